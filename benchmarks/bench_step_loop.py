"""The full jit-compiled step loop on the built-in hybrid model.

Serves synthetic requests with continuous batching and chunked prefill and
prints tokens/s and steps/s of the loop, compilations after warm-up (target 0),
and the step executables' temp memory over the pool size from
`memory_analysis()` (target <= 10%), with every pool aliased in place
(donated; temp alone would read the same without donation).

    python benchmarks/bench_step_loop.py --num-requests 16
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402


def run(args: Any) -> dict[str, Any]:
    buckets = tuple(int(b) for b in args.token_buckets.split(","))
    cfg = jaxkv.tiny_hybrid_config(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        kv_sharing_fast_prefill=not args.no_fast_prefill,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(buckets),
        max_model_len=args.max_model_len,
        token_buckets=buckets,
        request_buckets=(args.max_num_seqs,),
    )
    model = jaxkv.demo.TinyHybridModel(
        cfg, vocab_size=args.vocab_size, rngs=nnx.Rngs(0)
    )
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=args.num_blocks)
    warm_s = engine.warm_up()
    pool_bytes = sum(p.nbytes for p in engine.pools)
    analyses = [exe.memory_analysis() for exe in engine.programs.executables()]
    temps = [m.temp_size_in_bytes for m in analyses]
    # Temp alone reads the same with and without donation (an undonated pool
    # is a fresh output, not temp); the pools aliased in place say donation.
    donated = min(m.alias_size_in_bytes for m in analyses) / pool_bytes
    rng = np.random.default_rng(0)
    requests = [
        jaxkv.demo.EngineRequest(
            req_id=f"r{i}",
            prompt=rng.integers(
                1, args.vocab_size, int(rng.integers(8, args.max_prompt))
            ).tolist(),
            max_new_tokens=args.max_new_tokens,
            arrival_step=i,
        )
        for i in range(args.num_requests)
    ]
    with jaxkv.count_compilations() as compiles:
        t0 = time.perf_counter()
        steps, generated = engine.run(requests)
        seconds = time.perf_counter() - t0
    rows = [
        {
            "requests": args.num_requests,
            "steps": steps,
            "tokens": generated,
            "tokens/s": generated / seconds,
            "steps/s": steps / seconds,
            "compiles after warm-up": len(compiles),
            "max temp / pools": max(temps) / pool_bytes,
            "pools aliased": donated,
        }
    ]
    print_table(
        f"Step loop: built-in hybrid model, pools {pool_bytes / 2**20:.1f} MiB, "
        f"{len(engine.programs)} executables warmed up in {warm_s:.1f} s",
        rows,
    )
    print(
        f"\ncompilations after warm-up: {len(compiles)} (target 0); max temp over "
        f"pools: {max(temps) / pool_bytes:.1%} (target <= 10%), with {donated:.0%} "
        f"of the pools aliased in place in every step (target 100%: donated)"
    )
    return {
        "tokens_per_s": generated / seconds,
        "steps_per_s": steps / seconds,
        "steps": steps,
        "tokens": generated,
        "compiles_after_warm_up": len(compiles),
        "max_temp_over_pools": max(temps) / pool_bytes,
        "pools_aliased": donated,
        "pool_bytes": pool_bytes,
        "warm_up_s": warm_s,
        "executables": len(engine.programs),
        "fast_prefill_armed_steps": engine.counters["fast_prefill_armed"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("The jit-compiled step loop on the built-in hybrid model.")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--token-buckets", default="8,32,64")
    p.add_argument("--no-fast-prefill", action="store_true")
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_step_loop",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
