"""One step end to end: dispatch, pack, one transfer, metadata inside any jit.

The pipeline every step runner uses, the demo Engine included: the host picks
the bucket and packs every field of every group into one int32 buffer
(:meth:`StepMetadataBuilder.prepare`); the device unpacks it and builds every
layer's metadata (:meth:`StepMetadataBuilder.metadata`), either inside the
caller's own jitted step (one executable per step) or in the builder's own
compiled program (:meth:`StepMetadataBuilder.build`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxkv._specs import MambaSpec
from jaxkv._util import pytree_dataclass, static_field
from jaxkv.cache import KVCachePlan
from jaxkv.step._attn_metadata import build_attn_metadata_from_step
from jaxkv.step._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._fast_prefill import FastPrefillBatchMetadata, FastPrefillHelper
from jaxkv.step._packing import StepLayout, pack_step, unpack_step
from jaxkv.step._programs import Programs
from jaxkv.step._validate import validate_step


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The device inputs of one step: the argument of a jitted step function.

    Attributes:
      packed: ``(layout.size,)`` int32, every per-step field of every group.
      fast_prefill: Staged fast-prefill inputs, or ``None`` when not armed.
      layout: Capacities and field offsets (static).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> from jaxkv.step import StepLayout
      >>> layout = StepLayout(max_reqs=2, max_tokens=4, block_table_widths=(1,))
      >>> inputs = jaxkv.StepInputs(packed=np.zeros(layout.size, np.int32),
      ...                           fast_prefill=None, layout=layout)
      >>> inputs.program == (layout, None)
      True
    """

    packed: Int[Array, " size"]
    fast_prefill: FastPrefillBatchMetadata | None
    layout: StepLayout = static_field()

    @property
    def program(self) -> tuple[StepLayout, int | None]:
        """What determines the compiled code: the layout and fast-prefill padding."""
        fp = self.fast_prefill
        return (
            self.layout,
            None if fp is None else int(fp.logits_indices_padded.shape[0]),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedStep:
    """What the host hands the device for one step, with its host copies.

    Attributes:
      desc: The bucket the step was dispatched to (padded sizes and mode).
      inputs: The device inputs (:class:`StepInputs`); ``inputs.packed`` is
        still a NumPy array and crosses to the device as one transfer, as an
        argument of the step's executable.
      query_start_loc_cpu: Host copy of the (unpadded) query start locations.
      cu_num_logits_cpu: Host cumulative logits counts: the host copy of the
        reduced ``query_start_loc`` of fast-prefill layers (``None`` when not
        armed).
    """

    desc: BatchDescriptor
    inputs: StepInputs
    query_start_loc_cpu: np.ndarray
    cu_num_logits_cpu: np.ndarray | None = None


def _abstract_fast_prefill(padding: int) -> FastPrefillBatchMetadata:
    scalar: Any = jax.ShapeDtypeStruct((), jnp.int32)
    return FastPrefillBatchMetadata(
        logits_indices_padded=cast(Any, jax.ShapeDtypeStruct((padding,), jnp.int32)),
        num_logits_indices=scalar,
        max_logits_per_req=scalar,
    )


class StepMetadataBuilder:
    """Builds every layer's attention metadata for a step, one program per bucket.

    Host side (NumPy): pick the bucket, pack every field of every group into one
    int32 buffer; arm fast prefill and stage its indices. Device side:
    :meth:`metadata` unpacks and runs :func:`build_attn_metadata`; call it
    inside your own jitted step (then the whole step is one executable), or let
    :meth:`build` run the builder's own compiled program. :meth:`warm_up`
    compiles every program from shapes, after which steps compile nothing.

    With ``model_inputs=True`` the packed buffer also carries the step's token
    ids and the indices of the tokens whose logits are sampled
    (:meth:`model_inputs`), padded to the same bucket as fast prefill's.

    Args:
      plan: From :func:`make_plan`.
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
        plan: KVCachePlan,
        dispatcher: BucketDispatcher | None = None,
        *,
        max_mm_ranges: int = 0,
        causal: bool | Mapping[int, bool] = True,
        model_inputs: bool = False,
        fast_prefill: bool = True,
    ) -> None:
        """Stores the static configuration; compiles nothing."""
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
        self.plan = plan
        self.dispatcher = dispatcher
        self.max_mm_ranges = max_mm_ranges
        self.causal = causal
        self.model_inputs = model_inputs
        self.fast_prefill_helper = (
            FastPrefillHelper(dispatcher, dispatcher.max_num_tokens)
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

    def layout(self, desc: BatchDescriptor, num_samples: int = 0) -> StepLayout:
        """The packed layout of a descriptor's capacities."""
        return StepLayout(
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
        return d.token_bucket(d.max_num_reqs) or d.max_num_tokens

    def abstract_inputs(self) -> list[StepInputs]:
        """Abstract inputs of every program a warmed-up step can run (deduplicated).

        Buckets that differ only in their compile mode give the same program.
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
                        packed=cast(
                            Any, jax.ShapeDtypeStruct((layout.size,), jnp.int32)
                        ),
                        fast_prefill=None if q is None else _abstract_fast_prefill(q),
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

    # --- host side ----------------------------------------------------------------

    def _check_limits(self, query_start_loc: object) -> None:
        """Refuses a step above the limits the programs are sized for (it would
        compile a new program mid-serving).
        """  # noqa: D205
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
        token_ids: np.ndarray | None = None,
        is_prefilling: np.ndarray | None = None,
        encoder_seq_lens: np.ndarray | None = None,
        mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None,
        request_causal: np.ndarray | None = None,
        desc: BatchDescriptor | None = None,
        num_samples: int | None = None,
        validate: bool = True,
    ) -> PreparedStep:
        """Host work of a step: dispatch, pack, fast-prefill staging.

        Args:
          query_start_loc: ``(num_reqs + 1,)`` cumulative query lengths.
          seq_lens: ``(num_reqs,)`` context lengths after this step.
          positions: ``(num_tokens,)`` token positions.
          block_tables: Per KV-cache group ``(num_reqs, cols)`` block ids.
          slot_mappings: Per KV-cache group ``(num_tokens,)`` slots (``-1``:
            write nothing).
          logits_indices: Tokens whose logits are sampled, ascending; arms fast
            prefill (with `cu_num_logits`) when the model has fast-prefill
            layers, and are the sampled indices with ``model_inputs``.
          cu_num_logits: ``(num_reqs + 1,)`` cumulative logits per request.
          token_ids: ``(num_tokens,)`` input tokens (``model_inputs`` only).
          is_prefilling: ``(num_reqs,)`` (default: query length > 1).
          encoder_seq_lens: ``(num_reqs,)`` encoder lengths.
          mm_prefix_ranges: ``request -> inclusive ranges``.
          request_causal: ``(num_reqs,)`` bools; ``False`` makes a request
            attend to its whole context (default all causal).
          desc: The bucket to pad to instead of dispatching this step alone
            (data-parallel ranks run one program: dispatch on their largest
            sizes and pass the result to every rank).
          num_samples: Room for sampled tokens instead of the bucket of this
            step's count (``model_inputs`` without fast prefill; the same on
            every data-parallel rank).
          validate: Check the arrays first (:func:`validate_step`: dtypes,
            sorted query starts, sequences at least their queries, block tables
            covering every context with ids of this plan, logits indices in
            range); off only for arrays already checked.

        Returns:
          The prepared step.

        Raises:
          ValueError: If `logits_indices` comes without `cu_num_logits` where
            fast prefill needs it, a field does not fit the bucket, or the
            step has more tokens or requests than the builder's limits.
        """
        self._check_limits(query_start_loc)
        if validate:
            validate_step(
                block_sizes=self.plan.block_sizes,
                is_mamba=self._is_mamba,
                num_blocks=self.plan.num_blocks,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                positions=positions,
                block_tables=block_tables,
                slot_mappings=slot_mappings,
                logits_indices=logits_indices,
                group_kinds=self.plan.group_kinds,
            )
        qsl = np.asarray(query_start_loc)
        num_reqs, num_tokens = qsl.size - 1, int(qsl[-1])
        q_lens = np.diff(qsl)
        uniform = int(q_lens[0]) if num_reqs and (q_lens == q_lens[0]).all() else None
        if desc is None:
            desc = self.dispatcher.dispatch(
                num_reqs=num_reqs, num_tokens=num_tokens, uniform_token_count=uniform
            )
        has_prefill = bool(
            (q_lens > 1).any() if is_prefilling is None else np.any(is_prefilling)
        )
        fp = None
        if self.fast_prefill_helper is not None and logits_indices is not None:
            if cu_num_logits is None:
                raise ValueError(
                    "StepMetadataBuilder.prepare: cu_num_logits is required with "
                    "logits_indices on a model with fast-prefill layers."
                )
            fp = self.fast_prefill_helper.prepare(
                logits_indices, num_reqs, cu_num_logits, has_prefill, desc
            )
        samples = np.zeros(0, np.int32) if logits_indices is None else logits_indices
        layout = self.layout(
            desc, self._num_samples(len(samples), num_samples, fp, desc)
        )
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
            request_causal=request_causal,
            token_ids=token_ids,
            sample_idx=samples,
            out=np.empty(layout.size, np.int32),
        )
        return PreparedStep(
            desc=desc,
            inputs=StepInputs(packed=cast(Any, packed), fast_prefill=fp, layout=layout),
            query_start_loc_cpu=qsl,
            cu_num_logits_cpu=None if fp is None else np.asarray(cu_num_logits),
        )

    def _num_samples(
        self,
        n: int,
        num_samples: int | None,
        fp: FastPrefillBatchMetadata | None,
        desc: BatchDescriptor,
    ) -> int:
        """Room for the step's `n` sampled tokens in its model inputs: none
        without model inputs, the staged indices' padding with fast prefill
        armed, the caller's `num_samples`, or the smallest bucket holding `n`.
        """  # noqa: D205
        if not self.model_inputs:
            return 0
        if fp is not None:
            return int(fp.logits_indices_padded.shape[0])
        if num_samples is None:
            return self.sample_padding(max(n, 1), desc)
        if num_samples < n:
            raise ValueError(
                f"StepMetadataBuilder.prepare: num_samples={num_samples} holds fewer "
                f"than the step's {n} sampled tokens."
            )
        return num_samples

    def build(self, step: PreparedStep) -> dict[str, CommonAttentionMetadata]:
        """Runs the step's metadata program; attaches the host copies."""
        records = self.programs(step.inputs.program, step.inputs)
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
