"""Building every attention group's metadata for a step (spec §2.15-§2.16).

:func:`build_attn_metadata_from_step` is the one builder: a step's named
fields (:class:`StepFields`) in, one record per attention group out.
:func:`build_attn_metadata` is vLLM's signature over it: its positional
arguments become a :class:`StepFields` (defaults filled in) first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import KVCacheConfig, MambaSpec
from jaxkv.groups import AttentionGroup
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._fast_prefill import FastPrefillBatchMetadata
from jaxkv.step._packing import StepFields
from jaxkv.step._reduced_metadata import (
    make_kv_sharing_fast_prefill_common_attn_metadata,
)


def build_attn_metadata_from_step(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    fields: StepFields,
    kv_cache_config: KVCacheConfig,
    *,
    causal: bool | Mapping[int, bool] = True,
    fast_prefill: FastPrefillBatchMetadata | None = None,
    query_start_loc_cpu: np.ndarray | None = None,
) -> dict[str, CommonAttentionMetadata]:
    """Every layer's metadata from a step's named fields (jittable).

    Per KV-cache group: causality from `causal` (a bool, or ``gid -> bool``
    with default ``True``) combined with the per-request
    ``fields.request_causal``; the group's block table and slot mapping;
    groups with a kernel block size get the expanded kernel block table;
    Mamba groups with the same spec and backend reuse the first one's record
    with their own block table and slot mapping; fast-prefill-wrapped groups
    get the reduced record
    (:func:`make_kv_sharing_fast_prefill_common_attn_metadata`).

    Args:
      attn_groups: Attention groups per KV-cache group.
      fields: The step, e.g. :func:`unpack_step`'s.
      kv_cache_config: Pools and groups.
      causal: A bool for every group, or ``gid -> bool`` (default ``True``).
      fast_prefill: A :class:`FastPrefillBatchMetadata` attached to every
        record, or ``None``.
      query_start_loc_cpu: The host copy to attach, or ``None``.

    Returns:
      ``layer name -> metadata`` (the same record for every layer of a group).

    Raises:
      ValueError: If there are fewer block tables or slot mappings than
        groups, or more groups than the config has.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
      >>> groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> capacity = jaxkv.step.StepCapacity(max_reqs=2, max_tokens=8,
      ...                           block_table_widths=(1,) * 3)
      >>> packed = jaxkv.step.pack_step(capacity, query_start_loc=np.array([0, 3]),
      ...     seq_lens=np.array([3]), positions=np.arange(3),
      ...     block_tables=[np.array([[1]])] * 3, slot_mappings=[np.arange(32, 35)] * 3)
      >>> fields = jaxkv.step.unpack_step(jnp.asarray(packed), capacity)
      >>> meta = jaxkv.step.build_attn_metadata_from_step(groups, fields, kv)
      >>> meta["layers.1.self_attn"].slot_mapping.tolist()
      [32, 33, 34, -1, -1, -1, -1, -1]
    """
    _check_groups(attn_groups, kv_cache_config, fields)
    shared = _shared_fields(fields, fast_prefill, query_start_loc_cpu)
    out: dict[str, CommonAttentionMetadata] = {}
    mamba_cache: dict[tuple[Any, Any], CommonAttentionMetadata] = {}
    for gid, groups in enumerate(attn_groups):
        group_causal = (
            causal if isinstance(causal, bool) else bool(causal.get(gid, True))
        )
        for group in groups:
            meta = _group_record(
                group,
                fields.block_tables[gid],
                fields.slot_mappings[gid],
                group_causal,
                shared,
                mamba_cache,
            )
            meta = dataclasses.replace(meta, group=gid)
            for name in group.layer_names:
                out[name] = meta
    return out


def _check_groups(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    kv_cache_config: KVCacheConfig,
    fields: StepFields,
) -> None:
    n = len(attn_groups)
    if len(fields.block_tables) < n or len(fields.slot_mappings) < n:
        raise ValueError(
            f"build_attn_metadata needs one block table and slot mapping per "
            f"KV-cache group ({n}), got {len(fields.block_tables)} and "
            f"{len(fields.slot_mappings)}."
        )
    if n > len(kv_cache_config.kv_cache_groups):
        raise ValueError(
            f"build_attn_metadata: {n} attention-group lists for a "
            f"KVCacheConfig of {len(kv_cache_config.kv_cache_groups)} KV-cache groups; "
            "pass the config init_attn_backend grouped (with KV-sharing layers)."
        )


def _shared_fields(
    fields: StepFields,
    fp: FastPrefillBatchMetadata | None,
    query_start_loc_cpu: np.ndarray | None,
) -> dict[str, Any]:
    """The record fields every group of a step shares."""
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return dict(
        request_causal=fields.request_causal,
        query_start_loc=fields.query_start_loc,
        seq_lens=fields.seq_lens,
        num_reqs=fields.num_reqs,
        num_actual_tokens=fields.num_tokens,
        max_query_len=fields.max_query_len,
        max_seq_len=fields.max_seq_len,
        positions=fields.positions,
        is_prefilling=fields.is_prefilling,
        token_to_req=fields.token_to_req,
        encoder_seq_lens=fields.encoder_seq_lens,
        mm_prefix_ranges=fields.mm_prefix_ranges,
        mm_num_ranges=fields.mm_num_ranges,
        logits_indices_padded=(
            jnp.zeros(1, jnp.int32) if fp is None else i32(fp.logits_indices_padded)
        ),
        num_logits_indices=i32(0) if fp is None else i32(fp.num_logits_indices),
        max_logits_per_req=i32(0) if fp is None else i32(fp.max_logits_per_req),
        fast_prefill=fp is not None,
        query_start_loc_cpu=query_start_loc_cpu,
        logits_indices_cpu=None if fp is None else fp.logits_indices_cpu,
    )


def _group_record(
    group: AttentionGroup,
    table: jax.Array,
    slots: jax.Array,
    causal: bool,
    shared: dict[str, Any],
    mamba_cache: dict[tuple[Any, Any], CommonAttentionMetadata],
) -> CommonAttentionMetadata:
    """One attention group's record (a Mamba group may reuse an earlier one)."""
    group_table = group.map_to_kernel_block_table(table)
    key = (group.kv_cache_spec, group.backend)
    is_mamba = isinstance(group.kv_cache_spec, MambaSpec)
    if is_mamba and group.backend.supports_update_block_table and key in mamba_cache:
        meta = dataclasses.replace(
            mamba_cache[key], block_table_tensor=group_table, slot_mapping=slots
        )
    else:
        meta = CommonAttentionMetadata(
            block_table_tensor=group_table,
            slot_mapping=slots,
            causal=causal,
            block_size=group.kernel_block_size or group.kv_cache_spec.block_size,
            **shared,
        )
        if is_mamba:
            mamba_cache.setdefault(key, meta)
    if group.fast_prefill:
        meta = make_kv_sharing_fast_prefill_common_attn_metadata(meta)
    return meta


