"""Every benchmark script runs at tiny sizes, so none rots.

Marked slow: CI runs them once, in its slow pass (``pytest -m slow``); the
default test command and the 64-bit pass leave them out.
"""

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import BENCHMARKS, load_benchmark

pytestmark = pytest.mark.slow  # CI's slow pass, once per run


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("bench_kv_write", ["--pool-mib", "2", "--tokens", "8", "--iters", "2"]),
        (
            "bench_scaling",
            "--requests 2 --contexts 32 --pool-mib 1,4 --num-reqs 2 "
            "--context 32 --head-dim 16 --iters 1".split(),
        ),
        (
            "bench_attention",
            "--num-reqs 4 --context 64 --head-dim 16 --iters 2".split(),
        ),
        (
            "bench_step_loop",
            "--num-requests 2 --max-new-tokens 2 --max-prompt 12 "
            "--num-blocks 64 --token-buckets 32 --iters 1".split(),
        ),
        ("bench_layer_scan", "--layers 3 --tokens 32".split()),
        (
            "bench_sizing",
            "--layers 2 --tokens 32 --quick --memory-gib 0.5 --grow-from 16".split(),
        ),
        ("kernel_report", ["--quick"]),
        ("bench_quant", "--batch 2 --context 32 --iters 1 --no-model".split()),
        ("bench_serve", "--batch 2 --prompt 8 --new 4 --layers 1 --iters 2".split()),
        ("bench_spec", "--batch 2 --prompt 8 --new 6 --layers 1 --k 2".split()),
        (
            "bench_offload",
            "--prefixes 3 --prefix 32 --suffix 4 --per-prefix 1 --new 2 --rounds 2 "
            "--device-blocks 6 --host-blocks 32 --layers 1 --iters 1".split(),
        ),
        (
            "bench_sched",
            "--running 4 --prompt 24 --prefix 8 --steps 3".split(),
        ),
        (
            "bench_trace",
            "--synthetic 60 --capacity-tokens 8192,65536 --max-output 4".split(),
        ),
        ("bench_free_time", ["--traces", "12"]),
        (
            "bench_prefix",
            "--num-requests 3 --prefix 64 --suffix 4 --max-new-tokens 2 "
            "--token-buckets 64 --num-blocks 64 --iters 1".split(),
        ),
        (
            "bench_step_metadata",
            [
                "--num-reqs",
                "8",
                "--num-prefills",
                "2",
                "--chunk",
                "4",
                "--max-tokens",
                "64",
                "--max-model-len",
                "256",
                "--iters",
                "2",
            ],
        ),
    ],
)
def test_benchmark_runs_at_tiny_size(name, argv, tmp_path, capsys):
    results = load_benchmark(name).main([*argv, "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())
    assert "target" in capsys.readouterr().out
    FIGURES[name](results)


def _positive(*values):
    return all(math.isfinite(v) and v > 0 for v in values)


def _kv_write(r):
    for dtype in ("bfloat16", "float8_e4m3fn"):
        d = r[dtype]
        assert d["pool_bytes"] >= 2 * 2**20  # --pool-mib 2
        assert _positive(d["jaxkv_ms"], d["numpy_ms"], d["step"]["ratio"])
        assert d["ratio"] == pytest.approx(d["jaxkv_ms"] / d["numpy_ms"])


def _scaling(r):
    sizes = [p["pool_MiB"] for p in r["pool"]]
    assert len(sizes) == 2
    assert sizes[0] < sizes[1]
    assert r["write_spread"] >= 1
    assert r["read_spread"] >= 1


def _attention(r):
    assert r["typed_equals_words"]
    assert r["lhbnc_equals_words"]
    assert _positive(r["lhbnc_ms"])
    assert _positive(r["copy_ms"], r["jaxkv_ms"])
    assert r["jaxkv_over_copy"] == pytest.approx(r["jaxkv_ms"] / r["copy_ms"])
    if "decode_max_abs_diff" in r:  # ejkernel ran (head_dim 16 it refuses)
        assert r["decode_max_abs_diff"] < 1e-4


def _kernel_report(r):
    rows = r["tpu"]
    assert {row["chip"] for row in rows} == {"v5e", "v6e"}
    for row in rows:
        assert row["compiled"] == "yes" or row["compiled"].startswith("not tried")
        assert 0 < row["est. % of HBM"] <= 100
        assert row["no-overlap bound %"] <= row["est. % of HBM"] + 1e-9
        assert row["KiB/wave"] >= 256
    for row in r["gpu"]:  # empty without triton (the gpu-compile extra)
        assert row["spill bytes"] == 0
        assert row.get("mma", 1) > 0  # attention rows (the write has none)
        assert 0 < row["est. % of copy"] <= 100
    assert r["gpu_target_met"] in (True, None)


def _step_loop(r):
    assert r["compiles_after_warm_up"] == 0
    assert r["pools_aliased"] == 1.0  # every step donates every pool
    assert r["tokens"] == 2 * 2  # 2 requests x 2 new tokens


def _layer_scan(r):
    assert r["scan_equals_unrolled"]


def _quant(r):
    rows = {(row["implementation"], row["mode"]): row for row in r["rows"]}
    assert rows["xla", "int8_per_token_head"]["blocks_vs_bf16"] == pytest.approx(
        1.939, 1e-3
    )
    assert rows["xla", "fp8_per_tensor"]["blocks_vs_bf16"] == 2
    assert rows["xla", "int8_per_token_head"]["max_abs_err"] < 0.05
    # The native kernel (where a compiler is found) reads what XLA's path
    # reads: the same error against the float32 cache.
    for (implementation, mode), row in rows.items():
        xla = rows["xla", mode]
        assert row["max_abs_err"] == pytest.approx(xla["max_abs_err"], abs=1e-4)
        assert implementation in ("xla", "native")


def _sizing(r):
    (row,) = r["rows"]
    assert row["compiles"] >= 3
    assert row["blocks"] >= 2
    assert row["fixed_GiB"] > row["weights_GiB"] > 0  # the step holds more
    assert row["blocks"] < row["weights_only_blocks"]
    grow = r["grow"]
    assert grow["to_blocks"] == 2 * grow["from_blocks"]
    assert grow["moved_blocks"] > 0
    assert grow["move_s"] > 0


def _spec(r):
    rows = {row["loop"]: row for row in r["rows"]}
    assert all(row["same tokens"] for row in rows.values())
    assert all(row["compiles"] == 0 for row in rows.values())
    oracle = rows["oracle k=2"]
    assert oracle["accepted"] == 1.0  # every draft is the plain run's token
    assert oracle["steps"] < rows["plain"]["steps"]


def _serve(r):
    assert r["same_tokens"]
    assert r["compiles"] == 0
    assert r["device_ms"] > 0
    assert r["multi_device_ms"] > 0
    # Without overlap every dispatch comes after the previous tokens were
    # read: it finds the device idle (a multi-step loop's first block has no
    # recorded predecessor).
    assert r["found_idle_no_overlap"] == r["dispatches"] > 0
    assert r["multi_no_overlap_found_idle"] == r["multi_dispatches"] - 1
    assert 0 <= r["multi_found_idle"] <= r["multi_dispatches"]


def _sched(r):
    assert _positive(r["4"]["us_per_req"], r["4_cached"]["us_per_req"])


def _prefix(r):
    assert r["identical"]
    cached, uncached = r["cached"], r["uncached"]
    assert cached["tokens from the cache"] > 0
    assert (
        cached["prompt tokens computed"] + cached["tokens from the cache"]
        == uncached["prompt tokens computed"]
    )
    assert cached["compiles"] == uncached["compiles"] == 0


def _offload(r):
    assert r["identical"]
    modes = r["modes"]
    dev, host = modes["device prefix cache only"], modes["device + host tier"]
    assert r["tokens_saved"] > 0
    assert host["prompt tokens computed"] < dev["prompt tokens computed"]
    assert host["blocks back"] > 0
    assert all(m["compiles"] == 0 for m in modes.values())


def _trace(r):
    runs = {(x["side"], x["block_size"], x["capacity_tokens"]): x for x in r["runs"]}
    manager = "jaxkv KVCacheManager"
    small, large = runs[manager, 16, 8192], runs[manager, 16, 65536]
    assert 0 < small["hit_ratio"] <= large["hit_ratio"] < 1
    # The Scheduler and the bare manager under the same policy hit alike.
    for (side, bs, cap), run in runs.items():
        if side.startswith("jaxkv Scheduler"):
            assert run["hit_ratio"] == runs[manager, bs, cap]["hit_ratio"]
    assert r["lookup"]["lookups"] == 1  # an empty cache: the first block misses
    assert r["lookup"]["lookups_unchanged"] == 0


def _free_time(r):
    assert set(r) == {"swa/chunk", "swa/full", "mamba/chunk", "mamba/full"}
    for row in r.values():
        assert row["allocate"]["computed"] > 0
        assert row["commit"]["computed"] > 0


def _step_metadata(r):
    assert r["executables"] >= 1
    assert _positive(r["packed_ms"], r["naive_ms"], r["kernel_ms"])


FIGURES = {
    "bench_kv_write": _kv_write,
    "bench_scaling": _scaling,
    "bench_attention": _attention,
    "bench_step_loop": _step_loop,
    "bench_layer_scan": _layer_scan,
    "bench_sizing": _sizing,
    "bench_quant": _quant,
    "kernel_report": _kernel_report,
    "bench_serve": _serve,
    "bench_spec": _spec,
    "bench_sched": _sched,
    "bench_prefix": _prefix,
    "bench_trace": _trace,
    "bench_free_time": _free_time,
    "bench_offload": _offload,
    "bench_step_metadata": _step_metadata,
}


def test_run_all_writes_results(tmp_path, monkeypatch):
    run_all = load_benchmark("run_all")
    monkeypatch.setattr(
        run_all,
        "QUICK",
        {
            "attention": "--num-reqs 2 --context 32 --head-dim 16 --iters 1".split(),
            "kv_write": "--pool-mib 1 --tokens 4 --iters 1".split(),
            "step_loop": "--num-requests 1 --max-new-tokens 1 --max-prompt 10 "
            "--num-blocks 64 --token-buckets 8,32".split(),
            "step_metadata": "--num-reqs 4 --num-prefills 1 --chunk 2 --max-tokens 64 "
            "--max-model-len 128 --iters 1".split(),
            "prefix": "--num-requests 2 --prefix 64 --suffix 4 --max-new-tokens 1 "
            "--token-buckets 64 --num-blocks 64 --iters 1".split(),
            "scaling": "--requests 2 --contexts 32 --pool-mib 1,4 --num-reqs 2 "
            "--context 32 "
            "--head-dim 16 --iters 1".split(),
            "layer_scan": "--layers 3 --tokens 32".split(),
            "load": "--num-requests 200".split(),
            "serve": "--batch 2 --prompt 8 --new 4 --layers 1 --iters 2".split(),
        },
    )
    assert run_all.main(["--quick", "--out", str(tmp_path / "RESULTS.md")]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| Compilations after warm-up | 0 | 0 |" in text
    assert "Load: " in text


def test_mesh_benchmark_runs_at_tiny_size(tmp_path):
    """In a subprocess: it simulates its own CPU devices before JAX starts."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_mesh.py"),
            *"--meshes 1x2 --num-requests 2 --max-new-tokens 2 --iters 1".split(),
            *"--token-buckets 64 --num-blocks 32 --max-prompt 8".split(),
            "--json",
            str(tmp_path / "mesh.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    results = json.loads((tmp_path / "mesh.json").read_text())["results"]
    assert results["1x2"]["pools_mib"] == results["single"]["pools_mib"] / 2
    assert results["1x2"]["same_tokens"]
