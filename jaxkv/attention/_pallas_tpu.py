"""Paged attention as a Mosaic TPU Pallas kernel: many pages per DMA wave.

The design follows tpu-inference's ragged paged attention v3
(``kernels/ragged_paged_attention/v3/kernel.py``) and jax's
``pallas.ops.tpu.ragged_paged_attention``: the grid is one step per query
row (up to ``query_tile`` consecutive query tokens of one request), and a
row walks only its own page columns ``[first, end)`` (those holding a key
one of its queries sees: :func:`jaxkv.attention._call.row_plan`), in
*waves* of ``pages_per_wave`` pages. A wave's pages are DMA'd from the
pool in HBM (left there: ``memory_space=pl.ANY``, never copied, converted
or sliced outside the kernel) into one half of a double buffer in VMEM, all
on that half's one semaphore, while the previous wave is computed; the
last wave of a row starts the next row's first wave, so the DMA engine
never waits for a grid step to begin. The block table, each row's request
and page range and the layer slot ride in SMEM as scalar prefetch; a page
id or layer slot outside the pool is DMA'd clamped and reads as NaN, as
XLA's gather fills it.

A head-first page ``(H, N, D)`` (vLLM's HND) gives a KV head's keys as a
leading index of the wave; a token-major page ``(N, H, D)`` (NHD, jaxkv's
default) as one sublane of every token. Where the head dim is 128 lanes, the
kernel reads the wave as 32-bit words and picks a head's rows
of every token with one strided load (two bf16 heads a word, split by a
shift: RPA v3 reads its K/V-packed pages the same way; a fused page's K and
V lane halves are DMA'd into buffers of their own for it,
:func:`strided_heads`); otherwise it gathers them in vregs. The pool is
never relaid out: its HBM tiles are the page's own. A full wave is waited
for with one wait per buffer. A wave is
computed per KV head as one matmul of the row's ``tile * G``
query heads of that KV head (GQA packed into the matmul's rows) against
every key of the wave (``pages_per_wave * block_size`` of them), bf16 pages
as bf16 on the MXU with float32 accumulation, with an online softmax kept
in VMEM scratch. fp8 pages with static per-tensor scales (issue 58) are
DMA'd as their bytes (half a bf16 wave's) and converted to bf16 in VMEM
(exact: every e4m3 / e5m2 value is a bf16 one); heads of 128 lanes are
loaded by stride four to a 32-bit word and split by shifts. K's scale folds
into the score scale, V's into the output.

The wave size is data (:data:`TPU_TUNING`): bytes of K/V per wave by chip,
within the VMEM every chip jaxkv compiles for gives a kernel by default.
On CPU the kernel runs in Pallas's interpret mode, which is how CI checks
it against XLA's path; ``benchmarks/kernel_report.py`` compiles it for
v5e and v6e and states its bandwidth model.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv._util import kernel_operands
from jaxkv.attention._call import (
    Call,
    kernel_call,
    layer_of,
    pallas_unfit,
    rows_to_tokens,
    scalar_scale,
)
from jaxkv.kv import PageLayout, Pools, mosaic_dtype_unfit
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

_MASKED = -1e30


class TpuTuning(NamedTuple):
    """How the TPU kernel sizes its DMA waves on one chip.

    ``wave_bytes``: K/V bytes a wave aims at (its pages in flight at once);
    ``max_pages``: the most pages in one wave (each is one DMA, unrolled);
    ``vmem_budget``: the VMEM the double buffer may take.
    """

    wave_bytes: int
    max_pages: int
    vmem_budget: int


TPU_TUNING: dict[str, TpuTuning] = {
    # 16 MiB of scoped VMEM by default on v5e, 32 MiB on v6e; the double
    # buffer stays within a quarter of it (queries, outputs and the
    # softmax state take the rest).
    "v5e": TpuTuning(wave_bytes=1 << 20, max_pages=64, vmem_budget=4 << 20),
    "v6e": TpuTuning(wave_bytes=2 << 20, max_pages=64, vmem_budget=8 << 20),
}
"""The TPU kernel's wave sizes by chip. A program compiled without knowing
its chip (the usual case: ``jax.jit`` lowers before it sees a device) takes
the smallest entry, which every chip in the table can run."""


def tpu_unfit(view: KVCacheView, call: Call, q_shape: tuple[int, ...]) -> str | None:
    """Why the TPU kernel cannot take this call (``None``: it can).

    On top of :func:`pallas_unfit`: float16 pages (:func:`mosaic_dtype_unfit`).
    fp8 pages with static per-tensor scales are read and dequantized in the
    kernel.
    """
    del q_shape
    return pallas_unfit(view, call, fp8_per_tensor=True) or mosaic_dtype_unfit(view)


def pages_per_wave(page_bytes: int, cols: int, tuning: TpuTuning | None = None) -> int:
    """Pages per DMA wave for pages of `page_bytes` in a table of `cols` columns.

    Example:
      >>> from jaxkv.attention._pallas_tpu import pages_per_wave
      >>> pages_per_wave(64 << 10, cols=256)  # bf16, block 16, 8 KV heads of 128
      16
      >>> pages_per_wave(256 << 10, cols=2)  # never more than the table holds
      2
    """
    t = tuning or min(TPU_TUNING.values(), key=lambda t: t.vmem_budget)
    pages = max(1, t.wave_bytes // max(page_bytes, 1))
    pages = min(pages, t.max_pages, max(1, t.vmem_budget // (2 * page_bytes)))
    return max(1, min(pages, cols))


def tpu_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    call: Call,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``(T, H, Dv)`` attention of a ragged batch on the Mosaic TPU kernel."""
    kc = kernel_call(q, pools, view, meta, call)
    num_tokens, heads, kvh, groups = kc.num_tokens, kc.heads, kc.kv_heads, kc.groups
    dk, dv, tile, plan, lay, slots = kc.dk, kc.dv, kc.tile, kc.plan, kc.lay, kc.slots
    head_dim = q.shape[2]
    m = tile * groups
    rows = plan.rows
    num_rows = plan.info.shape[0]
    cols = meta.block_table_tensor.shape[1]
    # Queries as (row, KV head, tile * G, D): one 2-D matmul per KV head.
    tok = jnp.where(rows.valid, rows.tok, 0)
    qr = q[tok].reshape(num_rows, tile, kvh, groups, head_dim)
    qr = jnp.transpose(qr, (0, 2, 1, 3, 4)).reshape(num_rows, kvh, m, head_dim)
    bounds = jnp.repeat(plan.bounds, groups, axis=1)  # (R, tile * G, 2)
    page_shape = page_block_shape(lay)
    # Pages stay in the pool's own shape: merging a token-major page's heads
    # into its lanes, (N, H, D) -> (N, H * D), is no bitcast on a TPU (its
    # HBM tiles are (8, 128) over the last two dims): XLA would relayout the
    # whole pool on every call (tests/test_tpu_compile.py checks it does not).
    page_bytes = (1 if lay.fused else 2) * slots.dtype.itemsize * math.prod(page_shape)
    # Token-major pages whose heads a strided load can pick: a fused page's
    # K and V lane halves are DMA'd into buffers of their own (a strided
    # load takes a buffer 128 lanes wide per row of words, not 2 x 128).
    token_major = lay.roles.index("token") < lay.roles.index("head")
    split = (
        lay.fused
        and token_major
        and dk == dv
        and strided_heads((*page_shape[:-1], dk), slots.dtype) > 0
    )
    if split:
        page_shape = (*page_shape[:-1], dk)
    halves = 2 if split or not lay.fused else 1
    wave = (
        min(call.pages_per_chunk, cols)
        if call.pages_per_chunk
        else pages_per_wave(page_bytes, cols)
    )
    kernel = functools.partial(
        _kernel,
        lay=lay,
        kvh=kvh,
        block_size=view.block_size,
        dk=dk,
        split=split,
        cols=cols,
        wave=wave,
        # fp8 per-tensor pages: K's scale folds into the scores', V's into
        # the output (both linear in the online softmax).
        scale=call.scale * scalar_scale(call.k_scale),
        v_scale=scalar_scale(call.v_scale),
        cap=call.logits_soft_cap,
        num_blocks=view.num_blocks,
    )
    row = lambda r, *_: (r, 0, 0, 0)  # noqa: E731
    buffers = [pltpu.VMEM((2, wave, *page_shape), slots.dtype)] * halves
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_rows,),
        in_specs=[
            pl.BlockSpec((None, m, 2), lambda r, *_: (r, 0, 0)),
            pl.BlockSpec((None, kvh, m, head_dim), row),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, kvh, m, dv), row),
        scratch_shapes=[
            *buffers,
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((1,), jnp.int32),  # the buffer half the row's wave 0 is in
            pltpu.VMEM((kvh, m, 1), jnp.float32),
            pltpu.VMEM((kvh, m, 1), jnp.float32),
            pltpu.VMEM((kvh, m, dv), jnp.float32),
        ],
    )
    operands, out_shape = kernel_operands(
        (
            plan.info.reshape(-1),
            meta.block_table_tensor.astype(jnp.int32).reshape(-1),
            layer_of(layer, view),
            bounds,
            qr,
            slots,
        ),
        (num_rows, kvh, m, dv),
        jnp.float32,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            # Sequential: a row's last wave prefetches the next row's first.
            dimension_semantics=("arbitrary",)
        ),
        interpret=interpret,
        name="jaxkv_paged_attention_tpu",
    )(*operands)
    out = out.reshape(num_rows, kvh, tile, groups, dv)
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(num_rows, tile, heads, dv)
    return rows_to_tokens(out, rows, num_tokens, q.dtype)


