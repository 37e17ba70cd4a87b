"""A small serving loop: continuous batching on the built-in model through jaxkv.

The Engine is a thin user of the library's own pipeline: a :class:`KVCachePlan`,
a :class:`StepMetadataBuilder` whose :meth:`~StepMetadataBuilder.metadata` runs
inside the Engine's jitted step (one executable per step), and
:class:`Programs` for the compiled steps, and one :class:`Scheduler` per
data-parallel rank (admission, chunked prefill, preemption, prefix caching).
What it adds is the model, greedy sampling and arrivals.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv.sched.request as jaxkv_sched
from jaxkv.cache.blocks import BlockAllocator
from jaxkv.cache.ops import any_deleted
from jaxkv.cache.plan import make_plan
from jaxkv.cache.shard import ShardedPlan, local_runner_config, shard_plan
from jaxkv.cache.views import KVCacheView
from jaxkv.config import RunnerConfig
from jaxkv.demo.model import TinyHybridModel, forward_paged
from jaxkv.demo.tensor_parallel import tensor_parallel_state
from jaxkv.sched.scheduler import ScheduledStep, Scheduler, sampled_token_indices
from jaxkv.step.buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step.builder import PreparedStep, StepInputs, StepMetadataBuilder
from jaxkv.step.fast_prefill import FastPrefillBatchMetadata, stage_logits_indices
from jaxkv.step.programs import Programs


@dataclasses.dataclass(eq=False)
class Request(jaxkv_sched.Request):
    """A :class:`jaxkv.Request` with what the demo Engine adds.

    Attributes:
      arrival_step: Step at which the request arrives.
      logits: The logits each generated token was sampled from, when the
        Engine records them (``record_logits=True``).
      rank: The data-parallel rank serving the request (0 without a mesh).
    """

    arrival_step: int = 0
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    rank: int = 0


class Engine:
    """Continuous batching on the built-in model through jaxkv.

    Each step: hand arrivals to the :class:`Scheduler` (which rejects what can
    never be served), let it pick requests and tokens and hold their blocks
    (preempting when blocks run out, reusing cached prefixes when enabled),
    let the :class:`StepMetadataBuilder` pack the step and arm fast prefill,
    run the step's compiled program (pools donated; metadata built inside it),
    sample greedily and give the tokens back to the scheduler.

    With a `mesh`, the model is served tensor-parallel over heads on
    `tensor_axis` and data-parallel over requests on `data_axis`: pools from
    :func:`shard_plan`, the model's weights split by
    :func:`~jaxkv.demo.tensor_parallel.tensor_parallel_state`, one
    ``shard_map`` per step (check_vma on). Each data-parallel rank has its own
    requests and scheduler; all ranks run one program per step (the
    bucket of the largest rank). Fast prefill is armed for all ranks when any
    has a prefill; each rank stages its logits indices inside the step
    program (:func:`stage_logits_indices` on its row of a persistent,
    donated buffer).

    Args:
      config: The runner configuration (layers, limits, buckets).
      model: The model.
      num_blocks: Blocks per pool (per data-parallel rank).
      token_buckets: Token buckets (default: the config's).
      request_buckets: Request buckets (default: the config's, or
        ``(max_num_seqs,)``).
      pages_per_chunk: Pages per step of the attention's online softmax;
        default 4 on CPU and 64 on accelerators (measured best on each: 4.7 vs
        5.7 ms for a 32 x 512 decode on CPU, 2.3 vs 4.0 ms for 256 x 4096 on an
        H200).
      record_logits: Keep each sampled token's logits on its request (a
        device-to-host copy per step; for tests and debugging).
      mesh: Serve over this device mesh (``None``: one device).
      data_axis: The mesh's data-parallel axis.
      tensor_axis: The mesh's tensor-parallel axis.
      enable_prefix_caching: Reuse cached prefixes (see :class:`Scheduler`).
    """

    def __init__(
        self,
        config: RunnerConfig,
        model: TinyHybridModel,
        *,
        num_blocks: int,
        token_buckets: Sequence[int] | None = None,
        request_buckets: Sequence[int] | None = None,
        pages_per_chunk: int | None = None,
        record_logits: bool = False,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        tensor_axis: str = "tensor",
        enable_prefix_caching: bool = False,
    ) -> None:
        """Plans and allocates the pools, and prepares the step builder."""
        self.config = config
        self.mesh = mesh
        self.sharded: ShardedPlan | None = None
        if mesh is None:
            self.plan = make_plan(config, num_blocks=num_blocks, maps_slot_mapping=True)
            self._allocate_pools = self.plan.allocate
            self.num_ranks, tensor_parallel = 1, 1
            self.graphdef, self.state = nnx.split(model)
            self._state_sharded: Any = None
        else:
            self.sharded = shard_plan(
                config,
                mesh=mesh,
                data_axis=data_axis,
                tensor_axis=tensor_axis,
                num_blocks=num_blocks,
                maps_slot_mapping=True,
            )
            self.plan = self.sharded.local
            self._allocate_pools = self.sharded.allocate
            self.num_ranks = self.sharded.data_parallel
            tensor_parallel = self.sharded.tensor_parallel
            self.graphdef, state, self._state_sharded = tensor_parallel_state(
                model,
                local_runner_config(config, tensor_parallel=tensor_parallel),
                tensor_parallel=tensor_parallel,
                vocab_size=model.lm_head.out_features,
            )
            self.state = jax.tree.map(
                lambda x, split: jax.device_put(
                    x, NamedSharding(mesh, P(tensor_axis) if split else P())
                ),
                state,
                self._state_sharded,
            )
        self.pools = self._allocate_pools()
        self.data_axis, self.tensor_axis = data_axis, tensor_axis
        self.views = self.plan.views
        # What the model's layers read: attention layers with their spec's
        # window, Mamba layers their state view.
        self.layers = {
            name: self.plan.attention_layer(name)
            if isinstance(view, KVCacheView)
            else view
            for name, view in self.views.items()
        }
        self.widths = self.plan.block_table_widths
        self.max_num_tokens = config.max_num_batched_tokens
        self.max_num_reqs = config.max_num_seqs
        buckets = tuple(
            token_buckets if token_buckets is not None else config.token_buckets
        )
        reqs = tuple(
            request_buckets if request_buckets is not None else config.request_buckets
        )
        self.dispatcher = BucketDispatcher(
            token_buckets=buckets,
            max_num_tokens=self.max_num_tokens,
            max_num_reqs=self.max_num_reqs,
            request_buckets=reqs or (self.max_num_reqs,),
            cg_support=self.plan.cg_support.min_cg_support,
        )
        self.builder = StepMetadataBuilder(
            self.plan, self.dispatcher, model_inputs=True, fast_prefill=mesh is None
        )
        self.vocab_size = model.lm_head.out_features
        self.reset(enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks)
        if pages_per_chunk is None:
            pages_per_chunk = 4 if jax.default_backend() == "cpu" else 64
        self.pages_per_chunk = pages_per_chunk
        self.record_logits = record_logits
        self.programs = Programs(self._device_step, donate_argnums=(0, 3))
        # On a mesh, fast prefill stages each data rank's logits indices inside
        # the step program, on a persistent (ranks, max_num_tokens) buffer.
        self._yoco = mesh is not None and any(
            g.fast_prefill for groups in self.plan.attn_groups for g in groups
        )
        self.stage_buffer: jax.Array | None = None
        if self._yoco and mesh is not None:
            self.stage_buffer = self._new_stage_buffer()
        # A step in flight: the scheduled steps, then the device's results
        # once its program returned (see resume()).
        self._inflight: list[ScheduledStep] | None = None
        self._results: tuple[jax.Array, jax.Array] | None = None
        self._run: dict[str, Any] | None = None
        # What the loop did: steps, steps with fast prefill armed, steps with a
        # prefill chunk that did not finish its prompt.
        self.counters = {"steps": 0, "fast_prefill_armed": 0, "partial_prefills": 0}

    def reset(
        self, *, enable_prefix_caching: bool = False, num_blocks: int | None = None
    ) -> None:
        """New schedulers, one per data-parallel rank: requests and cached
        prefixes are forgotten; pools and compiled programs stay.

        Args:
          enable_prefix_caching: Reuse cached prefixes.
          num_blocks: Blocks each scheduler may use (default: all of the
            pool's); fewer simulate a smaller pool without recompiling.
        """  # noqa: D205
        self.schedulers = [
            Scheduler(
                self.plan,
                max_num_batched_tokens=self.max_num_tokens,
                max_num_seqs=self.max_num_reqs,
                enable_prefix_caching=enable_prefix_caching,
                vocab_size=self.vocab_size,
                num_blocks=num_blocks,
            )
            for _ in range(self.num_ranks)
        ]

    def _new_stage_buffer(self) -> jax.Array:
        if self.mesh is None:
            raise RuntimeError("Engine: the staging buffer is for a mesh.")
        return jax.jit(
            lambda: jnp.zeros((self.num_ranks, self.max_num_tokens), jnp.int32),
            out_shardings=NamedSharding(self.mesh, P(self.data_axis, None)),
        )()

    @property
    def allocator(self) -> BlockAllocator:
        """Rank 0's block allocator (the only one without a mesh)."""
        return self.schedulers[0].manager.allocator

    @property
    def fast_prefill(self) -> bool:
        """Whether the fast-prefill (YOCO early exit) path can be armed."""
        return self._yoco or self.builder.fast_prefill_helper is not None

    # --- device side -----------------------------------------------------------

    def _rank_step(
        self,
        pools: tuple[jax.Array, ...],
        state: Any,
        inputs: StepInputs,
        tensor_axis: str | None,
    ) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
        meta = self.builder.metadata(inputs)
        token_ids, sample = self.builder.model_inputs_of(inputs)
        model = nnx.merge(self.graphdef, state)
        pools, logits = forward_paged(
            model,
            pools,
            self.layers,
            meta,
            token_ids,
            sample,
            inputs.fast_prefill is not None,
            self.pages_per_chunk,
            tensor_axis=tensor_axis,
        )
        return pools, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits

    def _device_step(
        self,
        pools: tuple[jax.Array, ...],
        state: Any,
        inputs: StepInputs,
        buffer: jax.Array | None = None,
        fp_packed: jax.Array | None = None,
    ) -> Any:
        """One step; on a mesh, `buffer` and `fp_packed` arm fast prefill.

        ``buffer (ranks, max_num_tokens)`` is the persistent staging buffer
        (donated, returned last); ``fp_packed (ranks, 2 + padding)`` holds
        ``[n, max_logits_per_req, indices...]`` per rank: each rank stages its
        indices with :func:`stage_logits_indices` on its row of the buffer.
        """
        stage = None if buffer is None else (buffer, fp_packed)
        if self.sharded is None:
            return self._rank_step(pools, state, inputs, None)
        sp, layout = self.sharded, inputs.layout

        def per_rank(pools: Any, state: Any, packed: jax.Array, *stage: Any) -> Any:
            local_state = jax.tree.map(
                lambda x, split: x[0] if split else x, state, self._state_sharded
            )
            fp, buffer = None, None
            if stage:
                buffer, fp_packed = stage[0][0], stage[1][0]
                buffer, staged = stage_logits_indices(
                    buffer, fp_packed[2:], fp_packed[0]
                )
                fp = FastPrefillBatchMetadata(
                    logits_indices_padded=staged,
                    num_logits_indices=fp_packed[0],
                    max_logits_per_req=fp_packed[1],
                )
            local = StepInputs(packed=packed[0], fast_prefill=fp, layout=layout)
            pools, tokens, logits = self._rank_step(
                sp.local_pools(pools), local_state, local, self.tensor_axis
            )
            out = (sp.global_pools(pools), tokens[None], logits[None])
            return out if buffer is None else (*out, buffer[None])

        state_specs = jax.tree.map(
            lambda split: P(self.tensor_axis) if split else P(), self._state_sharded
        )
        rows = P(self.data_axis, None)
        out_specs: tuple[Any, ...] = (sp.pool_spec, rows, P(self.data_axis, None, None))
        return jax.shard_map(
            per_rank,
            mesh=sp.mesh,
            in_specs=(
                sp.pool_spec,
                state_specs,
                rows,
                *((rows, rows) if stage else ()),
            ),
            out_specs=(*out_specs, rows) if stage else out_specs,
        )(pools, state, inputs.packed, *(stage or ()))

    def _abstract_step_inputs(self, inputs: StepInputs) -> StepInputs:
        """A rank's abstract inputs, stacked over the data-parallel ranks."""
        if self.sharded is None:
            return inputs
        packed: Any = jax.ShapeDtypeStruct(
            (self.num_ranks, inputs.layout.size),
            jnp.int32,
            sharding=NamedSharding(self.sharded.mesh, P(self.data_axis, None)),
        )
        return StepInputs(packed=packed, fast_prefill=None, layout=inputs.layout)

    def _abstract_stage(self, padding: int) -> tuple[Any, Any]:
        """Abstract ``(buffer, packed indices)`` of an armed mesh step."""
        if self.sharded is None or self.stage_buffer is None:
            raise ValueError("Only a mesh with fast-prefill layers stages in-step.")
        rows = NamedSharding(self.sharded.mesh, P(self.data_axis, None))
        return (
            jax.ShapeDtypeStruct(self.stage_buffer.shape, jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct(
                (self.num_ranks, padding + 2), jnp.int32, sharding=rows
            ),
        )

    @staticmethod
    def _program(inputs: StepInputs, stage: Any) -> Any:
        """The key of a step's program: its inputs' program, armed on a mesh."""
        return (inputs.program, None if stage is None else stage[1].shape[1] - 2)

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles every step program from shapes; returns the seconds spent."""

        def sds(x: Any) -> Any:
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=getattr(x, "sharding", None)
            )

        t0 = time.perf_counter()
        pools, state = jax.tree.map(sds, self.pools), jax.tree.map(sds, self.state)
        todo: list[tuple[StepInputs, bool]] = [
            (inputs, armed)
            for inputs in self.builder.abstract_inputs()
            for armed in ((False, True) if self._yoco else (False,))
        ]
        for i, (inputs, armed) in enumerate(todo):
            stacked = self._abstract_step_inputs(inputs)
            stage = self._abstract_stage(inputs.layout.num_samples) if armed else None
            self.programs.compile(
                self._program(inputs, stage), pools, state, stacked, *(stage or ())
            )
            if progress:
                progress(i + 1, len(todo))
        self.builder.warm_up_host()
        return time.perf_counter() - t0

    # --- host side -------------------------------------------------------------

    def _prepare(
        self,
        step: ScheduledStep,
        desc: BatchDescriptor | None,
        num_samples: int | None,
    ) -> PreparedStep:
        """One rank's step, packed (an empty rank gets an empty batch)."""
        self.counters["partial_prefills"] += any(
            r.num_computed + n < len(r.prompt) for r, n in step.batch
        )
        return self.builder.prepare(
            **step.arrays._asdict(), desc=desc, num_samples=num_samples
        )

    def step(self, steps: list[ScheduledStep]) -> None:
        """Runs one scheduled step (one per data-parallel rank).

        If it raises, :meth:`resume` finishes or redoes it (see there).
        """
        self._inflight, self._results = steps, None
        batches = [s.batch for s in steps]
        desc = num_samples = None
        if self.sharded is not None:
            # One program for every rank: the bucket of the largest batch, and
            # room for the most sampled tokens of any rank.
            desc = self.dispatcher.dispatch(
                num_reqs=max(1, *(len(b) for b in batches)),
                num_tokens=max(1, *(sum(n for _, n in b) for b in batches)),
            )
            most = max(1, *(len(sampled_token_indices(b)) for b in batches))
            num_samples = self.builder.sample_padding(most, desc)
        prepared = [self._prepare(s, desc, num_samples) for s in steps]
        inputs = prepared[0].inputs
        if self.sharded is not None:
            inputs = StepInputs(
                packed=jax.device_put(
                    np.stack([np.asarray(p.inputs.packed) for p in prepared]),
                    NamedSharding(self.sharded.mesh, P(self.data_axis, None)),
                ),
                fast_prefill=None,
                layout=inputs.layout,
            )
        stage = None
        if (
            self._yoco
            and self.sharded is not None
            and self.stage_buffer is not None
            and desc is not None
            and desc.cg_mode != CompileMode.FULL
            and any(r.num_computed < len(r.prompt) for b in batches for r, _ in b)
        ):
            # Armed for every rank (one program): each rank's sampled tokens,
            # padded like its sample indices; a rank without any has n = 0.
            padding = inputs.layout.num_samples
            host = np.zeros((self.num_ranks, padding + 2), np.int32)
            for rank, batch in enumerate(batches):
                idx = sampled_token_indices(batch)
                host[rank, 0], host[rank, 1] = len(idx), 1
                host[rank, 2 : 2 + len(idx)] = idx
            rows = NamedSharding(self.sharded.mesh, P(self.data_axis, None))
            stage = (self.stage_buffer, jax.device_put(host, rows))
        armed = inputs.fast_prefill is not None or stage is not None
        result = self.programs(
            self._program(inputs, stage), self.pools, self.state, inputs, *(stage or ())
        )
        if stage is not None:
            *result, self.stage_buffer = result
        self.pools, next_tokens, logits = result
        # From here the step has run: the pools hold its K/V and states, so
        # it is finished (never run again) on resume().
        self._results = (next_tokens, logits)
        self.counters["steps"] += 1
        self.counters["fast_prefill_armed"] += armed
        self._apply_results()

    def _apply_results(self) -> None:
        """Gives the ran step's sampled tokens to the schedulers (each once)."""
        if self._inflight is None or self._results is None:
            raise RuntimeError("Engine: no step result to apply.")
        next_tokens, logits = self._results
        next_host = _to_host(next_tokens)  # the loop needs the tokens on the host
        logits_host = _to_host(logits) if self.record_logits else None
        if self.sharded is None:
            next_host = next_host[None]
            logits_host = None if logits_host is None else logits_host[None]
        for rank, (sched, step) in enumerate(
            zip(self.schedulers, self._inflight, strict=True)
        ):
            if sched.last_applied is step:  # applied before a fault on another rank
                continue
            sampled = step.sampled
            sched.update(step, next_host[rank, : len(sampled)].tolist())
            if logits_host is not None:
                for k, req in enumerate(sampled):
                    if isinstance(req, Request):
                        req.logits.append(logits_host[rank, k])
        self._inflight = self._results = None

    def resume(self) -> str | None:
        """Brings the Engine back to a consistent state after an exception
        inside a step; returns what it did (``None``: nothing was in flight).

        - ``"applied"``: the device step had run (its pools came back): its
          sampled tokens are given to the schedulers, never recomputed (a
          Mamba state, updated in place, has already advanced);
        - ``"rerun"``: it failed before its program ran (pools untouched):
          the same scheduled step runs again, bit for bit as it would have;
        - ``"recomputed"``: the program failed after consuming its donated
          pools (the cache is gone): new pools, and every running request is
          recomputed from its prompt and outputs
          (:meth:`Scheduler.recompute_all`).

        :meth:`run` calls it first, so ``engine.run([])`` after an exception
        finishes every request (those not yet arrived included).
        """  # noqa: D205
        if self._inflight is None:
            return None
        if self._results is not None:
            self._apply_results()
            done = "applied"
        elif any_deleted((self.pools, self.stage_buffer)):
            self.pools = self._allocate_pools()
            if self.stage_buffer is not None:
                self.stage_buffer = self._new_stage_buffer()
            for sched in self.schedulers:
                sched.recompute_all()
            self._inflight = None
            done = "recomputed"
        else:
            self.step(self._inflight)
            done = "rerun"
        if self._run is not None:  # the step counts, so arrivals keep their step
            self._run["steps"] += 1
        return done

    def run(
        self,
        requests: Sequence[Request],
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[int, int]:
        """Serves `requests` to completion; returns (steps, generated tokens).

        Requests that can never be served are rejected (``status`` REJECTED,
        ``reject_reason`` says why) while the others are served; when blocks
        run out, the most recently admitted request of a rank is preempted and
        recomputed later. Steps with nothing to run are skipped to the next
        arrival.

        After an exception (a fault in the model, the device, the host, an
        interrupt), call ``run([])`` (or ``run(more_requests)``): it resumes
        the step in flight (:meth:`resume`), then serves every request of the
        interrupted run, the ones not arrived yet included, with the outputs
        and logits a run without the fault gives.
        """
        if self._run is None:
            self._run = {"pending": [], "requests": [], "steps": 0, "total": 0}
        run = self._run
        # Requests of the interrupted run passed again are not added twice.
        seen = {id(r) for r in run["requests"]}
        requests = [r for r in requests if id(r) not in seen]
        run["requests"] += requests
        run["pending"] = sorted(
            [*run["pending"], *requests], key=lambda r: r.arrival_step
        )
        run["total"] += sum(max(0, r.max_new_tokens) for r in requests)
        self.resume()
        pending = run["pending"]
        generated = sum(len(r.output) for r in run["requests"])
        while pending or any(s.has_unfinished for s in self.schedulers):
            if pending and not any(s.has_unfinished for s in self.schedulers):
                # Nothing to run: skip to the next arrival.
                run["steps"] = max(run["steps"], pending[0].arrival_step)
            while pending and pending[0].arrival_step <= run["steps"]:
                # A new request goes to the data-parallel rank with fewest.
                req = pending[0]
                req.rank = min(
                    range(self.num_ranks),
                    key=lambda r: (
                        len(self.schedulers[r].running)
                        + len(self.schedulers[r].waiting)
                    ),
                )
                self.schedulers[req.rank].add_request(req)
                pending.pop(0)
            scheduled = [s.schedule() for s in self.schedulers]
            if any(s.batch for s in scheduled):
                live = [r for s in scheduled for r, _ in s.batch]
                before = sum(len(r.output) for r in live)
                self.step(scheduled)
                generated += sum(len(r.output) for r in live) - before
            elif any(s.has_unfinished for s in self.schedulers):
                raise RuntimeError(
                    "Engine.run: requests are waiting but none could be scheduled "
                    "(no free blocks and nothing running to preempt)."
                )
            run["steps"] += 1
            if progress:
                progress(generated, run["total"])
        self._run = None
        return run["steps"], sum(len(r.output) for r in run["requests"])

    @property
    def stats(self) -> dict[str, int]:
        """The schedulers' counters summed over ranks (preemptions, prefix hits)."""
        out: dict[str, int] = {}
        for s in self.schedulers:
            for k, v in s.stats.items():
                out[k] = out.get(k, 0) + v
        return out


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host; over several processes, gathered from all.

    Only sampled tokens and logits come back this way (a few KB a step).
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
