"""Prefix caching on a shared-prefix workload: the built-in hybrid model.

Many requests share a long prompt prefix (a system prompt) followed by their
own suffix. The same requests are served twice by one warmed-up Engine, with
and without prefix caching (compilation excluded on both sides: every bucket
is compiled before either run), and the script prints the prompt tokens each
run computed, the fraction saved (target >= 80% for 32 requests sharing 256
tokens), tokens/s of both runs and their ratio, and whether the outputs are
identical (target: identical).

    python benchmarks/bench_prefix.py --num-requests 32 --prefix 256
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
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(buckets),
        max_model_len=args.prefix + args.suffix + args.max_new_tokens,
        token_buckets=buckets,
        request_buckets=(args.max_num_seqs,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=256, rngs=nnx.Rngs(0))
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=args.num_blocks)
    warm_s = engine.warm_up()
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, args.prefix).tolist()
    prompts = [
        prefix + rng.integers(0, 256, args.suffix).tolist()
        for _ in range(args.num_requests)
    ]

    def serve(cached: bool) -> tuple[list[list[int]], dict[str, Any]]:
        engine.reset(scheduling=jaxkv.SchedulingOptions(enable_prefix_caching=cached))
        requests = [
            jaxkv.demo.EngineRequest(
                f"r{i}", prompt=p, max_new_tokens=args.max_new_tokens
            )
            for i, p in enumerate(prompts)
        ]
        with jaxkv.count_compilations() as compiles:
            t0 = time.perf_counter()
            steps, generated = engine.run(requests)
            seconds = time.perf_counter() - t0
        stats = engine.stats
        return [r.output for r in requests], {
            "prefix caching": "on" if cached else "off",
            "steps": steps,
            "prompt tokens computed": stats["prefill_tokens"],
            "tokens from the cache": stats["cached_tokens"],
            "seconds": seconds,
            "tokens/s": generated / seconds,
            "compiles": len(compiles),
        }

    serve(False)  # a first pass touches every host path once
    base_out, base = serve(False)
    cached_out, cached = serve(True)
    saved = 1 - cached["prompt tokens computed"] / base["prompt tokens computed"]
    speedup = cached["tokens/s"] / base["tokens/s"]
    print_table(
        f"Shared prefix: {args.num_requests} requests x ({args.prefix} shared + "
        f"{args.suffix} own) prompt tokens, {args.max_new_tokens} new; "
        f"{len(engine.programs)} executables warmed up in {warm_s:.1f} s",
        [base, cached],
    )
    print(
        f"\nprompt tokens saved: {saved:.1%} (target >= 80%); tokens/s cached / "
        f"uncached: {speedup:.2f}x; outputs identical: {cached_out == base_out} "
        "(target identical)"
    )
    return {
        "saved_fraction": saved,
        "speedup": speedup,
        "identical": cached_out == base_out,
        "uncached": base,
        "cached": cached,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Prefix caching on a shared-prefix workload.")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--token-buckets", default="8,64,256")
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_prefix",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
