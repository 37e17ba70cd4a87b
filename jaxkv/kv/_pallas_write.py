"""``write_kv`` as Pallas kernels: each new K/V byte moved once, into the pool in place.

The pool is an aliased operand (``input_output_aliases``; donated by
``write_kv``), seen as ``(L, *physical shape)`` (:class:`PageLayout`, a
bitcast), and never read: a kernel only stores the step's tokens at their
slots. A slot that is negative (padding), past the view's blocks, or in a
layer slot outside the pool writes nothing, as XLA's dropping scatter.

- GPU (Triton): one program per (token, KV head) stores that head's K and V
  rows at the token's slot.
- TPU (Mosaic): one grid step per token; the token's ``(H, D)`` K and V are
  DMA'd from VMEM into the slot's HBM rows (the slot ids and the layer ride
  in SMEM as scalar prefetch).

On CPU both run in their interpret modes (what CI checks against XLA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
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

    def kernel(slots_ref, layer_ref, k_ref, v_ref, _pool_in, pool_ref):
        t, h = pl.program_id(0), pl.program_id(1)
        slot, slot_layer = slots_ref[t], layer_ref[0]
        ok = _slot_ok(slot, slot_layer, lay, view)
        block, token = slot // view.block_size, slot % view.block_size

        @pl.when(ok)
        def _store():
            at = (slot_layer, block, h)
            pool_ref[_row(lay, *at, 0, 0, dk, token)] = k_ref[t, h, :]
            pool_ref[_row(lay, *at, 1, dk if lay.fused else 0, dv, token)] = v_ref[
                t, h, :
            ]

    operands, out_shape = kernel_operands(
        (slots, layer_index(layer, view).reshape(1), key, value, slots_arr),
        slots_arr.shape,
        slots_arr.dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid=(n, heads),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        input_output_aliases={4: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jaxkv_kv_write_gpu",
    )(*operands)
    return out.reshape(pool.shape)


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
    """The pool with the tokens' K/V stored at their slots (Mosaic TPU kernel)."""
    lay, key, value, slots_arr = _staged(pool, view, key, value)
    (n, heads, dk), dv = key.shape, value.shape[2]

    def kernel(slots_ref, layer_ref, k_ref, v_ref, _pool_in, pool_ref, sems):
        t = pl.program_id(0)
        slot, slot_layer = slots_ref[t], layer_ref[0]
        ok = _slot_ok(slot, slot_layer, lay, view)
        block, token = slot // view.block_size, slot % view.block_size

        @pl.when(ok)
        def _store():
            heads_all = slice(None)
            k_dst = pool_ref.at[
                _row(lay, slot_layer, block, heads_all, 0, 0, dk, token)
            ]
            v_at = dk if lay.fused else 0
            v_dst = pool_ref.at[
                _row(lay, slot_layer, block, heads_all, 1, v_at, dv, token)
            ]
            k_copy = pltpu.make_async_copy(k_ref, k_dst, sems.at[0])
            v_copy = pltpu.make_async_copy(v_ref, v_dst, sems.at[1])
            k_copy.start()
            v_copy.start()
            k_copy.wait()
            v_copy.wait()

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(n,),
        in_specs=[
            pl.BlockSpec((None, heads, dk), lambda t, *_: (t, 0, 0)),
            pl.BlockSpec((None, heads, dv), lambda t, *_: (t, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    operands, out_shape = kernel_operands(
        (slots, layer_index(layer, view).reshape(1), key, value, slots_arr),
        slots_arr.shape,
        slots_arr.dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        # Operand 4 counts the two scalar-prefetch operands.
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxkv_kv_write_tpu",
    )(*operands)
    return out.reshape(pool.shape)


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
