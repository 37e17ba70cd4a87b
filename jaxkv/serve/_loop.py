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
import numpy as np

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
    check_drafter,
    check_drafts,
    check_loop_arguments,
    check_options,
    check_same_model,
    check_sampling_keys,
)
from jaxkv.serve._device_step import Forward
from jaxkv.serve._drafts import Drafter
from jaxkv.serve._options import ExecutionOptions, SchedulingOptions
from jaxkv.serve._pipeline import StepPipeline
from jaxkv.serve._resize import move_blocks
from jaxkv.serve._runner import StepRunner, abstract
from jaxkv.serve._sampling import (
    SamplingParams,
)
from jaxkv.transfer import (
    RequestKV,
)


def _runner_attr(name: str, doc: str, settable: bool = False) -> Any:
    """A loop attribute that is its :class:`StepRunner`'s."""

    def get(loop: ServingLoop) -> Any:
        return getattr(loop.runner, name)

    def put(loop: ServingLoop, value: Any) -> None:
        setattr(loop.runner, name, value)

    return property(get, put if settable else None, doc=doc)


class ServingLoop:
    """Serves requests with your model's step through jaxkv.

    Each :meth:`step`: the :class:`Scheduler` picks requests and tokens
    (admission, chunked prefill, preemption, prefix caching), the
    :class:`StepMetadataBuilder` packs them into one buffer padded to a
    bucket, and one compiled program per bucket builds the metadata, runs
    `forward` with the pools donated and samples (:func:`sample_tokens`); the
    tokens go back to the scheduler, stop tokens end requests, `on_token`
    streams them.

    With overlap (``ExecutionOptions(overlap=True)``, the default) step N+1
    is scheduled and dispatched while step N runs, as vLLM's async
    scheduling (:class:`StepPipeline`); outputs equal no overlap.

    If a step raises (in your model, the device, the host, an interrupt),
    :meth:`resume` finishes or redoes it (see there) and :meth:`run` resumes
    by itself: ``loop.run([])`` serves what was left.

    On a mesh (`plan` a :class:`ShardedPlan`) each data-parallel rank has
    its own :class:`Scheduler` and `forward` runs per device inside
    ``jax.shard_map`` on its rank's pools (the sharding page says more).

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

    With ``execution.decode_steps > 1`` (multi-step decoding), steady
    decoding runs that many iterations in one program
    (:meth:`Scheduler.schedule_decode`), blocks pipelined like steps; the
    tokens are those of one step at a time.

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
        decode_steps = check_decode_steps(plan, execution.decode_steps)
        if execution.drafter is not None:
            check_drafter(plan, decode_steps)
        #: How requests are scheduled (:meth:`reset` may change it).
        self.scheduling = scheduling
        #: How each step runs.
        self.execution = execution
        self._vocab_size = vocab_size
        self.sampling = SamplingParams() if sampling is None else sampling
        sharded = plan if isinstance(plan, ShardedPlan) else None
        local = sharded.local if sharded else cast(KVCachePlan, plan)
        self.record_logits = bool(execution.record_logits)
        self.per_request_sampling = bool(execution.per_request_sampling)
        self.schedulers: list[Scheduler] = self._schedulers(
            num_blocks=None, plan=local, sharded=sharded
        )
        #: The device side: builder, parameters, pools, compiled programs.
        self.runner = StepRunner(
            plan,
            forward,
            params,
            execution=execution,
            sampling=self.sampling,
            vocab_size=self.schedulers[0].vocab_size,
            decode_steps=decode_steps,
        )
        #: Per request id, the logits each sampled token came from
        #: (``record_logits=True``).
        self.logits: dict[str, list[np.ndarray]] = {}
        self._on_token: Callable[[Request, int], None] | None = None
        #: Steps dispatched whose tokens are not read yet (one stays in flight
        #: between steps with overlap, none without).
        self.pipeline = StepPipeline(
            no_tokens=self.runner.no_tokens(),
            num_ranks=self.num_ranks,
            record_logits=self.record_logits,
            deliver=self._deliver,
            forget=self._forget,
        )

    plan = _runner_attr(
        "plan", "The plan every device runs (a mesh's rank-local plan)."
    )
    sharded = _runner_attr("sharded", "The sharded plan on a mesh, else ``None``.")
    num_ranks = _runner_attr("num_ranks", "Data-parallel ranks (1 off a mesh).")
    forward = _runner_attr("forward", "Your model's step (:class:`Forward`).")
    params = _runner_attr("params", "Its parameters, placed on the device or mesh.")
    pools = _runner_attr("pools", "The pool arrays, donated to every step.", True)
    builder = _runner_attr("builder", "The :class:`StepMetadataBuilder` of its steps.")
    programs = _runner_attr("programs", "The compiled step programs, one per bucket.")
    decode_programs = _runner_attr("decode_programs", "Multi-step decode programs.")
    counters = _runner_attr("counters", "Steps, fast-prefill steps, partial prefills.")
    decode_steps = _runner_attr("decode_steps", "Decode iterations per dispatch.")

    def resize(self, plan: KVCachePlan, *, forward: Forward | None = None) -> None:
        """Serves from `plan`'s pools: the same model with another ``num_blocks``.

        Grows (or shrinks) the KV cache without a restart (the sizing page
        shows how): what is in flight is finished first, then every block
        whose bytes matter (held or cached) is copied once to the same id in
        `plan`'s pools, so requests, the prefix cache and the host tier carry
        on as in a loop started at the new size. Shrunk, the blocks past the
        end must be free. The programs compile again (:meth:`warm_up` does
        it ahead); old and new pools coexist during the copy. Not on a mesh.

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
        """
        self._outside_run("resize", "resize")
        if self.sharded is not None:
            raise NotImplementedError(
                "ServingLoop.resize: not on a mesh yet; make a new loop from "
                "shard_plan(..., num_blocks=...) (and size it with "
                "jaxkv.serve.size_loop_kv_cache)."
            )
        check_same_model(self.plan, plan)
        if forward is not None:
            check_loop_arguments(plan, forward, self.sampling, None)
        builder, step = self.runner.checked_step_for(plan, forward or self.forward)
        old, old_pools = self.plan, self.pools
        self.resume()
        self.pools = self._flush_host_tiers(self.pools)
        sched = self.schedulers[0]
        sched.resize(plan)  # refuses a held block past the end, unchanged
        ids = sched.manager.allocator.in_use()
        pools = move_blocks(old, old_pools, plan, plan.allocate(), ids)
        self.runner.retarget(plan, pools=pools, builder=builder, step=step)
        self.pipeline.prev_tokens = self.runner.no_tokens()
        self.publish_kv_events()  # the cached blocks a shrink dropped

    def _schedulers(
        self,
        *,
        num_blocks: int | None,
        options: SchedulingOptions | None = None,
        plan: KVCachePlan | None = None,
        sharded: ShardedPlan | None = None,
    ) -> list[Scheduler]:
        """One scheduler per data-parallel rank (:meth:`SchedulingOptions.make`)."""
        opts = self.scheduling if options is None else options
        return opts.make(
            self.plan if plan is None else plan,
            sharded=self.sharded if plan is None else sharded,
            num_blocks=num_blocks,
            vocab_size=self._vocab_size,
        )

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
        """
        value = check_bool("ServingLoop.set_overlap", "value", value)
        if value == self.execution.overlap:
            return
        self._outside_run("set_overlap", "change")
        self.resume()
        self.execution = dataclasses.replace(self.execution, overlap=value)

    @property
    def host(self) -> HostKVCache | None:
        """The host tier of evicted prefix blocks, or None.

        On a mesh, rank 0's: each rank's is ``schedulers[rank].manager.host``.
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

        Requests, cached prefixes (the host tier's too) and recorded logits
        are forgotten. A request still running or waiting is aborted:
        finished, its blocks freed, tokens not yet read dropped (``status``
        FINISHED, not left RUNNING forever).

        Args:
          scheduling: The new schedulers' options, kept for later resets
            (default: :attr:`scheduling`, unchanged).
          num_blocks: Blocks each scheduler may use (default: all of the
            pool's); fewer simulate a smaller pool without recompiling.

        Raises:
          RuntimeError: Inside ``run()`` (from ``on_token``, while a step's
            tokens are being applied): the step would be left half applied.
        """
        self._outside_run("reset", "reset")
        options = (
            self.scheduling
            if scheduling is None
            else check_options(scheduling, SchedulingOptions, "scheduling")
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

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles the step for every bucket; returns the seconds spent.

        From shapes (allocating nothing). Without it each bucket compiles the
        first time a step meets it (never more than once). `progress(done,
        total)` is called after each bucket.
        """
        t0 = time.perf_counter()
        num_seqs = self.schedulers[0].max_num_seqs
        todo = self.runner.warm_up(self.pipeline.prev_tokens, num_seqs, progress)
        for sched in self.schedulers:  # the ranks share the programs
            if sched.manager.host is not None:
                sched.manager.host.warm_up(jax.tree.map(abstract, self.pools))
        if progress is not None:
            progress(todo, todo)
        return time.perf_counter() - t0

    # --- host side ------------------------------------------------------------

    @checks_own_arguments
    def submit(
        self, request: Request, *, sampling: SamplingParams | None = None
    ) -> bool:
        """Queues `request` on the least loaded rank, or rejects it.

        The rank with the fewest live requests takes it; a rejected request's
        ``reject_reason`` says why.

        Args:
          request: The request.
          sampling: Its own sampling parameters (``per_request_sampling``
            loops only; default: the loop's).

        Raises:
          ValueError: If `sampling` is given to a loop without
            ``per_request_sampling``.
          TypeError: If `sampling` is not a :class:`SamplingParams`.
        """
        self.runner.check_sampling(request.req_id, sampling)
        self.runner.check_forward_writes()
        sched = min(self.schedulers, key=lambda s: len(s.running) + len(s.waiting))
        accepted = sched.add_request(request)
        if accepted and sampling is not None:
            self.runner.request_sampling[request.req_id] = sampling
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
        if self.overlap and self.execution.drafter is None:
            self._recover()
        else:
            self.resume()
        if self.execution.drafter is not None:
            self._propose_drafts()
        done: list[Request] = []
        if self.decode_steps > 1:
            ran, done = self.pipeline.decode_ahead(
                self.schedulers,
                self.decode_steps,
                self._run_steps,
                depth=int(self.execution.overlap),
            )
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
        """Resolves what is in flight down to the mode's depth (overlap: 1).

        With a drafter, 0: the next drafts are proposed from its tokens.
        """
        depth = self.execution.overlap and self.execution.drafter is None
        return self.pipeline.drain(self.schedulers, int(depth))

    def _propose_drafts(self) -> None:
        """Asks the drafter for the drafts of every request decoding next.

        The requests whose every token is known and whose next step is a
        decode, per rank; their drafts are checked (one list of token ids in
        the vocabulary per request, cut to ``num_speculative_tokens``) before
        any is set, so a drafter that raises or answers wrongly changes
        nothing.
        """
        drafter = cast(Drafter, self.execution.drafter)
        k = cast(int, self.execution.num_speculative_tokens)
        proposed = []  # every rank's, checked, before any is set
        for sched in self.schedulers:
            reqs = [
                r
                for r in sched.running
                if r.num_computed == r.num_tokens - 1 and not r.num_pending
            ]
            if reqs:
                drafts = check_drafts(drafter(reqs), reqs, vocab_size=sched.vocab_size)
                proposed += zip(reqs, drafts, strict=True)
        for req, draft in proposed:
            req.spec_token_ids = draft[:k]

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
        own = check_sampling_keys(requests, sampling)
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
        ids = self.schedulers[rank].manager.blocks_of(req)
        return self.runner.export(rank, block_ids=ids, num_tokens=req.num_computed)

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
            self.runner.import_(rank, kv, block_ids=ids)
        except BaseException:
            _unadopt(sched, req)
            raise
        return True

    def _outside_run(self, op: str, verb: str) -> None:
        """Refuses `op` from ``on_token`` (a step would be left half applied)."""
        if self._on_token is not None:
            raise RuntimeError(
                f"ServingLoop.{op}: cannot {verb} inside run() (from on_token, "
                f"while a step's tokens are being applied); {verb} between "
                "step() calls or runs."
            )

    def _flush_host_tiers(self, pools: Pools) -> Pools:
        """Evicted blocks out to the host, hits in, before the step reusing them."""
        for sched in self.schedulers:
            host = sched.manager.host
            if host is not None and host.num_pending:
                pools = host.flush(pools)
        return pools

    def _run_steps(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Runs `steps` on the device after the host tiers' copies."""
        return self.runner.run(steps, prev_tokens, flush=self._flush_host_tiers)

    def _forget(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            self.runner.request_sampling.pop(req.req_id, None)
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

        Returns what it did (``None``: nothing was in flight).

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
        self.runner.allocate()
        for sched in self.schedulers:
            sched.recompute_all()
        self.pipeline.clear(self.runner.no_tokens())

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
