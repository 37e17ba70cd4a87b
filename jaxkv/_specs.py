"""KV-cache specs: what one layer stores per block, and how many bytes a page takes.

Specs are frozen, hashable, leafless pytrees. Equality is structural and ignores
``is_draft``, so a draft layer and a target layer with the same cache description
compare equal and group together (spec §1.1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, dataclass_transform

import jax
import numpy as np
from jax.typing import DTypeLike

from jaxkv._util import (
    check_non_negative_int,
    check_positive_int,
    is_int,
    reject_unsupported,
)

_T = TypeVar("_T")


@dataclass_transform(
    frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field,)
)
def _static_dataclass(cls: type[_T]) -> type[_T]:
    """Frozen keyword-only dataclass registered as a leafless pytree."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    return jax.tree_util.register_static(cls)


def _draft_field() -> Any:
    # is_draft never takes part in equality or hashing (spec §1.1).
    return dataclasses.field(default=False, compare=False)


def normalize_dtype(owner: str, value: DTypeLike) -> np.dtype[Any]:
    """Normalises `value` to a NumPy dtype so equal specs hash equally.

    Raises:
      TypeError: If `value` is not a dtype, or one a KV cache cannot hold:
        booleans, complex numbers, sub-byte types (int4, fp4) and non-numeric
        types.
    """
    try:
        dtype = np.dtype(jax.numpy.dtype(value))
    except TypeError as err:
        raise TypeError(f"{owner}.dtype must be a dtype, got {value!r}.") from err
    numeric = jax.numpy.issubdtype(dtype, jax.numpy.floating) or (
        jax.numpy.issubdtype(dtype, jax.numpy.integer)
    )
    if not numeric or dtype.itemsize < 1 or (dtype.itemsize * 8) not in (8, 16, 32, 64):
        raise TypeError(
            f"{owner}.dtype={dtype.name} cannot be stored in a KV cache; use a float "
            "(float32, bfloat16, float16, float8 variants) or an integer type of 8 to "
            "64 bits."
        )
    bits = getattr(
        jax.numpy,
        "finfo"
        if numeric and jax.numpy.issubdtype(dtype, jax.numpy.floating)
        else "iinfo",
    )(dtype).bits
    if bits < 8:
        raise TypeError(
            f"{owner}.dtype={dtype.name} is a sub-byte type ({bits} bits); KV caches "
            "store whole bytes."
        )
    return dtype


class KVCacheSpec:
    """Base of every per-layer KV-cache spec.

    Subclasses define ``block_size`` (tokens per manager block) and the page
    arithmetic: ``real_page_size_bytes`` (unpadded, ``U``) and
    ``page_size_bytes`` (reserved per block, ``P``).

    ``has_layer_views`` (a class attribute, vLLM's flag of the same name) says
    whether layers of this kind get a typed per-layer view. A kind without
    (``False``) registers by subclassing: its group takes no part in backend
    or kernel-block selection, contributes an empty attention-group list, and
    its layers receive their raw pages as bytes (spec §1.1, §2.7.2); see
    :class:`RawPageSpec`.
    """

    block_size: int
    is_draft: bool
    has_layer_views: ClassVar[bool] = True

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes one block of this layer really uses (``U``)."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes reserved per block (``P``): the padded page if set, else ``U``."""
        raise NotImplementedError


