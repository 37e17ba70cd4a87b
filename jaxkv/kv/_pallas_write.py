"""``write_kv`` as Pallas kernels: each new K/V byte moved once, into the pool in place.

The pool is an aliased operand (``input_output_aliases``; donated by
``write_kv``), seen as ``(L, *physical shape)`` (:class:`PageLayout`, a
bitcast), and never read: a kernel only stores the step's tokens at their
slots. A slot that is negative (padding), past the view's blocks, or in a
layer slot outside the pool writes nothing, as XLA's dropping scatter.

- GPU (Triton): a program stores a few tokens' K and V rows of every head
  (a tile of up to 4,096 elements each, 16-byte vector stores along the
  head dim), masked where a slot is dropped or a dim padded.
- TPU (Mosaic): the tokens whose slots follow one another inside a page
  form runs; each run moves HBM to HBM in one DMA per set bit of its length
  (a page's prefill in one, a decode token in one), every DMA started
  before any is waited on (the slots, run lengths and layer ride in SMEM
  as scalar prefetch).

On CPU both run in their interpret modes (what CI checks against XLA).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxkv._util import kernel_operands
from jaxkv.kv._checks import layer_index
from jaxkv.kv._page_layout import PageLayout, page_layout
from jaxkv.kv._strided import to_bits
from jaxkv.plan import KVCacheView


class _Staged(NamedTuple):
    """A write's operands as its kernel takes them."""

    lay: PageLayout
    key: jax.Array  # (n, H, Dk) in the pool's storage type
    value: jax.Array  # (n, H, Dv)
    slots: jax.Array  # the pool as (L, *physical shape): a bitcast


def _staged(
    pool: jax.Array, view: KVCacheView, key: jax.Array, value: jax.Array
) -> _Staged:
    """K and V in the pool's storage type (the floats' bits for a bits pool)."""
    key = key.astype(view.dtype)
    value = value.astype(view.dtype)
    if pool.dtype != view.dtype:
        key, value = to_bits(key), to_bits(value)
    lay = page_layout(view, pool)
    return _Staged(lay, key, value, pool.reshape(lay.slots_shape))


def gpu_write(
    pool: jax.Array,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array,
    slots: jax.Array,
    layer: object,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The pool with the tokens' K/V stored at their slots (Triton kernel)."""
    lay, key, value, slots_arr = _staged(pool, view, key, value)
    (n, heads, dk), dv = key.shape, value.shape[2]
    t = gpu_write_tiling(n, heads, dk, dv)
    block_dim = 1 + lay.roles.index("block")
    past_end = lay.slots_shape[block_dim]  # an index every scatter drops

    def kernel(slots_ref, layer_ref, k_ref, v_ref, _pool_in, pool_ref):
        tok = pl.program_id(0) * t.tokens + jnp.arange(t.tokens, dtype=jnp.int32)
        live = tok < n
        tok = jnp.minimum(tok, n - 1)
        slot = pltriton.load(slots_ref.at[tok], mask=live, other=-1)
        slot_layer = layer_ref[0]
        ok = live & _slot_ok(slot, slot_layer, lay, view)
        slot = jnp.where(ok, slot, 0)
        bs = jnp.asarray(view.block_size, slot.dtype)  # one dtype, 64-bit on
        block = jax.lax.div(slot, bs)
        token = jax.lax.rem(slot, bs)
        slot_layer = jnp.clip(slot_layer, 0, lay.slots_shape[0] - 1)
        h = jnp.arange(t.heads, dtype=jnp.int32)[None, :, None]
        for half, src, width, pad, at in (
            (0, k_ref, dk, t.dk, 0),
            (1, v_ref, dv, t.dv, dk if lay.fused else 0),
        ):
            d = jnp.arange(pad, dtype=jnp.int32)[None, None, :]
            rows = ok[:, None, None] & (h < heads)  # (tokens, heads, 1)
            mask = rows & (d < width) if pad > width else rows
            x = pltriton.load(
                src.at[tok[:, None, None], jnp.minimum(h, heads - 1), d],
                mask=mask,
                other=0,
            )
            # A dropped token's or padded head's lanes point past the pool:
            # Triton skips them, the interpreter's scatter drops them (never
            # a stale write-back over another token's row). A padded dim's
            # lanes stay in their own row: K's run into V's, stored after.
            where = jnp.where(rows, block[:, None, None], past_end)
            idx = lay.at(slot_layer, where, h, half, d + at, token=token[:, None, None])
            pltriton.store(pool_ref.at[idx], x, mask=mask)

    operands, out_shape = kernel_operands(
        (slots, layer_index(layer, view).reshape(1), key, value, slots_arr),
        slots_arr.shape,
        slots_arr.dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, t.tokens),),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        input_output_aliases={4: 0},
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=1),
        interpret=interpret,
        name="jaxkv_kv_write_gpu",
    )(*operands)
    return out.reshape(pool.shape)


