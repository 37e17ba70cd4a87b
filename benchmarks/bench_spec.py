"""Speculative decoding inside ``jaxkv.ServingLoop``: time per token and acceptance.

One small GQA decoder (``--layers`` attention layers, random weights, greedy),
one batch of requests, served four ways by loops of the same plan, compilation
excluded (each loop is warmed up, then timed over a second identical run):

* **plain**: no drafter, ``overlap=False`` and ``overlap=True``;
* **ngram**: ``ExecutionOptions(drafter=NgramDrafter(k))`` (vLLM's prompt
  lookup): what an integrator gets without a draft model;
* **oracle**: a drafter that proposes the plain run's own next tokens (every
  draft accepted): the upper bound of any draft model at this ``k``, with the
  drafter's own cost at zero.

Prints per loop: ms per generated token, steps, acceptance rate and mean
acceptance length (vLLM's ``SpecDecodingStats``), and whether the tokens equal
the plain loop's (they must). On a CPU the step's cost grows with its tokens,
so the gain is the host and dispatch time of the steps saved; on an
accelerator a decode step of ``1 + k`` tokens per request costs about what
one token does.

    python benchmarks/bench_spec.py --batch 8 --new 64 --k 3
"""

from __future__ import annotations

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


def _requests(args: Any) -> list[jaxkv.Request]:
    rng = np.random.default_rng(0)
    # Prompts that repeat a phrase: what prompt lookup is for.
    return [
        jaxkv.Request(
            f"r{i}",
            prompt=(rng.integers(0, GQA_VOCAB, 8).tolist() * args.prompt)[
                : args.prompt
            ],
            max_new_tokens=args.new,
        )
        for i in range(args.batch)
    ]


class _Oracle:
    """Drafts the plain run's next tokens (set once the plain run is done)."""

    def __init__(self, k: int) -> None:
        self.num_speculative_tokens = k
        self.outputs: dict[str, list[int]] = {}

    def __call__(self, requests: Any) -> list[list[int]]:
        out = []
        for r in requests:
            want = self.outputs.get(r.req_id, [])
            n = len(r.output)
            out.append(want[n : n + self.num_speculative_tokens])
        return out


def _timed(loop: jaxkv.ServingLoop, args: Any) -> dict[str, Any]:
    """Warms `loop` up, then times a run of the batch (the second run)."""
    loop.warm_up()
    loop.run(_requests(args))  # every program met once
    loop.reset()
    reqs = _requests(args)
    with jaxkv.count_compilations() as compiles:
        t0 = time.perf_counter()
        loop.run(reqs)
        wall = time.perf_counter() - t0
    stats = loop.scheduler.make_stats()
    spec = stats.spec_decoding_stats
    return {
        "outputs": {r.req_id: r.output for r in reqs},
        "ms_per_token": 1e3 * wall / sum(len(r.output) for r in reqs),
        "steps": stats.num_steps,
        "acceptance": spec.acceptance_rate,
        "mean_accept_len": spec.mean_acceptance_length,
        "compiles": len(compiles),
    }


def run(args: Any) -> dict[str, Any]:
    k = args.k
    max_len = args.prompt + args.new
    buckets = sorted({args.batch, args.batch * (1 + k), args.batch * args.prompt})
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_size=args.head,
        block_size=16,
        max_model_len=max_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=buckets[-1],
        token_buckets=tuple(buckets),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=args.batch * (-(-max_len // 16) + 1) + 2)
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]
    params = gqa_params(args.layers, args.heads, args.kv_heads, args.head)
    forward = gqa_forward(layers, args.head**-0.5)

    def loop(**execution: Any) -> jaxkv.ServingLoop:
        return jaxkv.ServingLoop(
            plan,
            forward,
            params,
            vocab_size=GQA_VOCAB,
            execution=jaxkv.ExecutionOptions(**execution),
        )

    results: dict[str, dict[str, Any]] = {}
    results["plain"] = _timed(loop(overlap=False), args)
    results["plain, overlap"] = _timed(loop(overlap=True), args)
    ngram = jaxkv.serve.NgramDrafter(num_speculative_tokens=k)
    results[f"ngram k={k}"] = _timed(loop(drafter=ngram), args)
    oracle = _Oracle(k)
    oracle.outputs = results["plain"]["outputs"]
    results[f"oracle k={k}"] = _timed(loop(drafter=oracle), args)
    base = results["plain"]
    rows = [
        {
            "loop": name,
            "ms/token": r["ms_per_token"],
            "vs plain": r["ms_per_token"] / base["ms_per_token"],
            "steps": r["steps"],
            "accepted": r["acceptance"],
            "tokens/verify": r["mean_accept_len"],
            "same tokens": r["outputs"] == base["outputs"],
            "compiles": r["compiles"],
        }
        for name, r in results.items()
    ]
    print_table(
        f"speculative decoding: batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens, {args.layers} layers",
        rows,
    )
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    oracle_ratio = results[f"oracle k={k}"]["ms_per_token"] / base["ms_per_token"]
    print(
        f"\ntokens equal the plain loop's in every mode (target: yes): "
        f"{'yes' if same else 'NO'}; every draft accepted (oracle k={k}): "
        f"{oracle_ratio:.2f}x the plain loop's time per token (target < 1x: "
        f"{'met' if oracle_ratio < 1 else 'not met'})"
    )
    return {"rows": rows, "same_tokens": same, "oracle_over_plain": oracle_ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(str(__doc__).splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head", type=int, default=32)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = p.parse_args(argv)
    out = run(args)
    write_json(args.json, "bench_spec", out)
    return out


if __name__ == "__main__":
    main()