@_static_dataclass
class AttentionSpec(KVCacheSpec):
    """Paged K/V of an attention layer.

    ``U = block_size * num_kv_heads * (head_size + head_size_v) * itemsize``.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(
      ...     block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
      >>> spec.page_size_bytes
      65536
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DTypeLike
    head_size_v: int | None = None
    page_size_padded: int | None = None
    kv_quant_mode: str = "none"
    is_draft: bool = _draft_field()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("block_size", "num_kv_heads", "head_size"):
            check_positive_int(owner, name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "dtype", normalize_dtype(owner, self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self._default_head_size_v())
        object.__setattr__(
            self,
            "head_size_v",
            check_non_negative_int(owner, "head_size_v", self.head_size_v),
        )
        if self.head_size_v == 0 and self._default_head_size_v() != 0:
            raise ValueError(
                f"{owner}.head_size_v must be positive (only MLA specs store no "
                "values), got 0."
            )
        reject_unsupported(owner, "kv_quant_mode", self.kv_quant_mode, "none")
        if self.page_size_padded is not None:
            check_positive_int(owner, "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(
                    f"{owner}.page_size_padded={self.page_size_padded} is smaller "
                    f"than the unpadded page of {self.real_page_size_bytes} bytes."
                )

    def _default_head_size_v(self) -> int:
        return self.head_size

    @property
    def itemsize(self) -> int:
        """Bytes per cache element (``E``)."""
        return np.dtype(self.dtype).itemsize

    @property
    def real_page_size_bytes(self) -> int:
        """``U = B * H * (D + Dv) * E``."""
        head_size_v = self.head_size_v or 0  # None only before __post_init__
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + head_size_v)
            * self.itemsize
        )

    @property
    def page_size_bytes(self) -> int:
        """``P``: ``page_size_padded`` if set, else ``U``."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@_static_dataclass
class FullAttentionSpec(AttentionSpec):
    """Full (causal or not) attention over the whole context.

    ``sliding_window`` / ``attention_chunk_size`` are set when a sliding or
    chunked layer is allocated as full attention (hybrid allocator off).

    Example:
      >>> import jaxkv
      >>> jaxkv.FullAttentionSpec(
      ...     block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16",
      ...     is_draft=True,
      ... ) == jaxkv.FullAttentionSpec(
      ...     block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
      True
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@_static_dataclass
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens.

    The window counts the query's own position: a query at position ``p``
    sees keys ``p - sliding_window + 1 .. p`` (vLLM's and Gemma's
    convention, ``window_size = (W - 1, 0)`` in FlashAttention terms). A
    model whose window excludes the query itself (``p - W .. p``, as
    RecurrentGemma's local attention) sets ``sliding_window=W + 1``.

    Example:
      >>> import jaxkv
      >>> jaxkv.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
      ...     dtype="float32", sliding_window=128).page_size_bytes
      16384
    """

    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("SlidingWindowSpec", "sliding_window", self.sliding_window)
        reject_unsupported(
            "SlidingWindowSpec", "extra_retained_tokens", self.extra_retained_tokens, 0
        )


@_static_dataclass
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention restricted to fixed chunks of ``attention_chunk_size`` tokens.

    Example:
      >>> import jaxkv
      >>> jaxkv.ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32", attention_chunk_size=64).block_size
      16
    """

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(
            "ChunkedLocalAttentionSpec",
            "attention_chunk_size",
            self.attention_chunk_size,
        )


@_static_dataclass
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross-attention over cached encoder K/V.

    Example:
      >>> import jaxkv
      >>> jaxkv.CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=2,
      ...     dtype="float32").page_size_bytes
      256
    """


@_static_dataclass
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention: needs no KV cache memory.

    Example:
      >>> import jaxkv
      >>> jaxkv.EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32").block_size
      16
    """


@_static_dataclass
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one latent vector per token.

    ``num_kv_heads`` must be 1 and ``head_size_v`` is 0, so
    ``U = B * D * E``.

    Example:
      >>> import jaxkv
      >>> jaxkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
      ...     dtype="bfloat16").page_size_bytes
      73728
    """

    def _default_head_size_v(self) -> int:
        return 0

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.num_kv_heads != 1:
            raise ValueError(
                f"{owner}.num_kv_heads must be 1 (one latent vector), "
                f"got {self.num_kv_heads}."
            )
        if self.head_size_v != 0:
            raise ValueError(
                f"{owner}.head_size_v must be 0 (latent only), got {self.head_size_v}."
            )


