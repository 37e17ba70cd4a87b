"""Paged attention as a Triton-lowered Pallas kernel (NVIDIA and AMD GPUs).

Shaped after FlashInfer's decode and jax's own
``jax.experimental.pallas.ops.gpu.paged_attention``, made ragged. A *row* is
up to ``query_tile`` consecutive query tokens of one request (a decode
token, or a tile of a prefill chunk); its ``tile x G`` query heads of one
KV head (GQA) are one block of the matrix product, padded to a power of two
and to at least 16 rows so that ``dot`` runs on tensor cores (bf16 / f16
operands, float32 accumulation). A program takes one such block of queries
(``grid (rows, KV heads x query blocks, splits)``) and walks the keys its
queries see (:func:`jaxkv.attention._call.row_plan`: causal, sliding
window, local chunk, cross-attention, keys past the table dropped)
``keys`` keys (64) a step, whatever the block size: key ``k`` is
token ``k % block_size`` of the page ``table[k // block_size]``, so a step
gathers several pages (block 16: four pages per step of 64 keys) or part of
one (block 128). Loads are masked to the keys some query of the block sees;
Triton's software pipeliner loads the next step's page ids, K and V
(``cp.async`` on sm_80 and newer) while one is computed: with 3 stages
the page ids take one, so K and V get one buffer each (read off the
compiled builds, ``benchmarks/kernel_report.py``).

When rows x KV heads would leave the GPU's SMs idle (a batch of one at 32k
context), the key range is *split* over programs (split-KV): each writes an
unnormalised partial output with its running max and denominator, and the
splits are merged afterwards (the log-sum-exp merge of FlashInfer and
FlashAttention's split-KV). Head dims, query heads per KV head and block
sizes that are not powers of two are padded by masked loads, never refused;
tile sizes are picked so that shared memory stays within an A100's 163 KB
(:func:`gpu_tiling`).

Every page is read in place from the layer's slot of a typed pool (the
pool reshaped to ``(L, *physical shape)``, a bitcast; the layer slot may be
traced, so one kernel serves every layer of a ``lax.scan``). A page id or
layer slot outside the pool is read clamped and poisons the queries that
see it with NaN, as XLA's gather fills it.

On CPU the same kernel runs in Pallas's interpret mode (``interpret=True``),
which is how CI checks it against XLA's path; ``benchmarks/kernel_report.py``
compiles its Triton module for sm_80 and sm_90 with PyPI's ``triton``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxkv._util import kernel_operands
from jaxkv.attention._call import (
    Call,
    kernel_call,
    layer_of,
    pallas_unfit,
    rows_to_tokens,
    scalar_scale,
)
from jaxkv.kv import PageLayout, Pools
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

_MASKED = -1e30  # finite: no inf - inf in the running max of an empty row
_DOT_MIN = 16  # tl.dot's smallest M, N and K
_LOG2E = math.log2(math.e)
SMEM_BUDGET = 160 * 1024
"""Shared memory a program may take: under an A100's 163 KB (an H100 has 227)."""
TARGET_SMS = 132
"""SMs the split-KV heuristic fills (an H100 SXM; the chip is unknown at trace)."""


def _cdiv(a: jax.Array, n: int) -> jax.Array:
    """``ceil(a / n)`` of a non-negative traced int (its own dtype, x64 or not)."""
    return (a + (n - 1)) // n


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


class GpuTiling(NamedTuple):
    """The static shape of one kernel launch (:func:`gpu_tiling`)."""

    groups_padded: int  # query heads per KV head, padded to a power of two
    queries: int  # query rows of a program (tile x G padded, >= 16)
    query_blocks: int  # programs per (row, KV head) along the query heads
    keys: int  # keys per loop step
    dk: int  # head dims padded to powers of two (>= 16)
    dv: int
    splits: int  # programs per (row, KV head, query block) along the keys
    num_warps: int
    num_stages: int

    def shared_bytes(self, itemsize: int) -> int:
        """Shared memory the pipelined K and V tiles take (Triton's own model)."""
        kv = self.num_stages * self.keys * (self.dk + self.dv) * itemsize
        return kv + self.queries * self.dk * itemsize


