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
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._util import checks_own_arguments, is_int
from jaxkv.config import MambaSpec
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.step._attn_metadata import build_attn_metadata_from_step
from jaxkv.step._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._fast_prefill import FastPrefillBatchMetadata, FastPrefillHelper
from jaxkv.step._packing import StepCapacity, pack_step, unpack_step
from jaxkv.step._programs import Programs
from jaxkv.step._step_inputs import StepArrays, StepInputs
from jaxkv.step._validate import validate_step


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


class StepMetadataBuilder:
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
      samples_per_request: The most tokens one request samples in a step
        (``1 + k`` when it verifies ``k`` draft tokens): sizes the sampled
        rows' buckets, so steps verifying drafts compile nothing new.

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
        samples_per_request: int = 1,
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
        if not is_int(samples_per_request) or samples_per_request < 1:
            raise ValueError(
                "StepMetadataBuilder: samples_per_request must be an int >= 1, "
                f"got {samples_per_request!r}."
            )
        self.samples_per_request = int(samples_per_request)
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
            unpack_step(inputs.packed, inputs.capacity),
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
        fields = unpack_step(inputs.packed, inputs.capacity)
        # model_inputs=True capacities hold both (num_samples > 0).
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
                capacity = self.capacity(desc, p)
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
                        packed=_abstract((capacity.size,), self.rows, self.num_ranks),
                        fast_prefill=None
                        if q is None
                        else _abstract_fast_prefill(q, self.rows, self.num_ranks),
                        capacity=capacity,
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

    def capacity(self, desc: BatchDescriptor, num_samples: int = 0) -> StepCapacity:
        """The step capacity a bucket descriptor gives (what its buffer holds)."""
        return StepCapacity(
            max_reqs=desc.num_reqs,
            max_tokens=desc.num_tokens,
            block_table_widths=self.plan.block_table_widths,
            max_mm_ranges=self.max_mm_ranges,
            num_samples=num_samples if self.model_inputs else 0,
        )

    def sample_padding(self, n: int, desc: BatchDescriptor) -> int:
        """Padded count of sampled tokens: the smallest token bucket holding `n`."""
        if desc.cg_mode == CompileMode.NONE:
            return n
        bucket = self.dispatcher.token_bucket(n)
        return min(bucket or n, self.dispatcher.max_num_tokens)

    @property
    def max_num_samples(self) -> int:
        """The most sampled tokens a step's model inputs hold (padded)."""
        d = self.dispatcher
        most = min(d.max_num_reqs * self.samples_per_request, d.max_num_tokens)
        return d.token_bucket(most) or d.max_num_tokens

    def _check_limits(self, query_start_loc: object) -> None:
        """Refuses a step above the limits the programs are sized for.

        It would compile a new program mid-serving.
        """
        qsl = np.asarray(query_start_loc)
        if qsl.ndim != 1 or not qsl.size or not np.issubdtype(qsl.dtype, np.integer):
            return  # validate_step names what is wrong
        d = self.dispatcher
        for what, n, limit, knob in (
            ("tokens", int(qsl[-1]), d.max_num_tokens, "max_num_batched_tokens"),
            ("requests", qsl.size - 1, d.max_num_reqs, "max_num_seqs"),
        ):
            if n > limit:
                raise ValueError(
                    f"prepare: a step of {n} {what} exceeds {knob}={limit}, the "
                    "limit this builder's programs are sized for; schedule with "
                    "the same limits (Scheduler(plan) takes them from the config)."
                )

    @checks_own_arguments
    def prepare(
        self,
        arrays: StepArrays,
        *,
        desc: BatchDescriptor | None = None,
        num_samples: int | None = None,
        validate: bool = True,
    ) -> StepInputs:
        """Host work of a step: dispatch, pack, fast-prefill staging.

        Args:
          arrays: The step's host arrays (a :class:`ScheduledStep` is one).
          desc: The bucket to pad to instead of dispatching this step alone.
          num_samples: Room for sampled tokens instead of the bucket of this
            step's count (``model_inputs`` without fast prefill).
          validate: Check the arrays first (:func:`validate_step`: dtypes,
            sorted query starts, sequences at least their queries, block tables
            covering every context with ids of this plan, logits indices in
            range); off only for arrays already checked.

        Returns:
          The step's inputs, its packed buffer still a NumPy array (it crosses
          to the device as one transfer, as an argument of the step's
          executable).

        Raises:
          ValueError: If `logits_indices` comes without `cu_num_logits` where
            fast prefill needs it, a field does not fit the bucket, the step
            has more tokens or requests than the builder's limits, or the
            builder serves several data-parallel ranks (:meth:`prepare_ranks`).
        """
        if self.sharded is not None:
            raise ValueError(
                f"StepMetadataBuilder.prepare: this builder serves a mesh of "
                f"{self.num_ranks} data-parallel rank(s); prepare_ranks(steps) "
                "takes one step per rank."
            )
        if not isinstance(arrays, StepArrays):
            raise TypeError(
                "StepMetadataBuilder.prepare: arrays must be a StepArrays (a "
                f"ScheduledStep is one), got {type(arrays).__name__}."
            )
        self._check(arrays, validate, rank=None)
        if desc is None:
            desc = self._dispatch(arrays)
        fp = None
        if self.fast_prefill_helper is not None and arrays.logits_indices is not None:
            if arrays.cu_num_logits is None:
                raise ValueError(
                    "StepMetadataBuilder.prepare: cu_num_logits is required with "
                    "logits_indices on a model with fast-prefill layers."
                )
            fp = self.fast_prefill_helper.prepare(
                arrays.logits_indices,
                arrays.num_reqs,
                arrays.cu_num_logits,
                _has_prefill(arrays),
                desc,
            )
        n = 0 if arrays.logits_indices is None else len(arrays.logits_indices)
        if fp is not None:
            num_samples = int(fp.logits_indices_padded.shape[0])
        capacity = self.capacity(desc, self._num_samples(n, num_samples, desc))
        return StepInputs(
            packed=cast(Any, self._pack(capacity, arrays)),
            fast_prefill=fp,
            capacity=capacity,
            desc=desc,
            query_start_loc_cpu=np.asarray(arrays.query_start_loc),
            cu_num_logits_cpu=None if fp is None else np.asarray(arrays.cu_num_logits),
        )

    @checks_own_arguments
    def prepare_ranks(
        self, steps: Sequence[StepArrays], *, validate: bool = True
    ) -> StepInputs:
        """Host work of one step on every data-parallel rank of the mesh.

        The ranks run one program: the bucket of the largest rank's batch and
        room for the most sampled tokens of any rank. Fast prefill is armed for
        every rank or none (any rank with a prefill arms it); each rank's
        indices are staged on its own row of the staging buffer. Every leaf of
        the result has a leading ranks axis sharded over the data axis; inside
        ``shard_map`` take the rank's own with :meth:`StepInputs.local`.

        Args:
          steps: One step per rank (an empty :class:`ScheduledStep` for an
            idle rank).
          validate: Check each rank's arrays first (see :meth:`prepare`).

        Returns:
          The ranks' inputs, on the mesh.

        Raises:
          ValueError: For a count of steps other than the ranks, or a rank's
            step that :meth:`prepare` would refuse (naming the rank).
        """
        if len(steps) != self.num_ranks:
            raise ValueError(
                f"StepMetadataBuilder.prepare_ranks: {len(steps)} step(s) for "
                f"{self.num_ranks} data-parallel rank(s); pass one per rank."
            )
        for rank, arrays in enumerate(steps):
            if not isinstance(arrays, StepArrays):
                raise TypeError(
                    f"StepMetadataBuilder.prepare_ranks: steps[{rank}] must be a "
                    f"StepArrays, got {type(arrays).__name__}."
                )
            self._check(arrays, validate, rank=rank)
        desc = self.dispatcher.dispatch(
            num_reqs=max(1, *(a.num_reqs for a in steps)),
            num_tokens=max(1, *(a.num_tokens for a in steps)),
        )
        counts = [
            0 if a.logits_indices is None else len(a.logits_indices) for a in steps
        ]
        num_samples = self._num_samples(max(counts), None, desc)
        fp = None
        helper = self.fast_prefill_helper
        if helper is not None:
            # With model inputs the staged indices are the sampled ones.
            padding = (
                num_samples
                if self.model_inputs
                else helper.padding(max(a.num_reqs for a in steps), max(1, *counts))
            )
            fp = helper.prepare_ranks(
                [a.logits_indices for a in steps],
                [a.cu_num_logits for a in steps],
                num_reqs=[a.num_reqs for a in steps],
                has_prefill=any(_has_prefill(a) for a in steps if a.num_reqs),
                batch_desc=desc,
                padding=padding,
            )
        capacity = self.capacity(desc, num_samples)
        packed = np.stack([self._pack(capacity, a) for a in steps])
        return StepInputs(
            packed=jax.device_put(packed, self.rows),
            fast_prefill=fp,
            capacity=capacity,
            desc=desc,
        )

    def _check(self, arrays: StepArrays, validate: bool, rank: int | None) -> None:
        try:
            self._check_limits(arrays.query_start_loc)
            if validate:
                validate_step(
                    block_sizes=self.plan.block_sizes,
                    is_mamba=self._is_mamba,
                    num_blocks=self.plan.num_blocks,
                    query_start_loc=arrays.query_start_loc,
                    seq_lens=arrays.seq_lens,
                    positions=arrays.positions,
                    block_tables=arrays.block_tables,
                    slot_mappings=arrays.slot_mappings,
                    logits_indices=arrays.logits_indices,
                    group_kinds=self.plan.group_kinds,
                )
        except (ValueError, TypeError) as e:
            if rank is None:
                raise
            raise type(e)(f"rank {rank}: {e}") from e

    def _dispatch(self, arrays: StepArrays) -> BatchDescriptor:
        q_lens = np.diff(np.asarray(arrays.query_start_loc))
        num_reqs = q_lens.size
        uniform = int(q_lens[0]) if num_reqs and (q_lens == q_lens[0]).all() else None
        return self.dispatcher.dispatch(
            num_reqs=num_reqs,
            num_tokens=arrays.num_tokens,
            uniform_token_count=uniform,
        )

    def _pack(self, capacity: StepCapacity, arrays: StepArrays) -> np.ndarray:
        # A fresh buffer per step: on CPU a transferred NumPy array may be
        # aliased zero-copy, so a reused buffer could change a step in flight.
        li = arrays.logits_indices
        return pack_step(
            capacity,
            query_start_loc=np.asarray(arrays.query_start_loc),
            seq_lens=arrays.seq_lens,
            positions=arrays.positions,
            block_tables=arrays.block_tables,
            slot_mappings=arrays.slot_mappings,
            is_prefilling=arrays.is_prefilling,
            encoder_seq_lens=arrays.encoder_seq_lens,
            mm_prefix_ranges=arrays.mm_prefix_ranges,
            request_causal=arrays.request_causal,
            token_ids=arrays.token_ids,
            sample_idx=np.zeros(0, np.int32) if li is None else li,
            out=np.empty(capacity.size, np.int32),
        )

    def _num_samples(
        self, n: int, num_samples: int | None, desc: BatchDescriptor
    ) -> int:
        """Room for the step's `n` sampled tokens in its model inputs.

        None without model inputs, the caller's `num_samples` (the staged indices'
        padding with fast prefill armed), or the smallest bucket holding `n`.
        """
        if not self.model_inputs:
            return 0
        if num_samples is None:
            return self.sample_padding(max(n, 1), desc)
        if num_samples < n:
            raise ValueError(
                f"StepMetadataBuilder.prepare: num_samples={num_samples} holds fewer "
                f"than the step's {n} sampled tokens."
            )
        return num_samples


def _has_prefill(arrays: StepArrays) -> bool:
    if arrays.is_prefilling is not None:
        return bool(np.any(arrays.is_prefilling))
    return bool((np.diff(np.asarray(arrays.query_start_loc)) > 1).any())