def build_attn_metadata(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    num_reqs: Any,
    num_tokens: Any,
    query_start_loc_gpu: Any,
    query_start_loc_cpu: np.ndarray | None,
    max_query_len: Any,
    seq_lens: Any,
    max_seq_len: Any,
    block_tables: Sequence[Any],
    slot_mappings: Sequence[Any],
    kv_cache_config: KVCacheConfig,
    *,
    positions: Any = None,
    is_prefilling: Any = None,
    token_to_req: Any = None,
    encoder_seq_lens: Any = None,
    mm_prefix_ranges: Any = None,
    mm_num_ranges: Any = None,
    causal: bool | Mapping[int, bool] | Any = True,
    request_causal: Any = None,
    fast_prefill: FastPrefillBatchMetadata | None = None,
) -> dict[str, CommonAttentionMetadata]:
    """Builds one metadata record per attention group; maps every layer to it.

    vLLM's signature: the arguments become a :class:`StepFields` (``None``
    fields filled with their defaults), then
    :func:`build_attn_metadata_from_step` builds the records.

    Jittable: array arguments may be traced; capacities come from shapes. Per
    KV-cache group: causality from `causal` (a bool, or ``gid -> bool`` with
    default ``True``); the group's block table and slot mapping; groups with a
    kernel block size get the expanded kernel block table; Mamba groups with
    the same spec and backend reuse the first one's record with their own
    block table and slot mapping; fast-prefill-wrapped groups get the reduced
    record (:func:`make_kv_sharing_fast_prefill_common_attn_metadata`).

    Args:
      attn_groups: Attention groups per KV-cache group.
      num_reqs: Real requests (int32 scalar).
      num_tokens: Real tokens (int32 scalar).
      query_start_loc_gpu: ``(max_reqs + 1,)`` int32.
      query_start_loc_cpu: Host copy, or ``None``.
      max_query_len: int32 scalar.
      seq_lens: ``(max_reqs,)`` int32.
      max_seq_len: int32 scalar (an upper bound is fine).
      block_tables: One ``(max_reqs, cols)`` manager block table per group.
      slot_mappings: One ``(max_tokens,)`` slot row per group.
      kv_cache_config: Pools and groups.
      positions: ``(max_tokens,)``; zeros if ``None``.
      is_prefilling: ``(max_reqs,)`` bools; ``False`` if ``None``.
      token_to_req: ``(max_tokens,)`` owning request of each token; computed
        from `query_start_loc_gpu` if ``None`` (once, shared by all groups).
      encoder_seq_lens: ``(max_reqs,)``; zeros if ``None``.
      mm_prefix_ranges: ``(max_reqs, max_ranges, 2)``; empty if ``None``.
      mm_num_ranges: ``(max_reqs,)`` valid ranges per request.
      causal: Causality, as in vLLM: a bool for every group, a mapping
        ``gid -> bool`` (default ``True``), or a per-request boolean array
        (``(num_reqs,)`` or ``(max_reqs,)``) handed to every group: requests
        marked ``False`` attend to their whole context.
      request_causal: Per-request causality combined with a bool or mapping
        `causal` (how :func:`build_attn_metadata_from_step` passes the packed
        field); default all ``True``.
      fast_prefill: A :class:`FastPrefillBatchMetadata`, attached to every
        group's record, or ``None``.

    Returns:
      ``layer name -> metadata`` (the same record for every layer of a group).

    Raises:
      ValueError: If there are fewer block tables or slot mappings than groups.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
      >>> groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> i32 = lambda x: jnp.asarray(x, jnp.int32)
      >>> meta = jaxkv.vllm.build_attn_metadata(
      ...     groups, i32(2), i32(5), i32([0, 4, 5]), None, i32(4), i32([4, 9]),
      ...     i32(9), [i32([[1], [2]])] * 3, [i32([32, 33, 34, 35, 72])] * 3, kv)
      >>> meta["layers.0.self_attn"] is meta["layers.3.self_attn"]
      True
      >>> meta["layers.2.mixer"].block_table_tensor.tolist()
      [[1], [2]]
    """
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    if not isinstance(causal, bool | Mapping):  # a per-request array
        if request_causal is not None:
            raise ValueError(
                "build_attn_metadata: causal is already a per-request array; "
                "request_causal must be None."
            )
        request_causal, causal = causal, True
    qsl = i32(query_start_loc_gpu)
    seq = i32(seq_lens)
    max_reqs = seq.shape[0]
    max_tokens = jnp.asarray(slot_mappings[0]).shape[0] if slot_mappings else 0
    if token_to_req is None:
        # Token t belongs to the request whose range [qsl[r], qsl[r+1]) holds it:
        # qsl = [0, 4, 5] -> tokens [0, 0, 0, 0, 1].
        token_to_req = jnp.searchsorted(
            qsl[1:], jnp.arange(max_tokens, dtype=jnp.int32), side="right"
        )

    def given(value: Any, shape: tuple[int, ...]) -> jax.Array:
        return jnp.zeros(shape, jnp.int32) if value is None else i32(value)

    fields = StepFields(
        num_reqs=i32(num_reqs),
        num_tokens=i32(num_tokens),
        max_query_len=i32(max_query_len),
        max_seq_len=i32(max_seq_len),
        query_start_loc=qsl,
        seq_lens=seq,
        positions=given(positions, (max_tokens,)),
        is_prefilling=given(is_prefilling, (max_reqs,)).astype(jnp.bool_),
        token_to_req=i32(token_to_req),
        encoder_seq_lens=given(encoder_seq_lens, (max_reqs,)),
        mm_prefix_ranges=given(mm_prefix_ranges, (max_reqs, 0, 2)),
        mm_num_ranges=given(mm_num_ranges, (max_reqs,)),
        request_causal=_request_causal(request_causal, num_reqs, max_reqs),
        block_tables=tuple(i32(b) for b in block_tables),
        slot_mappings=tuple(i32(s) for s in slot_mappings),
    )
    return build_attn_metadata_from_step(
        attn_groups,
        fields,
        kv_cache_config,
        causal=causal,
        fast_prefill=fast_prefill,
        query_start_loc_cpu=query_start_loc_cpu,
    )


