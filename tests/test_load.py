"""Load through the Scheduler (benchmarks/bench_load.py's workload): every good
request is served, every bad one rejected with a reason, all blocks given back,
and the bookkeeping drains (no live id, no kept hash; rejections bounded).
Time per step and memory are measured by the benchmark, never asserted here.
"""  # noqa: D205

import pytest

from jaxkv.sched._scheduler import MAX_REJECTED_KEPT
from tests.helpers import load_benchmark

pytestmark = pytest.mark.slow  # 4,500 requests (about 10 s): the slow pass


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-requests", "1000", "--bad-fraction", "0.05"],
        # Bursts above what a step serves: the queue grows, then drains.
        ["--num-requests", "600", "--per-step", "40", "--num-blocks", "128"],
    ],
)
def test_a_load_with_bad_requests_serves_every_good_one(argv):
    r = load_benchmark("bench_load").main(argv)
    assert r["good_served"] == r["good"] > 0
    assert r["bad_rejected"] == r["bad"] > 0
    assert r["wrong"] == 0
    assert r["blocks_free"]
    assert (r["live_ids"], r["hashes"]) == (0, 0)
    assert r["rejected_kept"] == min(r["bad"], MAX_REJECTED_KEPT)
