"""Where a layer's pages sit in its typed pool, as an array a kernel indexes.

A Pallas kernel takes a typed pool reshaped to ``(L, *physical shape)`` (a
bitcast: no copy) and indexes it by role: the layer slot, the block, the
K/V half, a token, a head, a range of the head dim, in whatever order the
view's strides lay them out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxkv.kv._quant import quant_unfit
from jaxkv.plan import KVCacheView

_KERNEL_DTYPES = (
    np.dtype(np.float32),
    np.dtype(jax.numpy.bfloat16),
    np.dtype(np.float16),
)


_FP8_DTYPES = (
    np.dtype(jax.numpy.float8_e4m3fn),
    np.dtype(jax.numpy.float8_e5m2),
)


def pallas_view_unfit(view: KVCacheView, *, fp8_per_tensor: bool = False) -> str | None:
    """Why jaxkv's Pallas kernels cannot address `view` (``None``: they can).

    They index a typed pool (``storage="typed"`` or ``"stacked"``, elements
    or their bits) by block, token, head and a range of the head dim (the
    innermost axis), in float32, bfloat16 or float16; MLA latents,
    head-packed layouts and kernel views of packed word pools stay on XLA's
    path. With `fp8_per_tensor` (a kernel that dequantizes them), fp8 pages
    of static per-tensor scales are taken too.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.llama_like_config(num_layers=2)
      >>> words = jaxkv.make_plan(cfg, num_blocks=4, storage="words")
      >>> jaxkv.kv.pallas_view_unfit(words.views["layers.0.self_attn"])[:11]
      'a word pool'
      >>> typed = jaxkv.make_plan(cfg, num_blocks=4, storage="stacked")
      >>> jaxkv.kv.pallas_view_unfit(typed.views["layers.0.self_attn"]) is None
      True
    """
    fp8 = fp8_per_tensor and view.kv_quant_mode == "fp8_per_tensor"
    if quant_unfit(view) and not fp8:
        return quant_unfit(view)
    if not view.typed:
        return (
            "a word pool (storage='words'): the Pallas kernels read typed pools "
            "(storage='typed' or 'stacked', the default off CPU)"
        )
    if view.kv_packing or view.owned is not None:
        return "a head-packing backend or a kernel view of a packed pool"
    if not {"block", "token", "head", "dim"} <= set(view.axes):
        return f"view axes {view.axes} (the kernels need block, token, head, dim)"
    if view.strides[view.dim("dim")] != 1:
        return "a head dim that is not contiguous"
    if view.dtype not in _KERNEL_DTYPES and not (fp8 and view.dtype in _FP8_DTYPES):
        return f"dtype {view.dtype} (the kernels read float32, bfloat16, float16)"
    return None


class PageLayout(NamedTuple):
    """Where one layer's pages sit in its typed pool, seen as an array.

    The pool reshaped to ``slots_shape`` (a bitcast: ``(L, *physical
    shape)``) holds element ``(block b, [kv half], token j, head h, dim d)``
    at the index :meth:`index` builds; a page of one head is ``(block_size,
    head dim)`` whatever the axis order.
    """

    slots_shape: tuple[int, ...]
    roles: tuple[str, ...]  # logical role of each dim after the layer dim
    head_size: int
    fused: bool  # K|V in one dim: K is [:head_size], V the rest
    dtype: np.dtype

    def at(self, layer, block, head, half: int, dim_slice, token: Any = None) -> tuple:
        """An index of the reshaped pool.

        One page (or one `token`) of one `head` (or all: ``slice(None)``), of K (`half`
        0) or V (1).
        """
        by_role = {
            "block": block,
            "kv": half,
            "token": slice(None) if token is None else token,
            "head": head,
            "dim": dim_slice,
        }
        return (layer, *(by_role[r] for r in self.roles))


def page_layout(view: KVCacheView, pool: jax.Array) -> PageLayout:
    """The :class:`PageLayout` of a typed `view` in `pool`."""
    order = tuple(sorted(range(len(view.shape)), key=lambda d: -view.strides[d]))
    phys = tuple(int(view.shape[d]) for d in order)
    roles = tuple(view.axes[d] for d in order)
    if roles[-1] != "dim":  # excluded by pallas_unfit
        raise ValueError("the head dim must be the innermost axis")
    per_slot = int(np.prod(phys))
    return PageLayout(
        slots_shape=(pool.size // per_slot, *phys),
        roles=roles,
        head_size=view.head_size or view.shape[view.dim("dim")],
        fused="kv" not in view.axes,
        dtype=np.dtype(view.dtype),
    )
