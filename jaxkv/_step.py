"""One step's metadata end to end: dispatch, pack, one transfer, compiled build."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._attn_group import AttentionGroup
from jaxkv._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv._fast_prefill import FastPrefillBatchMetadata, FastPrefillHelper
from jaxkv._kv_cache_config import KVCacheConfig
from jaxkv._metadata import (
    CommonAttentionMetadata,
    StepLayout,
    build_attn_metadata_from_step,
    pack_step,
    unpack_step,
)


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """What the host hands the device for one step.

    Attributes:
      desc: The executable the step uses (padded sizes and mode).
      layout: Capacities of the packed buffer.
      packed: The packed step inputs (host). They cross to the device as one
        transfer, as an argument of the step's executable.
      fast_prefill: Staged fast-prefill inputs, or ``None`` when not armed.
      query_start_loc_cpu: Host copy of the (unpadded) query start locations.
      cu_num_logits_cpu: Host cumulative logits counts: the host copy of the
        reduced ``query_start_loc`` of fast-prefill layers.
    """

    desc: BatchDescriptor
    layout: StepLayout
    packed: np.ndarray
    fast_prefill: FastPrefillBatchMetadata | None
    query_start_loc_cpu: np.ndarray
    cu_num_logits_cpu: np.ndarray | None = None

    @property
    def executable_key(self) -> tuple[Any, ...]:
        """Key of the compiled executable this step runs."""
        fp = (
            None
            if self.fast_prefill is None
            else self.fast_prefill.logits_indices_padded.shape[0]
        )
        return (*self.desc.key, fp)


class StepMetadataBuilder:
    """Builds every layer's attention metadata for a step, compiled per bucket.

    Host side (NumPy): pick the bucket, pack every field of every group into one
    int32 buffer, one ``device_put``; arm fast prefill and stage its indices.
    Device side (one executable per bucket and fast-prefill padding): unpack and
    :func:`build_attn_metadata`. :meth:`warm_up` compiles all of them from
    shapes, after which steps compile nothing.

    Args:
      attn_groups: From :func:`init_attn_backend`.
      kv_cache_config: Pools and groups.
      dispatcher: The bucket dispatcher.
      block_table_widths: Manager block-table columns per KV-cache group.
      fast_prefill_helper: Stages logits indices when the model has
        fast-prefill layers, else ``None``.
      max_mm_ranges: Multimodal prefix ranges per request.
      causal: Per-group causality (see :func:`build_attn_metadata`).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=16)
      >>> groups, info, _ = jaxkv.init_attn_backend(kv, cfg)
      >>> d = jaxkv.BucketDispatcher(token_buckets=(8, 16), max_num_tokens=16,
      ...     max_num_reqs=4, request_buckets=(4,), cg_support=info.min_cg_support)
      >>> builder = jaxkv.StepMetadataBuilder(groups, kv, d,
      ...                                     block_table_widths=(2,) * 3)
      >>> builder.warm_up()
      >>> step = builder.prepare(query_start_loc=np.array([0, 3, 4]),
      ...     seq_lens=np.array([3, 9]), positions=np.array([0, 1, 2, 8]),
      ...     block_tables=[np.array([[1], [2]])] * 3,
      ...     slot_mappings=[np.array([32, 33, 34, 72])] * 3)
      >>> step.desc.num_tokens, step.desc.cg_mode.name
      (8, 'PIECEWISE')
      >>> meta = builder.build(step)
      >>> meta["layers.0.self_attn"].query_start_loc.tolist()
      [0, 3, 4, 4, 4]
    """

    def __init__(
        self,
        attn_groups: Sequence[Sequence[AttentionGroup]],
        kv_cache_config: KVCacheConfig,
        dispatcher: BucketDispatcher,
        *,
        block_table_widths: Sequence[int],
        fast_prefill_helper: FastPrefillHelper | None = None,
        max_mm_ranges: int = 0,
        causal: bool | Mapping[int, bool] = True,
    ) -> None:
        """Stores the static configuration."""
        if len(block_table_widths) != len(kv_cache_config.kv_cache_groups):
            raise ValueError(
                f"block_table_widths has {len(block_table_widths)} entries, expected "
                f"one per KV-cache group ({len(kv_cache_config.kv_cache_groups)})."
            )
        self.attn_groups = [list(g) for g in attn_groups]
        self.kv_cache_config = kv_cache_config
        self.dispatcher = dispatcher
        self.widths = tuple(block_table_widths)
        self.fast_prefill_helper = fast_prefill_helper
        self.max_mm_ranges = max_mm_ranges
        self.causal = causal
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self._device_fn = jax.jit(self._device)
        self._record_of: dict[str, int] = {}
        self._wrapped = {
            name
            for groups in self.attn_groups
            for g in groups
            if g.backend.prefix.startswith("FastPrefill")
            for name in g.layer_names
        }

    def layout(self, desc: BatchDescriptor) -> StepLayout:
        """The packed layout of a descriptor's capacities."""
        return StepLayout(
            max_reqs=desc.num_reqs,
            max_tokens=desc.num_tokens,
            block_table_widths=self.widths,
            max_mm_ranges=self.max_mm_ranges,
        )

    def _device(
        self,
        packed: jax.Array,
        fast_prefill: FastPrefillBatchMetadata | None,
        layout: StepLayout,
    ) -> tuple[CommonAttentionMetadata, ...]:
        meta = build_attn_metadata_from_step(
            self.attn_groups,
            unpack_step(packed, layout),
            self.kv_cache_config,
            causal=self.causal,
            fast_prefill=fast_prefill,
        )
        # Return each record once (layers of a group share one); the static
        # layer -> record map is the same for every trace.
        records: list[CommonAttentionMetadata] = []
        index: dict[int, int] = {}
        for name, m in meta.items():
            if id(m) not in index:
                index[id(m)] = len(records)
                records.append(m)
            self._record_of[name] = index[id(m)]
        return tuple(records)

    def _fast_prefill_paddings(self, desc: BatchDescriptor) -> list[int | None]:
        if self.fast_prefill_helper is None or desc.cg_mode == CompileMode.FULL:
            return [None]
        # Logits indices are at most one per token; their bucket never exceeds
        # the step's.
        paddings = [
            p for p in self.fast_prefill_helper.paddings() if p <= desc.num_tokens
        ]
        return [None, *paddings]

    def executables(self) -> list[tuple[BatchDescriptor, int | None]]:
        """Every (descriptor, fast-prefill padding) this builder compiles."""
        return [
            (desc, p)
            for desc in self.dispatcher.executables()
            for p in self._fast_prefill_paddings(desc)
        ]

    def _abstract(self, desc: BatchDescriptor, padding: int | None) -> tuple[Any, ...]:
        layout = self.layout(desc)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        fp = None
        if padding is not None:
            scalar: Any = jax.ShapeDtypeStruct((), jnp.int32)
            fp = FastPrefillBatchMetadata(
                logits_indices_padded=cast(
                    Any, jax.ShapeDtypeStruct((padding,), jnp.int32)
                ),
                num_logits_indices=scalar,
                max_logits_per_req=scalar,
            )
        return packed, fp, layout

    def warm_up(self) -> None:
        """Compiles every executable from ``jax.ShapeDtypeStruct``s (no allocation)."""
        for desc, padding in self.executables():
            key = (*desc.key, padding)
            if key not in self.compiled:
                self.compiled[key] = self._device_fn.lower(
                    *self._abstract(desc, padding)
                ).compile()
        if self.fast_prefill_helper is not None:
            self.fast_prefill_helper.warm_up()
        self.dispatcher.mark_ready()

    def prepare(
        self,
        *,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        positions: np.ndarray,
        block_tables: Sequence[np.ndarray],
        slot_mappings: Sequence[np.ndarray],
        logits_indices: np.ndarray | None = None,
        cu_num_logits: np.ndarray | None = None,
        is_prefilling: np.ndarray | None = None,
        encoder_seq_lens: np.ndarray | None = None,
        mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    ) -> PreparedStep:
        """Host work of a step: dispatch, pack, one transfer, fast-prefill staging."""
        qsl = np.asarray(query_start_loc)
        num_reqs, num_tokens = qsl.size - 1, int(qsl[-1])
        q_lens = np.diff(qsl)
        uniform = int(q_lens[0]) if num_reqs and (q_lens == q_lens[0]).all() else None
        desc = self.dispatcher.dispatch(
            num_reqs=num_reqs, num_tokens=num_tokens, uniform_token_count=uniform
        )
        layout = self.layout(desc)
        # A fresh buffer per step: on CPU a transferred NumPy array may be
        # aliased zero-copy, so a reused buffer could change a step in flight.
        packed = pack_step(
            layout,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            positions=positions,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            is_prefilling=is_prefilling,
            encoder_seq_lens=encoder_seq_lens,
            mm_prefix_ranges=mm_prefix_ranges,
            out=np.empty(layout.size, np.int32),
        )
        fp = None
        if self.fast_prefill_helper is not None and logits_indices is not None:
            cu = cu_num_logits
            if cu is None:
                raise ValueError("cu_num_logits is required with logits_indices.")
            fp = self.fast_prefill_helper.prepare(
                logits_indices, num_reqs, cu, bool((q_lens > 1).any()), desc
            )
        return PreparedStep(
            desc=desc,
            layout=layout,
            packed=packed,
            fast_prefill=fp,
            query_start_loc_cpu=qsl,
            cu_num_logits_cpu=None if fp is None else np.asarray(cu_num_logits),
        )

    def build(self, step: PreparedStep) -> dict[str, CommonAttentionMetadata]:
        """Runs the step's compiled executable (or jit, before warm-up)."""
        exe = self.compiled.get(step.executable_key)
        if exe is None:
            records = self._device_fn(step.packed, step.fast_prefill, step.layout)
        else:
            records = exe(step.packed, step.fast_prefill, step.layout)
        # Host copies, outside the traced leaves: reduced (fast-prefill) records
        # get the host cumulative logits counts, which their device copy equals.
        with_host: dict[int, CommonAttentionMetadata] = {}
        out: dict[str, CommonAttentionMetadata] = {}
        for name, i in self._record_of.items():
            if i not in with_host:
                reduced = step.fast_prefill is not None and name in self._wrapped
                cpu = step.cu_num_logits_cpu if reduced else step.query_start_loc_cpu
                with_host[i] = dataclasses.replace(records[i], query_start_loc_cpu=cpu)
            out[name] = with_host[i]
        return out