@_static_dataclass
class SlidingWindowMLASpec(MLAAttentionSpec):
    """MLA over the last ``sliding_window`` tokens.

    Example:
      >>> import jaxkv
      >>> jaxkv.SlidingWindowMLASpec(block_size=64, num_kv_heads=1,
      ...     head_size=576, dtype="bfloat16", sliding_window=128).sliding_window
      128
    """

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(
            "SlidingWindowMLASpec", "sliding_window", self.sliding_window
        )


@_static_dataclass
class MambaSpec(KVCacheSpec):
    """Recurrent state of a Mamba-style layer: one page per block.

    State ``i`` occupies ``prod(shapes[i]) * itemsize(dtypes[i])`` bytes and
    starts at ``state_offsets[i]`` inside the page; states are packed in
    declaration order and ``[U, P)`` is padding. ``shard_axes[i]`` is the axis
    of state ``i`` split over a tensor-parallel mesh axis (its heads or
    channels), ``None`` to replicate it; empty: every state replicated (a jaxkv
    extension, see :func:`local_runner_config`).

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.MambaSpec(block_size=80, shapes=((3, 2304), (8, 64, 128)),
      ...     dtypes=("bfloat16", "float32"), page_size_padded=327680)
      >>> spec.real_page_size_bytes, spec.page_size_bytes, spec.state_offsets
      (275968, 327680, (0, 13824))
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DTypeLike, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    shard_axes: tuple[int | None, ...] = ()
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    is_draft: bool = _draft_field()

    def __post_init__(self) -> None:
        check_positive_int("MambaSpec", "block_size", self.block_size)
        object.__setattr__(self, "block_size", int(self.block_size))
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, tuple | list) or not all(map(is_int, shape)):
                raise TypeError(
                    f"MambaSpec.shapes[{i}]={shape!r} must be a tuple of ints (one "
                    "shape per state, e.g. shapes=((3, 256), (8, 64, 16)))."
                )
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if not shapes:
            raise ValueError("MambaSpec.shapes must name at least one state, got ().")
        for shape in shapes:
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(
                    "MambaSpec.shapes must hold non-empty positive shapes, "
                    f"got {shape}."
                )
        if len(self.dtypes) != len(shapes):
            raise ValueError(
                f"MambaSpec.dtypes has {len(self.dtypes)} entries but shapes has "
                f"{len(shapes)}; give one dtype per state."
            )
        dtypes = tuple(normalize_dtype("MambaSpec", d) for d in self.dtypes)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        axes = tuple(self.shard_axes)
        if axes and (
            len(axes) != len(shapes)
            or any(
                a is not None and not 0 <= a < len(s)
                for a, s in zip(axes, shapes, strict=True)
            )
        ):
            raise ValueError(
                f"MambaSpec.shard_axes={axes} must give one axis (or None) per "
                f"state of shapes {shapes}."
            )
        object.__setattr__(self, "shard_axes", axes)
        reject_unsupported(
            "MambaSpec", "num_speculative_blocks", self.num_speculative_blocks, 0
        )
        reject_unsupported(
            "MambaSpec", "mamba_cache_mode", self.mamba_cache_mode, "none"
        )
        for offset, dtype in zip(self.state_offsets, dtypes, strict=True):
            if offset % np.dtype(dtype).itemsize:
                raise ValueError(
                    f"MambaSpec state of dtype {np.dtype(dtype).name} starts at "
                    f"byte {offset}, which is not a multiple of its itemsize; "
                    "reorder the states."
                )
        if self.page_size_padded is not None:
            check_positive_int("MambaSpec", "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(
                    f"MambaSpec.page_size_padded={self.page_size_padded} is smaller "
                    f"than the unpadded page of {self.real_page_size_bytes} bytes."
                )

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state (``S_i``)."""
        return tuple(
            math.prod(s) * np.dtype(d).itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state inside a page (``off_i``)."""
        offsets, total = [], 0
        for size in self.state_bytes:
            offsets.append(total)
            total += size
        return tuple(offsets)

    @property
    def real_page_size_bytes(self) -> int:
        """``U = sum(S_i)``."""
        return sum(self.state_bytes)

    @property
    def page_size_bytes(self) -> int:
        """``P``: ``page_size_padded`` if set, else ``U``."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@_static_dataclass
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Group-level wrapper: layers of one type whose pages may differ in size.

    One block spans a page of every layer, so ``page_size_bytes`` is the sum of
    the per-layer pages.

    Example:
      >>> import jaxkv
      >>> a = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=64, dtype="float32")
      >>> b = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=128, dtype="float32")
      >>> spec = jaxkv.UniformTypeKVCacheSpecs(block_size=16,
      ...     kv_cache_specs={"l0": a, "l1": b})
      >>> spec.page_size_bytes, spec.for_layer("l1") == b
      (24576, True)
    """

    block_size: int
    kv_cache_specs: Mapping[str, KVCacheSpec]
    is_draft: bool = _draft_field()

    def __post_init__(self) -> None:
        check_positive_int("UniformTypeKVCacheSpecs", "block_size", self.block_size)
        items = tuple(dict(self.kv_cache_specs).items())
        if not items:
            raise ValueError(
                "UniformTypeKVCacheSpecs.kv_cache_specs must not be empty."
            )
        for name, spec in items:
            if spec.block_size != self.block_size:
                raise ValueError(
                    f"UniformTypeKVCacheSpecs layer {name!r} has block_size "
                    f"{spec.block_size}, expected {self.block_size}."
                )
        # A tuple of pairs keeps the wrapper hashable and ordered.
        object.__setattr__(self, "kv_cache_specs", _FrozenSpecMap(items))

    def for_layer(self, layer_name: str) -> KVCacheSpec:
        """The per-layer spec of `layer_name`."""
        return self.kv_cache_specs[layer_name]

    @property
    def first_spec(self) -> KVCacheSpec:
        """The representative spec used for kernel block size dispatch."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def real_page_size_bytes(self) -> int:
        """Sum of the per-layer unpadded pages."""
        return sum(s.real_page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        """Sum of the per-layer pages."""
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())