def _request_causal(values: Any, num_reqs: Any, max_reqs: int) -> jax.Array:
    """``(max_reqs,)`` bools: `values` padded with ``True`` (or all ``True``).

    Raises:
      ValueError: If `values` has neither ``num_reqs`` nor ``max_reqs`` entries,
        or is not boolean (a 0/1 int32 array from a packed step is accepted).
    """
    if values is None:
        return jnp.ones(max_reqs, jnp.bool_)
    arr = jnp.asarray(values)
    if arr.ndim != 1 or not (
        arr.dtype == jnp.bool_ or jnp.issubdtype(arr.dtype, jnp.integer)
    ):
        raise ValueError(
            f"build_attn_metadata: a per-request causal must be a 1-D boolean "
            f"array, got shape {arr.shape} and dtype {arr.dtype}."
        )
    n = arr.shape[0]
    if n == max_reqs:
        return arr.astype(jnp.bool_)
    try:
        expected = int(num_reqs)
    except (jax.errors.ConcretizationTypeError, TypeError):
        expected = n  # traced count: trust the shape, pad to capacity
    if n != expected or n > max_reqs:
        raise ValueError(
            f"build_attn_metadata: the per-request causal array has {n} entries, "
            f"expected num_reqs={expected} or max_reqs={max_reqs}."
        )
    return jnp.concatenate([arr.astype(jnp.bool_), jnp.ones(max_reqs - n, jnp.bool_)])
