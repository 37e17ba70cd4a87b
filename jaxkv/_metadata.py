"""Per-step attention metadata: the record, host packing, and per-group building.

Spec §1.12, §2.15-§2.17. The record's pytree structure is fixed by static
flags and capacities (shapes), never by a step's values: optional features are
zero-filled arrays, counts are int32 leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxkv._attn_group import AttentionGroup
from jaxkv._kv_cache_config import KVCacheConfig
from jaxkv._pytree import static_field
from jaxkv._specs import MambaSpec


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "query_start_loc",
        "seq_lens",
        "block_table_tensor",
        "slot_mapping",
        "num_reqs",
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "positions",
        "is_prefilling",
        "token_to_req",
        "encoder_seq_lens",
        "mm_prefix_ranges",
        "mm_num_ranges",
        "logits_indices_padded",
        "num_logits_indices",
        "max_logits_per_req",
    ],
    meta_fields=["causal", "fast_prefill"],
    drop_fields=["query_start_loc_cpu"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """Attention inputs of one KV-cache group for one step, padded to capacities.

    Only the first ``num_reqs`` rows of per-request arrays and the first
    ``num_actual_tokens`` entries of per-token arrays are meaningful; padded
    rows of ``query_start_loc`` repeat its last value (zero-length requests),
    padded slots are ``-1``, padded block-table entries are ``0`` (null block).
    ``query_start_loc_cpu`` is the host copy (NumPy), kept outside the traced
    leaves: it is ``None`` inside ``jit``.

    Example:
      >>> import jax
      >>> import jaxkv
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=4, max_tokens=8,
      ...                                         max_blocks=2)
      >>> len(jax.tree.leaves(m)), m.query_start_loc.shape
      (17, (5,))
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
    causal: bool = static_field(default=True)
    fast_prefill: bool = static_field(default=False)
    query_start_loc_cpu: np.ndarray | None = None

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
        )

    @property
    def max_reqs(self) -> int:
        """Request capacity (static, from the shape)."""
        return self.seq_lens.shape[0]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLayout:
    """Capacities of a step and where each host field sits in the packed buffer.

    One int32 host buffer holds every per-step field of every group, so a step
    costs one host-to-device transfer; :func:`unpack_step` slices it on device.

    Args:
      max_reqs: Request capacity (the request bucket).
      max_tokens: Token capacity (the token bucket).
      block_table_widths: Block-table columns per KV-cache group.
      max_mm_ranges: Multimodal prefix ranges per request (0: none).
      num_samples: Room for the model's inputs too: ``token_ids``
        (``max_tokens``) and ``sample_idx`` (``num_samples``) when positive.

    Example:
      >>> import jaxkv
      >>> layout = jaxkv.StepLayout(max_reqs=4, max_tokens=8, block_table_widths=(2,))
      >>> layout.size
      57
    """

    max_reqs: int
    max_tokens: int
    block_table_widths: tuple[int, ...]
    max_mm_ranges: int = 0
    num_samples: int = 0

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every packed field, in buffer order."""
        r, t = self.max_reqs, self.max_tokens
        out = [
            ("scalars", (4,)),  # num_reqs, num_tokens, max_query_len, max_seq_len
            ("query_start_loc", (r + 1,)),
            ("seq_lens", (r,)),
            ("positions", (t,)),
            ("is_prefilling", (r,)),
            ("token_to_req", (t,)),
            ("encoder_seq_lens", (r,)),
            ("mm_prefix_ranges", (r, self.max_mm_ranges, 2)),
            ("mm_num_ranges", (r,)),
        ]
        for g, width in enumerate(self.block_table_widths):
            out.append((f"block_table.{g}", (r, width)))
            out.append((f"slot_mapping.{g}", (t,)))
        if self.num_samples:
            out.append(("token_ids", (t,)))
            out.append(("sample_idx", (self.num_samples,)))
        return out

    @functools.cached_property
    def _offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out, pos = {}, 0
        for name, shape in self.fields():
            out[name] = (pos, shape)
            pos += math.prod(shape)
        return out

    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """``name -> (offset, shape)`` in the packed buffer (computed once)."""
        return self._offsets

    @property
    def size(self) -> int:
        """Int32 entries of the packed buffer."""
        return sum(math.prod(s) for _, s in self.fields())


def pack_step(
    layout: StepLayout,
    *,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    positions: np.ndarray,
    block_tables: Sequence[np.ndarray],
    slot_mappings: Sequence[np.ndarray],
    is_prefilling: np.ndarray | None = None,
    encoder_seq_lens: np.ndarray | None = None,
    mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    token_ids: np.ndarray | None = None,
    sample_idx: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Packs one step's host arrays into a single int32 buffer (NumPy only).

    Per-request arrays are padded to ``max_reqs`` (``query_start_loc`` repeats
    its last value), per-token arrays to ``max_tokens`` (slots with ``-1``),
    block tables with the null block ``0``.

    Args:
      layout: The capacities.
      query_start_loc: ``(num_reqs + 1,)`` cumulative query lengths.
      seq_lens: ``(num_reqs,)`` context lengths after this step.
      positions: ``(num_tokens,)`` token positions.
      block_tables: Per KV-cache group ``(num_reqs, cols)`` manager block ids.
      slot_mappings: Per KV-cache group ``(num_tokens,)`` slots.
      is_prefilling: ``(num_reqs,)`` bools (default: query length > 1).
      encoder_seq_lens: ``(num_reqs,)`` encoder lengths (default zeros).
      mm_prefix_ranges: ``request -> inclusive ranges`` from
        :func:`compute_mm_prefix_ranges`.
      token_ids: ``(num_tokens,)`` model inputs (layouts with ``num_samples``).
      sample_idx: Token indices whose logits are sampled; padded with the last.
      out: A preallocated buffer of ``layout.size`` int32 to fill (reused across
        steps to avoid allocation).

    Returns:
      The packed buffer.

    Raises:
      ValueError: If a field does not fit its capacity.
    """
    qsl = np.asarray(query_start_loc, np.int64)
    num_reqs = qsl.size - 1
    num_tokens = int(qsl[-1])
    if num_reqs > layout.max_reqs or num_tokens > layout.max_tokens:
        raise ValueError(
            f"A step of {num_reqs} requests and {num_tokens} tokens does not fit the "
            f"layout's capacity ({layout.max_reqs} requests, "
            f"{layout.max_tokens} tokens)."
        )
    if len(block_tables) != len(layout.block_table_widths) or len(slot_mappings) != len(
        layout.block_table_widths
    ):
        raise ValueError(
            f"Expected {len(layout.block_table_widths)} block tables and slot mappings "
            f"(one per KV-cache group), got {len(block_tables)} and "
            f"{len(slot_mappings)}."
        )
    buf = np.zeros(layout.size, np.int32) if out is None else out
    offs = layout.offsets()

    def put(name: str, values: np.ndarray, fill: int = 0) -> None:
        off, shape = offs[name]
        view = buf[off : off + math.prod(shape)].reshape(shape)
        view[...] = fill
        values = np.asarray(values)
        if any(v > s for v, s in zip(values.shape, shape, strict=True)):
            raise ValueError(f"{name}.shape={values.shape} does not fit {shape}.")
        view[tuple(slice(0, n) for n in values.shape)] = values

    q_lens = np.diff(qsl)
    put(
        "scalars",
        np.array(
            [num_reqs, num_tokens, q_lens.max(initial=0), np.max(seq_lens, initial=0)]
        ),
    )
    put("query_start_loc", qsl, fill=num_tokens)
    put("seq_lens", seq_lens)
    put("positions", positions)
    put("is_prefilling", q_lens > 1 if is_prefilling is None else is_prefilling)
    put("token_to_req", np.repeat(np.arange(num_reqs), q_lens))
    put(
        "encoder_seq_lens",
        np.zeros(num_reqs) if encoder_seq_lens is None else encoder_seq_lens,
    )
    ranges = np.zeros((num_reqs, layout.max_mm_ranges, 2), np.int32)
    counts = np.zeros(num_reqs, np.int32)
    for req, rs in (mm_prefix_ranges or {}).items():
        if len(rs) > layout.max_mm_ranges:
            raise ValueError(
                f"Request {req} has {len(rs)} multimodal ranges; the layout holds "
                f"{layout.max_mm_ranges}."
            )
        counts[req] = len(rs)
        if rs:
            ranges[req, : len(rs)] = rs
    put("mm_prefix_ranges", ranges)
    put("mm_num_ranges", counts)
    for g, (table, slots) in enumerate(zip(block_tables, slot_mappings, strict=True)):
        put(f"block_table.{g}", table)
        put(f"slot_mapping.{g}", slots, fill=-1)
    if layout.num_samples:
        put("token_ids", np.zeros(0, np.int32) if token_ids is None else token_ids)
        samples = (
            np.zeros(0, np.int32) if sample_idx is None else np.asarray(sample_idx)
        )
        put("sample_idx", samples, fill=int(samples[-1]) if samples.size else 0)
    return buf


