"""The device side of a serving loop: steps packed, programs run, pools donated.

A :class:`StepRunner` holds what every step of a :class:`jaxkv.ServingLoop`
runs with: the step builder, the parameters and pools (placed on the device
or over the mesh), the compiled programs (one per bucket, and the multi-step
decode programs) and the sampling inputs of each row. It knows nothing of
requests beyond the scheduled steps it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.kv import Pools
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.sched import ScheduledStep
from jaxkv.serve._checks import check_param_specs
from jaxkv.serve._device_step import DeviceStep, Forward
from jaxkv.serve._drafts import draft_rows
from jaxkv.serve._options import ExecutionOptions
from jaxkv.serve._sampling import (
    SamplingParams,
    abstract_sampling_rows,
    sampling_rows,
)
from jaxkv.step import (
    Programs,
    StepArrays,
    StepInputs,
    StepMetadataBuilder,
    decode_step_inputs,
)
from jaxkv.transfer import (
    RequestKV,
    export_rank_request,
    export_request,
    import_rank_request,
    import_request,
)

#: ``flush(pools) -> pools``: the host tiers' copies, run before each program.
Flush = Callable[[Pools], Pools]


class StepRunner:
    """Runs scheduled steps on the device (see the module docstring).

    Example (a loop's runner: ``loop.pools`` are its pools):
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1),
      ...                        num_blocks=8)
      >>> bigram = lambda p, pools, meta, tokens, sample: (pools, p[tokens[sample]])
      >>> loop = jaxkv.ServingLoop(plan, bigram, jnp.eye(8), vocab_size=8)
      >>> loop.runner.pools is loop.pools, loop.runner.plan is loop.plan
      (True, True)
    """

    def __init__(
        self,
        plan: KVCachePlan | ShardedPlan,
        forward: Forward,
        params: Any,
        *,
        execution: ExecutionOptions,
        sampling: SamplingParams,
        vocab_size: int | None,
        decode_steps: int,
    ) -> None:
        """Places `params`, allocates the pools and wraps the programs."""
        self.sharded = plan if isinstance(plan, ShardedPlan) else None
        #: The plan every device runs (a mesh's rank-local plan).
        self.plan: KVCachePlan = (
            self.sharded.local if self.sharded else cast(KVCachePlan, plan)
        )
        self.num_ranks = 1 if self.sharded is None else self.sharded.data_parallel
        self.forward = forward
        self.sampling = sampling
        self.per_request_sampling = bool(execution.per_request_sampling)
        self.vocab_size = vocab_size
        self.decode_steps = decode_steps
        self.dispatcher = execution.dispatcher
        #: Whether steps verify draft tokens (a drafter), and at most how many
        #: per request.
        self.speculative = execution.drafter is not None
        self.samples_per_request = 1 + (execution.num_speculative_tokens or 0)
        #: Per request id, its own SamplingParams (per_request_sampling).
        self.request_sampling: dict[str, SamplingParams] = {}
        # On a mesh the builder prepares every data rank's step at once.
        self.builder = self._builder(plan)
        # Sampled tokens travel between steps padded to one width, so a
        # step's program takes its predecessor's tokens whatever its bucket.
        self.width = self.builder.max_num_samples
        self.params, self.pools, self.param_specs = self._place(
            params, execution.param_specs
        )
        self.build()
        #: Steps run (a multi-step decode counts once), steps with fast prefill
        #: armed, rank steps with a prefill chunk that did not finish its
        #: prompt, iterations run by multi-step decodes.
        self.counters = {
            "steps": 0,
            "fast_prefill_armed": 0,
            "partial_prefills": 0,
            "decode_iterations": 0,
        }

    def device_step_for(
        self, builder: StepMetadataBuilder, forward: Forward
    ) -> DeviceStep:
        """The program of `forward` over `builder`'s steps."""
        return DeviceStep(
            builder=builder,
            forward=forward,
            sharded=self.sharded,
            param_specs=self.param_specs,
            width=self.width,
            sampling=self.sampling,
            per_request_sampling=self.per_request_sampling,
            vocab_size=self.vocab_size,
            speculative=self.speculative,
        )

    def _builder(self, plan: KVCachePlan | ShardedPlan) -> StepMetadataBuilder:
        """The step builder over `plan` (model inputs packed, drafts' rows sized)."""
        return StepMetadataBuilder(
            plan,
            self.dispatcher,
            model_inputs=True,
            samples_per_request=self.samples_per_request,
        )

    def checked_step_for(
        self, plan: KVCachePlan, forward: Forward
    ) -> tuple[StepMetadataBuilder, DeviceStep]:
        """The builder and program of `forward` over `plan`, its writes checked.

        A forward that writes through another plan's views is named before
        anything changes (traced from shapes: nothing is allocated).
        """
        builder = self._builder(plan)
        step = self.device_step_for(builder, forward)
        jax.eval_shape(
            step.check_writes,
            jax.eval_shape(plan.allocate),
            jax.tree.map(abstract, self.params),
            builder.abstract_inputs()[0],
        )
        return builder, step

    def build(self, step: DeviceStep | None = None) -> None:
        """The device step (`step`, or one for :attr:`builder`) and its programs."""
        self.device_step = step or self.device_step_for(self.builder, self.forward)
        self.programs = Programs(self.device_step, donate_argnums=0)
        #: Multi-step decode programs (``decode_steps > 1``), one per decode
        #: bucket.
        self.decode_programs = Programs(self.device_step.decode_steps, donate_argnums=0)

    def retarget(
        self,
        plan: KVCachePlan,
        *,
        pools: Pools,
        builder: StepMetadataBuilder,
        step: DeviceStep,
    ) -> None:
        """Runs over `plan`'s `pools` from now on (a resized cache)."""
        self.plan, self.pools, self.builder = plan, pools, builder
        self.forward = step.forward
        self.build(step)

    def check_sampling(self, req_id: str, sampling: Any) -> None:
        """Refuses a request's own `sampling` that this loop cannot take.

        Raises:
          TypeError: If `sampling` is not a :class:`SamplingParams`.
          ValueError: Without ``per_request_sampling``.
        """
        if sampling is None:
            return
        if not isinstance(sampling, SamplingParams):
            raise TypeError(
                f"submit: sampling for request {req_id!r} must be a "
                f"SamplingParams, got {type(sampling).__name__}."
            )
        if not self.per_request_sampling:
            raise ValueError(
                f"submit: request {req_id!r} brings its own sampling "
                "parameters, but this loop samples every request with its "
                "own: make it with per_request_sampling=True."
            )

    def export(
        self, rank: int, *, block_ids: list[list[int]], num_tokens: int
    ) -> RequestKV:
        """A request's KV cache from rank `rank`'s blocks (global heads on a mesh)."""
        if self.sharded is None:
            return export_request(
                self.plan, self.pools, block_ids=block_ids, num_tokens=num_tokens
            )
        return export_rank_request(
            self.sharded,
            self.pools,
            data=rank,
            block_ids=block_ids,
            num_tokens=num_tokens,
        )

    def import_(self, rank: int, kv: RequestKV, *, block_ids: list[list[int]]) -> None:
        """Writes `kv` into rank `rank`'s blocks `block_ids` (heads split on a mesh)."""
        if self.sharded is None:
            self.pools = import_request(self.plan, self.pools, kv, block_ids=block_ids)
        else:
            self.pools = import_rank_request(
                self.sharded, self.pools, kv, data=rank, block_ids=block_ids
            )

    def _place(self, params: Any, param_specs: Any) -> tuple[Any, Pools, Any]:
        """``(params, pools, param specs)``, placed on the device or mesh.

        On a mesh the parameters are replicated unless `param_specs` shard
        them.
        """
        if self.sharded is None:
            return params, self.plan.allocate(), None
        mesh = self.sharded.mesh
        if param_specs is not None:
            check_param_specs(params, param_specs)
        specs = (
            jax.tree.map(lambda _: P(), params) if param_specs is None else param_specs
        )
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        return jax.device_put(params, shardings), self.sharded.allocate(), specs

    def allocate(self) -> None:
        """New pools (the old ones were consumed by a failed program)."""
        self.pools = (
            self.plan.allocate() if self.sharded is None else self.sharded.allocate()
        )

    def rows(self) -> NamedSharding | None:
        """Per-rank rows on the mesh: ``P(data)`` over the leading axis."""
        if self.sharded is None:
            return None
        return NamedSharding(self.sharded.mesh, P(self.sharded.data_axis))

    def no_tokens(self) -> jax.Array:
        """The tokens before any step (zeros, one row per rank on a mesh)."""
        if self.sharded is None:
            return jnp.zeros(self.width, jnp.int32)
        return jax.device_put(
            np.zeros((self.num_ranks, self.width), np.int32), self.rows()
        )

    def warm_up(self, prev_tokens: jax.Array, max_num_seqs: int, progress: Any) -> int:
        """Compiles every bucket's program from shapes; returns the buckets."""
        self.check_forward_writes()
        pools = jax.tree.map(abstract, self.pools)
        params = jax.tree.map(abstract, self.params)
        prev = abstract(prev_tokens)
        ranks = () if self.sharded is None else (self.num_ranks,)
        rows = self.rows()
        todo = self.builder.abstract_inputs()
        for i, inputs in enumerate(todo):
            if progress is not None and i:
                progress(i, len(todo))
            seeds = self._abstract_seeds((*ranks, inputs.capacity.num_samples), rows)
            self.programs.compile(inputs.program, pools, params, inputs, seeds, prev)
        for key, inputs in self._decode_inputs(max_num_seqs).items():
            seeds = self._abstract_seeds((inputs.capacity.num_samples,), rows)
            self.decode_programs.compile(key, pools, params, inputs, seeds, prev)
        self.builder.warm_up_host()
        return len(todo)

    def _abstract_seeds(self, shape: tuple[int, ...], rows: Any) -> Any:
        """What a step's sampling inputs look like (see :meth:`_seeds`)."""
        sampling = abstract_sampling_rows(
            shape, rows, per_request=self.per_request_sampling
        )
        if not self.speculative:
            return sampling
        drafts = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
        return {"sampling": sampling, "drafts": drafts}

    def check_forward_writes(self) -> None:
        """Once, before a request is queued: `forward` keeps every layer's write.

        Traced from shapes (nothing runs); raises naming the first KV-owning
        layer whose write the returned pools do not keep
        (:meth:`DeviceStep.check_writes`).
        """
        step = self.device_step
        if self.sharded is not None or step.writes_checked:
            return
        inputs = self.builder.abstract_inputs()[0]
        jax.eval_shape(
            step.check_writes,
            jax.tree.map(abstract, self.pools),
            jax.tree.map(abstract, self.params),
            inputs,
        )

    def _decode_inputs(self, max_num_seqs: int) -> dict[Any, StepInputs]:
        """Abstract inputs of every multi-step decode program, by key.

        The programs a decode of 1 to `max_num_seqs` requests prepares to
        (found by preparing such a step on the host).
        """
        if self.decode_steps == 1:
            return {}
        out: dict[Any, StepInputs] = {}
        groups = len(self.plan.kv_cache_config.kv_cache_groups)
        for n in range(1, max_num_seqs + 1):
            qsl = np.arange(n + 1, dtype=np.int32)
            arrays = StepArrays(
                query_start_loc=qsl,
                seq_lens=np.ones(n, np.int32),
                positions=np.zeros(n, np.int32),
                block_tables=[np.zeros((n, 1), np.int32)] * groups,
                slot_mappings=[np.full(n, -1, np.int32)] * groups,
                logits_indices=np.arange(n, dtype=np.int32),
                cu_num_logits=qsl,
                token_ids=np.zeros(n, np.int32),
                is_prefilling=np.zeros(n, bool),
            )
            inputs = self.builder.prepare(arrays, validate=False)
            key = ("decode", inputs.program)
            if key not in out:
                shape = (self.decode_steps, inputs.capacity.size)
                out[key] = dataclasses.replace(
                    jax.tree.map(
                        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                        inputs,
                    ),
                    packed=jax.ShapeDtypeStruct(shape, jnp.int32),
                )
        return out

    def _seeds(self, steps: list[ScheduledStep], num_samples: int) -> Any:
        """Per rank and sampled row: the request's seed and parameters.

        With ``per_request_sampling`` its parameters too (padding rows:
        greedy); when steps verify drafts, with the draft after each row
        (:func:`draft_rows`).
        """
        rows = [draft_rows(s, num_samples) for s in steps] if self.speculative else []
        if self.speculative:
            ids = [r[0] for r in rows]
        else:
            ids = [[r.req_id for r in s.sampled] for s in steps]
        sampling = sampling_rows(
            ids,
            num_samples,
            per_request=self.per_request_sampling,
            default=self.sampling,
            overrides=self.request_sampling,
        )
        if not self.speculative:
            return sampling
        return {"sampling": sampling, "drafts": np.stack([r[1] for r in rows])}

    def run(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array, *, flush: Flush
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Runs `steps`: ``(tokens, logits, tokens the next step reads)``.

        `prev_tokens` fill the steps' decode placeholders; `flush` runs on
        the pools just before the program.
        """
        if steps[0].num_steps > 1:  # a multi-step decode (one device)
            # The next step's placeholders are its last iteration's tokens.
            return self.dispatch_decode(steps[0], prev_tokens, flush=flush)
        tokens, logits = self.dispatch(steps, prev_tokens, flush=flush)
        return tokens, logits, tokens

    def dispatch(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array, *, flush: Flush
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatches one step per rank: ``(tokens, logits)``."""
        if self.sharded is None:
            inputs = self.builder.prepare(steps[0])
        else:
            inputs = self.builder.prepare_ranks(steps)
        seeds = self._seeds(steps, inputs.capacity.num_samples)
        if self.sharded is None:
            seeds = jax.tree.map(lambda x: x[0], seeds)
        else:
            seeds = jax.device_put(seeds, self.rows())
        self.pools = flush(self.pools)
        self.pools, next_tokens, logits = self.programs(
            inputs.program, self.pools, self.params, inputs, seeds, prev_tokens
        )
        self.counters["steps"] += 1
        self.counters["fast_prefill_armed"] += inputs.fast_prefill is not None
        self.counters["partial_prefills"] += sum(
            any(r.num_computed + n < len(r.prompt) for r, n in s.batch) for s in steps
        )
        return next_tokens, logits

    def dispatch_decode(
        self, step: ScheduledStep, prev_tokens: jax.Array, *, flush: Flush
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dispatches a multi-step decode.

        ``(tokens (num_steps, width), logits, its last iteration's tokens)``;
        `prev_tokens` fills its first iteration's placeholders.
        """
        first = self.builder.prepare(step)
        inputs = decode_step_inputs(
            first, num_reqs=step.num_reqs, step_slots=step.step_slots or []
        )
        seeds = self._seeds([step], first.capacity.num_samples)
        seeds = jax.tree.map(lambda x: x[0], seeds)
        self.pools = flush(self.pools)
        self.pools, tokens, logits, last = self.decode_programs(
            ("decode", first.program),
            self.pools,
            self.params,
            inputs,
            seeds,
            prev_tokens,
        )
        self.counters["steps"] += 1
        self.counters["decode_iterations"] += step.num_steps
        return tokens, logits, last


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and sharding (programs are traced from these)."""
    return jax.ShapeDtypeStruct(
        jnp.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None)
    )
