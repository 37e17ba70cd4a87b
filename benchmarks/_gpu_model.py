"""The Triton attention kernel as an NVIDIA GPU would run it, read without one.

For each configuration the kernel's Triton module is compiled by PyPI's
triton for sm_80 and sm_90 (``tests/gpu_compile.py``) and read: registers,
spills, shared memory, ``mma`` and ``cp.async`` instructions, the depth of
the pipelined K/V buffers. From those, the launch shape
(:func:`jaxkv.attention._pallas_gpu.gpu_tiling`) and the model below, an
estimate of the fraction of the *copy* bandwidth the kernel reaches. A
model, not a measurement: no GPU ran anything.

The model (every constant is in ``GPUS``, stated there):

- **Residency.** Programs per SM = the fewest allowed by registers (rounded
  up to 8 a thread), shared memory, threads (2,048) and blocks (32).
- **A program** walks its steps of ``keys`` keys; a step reads K and V of
  one KV head (``keys x (Dk + Dv)`` elements, a padded head dim's real
  ones only: the loads are masked) and the keys' page ids. With
  ``buffers`` steps in flight (Triton's cp.async pipeline) a step costs at
  least ``latency / buffers``; with ``r`` programs resident on an SM, it
  also costs at least ``r x`` its compute: CUDA-core work of
  ``OPS_PER_SCORE`` per (query row, key) score and ``OPS_PER_KV`` per K/V
  element, on ``lanes`` FP32 lanes at ``clock``, plus its tensor-core
  FLOPs at the SM's share of the chip's dense bf16 rate.
- **The chip** runs programs in launch order in its ``SMs x residency``
  slots; at any moment the running programs share the copy bandwidth
  (``hbm x copy_fraction``): each runs at its own rate above, scaled down
  together when their sum exceeds it. An event simulation gives the time.
- **Launches**: ``launch_us`` per kernel; with split-KV a second pass
  merges the partial softmaxes (its bytes at copy bandwidth, one launch).
- Estimate = (the K/V bytes the step must read / copy bandwidth) / time.
"""

from __future__ import annotations

import heapq
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxkv.attention._pallas_gpu import GpuTiling, gpu_tiling
from jaxkv.kv._pallas_write import gpu_write_tiling
from tests.device_compile import Step
from tests.gpu_compile import GpuBuild


class Gpu(NamedTuple):
    """The constants the model uses for one GPU."""

    arch: int  # the sm_ compiled for
    sms: int
    hbm: float  # bytes/s, published peak
    copy_fraction: float  # of the peak a copy kernel reaches (assumed)
    latency_ns: float  # HBM load latency under load (assumed)
    regs: int  # 32-bit registers per SM
    shared: int  # shared memory per SM, bytes
    clock: float  # Hz (boost)
    lanes: int  # FP32 lanes per SM
    tensor_flops: float  # dense bf16 FLOP/s, whole chip
    launch_us: float  # one kernel launch (assumed)


GPUS = {
    # H100 SXM: 132 SMs, 3.35 TB/s HBM3, 228 KB shared / SM, 989 bf16 TFLOP/s.
    "H100 (sm_90)": Gpu(90, 132, 3.35e12, 0.9, 700, 65536, 228 << 10, 1.755e9,
                        128, 989e12, 3.0),
    # A100 SXM 80 GB: 108 SMs, 2.04 TB/s HBM2e, 164 KB shared / SM, 312 TFLOP/s.
    "A100 (sm_80)": Gpu(80, 108, 2.039e12, 0.9, 600, 65536, 164 << 10, 1.41e9,
                        64, 312e12, 3.0),
}  # fmt: skip
OPS_PER_SCORE = 24  # 4 bound compares and ands, scale, select, max, subtract,
# exp2, select, sum, the cast to bf16, the poison compare and max, the
# conversions between the mma and blocked layouts (~8)
OPS_PER_KV = 2  # shared memory to registers and the layout conversion


def tiling_of(step: Step, rows: int) -> GpuTiling:
    """The launch shape the kernel takes for `step` over `rows` query rows."""
    return gpu_tiling(
        rows=rows,
        tile=step.tile,
        groups=step.q_heads // step.kv_heads,
        kv_heads=step.kv_heads,
        dk=step.head,
        dv=step.head,
        max_keys=step.cols * step.block,
        itemsize=jnp.dtype(step.page_dtype).itemsize,
    )


