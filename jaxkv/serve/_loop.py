"""A serving loop for your own model.

Arrivals, scheduling, the step in one jitted program per bucket, sampling, stop tokens,
streaming and resumption.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._util import check_bool, checks_own_arguments
from jaxkv.kv import Pools, any_deleted
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.sched import (
    AllBlocksCleared,
    HostKVCache,
    KVEventBatch,
    Request,
    RequestStatus,
    ScheduledStep,
    Scheduler,
)
from jaxkv.serve._checks import (
    check_decode_steps,
    check_host_blocks,
    check_loop_arguments,
    check_options,
    check_param_specs,
    check_same_model,
)
from jaxkv.serve._device_step import DeviceStep, Forward
from jaxkv.serve._options import ExecutionOptions, SchedulingOptions
from jaxkv.serve._pipeline import StepPipeline
from jaxkv.serve._resize import move_blocks
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


class ServingLoop:
    """Serves requests with your model's step through jaxkv.

    Each :meth:`step`: the :class:`Scheduler` picks requests and tokens
    (admission, chunked prefill, preemption, prefix caching), the
    :class:`StepMetadataBuilder` packs them into one buffer padded to a
    bucket, and one compiled program per bucket builds the metadata, runs
    `forward` with the pools donated and samples (:func:`sample_tokens`); the
    tokens go back to the scheduler, stop tokens end requests, `on_token`
    streams them.

    With overlap (``ExecutionOptions(overlap=True)``, the default) the host
    hides behind the device, as vLLM's async scheduling: step N+1 is
    scheduled, packed and dispatched while step N runs (JAX dispatch is
    asynchronous), its decode tokens taken from step N's sampled tokens on
    the device (:meth:`Scheduler.advance`); step N's tokens are then read and
    applied (:meth:`Scheduler.resolve`). A request that samples a stop token
    has one more step computed for it, dropped. Outputs equal no overlap.

    If a step raises (in your model, the device, the host, an interrupt),
    :meth:`resume` finishes or redoes it (see there) and :meth:`run` resumes
    by itself: ``loop.run([])`` serves what was left.

    On a mesh (`plan` a :class:`ShardedPlan` from :func:`shard_plan`), each
    data-parallel rank has its own :class:`Scheduler` (:attr:`schedulers`;
    a request goes to the rank with the fewest), every step packs all ranks'
    batches on one bucket, and `forward` runs per device inside
    ``jax.shard_map`` (``check_vma`` on) on its rank's pools (the local
    plan's: ``plan.local.attention_layer(name)``), metadata and tokens; with
    a tensor axis it sees its local heads and joins them itself (a
    ``jax.lax.psum`` over the tensor axis), and ``execution.param_specs``
    shard its parameters. Nothing per rank is written by the caller
    (``tests/serve_mesh_check.py``: 2x4, 4x2 and 8x1 meshes serve what one
    device serves). Fast prefill is not armed on a mesh.

    Args:
      plan: The model's plan (:func:`make_plan`), or a :class:`ShardedPlan`.
      forward: Your step (:class:`Forward`).
      params: Its parameters (a pytree of arrays, passed to every step).
      sampling: How tokens are drawn (greedy by default).
      vocab_size: Check prompt and sampled token ids against it.
      scheduling: How requests are admitted and batched
        (:class:`SchedulingOptions`: prefix caching, budgets, policy,
        full-prompt admission, a host tier, KV-cache events).
      execution: How each step runs (:class:`ExecutionOptions`: overlap,
        multi-step decoding, buckets, parameter sharding, per-request
        sampling, recorded logits).

    With ``execution.decode_steps > 1`` (multi-step decoding, as vLLM's
    ``num_scheduler_steps``), when nothing waits and every running request
    is decoding, one program runs that many iterations on the device, each
    feeding its sampled tokens to the next, and the host schedules, packs and
    reads back once for all (:meth:`Scheduler.schedule_decode`). With
    overlap the blocks are pipelined: block k+1 is scheduled and dispatched
    before block k's tokens are read (:meth:`Scheduler.advance`), so
    the host's work hides behind the device's (``benchmarks/bench_serve.py``).
    Tokens are the same as one step at a time; a request admitted meanwhile
    waits up to two blocks, and a request that stops early has the rest of
    its iterations (with overlap, of the next block too) computed and
    dropped.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=2,
      ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
      ...     max_num_batched_tokens=16, token_buckets=(4, 16))
      >>> plan = jaxkv.make_plan(cfg, num_blocks=8)
      >>> layer = plan.attention_layer("layers.0.self_attn")
      >>> def forward(params, pools, meta, tokens, sample):
      ...     x = params[tokens]                           # (tokens, 8)
      ...     m = meta[layer.name]
      ...     k = v = x[:, None, :]
      ...     pools = jaxkv.write_kv(pools, layer, k, v, m)
      ...     q = jnp.repeat(x[:, None, :], 2, axis=1)
      ...     out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
      ...     return pools, out[sample, 0] @ params.T       # (samples, vocab)
      >>> loop = jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)
      >>> r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)
      >>> loop.run([r])[0].output
      [3, 3]
    """

    @checks_own_arguments
    def __init__(
        self,
        plan: KVCachePlan | ShardedPlan,
        forward: Forward,
        params: Any,
        *,
        sampling: SamplingParams | None = None,
        vocab_size: int | None = None,
        scheduling: SchedulingOptions | None = None,
        execution: ExecutionOptions | None = None,
    ) -> None:
        """Creates the schedulers and the builder and allocates the pools."""
        scheduling = check_options(scheduling, SchedulingOptions, "scheduling")
        execution = check_options(execution, ExecutionOptions, "execution")
        check_loop_arguments(plan, forward, sampling, execution.param_specs)
        self._decode_steps = check_decode_steps(plan, execution.decode_steps)
        check_host_blocks(
            plan, scheduling.host_blocks, scheduling.enable_prefix_caching
        )
        #: How requests are scheduled (:meth:`reset` may change it).
        self.scheduling = scheduling
        #: How each step runs.
        self.execution = execution
        self._vocab_size = vocab_size
        self.sampling = SamplingParams() if sampling is None else sampling
        sharded = plan if isinstance(plan, ShardedPlan) else None
        self.sharded = sharded
        #: The plan every device runs (a mesh's rank-local plan).
        self.plan: KVCachePlan = sharded.local if sharded else cast(KVCachePlan, plan)
        self.num_ranks = 1 if self.sharded is None else self.sharded.data_parallel
        self.forward = forward
        self.record_logits = bool(execution.record_logits)
        self.per_request_sampling = bool(execution.per_request_sampling)
        # Per request id, its own SamplingParams (per_request_sampling).
        self._request_sampling: dict[str, SamplingParams] = {}
        # On a mesh the builder prepares every data rank's step at once.
        self.builder = StepMetadataBuilder(
            plan, execution.dispatcher, model_inputs=True
        )
        # Sampled tokens travel between steps padded to one width, so a
        # step's program takes its predecessor's tokens whatever its bucket.
        self._width = self.builder.max_num_samples
        self.schedulers: list[Scheduler] = self._schedulers(num_blocks=None)
        self.params, self.pools, self._param_specs = self._place(
            params, execution.param_specs
        )
        self._build_device()
        #: Steps run (a multi-step decode counts once), steps with fast prefill
        #: armed, rank steps with a prefill chunk that did not finish its
        #: prompt, iterations run by multi-step decodes.
        self.counters = {
            "steps": 0,
            "fast_prefill_armed": 0,
            "partial_prefills": 0,
            "decode_iterations": 0,
        }
        #: Per request id, the logits each sampled token came from
        #: (``record_logits=True``).
        self.logits: dict[str, list[np.ndarray]] = {}
        self._on_token: Callable[[Request, int], None] | None = None
        #: Steps dispatched whose tokens are not read yet (one stays in flight
        #: between steps with overlap, none without).
        self.pipeline = StepPipeline(
            no_tokens=self._no_tokens(),
            num_ranks=self.num_ranks,
            record_logits=self.record_logits,
            deliver=self._deliver,
            forget=self._forget,
        )

    def _device_step(
        self, builder: StepMetadataBuilder, forward: Forward
    ) -> DeviceStep:
        return DeviceStep(
            builder=builder,
            forward=forward,
            sharded=self.sharded,
            param_specs=self._param_specs,
            width=self._width,
            sampling=self.sampling,
            per_request_sampling=self.per_request_sampling,
            vocab_size=self.schedulers[0].vocab_size,
        )

    def _build_device(self, step: DeviceStep | None = None) -> None:
        """The device step (`step`, or one for :attr:`builder`) and its programs."""
        self.device_step = step or self._device_step(self.builder, self.forward)
        self.programs = Programs(self.device_step, donate_argnums=0)
        #: Multi-step decode programs (``decode_steps > 1``), one per decode
        #: bucket.
        self.decode_programs = Programs(self.device_step.decode_steps, donate_argnums=0)

    def resize(self, plan: KVCachePlan, *, forward: Forward | None = None) -> None:
        """Serves from `plan`'s pools: the same model with another ``num_blocks``.

        Grows (or shrinks) the KV cache without a restart, as vLLM's growable
        cache does: what is in flight is finished first (:meth:`resume`),
        then `plan`'s pools are allocated and every block whose bytes matter
        (held by a request or cached) is copied once to the same id, so
        running requests, the prefix cache and the host tier carry on and
        produce the tokens a loop started at the new size would. Grown, the
        new blocks are free and used first; shrunk, the blocks past the end
        must be free (cached ones among them leave the prefix cache). The
        step programs compile again for the new pools, once per bucket
        (:meth:`warm_up` does it ahead). Old and new pools coexist during
        the copy. Not on a mesh yet.

        Args:
          plan: ``make_plan`` of the same runner config with the same options
            and another `num_blocks` (or :func:`jaxkv.size_kv_cache`'s).
          forward: The model step for `plan` (default: the current one). A
            forward that closes over the old plan's layers or views must be
            rebuilt from `plan`: their views address the old pools.

        Raises:
          ValueError: If `plan` is not the same model's plan (runner config,
            groups, layouts, storage), or a held block would not fit.
          NotImplementedError: On a mesh.
          RuntimeError: Inside ``run()`` (from ``on_token``).

        Example (the class's toy model, grown mid-request):
          >>> import jax.numpy as jnp
          >>> import jaxkv
          >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=2,
          ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
          ...     max_num_batched_tokens=16, token_buckets=(4, 16))
          >>> def forward_for(plan):
          ...     layer = plan.attention_layer("layers.0.self_attn")
          ...     def forward(params, pools, meta, tokens, sample):
          ...         x = params[tokens]
          ...         m = meta[layer.name]
          ...         pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
          ...         q = jnp.repeat(x[:, None, :], 2, axis=1)
          ...         out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
          ...         return pools, out[sample, 0] @ params.T
          ...     return forward
          >>> small, big = (jaxkv.make_plan(cfg, num_blocks=n) for n in (8, 32))
          >>> loop = jaxkv.ServingLoop(small, forward_for(small), jnp.eye(8),
          ...     vocab_size=8)
          >>> r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=4)
          >>> loop.submit(r), len(loop.step())  # its prompt, in flight
          (True, 0)
          >>> loop.resize(big, forward=forward_for(big))
          >>> loop.scheduler.manager.num_usable_blocks
          31
          >>> while loop.has_unfinished:
          ...     _ = loop.step()
          >>> r.output
          [3, 3, 3, 3]
        """
        if self._on_token is not None:
            raise RuntimeError(
                "ServingLoop.resize: cannot resize inside run() (from on_token, "
                "while a step's tokens are being applied); resize between "
                "step() calls or runs."
            )
        if self.sharded is not None:
            raise NotImplementedError(
                "ServingLoop.resize: not on a mesh yet; make a new loop from "
                "shard_plan(..., num_blocks=...) (and size it with "
                "jaxkv.serve.size_loop_kv_cache)."
            )
        check_same_model(self.plan, plan)
        if forward is not None:
            check_loop_arguments(plan, forward, self.sampling, None)
        builder = StepMetadataBuilder(
            plan, self.execution.dispatcher, model_inputs=True
        )
        step = self._device_step(builder, self.forward if forward is None else forward)
        # A forward that writes through the old plan's views is named before
        # anything changes (traced from shapes: nothing is allocated).
        jax.eval_shape(
            step.check_writes,
            jax.eval_shape(plan.allocate),
            jax.tree.map(_abstract, self.params),
            builder.abstract_inputs()[0],
        )
        old, old_pools = self.plan, self.pools
        self.resume()
        self._flush_host_tiers()
        sched = self.schedulers[0]
        sched.resize(plan)  # refuses a held block past the end, unchanged
        ids = sched.manager.allocator.in_use()
        self.pools = move_blocks(old, old_pools, plan, plan.allocate(), ids)
        self.plan, self.builder = plan, builder
        if forward is not None:
            self.forward = forward
        self._build_device(step)
        self.pipeline.prev_tokens = self._no_tokens()
        self.publish_kv_events()  # the cached blocks a shrink dropped

    def _schedulers(
        self, *, num_blocks: int | None, options: SchedulingOptions | None = None
    ) -> list[Scheduler]:
        """One scheduler per data-parallel rank under :attr:`scheduling`.

        Each with its own host tier (on a mesh, the rank's copies of the pools).
        """
        opts = self.scheduling if options is None else options

        def host(rank: int) -> HostKVCache | None:
            if not opts.host_blocks:
                return None
            return HostKVCache(
                self.plan, num_blocks=opts.host_blocks, sharded=self.sharded, rank=rank
            )

        return [
            Scheduler(
                self.plan,
                enable_prefix_caching=opts.enable_prefix_caching,
                num_blocks=num_blocks,
                host_blocks=0,  # the tier is `host`
                host=host(rank),
                vocab_size=self._vocab_size,
                max_num_batched_tokens=opts.max_num_batched_tokens,
                max_num_seqs=opts.max_num_seqs,
                policy=opts.policy,
                scheduler_reserve_full_isl=opts.scheduler_reserve_full_isl,
                enable_kv_cache_events=opts.enable_kv_cache_events
                or opts.kv_event_sink is not None,
            )
            for rank in range(self.num_ranks)
        ]

    def _place(self, params: Any, param_specs: Any) -> tuple[Any, Pools, Any]:
        """``(params, pools, param specs)``, placed on the device or mesh.

        ``(params, pools, param specs)``: on the device, or over the mesh
        (parameters replicated unless `param_specs` shard them).
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

    @property
    def overlap(self) -> bool:
        """Whether the next step is scheduled while one runs.

        See the class. Change it with :meth:`set_overlap`.
        """
        return self.execution.overlap

    def set_overlap(self, value: bool) -> None:
        """Sets :attr:`overlap`, finishing what is in flight first.

        Allowed between any two calls (not from ``on_token`` inside
        ``run()``: RuntimeError): what is in flight is finished first under
        the mode it was dispatched in (:meth:`resume`: its tokens are
        applied, and requests it finishes are finished), so outputs stay
        those of either mode throughout. If that raises, the mode is
        unchanged and ``run()`` or ``resume()`` picks up as after any fault.

        Example (the class's toy model; a step in flight when it changes):
          >>> import jax.numpy as jnp
          >>> import jaxkv
          >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=1,
          ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
          ...     max_num_batched_tokens=16, token_buckets=(4, 16))
          >>> plan = jaxkv.make_plan(cfg, num_blocks=8)
          >>> layer = plan.attention_layer("layers.0.self_attn")
          >>> def forward(params, pools, meta, tokens, sample):
          ...     x = params[tokens]
          ...     m = meta[layer.name]
          ...     pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
          ...     out = jaxkv.paged_attention(x[:, None], pools, layer, m, scale=1.0)
          ...     return pools, out[sample, 0] @ params.T
          >>> loop = jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)
          >>> r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3)
          >>> loop.submit(r)
          True
          >>> _ = loop.step()                   # dispatched, not read yet
          >>> loop.set_overlap(False)           # it is read first
          >>> r.output
          [3]
          >>> _ = loop.run()
          >>> r.output
          [3, 3, 3]
        """
        value = check_bool("ServingLoop.set_overlap", "value", value)
        if value == self.execution.overlap:
            return
        if self._on_token is not None:
            raise RuntimeError(
                "ServingLoop.set_overlap: cannot change inside run() (from "
                "on_token, while a step's tokens are being applied); change it "
                "between step() calls or runs."
            )
        self.resume()
        self.execution = dataclasses.replace(self.execution, overlap=value)

    @property
    def host(self) -> HostKVCache | None:
        """The host tier of evicted prefix blocks, or None.

        The host tier of evicted prefix blocks (``host_blocks``), or None
        (on a mesh, rank 0's: each rank's is ``schedulers[rank].manager.host``).
        """
        return self.schedulers[0].manager.host

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (one device, or one data-parallel rank).

        Raises:
          ValueError: On a mesh with several data-parallel ranks (each has its
            own: :attr:`schedulers`).
        """
        if self.num_ranks != 1:
            raise ValueError(
                f"ServingLoop: {self.num_ranks} data-parallel ranks, one scheduler "
                "each: use loop.schedulers[rank]."
            )
        return self.schedulers[0]

    def reset(
        self,
        *,
        scheduling: SchedulingOptions | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """New schedulers; pools and compiled programs stay.

        New schedulers: requests, cached prefixes (the host tier's too) and
        recorded logits are forgotten; pools and compiled programs stay. A
        request still running or waiting is aborted: finished, its blocks
        freed, tokens not yet read dropped (``status`` FINISHED, not left
        RUNNING forever).

        Args:
          scheduling: The new schedulers' options, kept for later resets
            (default: :attr:`scheduling`, unchanged).
          num_blocks: Blocks each scheduler may use (default: all of the
            pool's); fewer simulate a smaller pool without recompiling.

        Raises:
          RuntimeError: Inside ``run()`` (from ``on_token``, while a step's
            tokens are being applied): the step would be left half applied.
        """
        if self._on_token is not None:
            raise RuntimeError(
                "ServingLoop.reset: cannot reset inside run() (from on_token, "
                "while a step's tokens are being applied); reset between "
                "step() calls or runs."
            )
        options = (
            self.scheduling
            if scheduling is None
            else check_options(scheduling, SchedulingOptions, "scheduling")
        )
        check_host_blocks(
            self.sharded or self.plan,
            options.host_blocks,
            options.enable_prefix_caching,
        )
        # The new schedulers first: options they refuse change nothing.
        schedulers = self._schedulers(num_blocks=num_blocks, options=options)
        self.resume()
        # Requests still live are aborted (finished, as Scheduler.finish
        # does), not left RUNNING or WAITING in a scheduler nobody drives.
        for scheduler in self.schedulers:
            for req in [*scheduler.running, *scheduler.waiting]:
                scheduler.finish(req)
        self.publish_kv_events()  # the old schedulers' last events
        cleared = self.scheduling.kv_event_sink is not None and any(
            s.manager.enable_kv_cache_events for s in self.schedulers
        )
        self.scheduling = options
        self.schedulers = schedulers
        self.logits = {}
        if cleared and options.kv_event_sink is not None:
            # The new schedulers start with an empty prefix cache: a router
            # forgets the old one's blocks.
            for sched in schedulers:
                sched.manager.requeue_events([AllBlocksCleared()])
            self.publish_kv_events()

    # --- device side ----------------------------------------------------------

    @property
    def fast_prefill(self) -> bool:
        """Whether steps with a prefill can arm the fast-prefill path."""
        return self.builder.fast_prefill_helper is not None

    def _abstract_seeds(self, shape: tuple[int, ...], rows: Any) -> Any:
        """What a step's sampling inputs look like (see :meth:`_seeds`)."""
        return abstract_sampling_rows(
            shape, rows, per_request=self.per_request_sampling
        )

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles the step for every bucket; returns the seconds spent.

        Compiles the step for every bucket from shapes (allocating nothing);
        returns the seconds spent. Without it each bucket compiles the first
        time a step meets it (never more than once). `progress(done, total)`
        is called after each bucket.
        """
        t0 = time.perf_counter()
        self._check_forward_writes()
        pools = jax.tree.map(_abstract, self.pools)
        params = jax.tree.map(_abstract, self.params)
        prev = _abstract(self.pipeline.prev_tokens)
        ranks = () if self.sharded is None else (self.num_ranks,)
        rows = self._rows()
        todo = self.builder.abstract_inputs()
        for i, inputs in enumerate(todo):
            if progress is not None and i:
                progress(i, len(todo))
            seeds = self._abstract_seeds((*ranks, inputs.capacity.num_samples), rows)
            self.programs.compile(inputs.program, pools, params, inputs, seeds, prev)
        for key, inputs in self._decode_inputs().items():
            seeds = self._abstract_seeds((inputs.capacity.num_samples,), rows)
            self.decode_programs.compile(key, pools, params, inputs, seeds, prev)
        for sched in self.schedulers:  # the ranks share the programs
            if sched.manager.host is not None:
                sched.manager.host.warm_up(pools)
        self.builder.warm_up_host()
        if progress is not None:
            progress(len(todo), len(todo))
        return time.perf_counter() - t0

    def _check_forward_writes(self) -> None:
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
            jax.tree.map(_abstract, self.pools),
            jax.tree.map(_abstract, self.params),
            inputs,
        )

    def _decode_inputs(self) -> dict[Any, StepInputs]:
        """Abstract inputs of every multi-step decode program, by key.

        The programs a decode of 1 to ``max_num_seqs`` requests prepares to (found by
        preparing such a step on the host).
        """
        if self.decode_steps == 1:
            return {}
        out: dict[Any, StepInputs] = {}
        groups = len(self.plan.kv_cache_config.kv_cache_groups)
        for n in range(1, self.schedulers[0].max_num_seqs + 1):
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
            key = self._decode_key(inputs)
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

    # --- host side ------------------------------------------------------------

    @checks_own_arguments
    def submit(
        self, request: Request, *, sampling: SamplingParams | None = None
    ) -> bool:
        """Queues `request` on the least loaded rank, or rejects it.

        Queues `request` (on the data-parallel rank with the fewest live
        requests), or rejects it (``request.reject_reason`` says why).

        Args:
          request: The request.
          sampling: Its own sampling parameters (``per_request_sampling``
            loops only; default: the loop's).

        Raises:
          ValueError: If `sampling` is given to a loop without
            ``per_request_sampling``.
          TypeError: If `sampling` is not a :class:`SamplingParams`.
        """
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise TypeError(
                    f"submit: sampling for request {request.req_id!r} must be a "
                    f"SamplingParams, got {type(sampling).__name__}."
                )
            if not self.per_request_sampling:
                raise ValueError(
                    f"submit: request {request.req_id!r} brings its own sampling "
                    "parameters, but this loop samples every request with its "
                    "own: make it with per_request_sampling=True."
                )
        self._check_forward_writes()
        sched = min(self.schedulers, key=lambda s: len(s.running) + len(s.waiting))
        accepted = sched.add_request(request)
        if accepted and sampling is not None:
            self._request_sampling[request.req_id] = sampling
        return accepted

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or has a token in flight."""
        return any(s.has_unfinished for s in self.schedulers) or bool(self.pipeline)

    def step(self) -> list[Request]:
        """Schedules and runs one step; returns the requests it finished.

        Schedules and runs one step (every rank's); returns the requests it
        finished.

        With ``overlap=True`` the step is dispatched and the one before it
        applied (its requests are those returned); the last step is applied
        by the call that finds nothing more to schedule. The KV-cache events
        it caused go to ``scheduling.kv_event_sink`` when one is set.
        """
        done = self._step()
        self.publish_kv_events()
        return done

    def publish_kv_events(self) -> None:
        """Gives each rank's pending KV-cache events to the sink, as a batch.

        ``scheduling.kv_event_sink`` gets one :class:`jaxkv.sched.KVEventBatch`
        per data-parallel rank with events (nothing without a sink). If the
        sink raises, that batch and the later ranks' stay pending, first in
        line for the next call; the exception propagates.

        Example (the class's toy model; blocks of 16 tokens):
          >>> import jax.numpy as jnp
          >>> import jaxkv
          >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=2,
          ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
          ...     max_num_batched_tokens=32, token_buckets=(4, 32))
          >>> plan = jaxkv.make_plan(cfg, num_blocks=8)
          >>> layer = plan.attention_layer("layers.0.self_attn")
          >>> def forward(params, pools, meta, tokens, sample):
          ...     x = params[tokens]
          ...     m = meta[layer.name]
          ...     pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
          ...     q = jnp.repeat(x[:, None, :], 2, axis=1)
          ...     out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
          ...     return pools, out[sample, 0] @ params.T
          >>> batches = []
          >>> loop = jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8,
          ...     scheduling=jaxkv.SchedulingOptions(enable_prefix_caching=True,
          ...         kv_event_sink=batches.append))
          >>> _ = loop.run([jaxkv.Request("a", prompt=list(range(8)) * 2 + [1],
          ...     max_new_tokens=2)])
          >>> [[type(e).__name__ for e in b.events] for b in batches]
          [['BlockStored']]
          >>> len(batches[0].events[0].token_ids), batches[0].data_parallel_rank
          (16, None)
        """
        sink = self.scheduling.kv_event_sink
        if sink is None:
            return
        for rank, sched in enumerate(self.schedulers):
            events = sched.manager.take_events()
            if not events:
                continue
            batch = KVEventBatch(
                ts=time.time(),
                events=tuple(events),
                data_parallel_rank=rank if self.num_ranks > 1 else None,
            )
            try:
                sink(batch)
            except BaseException:
                sched.manager.requeue_events(events)
                raise

    def _step(self) -> list[Request]:
        if self.overlap:
            self._recover()
        else:
            self.resume()
        done: list[Request] = []
        if self.decode_steps > 1:
            ran, done = self._decode_ahead()
            if ran:
                return done
        steps = [s.schedule() for s in self.schedulers]
        if not any(step.batch for step in steps):
            if self.pipeline:
                return done + self.pipeline.drain(self.schedulers)
            if any(s.has_unfinished for s in self.schedulers):
                raise RuntimeError(
                    "ServingLoop: requests are waiting but none could be scheduled."
                )
            return done
        self.pipeline.dispatch(self.schedulers, steps, self._run_steps)
        return done + self._drain()

    def _drain(self) -> list[Request]:
        """Resolves what is in flight down to the mode's depth (overlap: 1)."""
        return self.pipeline.drain(self.schedulers, int(self.execution.overlap))

    def run(
        self,
        requests: Iterable[Request] = (),
        *,
        on_token: Callable[[Request, int], None] | None = None,
        sampling: Mapping[str, SamplingParams] | None = None,
    ) -> list[Request]:
        """Submits `requests` and serves until none is left; returns them.

        Rejected requests come back with ``status`` REJECTED and a
        ``reject_reason``; the others with their ``output``. `on_token(req,
        token)` is called for every token as it is sampled (streaming). After
        an exception, ``run()`` again resumes the step in flight and serves
        the rest. `sampling` maps request ids to their own parameters
        (``per_request_sampling`` loops).
        """
        requests = list(requests)
        own = dict(sampling or {})
        unknown = sorted(set(own) - {r.req_id for r in requests})
        if unknown:
            raise ValueError(
                f"run: sampling names request ids {unknown[:5]} that are not among "
                "the requests given; each key must be the req_id of one of them."
            )
        self._on_token = on_token
        try:
            for req in requests:
                self.submit(req, sampling=own.get(req.req_id))
            self.resume()
            while self.has_unfinished:
                self.step()
        finally:
            self._on_token = None
        return requests

    def export_request(self, req: Request) -> RequestKV:
        """The KV cache of running request `req`.

        Its computed tokens, after every step in flight is applied (:meth:`resume`); see
        :func:`export_request`. On a mesh, read from the request's data-parallel rank
        with every tensor rank's heads joined (:func:`export_rank_request`): the global
        model's cache, which a loop of any tensor-parallel degree adopts.

        Raises:
          ValueError: If `req` is not running.
        """
        self.resume()
        rank = next(
            (d for d, s in enumerate(self.schedulers) if req in s.running), None
        )
        if rank is None:
            raise ValueError(
                f"export_request: request {req.req_id!r} is not running (status "
                f"{req.status.value})."
            )
        manager = self.schedulers[rank].manager
        ids, n = manager.blocks_of(req), req.num_computed
        if self.sharded is None:
            return export_request(self.plan, self.pools, block_ids=ids, num_tokens=n)
        return export_rank_request(
            self.sharded, self.pools, data=rank, block_ids=ids, num_tokens=n
        )

    def adopt(self, req: Request, kv: RequestKV) -> bool:
        """Continues `req` from a KV cache computed elsewhere.

        Another loop's :meth:`export_request`, on any plan of the same layers:
        prefill/decode disaggregation: :meth:`Scheduler.adopt` holds its blocks,
        :func:`import_request` writes the cache into them. Returns ``False`` (nothing
        changed) when too few blocks are free now.

        On a mesh the request goes to the data-parallel rank with the fewest
        live requests (as :meth:`submit`), and :func:`import_rank_request`
        splits the heads over this loop's tensor ranks, whatever degree the
        exporting loop had.

        All or nothing: a cache the plan refuses (another layer set, shapes or
        dtypes, heads that do not split: named) leaves the schedulers and the
        pools as they were.

        Raises:
          ValueError: As :meth:`Scheduler.adopt` and :func:`import_request`.
        """
        self.resume()
        rank, sched = min(
            enumerate(self.schedulers),
            key=lambda rs: len(rs[1].running) + len(rs[1].waiting),
        )
        ids = sched.adopt(req, num_computed=kv.num_tokens)
        if ids is None:
            return False
        try:
            if self.sharded is None:
                self.pools = import_request(self.plan, self.pools, kv, block_ids=ids)
            else:
                self.pools = import_rank_request(
                    self.sharded, self.pools, kv, data=rank, block_ids=ids
                )
        except BaseException:
            _unadopt(sched, req)
            raise
        return True

    @property
    def decode_steps(self) -> int:
        """Decode iterations per dispatch in steady decoding (read-only).

        Decode iterations per dispatch in steady decoding (read-only: its
        programs are compiled by :meth:`warm_up`; make a new loop to change it).
        """
        return self._decode_steps

    def _rows(self) -> NamedSharding | None:
        """Per-rank rows on the mesh: ``P(data)`` over the leading axis."""
        if self.sharded is None:
            return None
        return NamedSharding(self.sharded.mesh, P(self.sharded.data_axis))

    def _no_tokens(self) -> jax.Array:
        if self.sharded is None:
            return jnp.zeros(self._width, jnp.int32)
        return jax.device_put(
            np.zeros((self.num_ranks, self._width), np.int32), self._rows()
        )

    def _seeds(self, steps: list[ScheduledStep], num_samples: int) -> Any:
        """Per rank and sampled row: the request's seed and parameters.

        Per rank and sampled row: the request's seed, and with
        ``per_request_sampling`` its parameters (padding rows: greedy).
        """
        return sampling_rows(
            [[r.req_id for r in s.sampled] for s in steps],
            num_samples,
            per_request=self.per_request_sampling,
            default=self.sampling,
            overrides=self._request_sampling,
        )

    def _dispatch(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        if self.sharded is None:
            inputs = self.builder.prepare(steps[0])
        else:
            inputs = self.builder.prepare_ranks(steps)
        seeds = self._seeds(steps, inputs.capacity.num_samples)
        if self.sharded is None:
            seeds = jax.tree.map(lambda x: x[0], seeds)
        else:
            seeds = jax.device_put(seeds, self._rows())
        self._flush_host_tiers()
        self.pools, next_tokens, logits = self.programs(
            inputs.program, self.pools, self.params, inputs, seeds, prev_tokens
        )
        self.counters["steps"] += 1
        self.counters["fast_prefill_armed"] += inputs.fast_prefill is not None
        self.counters["partial_prefills"] += sum(
            any(r.num_computed + n < len(r.prompt) for r, n in s.batch) for s in steps
        )
        return next_tokens, logits

    def _flush_host_tiers(self) -> None:
        for sched in self.schedulers:
            host = sched.manager.host
            if host is not None and host.num_pending:
                # Evicted blocks out to the host, hits back in, before the step
                # that reuses their device blocks (dispatched in order).
                self.pools = host.flush(self.pools)

    @staticmethod
    def _decode_key(inputs: StepInputs) -> tuple[Any, ...]:
        """The multi-step decode program of a first iteration's inputs."""
        return ("decode", inputs.program)

    def _decode_ahead(self) -> tuple[bool, list[Request]]:
        """Multi-step decoding: runs a block of iterations when it can.

        Multi-step decoding (``decode_steps > 1``, one device): when the
        batch is in steady decoding, runs ``decode_steps`` iterations in one
        program. With overlap the block is dispatched before the one in flight
        is read (:meth:`Scheduler.advance`), so the host schedules,
        packs and reads back while the device computes. Returns whether it
        ran and the requests finished.
        """
        sched, pipeline = self.schedulers[0], self.pipeline
        blocks = bool(pipeline) and pipeline.entries[-1][0][0].num_steps > 1
        if sched.waiting or not sched.running:
            # An ordinary step starts from known tokens: read the blocks first.
            return False, (pipeline.drain(self.schedulers) if blocks else [])
        done = [] if blocks else pipeline.drain(self.schedulers)
        step = sched.schedule_decode(self.decode_steps)
        if step is None and pipeline:
            # Not steady, or its blocks do not fit yet: with every token known
            # (stop tokens free blocks), once more; else an ordinary step.
            done += pipeline.drain(self.schedulers)
            step = sched.schedule_decode(self.decode_steps)
        if step is None:
            return False, done
        pipeline.dispatch(self.schedulers, [step], self._run_steps)
        return True, done + self._drain()

    def _run_steps(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Runs `steps`: ``(tokens, logits, tokens the next step reads)``."""
        if steps[0].num_steps > 1:  # a multi-step decode (one device)
            # The next step's placeholders are its last iteration's tokens.
            return self._dispatch_decode(steps[0], prev_tokens)
        tokens, logits = self._dispatch(steps, prev_tokens)
        return tokens, logits, tokens

    def _dispatch_decode(
        self, step: ScheduledStep, prev_tokens: jax.Array
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
        self._flush_host_tiers()
        self.pools, tokens, logits, last = self.decode_programs(
            self._decode_key(first), self.pools, self.params, inputs, seeds, prev_tokens
        )
        self.counters["steps"] += 1
        self.counters["decode_iterations"] += step.num_steps
        return tokens, logits, last

    def _forget(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            self._request_sampling.pop(req.req_id, None)
        return finished

    def _deliver(
        self, filled: list[tuple[int, Request, int]], logits: np.ndarray | None
    ) -> None:
        """Records logits and streams the tokens the scheduler took."""
        if logits is not None:
            for k, req, _ in filled:
                self.logits.setdefault(req.req_id, []).append(logits[k])
        if self._on_token is not None:
            for _, req, token in filled:
                self._on_token(req, token)

    def resume(self) -> str | None:
        """Brings the loop back to a consistent state after an exception.

        Brings the loop back to a consistent state after an exception inside
        a step; returns what it did (``None``: nothing was in flight).

        - ``"applied"``: the step's program had returned (the pools hold its
          K/V and states): its tokens are applied, never recomputed (a
          recurrent state updated in place has already advanced);
        - ``"rerun"``: it failed before the program ran (pools untouched): the
          same scheduled step runs again, bit for bit;
        - ``"recomputed"``: the program consumed its donated pools and failed:
          new pools, and every running request is recomputed from its prompt
          and outputs (:meth:`Scheduler.recompute_all`).

        With ``overlap=True`` every step in flight is finished the same way
        (applied, or rerun and applied), or, when the pools were consumed,
        all are recomputed (tokens not yet read are sampled again, the same).
        """
        done = self._recover()
        if self.pipeline:
            self.pipeline.drain(self.schedulers)
            done = done or "applied"
        return done

    def _recompute_all(self) -> None:
        """New pools; every rank's running requests recomputed."""
        self.pools = (
            self.plan.allocate() if self.sharded is None else self.sharded.allocate()
        )
        for sched in self.schedulers:
            sched.recompute_all()
        self.pipeline.clear(self._no_tokens())

    def _recover(self) -> str | None:
        """Finishes a step whose dispatch or advance raised.

        Steps in flight that ran stay in flight (a normal state).
        """
        pipeline, schedulers = self.pipeline, self.schedulers
        unadvanced = pipeline.unadvanced(schedulers)
        if pipeline.inflight is None and not unadvanced:
            return None
        if any_deleted(self.pools):
            # Steps in flight are lost with the pools: their tokens too.
            self._recompute_all()
            return "recomputed"
        if unadvanced:
            pipeline.advance(schedulers, pipeline.entries[-1][0])  # it ran
        if pipeline.inflight is not None:
            pipeline.dispatch(schedulers, pipeline.inflight, self._run_steps)
            return "rerun"
        return "applied"


def _unadopt(sched: Scheduler, req: Request) -> None:
    """Gives back what :meth:`Scheduler.adopt` held: `req` as it came."""
    sched.finish(req)
    req.status, req.num_computed = RequestStatus.WAITING, 0


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """`x`'s shape, dtype and sharding (programs are traced from these)."""
    return jax.ShapeDtypeStruct(
        jnp.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None)
    )
