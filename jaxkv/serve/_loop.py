"""A serving loop for your own model: arrivals, scheduling, the step in one
jitted program per bucket, sampling, stop tokens, streaming and resumption.
"""  # noqa: D205

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.cache import KVCachePlan, Pools, ShardedPlan, any_deleted
from jaxkv.sched import Request, ScheduledStep, Scheduler
from jaxkv.serve._checks import check_loop_arguments, check_param_specs
from jaxkv.serve._device_step import DeviceStep
from jaxkv.serve._sampling import (
    SamplingParams,
    abstract_sampling_rows,
    sampling_rows,
)
from jaxkv.step import (
    BucketDispatcher,
    CommonAttentionMetadata,
    Programs,
    StepMetadataBuilder,
)


class Forward(Protocol):
    """Your model's step, traced inside the loop's jitted program.

    ``forward(params, pools, meta, token_ids, sample_idx) -> (pools, logits)``:
    `meta` maps every layer to its :class:`CommonAttentionMetadata`,
    `token_ids` are the step's ``(max_tokens,)`` padded tokens (their positions
    are ``meta[name].positions``), `sample_idx` the ``(num_samples,)`` token
    indices whose logits are sampled; return the updated pools and
    ``(num_samples, vocab)`` logits.

    Example:
      >>> import jaxkv
      >>> def forward(params, pools, meta, token_ids, sample_idx):
      ...     return pools, params[token_ids[sample_idx]]  # a bigram table
      >>> f: jaxkv.Forward = forward  # any function of this signature
    """

    def __call__(
        self,
        params: Any,
        pools: Pools,
        meta: Mapping[str, CommonAttentionMetadata],
        token_ids: jax.Array,
        sample_idx: jax.Array,
        /,
    ) -> tuple[Pools, jax.Array]:
        """One step of the model (positional arguments: name them as you like)."""
        ...


