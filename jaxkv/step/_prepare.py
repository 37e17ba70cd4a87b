"""The host side of a step: check its arrays, pick its bucket, pack every
field into one int32 buffer and stage fast prefill (one device, or every
data-parallel rank of a mesh at once).
"""  # noqa: D205

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxkv._util import checks_own_arguments
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.step._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step._fast_prefill import FastPrefillHelper
from jaxkv.step._packing import StepLayout, pack_step
from jaxkv.step._step_inputs import StepArrays, StepInputs
from jaxkv.step._validate import validate_step


class StepPreparation:
    """The host half of :class:`StepMetadataBuilder`: a step's capacities
    (:meth:`layout`, :meth:`sample_padding`) and its inputs
    (:meth:`prepare`, :meth:`prepare_ranks`).
    """  # noqa: D205

    # State owned by StepMetadataBuilder.__init__.
    plan: KVCachePlan
    sharded: ShardedPlan | None
    rows: NamedSharding | None
    num_ranks: int
    dispatcher: BucketDispatcher
    max_mm_ranges: int
    model_inputs: bool
    fast_prefill_helper: FastPrefillHelper | None
    _is_mamba: tuple[bool, ...]

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
        layout = self.layout(desc, self._num_samples(n, num_samples, desc))
        return StepInputs(
            packed=cast(Any, self._pack(layout, arrays)),
            fast_prefill=fp,
            layout=layout,
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
        layout = self.layout(desc, num_samples)
        packed = np.stack([self._pack(layout, a) for a in steps])
        return StepInputs(
            packed=jax.device_put(packed, self.rows),
            fast_prefill=fp,
            layout=layout,
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

    def _pack(self, layout: StepLayout, arrays: StepArrays) -> np.ndarray:
        # A fresh buffer per step: on CPU a transferred NumPy array may be
        # aliased zero-copy, so a reused buffer could change a step in flight.
        li = arrays.logits_indices
        return pack_step(
            layout,
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
            out=np.empty(layout.size, np.int32),
        )

    def _num_samples(
        self, n: int, num_samples: int | None, desc: BatchDescriptor
    ) -> int:
        """Room for the step's `n` sampled tokens in its model inputs: none
        without model inputs, the caller's `num_samples` (the staged indices'
        padding with fast prefill armed), or the smallest bucket holding `n`.
        """  # noqa: D205
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
