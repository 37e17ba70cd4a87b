"""Compiling jaxkv's Triton kernels for an NVIDIA GPU on a CPU host.

Pallas lowers a GPU kernel to a Triton module (``tt`` dialect) that XLA
compiles when the program runs on a GPU. Here the module is caught as
``jax.export`` lowers a step for ``("cuda",)`` (on its way through
``lower_jaxpr_to_triton_module``, with the launch's warps and stages), then
compiled with PyPI's ``triton`` (the ``gpu-compile`` extra; it bundles
``ptxas``) for sm_80 or sm_90, and read: registers and spills (``ptxas
-v``), shared memory, and the PTX's tensor-core (``mma``, ``wgmma``) and
asynchronous-copy (``cp.async``) instructions. jaxlib compiles with its own
Triton, so the figures are indicative of, not equal to, what XLA builds.
Shared by ``tests/test_gpu_compile.py`` and ``benchmarks/kernel_report.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"
_PRED = r"^\s*(?:@!?%p\d+\s+)?"  # a PTX instruction, predicated or not


def triton_missing() -> str | None:
    """Why Triton modules cannot be compiled here (``None``: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "PyPI's triton is not installed (pip install -e '.[gpu-compile]')"
    return None


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas kernel as Pallas hands it to XLA's Triton."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def triton_modules(fn: Any, args: tuple[Any, ...]) -> list[TritonModule]:
    """The Triton modules of `fn` lowered for CUDA with abstract `args`."""
    # The exported program holds the module as MLIR bytecode that PyPI's
    # triton cannot read back (another MLIR); the text is caught at lowering.
    from jax._src.pallas.triton import (  # noqa: TID251
        pallas_call_registration as registration,
    )

    caught: list[TritonModule] = []
    lower = registration.lowering.lower_jaxpr_to_triton_module  # pyright: ignore[reportPrivateImportUsage]

    def catch(*a: Any, **kw: Any) -> Any:
        result = lower(*a, **kw)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering's launch
        caught.append(
            TritonModule(
                name=str(caller.get("name", "kernel")),
                ttir=str(result.module.operation.get_asm(enable_debug_info=False)),
                num_warps=int(caller["num_warps"]),
                num_stages=int(caller["num_stages"]),
                grid=_grid3(result.grid),
            )
        )
        return result

    registration.lowering.lower_jaxpr_to_triton_module = catch  # pyright: ignore[reportPrivateImportUsage]
    try:
        jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower  # pyright: ignore[reportPrivateImportUsage]
    return caught


def _grid3(grid: Any) -> tuple[int, int, int]:
    x, y, z = (*(int(g) for g in grid), 1, 1, 1)[:3]
    return x, y, z


@dataclasses.dataclass(frozen=True)
class GpuBuild:
    """What ptxas and the PTX say of one kernel compiled for one arch."""

    arch: int
    registers: int
    spill_bytes: int  # spill stores per thread
    shared_bytes: int
    mma: int  # mma.sync (sm_80+) and wgmma (sm_90a) instructions
    cp_async: int  # cp.async copies (global -> shared, asynchronous)
    vector_loads: int  # 16-byte global loads
    vector_stores: int  # 16-byte global stores
    buffers: int  # depth of the pipelined 2-D tiles in shared memory (K, V)
    num_warps: int
    num_stages: int


def compile_triton(module: TritonModule, arch: int) -> GpuBuild:
    """`module` compiled by PyPI's triton for ``sm_<arch>``, read back."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(module.ttir)
        kernel = triton.compile(
            path,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": module.num_warps, "num_stages": module.num_stages},
        )
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [
                get_ptxas(arch).path,
                "-v",
                f"--gpu-name={sm_arch_from_capability(arch)}",
                ptx_path,
                "-o",
                os.path.join(tmp, "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return GpuBuild(
        arch=arch,
        registers=int(regs.group(1)) if regs else -1,
        spill_bytes=int(spills.group(1)) if spills else 0,
        shared_bytes=int(kernel.metadata.shared),
        mma=len(re.findall(_PRED + r"(?:mma\.sync|wgmma\.mma_async)", ptx, re.M)),
        cp_async=len(re.findall(_PRED + r"cp\.async\.(?:ca|cg)\.shared", ptx, re.M)),
        vector_loads=len(re.findall(_PRED + r"ld\.global[.\w]*\.v4\.b32", ptx, re.M)),
        vector_stores=len(re.findall(_PRED + r"st\.global[.\w]*\.v4\.b32", ptx, re.M)),
        buffers=max(
            (
                int(n)
                for n in re.findall(
                    r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir
                )
            ),
            default=0,
        ),
        num_warps=module.num_warps,
        num_stages=module.num_stages,
    )
