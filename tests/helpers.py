"""Shared test helpers: compile counters and small model configs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import jaxkv

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (its folder on the path for _harness)."""
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_asan_check(source: Path, out_dir: Path, *, guard_pages: bool = False) -> None:
    """Builds a C++ check of a native kernel (``tests/native_*_check.cc``,
    which includes the kernel's source) with AddressSanitizer and runs it: it
    must print OK, and any byte touched outside its buffers aborts it.
    Skips the calling test where there is no compiler or no ASan runtime.
    `guard_pages`: no ASan (a faster build); the check's buffers end at an
    inaccessible page (``-DGUARD_PAGES``), so a read past one's end faults.
    """  # noqa: D205
    import jax
    import pytest

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = Path(__file__).resolve().parents[1]
    exe = out_dir / source.stem
    build = subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-g",
            "-O1",
            *(
                ["-DGUARD_PAGES"]
                if guard_pages
                else ["-fsanitize=address", "-fno-omit-frame-pointer"]
            ),
            "-w",
            "-Wno-psabi",
            f"-I{jax.ffi.include_dir()}",
            f"-I{root / 'jaxkv' / '_native'}",
            str(source),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0 and "asan" in build.stderr.lower():
        pytest.skip(f"AddressSanitizer unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.stdout.strip() == "OK"


def examples(n: int) -> int:
    """Hypothesis example count: `n`, or a twentieth of it when JAXKV_QUICK=1."""
    return max(5, n // 20) if os.environ.get("JAXKV_QUICK") == "1" else n


count_compiles = jaxkv.count_compilations


def full_spec(block_size: int = 16, heads: int = 8, head: int = 128, dtype="bfloat16"):
    return jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype
    )


def layer(name, spec, backend="FLASH_ATTN", **kw):
    return jaxkv.LayerConfig(
        name=name, spec=spec, backend=jaxkv.get_backend(backend), **kw
    )


def single_group_config(names, spec, num_blocks=4):
    return jaxkv.vllm.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(
                size=num_blocks * spec.page_size_bytes, shared_by=[n]
            )
            for n in names
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
        ],
    )


def one_layer_config(spec, *, max_model_len=256, max_num_seqs=8, tokens=64):
    """A runner config of one JAX_PAGED layer named ``attn`` (one token bucket)."""
    return jaxkv.RunnerConfig(
        layers=(
            jaxkv.LayerConfig(
                name="attn",
                spec=spec,
                backend=jaxkv.get_backend("JAX_PAGED"),
                num_heads=1,
            ),
        ),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=tokens,
        token_buckets=(tokens,),
    )


def reset_loop(loop: jaxkv.ServingLoop, *, num_blocks: int | None = None, **changes):
    """``loop.reset`` with a fresh scheduling state: prefix caching and the host
    tier off unless `changes` turn them on, the loop's other options kept.
    """  # noqa: D205
    options = dataclasses.replace(
        loop.scheduling, enable_prefix_caching=False, host_blocks=0
    )
    loop.reset(
        scheduling=dataclasses.replace(options, **changes), num_blocks=num_blocks
    )
