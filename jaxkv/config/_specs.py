"""KV-cache specs: what one layer stores per block, and how many bytes a page takes.

Specs are frozen, hashable, leafless pytrees. Equality is structural and ignores
``is_draft``, so a draft layer and a target layer with the same cache description
compare equal and group together (spec §1.1).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, ClassVar, TypeVar, dataclass_transform

import jax
import numpy as np
from jax.typing import DTypeLike

from jaxkv._util import (
    check_non_negative_int,
    check_positive_int,
    reject_unsupported,
)

_T = TypeVar("_T")


@dataclass_transform(
    frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field,)
)
def spec_dataclass(cls: type[_T]) -> type[_T]:
    """Frozen keyword-only dataclass registered as a leafless pytree."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    # Specs check their own fields with named errors (checks_own_arguments).
    cls.__no_type_check__ = True  # pyright: ignore[reportAttributeAccessIssue]
    return jax.tree_util.register_static(cls)


def draft_field() -> Any:
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


KV_QUANT_MODES = (
    "none",
    "fp8_per_tensor",
    "int8_per_token_head",
    "fp8_per_token_head",
)
"""vLLM's KV quantization modes jaxkv stores (``KVQuantMode``'s names, lower
case): 8-bit pages with a static scale per tensor, or with a float32 scale per
token and head for K and for V computed when the token is written."""

_QUANT_DTYPES = {
    "fp8_per_tensor": ("float8_e4m3fn", "float8_e5m2"),
    "int8_per_token_head": ("int8",),
    "fp8_per_token_head": ("float8_e4m3fn", "float8_e5m2"),
}
# vLLM's other modes (packed 4-bit, NVFP4, TurboQuant, ...): named as such.
_VLLM_ONLY_MODES = {
    "INT4_PER_TOKEN_HEAD",
    "NVFP4",
    "TURBOQUANT_K8V4",
    "TURBOQUANT_4BIT_NC",
    "TURBOQUANT_K3V4_NC",
    "TURBOQUANT_3BIT_NC",
    "NVFP4_DS_MLA",
    "ULTRAQUANT_4BIT",
}


