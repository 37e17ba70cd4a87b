"""Attention backends as static capability records (spec §1.5, §1.10).

A backend is a frozen, hashable, leafless pytree: it can be a jit static
argument, a dict key and a static field of another pytree. It never holds
code; what a backend "is" is the set of flags the rest of jaxkv reads.
"""

from __future__ import annotations

import dataclasses
import enum

import jax

from jaxkv._util import check_positive_int


class AttentionCGSupport(enum.IntEnum):
    """How much of a step a backend lets one fully-compiled executable cover.

    The JAX counterpart of vLLM's CUDA-graph support levels; larger is stronger.

    Example:
      >>> import jaxkv
      >>> from jaxkv.vllm import AttentionCGSupport
      >>> AttentionCGSupport.UNIFORM_BATCH < AttentionCGSupport.ALWAYS
      True
    """

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


class KVCacheLayout(enum.Enum):
    """Logical shape rule of one layer's cache (spec §1.5).

    * ``BLOCKS_FIRST``: ``(num_blocks, 2, block_size, H, D)``, block dim 0.
    * ``KV_FIRST``: ``(2, num_blocks, block_size, H, D)``, block dim 1.
    * ``BLOCKS_FIRST_FUSED``: ``(num_blocks, block_size, H, D + Dv)``: K and V
      side by side in the last axis, block dim 0, no K/V axis.
    * ``MLA``: ``(num_blocks, block_size, D)``, block dim 0.
    * ``MAMBA``: per-state ``(num_blocks, *shape)`` views; no attention shape.
    """

    BLOCKS_FIRST = "blocks_first"
    KV_FIRST = "kv_first"
    BLOCKS_FIRST_FUSED = "blocks_first_fused"
    MLA = "mla"
    MAMBA = "mamba"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """A kernel block size constraint accepting any multiple of ``base``.

    Example:
      >>> import jaxkv
      >>> jaxkv.vllm.MultipleOf(16).accepts(48), jaxkv.vllm.MultipleOf(16).accepts(40)
      (True, False)
    """

    base: int

    def __post_init__(self) -> None:
        check_positive_int("MultipleOf", "base", self.base)

    def accepts(self, block_size: int) -> bool:
        """Whether `block_size` is a multiple of ``base``."""
        return block_size % self.base == 0


