"""Every benchmark script runs at tiny sizes, so none rots.

Marked slow: CI runs them once, in its slow pass (``pytest -m slow``); the
default test command and the 64-bit pass leave them out.
"""

import json
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
            "--requests 2 --contexts 32 --pool-mib 1 --num-reqs 2 "
            "--context 32 --head-dim 16 --iters 1".split(),
        ),
        (
            "bench_attention",
            "--num-reqs 4 --context 64 --head-dim 16 --iters 2".split(),
        ),
        (
            "bench_step_loop",
            "--num-requests 2 --max-new-tokens 2 --max-prompt 12 "
            "--num-blocks 64 --token-buckets 8,32 --iters 1".split(),
        ),
        ("bench_layer_scan", "--layers 3 --tokens 32".split()),
        ("bench_serve", "--batch 2 --prompt 8 --new 4 --layers 1 --iters 2".split()),
        (
            "bench_sched",
            "--running 4 --prompt 24 --prefix 8 --steps 3".split(),
        ),
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
    assert results
    assert (tmp_path / "out.json").exists()
    assert "target" in capsys.readouterr().out


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
            "scaling": "--requests 2 --contexts 32 --pool-mib 1 --num-reqs 2 "
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