def gpu_tiling(
    *,
    rows: int,
    tile: int,
    groups: int,
    kv_heads: int,
    dk: int,
    dv: int,
    max_keys: int,
    itemsize: int,
) -> GpuTiling:
    """The launch shape of one call: query blocks, keys per step, splits.

    Query rows per program: ``tile x G`` padded, at most 64 (32 for value
    heads of 256: the float32 accumulator stays in registers). Keys per
    step: 64, with 3 pipeline stages, shrunk until K and V tiles fit
    :data:`SMEM_BUDGET`. Splits: enough programs to give each of
    :data:`TARGET_SMS` SMs four (a full wave of programs, balanced), no
    split shorter than four steps.

    Example:
      >>> from jaxkv.attention._pallas_gpu import gpu_tiling
      >>> t = gpu_tiling(rows=4, tile=1, groups=4, kv_heads=8, dk=128, dv=128,
      ...                max_keys=32768, itemsize=2)
      >>> t.queries, t.keys, t.num_stages, t.splits
      (16, 64, 3, 17)
      >>> t.shared_bytes(2) <= 163 * 1024
      True
    """
    gp = _pow2_at_least(groups)
    dkp, dvp = _pow2_at_least(dk, _DOT_MIN), _pow2_at_least(dv, _DOT_MIN)
    cap = 32 if dvp >= 256 else 64
    queries = min(_pow2_at_least(tile * gp, _DOT_MIN), max(cap, _DOT_MIN))
    query_blocks = -(-(tile * gp) // queries)
    keys, stages = 64, 3
    while True:
        t = GpuTiling(gp, queries, query_blocks, keys, dkp, dvp, 1, 4, stages)
        if t.shared_bytes(itemsize) <= SMEM_BUDGET:
            break
        if stages > 2:
            stages -= 1
        elif keys > _DOT_MIN:
            keys //= 2
        else:
            break
    programs = rows * kv_heads * query_blocks
    splits = 1
    if programs < 4 * TARGET_SMS:
        most = max(1, max_keys // (4 * keys))
        splits = max(1, min(-(-4 * TARGET_SMS // programs), most))
    warps = 8 if queries * dvp >= 64 * 128 else 4
    return t._replace(splits=splits, num_warps=warps)


def gpu_unfit(view: KVCacheView, call: Call, q_shape: tuple[int, ...]) -> str | None:
    """Why the GPU kernel cannot take this call (``None``: it can).

    Only the view's and mask's reasons (:func:`pallas_unfit`): block sizes,
    head dims, GQA ratios and query tiles of any size are padded; fp8 pages
    with static per-tensor scales are read and dequantized in the kernel.
    """
    del q_shape
    reason = pallas_unfit(view, call, fp8_per_tensor=True)
    if reason is None and view.kv_quant_mode == "fp8_per_tensor":
        arch = _cuda_arch()
        if arch is not None and arch < (8, 9):
            return (
                f"fp8 pages on sm_{arch[0]}{arch[1]} (Triton converts float8_e4m3 "
                "on sm_89 and newer)"
            )
    return reason


def _cuda_arch() -> tuple[int, int] | None:
    """The default CUDA device's compute capability, or ``None`` off CUDA."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = str(capability).split(".")[:2]
    return int(major), int(minor)


def gpu_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    call: Call,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``(T, H, Dv)`` attention of a ragged batch on the Triton kernel."""
    kc = kernel_call(q, pools, view, meta, call)
    heads, kvh, groups, dv, tile = kc.heads, kc.kv_heads, kc.groups, kc.dv, kc.tile
    cols = meta.block_table_tensor.shape[1]
    num_rows = kc.plan.info.shape[0]
    t = gpu_tiling(
        rows=num_rows,
        tile=tile,
        groups=groups,
        kv_heads=kvh,
        dk=kc.dk,
        dv=dv,
        max_keys=cols * view.block_size,
        itemsize=kc.lay.dtype.itemsize,
    )
    kernel = functools.partial(
        _kernel,
        lay=kc.lay,
        t=t,
        tile=tile,
        groups=groups,
        block_size=view.block_size,
        dk=kc.dk,
        dv=dv,
        # fp8 per-tensor pages: K's scale folds into the scores', V's into
        # the output (each is linear in its pages).
        scale=call.scale * scalar_scale(call.k_scale),
        v_scale=scalar_scale(call.v_scale),
        cap=call.logits_soft_cap,
        num_blocks=view.num_blocks,
    )
    programs = kvh * t.query_blocks
    operands, acc_shape = kernel_operands(
        (
            kc.plan.info,
            kc.plan.bounds,
            meta.block_table_tensor.astype(jnp.int32),
            layer_of(layer, view),
            q,
            kc.slots,
        ),
        (num_rows, t.splits, programs, t.queries, t.dv),
        jnp.float32,
    )
    _, stat_shape = kernel_operands(
        operands, (num_rows, t.splits, programs, t.queries), jnp.float32
    )
    out_shape = (acc_shape, stat_shape, stat_shape)
    acc_spec = pl.BlockSpec(
        (None, None, None, t.queries, t.dv), lambda r, p, s: (r, s, p, 0, 0)
    )
    stat_spec = pl.BlockSpec(
        (None, None, None, t.queries), lambda r, p, s: (r, s, p, 0)
    )
    acc, top, denom = pl.pallas_call(
        kernel,
        grid=(num_rows, programs, t.splits),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=(acc_spec, stat_spec, stat_spec),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=t.num_warps, num_stages=t.num_stages
        ),
        interpret=interpret,
        name="jaxkv_paged_attention_gpu",
    )(*operands)
    out = _merge(acc, top, denom)  # (R, programs, queries, Dv)
    gp = t.groups_padded
    out = out.reshape(num_rows, kvh, t.query_blocks * t.queries, t.dv)
    out = out[:, :, : tile * gp, :dv].reshape(num_rows, kvh, tile, gp, dv)
    out = out[:, :, :, :groups].transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_rows, tile, heads, dv)
    return rows_to_tokens(out, kc.plan.rows, kc.num_tokens, q.dtype)


def _merge(acc: jax.Array, top: jax.Array, denom: jax.Array) -> jax.Array:
    """The splits' partial softmaxes ``(R, S, ...)`` merged: ``(R, ...)``.

    One split: the kernel already divided by its denominator (``denom`` 1).
    """
    if acc.shape[1] == 1:
        return acc[:, 0]
    best = jnp.max(top, axis=1, keepdims=True)
    w = jnp.exp2(top - best)  # the kernel's max is in log2 units
    total = jnp.sum(w * denom, axis=1)
    out = jnp.sum(w[..., None] * acc, axis=1)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _kernel(
    info_ref,
    bounds_ref,
    table_ref,
    layer_ref,
    q_ref,
    pool_ref,
    acc_ref,
    top_ref,
    denom_ref,
    *,
    lay: PageLayout,
    t: GpuTiling,
    tile: int,
    groups: int,
    block_size: int,
    dk: int,
    dv: int,
    scale: float,
    v_scale: float,
    cap: float | None,
    num_blocks: int,
) -> None:
    r, p, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, qb = p // t.query_blocks, p % t.query_blocks
    gp, nq, nk = t.groups_padded, t.queries, t.keys
    req, start = info_ref[r, 0], info_ref[r, 1]
    num_tokens = q_ref.shape[0]

    # This program's queries: slot m = (token of the row, query head of h).
    m = qb * nq + jnp.arange(nq, dtype=jnp.int32)
    slot, g = m // gp, m % gp
    real = (slot < tile) & (g < groups)
    slot = jnp.minimum(slot, tile - 1)
    lo = pltriton.load(bounds_ref.at[r, slot, 0], mask=real, other=0)
    hi = pltriton.load(bounds_ref.at[r, slot, 1], mask=real, other=0)
    live = hi > lo
    first = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max))
    last = jnp.max(jnp.where(live, hi, 0))
    span = jnp.maximum(last - first, 0)
    per = _cdiv(_cdiv(span, t.splits), nk) * nk
    a = first + split * per
    b = jnp.minimum(last, a + per)
    steps = _cdiv(jnp.maximum(b - a, 0), nk)

    tok = start + slot
    d = jnp.arange(t.dk, dtype=jnp.int32)
    q_ok = real & (tok < num_tokens)
    q = pltriton.load(
        q_ref.at[
            jnp.minimum(tok, num_tokens - 1)[:, None],
            (h * groups + g)[:, None],
            d[None, :],
        ],
        mask=q_ok[:, None] & (d < dk)[None, :],
        other=0,
    )
    f32 = lay.dtype == jnp.float32
    # 8-bit pages are computed in bfloat16 (tensor cores; float32 sums).
    cdt = jnp.float32 if f32 else jnp.bfloat16 if lay.dtype.itemsize == 1 else lay.dtype
    q = q.astype(cdt)

    num_layers = lay.slots_shape[0]
    layer = layer_ref[0]
    layer_ok = (layer >= 0) & (layer < num_layers)
    layer = jnp.clip(layer, 0, num_layers - 1)
    v_at = dk if lay.fused else 0
    dv_idx = jnp.arange(t.dv, dtype=jnp.int32)

    def load(page, token, half, dims, width, mask):
        idx = lay.at(layer, page[:, None], h, half, dims[None, :], token=token[:, None])
        # An 8-bit float pool's masked lanes are filled as floats (Triton
        # casts no int to fp8).
        fp8_pool = jnp.issubdtype(pool_ref.dtype, jnp.floating) and (
            pool_ref.dtype.itemsize == 1
        )
        other = 0.0 if fp8_pool else 0
        x = pltriton.load(
            pool_ref.at[idx], mask=mask & (dims < width)[None, :], other=other
        )
        if x.dtype != lay.dtype:  # a bits pool: the same bytes, as floats
            x = jax.lax.bitcast_convert_type(x, lay.dtype)
        return x.astype(cdt)

    def dot(x, y, trans_b=False):
        return pltriton.dot(x, y, trans_b=trans_b, allow_tf32=False)

    def body(i, carry):
        top, denom, acc, bad_seen = carry
        key = a + i * nk + jnp.arange(nk, dtype=jnp.int32)
        col = key // block_size
        page = pltriton.load(table_ref.at[req, col], mask=key < b, other=0)
        bad = ~layer_ok | (page < 0) | (page >= num_blocks)
        page = jnp.clip(page, 0, num_blocks - 1)
        vis = (key[None, :] >= lo[:, None]) & (key[None, :] < hi[:, None])
        vis = vis & (key < b)[None, :]  # (nq, nk)
        seen = jnp.max(vis.astype(jnp.int32), axis=0) > 0  # (nk,)
        token = key % block_size
        k = load(page, token, 0, d, dk, seen[:, None])  # (nk, Dk), unseen 0
        s = dot(q, k, trans_b=True) * scale
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        s = jnp.where(vis, s * _LOG2E, _MASKED)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))
        w = jnp.where(vis, jnp.exp2(s - new_top[:, None]), 0.0)
        rescale = jnp.exp2(top - new_top)
        denom = denom * rescale + jnp.sum(w, axis=1)
        v = load(page, token, 1, dv_idx + v_at, v_at + dv, seen[:, None])
        acc = acc * rescale[:, None] + dot(w.astype(v.dtype), v)
        hit = jnp.max((vis & bad[None, :]).astype(jnp.int32), axis=1)
        return new_top, denom, acc, jnp.maximum(bad_seen, hit)

    init = (
        jnp.full((nq,), _MASKED, jnp.float32),
        jnp.zeros((nq,), jnp.float32),
        jnp.zeros((nq, t.dv), jnp.float32),
        jnp.zeros((nq,), jnp.int32),
    )
    top, denom, acc, bad_seen = jax.lax.fori_loop(0, steps, body, init)
    # A query that sees a key of a page or layer outside the pool reads NaN.
    acc = jnp.where(bad_seen[:, None] > 0, jnp.nan, acc)
    if v_scale != 1.0:
        acc = acc * v_scale
    if t.splits == 1:
        acc = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
    acc_ref[...] = acc
    top_ref[...] = top
    denom_ref[...] = denom
