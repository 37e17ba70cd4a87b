"""The kernels as a device would run them, read without the device.

Two parts: the TPU kernels (below) and the GPU's Triton kernel
(``benchmarks/_gpu_model.py``: compiled for sm_80 and sm_90 by PyPI's
triton, registers, spills, shared memory, ``mma`` and ``cp.async``, and a
modelled fraction of the copy bandwidth; its model is stated there).

For each configuration (decode 256 x 4096 bf16, 32 query / 8 KV heads of 128,
at blocks 16 and 64; decode 4 x 32k; a mixed batch of prefill tiles and
decode rows) and each TPU chip (v5e, v6e), the TPU kernels are compiled
for the chip on this host (libtpu's Mosaic and XLA:TPU compilers, no TPU:
``tests/device_compile.py``), and the report prints whether they compiled,
the attention kernel's grid, its DMA waves (pages and bytes in flight), its
VMEM, and a bandwidth estimate from the model below; and for the KV write,
its DMAs and an estimate. A model, not a measurement: no TPU ran anything.

The model (per chip: ``CHIPS``; every constant is stated there):

- **Attention.** Grid steps run one after another (one per query row);
  each costs ``step_us``. A row's pages come in waves; a wave's DMAs are
  in flight while the previous wave is computed, and the row's last wave
  starts the next row's first, so a wave costs the larger of its DMA time
  (``bytes / hbm``) and its compute. Compute has three parts, each on its
  own unit: the MXU streams every K and V element once per KV head
  (``mxus`` units of ``mxu_width`` columns at ``clock``, a head of ``D`` <
  width using ``D`` of them); the VPU does ``VPU_OPS_PER_SCORE`` operations
  per vreg of scores (``(tile * G / 8) x (keys / 128)`` vregs per head)
  and ``VPU_OPS_PER_KV`` per vreg of V, ``vpu_slots`` a cycle; token-major
  pages add either a gather per head over every vreg of the wave
  (``VPU_OPS_PER_HEAD_GATHER``) or, where heads are loaded by stride, one
  strided load per vreg of 32-bit words (``LOAD_SLOTS`` a cycle) and
  ``VPU_OPS_PER_WORD_UNPACK`` per vreg of 16-bit pages; the scalar
  unit starts each DMA and waits on each of a part-empty wave's, or once
  per buffer for a full wave (``dma_issue_us`` each). The TPU
  issues these in the same VLIW bundles, so the estimate takes the
  largest plus one KV head's MXU and VPU work (the softmax of a head waits
  for its scores: the tail that cannot overlap). The *no-overlap bound*
  adds the three instead (a floor no schedule falls below).
  Estimate = HBM time of the bytes read / the sum over rows.
- **The previous kernel** (one page per grid step), for contrast: every
  (row, table column) a grid step of ``step_us``, its page DMA overlapped.
- **Write.** One DMA per run of consecutive slots in a page per set bit of
  its length (``dma_issue_us`` each) against the HBM time of the new bytes
  read and written; XLA's scatter is modelled as one update row per token,
  each a DMA of the same cost (its compiled HLO is one scatter op whose
  lowering is not visible here).

Run: ``pip install -e ".[test,tpu-compile]"``, then
``JAX_PLATFORMS=cpu python benchmarks/kernel_report.py`` (``--quick``: one
configuration per chip). The JSON goes where ``gpu_check.sh`` writes
(``$OUT/kernel_report.json``) or to ``--json``.
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax.numpy as jnp  # noqa: E402
from _gpu_model import describe as describe_gpu_model  # noqa: E402
from _gpu_model import gpu_rows, write_rows  # noqa: E402
from _harness import parser, print_table, write_json  # noqa: E402

from jaxkv.attention._pallas_tpu import (  # noqa: E402
    TPU_TUNING,
    pages_per_wave,
    strided_heads,
)
from tests.device_compile import (  # noqa: E402
    Step,
    attention_step,
    compile_for_tpu,
    interpreted_ops,
    kernel_calls,
    libtpu_missing,
)
from tests.gpu_compile import (  # noqa: E402
    compile_triton,
    triton_missing,
    triton_modules,
)


class Chip(NamedTuple):
    """The constants the model uses for one TPU chip (per TensorCore)."""

    hbm: float  # bytes/s (published)
    clock: float  # Hz
    mxus: int  # matrix units per core
    mxu_width: int  # their systolic width
    vpu_slots: int  # vector ALU ops issued a cycle (assumed)
    step_us: float  # fixed cost of a grid step (issue 54's figure)
    dma_issue_us: float  # scalar-unit cost to start or wait on one DMA (assumed)
    vmem_scoped: int  # default scoped VMEM a kernel may take


CHIPS = {
    # v5e: 819 GB/s HBM, 197 bf16 TFLOP/s = 4 MXUs of 128 x 128 at 1.5 GHz.
    "v5e": Chip(819e9, 1.5e9, 4, 128, 2, 0.35, 0.01, 16 << 20),
    # v6e: 1,640 GB/s HBM, 918 bf16 TFLOP/s = 4 MXUs of 256 x 256 at 1.75 GHz.
    "v6e": Chip(1640e9, 1.75e9, 4, 256, 2, 0.35, 0.01, 32 << 20),
}
VPU_OPS_PER_SCORE = 16  # two bounds compares, and, NaN-page select, scale,
# mask select, running max, subtract, exp (~4), select, sum, rescale
VPU_OPS_PER_KV = 2  # V zeroed where no query sees it, the cast to the MXU type
# A token-major page (N, H, D) holds every head of a token in one vreg's
# rows. Where the kernel cannot load a head by stride (D not a multiple of
# 128 lanes, or an odd head count of 16-bit pages), one KV head's (N, D) rows
# are gathered from every vreg of the wave, for each head (assumed one op per
# vreg touched). Head-first pages (H, N, D) need none.
VPU_OPS_PER_HEAD_GATHER = 1
# Where it can (``strided_heads``), every 32-bit word of the wave is loaded
# once by a strided load (a load slot, ``LOAD_SLOTS`` a cycle, assumed) and
# 16-bit pages are unpacked: the even head by a truncating convert (1 op),
# the odd one by a shift and a convert (2 ops), per vreg of words.
VPU_OPS_PER_WORD_UNPACK = 3
# 8-bit pages (fp8) loaded by stride hold four heads a word: each head's
# byte is shifted, masked and converted to bfloat16 (3 ops, assumed one
# for the conversion), per vreg of words.
VPU_OPS_PER_WORD_UNPACK_8BIT = 12
LOAD_SLOTS = 1

CONFIGS = [
    Step("decode 256x4096 block 16"),
    Step("decode 256x4096 block 64", block=64),
    Step("decode 4x32k block 16", decode=4, context=32768),
    Step("mixed 128 decode + 8x512 prefill", decode=128, prefill=8),
    Step("decode 256x4096 block 16 K/V halves", layout="kv"),
    Step("decode 256x4096 block 16 HND", layout="hnd"),
    Step("decode 256x4096 block 64 HND", block=64, layout="hnd"),
    Step("mixed 128 decode + 8x512 prefill HND", decode=128, prefill=8, layout="hnd"),
    # fp8 pages with per-tensor scales (issue 58): read as bytes (four
    # heads a 32-bit word, loaded by stride), converted to bfloat16 in VMEM
    # for the MXU; written by XLA's scatter (the Mosaic write takes no 8-bit
    # pages yet).
    Step("decode 256x4096 block 16 fp8", quant="fp8_per_tensor"),
]


GPU_CONFIGS = [
    Step("decode 256x4096 block 16"),
    Step("decode 256x4096 block 64", block=64),
    Step("decode 4x32k block 16", decode=4, context=32768),
    Step("mixed 128 decode + 8x512 prefill", decode=128, prefill=8),
    Step("decode 256x4096 block 16 head 256", head=256),
    Step("decode 256x4096 block 64 head 256", block=64, head=256),
    Step("mixed 128 decode + 8x512 prefill head 256", decode=128, prefill=8, head=256),
    Step("decode 256x4096 GQA 40:8", q_heads=40),
    Step("decode 256x4096 head 96", head=96),
    # fp8 pages with per-tensor scales (issue 58): sm_90 only (Triton
    # converts e4m3 on sm_89 and newer).
    Step("decode 256x4096 block 16 fp8", quant="fp8_per_tensor"),
]


def _rows(step: Step) -> list[tuple[int, int]]:
    """Each row's ``(query slots used, pages it reads)``."""
    rows = [(1, step.cols)] * step.decode
    for _ in range(step.prefill):
        past = step.context - step.chunk
        for t in range(step.chunk // step.tile):
            seen = past + (t + 1) * step.tile
            rows.append((step.tile, -(-seen // step.block)))
    return rows


def attention_model(
    step: Step, chip: Chip, wave: int, grid: int | None = None
) -> dict[str, Any]:
    """The modelled time of the TPU attention kernel for `step` on `chip`.

    `grid`: the rows the compiled kernel has (its static bound); rows past
    the step's own are empty grid steps, ``step_us`` each. Pages count in
    their own dtype (fp8: a byte a value, gathered per head, not loaded by
    stride).
    """
    item = jnp.dtype(step.page_dtype).itemsize
    strided = step.layout != "hnd" and strided_heads(
        (step.kv_heads, step.head), jnp.dtype(step.page_dtype)
    )
    # A fused page loaded by stride is DMA'd as its K and V halves.
    halves = 1 if step.layout == "fused" and not strided else 2
    page_bytes = 2 * step.block * step.kv_heads * step.head * item
    groups = step.q_heads // step.kv_heads
    width = min(chip.mxu_width, step.head)
    packed = 8 * (4 // item)  # rows of a vreg
    total_us, read = 0.0, 0
    serial_us = float(len(_rows(step))) * chip.step_us
    dmas = waves = 0
    for slots, pages in _rows(step):
        m = slots * groups
        total_us += chip.step_us
        for w in range(math.ceil(pages / wave)):
            n = min(wave, pages - w * wave)
            keys = n * step.block
            dma_us = n * page_bytes / chip.hbm * 1e6
            elems = step.kv_heads * keys * 2 * step.head
            mxu = elems / (chip.mxus * width) * math.ceil(m / 128)
            score_vregs = math.ceil(m / 8) * math.ceil(keys / 128)
            kv_vregs = keys * step.head / (packed * 128)
            vpu = step.kv_heads * (
                score_vregs * VPU_OPS_PER_SCORE + kv_vregs * VPU_OPS_PER_KV
            )
            word_vregs = n * page_bytes / 4096  # the wave as vregs of 32-bit words
            loads = 0.0
            if strided:  # each word loaded once by stride, 16-bit ones unpacked
                loads = word_vregs
                if item < 4:
                    vpu += word_vregs * (
                        VPU_OPS_PER_WORD_UNPACK
                        if item == 2
                        else VPU_OPS_PER_WORD_UNPACK_8BIT
                    )
            elif step.layout != "hnd":  # every vreg of K and V, once per head
                wave_vregs = 2 * step.kv_heads * kv_vregs
                vpu += step.kv_heads * wave_vregs * VPU_OPS_PER_HEAD_GATHER
            mxu_us = mxu / chip.clock * 1e6
            vpu_us = vpu / chip.vpu_slots / chip.clock * 1e6
            load_us = loads / LOAD_SLOTS / chip.clock * 1e6
            # Each DMA started; a full wave waited for once per buffer, a
            # part-empty one DMA by DMA.
            waits = halves if n == wave else n * halves
            scalar_us = (n * halves + waits) * chip.dma_issue_us
            tail_us = (mxu_us + vpu_us) / step.kv_heads
            compute_us = max(mxu_us, vpu_us, load_us, scalar_us) + tail_us
            total_us += max(dma_us, compute_us)
            serial_us += max(dma_us, mxu_us + vpu_us + load_us + scalar_us)
            read += n * page_bytes
            dmas += n * halves
            waves += 1
    empty = max(0, (grid or 0) - len(_rows(step)))
    total_us += empty * chip.step_us
    serial_us += empty * chip.step_us
    hbm_us = read / chip.hbm * 1e6
    old_us = sum(chip.step_us * step.cols for _ in _rows(step))
    return {
        "grid steps": len(_rows(step)),
        "waves": waves,
        "DMAs": dmas,
        "MiB read": read / 2**20,
        "model us": total_us,
        "HBM us": hbm_us,
        "est. % of HBM": 100 * hbm_us / total_us,
        "no-overlap bound %": 100 * hbm_us / serial_us,
        "one-page-per-step kernel %": 100 * hbm_us / max(old_us, hbm_us),
    }


def vmem_bytes(step: Step, wave: int) -> int:
    """VMEM the attention kernel takes: the K/V double buffer, its blocks, state."""
    item = jnp.dtype(step.dtype).itemsize
    groups = step.q_heads // step.kv_heads
    m = step.tile * groups
    lanes = lambda n: -(-n // 128) * 128  # noqa: E731
    rows = lambda n: -(-n // 8) * 8  # noqa: E731
    page_item = jnp.dtype(step.page_dtype).itemsize
    page = step.block * step.kv_heads * 2 * step.head * page_item
    buffers = 2 * wave * page
    q = 2 * step.kv_heads * rows(m) * lanes(step.head) * item  # double-buffered
    out = 2 * step.kv_heads * rows(m) * lanes(step.head) * 4
    bounds = 2 * rows(m) * lanes(2) * 4
    state = step.kv_heads * rows(m) * (2 * lanes(1) + lanes(step.head)) * 4
    return buffers + q + out + bounds + state


def write_model(step: Step, chip: Chip) -> dict[str, Any]:
    """The modelled KV write of the step's new tokens (prefill runs fill pages)."""
    item = jnp.dtype(step.dtype).itemsize
    row = 2 * step.kv_heads * step.head * item
    halves = 1 if step.layout == "fused" else 2
    # A decode token is a run of 1 (one DMA); a prefill chunk's full pages
    # are runs of a page, one DMA per set bit of the block size.
    pages = step.prefill * -(-step.chunk // step.block)
    dmas = halves * (step.decode + pages * bin(step.block).count("1"))
    moved = step.tokens * row * 2  # read the new K/V, write the pages
    hbm_us = moved / chip.hbm * 1e6
    pallas_us = chip.step_us + max(hbm_us, 2 * dmas * chip.dma_issue_us)
    xla_us = chip.step_us + max(hbm_us, 2 * step.tokens * chip.dma_issue_us)
    return {
        "write DMAs": dmas,
        "write est. us": pallas_us,
        "write est. % of HBM": 100 * hbm_us / pallas_us,
        "XLA scatter est. us": xla_us,
    }


def compiled(step: Step, chip_name: str) -> tuple[str, float, int | None]:
    """Whether the write and attention compile for the chip, in how long, the grid.

    The grid is read off the compiled attention kernel's output ``(rows,
    KV heads, tile * G, Dv)``: the rows the program was built for.
    """
    # The write the TPU picks (None): the Mosaic kernel, or XLA's scatter for
    # head-first pages (tokens in the tiled dims) and 8-bit pages.
    fn, args = attention_step(step, implementation="pallas_tpu", write=None)
    start = time.perf_counter()
    try:
        text = compile_for_tpu(fn, args, chip_name, donate=(0,)).as_text() or ""
    except Exception as err:  # noqa: BLE001 - reported, not raised
        first = str(err).splitlines()[0][:80]
        return f"no: {first}", time.perf_counter() - start, None
    secs = time.perf_counter() - start
    xla_write = step.layout == "hnd" or step.quant != "none"
    write = [] if xla_write else ["jaxkv_kv_write_tpu"]
    ok = kernel_calls(text) == [*write, "jaxkv_paged_attention_tpu"]
    ok = ok and not interpreted_ops(text)
    grid = re.search(r"%jaxkv_paged_attention_tpu[.\d]* = f32\[(\d+),", text)
    return (
        ("yes" if ok else "no: not the two kernels"),
        secs,
        (int(grid.group(1)) if grid else None),
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser((__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one configuration")
    p.add_argument("--no-compile", action="store_true", help="the model only")
    args = p.parse_args(argv)
    missing = libtpu_missing()
    configs = CONFIGS[:1] if args.quick else CONFIGS
    rows = []
    for chip_name, chip in CHIPS.items():
        for step in configs:
            item = jnp.dtype(step.page_dtype).itemsize
            page_bytes = 2 * step.block * step.kv_heads * step.head * item
            wave = pages_per_wave(page_bytes, step.cols)
            if args.no_compile or missing:
                status, secs, grid = (f"not tried: {missing or 'asked'}", 0.0, None)
            else:
                status, secs, grid = compiled(step, chip_name)
            row = {
                "chip": chip_name,
                "config": step.name,
                "compiled": status,
                "compile s": secs,
                "grid (compiled)": grid,
                "pages/wave": wave,
                "KiB/wave": wave * page_bytes / 1024,
                "VMEM KiB": vmem_bytes(step, wave) / 1024,
                "VMEM ok": vmem_bytes(step, wave) <= chip.vmem_scoped,
                **attention_model(step, chip, wave, grid),
                **write_model(step, chip),
            }
            rows.append(row)
    short = [
        {
            k: r[k]
            for k in (
                "chip",
                "config",
                "compiled",
                "grid (compiled)",
                "grid steps",
                "pages/wave",
                "KiB/wave",
                "DMAs",
                "VMEM KiB",
                "est. % of HBM",
                "no-overlap bound %",
                "one-page-per-step kernel %",
                "write est. % of HBM",
            )
        }
        for r in rows
    ]
    print_table("TPU kernels compiled for the chip, with the modelled bandwidth", short)

    def layout(name: str) -> str:
        """The page layout (or dtype) a row is compared within."""
        return name.rsplit(" ", 1)[1] if name.endswith(("HND", "halves", "fp8")) else ""

    decode = {
        (r["chip"], layout(r["config"])): r
        for r in rows
        if r["config"].startswith("decode 256x4096 block 16")
    }
    for r in rows:
        if r["config"].startswith("mixed"):
            d = decode[r["chip"], layout(r["config"])]
            per_byte = (r["model us"] / r["MiB read"]) / (d["model us"] / d["MiB read"])
            print(
                f"{r['chip']}: {r['config']}: time per byte = {per_byte:.2f}x "
                "the same layout's decode"
            )
            r["time per byte vs decode"] = per_byte
    print(
        "\nModel constants (per chip): "
        + "; ".join(f"{k}: {v}" for k, v in CHIPS.items())
        + f"; VPU ops per score vreg {VPU_OPS_PER_SCORE}, per K/V vreg "
        f"{VPU_OPS_PER_KV}, per vreg gathered per head (token-major pages "
        f"not loaded by stride) {VPU_OPS_PER_HEAD_GATHER}, per vreg of 16-bit "
        f"words unpacked (loaded by stride) {VPU_OPS_PER_WORD_UNPACK} (8-bit: "
        f"{VPU_OPS_PER_WORD_UNPACK_8BIT}), strided "
        f"loads {LOAD_SLOTS} a cycle; waves sized by {TPU_TUNING}"
    )
    # The targets of issue 54, on the model's estimate, per page layout.
    met = {}
    for name, suffix in (("NHD (jaxkv's default)", ""), ("HND", "HND")):
        mine = [r for r in rows if layout(r["config"]) == suffix]
        if not mine:
            continue
        wave_kib = min(r["KiB/wave"] for r in mine if "block 16" in r["config"])
        pct = min(r["est. % of HBM"] for r in mine if "decode 256" in r["config"])
        mixed = max((r.get("time per byte vs decode", 0.0) for r in mine), default=0)
        met[name] = wave_kib >= 256 and pct >= 80 and mixed <= 2
        print(
            f"target, {name} pages: >= 256 KiB per DMA wave at block 16 "
            f"({wave_kib:.0f}), an estimated >= 80% of HBM at blocks 16 and 64 "
            f"({pct:.1f}%), a mixed batch within 2x of decode per byte "
            f"({mixed:.2f}x): {'met' if met[name] else 'NOT met'} (a model, not "
            "a measurement)"
        )
    gpu, gpu_met = gpu_report(GPU_CONFIGS[:1] if args.quick else GPU_CONFIGS)
    payload = {
        "gpu": gpu,
        "gpu_target_met": gpu_met,
        "model": {k: v._asdict() for k, v in CHIPS.items()},
        "vpu_ops_per_score": VPU_OPS_PER_SCORE,
        "vpu_ops_per_kv": VPU_OPS_PER_KV,
        "vpu_ops_per_head_gather": VPU_OPS_PER_HEAD_GATHER,
        "vpu_ops_per_word_unpack": VPU_OPS_PER_WORD_UNPACK,
        "vpu_ops_per_word_unpack_8bit": VPU_OPS_PER_WORD_UNPACK_8BIT,
        "load_slots": LOAD_SLOTS,
        "tpu": rows,
        "target_met": met,
    }
    write_json(args.json, "kernel_report", payload)
    return payload


def gpu_report(configs: list[Step]) -> tuple[list[dict[str, Any]], bool | None]:
    """The Triton kernel compiled for sm_80 and sm_90 per configuration, modelled.

    Returns the rows and whether issue 55's targets hold on the model
    (``None``: triton is missing, nothing was compiled).
    """
    missing = triton_missing()
    if missing is not None:
        print(f"\nGPU kernel: not compiled ({missing})")
        return [], None
    rows = []
    for step in configs:
        fn, args = attention_step(step, implementation="pallas_gpu")
        [module] = triton_modules(fn, args)
        archs = (90,) if step.quant != "none" else (80, 90)
        builds = {arch: compile_triton(module, arch) for arch in archs}
        rows += gpu_rows(step, module.grid[0], builds)
    keys = (
        "gpu",
        "config",
        "registers",
        "spill bytes",
        "shared KiB",
        "mma",
        "cp.async",
        "K/V buffers",
        "programs",
        "programs/SM",
        "splits",
        "KiB in flight/SM",
        "est. % of copy",
    )
    print_table(
        "GPU Triton kernel compiled for sm_80 / sm_90 (PyPI triton), modelled",
        [{k: r[k] for k in keys} for r in rows],
    )
    decode = {r["gpu"]: r for r in rows if r["config"] == "decode 256x4096 block 16"}
    for r in rows:
        if r["config"].startswith("mixed"):
            d = decode[r["gpu"]]
            per_byte = (r["model us"] / r["MiB read"]) / (d["model us"] / d["MiB read"])
            r["time per byte vs decode"] = per_byte
            print(
                f"{r['gpu']}: {r['config']}: time per byte read = "
                f"{per_byte:.2f}x decode's"
            )
    for r in rows:
        if r["config"].endswith(" fp8"):
            d = decode[r["gpu"]]
            r["time vs bf16 decode"] = r["model us"] / d["model us"]
            print(
                f"{r['gpu']}: {r['config']}: est. {r['est. % of copy']:.1f}% of "
                f"copy, time {r['time vs bf16 decode']:.2f}x the bf16 decode's "
                "(half the bytes)"
            )
    write_step = Step("KV write, 16384 tokens", decode=16384)
    fn, args = attention_step(write_step, implementation="pallas_gpu", write="pallas")
    [write] = [m for m in triton_modules(fn, args) if "write" in m.name]
    writes = write_rows(
        write_step, {arch: compile_triton(write, arch) for arch in (80, 90)}
    )
    print_table("GPU KV write (Triton), compiled and modelled", writes)
    rows += writes
    print("\nGPU model constants: " + describe_gpu_model())
    h100 = [r for r in rows if r["gpu"].startswith("H100")]
    bandwidth = [
        r["est. % of copy"]
        for r in h100
        if r["config"] in ("decode 256x4096 block 16", "decode 4x32k block 16")
    ]
    prefill = [r for r in h100 if r["config"].startswith("mixed")]
    attention = [r for r in rows if "mma" in r]
    met = (
        all(r["spill bytes"] == 0 for r in rows)
        and all(r["shared KiB"] <= 163 for r in attention)
        and all(r["mma"] > 0 for r in h100 if "mma" in r)
        and all(p >= 80 for p in bandwidth)
        and all(r.get("time per byte vs decode", 1.0) <= 2 for r in prefill)
    )
    print(
        "target (sm_90; the same kernel built for sm_80): 0 spills, shared <= 163 "
        "KiB, mma in decode and prefill, an estimated >= 80% of copy bandwidth at "
        f"256 x 4096 and 4 x 32k ({', '.join(f'{p:.1f}%' for p in bandwidth)}): "
        f"{'met' if met else 'NOT met'} (a model, not a measurement)"
    )
    return rows, met


if __name__ == "__main__":
    main()
