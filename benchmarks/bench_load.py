"""Load: many requests, some of them bad, through one Scheduler (host only).

20,000 requests arrive over time (``--per-step`` a step, below what a step
serves, so the queue stays level), 2% of them bad in
one of eight ways (empty, tuple-of-floats or nested prompts, ids outside the
vocabulary, ``max_new_tokens`` 0 or a bool, a prompt past ``max_model_len``,
a non-str salt); sampled tokens are drawn at random, some of them stop
tokens. Prefix caching is on (hashes are kept per live request only). The
script checks that every good request is served with its tokens, every bad one
is rejected with a reason, every block is given back, and prints, side by
side in one run, the time per step and the traced Python memory of the first
and last tenth of the run (targets: ratios <= 1.5, i.e. flat).

    python benchmarks/bench_load.py --num-requests 20000
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402

VOCAB = 1000
STOP = 7


def _bad_request(kind: int, i: int, rng: np.random.Generator) -> jaxkv.Request:
    """A request that can never be served, in one of eight ways."""
    good = rng.integers(0, VOCAB, 8).tolist()
    fields: dict[str, Any] = {"prompt": good, "max_new_tokens": 4}
    if kind == 0:
        fields["prompt"] = []
    elif kind == 1:
        fields["prompt"] = tuple(float(t) for t in good)
    elif kind == 2:
        fields["prompt"] = [good[:4], good[4:]]
    elif kind == 3:
        fields["prompt"] = [*good, VOCAB + 5]
    elif kind == 4:
        fields["max_new_tokens"] = 0
    elif kind == 5:
        fields["max_new_tokens"] = True
    elif kind == 6:
        fields["prompt"] = [1] * 600
    else:
        fields["cache_salt"] = 123
    return jaxkv.Request(f"bad{i}", **fields)


def run(args: Any) -> dict[str, Any]:
    cfg = jaxkv.tiny_hybrid_config(
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        token_buckets=(args.budget,),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=args.num_blocks)
    s = jaxkv.Scheduler(plan, vocab_size=VOCAB, enable_prefix_caching=True)
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, VOCAB, 64).tolist()  # a system prompt some share
    good: list[jaxkv.Request] = []
    bad: list[jaxkv.Request] = []
    for i in range(args.num_requests):
        if rng.random() < args.bad_fraction:
            bad.append(_bad_request(len(bad) % 8, i, rng))
            continue
        own = rng.integers(0, VOCAB, int(rng.integers(2, 40))).tolist()
        good.append(
            jaxkv.Request(
                f"r{i}",
                prompt=(shared if rng.random() < 0.5 else []) + own,
                max_new_tokens=int(rng.integers(1, 9)),
                stop_token_ids=(STOP,),
            )
        )
    arrivals: list[jaxkv.Request | None] = [*good, *bad]
    num_good, num_bad = len(good), len(bad)
    del good, bad  # from here the scheduler holds the live requests
    order = rng.permutation(len(arrivals))
    arrivals = [arrivals[i] for i in order]

    # Each request is checked as it leaves (rejected at arrival, or finished
    # by update()) and dropped, so traced memory is the scheduler's own.
    served = rejected = wrong = 0
    # Preallocated, so the measurement itself allocates nothing traced.
    limit = 20 * (len(arrivals) // args.per_step + 1) + 1000
    step_seconds = np.zeros(limit)
    memory = np.zeros(limit, np.int64)
    queued = np.zeros(limit, np.int64)
    tracemalloc.start()
    next_arrival = 0
    steps = 0
    while next_arrival < len(arrivals) or s.has_unfinished:
        t0 = time.perf_counter()
        for i in range(next_arrival, min(next_arrival + args.per_step, len(arrivals))):
            req = arrivals[i]
            arrivals[i] = None
            assert req is not None
            if not s.add_request(req):
                is_bad = req.req_id.startswith("bad")
                rejected += is_bad and bool(req.reject_reason)
                wrong += not is_bad
        next_arrival += args.per_step
        step = s.schedule()
        tokens = rng.integers(0, VOCAB, len(step.sampled))
        tokens[rng.random(len(tokens)) < 0.05] = STOP
        for r in s.update(step, tokens.tolist()):
            ok = 1 <= len(r.output) <= r.max_new_tokens and (
                len(r.output) == r.max_new_tokens or r.output[-1] == STOP
            )
            served += ok and r.status is jaxkv.RequestStatus.FINISHED
            wrong += not ok or r.req_id.startswith("bad")
        step_seconds[steps] = time.perf_counter() - t0
        memory[steps] = tracemalloc.get_traced_memory()[0]
        queued[steps] = len(s.waiting) + len(s.running)
        steps += 1
        if steps == limit:
            raise RuntimeError("the load did not drain")
    tracemalloc.stop()

    free = s.manager.num_free_blocks == s.manager.num_usable_blocks
    tenth = max(1, steps // 10)
    # The arrival phase only: the drain at the end runs nearly empty steps.
    busy = max(tenth + 1, len(arrivals) // args.per_step)
    first = float(np.median(step_seconds[:tenth]))
    last = float(np.median(step_seconds[busy - tenth : busy]))
    mem_first = float(np.median(memory[tenth : 2 * tenth]))
    mem_last = float(np.median(memory[busy - tenth : busy]))
    rows = [
        {
            "phase": "first tenth",
            "ms/step": first * 1e3,
            "traced MiB": mem_first / 2**20,
            "live requests": float(np.median(queued[tenth : 2 * tenth])),
        },
        {
            "phase": "last tenth (arrivals)",
            "ms/step": last * 1e3,
            "traced MiB": mem_last / 2**20,
            "live requests": float(np.median(queued[busy - tenth : busy])),
        },
    ]
    print_table(
        f"Load: {len(arrivals)} requests ({num_bad} bad), {args.per_step} arrive "
        f"per step, {steps} steps",
        rows,
    )
    print(
        f"\ngood served: {served}/{num_good}; bad rejected with a reason: "
        f"{rejected}/{num_bad}; wrongly rejected or served: {wrong}; blocks all "
        f"free: {free}; time per step last / "
        f"first: {last / first:.2f}x (target <= 1.5); memory last / first: "
        f"{mem_last / mem_first:.2f}x (target <= 1.5); rejected kept: "
        f"{len(s.rejected)} (bounded)"
    )
    return {
        "requests": len(arrivals),
        "bad": num_bad,
        "good_served": served,
        "good": num_good,
        "wrong": wrong,
        "bad_rejected": rejected,
        "blocks_free": free,
        "steps": steps,
        "time_ratio": last / first,
        "memory_ratio": mem_last / mem_first,
        "rejected_kept": len(s.rejected),
        "live_ids": len(s._ids),  # noqa: SLF001 - bookkeeping must drain
        "hashes": len(s.manager._hashes),  # noqa: SLF001
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Load: many requests, some bad, through one Scheduler.")
    p.add_argument("--num-requests", type=int, default=20000)
    p.add_argument("--bad-fraction", type=float, default=0.02)
    p.add_argument("--per-step", type=int, default=8)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_load",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