class GpuWriteTiling(NamedTuple):
    """The static shape of the GPU write (:func:`gpu_write_tiling`)."""

    tokens: int  # tokens per program
    heads: int  # KV heads, padded to a power of two
    dk: int  # head dims, padded
    dv: int
    num_warps: int


def gpu_write_tiling(n: int, heads: int, dk: int, dv: int) -> GpuWriteTiling:
    """Tokens per program: every head of each, 4,096 elements a tile at most.

    Example:
      >>> from jaxkv.kv._pallas_write import gpu_write_tiling
      >>> gpu_write_tiling(16384, 8, 128, 128)
      GpuWriteTiling(tokens=4, heads=8, dk=128, dv=128, num_warps=4)
    """
    hp = _pow2_at_least(heads)
    dkp, dvp = _pow2_at_least(dk), _pow2_at_least(dv)
    per_token = hp * max(dkp, dvp)
    tokens = max(1, min(_pow2_at_least(n), 4096 // per_token))
    warps = 4 if tokens * per_token >= 1024 else 1
    return GpuWriteTiling(tokens, hp, dkp, dvp, warps)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def mosaic_dtype_unfit(view: KVCacheView) -> str | None:
    """Why Mosaic's TPU kernels cannot take `view`'s dtype (``None``: they can).

    Mosaic takes kernel arguments of bfloat16, 8-bit floats and 32-bit
    types only: float16 pages (or their bits) are left to XLA's path on a
    TPU (found compiling the case matrix for v5e and v6e).

    Example:
      >>> import jaxkv
      >>> from jaxkv.kv._pallas_write import mosaic_dtype_unfit
      >>> cfg = jaxkv.llama_like_config(num_layers=1, dtype="float16")
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4, storage="stacked")
      >>> mosaic_dtype_unfit(plan.views["layers.0.self_attn"])[:15]
      'float16 pages ('
    """
    if view.dtype == jnp.float16:
        return (
            "float16 pages (Mosaic's TPU kernels take bfloat16 and 32-bit "
            "types; XLA's path runs float16)"
        )
    return None


def tpu_write_unfit(view: KVCacheView) -> str | None:
    """Why the TPU write cannot take `view` (``None``: it can).

    A TPU tiles an array's last two dims in HBM; a DMA must start on a tile.
    A token-major page ``(N, H, D)`` stores a token as whole tiles of its
    ``(H, D)``; a head-first page ``(H, N, D)`` puts tokens in the tiled
    dims, where one token's write starts mid-tile.

    Example:
      >>> import jaxkv
      >>> from jaxkv.kv._pallas_write import tpu_write_unfit
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1),
      ...                        num_blocks=4, storage="stacked")
      >>> tpu_write_unfit(plan.views["layers.0.self_attn"]) is None
      True
    """
    reason = mosaic_dtype_unfit(view)
    if reason is not None:
        return reason
    order = sorted(range(len(view.shape)), key=lambda d: -view.strides[d])
    if view.axes[order[-2]] == "token":
        return (
            "tokens in a page's tiled dims (a head-first page: one token's "
            "write starts mid-tile, which a TPU DMA cannot)"
        )
    return None


def tpu_write(
    pool: jax.Array,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array,
    slots: jax.Array,
    layer: object,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The pool with the tokens' K/V stored at their slots (Mosaic TPU kernel).

    Tokens whose slots continue one another inside one page form a *run*; a
    run of ``L`` tokens is moved HBM to HBM by one DMA per set bit of ``L``
    (block 16: a whole page's prefill in one DMA, a decode token in one),
    all started before any is waited on.
    """
    lay, key, value, slots_arr = _staged(pool, view, key, value)
    n = key.shape[0]
    bs = view.block_size
    layer_arr = layer_index(layer, view).reshape(1)
    ok = _slot_ok(slots, layer_arr[0], lay, view)
    runs = run_lengths(slots, ok, bs)
    # The new tokens in the order a page lays out its non-block axes, so a
    # run of them is the same shape at both ends of its DMA.
    roles = [r for r in lay.roles if r not in ("block", "kv")]
    order = [("token", "head", "dim").index(r) for r in roles]
    halves = [jnp.concatenate([key, value], axis=-1)] if lay.fused else [key, value]
    halves = [jnp.transpose(x, order) for x in halves]
    token_axis = roles.index("token")
    # Run lengths' bits (a run is at most a page and at most the tokens).
    pieces = tuple(reversed(range(min(bs, n).bit_length())))

    def kernel(slots_ref, runs_ref, layer_ref, *refs):
        srcs, (_pool_in, pool_ref, sem) = refs[: len(halves)], refs[len(halves) :]
        slot_layer = jnp.clip(layer_ref[0], 0, lay.slots_shape[0] - 1)

        def dmas(t, go):
            length = runs_ref[t]
            slot = jnp.maximum(slots_ref[t], 0).astype(jnp.int32)
            # lax.div, not //: jnp's floor division lowers through sign,
            # which needs the TPU's generation at lowering.
            size = jnp.int32(bs)
            block, token = jax.lax.div(slot, size), jax.lax.rem(slot, size)
            at = jnp.int32(0)
            for bit in pieces:
                size = 1 << bit
                has = jax.lax.bitwise_and(length, jnp.int32(size)) != 0
                for h, src in enumerate(srcs):
                    src_at: list[Any] = [slice(None)] * len(roles)
                    src_at[token_axis] = pl.ds(t + at, size)
                    dst = pool_ref.at[
                        lay.at(
                            slot_layer,
                            block,
                            slice(None),
                            h,
                            slice(None),
                            token=pl.ds(token + at, size),
                        )
                    ]
                    copy = pltpu.make_async_copy(src.at[tuple(src_at)], dst, sem.at[0])
                    pl.when(has)(copy.start if go else copy.wait)
                at = at + jnp.where(has, jnp.int32(size), jnp.int32(0))

        def start(t, carry):
            dmas(t, True)
            return carry

        def wait(t, carry):
            dmas(t, False)
            return carry

        jax.lax.fori_loop(0, n, start, 0)
        jax.lax.fori_loop(0, n, wait, 0)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(1,),
        in_specs=[any_spec] * (len(halves) + 1),
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
    )
    operands, out_shape = kernel_operands(
        (slots, runs, layer_arr, *halves, slots_arr),
        slots_arr.shape,
        slots_arr.dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        # The pool's operand index counts the three scalar-prefetch operands.
        input_output_aliases={3 + len(halves): 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="jaxkv_kv_write_tpu",
    )(*operands)
    return out.reshape(pool.shape)


def run_lengths(slots: jax.Array, ok: jax.Array, block_size: int) -> jax.Array:
    """Per token: the length of the run of slots it starts (0 if none).

    A run is tokens whose slots follow one another inside one page
    (``slot[t + 1] == slot[t] + 1``, not crossing a page boundary); tokens
    that write nothing (`ok` false) start no run and end the one before.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxkv.kv._pallas_write import run_lengths
      >>> slots = jnp.array([14, 15, 16, 17, 40, -1, 41, 3])
      >>> ok = slots >= 0
      >>> run_lengths(slots, ok, 16).tolist()
      [2, 0, 2, 0, 1, 0, 1, 1]
    """
    n = slots.shape[0]
    prev_ok = jnp.concatenate([jnp.zeros((1,), bool), ok[:-1]])
    prev = jnp.concatenate([jnp.full((1,), -2, slots.dtype), slots[:-1]])
    cont = ok & prev_ok & (slots == prev + 1) & (slots % block_size != 0)
    idx = jnp.arange(n, dtype=jnp.int32)
    # The first token after t that does not continue t's run.
    brk = jnp.where(jnp.logical_not(cont), idx, n)
    nxt = jnp.concatenate([brk[1:], jnp.full((1,), n, jnp.int32)])
    end = jax.lax.cummin(nxt, reverse=True)
    return jnp.where(ok & jnp.logical_not(cont), end - idx, 0).astype(jnp.int32)


def _slot_ok(slot, slot_layer, lay: PageLayout, view: KVCacheView):
    blocks = view.num_blocks * view.block_size
    return (
        (slot >= 0)
        & (slot < blocks)
        & (slot_layer >= 0)
        & (slot_layer < lay.slots_shape[0])
    )


def _row(lay: PageLayout, layer, block, head, half: int, at: int, width: int, token):
    return lay.at(layer, block, head, half, pl.ds(at, width), token=token)