@spec_dataclass
class AttentionSpec(KVCacheSpec):
    """Paged K/V of an attention layer.

    A page is vLLM's logical ``[H, N, C]``: ``H`` head slots (``num_heads``),
    ``N`` stored states (``num_states``), ``C`` content bytes per slot and
    state (``state_content_size_bytes``), so ``U = H * N * C``. By default a
    slot per KV head, a state per token and K then V of one head side by
    side: ``U = block_size * num_kv_heads * (head_size + head_size_v) *
    itemsize``. vLLM's packing fields change that:

    - ``tokens_per_state``: tokens one stored state covers. An int above 1
      compresses that many tokens into a state (DeepSeek-V3.2/V4 sparse
      indexers: ``N = block_size // tokens_per_state``); a
      ``fractions.Fraction`` below 1 stores several states per token
      (Whisper block pooling). ``block_size / tokens_per_state`` must be a
      whole number.
    - ``num_head_slots``: ``H`` when packing does not keep a slot per KV head.
    - ``state_content_bytes``: ``C`` when the content is packed (quantized
      values with their scales); a multiple of the dtype's size.

    ``kv_quant_mode`` (:data:`KV_QUANT_MODES`, vLLM's ``KVQuantMode``):
    ``"fp8_per_tensor"`` pages of ``float8_e4m3fn``/``float8_e5m2`` with a
    static scale per tensor (half a bf16 page); ``"int8_per_token_head"`` /
    ``"fp8_per_token_head"`` pages of ``int8`` / fp8 with a float32 scale per
    token and head for K and V, computed as each token is written, kept at
    the end of each page (8 bytes per head and token more: vLLM's page).

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(
      ...     block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
      >>> spec.page_size_bytes
      65536
      >>> jaxkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=68,
      ...     dtype="uint8", state_content_bytes=68, tokens_per_state=4).page_size_bytes
      1088
      >>> jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
      ...     dtype="int8", kv_quant_mode="int8_per_token_head").page_size_bytes
      33792
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DTypeLike
    head_size_v: int | None = None
    page_size_padded: int | None = None
    kv_quant_mode: str = "none"
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int | Fraction = 1
    is_draft: bool = draft_field()

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
        self._check_quant_mode(owner)
        self._check_packing(owner)
        if self.page_size_padded is not None:
            check_positive_int(owner, "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(
                    f"{owner}.page_size_padded={self.page_size_padded} is smaller "
                    f"than the unpadded page of {self.real_page_size_bytes} bytes."
                )

    def _check_quant_mode(self, owner: str) -> None:
        """`kv_quant_mode` is one of vLLM's KV quantization modes jaxkv stores."""
        mode = self.kv_quant_mode
        if mode not in KV_QUANT_MODES:
            if not isinstance(mode, str) or mode.upper() not in _VLLM_ONLY_MODES:
                raise ValueError(
                    f"{owner}.kv_quant_mode must be one of {KV_QUANT_MODES}, got "
                    f"{mode!r}."
                )
            raise NotImplementedError(
                f"{owner}.kv_quant_mode={mode!r} (vLLM's {mode.upper()}) is not "
                f"implemented by jaxkv; it stores {KV_QUANT_MODES}."
            )
        want = _QUANT_DTYPES.get(mode)
        if want is not None and np.dtype(self.dtype).name not in want:
            raise ValueError(
                f"{owner}.kv_quant_mode={mode!r} stores its pages as one of {want}, "
                f"but dtype is {np.dtype(self.dtype).name}."
            )
        if mode.endswith("per_token_head") and self.state_content_bytes is not None:
            raise ValueError(
                f"{owner}.kv_quant_mode={mode!r} computes the page from the head "
                "sizes and the scales; give no state_content_bytes."
            )

    @property
    def quant_scale_bytes(self) -> int:
        """Bytes of quantization scales per (head slot, state) of a page.

        A pair of float32 scales (K's and V's) per token and head under the
        per-token-head modes, 0 otherwise: vLLM's ``customize_spec`` of the
        Triton and MLA backends counts the same 8 bytes (an MLA latent, with
        no values, keeps the pair too).
        """
        return 8 if self.kv_quant_mode.endswith("per_token_head") else 0

    def _check_packing(self, owner: str) -> None:
        """Validates and normalises vLLM's packing fields."""
        for name in ("num_head_slots", "state_content_bytes"):
            if getattr(self, name) is not None:
                check_positive_int(owner, name, getattr(self, name))
                object.__setattr__(self, name, int(getattr(self, name)))
        tps = self.tokens_per_state
        if isinstance(tps, bool) or not isinstance(tps, (int, np.integer, Fraction)):
            raise TypeError(
                f"{owner}.tokens_per_state must be a positive int or a "
                f"fractions.Fraction, got {tps!r}."
            )
        tps = Fraction(tps)
        states = self.block_size / tps if tps > 0 else None
        if states is None or states.denominator != 1:
            raise ValueError(
                f"{owner}.tokens_per_state={self.tokens_per_state} must be positive "
                f"and divide block_size={self.block_size} into whole states."
            )
        object.__setattr__(
            self, "tokens_per_state", int(tps) if tps.denominator == 1 else tps
        )
        itemsize = np.dtype(self.dtype).itemsize
        if self.state_content_bytes is not None and self.state_content_bytes % itemsize:
            raise ValueError(
                f"{owner}.state_content_bytes={self.state_content_bytes} is not a "
                f"multiple of the {np.dtype(self.dtype).name} itemsize ({itemsize})."
            )

    def _default_head_size_v(self) -> int:
        return self.head_size

    @property
    def itemsize(self) -> int:
        """Bytes per cache element (``E``)."""
        return np.dtype(self.dtype).itemsize

    @property
    def num_heads(self) -> int:
        """``H``: head slots of a page (``num_head_slots``, else ``num_kv_heads``)."""
        return self.num_kv_heads if self.num_head_slots is None else self.num_head_slots

    @property
    def num_states(self) -> int:
        """``N``: states stored per block (``block_size / tokens_per_state``)."""
        return int(self.block_size / Fraction(self.tokens_per_state))

    @property
    def state_content_size_bytes(self) -> int:
        """``C``: bytes per (head slot, state) cell of a page."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + (self.head_size_v or 0)) * self.itemsize

    @property
    def is_packed(self) -> bool:
        """Whether a page departs from a K/V slot per KV head and token."""
        return (
            self.tokens_per_state != 1
            or self.num_head_slots is not None
            or self.state_content_bytes is not None
        )

    def states_in(self, num_tokens: int) -> int | None:
        """States a block of `num_tokens` tokens stores.

        ``None`` unless `num_tokens` divides ``block_size`` into blocks of
        whole states (``num_tokens / tokens_per_state`` a whole number).
        """
        states = num_tokens / Fraction(self.tokens_per_state)
        if self.block_size % num_tokens or states.denominator != 1:
            return None
        return int(states)

    def view_block_size(self, kernel_block_size: int | None = None) -> int:
        """Tokens one block of a layer's view holds.

        `kernel_block_size` (default: the whole block). An MLA spec with
        ``storage_block_size`` views its storage in blocks of that width
        instead, whatever the kernel block.
        """
        return kernel_block_size or self.block_size

    @property
    def real_page_size_bytes(self) -> int:
        """``U = H * N * C`` (by default ``B * H * (D + Dv) * E``).

        Per-token-head quantized pages add their scales:
        ``U = H * N * (C + 8)`` (:attr:`quant_scale_bytes`), vLLM's page.
        """
        cell = self.state_content_size_bytes + self.quant_scale_bytes
        return self.num_heads * self.num_states * cell

    @property
    def page_size_bytes(self) -> int:
        """``P``: ``page_size_padded`` if set, else ``U``."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@spec_dataclass
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


