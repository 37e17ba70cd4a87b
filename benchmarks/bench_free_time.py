"""When to free blocks no later query reads: right after the step, or at the
request's next allocation (vLLM's time).

Window blocks a query no longer sees and Mamba states before the last are
freed either at ``commit`` (``KVCacheManager(free_skipped_at="commit")``) or
at the request's next ``allocate`` (``"allocate"``, the default, vLLM's
``remove_skipped_blocks`` inside ``allocate_slots``). Both are run by jaxkv's
``Scheduler`` with prefix caching over the seeded hybrid traces of
``benchmarks/vllm_parity.py`` (block 4; full + sliding window 6, full +
Mamba; shared prefixes, small pools that evict and preempt), with
first-chunk and full-prompt admission. Printed per mode: prompt tokens
taken from the prefix cache (higher is better), prompt tokens computed
(lower is better: recomputation after preemption included) and preemptions.
Target: the default keeps at least as many hit tokens and computes no more.

    python benchmarks/bench_free_time.py --traces 300
"""  # noqa: D205

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402
from vllm_parity import _jaxkv_plan  # noqa: E402

import jaxkv  # noqa: E402


def run_trace(seed: int, kind: str, mode: str, reserve: bool) -> dict[str, int]:
    """One seeded trace (``vllm_parity``'s requests) through the Scheduler."""
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(8, 24))
    budget = int(rng.integers(6, 17))
    s = jaxkv.Scheduler(
        _jaxkv_plan(kind, num_blocks, 64),
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
        scheduler_reserve_full_isl=reserve,
    )
    s.manager.free_skipped_at = mode
    prefixes = [[int(t) for t in rng.integers(0, 40, 16)] for _ in range(3)]
    for i in range(int(rng.integers(6, 16))):
        p = prefixes[int(rng.integers(3))][: int(rng.integers(1, 17))]
        p = p + [int(t) for t in rng.integers(0, 40, int(rng.integers(0, 6)))]
        s.add_request(
            jaxkv.Request(
                f"q{i}", prompt=p or [1], max_new_tokens=int(rng.integers(1, 6))
            )
        )
    for _ in range(400):
        if not s.has_unfinished:
            break
        step = s.schedule()
        s.update(step, [int(t) for t in rng.integers(0, 40, len(step.sampled))])
    return {
        "hit": s.stats["cached_tokens"],
        "computed": s.stats["prefill_tokens"],
        "preemptions": s.stats["preemptions"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser((__doc__ or "").split("\n")[0])
    ap.add_argument("--traces", type=int, default=300)
    args = ap.parse_args(argv)
    rows, out = [], {}
    for kind in ("swa", "mamba"):
        for reserve in (False, True):
            sums = {}
            for mode in ("commit", "allocate"):
                tot = {"hit": 0, "computed": 0, "preemptions": 0}
                for seed in range(args.traces):
                    for k, v in run_trace(seed, kind, mode, reserve).items():
                        tot[k] += v
                sums[mode] = tot
                rows.append(
                    {
                        "model": f"full + {kind}",
                        "admission": "full prompt" if reserve else "first chunk",
                        "free at": mode,
                        "hit tokens": tot["hit"],
                        "prompt tokens computed": tot["computed"],
                        "preemptions": tot["preemptions"],
                    }
                )
            key = f"{kind}/{'full' if reserve else 'chunk'}"
            out[key] = sums
            late, early = sums["allocate"], sums["commit"]
            out[key]["met"] = (
                late["hit"] >= early["hit"] and late["computed"] <= early["computed"]
            )
    print_table(f"{args.traces} seeded traces per row", rows)
    met = all(v["met"] for v in out.values())
    print(
        "target: freeing at the next allocation keeps >= hit tokens and computes "
        f"<= prompt tokens: {'met' if met else 'NOT met'}"
    )
    write_json(args.json, "bench_free_time", out)
    return out


if __name__ == "__main__":
    main()