class ServingLoop:
    """Serves requests with your model's step through jaxkv.

    Each :meth:`step`: the :class:`Scheduler` picks requests and tokens
    (admission, chunked prefill, preemption, prefix caching), the
    :class:`StepMetadataBuilder` packs them into one buffer padded to a
    bucket, and one compiled program per bucket builds the metadata, runs
    `forward` with the pools donated and samples (:func:`sample_tokens`); the
    tokens go back to the scheduler, stop tokens end requests, `on_token`
    streams them.

    With ``overlap=True`` (the default) the host hides behind the device, as
    vLLM's async scheduling: step N+1 is scheduled, packed and dispatched
    while step N runs (JAX dispatch is asynchronous), its decode tokens taken
    from step N's sampled tokens on the device (:meth:`Scheduler.advance`);
    step N's tokens are then read and applied (:meth:`Scheduler.resolve`). A
    request that samples a stop token has one more step computed for it,
    dropped. Outputs equal ``overlap=False``.

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
    ``jax.lax.psum`` over the tensor axis), and `param_specs` shard its
    parameters. Nothing per rank is written by the caller
    (``tests/serve_mesh_check.py``: 2x4, 4x2 and 8x1 meshes serve what one
    device serves). Fast prefill is not armed on a mesh.

    Args:
      plan: The model's plan (:func:`make_plan`), or a :class:`ShardedPlan`.
      forward: Your step (:class:`Forward`).
      params: Its parameters (a pytree of arrays, passed to every step).
      sampling: How tokens are drawn (greedy by default).
      enable_prefix_caching: Reuse cached prefixes.
      vocab_size: Check prompt and sampled token ids against it.
      record_logits: Keep each sampled token's logits in :attr:`logits` (a
        device-to-host copy per step).
      max_num_batched_tokens: Token budget per step (default: the config's).
      max_num_seqs: Requests per step (default: the config's).
      overlap: Schedule the next step while one runs (see above).
      param_specs: On a mesh, a ``PartitionSpec`` per leaf of `params`
        (default: replicated).
      dispatcher: The buckets (default: the config's, as
        :class:`StepMetadataBuilder` makes them).
      per_request_sampling: Each request may bring its own
        :class:`SamplingParams` (``submit(req, sampling=...)``, ``run(...,
        sampling={req_id: ...})``; the others use `sampling`): the step
        samples with :func:`sample_tokens_per_row` from per-row arrays, one
        program for any mix (a sort of the vocabulary per sampled row, which
        a greedy-only loop does not pay).

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
      ...     pools = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
      ...     q = jnp.repeat(x[:, None, :], 2, axis=1)
      ...     out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
      ...     return pools, out[sample, 0] @ params.T       # (samples, vocab)
      >>> loop = jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)
      >>> r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)
      >>> loop.run([r])[0].output
      [3, 3]
    """

    def __init__(
        self,
        plan: KVCachePlan | ShardedPlan,
        forward: Forward,
        params: Any,
        *,
        sampling: SamplingParams | None = None,
        enable_prefix_caching: bool = False,
        vocab_size: int | None = None,
        record_logits: bool = False,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        overlap: bool = True,
        param_specs: Any = None,
        dispatcher: BucketDispatcher | None = None,
        per_request_sampling: bool = False,
    ) -> None:
        """Creates the schedulers and the builder and allocates the pools."""
        check_loop_arguments(plan, forward, sampling, param_specs)
        self.sampling = SamplingParams() if sampling is None else sampling
        sharded = plan if isinstance(plan, ShardedPlan) else None
        self.sharded = sharded
        #: The plan every device runs (a mesh's rank-local plan).
        self.plan: KVCachePlan = sharded.local if sharded else cast(KVCachePlan, plan)
        self.num_ranks = 1 if self.sharded is None else self.sharded.data_parallel
        self.forward = forward
        self.record_logits = bool(record_logits)
        self.overlap = bool(overlap)
        self.per_request_sampling = bool(per_request_sampling)
        # Per request id, its own SamplingParams (per_request_sampling).
        self._request_sampling: dict[str, SamplingParams] = {}
        # On a mesh the builder prepares every data rank's step at once.
        self.builder = StepMetadataBuilder(plan, dispatcher, model_inputs=True)
        # Sampled tokens travel between steps padded to one width, so a
        # step's program takes its predecessor's tokens whatever its bucket.
        self._width = self.builder.max_num_samples
        self._limits = {
            "vocab_size": vocab_size,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
        }
        self.schedulers: list[Scheduler] = [
            Scheduler(
                self.plan, enable_prefix_caching=enable_prefix_caching, **self._limits
            )
            for _ in range(self.num_ranks)
        ]
        self.params, self.pools, self._param_specs = self._place(params, param_specs)
        self.device_step = DeviceStep(
            builder=self.builder,
            forward=forward,
            sharded=sharded,
            param_specs=self._param_specs,
            width=self._width,
            sampling=self.sampling,
            per_request_sampling=self.per_request_sampling,
        )
        self.programs = Programs(self.device_step, donate_argnums=0)
        #: Steps run, steps with fast prefill armed, rank steps with a prefill
        #: chunk that did not finish its prompt.
        self.counters = {"steps": 0, "fast_prefill_armed": 0, "partial_prefills": 0}
        #: Per request id, the logits each sampled token came from
        #: (``record_logits=True``).
        self.logits: dict[str, list[np.ndarray]] = {}
        # The steps in flight (one per rank): scheduled, then their results
        # once they ran.
        self._inflight: list[ScheduledStep] | None = None
        self._results: tuple[jax.Array, jax.Array] | None = None
        self._on_token: Callable[[Request, int], None] | None = None
        # overlap=True: steps dispatched and advanced, not resolved yet, with
        # their (device) tokens and logits; the latest dispatched step's
        # tokens, which the next step's decode placeholders index.
        self._pipeline: deque[tuple[list[ScheduledStep], jax.Array, jax.Array]] = (
            deque()
        )
        self._prev_tokens = self._no_tokens()

    def _place(self, params: Any, param_specs: Any) -> tuple[Any, Pools, Any]:
        """``(params, pools, param specs)``: on the device, or over the mesh
        (parameters replicated unless `param_specs` shard them).
        """  # noqa: D205
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
        self, *, enable_prefix_caching: bool = False, num_blocks: int | None = None
    ) -> None:
        """New schedulers: requests, cached prefixes and recorded logits are
        forgotten; pools and compiled programs stay.

        Args:
          enable_prefix_caching: Reuse cached prefixes.
          num_blocks: Blocks each scheduler may use (default: all of the
            pool's); fewer simulate a smaller pool without recompiling.
        """  # noqa: D205
        self.resume()
        self.schedulers = [
            Scheduler(
                self.plan,
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_blocks,
                **self._limits,
            )
            for _ in range(self.num_ranks)
        ]
        self.logits = {}

    # --- device side ----------------------------------------------------------

    def _rows(self) -> NamedSharding | None:
        """Per-rank rows on the mesh: ``P(data)`` over the leading axis."""
        if self.sharded is None:
            return None
        return NamedSharding(self.sharded.mesh, P(self.sharded.data_axis))

    @property
    def fast_prefill(self) -> bool:
        """Whether steps with a prefill can arm the fast-prefill path."""
        return self.builder.fast_prefill_helper is not None

    def _no_tokens(self) -> jax.Array:
        if self.sharded is None:
            return jnp.zeros(self._width, jnp.int32)
        return jax.device_put(
            np.zeros((self.num_ranks, self._width), np.int32), self._rows()
        )

    def _abstract_seeds(self, shape: tuple[int, ...], rows: Any) -> Any:
        """What a step's sampling inputs look like (see :meth:`_seeds`)."""
        return abstract_sampling_rows(
            shape, rows, per_request=self.per_request_sampling
        )

    def _seeds(self, steps: list[ScheduledStep], num_samples: int) -> Any:
        """Per rank and sampled row: the request's seed, and with
        ``per_request_sampling`` its parameters (padding rows: greedy).
        """  # noqa: D205
        return sampling_rows(
            [[r.req_id for r in s.sampled] for s in steps],
            num_samples,
            per_request=self.per_request_sampling,
            default=self.sampling,
            overrides=self._request_sampling,
        )

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles the step for every bucket from shapes (allocating nothing);
        returns the seconds spent. Without it each bucket compiles the first
        time a step meets it (never more than once). `progress(done, total)`
        is called after each bucket.
        """  # noqa: D205

        def abstract(x: Any) -> Any:
            return jax.ShapeDtypeStruct(
                jnp.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None)
            )

        t0 = time.perf_counter()
        pools = jax.tree.map(abstract, self.pools)
        params = jax.tree.map(abstract, self.params)
        prev = abstract(self._prev_tokens)
        ranks = () if self.sharded is None else (self.num_ranks,)
        rows = self._rows()
        todo = self.builder.abstract_inputs()
        for i, inputs in enumerate(todo):
            if progress is not None and i:
                progress(i, len(todo))
            seeds = self._abstract_seeds((*ranks, inputs.layout.num_samples), rows)
            self.programs.compile(inputs.program, pools, params, inputs, seeds, prev)
        self.builder.warm_up_host()
        if progress is not None:
            progress(len(todo), len(todo))
        return time.perf_counter() - t0

    # --- host side ------------------------------------------------------------

    def submit(
        self, request: Request, *, sampling: SamplingParams | None = None
    ) -> bool:
        """Queues `request` (on the data-parallel rank with the fewest live
        requests), or rejects it (``request.reject_reason`` says why).

        Args:
          request: The request.
          sampling: Its own sampling parameters (``per_request_sampling``
            loops only; default: the loop's).

        Raises:
          ValueError: If `sampling` is given to a loop without
            ``per_request_sampling``.
          TypeError: If `sampling` is not a :class:`SamplingParams`.
        """  # noqa: D205
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
        sched = min(self.schedulers, key=lambda s: len(s.running) + len(s.waiting))
        accepted = sched.add_request(request)
        if accepted and sampling is not None:
            self._request_sampling[request.req_id] = sampling
        return accepted

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or has a token in flight."""
        return any(s.has_unfinished for s in self.schedulers) or bool(self._pipeline)

    def step(self) -> list[Request]:
        """Schedules and runs one step (every rank's); returns the requests it
        finished.

        With ``overlap=True`` the step is dispatched and the one before it
        applied (its requests are those returned); the last step is applied
        by the call that finds nothing more to schedule.
        """  # noqa: D205
        if self.overlap:
            self._recover()
        else:
            self.resume()
        steps = [s.schedule() for s in self.schedulers]
        if not any(step.batch for step in steps):
            if self._pipeline:
                return self._resolve_all()
            if any(s.has_unfinished for s in self.schedulers):
                raise RuntimeError(
                    "ServingLoop: requests are waiting but none could be scheduled."
                )
            return []
        if not self.overlap:
            return self._run_step(steps)
        self._dispatch_ahead(steps)
        finished = []
        while len(self._pipeline) > 1:
            finished += self._resolve_oldest()
        return finished

    def _dispatch(
        self, steps: list[ScheduledStep], prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        if self.sharded is None:
            inputs = self.builder.prepare(steps[0])
        else:
            inputs = self.builder.prepare_ranks(steps)
        seeds = self._seeds(steps, inputs.layout.num_samples)
        if self.sharded is None:
            seeds = jax.tree.map(lambda x: x[0], seeds)
        else:
            seeds = jax.device_put(seeds, self._rows())
        self.pools, next_tokens, logits = self.programs(
            inputs.program, self.pools, self.params, inputs, seeds, prev_tokens
        )
        self.counters["steps"] += 1
        self.counters["fast_prefill_armed"] += inputs.fast_prefill is not None
        self.counters["partial_prefills"] += sum(
            any(r.num_computed + n < len(r.prompt) for r, n in s.batch) for s in steps
        )
        return next_tokens, logits

    def _host_results(
        self, next_tokens: jax.Array, logits: jax.Array | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(ranks, width)`` tokens and ``(ranks, samples, vocab)`` logits."""
        tokens = _to_host(next_tokens).reshape(self.num_ranks, -1)
        host = None
        if logits is not None and self.record_logits:
            host = _to_host(logits).reshape(self.num_ranks, *logits.shape[-2:])
        return tokens, host

    def _run_step(self, steps: list[ScheduledStep]) -> list[Request]:
        self._inflight, self._results = steps, None
        results = self._dispatch(steps, self._no_tokens())
        # From here the step has run (the pools hold its K/V and states): on
        # resume() it is applied, never run again.
        self._results = results
        return self._apply()

    def _dispatch_ahead(self, steps: list[ScheduledStep]) -> None:
        """Dispatches `steps` (overlap) and advances the schedulers past them."""
        self._inflight = steps
        next_tokens, logits = self._dispatch(steps, self._prev_tokens)
        # It ran: from here resume() advances and resolves it, never reruns it.
        self._pipeline.append((steps, next_tokens, logits))
        self._prev_tokens = next_tokens
        self._inflight = None
        self._advance(steps)

    def _advance(self, steps: list[ScheduledStep]) -> None:
        for sched, step in zip(self.schedulers, steps, strict=True):
            if sched.last_applied is not step:  # each once, after a fault too
                sched.advance(step)

    def _resolve_oldest(self) -> list[Request]:
        steps, next_tokens, logits = self._pipeline[0]
        tokens, host_logits = self._host_results(next_tokens, logits)  # waits
        finished = []
        for rank, (sched, step) in enumerate(zip(self.schedulers, steps, strict=True)):
            if step in sched.unresolved:  # each once, after a fault too
                n = len(step.sampled)
                finished += sched.resolve(step, tokens[rank, :n].tolist())
        self._pipeline.popleft()
        self._forget(finished)
        for rank, step in enumerate(steps):
            self._deliver(
                step.filled, None if host_logits is None else host_logits[rank]
            )
        return finished

    def _forget(self, finished: list[Request]) -> list[Request]:
        for req in finished:
            self._request_sampling.pop(req.req_id, None)
        return finished

    def _resolve_all(self) -> list[Request]:
        finished = []
        while self._pipeline:
            finished += self._resolve_oldest()
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

    def _apply(self) -> list[Request]:
        if self._inflight is None or self._results is None:
            raise RuntimeError("ServingLoop: no step result to apply.")
        steps = self._inflight
        tokens, host_logits = self._host_results(*self._results)
        finished, delivered = [], []
        for rank, (sched, step) in enumerate(zip(self.schedulers, steps, strict=True)):
            sampled = step.sampled
            if sched.last_applied is step:  # applied before a fault on another rank
                continue
            row = tokens[rank, : len(sampled)].tolist()
            finished += sched.update(step, row)
            delivered.append(
                (
                    [
                        (k, r, t)
                        for k, (r, t) in enumerate(zip(sampled, row, strict=True))
                    ],
                    None if host_logits is None else host_logits[rank],
                )
            )
        self._inflight = self._results = None
        self._forget(finished)
        for filled, logits in delivered:
            self._deliver(filled, logits)
        return finished

    def resume(self) -> str | None:
        """Brings the loop back to a consistent state after an exception inside
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
        """  # noqa: D205
        if not self.overlap:
            if self._inflight is None:
                return None
            if self._results is not None:
                self._apply()
                return "applied"
            if any_deleted(self.pools):
                self._recompute_all()
                return "recomputed"
            self._run_step(self._inflight)
            return "rerun"
        done = self._recover()
        if self._pipeline:
            self._resolve_all()
            done = done or "applied"
        return done

    def _recompute_all(self) -> None:
        """New pools; every rank's running requests recomputed."""
        self.pools = (
            self.plan.allocate() if self.sharded is None else self.sharded.allocate()
        )
        for sched in self.schedulers:
            sched.recompute_all()
        self._pipeline.clear()
        self._prev_tokens = self._no_tokens()
        self._inflight = self._results = None

    def _recover(self) -> str | None:
        """Overlap: finishes a step whose dispatch or advance raised; steps in
        flight that ran stay in flight (a normal state).
        """  # noqa: D205
        unadvanced = bool(self._pipeline) and any(
            sched.last_applied is not step
            for sched, step in zip(self.schedulers, self._pipeline[-1][0], strict=True)
        )
        if self._inflight is None and not unadvanced:
            return None
        if any_deleted(self.pools):
            # Steps in flight are lost with the pools: their tokens too.
            self._recompute_all()
            return "recomputed"
        if unadvanced:
            self._advance(self._pipeline[-1][0])  # it ran
        if self._inflight is not None:
            self._dispatch_ahead(self._inflight)
            return "rerun"
        return "applied"

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


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host; over several processes, gathered from all
    (sampled tokens and logits only: a few KB a step).
    """  # noqa: D205
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
