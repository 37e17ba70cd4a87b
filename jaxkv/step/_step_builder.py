"""One step end to end: dispatch, pack, one transfer, metadata inside any jit.

The pipeline every step runner uses, the serving loop included: the host picks
the bucket and packs every field of every group into one int32 buffer
(:meth:`StepMetadataBuilder.prepare`, or :meth:`~StepMetadataBuilder.
prepare_ranks` for every data-parallel rank of a mesh at once); the device
unpacks it and builds every layer's metadata
(:meth:`StepMetadataBuilder.metadata`), either inside the caller's own jitted
step (one executable per step) or in the builder's own compiled program
(:meth:`StepMetadataBuilder.build`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._mamba_spec import MambaSpec
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.step._attn_metadata import build_attn_metadata_from_step
from jaxkv.step._buckets import BucketDispatcher, CompileMode
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._fast_prefill import FastPrefillBatchMetadata, FastPrefillHelper
from jaxkv.step._packing import unpack_step
from jaxkv.step._prepare import StepPreparation
from jaxkv.step._programs import Programs
from jaxkv.step._step_inputs import StepInputs


def _abstract(shape: tuple[int, ...], rows: NamedSharding | None, ranks: int) -> Any:
    if rows is None:
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    return jax.ShapeDtypeStruct((ranks, *shape), jnp.int32, sharding=rows)


def _abstract_fast_prefill(
    padding: int, rows: NamedSharding | None, ranks: int
) -> FastPrefillBatchMetadata:
    return FastPrefillBatchMetadata(
        logits_indices_padded=_abstract((padding,), rows, ranks),
        num_logits_indices=_abstract((), rows, ranks),
        max_logits_per_req=_abstract((), rows, ranks),
    )


class StepMetadataBuilder(StepPreparation):
    """Builds every layer's attention metadata for a step, one program per bucket.

    Host side (NumPy): pick the bucket, pack every field of every group into one
    int32 buffer; arm fast prefill and stage its indices. Given a
    :class:`ShardedPlan`, it prepares every data-parallel rank's step at once
    (:meth:`prepare_ranks`: one bucket for all ranks, each rank's buffer a row
    sharded over the data axis, fast prefill staged on each rank's row). Device
    side:
    :meth:`metadata` unpacks and runs :func:`build_attn_metadata`; call it
    inside your own jitted step (then the whole step is one executable), or let
    :meth:`build` run the builder's own compiled program. :meth:`warm_up`
    compiles every program from shapes, after which steps compile nothing.

    With ``model_inputs=True`` the packed buffer also carries the step's token
    ids and the indices of the tokens whose logits are sampled
    (:meth:`model_inputs`), padded to the same bucket as fast prefill's.

    Args:
      plan: From :func:`make_plan`, or a :class:`ShardedPlan` (then the
        builder's :attr:`plan` is its rank-local plan).
      dispatcher: The bucket dispatcher (default: the runner config's buckets
        and limits, and the plan's compile support, padding from the first
        step; one given here pads once it is ready, as vLLM's does after
        capture: :meth:`warm_up` or :meth:`warm_up_host` marks it).
      max_mm_ranges: Multimodal prefix ranges per request.
      causal: Per-group causality (see :func:`build_attn_metadata`).
      model_inputs: Pack token ids and sampled-token indices too.
      fast_prefill: Arm the fast-prefill path when the model has fast-prefill
        layers (``False``: those layers run on every token, as unarmed).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False,
      ...     max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
      ...     token_buckets=(8, 16), request_buckets=(4,))
      >>> plan = jaxkv.make_plan(cfg, num_blocks=16)
      >>> builder = jaxkv.StepMetadataBuilder(plan)
      >>> builder.warm_up()
      >>> step = builder.prepare(jaxkv.StepArrays(query_start_loc=np.array([0, 3, 4]),
      ...     seq_lens=np.array([3, 9]), positions=np.array([0, 1, 2, 8]),
      ...     block_tables=[np.array([[1], [2]])] * 3,
      ...     slot_mappings=[np.array([32, 33, 34, 72])] * 3))
      >>> step.desc.num_tokens, step.desc.cg_mode.name
      (8, 'PIECEWISE')
      >>> meta = builder.build(step)
      >>> meta["layers.0.self_attn"].query_start_loc.tolist()
      [0, 3, 4, 4, 4]
    """

    def __init__(
        self,
        plan: KVCachePlan | ShardedPlan,
        dispatcher: BucketDispatcher | None = None,
        *,
        max_mm_ranges: int = 0,
        causal: bool | Mapping[int, bool] = True,
        model_inputs: bool = False,
        fast_prefill: bool = True,
    ) -> None:
        """Stores the static configuration; compiles nothing."""
        sharded = plan if isinstance(plan, ShardedPlan) else None
        plan = sharded.local if sharded is not None else cast(KVCachePlan, plan)
        cfg = plan.runner_config
        if dispatcher is None:
            dispatcher = BucketDispatcher(
                token_buckets=cfg.token_buckets,
                max_num_tokens=cfg.max_num_batched_tokens,
                max_num_reqs=cfg.max_num_seqs,
                request_buckets=cfg.request_buckets,
                cg_support=plan.cg_support.min_cg_support,
            )
            # Its own dispatcher pads to the config's buckets from the first
            # step: a loop that never calls warm_up() still compiles one
            # program per bucket, not one per step shape.
            dispatcher.mark_ready()
        #: The plan every device runs (a mesh's rank-local plan).
        self.plan = plan
        #: The mesh plan, or ``None`` on one device.
        self.sharded = sharded
        #: ``NamedSharding(mesh, P(data_axis))`` of per-rank rows (``None`` on
        #: one device).
        self.rows = (
            None
            if sharded is None
            else NamedSharding(sharded.mesh, P(sharded.data_axis))
        )
        #: Data-parallel ranks (1 on one device).
        self.num_ranks = 1 if sharded is None else sharded.data_parallel
        self.dispatcher = dispatcher
        self.max_mm_ranges = max_mm_ranges
        self.causal = causal
        self.model_inputs = model_inputs
        self.fast_prefill_helper = (
            FastPrefillHelper(dispatcher, dispatcher.max_num_tokens, rows=self.rows)
            if fast_prefill
            and any(g.fast_prefill for groups in plan.attn_groups for g in groups)
            else None
        )
        # Layers sharing one record (an attention group), in a static order.
        self._records: tuple[tuple[str, ...], ...] = tuple(
            tuple(g.layer_names) for groups in plan.attn_groups for g in groups
        )
        self._fast_prefill_records = frozenset(
            i
            for i, g in enumerate(g for groups in plan.attn_groups for g in groups)
            if g.fast_prefill
        )
        self.programs = Programs(self._records_of)
        self._is_mamba = tuple(
            isinstance(g.kv_cache_spec, MambaSpec)
            for g in plan.kv_cache_config.kv_cache_groups
        )

    # --- device side (pure, jittable) -------------------------------------------

    def metadata(self, inputs: StepInputs) -> dict[str, CommonAttentionMetadata]:
        """Every layer's metadata from a step's inputs; call it inside your jit.

        Host copies (``query_start_loc_cpu``) are ``None`` here: they are not
        traced values; :meth:`build` attaches them.
        """
        return build_attn_metadata_from_step(
            self.plan.attn_groups,
            unpack_step(inputs.packed, inputs.layout),
            self.plan.kv_cache_config,
            causal=self.causal,
            fast_prefill=inputs.fast_prefill,
        )

    def model_inputs_of(self, inputs: StepInputs) -> tuple[jax.Array, jax.Array]:
        """``(token_ids (max_tokens,), sampled token indices (num_samples,))``.

        With fast prefill armed the sampled indices are its staged logits
        indices (the same tokens, padded the same way).

        Raises:
          ValueError: If the builder was made without ``model_inputs=True``.
        """
        if not self.model_inputs:
            raise ValueError(
                "StepMetadataBuilder.model_inputs_of: the builder packs no model "
                "inputs; make it with model_inputs=True."
            )
        fields = unpack_step(inputs.packed, inputs.layout)
        # model_inputs=True layouts hold both (num_samples > 0).
        token_ids = cast(jax.Array, fields.token_ids)
        sample = (
            cast(jax.Array, fields.sample_idx)
            if inputs.fast_prefill is None
            else inputs.fast_prefill.logits_indices_padded
        )
        return token_ids, sample

    def _records_of(self, inputs: StepInputs) -> tuple[CommonAttentionMetadata, ...]:
        meta = self.metadata(inputs)
        return tuple(meta[names[0]] for names in self._records)

    # --- programs ---------------------------------------------------------------

    def abstract_inputs(self) -> list[StepInputs]:
        """Abstract inputs of every program a warmed-up step can run (deduplicated).

        Buckets that differ only in their compile mode give the same program.
        On a mesh every leaf has the leading ranks axis, sharded over the data
        axis (what :meth:`prepare_ranks` returns).
        """
        d = self.dispatcher
        helper = self.fast_prefill_helper
        max_samples = self.max_num_samples
        out: dict[Any, StepInputs] = {}
        for desc in d.executables():
            samples = (
                [p for p in d.token_buckets if p <= min(desc.num_tokens, max_samples)]
                if self.model_inputs
                else [0]
            )
            for p in samples:
                layout = self.layout(desc, p)
                paddings: list[int | None] = [None]
                if helper is not None and desc.cg_mode == CompileMode.PIECEWISE:
                    # Model inputs: the sampled tokens are the staged indices.
                    paddings += (
                        [p]
                        if self.model_inputs
                        else [q for q in helper.paddings() if q <= desc.num_tokens]
                    )
                for q in paddings:
                    inputs = StepInputs(
                        packed=_abstract((layout.size,), self.rows, self.num_ranks),
                        fast_prefill=None
                        if q is None
                        else _abstract_fast_prefill(q, self.rows, self.num_ranks),
                        layout=layout,
                    )
                    out.setdefault(inputs.program, inputs)
        return list(out.values())

    def warm_up(self) -> None:
        """Compiles every metadata program and the staging kernel from shapes."""
        for inputs in self.abstract_inputs():
            self.programs.compile(inputs.program, inputs)
        self.warm_up_host()

    def warm_up_host(self) -> None:
        """Compiles the fast-prefill staging kernel and starts padding to buckets.

        A caller that runs :meth:`metadata` inside its own step compiles its
        step per :meth:`abstract_inputs` and calls this instead of
        :meth:`warm_up`.
        """
        if self.fast_prefill_helper is not None:
            self.fast_prefill_helper.warm_up()
        self.dispatcher.mark_ready()

    def build(self, step: StepInputs) -> dict[str, CommonAttentionMetadata]:
        """Runs the step's metadata program (one device); attaches the host copies."""
        if self.sharded is not None:
            raise ValueError(
                "StepMetadataBuilder.build runs one device's step; on a mesh call "
                "metadata(inputs.local()) inside your shard_map."
            )
        records = self.programs(step.program, step)
        out: dict[str, CommonAttentionMetadata] = {}
        for i, (names, record) in enumerate(zip(self._records, records, strict=True)):
            reduced = step.cu_num_logits_cpu is not None and (
                i in self._fast_prefill_records
            )
            cpu = step.cu_num_logits_cpu if reduced else step.query_start_loc_cpu
            record = dataclasses.replace(record, query_start_loc_cpu=cpu)
            for name in names:
                out[name] = record
        return out
