"""Runs every benchmark and writes benchmarks/RESULTS.md (and scaling.png).

python benchmarks/run_all.py            # full sizes (several minutes on CPU)
python benchmarks/run_all.py --quick    # small sizes, a smoke run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402
import bench_kv_write  # noqa: E402
import bench_layer_scan  # noqa: E402
import bench_load  # noqa: E402
import bench_prefix  # noqa: E402
import bench_scaling  # noqa: E402
import bench_serve  # noqa: E402
import bench_step_loop  # noqa: E402
import bench_step_metadata  # noqa: E402

QUICK = {
    "attention": ["--num-reqs", "8", "--context", "128", "--iters", "5"],
    "kv_write": ["--pool-mib", "16", "--iters", "20"],
    "step_loop": [
        "--num-requests",
        "4",
        "--max-new-tokens",
        "4",
        "--num-blocks",
        "512",
    ],
    "step_metadata": ["--num-reqs", "32", "--iters", "20"],
    "layer_scan": ["--layers", "8"],
    "load": ["--num-requests", "2000"],
    "serve": ["--new", "16", "--iters", "10"],
    "prefix": "--num-requests 8 --prefix 128 --max-new-tokens 4".split(),
    "scaling": [
        "--requests",
        "8,32",
        "--contexts",
        "128,512",
        "--pool-mib",
        "16,64",
        "--iters",
        "5",
    ],
}


def _commit() -> str:
    """The code the figures were measured on (short hash, '+dirty' if edited)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "jaxkv", "benchmarks/*.py"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent.parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks; returns 0."""
    p = argparse.ArgumentParser(description="Run every benchmark, write RESULTS.md.")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    extra = QUICK if args.quick else {k: [] for k in QUICK}
    plot_path = args.out.parent / "scaling.png"
    r_att = bench_attention.main(extra["attention"])
    r_kv = bench_kv_write.main(extra["kv_write"])
    r_loop = bench_step_loop.main(extra["step_loop"])
    r_meta = bench_step_metadata.main(extra["step_metadata"])
    r_prefix = bench_prefix.main(extra["prefix"])
    r_scale = bench_scaling.main([*extra["scaling"], "--plot", str(plot_path)])
    r_scan = bench_layer_scan.main(extra["layer_scan"])
    r_load = bench_load.main(extra["load"])
    r_serve = bench_serve.main(extra["serve"])
    device = f"{jax.default_backend()}: {jax.devices()[0].device_kind}"
    rows = [
        (
            "Write + decode attention vs ejkernel RPA v3, XLA fallback",
            ">= 2.5x faster",
            _fmt(r_att.get("ejkernel_over_jaxkv", "ejkernel not installed")),
        ),
        (
            "Decode attention (fp32) vs copy of its KV bytes: word / typed pool",
            "<= 3x",
            f"{_fmt(r_att['jaxkv_over_copy'])} / {_fmt(r_att['typed_over_copy'])}",
        ),
        (
            "Decode on a vLLM 0.33 LHBNC tensor / block-outermost pool (guard)",
            "<= 1.5x",
            f"{_fmt(r_att['lhbnc_over_words'])}; equal {r_att['lhbnc_equals_words']}",
        ),
        (
            "Mixed batch: jaxkv / ejkernel XLA fallback (ms)",
            "<= 1x",
            f"{_fmt(r_att.get('mixed_jaxkv_ms', 0.0))} / "
            f"{_fmt(r_att.get('mixed_ejkernel_ms', 0.0))}",
        ),
        (
            "Layer scan: compile time of deep / 2 layers; logits equal unrolled",
            "<= 1.5x",
            f"{_fmt(r_scan['deep_over_shallow'])}; {r_scan['scan_equals_unrolled']}",
        ),
        (
            "Mixed batch equals ejkernel (1e-4)",
            "equal",
            _fmt(r_att.get("mixed_matches_ejkernel", "ejkernel not installed")),
        ),
        *(
            row
            for dtype, name in (("bfloat16", "bf16"), ("float8_e4m3fn", "fp8"))
            for row in (
                (
                    f"KV write {name}, one call, vs NumPy in place: word / typed",
                    "<= 2.0x",
                    f"{_fmt(r_kv[dtype]['ratio'])} / "
                    f"{_fmt(r_kv[dtype]['typed_ratio'])}",
                ),
                (
                    f"KV write {name}, one step of 8 layers in one program",
                    "<= 2.0x",
                    _fmt(r_kv[dtype]["step"]["ratio"]),
                ),
                (
                    f"KV write {name}, pipelined calls / one-kernel floor",
                    "-",
                    f"{_fmt(r_kv[dtype]['pipelined_ratio'])} / "
                    f"{_fmt(r_kv[dtype]['floor_ratio'])}",
                ),
            )
        ),
        (
            "Naive bf16 .at[].set vs jaxkv",
            "contrast",
            _fmt(r_kv["naive_bf16_ms"] / r_kv["bfloat16"]["jaxkv_ms"]),
        ),
        (
            "Serve: ServingLoop steady decode (multi-step, overlap) / dense-cache "
            "fori_loop (same tokens)",
            "<= 1.5x, host hidden",
            f"{_fmt(r_serve['multi_over_dense'])} ({r_serve['same_tokens']}); "
            f"blocks dispatched onto an idle device {r_serve['multi_found_idle']}/"
            f"{r_serve['multi_dispatches']}; one step at a time: overlap "
            f"{_fmt(r_serve['jaxkv_over_dense'])}, no overlap "
            f"{_fmt(r_serve['no_overlap_over_dense'])}",
        ),
        ("Step loop tokens/s", "-", _fmt(r_loop["tokens_per_s"])),
        ("Step loop steps/s", "-", _fmt(r_loop["steps_per_s"])),
        ("Compilations after warm-up", "0", _fmt(r_loop["compiles_after_warm_up"])),
        ("Step temp memory / pools", "<= 10%", f"{r_loop['max_temp_over_pools']:.1%}"),
        (
            "Step pools aliased in place (donated), every executable",
            "100%",
            f"{r_loop['pools_aliased']:.0%}",
        ),
        (
            "Host overhead: naive / jaxkv (validated; validate=False)",
            ">= 3x",
            f"{_fmt(r_meta['naive_over_packed'])}; "
            f"{_fmt(r_meta['naive_over_unchecked'])}",
        ),
        (
            "Prefix caching: prompt tokens saved (shared prefix)",
            ">= 80%",
            f"{r_prefix['saved_fraction']:.1%}",
        ),
        (
            "Prefix caching: tokens/s cached / uncached, outputs identical",
            "identical",
            f"{_fmt(r_prefix['speedup'])}, {r_prefix['identical']}",
        ),
        ("Staging: Python loop / jitted kernel", "-", _fmt(r_meta["loop_over_kernel"])),
        (
            f"Load: {r_load['requests']} requests, {r_load['bad']} bad: served / "
            "rejected with a reason",
            "all",
            f"{r_load['good_served']}/{r_load['good']}, "
            f"{r_load['bad_rejected']}/{r_load['bad']}",
        ),
        (
            "Load: time per step, memory: last / first tenth",
            "<= 1.5x",
            f"{_fmt(r_load['time_ratio'])}, {_fmt(r_load['memory_ratio'])}",
        ),
        (
            "Write time spread over pool sizes",
            "flat (~1x)",
            _fmt(r_scale["write_spread"]),
        ),
        (
            "Attention time spread over pool sizes",
            "flat (~1x)",
            _fmt(r_scale["read_spread"]),
        ),
    ]
    lines = [
        "# jaxkv benchmark results",
        "",
        f"Device: {device}. Code: commit {_commit()}. Generated by "
        f"`python benchmarks/run_all.py"
        f"{' --quick' if args.quick else ''}`; ratios are measured side by side in "
        "one run.",
        "",
        "| measure | target | result |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
    ]
    if plot_path.exists():
        lines += ["![scaling](scaling.png)", ""]
    args.out.write_text("\n".join(lines))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
