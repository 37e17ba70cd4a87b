"""Specs of a whole group, of raw pages, and a group's per-layer spec.

Specs of a whole group or of raw pages: layers of one type whose pages differ
(UniformTypeKVCacheSpecs), pages of raw bytes, and the per-layer spec of a
group's spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from jaxkv._util import (
    check_positive_int,
)
from jaxkv.config._specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    draft_field,
    spec_dataclass,
)


@spec_dataclass
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
    is_draft: bool = draft_field()

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

    @classmethod
    def from_specs(
        cls, kv_cache_specs: Mapping[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """One spec for layers of one attention type and one block size, or None.

        vLLM's ``from_specs``: "one type" means layers that need the same token
        slots: the same spec class, and for sliding-window and chunked layers
        the same window or chunk (Mamba layers: the same page).

        Example:
          >>> import jaxkv
          >>> kw = dict(block_size=16, num_kv_heads=2, dtype="float32")
          >>> a = jaxkv.FullAttentionSpec(head_size=64, **kw)
          >>> b = jaxkv.FullAttentionSpec(head_size=128, **kw)
          >>> jaxkv.UniformTypeKVCacheSpecs.from_specs({"l1": a, "l2": b}).page_size_bytes
          49152
          >>> w = jaxkv.SlidingWindowSpec(head_size=64, sliding_window=1, **kw)
          >>> jaxkv.UniformTypeKVCacheSpecs.from_specs({"l1": a, "l2": w}) is None
          True
        """  # noqa: E501
        values = list(kv_cache_specs.values())
        if not values or any(isinstance(s, cls) for s in values):
            return None
        if len({s.block_size for s in values}) > 1:
            return None
        if len({_type_key(s) for s in values}) > 1:
            return None
        return cls(block_size=values[0].block_size, kv_cache_specs=kv_cache_specs)

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


@spec_dataclass
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
    is_draft: bool = draft_field()
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


def _type_key(spec: KVCacheSpec) -> tuple[object, ...]:
    """What "one attention type" means for :class:`UniformTypeKVCacheSpecs`.

    vLLM 0.32's registry (``uniform_type_base_spec``): MLA is full attention;
    sliding-window MLA is sliding window; windows and chunks must be equal.
    """
    if isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec):
        return (SlidingWindowSpec, spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (type(spec), spec.attention_chunk_size)
    if not isinstance(spec, AttentionSpec):  # Mamba and raw pages: one page
        return (type(spec), spec.page_size_bytes)
    if isinstance(spec, FullAttentionSpec | MLAAttentionSpec):
        return (FullAttentionSpec,)
    return (type(spec),)


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