@_static_dataclass
class RawPageSpec(KVCacheSpec):
    """A cache kind without per-layer views: each block is ``page_bytes`` raw bytes.

    For caches whose layout only the layer itself knows (vLLM's
    ``has_layer_views == False`` kinds, e.g. sparse-attention indices). Its
    layers get a ``uint8`` view of shape ``(num_blocks, page_bytes)`` over their
    pages, and no attention group. Subclass it (or any :class:`KVCacheSpec` with
    ``has_layer_views = False``) for a kind of your own.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.RawPageSpec(block_size=16, page_bytes=4096)
      >>> spec.page_size_bytes, spec.has_layer_views
      (4096, False)
    """

    block_size: int
    page_bytes: int
    is_draft: bool = _draft_field()
    has_layer_views: ClassVar[bool] = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_positive_int(owner, "block_size", self.block_size)
        check_positive_int(owner, "page_bytes", self.page_bytes)

    @property
    def real_page_size_bytes(self) -> int:
        """``page_bytes``."""
        return self.page_bytes

    @property
    def page_size_bytes(self) -> int:
        """``page_bytes``."""
        return self.page_bytes


class _FrozenSpecMap(Mapping[str, KVCacheSpec]):
    """Immutable, hashable, ordered ``layer -> spec`` mapping."""

    def __init__(self, items: tuple[tuple[str, KVCacheSpec], ...]) -> None:
        self._items = items
        self._dict = dict(items)

    def __getitem__(self, key: str) -> KVCacheSpec:
        return self._dict[key]

    def __iter__(self):  # noqa: ANN204
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _FrozenSpecMap):
            return self._items == other._items
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._dict)


def layer_spec(spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """Unwraps a group spec to the spec of one layer (spec §1.1)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.for_layer(layer_name)
    return spec


def representative_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """Unwraps a group spec to its first per-layer spec (dispatch only)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.first_spec
    return spec
