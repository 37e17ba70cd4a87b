"""The reduced record of the KV-sharing fast-prefill layers.

The same batch seen from the sampled tokens only (spec §2.17).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.step._common_metadata import CommonAttentionMetadata


def make_kv_sharing_fast_prefill_common_attn_metadata(
    common: CommonAttentionMetadata,
) -> CommonAttentionMetadata:
    """The reduced record of the fast-prefill (KV-sharing) layers (spec §2.17).

    Keeps only the logits positions: request ``r``'s query becomes its logits
    tokens, ``query_start_loc' = [0, cumsum(counts)]``; ``seq_lens``, block
    table and slot mapping are unchanged (logits positions are each request's
    trailing tokens, so they attend exactly as in the full batch);
    ``num_actual_tokens = num_logits_indices``, ``max_query_len =
    max_logits_per_req``, causal. Per-token optional fields are cleared.
    Returns `common` unchanged if fast prefill is not armed. When
    ``max_query_len == 1`` vLLM returns the record unchanged; here the counts are
    selected on device to the same values, but the optional per-token fields are
    still cleared, since a jitted step cannot change its structure on a value.

    Example:
      >>> import dataclasses
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> i32 = lambda x: jnp.asarray(x, jnp.int32)
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=28,
      ...                                         max_blocks=1)
      >>> m = dataclasses.replace(m, query_start_loc=i32([0, 15, 20, 28]),
      ...     seq_lens=i32([41, 31, 40]), num_reqs=i32(3), max_query_len=i32(15),
      ...     logits_indices_padded=i32([14, 18, 19, 27, 27, 27, 27, 27]),
      ...     num_logits_indices=i32(4), max_logits_per_req=i32(2), fast_prefill=True)
      >>> r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(m)
      >>> r.query_start_loc.tolist(), int(r.num_actual_tokens), int(r.max_query_len)
      ([0, 1, 3, 4], 4, 2)
      >>> m = dataclasses.replace(m, query_start_loc_cpu=np.array([0, 15, 20, 28]))
      >>> jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(
      ...     m).query_start_loc_cpu.tolist()  # the host copy too
      [0, 1, 3, 4]
    """
    if not common.fast_prefill:
        return common
    qsl = common.query_start_loc
    idx = common.logits_indices_padded
    n = common.num_logits_indices
    max_reqs = common.max_reqs
    # Owning request of each index: qsl = [0, 15, 20, 28], idx = [14, 18, 19, 27]
    # -> [0, 1, 1, 2]; entries past n (padding) get max_reqs and are dropped.
    owner = jnp.searchsorted(qsl[1:], idx, side="right").astype(jnp.int32)
    valid = jnp.arange(idx.shape[0], dtype=jnp.int32) < n
    owner = jnp.where(valid, owner, max_reqs)
    counts = jnp.zeros(max_reqs, jnp.int32).at[owner].add(1, mode="drop")
    reduced_qsl = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)]
    )
    decode_only = common.max_query_len == 1
    max_tokens = common.positions.shape[0]
    return dataclasses.replace(
        common,
        query_start_loc=jnp.where(decode_only, qsl, reduced_qsl),
        num_actual_tokens=jnp.where(decode_only, common.num_actual_tokens, n),
        max_query_len=jnp.where(
            decode_only, common.max_query_len, common.max_logits_per_req
        ),
        positions=jnp.zeros(max_tokens, jnp.int32),
        is_prefilling=jnp.zeros(max_reqs, jnp.bool_),
        token_to_req=jnp.zeros(max_tokens, jnp.int32),
        encoder_seq_lens=jnp.zeros(max_reqs, jnp.int32),
        mm_prefix_ranges=jnp.zeros_like(common.mm_prefix_ranges),
        mm_num_ranges=jnp.zeros(max_reqs, jnp.int32),
        request_causal=jnp.ones(max_reqs, jnp.bool_),
        causal=True,
        query_start_loc_cpu=_reduced_query_start_loc_cpu(common),
    )


def _reduced_query_start_loc_cpu(common: CommonAttentionMetadata) -> np.ndarray | None:
    """The host copy of the reduced ``query_start_loc`` (spec §2.17.1), or ``None``.

    Computed on the host by the same rule as on device, from the host query
    start locations and the host logits indices (the record's host copy, or the
    device values when they are concrete, outside jit). ``None`` where the host
    data is not there (inside jit).
    """
    qsl = common.query_start_loc_cpu
    if qsl is None:
        return None
    qsl = np.asarray(qsl)
    if np.diff(qsl).max(initial=0) == 1:  # pure decode: vLLM keeps the record
        return qsl
    idx = common.logits_indices_cpu
    if idx is None:
        try:
            n = int(common.num_logits_indices)
            idx = np.asarray(common.logits_indices_padded)[:n]
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerIntegerConversionError,
            jax.errors.TracerArrayConversionError,
        ):  # traced device values (a record built inside jit)
            return None
    owner = np.searchsorted(qsl[1:], np.asarray(idx), side="right")
    counts = np.bincount(owner, minlength=qsl.size - 1)[: qsl.size - 1]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
