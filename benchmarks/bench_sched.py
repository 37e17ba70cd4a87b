# pyright: reportMissingImports=false
"""Host cost of scheduling: microseconds per scheduled request per step.

Steady decoding of N running requests (prompts of --prompt tokens, half of
them sharing a --prefix-token prefix, block --block-size), each step
``Scheduler.schedule()`` + ``StepMetadataBuilder.prepare()`` +
``Scheduler.update()``, at N = 64, 256 and 1,024, with and without prefix
caching. Side by side in the same run:

* **baseline**: the least pure-Python/NumPy code doing the same bookkeeping
  for the same requests and steps (a free list, per-request block tables, a
  new block every ``block_size`` tokens, a SHA-256 per full block when
  caching, then the block-table, slot-mapping, position and query-start
  arrays), no validation, no preemption, no admission; the floor a
  hand-written loop would pay;
* **vLLM 0.32 KVCacheManager**, if importable: ``allocate_slots`` per
  running request per decode step, plus ``append_output_token_ids`` (its
  block hashing), over its real ``BlockPool``; vLLM's block manager alone,
  not its whole scheduler.

Also printed: the first and last third of the timed steps (flat in the steps
served), and the time in ``KVCacheManager.allocate`` against ``commit``.

    python benchmarks/bench_sched.py
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import numpy as np
from _harness import parser, print_table, write_json

import jaxkv


def _config(n: int, block_size: int, max_model_len: int) -> jaxkv.RunnerConfig:
    spec = jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    backend = jaxkv.get_backend("JAX_PAGED")
    return jaxkv.RunnerConfig(
        layers=tuple(
            jaxkv.LayerConfig(name=f"l{i}", spec=spec, backend=backend, num_heads=32)
            for i in range(2)
        ),
        max_model_len=max_model_len,
        max_num_seqs=n,
        max_num_batched_tokens=max(n, 2048),
        token_buckets=(max(n, 2048),),
        request_buckets=(n,),
    )


def _prompts(n: int, prompt: int, prefix: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 32000, prefix).tolist()
    return [
        (shared if i % 2 == 0 else rng.integers(0, 32000, prefix).tolist())
        + rng.integers(0, 32000, prompt - prefix).tolist()
        for i in range(n)
    ]


class _Timed:
    """Wraps a bound method, adding its seconds to a counter."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run_jaxkv(n: int, args: Any, caching: bool) -> dict[str, float]:
    """Per-step microseconds of schedule + prepare + update, N decoding."""
    steps = args.steps
    # Every prompt is prefilled in one untimed step, so every request then
    # decodes through the timed steps.
    total = args.prompt + 2 * steps + 32
    cfg = _config(n, args.block_size, total)
    per_req = -(-total // args.block_size)
    plan = jaxkv.make_plan(cfg, num_blocks=n * per_req + 2)
    builder = jaxkv.StepMetadataBuilder(plan)
    builder.warm_up_host()
    s = jaxkv.Scheduler(plan, enable_prefix_caching=caching)
    for i, p in enumerate(_prompts(n, args.prompt, args.prefix)):
        s.add_request(
            jaxkv.Request(f"r{i}", prompt=p, max_new_tokens=total - args.prompt)
        )
    budget = s.max_num_batched_tokens
    s.max_num_batched_tokens = n * args.prompt
    step = s.schedule()
    s.update(step, [1] * len(step.sampled))
    s.max_num_batched_tokens = budget
    assert len(s.running) == n
    m = s.manager
    alloc, commit = _Timed(m.allocate), _Timed(m.commit)
    m.allocate, m.commit = alloc, commit
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = s.schedule()
        builder.prepare(step)
        s.update(step, [7] * len(step.sampled))
        times.append(time.perf_counter() - t0)
        assert len(step.batch) == n
    third = max(1, steps // 3)
    return {
        "us_per_req": statistics.median(times) / n * 1e6,
        "first_third_us": statistics.median(times[:third]) / n * 1e6,
        "last_third_us": statistics.median(times[-third:]) / n * 1e6,
        "allocate_us": alloc.seconds / alloc.calls * 1e6,
        "commit_us": commit.seconds / commit.calls * 1e6,
        "cached_tokens": float(s.stats["cached_tokens"]),
    }


def run_baseline(n: int, args: Any, caching: bool) -> float:
    """The same steps' bookkeeping, hand-written: microseconds per request."""
    bs, steps = args.block_size, args.steps
    width = -(-(args.prompt + steps + 8) // bs)
    free = list(range(1, n * width + 2))
    tables = []
    lens = []
    tokens = []
    hashes: list[list[bytes]] = []
    for p in _prompts(n, args.prompt, args.prefix):
        k = -(-len(p) // bs)
        tables.append([free.pop() for _ in range(k)])
        lens.append(len(p))
        tokens.append(list(p))
        hashes.append([])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        bt = np.zeros((n, width), np.int32)
        slots = np.empty(n, np.int32)
        pos = np.asarray(lens, np.int32)
        for r in range(n):
            if lens[r] % bs == 0:
                tables[r].append(free.pop())
            bt[r, : len(tables[r])] = tables[r]
            slots[r] = tables[r][lens[r] // bs] * bs + lens[r] % bs
        qsl = np.arange(n + 1, dtype=np.int32)
        seq = pos + 1
        for r in range(n):
            lens[r] += 1
            tokens[r].append(7)
            if caching and lens[r] % bs == 0:
                parent = hashes[r][-1] if hashes[r] else b""
                block = np.asarray(tokens[r][-bs:], np.int64).tobytes()
                hashes[r].append(hashlib.sha256(parent + block).digest())
        del bt, slots, qsl, seq
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def run_vllm(n: int, args: Any, caching: bool) -> float | None:
    """vLLM 0.32's KVCacheManager over the same decode steps, if importable."""
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.request import Request
    except Exception:  # noqa: BLE001 - any import failure: not installed here
        return None
    bs, steps = args.block_size, args.steps
    init_none_hash(sha256)
    spec = FullAttentionSpec(bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    width = -(-(args.prompt + steps + 8) // bs)
    num_blocks = n * width + 2
    page = spec.page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * page * 2,
                layers=["l0", "l1"],
                layer_stride=page,
                block_stride=2 * page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
    )
    m = KVCacheManager(
        cfg,
        max_model_len=args.prompt + steps + 8,
        scheduler_block_size=bs,
        hash_block_size=bs,
        enable_caching=caching,
    )
    hasher = get_request_block_hasher(bs, sha256) if caching else None
    reqs = []
    for i, p in enumerate(_prompts(n, args.prompt, args.prefix)):
        r = Request(f"r{i}", p, SamplingParams(max_tokens=steps + 4), None,
                    block_hasher=hasher)  # fmt: skip
        blocks, hit, _ = m.get_computed_blocks(r)
        assert m.allocate_slots(
            r, len(p) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
        )
        r.num_computed_tokens = len(p)
        r.append_output_token_ids(1)
        reqs.append(r)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        m.new_step_starts()
        for r in reqs:
            assert m.allocate_slots(r, 1) is not None
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the results."""
    p = parser((__doc__ or "").split("\n")[0])
    p.add_argument("--running", default="64,256,1024")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args(argv)
    rows, results = [], {}
    for n in [int(x) for x in args.running.split(",")]:
        for caching in (False, True):
            ours = run_jaxkv(n, args, caching)
            base = run_baseline(n, args, caching)
            vllm = run_vllm(n, args, caching)
            key = f"{n}{'_cached' if caching else ''}"
            results[key] = {**ours, "baseline_us": base, "vllm_manager_us": vllm}
            rows.append(
                {
                    "running": n,
                    "prefix caching": caching,
                    "jaxkv us/req": ours["us_per_req"],
                    "baseline us/req": base,
                    "jaxkv/baseline": ours["us_per_req"] / base,
                    "vLLM mgr us/req": "-" if vllm is None else vllm,
                    "first/last third": ours["first_third_us"] / ours["last_third_us"],
                    "allocate us": ours["allocate_us"],
                    "commit us": ours["commit_us"],
                }
            )
    print_table(
        "Scheduler + manager + prepare per decoding request per step "
        "(target: commit <= allocate; flat in steps; vLLM manager column where "
        "vLLM is importable)",
        rows,
    )
    write_json(args.json, "bench_sched", {"results": results})
    return results


if __name__ == "__main__":
    main()
