"""A serving loop for your own model: arrivals, scheduling, the step in one
jitted program per bucket, sampling, stop tokens, streaming and resumption.
"""  # noqa: D205

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.ops import Pools, any_deleted
from jaxkv.cache.plan import KVCachePlan
from jaxkv.sched.request import Request
from jaxkv.sched.scheduler import ScheduledStep, Scheduler
from jaxkv.serve.sampling import SamplingParams, request_seed, sample_tokens
from jaxkv.step.builder import StepInputs, StepMetadataBuilder
from jaxkv.step.metadata import CommonAttentionMetadata
from jaxkv.step.programs import Programs


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

    Args:
      plan: The model's plan (:func:`make_plan`).
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
        plan: KVCachePlan,
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
    ) -> None:
        """Creates the scheduler and the builder and allocates the pools."""
        if not callable(forward):
            raise TypeError(
                f"ServingLoop: forward must be callable, got {type(forward).__name__}."
            )
        self.sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                "ServingLoop: sampling must be a SamplingParams, got "
                f"{type(self.sampling).__name__}."
            )
        self.plan = plan
        self.forward = forward
        self.params = params
        self.record_logits = bool(record_logits)
        self.overlap = bool(overlap)
        self.builder = StepMetadataBuilder(plan, model_inputs=True)
        # Sampled tokens travel between steps padded to one width, so a
        # step's program takes its predecessor's tokens whatever its bucket.
        self._width = self.builder.max_num_samples
        self._limits = {
            "vocab_size": vocab_size,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
        }
        self.scheduler = Scheduler(
            plan, enable_prefix_caching=enable_prefix_caching, **self._limits
        )
        self.pools: Pools = plan.allocate()
        self.programs = Programs(self._device_step, donate_argnums=(0,))
        #: Per request id, the logits each sampled token came from
        #: (``record_logits=True``).
        self.logits: dict[str, list[np.ndarray]] = {}
        # The step in flight: scheduled, then its results once it ran.
        self._inflight: ScheduledStep | None = None
        self._results: tuple[jax.Array, jax.Array] | None = None
        self._on_token: Callable[[Request, int], None] | None = None
        # overlap=True: steps dispatched and advanced, not resolved yet, with
        # their (device) tokens and logits; the latest dispatched step's
        # tokens, which the next step's decode placeholders index.
        self._pipeline: deque[tuple[ScheduledStep, jax.Array, jax.Array]] = deque()
        self._prev_tokens: jax.Array = jnp.zeros(self._width, jnp.int32)

    def reset(
        self, *, enable_prefix_caching: bool = False, num_blocks: int | None = None
    ) -> None:
        """A new scheduler: requests, cached prefixes and recorded logits are
        forgotten; pools and compiled programs stay.

        Args:
          enable_prefix_caching: Reuse cached prefixes.
          num_blocks: Blocks the scheduler may use (default: all of the
            pool's); fewer simulate a smaller pool without recompiling.
        """  # noqa: D205
        self.resume()
        self.scheduler = Scheduler(
            self.plan,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks=num_blocks,
            **self._limits,
        )
        self.logits = {}

    # --- device side ----------------------------------------------------------

    def _device_step(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array,
        prev_tokens: jax.Array,
    ) -> tuple[Pools, jax.Array, jax.Array]:
        meta = self.builder.metadata(inputs)
        tokens, sample = self.builder.model_inputs_of(inputs)
        # A placeholder -(k + 1) (async scheduling) is the previous step's
        # k-th sampled token, still on the device.
        src = jnp.clip(-tokens - 1, 0, self._width - 1)
        tokens = jnp.where(tokens < 0, prev_tokens[src], tokens)
        pools, logits = self.forward(params, pools, meta, tokens, sample)
        positions = next(iter(meta.values())).positions[sample]
        next_tokens = sample_tokens(
            logits, params=self.sampling, request_seeds=seeds, positions=positions
        )
        padded = jnp.zeros(self._width, jnp.int32)
        padded = padded.at[: next_tokens.shape[0]].set(next_tokens.astype(jnp.int32))
        return pools, padded, logits

    def warm_up(self) -> float:
        """Compiles the step for every bucket from shapes (allocating nothing);
        returns the seconds spent. Without it each bucket compiles the first
        time a step meets it (never more than once).
        """  # noqa: D205

        def abstract(x: Any) -> Any:
            return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

        t0 = time.perf_counter()
        pools = jax.tree.map(abstract, self.pools)
        params = jax.tree.map(abstract, self.params)
        prev = jax.ShapeDtypeStruct((self._width,), jnp.int32)
        for inputs in self.builder.abstract_inputs():
            seeds = jax.ShapeDtypeStruct((inputs.layout.num_samples,), jnp.int32)
            self.programs.compile(inputs.program, pools, params, inputs, seeds, prev)
        self.builder.warm_up_host()
        return time.perf_counter() - t0

    # --- host side ------------------------------------------------------------

    def submit(self, request: Request) -> bool:
        """Queues `request`, or rejects it (``request.reject_reason`` says why)."""
        return self.scheduler.add_request(request)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or has a token in flight."""
        return self.scheduler.has_unfinished or bool(self._pipeline)

    def step(self) -> list[Request]:
        """Schedules and runs one step; returns the requests it finished.

        With ``overlap=True`` the step is dispatched and the one before it
        applied (its requests are those returned); the last step is applied
        by the call that finds nothing more to schedule.
        """
        if self.overlap:
            self._recover()
        else:
            self.resume()
        scheduled = self.scheduler.schedule()
        if not scheduled.batch:
            if self._pipeline:
                return self._resolve_all()
            if self.scheduler.has_unfinished:
                raise RuntimeError(
                    "ServingLoop: requests are waiting but none could be scheduled."
                )
            return []
        if not self.overlap:
            return self._run_step(scheduled)
        self._dispatch_ahead(scheduled)
        finished = []
        while len(self._pipeline) > 1:
            finished += self._resolve_oldest()
        return finished

    def _dispatch(
        self, scheduled: ScheduledStep, prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        prepared = self.builder.prepare(**scheduled.arrays._asdict())
        inputs = prepared.inputs
        seeds = np.zeros(inputs.layout.num_samples, np.int32)
        sampled = scheduled.sampled
        seeds[: len(sampled)] = [request_seed(r.req_id) for r in sampled]
        self.pools, next_tokens, logits = self.programs(
            inputs.program, self.pools, self.params, inputs, seeds, prev_tokens
        )
        return next_tokens, logits

    def _run_step(self, scheduled: ScheduledStep) -> list[Request]:
        self._inflight, self._results = scheduled, None
        results = self._dispatch(scheduled, jnp.zeros(self._width, jnp.int32))
        # From here the step has run (the pools hold its K/V and states): on
        # resume() it is applied, never run again.
        self._results = results
        return self._apply()

    def _dispatch_ahead(self, scheduled: ScheduledStep) -> None:
        """Dispatches `scheduled` (overlap) and advances the scheduler past it."""
        self._inflight = scheduled
        next_tokens, logits = self._dispatch(scheduled, self._prev_tokens)
        # It ran: from here resume() advances and resolves it, never reruns it.
        self._pipeline.append((scheduled, next_tokens, logits))
        self._prev_tokens = next_tokens
        self._inflight = None
        self.scheduler.advance(scheduled)

    def _resolve_oldest(self) -> list[Request]:
        scheduled, next_tokens, logits = self._pipeline[0]
        sampled = scheduled.sampled
        tokens = np.asarray(next_tokens)[: len(sampled)].tolist()  # waits for it
        finished = self.scheduler.resolve(scheduled, tokens)
        self._pipeline.popleft()
        self._deliver(scheduled.filled, logits)
        return finished

    def _resolve_all(self) -> list[Request]:
        finished = []
        while self._pipeline:
            finished += self._resolve_oldest()
        return finished

    def _deliver(
        self, filled: list[tuple[int, Request, int]], logits: jax.Array
    ) -> None:
        """Records logits and streams the tokens the scheduler took."""
        if self.record_logits and filled:
            host = np.asarray(logits)
            for k, req, _ in filled:
                self.logits.setdefault(req.req_id, []).append(host[k])
        if self._on_token is not None:
            for _, req, token in filled:
                self._on_token(req, token)

    def _apply(self) -> list[Request]:
        if self._inflight is None or self._results is None:
            raise RuntimeError("ServingLoop: no step result to apply.")
        scheduled = self._inflight
        next_tokens, logits = self._results
        sampled = scheduled.sampled
        tokens = np.asarray(next_tokens)[: len(sampled)].tolist()
        finished = self.scheduler.update(scheduled, tokens)
        self._inflight = self._results = None
        self._deliver(
            [(k, r, t) for k, (r, t) in enumerate(zip(sampled, tokens, strict=True))],
            logits,
        )
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
                self.pools = self.plan.allocate()
                self.scheduler.recompute_all()
                self._inflight = None
                return "recomputed"
            self._run_step(self._inflight)
            return "rerun"
        done = self._recover()
        if self._pipeline:
            self._resolve_all()
            done = done or "applied"
        return done

    def _recover(self) -> str | None:
        """Overlap: finishes a step whose dispatch or advance raised; steps in
        flight that ran stay in flight (a normal state).
        """  # noqa: D205
        unadvanced = bool(self._pipeline) and (
            self._pipeline[-1][0] is not self.scheduler.last_applied
        )
        if self._inflight is None and not unadvanced:
            return None
        if any_deleted(self.pools):
            # Steps in flight are lost with the pools: their tokens too.
            self.pools = self.plan.allocate()
            self.scheduler.recompute_all()
            self._pipeline.clear()
            self._prev_tokens = jnp.zeros(self._width, jnp.int32)
            self._inflight = None
            return "recomputed"
        if unadvanced:
            self.scheduler.advance(self._pipeline[-1][0])  # it ran
        if self._inflight is not None:
            self._dispatch_ahead(self._inflight)
            return "rerun"
        return "applied"

    def run(
        self,
        requests: Iterable[Request] = (),
        *,
        on_token: Callable[[Request, int], None] | None = None,
    ) -> list[Request]:
        """Submits `requests` and serves until none is left; returns them.

        Rejected requests come back with ``status`` REJECTED and a
        ``reject_reason``; the others with their ``output``. `on_token(req,
        token)` is called for every token as it is sampled (streaming). After
        an exception, ``run()`` again resumes the step in flight and serves
        the rest.
        """
        requests = list(requests)
        self._on_token = on_token
        try:
            for req in requests:
                self.submit(req)
            self.resume()
            while self.has_unfinished:
                self.step()
        finally:
            self._on_token = None
        return requests
