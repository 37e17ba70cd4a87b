"""Host offload: shared prefixes that fit the host but not the device.

One small GQA decoder (``--layers`` attention layers, random weights) served
by one warmed-up ``jaxkv.ServingLoop`` with prefix caching, three ways, the
same requests in the same order, compilation excluded on all three (the copy
programs compiled by ``warm_up`` too):

* **no prefix caching**: every prompt token computed;
* **device prefix cache only**: ``--device-blocks`` blocks, too few to keep
  every prefix: by the time a prefix comes back it was evicted;
* **device + host tier** (``host_blocks=--host-blocks``): the evicted blocks
  were copied to ``pinned_host`` memory and are copied back on the hit.

The workload: ``--prefixes`` distinct prefixes of ``--prefix`` tokens; in each
of ``--rounds`` rounds, each prefix is served to ``--per-prefix`` requests at
once (own suffix of ``--suffix`` tokens, ``--new`` new tokens), one prefix
after another. Prints prompt tokens computed, tokens from the cache, blocks
and bytes copied each way, seconds per workload and ms per step, the host
time spent dispatching the copies (``HostKVCache.flush``), and whether
the outputs are identical (target: the host tier computes fewer prompt tokens
than the device cache alone, identical outputs, 0 compilations while serving).

    python benchmarks/bench_offload.py --prefixes 8 --prefix 256
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    GQA_VOCAB,
    gqa_forward,
    gqa_params,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402

VOCAB = GQA_VOCAB


def _workload(args: Any) -> list[list[jaxkv.Request]]:
    """Per run call, the requests of one prefix (fresh Request objects)."""
    rng = np.random.default_rng(0)
    prefixes = [
        rng.integers(0, VOCAB, args.prefix).tolist() for _ in range(args.prefixes)
    ]
    out = []
    for rnd in range(args.rounds):
        for i, p in enumerate(prefixes):
            out.append(
                [
                    jaxkv.Request(
                        f"p{i}.r{rnd}.{j}",
                        prompt=p + rng.integers(0, VOCAB, args.suffix).tolist(),
                        max_new_tokens=args.new,
                    )
                    for j in range(args.per_prefix)
                ]
            )
    return out


def run(args: Any) -> dict[str, Any]:
    heads, kv_heads, head, block = args.heads, args.kv_heads, args.head, 16
    max_len = args.prefix + args.suffix + args.new
    tokens = args.per_prefix * (args.prefix + args.suffix)
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        block_size=block,
        max_model_len=max_len,
        max_num_seqs=args.per_prefix,
        max_num_batched_tokens=tokens,
        # Prefill buckets fine enough that a chunk with its prefix restored
        # runs a smaller program (one bucket would hide what is saved).
        token_buckets=tuple(
            sorted({args.per_prefix, *(b for b in (32, 64, 128, 256) if b < tokens)})
        )
        + (tokens,),
    )
    per_request = -(-max_len // block)
    need = args.per_prefix * per_request + 1
    if args.device_blocks < need:
        raise SystemExit(f"--device-blocks must be >= {need} (one prefix's batch)")
    plan = jaxkv.make_plan(cfg, num_blocks=args.device_blocks)
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]
    params = gqa_params(args.layers, heads, kv_heads, head)
    scale = head**-0.5

    forward = gqa_forward(layers, scale)

    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        scheduling=jaxkv.SchedulingOptions(
            enable_prefix_caching=True, host_blocks=args.host_blocks
        ),
    )
    warm_s = loop.warm_up()  # the step's buckets and the copy programs

    modes = {
        "no prefix caching": {},
        "device prefix cache only": {"enable_prefix_caching": True},
        "device + host tier": {
            "enable_prefix_caching": True,
            "host_blocks": args.host_blocks,
        },
    }
    # The host time the copies take (recording them is the manager's, inside
    # the step's scheduling): flush dispatches them, asynchronously.
    flush = jaxkv.sched.HostKVCache.flush
    in_flush = [0.0]

    def timed_flush(self: Any, pools: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return flush(self, pools)
        finally:
            in_flush[0] += time.perf_counter() - t0

    jaxkv.sched.HostKVCache.flush = timed_flush
    rows, results, outputs = [], {}, {}
    for name, kwargs in modes.items():
        walls, flushes, stats, host_stats, compiles = [], [], {}, {}, 0
        for _ in range(args.iters):
            loop.reset(scheduling=jaxkv.SchedulingOptions(**kwargs))
            in_flush[0] = 0.0
            served = []
            with jaxkv.count_compilations() as compiled:
                t0 = time.perf_counter()
                for batch in _workload(args):
                    served += loop.run(batch)
                walls.append(time.perf_counter() - t0)
            flushes.append(in_flush[0])
            compiles += len(compiled)
            stats = dict(loop.scheduler.stats)
            host_stats = dict(loop.host.stats) if loop.host is not None else {}
            outputs[name] = {r.req_id: r.output for r in served}
        wall = statistics.median(walls)
        row = {
            "mode": name,
            "prompt tokens computed": stats["prefill_tokens"],
            "tokens from the cache": stats["cached_tokens"],
            "blocks to host": host_stats.get("offloaded_blocks", 0),
            "blocks back": host_stats.get("restored_blocks", 0),
            "MiB to host": host_stats.get("bytes_to_host", 0) / 2**20,
            "MiB back": host_stats.get("bytes_to_device", 0) / 2**20,
            "s/workload": wall,
            "ms/step": wall / stats["steps"] * 1e3,
            "flush ms": statistics.median(flushes) * 1e3,
        }
        rows.append(row)
        results[name] = row | {"compiles": compiles, "steps": stats["steps"]}
    jaxkv.sched.HostKVCache.flush = flush
    identical = all(o == outputs["no prefix caching"] for o in outputs.values())
    plain, dev, host = (results[m] for m in modes)
    print_table(
        f"{args.prefixes} prefixes x {args.prefix} tokens, {args.per_prefix} "
        f"requests each (+{args.suffix} own, {args.new} new), {args.rounds} rounds; "
        f"{args.device_blocks} device blocks of {block}, {args.host_blocks} host "
        f"blocks; {args.layers} layers {heads}/{kv_heads} heads x {head}; warm-up "
        f"{warm_s:.1f} s",
        rows,
    )
    saved = dev["prompt tokens computed"] - host["prompt tokens computed"]
    print(
        f"\nhost tier: {saved} fewer prompt tokens computed than the device cache "
        f"alone ({host['prompt tokens computed']} vs {dev['prompt tokens computed']}"
        f"; {plain['prompt tokens computed']} without caching; target: fewer, "
        "identical outputs), "
        f"{host['MiB to host']:.2f} MiB to host and {host['MiB back']:.2f} MiB back "
        f"({host['flush ms']:.1f} ms of host time in flush); "
        f"workload time host tier / device only: "
        f"{host['s/workload'] / dev['s/workload']:.2f}x; identical outputs: "
        f"{identical}; compiles while serving: "
        f"{sum(r['compiles'] for r in results.values())}"
    )
    return {"modes": results, "identical": identical, "tokens_saved": saved}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Host offload of prefix-cache blocks: tokens saved, bytes, time.")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--per-prefix", type=int, default=2)
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device-blocks", type=int, default=72)
    p.add_argument("--host-blocks", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head", type=int, default=32)
    p.set_defaults(iters=3)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_offload",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