@spec_dataclass
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


@spec_dataclass
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


@spec_dataclass
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross-attention over cached encoder K/V.

    Example:
      >>> import jaxkv
      >>> jaxkv.CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=2,
      ...     dtype="float32").page_size_bytes
      256
    """


@spec_dataclass
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention: needs no KV cache memory.

    Example:
      >>> import jaxkv
      >>> jaxkv.EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32").block_size
      16
    """


@spec_dataclass
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one latent vector per token.

    ``num_kv_heads`` must be 1 and ``head_size_v`` is 0, so
    ``U = B * D * E``.

    ``storage_block_size`` (vLLM's field of that name, DeepSeek-V4-style
    indexers): the token width the layer's storage is viewed in when it
    differs from the kernel block (a kernel tiling pages more finely, as
    DeepGEMM's, does not split the view); it divides ``block_size`` into
    whole states and leaves the page size unchanged. Such a layer is read
    only by backends that read packed pages (:attr:`is_packed`).

    Example:
      >>> import jaxkv
      >>> jaxkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
      ...     dtype="bfloat16").page_size_bytes
      73728
      >>> idx = jaxkv.MLAAttentionSpec(block_size=256, num_kv_heads=1,
      ...     head_size=128, dtype="bfloat16", tokens_per_state=4,
      ...     storage_block_size=256)
      >>> idx.view_block_size(64), jaxkv.vllm.hnc_shape(idx, kernel_block_size=64)
      (256, (1, 64, 256))
    """

    storage_block_size: int | None = None

    def _default_head_size_v(self) -> int:
        return 0

    @property
    def is_packed(self) -> bool:
        """Whether a page departs from a K/V slot per KV head and token."""
        return super().is_packed or self.storage_block_size is not None

    def view_block_size(self, kernel_block_size: int | None = None) -> int:
        """Tokens one block of a layer's view holds (see the class)."""
        if self.storage_block_size is not None:
            return self.storage_block_size
        return super().view_block_size(kernel_block_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.storage_block_size is not None:
            s = check_positive_int(owner, "storage_block_size", self.storage_block_size)
            if self.states_in(s) is None:
                raise ValueError(
                    f"{owner}.storage_block_size={s} must divide block_size="
                    f"{self.block_size} into blocks of whole states "
                    f"(tokens_per_state={self.tokens_per_state})."
                )
            object.__setattr__(self, "storage_block_size", int(s))
        if self.num_kv_heads != 1:
            raise ValueError(
                f"{owner}.num_kv_heads must be 1 (one latent vector), "
                f"got {self.num_kv_heads}."
            )
        if self.head_size_v != 0:
            raise ValueError(
                f"{owner}.head_size_v must be 0 (latent only), got {self.head_size_v}."
            )


@spec_dataclass
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


def get_num_skipped_tokens(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Leading tokens no future query of a request attends to (vLLM's rule).

    Sliding window ``w``: a query at position ``p >= num_computed_tokens`` sees
    keys ``> p - w``, so ``num_computed_tokens - w + 1`` tokens are skipped.
    Chunked local attention of chunk ``c``: keys of earlier chunks are never seen
    again, ``(num_computed_tokens // c) * c``. Other specs skip nothing. Blocks
    whose tokens are all skipped can be freed and replaced by the null block.

    Example:
      >>> import jaxkv
      >>> swa = jaxkv.SlidingWindowSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32", sliding_window=64)
      >>> from jaxkv.vllm import get_num_skipped_tokens
      >>> get_num_skipped_tokens(swa, 100), get_num_skipped_tokens(swa, 10)
      (37, 0)
    """
    if isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec):
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk
    return 0