KernelBlockSize = int | MultipleOf


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBackend:
    """Static capability flags of an attention (or state-space) backend.

    Args:
      name: Class-style name used in messages and returned by the capability
        checks, e.g. ``"FlashAttentionBackend"``.
      layout: Logical KV shape rule (:class:`KVCacheLayout`).
      stride_order: Physical order of the logical dims; ``None`` is identity.
        It may only permute dims after the first two (spec §1.7).
      supported_kernel_block_sizes: Exact ints and/or :class:`MultipleOf`.
      cudagraph_support: Strongest :class:`AttentionCGSupport` its metadata
        allows for a fully-compiled step.
      varlen_cudagraph_max_query_len: Largest per-request query length a
        fully-compiled decode step replays for variable-length batches, or
        ``None``.
      supports_query_lens_mismatch: Whether the device ``query_start_loc`` may
        disagree with the host copy; ``None`` means ``not is_ssm``.
      supports_batch_invariance: Whether the backend has a batch-invariant mode.
      supports_update_block_table: Whether metadata can be cloned with a new
        block table (Mamba groups reuse metadata this way).
      prefix: Prefix added by a wrapper such as the fast-prefill variant; part of
        the backend's identity.
      packs_kv_heads: A fused (``BLOCKS_FIRST_FUSED``) cache as the kernel takes
        it, ``(num_blocks, block_size, 2 * H // p, p, D)`` with ``p = 4 //
        itemsize`` and K and V heads interleaved (ragged paged attention v3,
        tpu-inference): the same bytes as LBNHC, shaped so that a typed pool
        *is* the kernel's array (XLA:CPU copies a reshaped cache fed to such a
        kernel's loop).
      reads_packed_pages: The kernel reads pages packed by vLLM's spec fields
        (``tokens_per_state``, ``num_head_slots``, ``state_content_bytes``):
        such a layer's view is ``(blocks, states, head slots, C / itemsize)``
        (MLA: no slot axis), axes ``block, state, head, dim``, in the spec's
        dtype. Backends without it refuse packed specs.

    Example:
      >>> import jaxkv
      >>> b = jaxkv.get_backend("FLASH_ATTN")
      >>> b.get_kv_cache_shape(10, 16, 8, 128), b.get_kv_cache_block_dim(16, 8, 128)
      ((10, 2, 16, 8, 128), 0)
    """

    name: str
    layout: KVCacheLayout
    stride_order: tuple[int, ...] | None = None
    supported_kernel_block_sizes: tuple[KernelBlockSize, ...] = (MultipleOf(1),)
    cudagraph_support: AttentionCGSupport = AttentionCGSupport.ALWAYS
    varlen_cudagraph_max_query_len: int | None = None
    supports_query_lens_mismatch: bool | None = None
    supports_batch_invariance: bool = False
    supports_update_block_table: bool = False
    prefix: str = ""
    packs_kv_heads: bool = False
    reads_packed_pages: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"AttentionBackend.name must be a non-empty str, got {self.name!r}."
            )
        if not isinstance(self.layout, KVCacheLayout):
            raise TypeError(
                f"AttentionBackend.layout must be a KVCacheLayout, got {self.layout!r}."
            )
        sizes = tuple(self.supported_kernel_block_sizes)
        if not sizes:
            raise ValueError(
                f"{self.name}.supported_kernel_block_sizes must not be empty."
            )
        for size in sizes:
            if isinstance(size, MultipleOf):
                continue
            check_positive_int(self.name, "supported_kernel_block_sizes[i]", size)
        object.__setattr__(self, "supported_kernel_block_sizes", sizes)
        object.__setattr__(
            self, "cudagraph_support", AttentionCGSupport(self.cudagraph_support)
        )
        if self.stride_order is not None:
            order = tuple(int(d) for d in self.stride_order)
            rank = len(self._shape_template())
            if sorted(order) != list(range(rank)):
                raise ValueError(
                    f"{self.name}.stride_order={order} is not a permutation of "
                    f"range({rank})."
                )
            if order[:2] != (0, 1):
                raise ValueError(
                    f"{self.name}.stride_order={order} moves the first two logical "
                    "dims; only dims after the block and K/V axes may be permuted."
                )
            object.__setattr__(self, "stride_order", order)

    @property
    def class_name(self) -> str:
        """The backend's full name, wrapper prefix included."""
        return self.prefix + self.name

    def is_ssm(self) -> bool:
        """Whether this is a state-space (Mamba) backend."""
        return self.layout is KVCacheLayout.MAMBA

    def supports_device_cpu_query_lens_mismatch(self) -> bool:
        """Whether device and host query lengths may disagree."""
        if self.supports_query_lens_mismatch is None:
            return not self.is_ssm()
        return self.supports_query_lens_mismatch

    def supports_block_size(self, block_size: int) -> bool:
        """Whether `block_size` is accepted as a kernel block size."""
        return any(
            s.accepts(block_size) if isinstance(s, MultipleOf) else s == block_size
            for s in self.supported_kernel_block_sizes
        )

    def _shape_template(self) -> tuple[str, ...]:
        return {
            KVCacheLayout.BLOCKS_FIRST: ("N", "2", "k", "H", "D"),
            KVCacheLayout.KV_FIRST: ("2", "N", "k", "H", "D"),
            KVCacheLayout.BLOCKS_FIRST_FUSED: ("N", "k", "H", "DD"),
            KVCacheLayout.MLA: ("N", "k", "D"),
            KVCacheLayout.MAMBA: (),
        }[self.layout]

    def get_kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
        *,
        head_size_v: int | None = None,
    ) -> tuple[int, ...]:
        """Logical shape of one layer's cache.

        Args:
          num_blocks: Number of (kernel) blocks viewed.
          block_size: Tokens per (kernel) block.
          num_kv_heads: KV heads per rank.
          head_size: Key head size.
          cache_dtype_str: Cache dtype name; unused by the built-in rules.
          head_size_v: Value head size when it differs from `head_size`; only
            the fused layout accepts that.

        Returns:
          The logical shape.

        Raises:
          ValueError: For a Mamba backend, or a head_size_v the layout cannot hold.
        """
        del cache_dtype_str
        dv = head_size if head_size_v is None else head_size_v
        if self.layout in (KVCacheLayout.BLOCKS_FIRST, KVCacheLayout.KV_FIRST):
            if dv != head_size:
                raise ValueError(
                    f"{self.class_name} stores K and V in one (.., 2, ..) axis and "
                    f"needs head_size_v == head_size, got {dv} != {head_size}."
                )
        dims = {
            "N": num_blocks,
            "2": 2,
            "k": block_size,
            "H": num_kv_heads,
            "D": head_size,
            "DD": head_size + dv,
        }
        if self.layout is KVCacheLayout.MAMBA:
            raise ValueError(f"{self.class_name} has per-state views, not a KV shape.")
        return tuple(dims[d] for d in self._shape_template())

    def get_kv_cache_stride_order(self) -> tuple[int, ...]:
        """Physical order of the logical dims (identity when not declared)."""
        if self.stride_order is not None:
            return self.stride_order
        return tuple(range(len(self._shape_template())))

    def get_kv_cache_block_dim(
        self,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> int:
        """Index of the block axis in the logical shape.

        Found, as in vLLM, by probing the shape rule with a sentinel block count.
        """
        sentinel = 1234567
        shape = self.get_kv_cache_shape(
            sentinel, block_size, num_kv_heads, head_size, cache_dtype_str
        )
        return shape.index(sentinel)


def create_fast_prefill_custom_backend(
    prefix: str, backend: AttentionBackend
) -> AttentionBackend:
    """The fast-prefill wrapper of `backend`: same flags, distinct identity.

    Args:
      prefix: Name prefix, ``"FastPrefill"`` in vLLM.
      backend: The wrapped backend.

    Returns:
      A backend equal in every flag but the prefix, so it never groups with
      the unwrapped backend.

    Example:
      >>> import jaxkv
      >>> fa = jaxkv.get_backend("FLASH_ATTN")
      >>> wrapped = jaxkv.vllm.create_fast_prefill_custom_backend("FastPrefill", fa)
      >>> wrapped.class_name, wrapped == fa
      ('FastPrefillFlashAttentionBackend', False)
    """
    if backend.prefix.startswith(prefix):
        return backend
    return dataclasses.replace(backend, prefix=prefix + backend.prefix)