def page_block_shape(lay: PageLayout) -> tuple[int, ...]:
    """One page of one K/V half (all its heads), as the pool lays it out."""
    return tuple(
        lay.slots_shape[1 + i]
        for i, r in enumerate(lay.roles)
        if r not in ("block", "kv")
    )


def strided_heads(buf_shape: tuple[int, ...], dtype: jnp.dtype) -> int:
    """KV heads one strided load gives out of token-major pages (0: none).

    A wave buffer ``(2, wave, N, H, D)`` of 32-bit words (two 16-bit heads a
    word, as a TPU packs 16-bit rows in pairs) read every ``H / pack``-th
    row: one head's (or, for 16-bit pages, two heads') rows of every token
    in one strided load, and no per-head gather over the whole wave. It
    needs rows of 128 lanes (``D == 128``: Mosaic's strided load takes a
    buffer exactly 128 lanes wide), 8-, 16- or 32-bit elements, and a head
    count that is a multiple of the heads a word holds (4 of 8-bit, 2 of
    16-bit).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxkv.attention._pallas_tpu import strided_heads
      >>> strided_heads((2, 16, 16, 8, 128), jnp.dtype(jnp.bfloat16))
      2
      >>> strided_heads((2, 16, 16, 8, 128), jnp.dtype(jnp.float32))
      1
      >>> strided_heads((2, 16, 16, 8, 128), jnp.dtype(jnp.float8_e4m3fn))
      4
      >>> strided_heads((2, 16, 16, 8, 256), jnp.dtype(jnp.bfloat16))  # lanes
      0
    """
    heads, dim, item = buf_shape[-2], buf_shape[-1], jnp.dtype(dtype).itemsize
    if dim != 128 or item not in (1, 2, 4):
        return 0
    pack = 4 // item
    return pack if heads % pack == 0 else 0