def _row_keys(step: Step) -> list[tuple[int, int]]:
    """Each row's ``(query slots used, keys it sees)``."""
    rows = [(1, step.context)] * step.decode
    for _ in range(step.prefill):
        past = step.context - step.chunk
        for t in range(step.chunk // step.tile):
            rows.append((step.tile, past + (t + 1) * step.tile))
    return rows


def residency(build: GpuBuild, gpu: Gpu) -> int:
    """Programs one SM holds at once."""
    threads = 32 * build.num_warps
    regs = -(-max(build.registers, 1) // 8) * 8
    return max(
        0,
        min(
            gpu.regs // (regs * threads),
            gpu.shared // max(build.shared_bytes, 1),
            2048 // threads,
            32,
        ),
    )


def estimate(step: Step, t: GpuTiling, build: GpuBuild, gpu: Gpu) -> dict[str, Any]:
    """The modelled time of the kernel for `step` on `gpu` (see the module)."""
    item = jnp.dtype(step.page_dtype).itemsize  # fp8 pages: one byte a value
    # Masked loads read a padded head dim's real elements only.
    step_bytes = t.keys * (2 * step.head * item + 4)
    per_sm = residency(build, gpu)
    ops = t.queries * t.keys * OPS_PER_SCORE + t.keys * (t.dk + t.dv) * OPS_PER_KV
    flops = 2 * t.queries * t.keys * (t.dk + t.dv)
    compute_s = ops / (gpu.lanes * gpu.clock) + flops / (gpu.tensor_flops / gpu.sms)
    step_s = max(gpu.latency_ns * 1e-9 / max(build.buffers, 1), per_sm * compute_s)
    rate = step_bytes / step_s  # one program's bytes/s
    copy = gpu.hbm * gpu.copy_fraction
    # Programs in launch order: (row, KV head x query block, split).
    work = []
    for _, keys in _row_keys(step):
        per = -(-keys // t.splits)
        for _ in range(step.kv_heads * t.query_blocks):
            for s in range(t.splits):
                mine = max(0, min(per, keys - s * per))
                work.append(-(-mine // t.keys) * step_bytes)
    slots = max(1, per_sm * gpu.sms)
    time_s = _simulate(work, slots, rate, copy)
    time_s += gpu.launch_us * 1e-6
    if t.splits > 1:
        partials = len(work) * t.queries * (t.dv + 2) * 4
        time_s += gpu.launch_us * 1e-6 + 2 * partials / copy
    need = step.kv_bytes()
    return {
        "programs": len(work),
        "programs/SM": per_sm,
        "waves": len(work) / slots,
        "KiB in flight/SM": per_sm * max(build.buffers, 1) * step_bytes / 1024,
        "MiB read": sum(work) / 2**20,
        "model us": time_s * 1e6,
        "est. % of copy": 100 * (need / copy) / time_s,
    }


def _simulate(work: list[int], slots: int, rate: float, cap: float) -> float:
    """Seconds to run programs of `work` bytes in `slots`, sharing `cap` B/s.

    Every running program moves bytes at ``min(rate, cap / n)`` (``n``
    running): all at one speed, so a heap of the byte counts at which each
    ends gives the completions in order; a finished program's slot takes
    the next in launch order.
    """
    running: list[float] = []
    done = clock = 0.0
    nxt = 0
    while nxt < len(work) and len(running) < slots:
        heapq.heappush(running, float(work[nxt]))
        nxt += 1
    while running:
        speed = min(rate, cap / len(running))
        end = heapq.heappop(running)
        clock += (end - done) / speed
        done = end
        if nxt < len(work):
            heapq.heappush(running, done + work[nxt])
            nxt += 1
    return clock


def gpu_rows(
    step: Step, rows: int, builds: dict[int, GpuBuild]
) -> list[dict[str, Any]]:
    """One report row per GPU for `step`, from its builds by arch.

    `rows`: the query rows of the compiled launch (its grid's first axis).
    """
    t = tiling_of(step, rows)
    out = []
    for name, gpu in GPUS.items():
        if gpu.arch not in builds:  # fp8 pages: sm_89 and newer
            continue
        b = builds[gpu.arch]
        out.append(
            {
                "gpu": name,
                "config": step.name,
                "registers": b.registers,
                "spill bytes": b.spill_bytes,
                "shared KiB": b.shared_bytes / 1024,
                "mma": b.mma,
                "cp.async": b.cp_async,
                "K/V buffers": b.buffers,
                "warps": b.num_warps,
                "stages": b.num_stages,
                "queries/program": t.queries,
                "keys/step": t.keys,
                "splits": t.splits,
                **estimate(step, t, b, gpu),
            }
        )
    return out


def write_rows(step: Step, builds: dict[int, GpuBuild]) -> list[dict[str, Any]]:
    """The KV write of the step's tokens per GPU: read the new K/V, store it.

    A program loads its tokens' rows (every head) and stores them: two
    latencies of its bytes, at most; programs share the copy bandwidth as
    the attention's do. Estimate = (bytes read + written / copy) / time.
    """
    t = gpu_write_tiling(step.tokens, step.kv_heads, step.head, step.head)
    item = jnp.dtype(step.dtype).itemsize
    per = t.tokens * 2 * step.kv_heads * step.head * item * 2  # read + write
    out = []
    for name, gpu in GPUS.items():
        b = builds[gpu.arch]
        per_sm = residency(b, gpu)
        copy = gpu.hbm * gpu.copy_fraction
        work = [per] * -(-step.tokens // t.tokens)
        rate = per / (2 * gpu.latency_ns * 1e-9)
        time_s = _simulate(work, per_sm * gpu.sms, rate, copy) + gpu.launch_us * 1e-6
        need = step.tokens * 2 * step.kv_heads * step.head * item * 2
        out.append(
            {
                "gpu": name,
                "config": step.name,
                "registers": b.registers,
                "spill bytes": b.spill_bytes,
                "16-byte stores": b.vector_stores,
                "tokens/program": t.tokens,
                "programs/SM": per_sm,
                "model us": time_s * 1e6,
                "est. % of copy": 100 * (need / copy) / time_s,
            }
        )
    return out


def describe() -> str:
    """The model's constants, for the report."""
    return (
        "; ".join(f"{k}: {v}" for k, v in GPUS.items())
        + f"; CUDA-core ops per score {OPS_PER_SCORE}, per K/V element {OPS_PER_KV}"
    )
