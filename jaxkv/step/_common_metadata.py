"""The per-step attention metadata record (spec §1.12).

Its pytree structure is fixed by static flags and capacities (shapes), never by
a step's values: optional features are zero-filled arrays, counts are int32
leaves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxkv._util import host_field, pytree_dataclass, static_field


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """Attention inputs of one KV-cache group for one step, padded to capacities.

    Only the first ``num_reqs`` rows of per-request arrays and the first
    ``num_actual_tokens`` entries of per-token arrays are meaningful; padded
    rows of ``query_start_loc`` repeat its last value (zero-length requests),
    padded slots are ``-1``, padded block-table entries are ``0`` (null block).
    Causality is ``causal`` (static, per group) and ``request_causal`` (per
    request): a request attends causally when both hold, otherwise to its whole
    context (vLLM's ``causal`` as a bool, or as a per-request array).
    ``query_start_loc_cpu`` is the host copy (NumPy), kept outside the traced
    leaves: it is ``None`` inside ``jit``; ``logits_indices_cpu`` likewise holds
    the host copy of the real fast-prefill logits indices. ``block_size``
    (static) is the tokens per column of ``block_table_tensor`` (the group's
    kernel block size) when built by :func:`build_attn_metadata`; ``group``
    (static) the KV-cache group the record belongs to (``None`` when built by
    hand): :func:`paged_attention` refuses a layer of another group.

    Example:
      >>> import jax
      >>> import jaxkv
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=4, max_tokens=8,
      ...                                         max_blocks=2)
      >>> len(jax.tree.leaves(m)), m.query_start_loc.shape
      (18, (5,))
    """

    query_start_loc: Int[Array, " max_reqs_plus_1"]
    seq_lens: Int[Array, " max_reqs"]
    block_table_tensor: Int[Array, "max_reqs max_blocks"]
    slot_mapping: Int[Array, " max_tokens"]
    num_reqs: Int[Array, ""]
    num_actual_tokens: Int[Array, ""]
    max_query_len: Int[Array, ""]
    max_seq_len: Int[Array, ""]
    positions: Int[Array, " max_tokens"]
    is_prefilling: Bool[Array, " max_reqs"]
    token_to_req: Int[Array, " max_tokens"]
    encoder_seq_lens: Int[Array, " max_reqs"]
    mm_prefix_ranges: Int[Array, "max_reqs max_ranges 2"]
    mm_num_ranges: Int[Array, " max_reqs"]
    logits_indices_padded: Int[Array, " max_logits"]
    num_logits_indices: Int[Array, ""]
    max_logits_per_req: Int[Array, ""]
    request_causal: Bool[Array, " max_reqs"]
    causal: bool = static_field(default=True)
    fast_prefill: bool = static_field(default=False)
    block_size: int | None = static_field(default=None)
    group: int | None = static_field(default=None)
    query_start_loc_cpu: np.ndarray | None = host_field()
    logits_indices_cpu: np.ndarray | None = host_field()

    @classmethod
    def empty(
        cls,
        *,
        max_reqs: int,
        max_tokens: int,
        max_blocks: int,
        max_ranges: int = 0,
        max_logits: int = 1,
    ) -> CommonAttentionMetadata:
        """An all-zero record of the given capacities (padding everywhere)."""
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        return cls(
            query_start_loc=z(max_reqs + 1),
            seq_lens=z(max_reqs),
            block_table_tensor=z((max_reqs, max_blocks)),
            slot_mapping=jnp.full(max_tokens, -1, jnp.int32),
            num_reqs=z(()),
            num_actual_tokens=z(()),
            max_query_len=z(()),
            max_seq_len=z(()),
            positions=z(max_tokens),
            is_prefilling=jnp.zeros(max_reqs, jnp.bool_),
            token_to_req=z(max_tokens),
            encoder_seq_lens=z(max_reqs),
            mm_prefix_ranges=z((max_reqs, max_ranges, 2)),
            mm_num_ranges=z(max_reqs),
            logits_indices_padded=z(max_logits),
            num_logits_indices=z(()),
            max_logits_per_req=z(()),
            request_causal=jnp.ones(max_reqs, jnp.bool_),
        )

    @property
    def max_reqs(self) -> int:
        """Request capacity (static, from the shape)."""
        return self.seq_lens.shape[0]

    def mamba_state_blocks(self, block_size: int | None = None) -> tuple[Array, Array]:
        """Per request, the blocks its Mamba state is read from and written to.

        Per request, the block holding its Mamba state before this step's
        tokens and the block that receives the state after them.

        A Mamba group's block table has one column per `block_size` tokens; the
        state after ``n`` tokens lives in column ``(n - 1) // block_size`` (see
        :class:`KVCacheManager`). Requests with nothing computed before the
        step read ``-1`` (start from a zero state); padded rows read and write
        ``-1`` (nothing).

        Args:
          block_size: Tokens per block-table column. Metadata from
            :func:`build_attn_metadata` (or a :class:`StepMetadataBuilder`)
            knows its group's; give it only for a record built by hand.

        Raises:
          ValueError: If `block_size` contradicts the record's own, or neither
            is known.

        Example:
          >>> import jax.numpy as jnp
          >>> import jaxkv
          >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=8,
          ...                                         max_blocks=4)
          >>> import dataclasses
          >>> m = dataclasses.replace(m, num_reqs=jnp.int32(2),
          ...     query_start_loc=jnp.array([0, 5, 6, 6]),
          ...     seq_lens=jnp.array([5, 33, 0]),
          ...     block_table_tensor=jnp.array([[7, 0, 0, 0], [0, 8, 9, 0],
          ...                                   [0, 0, 0, 0]]))
          >>> [x.tolist() for x in m.mamba_state_blocks(16)]
          [[-1, 8, -1], [7, 9, -1]]
        """
        own = self.block_size
        if block_size is None:
            if own is None:
                raise ValueError(
                    "mamba_state_blocks: this metadata does not know its block "
                    "size (built by hand); pass block_size."
                )
            block_size = own
        elif own is not None and block_size != own:
            raise ValueError(
                f"mamba_state_blocks: block_size={block_size!r} contradicts the "
                f"group's block size {own} (leave it out)."
            )
        rows = jnp.arange(self.max_reqs, dtype=jnp.int32)
        live = rows < self.num_reqs
        before = self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])
        last = self.block_table_tensor.shape[1] - 1

        def block(n: Array) -> Array:
            col = jnp.clip((n - 1) // block_size, 0, last)
            return jnp.take_along_axis(self.block_table_tensor, col[:, None], axis=1)[
                :, 0
            ]

        src = jnp.where(live & (before > 0), block(before), -1)
        dst = jnp.where(live & (self.seq_lens > 0), block(self.seq_lens), -1)
        return src, dst