def _strided_rows(buf, half_slot, word_row: int, pack: int, dtype) -> list[jax.Array]:
    """The ``pack`` heads in 32-bit row `word_row` of each token, ``(wave * N, D)``.

    The buffer's half as 32-bit words ``(wave * N * H / pack, 128)`` and a
    load of every ``H / pack``-th row (Mosaic's strided loads take 32-bit
    data from a buffer 128 lanes wide: tpu-inference's RPA v3 reads its
    K/V-interleaved pages the same way); 16-bit heads are then the low (even
    head) and high (odd head) halves of each word, 8-bit heads its bytes
    (head ``4 * row + k`` in byte ``k``, as the TPU packs 8-bit rows in
    fours).
    """
    _, wave, tokens, heads, dim = buf.shape
    words = buf.bitcast(jnp.uint32) if pack > 1 else buf
    per = heads // pack
    flat = words.at[half_slot].reshape(wave * tokens * per, dim)
    x = flat[pl.ds(word_row, wave * tokens, stride=per), :]
    if pack == 1:
        return [x if x.dtype == dtype else pltpu.bitcast(x, dtype)]
    if pack == 4:  # 8-bit heads: byte k of each word is head 4 * row + k
        return [
            pltpu.bitcast(((x >> (8 * k)) & 0xFF).astype(jnp.uint8), dtype)
            for k in range(4)
        ]
    low = x.astype(jnp.uint16)
    high = (x >> 16).astype(jnp.uint16)
    return [pltpu.bitcast(low, dtype), pltpu.bitcast(high, dtype)]