def unpack_step(packed: jax.Array, layout: StepLayout) -> dict[str, jax.Array]:
    """Slices a packed step buffer into its fields (jittable; static slices)."""
    out = {}
    for name, (off, shape) in layout.offsets().items():
        out[name] = packed[off : off + math.prod(shape)].reshape(shape)
    return out


def build_attn_metadata_from_step(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    fields: Mapping[str, jax.Array],
    kv_cache_config: KVCacheConfig,
    *,
    causal: bool | Mapping[int, bool] = True,
    fast_prefill: Any = None,
) -> dict[str, CommonAttentionMetadata]:
    """:func:`build_attn_metadata` from the fields of :func:`unpack_step`.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=8)
      >>> groups, _, _ = jaxkv.init_attn_backend(kv, cfg)
      >>> layout = jaxkv.StepLayout(max_reqs=2, max_tokens=8,
      ...                           block_table_widths=(1,) * 3)
      >>> packed = jaxkv.pack_step(layout, query_start_loc=np.array([0, 3]),
      ...     seq_lens=np.array([3]), positions=np.arange(3),
      ...     block_tables=[np.array([[1]])] * 3, slot_mappings=[np.arange(32, 35)] * 3)
      >>> fields = jaxkv.unpack_step(jnp.asarray(packed), layout)
      >>> meta = jaxkv.build_attn_metadata_from_step(groups, fields, kv)
      >>> meta["layers.1.self_attn"].slot_mapping.tolist()
      [32, 33, 34, -1, -1, -1, -1, -1]
    """
    s = fields["scalars"]
    n = len(attn_groups)
    return build_attn_metadata(
        attn_groups,
        s[0],
        s[1],
        fields["query_start_loc"],
        None,
        s[2],
        fields["seq_lens"],
        s[3],
        [fields[f"block_table.{g}"] for g in range(n)],
        [fields[f"slot_mapping.{g}"] for g in range(n)],
        kv_cache_config,
        positions=fields["positions"],
        is_prefilling=fields["is_prefilling"],
        token_to_req=fields["token_to_req"],
        encoder_seq_lens=fields["encoder_seq_lens"],
        mm_prefix_ranges=fields["mm_prefix_ranges"],
        mm_num_ranges=fields["mm_num_ranges"],
        causal=causal,
        fast_prefill=fast_prefill,
    )


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
    causal: bool | Mapping[int, bool] = True,
    fast_prefill: Any = None,
) -> dict[str, CommonAttentionMetadata]:
    """Builds one metadata record per attention group; maps every layer to it.

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
      causal: Per-group causality.
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
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=8)
      >>> groups, _, _ = jaxkv.init_attn_backend(kv, cfg)
      >>> i32 = lambda x: jnp.asarray(x, jnp.int32)
      >>> meta = jaxkv.build_attn_metadata(
      ...     groups, i32(2), i32(5), i32([0, 4, 5]), None, i32(4), i32([4, 9]),
      ...     i32(9), [i32([[1], [2]])] * 3, [i32([32, 33, 34, 35, 72])] * 3, kv)
      >>> meta["layers.0.self_attn"] is meta["layers.3.self_attn"]
      True
      >>> meta["layers.2.mixer"].block_table_tensor.tolist()
      [[1], [2]]
    """
    if len(block_tables) < len(attn_groups) or len(slot_mappings) < len(attn_groups):
        raise ValueError(
            f"build_attn_metadata needs one block table and slot mapping per "
            f"KV-cache group ({len(attn_groups)}), got {len(block_tables)} and "
            f"{len(slot_mappings)}."
        )
    del kv_cache_config  # group ids index block_tables / slot_mappings directly
    qsl = jnp.asarray(query_start_loc_gpu, jnp.int32)
    seq = jnp.asarray(seq_lens, jnp.int32)
    max_reqs = seq.shape[0]
    max_tokens = jnp.asarray(slot_mappings[0]).shape[0]
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    if token_to_req is None:
        # Token t belongs to the request whose range [qsl[r], qsl[r+1]) holds it:
        # qsl = [0, 4, 5] -> tokens [0, 0, 0, 0, 1].
        token_to_req = jnp.searchsorted(
            qsl[1:], jnp.arange(max_tokens, dtype=jnp.int32), side="right"
        ).astype(jnp.int32)
    ranges = (
        jnp.zeros((max_reqs, 0, 2), jnp.int32)
        if mm_prefix_ranges is None
        else i32(mm_prefix_ranges)
    )
    fp = fast_prefill
    base: dict[str, Any] = dict(
        query_start_loc=qsl,
        seq_lens=seq,
        num_reqs=i32(num_reqs),
        num_actual_tokens=i32(num_tokens),
        max_query_len=i32(max_query_len),
        max_seq_len=i32(max_seq_len),
        positions=jnp.zeros(max_tokens, jnp.int32)
        if positions is None
        else i32(positions),
        is_prefilling=(
            jnp.zeros(max_reqs, jnp.bool_)
            if is_prefilling is None
            else jnp.asarray(is_prefilling).astype(jnp.bool_)
        ),
        token_to_req=i32(token_to_req),
        encoder_seq_lens=(
            jnp.zeros(max_reqs, jnp.int32)
            if encoder_seq_lens is None
            else i32(encoder_seq_lens)
        ),
        mm_prefix_ranges=ranges,
        mm_num_ranges=(
            jnp.zeros(max_reqs, jnp.int32)
            if mm_num_ranges is None
            else i32(mm_num_ranges)
        ),
        logits_indices_padded=(
            jnp.zeros(1, jnp.int32) if fp is None else i32(fp.logits_indices_padded)
        ),
        num_logits_indices=i32(0) if fp is None else i32(fp.num_logits_indices),
        max_logits_per_req=i32(0) if fp is None else i32(fp.max_logits_per_req),
        fast_prefill=fp is not None,
        query_start_loc_cpu=query_start_loc_cpu,
    )
    out: dict[str, CommonAttentionMetadata] = {}
    mamba_cache: dict[tuple[Any, Any], CommonAttentionMetadata] = {}
    for gid, groups in enumerate(attn_groups):
        if not groups:
            continue
        group_causal = causal if isinstance(causal, bool) else causal.get(gid, True)
        table = i32(block_tables[gid])
        slots = i32(slot_mappings[gid])
        for group in groups:
            group_table = group.map_to_kernel_block_table(table)
            key = (group.kv_cache_spec, group.backend)
            if (
                isinstance(group.kv_cache_spec, MambaSpec)
                and group.backend.supports_update_block_table
                and key in mamba_cache
            ):
                meta = dataclasses.replace(
                    mamba_cache[key], block_table_tensor=group_table, slot_mapping=slots
                )
            else:
                meta = CommonAttentionMetadata(
                    block_table_tensor=group_table,
                    slot_mapping=slots,
                    causal=group_causal,
                    **base,
                )
                if isinstance(group.kv_cache_spec, MambaSpec):
                    mamba_cache.setdefault(key, meta)
            if group.backend.prefix.startswith("FastPrefill"):
                meta = make_kv_sharing_fast_prefill_common_attn_metadata(meta)
            for name in group.layer_names:
                out[name] = meta
    return out


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
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> i32 = lambda x: jnp.asarray(x, jnp.int32)
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=28,
      ...                                         max_blocks=1)
      >>> m = dataclasses.replace(m, query_start_loc=i32([0, 15, 20, 28]),
      ...     seq_lens=i32([41, 31, 40]), num_reqs=i32(3), max_query_len=i32(15),
      ...     logits_indices_padded=i32([14, 18, 19, 27, 27, 27, 27, 27]),
      ...     num_logits_indices=i32(4), max_logits_per_req=i32(2), fast_prefill=True)
      >>> r = jaxkv.make_kv_sharing_fast_prefill_common_attn_metadata(m)
      >>> r.query_start_loc.tolist(), int(r.num_actual_tokens), int(r.max_query_len)
      ([0, 1, 3, 4], 4, 2)
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
        causal=True,
        query_start_loc_cpu=None,
    )