def _kernel(
    info_ref,
    table_ref,
    layer_ref,
    bounds_ref,
    q_ref,
    pool_ref,
    o_ref,
    *scratch,
    lay: PageLayout,
    kvh: int,
    block_size: int,
    dk: int,
    split: bool,
    cols: int,
    wave: int,
    scale: float,
    v_scale: float,
    cap: float | None,
    num_blocks: int,
) -> None:
    halves = 2 if split or not lay.fused else 1
    bufs = scratch[:halves]
    sems, half_ref, top_ref, denom_ref, acc_ref = scratch[halves:]
    num_layers = lay.slots_shape[0]
    r = pl.program_id(0)
    num_rows = pl.num_programs(0)
    layer = layer_ref[0]
    layer_ok = (layer >= 0) & (layer < num_layers)
    layer_c = jnp.clip(layer, 0, num_layers - 1)

    def waves_of(row):
        first, end = info_ref[4 * row + 2], info_ref[4 * row + 3]
        # lax.div, not //: jnp's floor division lowers through sign, which
        # needs the TPU's generation at lowering (absent on a compile host).
        pages = jnp.maximum(end - first, 0).astype(jnp.int32)
        return jax.lax.div(pages + (wave - 1), jnp.int32(wave))

    def page_at(row, w, i):
        """Page id (raw), whether the column is live, for page `i` of wave `w`."""
        req, first = info_ref[4 * row], info_ref[4 * row + 2]
        end = info_ref[4 * row + 3]
        col = first + w * wave + i
        page = table_ref[req * cols + jnp.minimum(col, cols - 1)]
        return page, col < end

    def copies(row, w, half_slot):
        """The DMAs of wave `w` of `row` into buffer half `half_slot`."""
        out = []
        for i in range(wave):
            page, live = page_at(row, w, i)
            page = jnp.clip(page, 0, num_blocks - 1)
            for h, buf in enumerate(bufs):
                lanes = slice(h * dk, (h + 1) * dk) if split else slice(None)
                src = pool_ref.at[lay.at(layer_c, page, slice(None), h, lanes)]
                dst = buf.at[half_slot, i]
                out.append((live, pltpu.make_async_copy(src, dst, sems.at[half_slot])))
        return out

    def start(row, w, half_slot):
        for live, cp in copies(row, w, half_slot):
            pl.when(live)(cp.start)

    def wait(row, w, half_slot):
        # A full wave is waited for at once: its DMAs all signal the half's
        # one semaphore, and a wait takes the bytes of the descriptor given.
        _, full = page_at(row, w, wave - 1)

        @pl.when(full)
        def _whole():
            for buf in bufs:
                whole = buf.at[half_slot]
                pltpu.make_async_copy(whole, whole, sems.at[half_slot]).wait()

        @pl.when(jnp.logical_not(full))
        def _page_by_page():
            for live, cp in copies(row, w, half_slot):
                pl.when(live)(cp.wait)

    n_waves = waves_of(r)

    @pl.when(r == 0)
    def _first_row():
        half_ref[0] = 0
        start(r, 0, 0)  # pages past the row's end start nothing

    top_ref[...] = jnp.full(top_ref.shape, _MASKED, jnp.float32)
    denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    h0 = half_ref[0]
    lo = bounds_ref[:, 0:1]  # (M, 1)
    hi = bounds_ref[:, 1:2]
    m = lo.shape[0]
    width = wave * block_size

    def body(w, carry):
        half_slot = jax.lax.rem((h0 + w).astype(jnp.int32), jnp.int32(2))

        @pl.when(w + 1 < n_waves)
        def _next_wave():
            start(r, w + 1, 1 - half_slot)

        @pl.when((w + 1 == n_waves) & (r + 1 < num_rows))
        def _next_row():
            start(r + 1, 0, 1 - half_slot)

        wait(r, w, half_slot)
        _compute(w, half_slot)
        return carry

    def _compute(w, half_slot):
        first = info_ref[4 * r + 2]
        base = (first + w * wave) * block_size
        j = base + jax.lax.broadcasted_iota(jnp.int32, (m, width), 1)
        vis = (j >= lo) & (j < hi)  # (M, wave * N)
        seen = jnp.max(vis.astype(jnp.float32), axis=0, keepdims=True) > 0
        # Pages outside the pool (or a layer slot outside it) read as NaN.
        which = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
        bad = jnp.zeros((1, width), jnp.bool_)
        for i in range(wave):
            page, _ = page_at(r, w, i)
            ok = layer_ok & (page >= 0) & (page < num_blocks)
            in_page = (which >= i * block_size) & (which < (i + 1) * block_size)
            bad = bad | (in_page & jnp.logical_not(ok))

        head_first = lay.roles.index("head") < lay.roles.index("token")
        strided = not head_first and strided_heads(bufs[0].shape, bufs[0].dtype)
        loaded: dict[tuple[int, int], list[jax.Array]] = {}

        def head_rows(b, h):
            """``(wave * N, D)``: KV head `h`'s rows of the wave in buffer `b`."""
            buf = bufs[b]
            if strided:
                if (b, h // strided) not in loaded:
                    loaded[b, h // strided] = _strided_rows(
                        buf, half_slot, h // strided, strided, lay.dtype
                    )
                return loaded[b, h // strided][h % strided]
            if head_first:  # (wave, H, N, D): a head is a leading index
                x = buf[half_slot, :, h]
            else:  # (wave, N, H, D): the head's sublane of every token
                x = buf[half_slot][:, :, h]
            if x.dtype != lay.dtype:  # a bits pool: the same bytes, as floats
                x = jax.lax.bitcast_convert_type(x, lay.dtype)
            return x.reshape(x.shape[0] * x.shape[1], x.shape[2])

        # bf16 pages meet the MXU as bf16 (float32 accumulation), and fp8
        # pages too (every e4m3 / e5m2 value is a bf16 one); float32 pages
        # in float32.
        mxu = jnp.bfloat16 if lay.dtype.itemsize < 4 else jnp.float32
        # Explicit, whatever jax_default_matmul_precision says: bf16 operands
        # take one MXU pass (a float32 contract precision would refuse them).
        precision = (
            jax.lax.Precision.DEFAULT
            if mxu == jnp.bfloat16
            else jax.lax.Precision.HIGHEST
        )
        for h in range(kvh):
            heads = [head_rows(b, h) for b in range(halves)]  # (wave * N, D)
            fused = lay.fused and not split
            k = (heads[0][:, :dk] if fused else heads[0]).astype(mxu)
            v = (heads[0][:, dk:] if fused else heads[1]).astype(mxu)
            q = q_ref[h].astype(mxu)  # (M, Dk)
            s = jax.lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            s = s * scale
            if cap is not None:
                s = cap * jnp.tanh(s / cap)
            s = jnp.where(bad, jnp.nan, s)
            s = jnp.where(vis, s, _MASKED)
            top = top_ref[h]  # (M, 1)
            new_top = jnp.maximum(top, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(vis, jnp.exp(s - new_top), 0.0)
            rescale = jnp.exp(top - new_top)
            denom_ref[h] = denom_ref[h] * rescale + jnp.sum(p, axis=1, keepdims=True)
            # Keys no query of the row sees may be stale or NaN: zero them,
            # as their weight 0 times NaN is NaN.
            v = jnp.where(seen.T, v, jnp.zeros((), mxu))
            pv = jax.lax.dot_general(
                p.astype(mxu),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            acc_ref[h] = acc_ref[h] * rescale + pv
            top_ref[h] = new_top

    jax.lax.fori_loop(0, n_waves, body, 0)

    @pl.when((n_waves == 0) & (r + 1 < num_rows))
    def _next_row_from_empty():
        start(r + 1, 0, h0)

    half_ref[0] = jax.lax.rem((h0 + n_waves).astype(jnp.int32), jnp.int32(2))
    denom = denom_ref[...]
    out = acc_ref[...] / jnp.where(denom > 0, denom, 1.0)
    o_ref[...] = out * v_scale if v_scale != 1.0 else out
