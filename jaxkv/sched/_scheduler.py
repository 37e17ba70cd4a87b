"""Continuous batching with admission, preemption and prefix caching.

The scheduler decides, each step, which requests compute how many tokens,
and holds their blocks through a :class:`KVCacheManager`; it knows nothing of
the model. Its output, a :class:`ScheduledStep`, is the
:class:`StepArrays` that :meth:`StepMetadataBuilder.prepare` takes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence

from jaxkv._util import (
    check_non_negative_int,
    check_positive_int,
    checks_own_arguments,
)
from jaxkv.plan import KVCachePlan
from jaxkv.sched._apply import StepApplier
from jaxkv.sched._host_tier import HostKVCache
from jaxkv.sched._ledger import StepLedger
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._metrics import (
    PrefixCacheStats,
    SchedulerStats,
    SpecDecodingCounter,
)
from jaxkv.sched._planner import StepPlanner
from jaxkv.sched._request import (
    Request,
    RequestStatus,
    as_python_ints,
)
from jaxkv.sched._scheduled import ScheduledStep

MAX_REJECTED_KEPT = 1024  # Scheduler.rejected keeps the latest this many


class Scheduler:
    """Continuous batching over a :class:`KVCacheManager`.

    Each :meth:`schedule` gives running requests their next tokens, then
    admits waiting requests after their longest prefix-cache hit
    (:class:`StepPlanner`); a request whose blocks run out is preempted: its
    blocks go back and it waits at the front, to be recomputed from its
    prompt and the tokens it generated. :meth:`update` (or :meth:`advance`,
    then :meth:`resolve`) applies the sampled tokens (:class:`StepApplier`).

    :meth:`add_request` rejects, with a reason on the request, what can never
    be served: an empty prompt, ``max_new_tokens < 1``, prompt plus new tokens
    over ``max_model_len``, token ids outside ``[0, vocab_size)``, or more
    blocks than the pool holds. Rejection touches no other request.

    With prefix caching and Mamba groups, prefill chunks end on the lcm of
    the block sizes (vLLM's align mode; :meth:`StepPlanner.chunk`).

    Args:
      plan: The model's plan.
      max_num_batched_tokens: Token budget per step (default: the config's).
      max_num_seqs: Requests per step (default: the config's).
      enable_prefix_caching: Reuse cached prefixes.
      vocab_size: Check prompt token ids against it (``None``: no check).
      num_blocks: Blocks to manage (default: the plan's).
      host_blocks: Blocks of a host tier for evicted prefix-cache blocks
        (:class:`HostKVCache`, at ``scheduler.manager.host``; needs prefix
        caching; run ``manager.host.flush(pools)`` before each step).
      host: A host tier of your own instead (see :class:`KVCacheManager`).
      policy: ``"fcfs"`` (default): requests are served in arrival order and
        the latest admitted is preempted first. ``"priority"``: the waiting
        queue is ordered by ``(priority, arrival_time)`` (lower first) and the
        running request with the largest is preempted first, even one
        already given tokens this step (vLLM's ``SchedulingPolicy``).
      scheduler_reserve_full_isl: Admit a waiting request only when the free
        blocks hold its whole prompt (after its prefix-cache hit), not just
        its first chunk (vLLM's option of that name, on by default): no
        request is admitted only to be preempted while its prompt is
        prefilled. ``req.wait_reason`` says what held the head of the queue.
      enable_kv_cache_events: The manager keeps vLLM's KV-cache events
        (``scheduler.manager.take_events()``; see :class:`KVCacheManager`).
      num_lookahead_tokens: Slots held past the step's tokens of every
        request scheduled, decoding, admitted or running a prefill chunk,
        within ``max_model_len`` (vLLM's ``num_lookahead_tokens`` as its
        ``allocate_slots`` holds them: a draft model that writes its own K/V
        there, EAGLE-style).

    Speculative decoding: after a step, set ``req.spec_token_ids`` to the
    drafts for a decoding request; the next step computes its last token and
    as many drafts as fit (the budget, ``max_new_tokens``, ``max_model_len``)
    and samples at each (``step.spec_token_ids`` says which; the logits come
    ``cu_num_logits``-delimited, as vLLM's). Give :meth:`update` the tokens
    each request accepted: the drafts your rejection sampler kept, then the
    token it sampled after them; the slots of rejected drafts are given back.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
      >>> s = jaxkv.Scheduler(plan, max_num_batched_tokens=64)
      >>> s.add_request(jaxkv.Request("a", prompt=[1] * 100, max_new_tokens=2))
      True
      >>> s.add_request(jaxkv.Request("b", prompt=[1] * 5000, max_new_tokens=2))
      False
      >>> s.rejected[0].reject_reason
      'prompt (5000 tokens) + max_new_tokens (2) > max_model_len (4096)'
      >>> step = s.schedule()
      >>> [(r.req_id, n) for r, n in step.batch], step.seq_lens.tolist()
      ([('a', 64)], [64])
    """

    @checks_own_arguments
    def __init__(
        self,
        plan: KVCachePlan,
        *,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool = False,
        vocab_size: int | None = None,
        num_blocks: int | None = None,
        host_blocks: int = 0,
        host: HostKVCache | None = None,
        policy: str = "fcfs",
        scheduler_reserve_full_isl: bool = True,
        enable_kv_cache_events: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Creates the block manager; no requests yet."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(
                f"Scheduler: policy must be 'fcfs' or 'priority', got {policy!r}."
            )
        self.policy = policy
        self.num_lookahead_tokens = check_non_negative_int(
            "Scheduler", "num_lookahead_tokens", num_lookahead_tokens
        )
        self.scheduler_reserve_full_isl = bool(scheduler_reserve_full_isl)
        cfg = plan.runner_config
        self.manager = KVCacheManager(
            plan,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks=num_blocks,
            host_blocks=host_blocks,
            host=host,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        # Given limits are checked, never replaced by the config's (0 is not
        # "the default").
        self.max_num_batched_tokens = _within_config(
            "max_num_batched_tokens", max_num_batched_tokens, cfg.max_num_batched_tokens
        )
        self.max_num_seqs = _within_config(
            "max_num_seqs", max_num_seqs, cfg.max_num_seqs
        )
        self.max_model_len = cfg.max_model_len
        self.vocab_size = (
            None
            if vocab_size is None
            else check_positive_int("Scheduler", "vocab_size", vocab_size)
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # The latest rejections (bounded: a long-lived server keeps no more);
        # stats["rejected"] counts them all.
        self.rejected: deque[Request] = deque(maxlen=MAX_REJECTED_KEPT)
        # Which step may be applied next, and how far the steps in flight are.
        self.ledger = StepLedger()
        self._ids: set[str] = set()
        # Admission order, the last tie-break of the priority order.
        self._arrivals: dict[str, int] = {}
        self._num_arrivals = 0
        # With prefix caching and Mamba groups, prefill chunks end where every
        # group's blocks end (the lcm of the block sizes), so a hit there finds
        # full attention blocks and the Mamba state after them.
        has_mamba = any(self.manager.is_mamba)
        self.align = (
            math.lcm(*self.manager.block_sizes)
            if enable_prefix_caching and has_mamba
            else 0
        )
        # Counters: steps scheduled, preemptions, prompt tokens computed
        # (recomputation included), tokens taken from the prefix cache.
        self.stats = {
            "steps": 0,
            "preemptions": 0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "rejected": 0,
            "recomputed": 0,
        }
        # Prefix-cache lookups at admission (PrefixCacheStats' fields), and
        # the output tokens of requests already finished.
        self.lookups = dict.fromkeys(
            (f.name for f in dataclasses.fields(PrefixCacheStats)), 0
        )
        self._generated_by_finished = 0
        #: Drafts verified and accepted (``make_stats().spec_decoding_stats``).
        self.spec_decoding = SpecDecodingCounter()
        # Chooses steps; applies them (advance, resolve, update: the two).
        self.planner = StepPlanner(self)
        self.applier = StepApplier(self)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    @property
    def unresolved(self) -> tuple[ScheduledStep, ...]:
        """Steps :meth:`advance` applied that :meth:`resolve` has not, oldest first."""
        return self.ledger.unresolved

    @property
    def last_applied(self) -> ScheduledStep | None:
        """The latest step :meth:`update` finished applying."""
        return self.ledger.applied

    def is_live(self, req: Request) -> bool:
        """Whether `req` is one of this scheduler's running requests."""
        return req.req_id in self._ids and req.status is RequestStatus.RUNNING

    def count_generated(self, n: int) -> None:
        """Counts `n` tokens filled in for a request that finished before them."""
        self._generated_by_finished += n

    def rejection_reason(self, req: Request) -> str | None:
        """Why `req` can never be served, or ``None``.

        Checks every field that enters the scheduler (a bad request never
        fails a later step): the prompt (ints in ``[0, vocab_size)``, or int32
        without one), ``max_new_tokens``, ``stop_token_ids``, ``cache_salt``,
        the model length and the blocks it needs.
        """
        return self.planner.rejection_reason(req)

    @checks_own_arguments
    def add_request(self, req: Request) -> bool:
        """Queues `req`, or rejects it (``req.reject_reason`` says why).

        Raises:
          ValueError: If a live request has the same ``req_id``.
        """
        if not isinstance(req, Request):
            raise TypeError(
                f"add_request: expected a jaxkv.Request, got {type(req).__name__}."
            )
        try:
            live = req.req_id in self._ids
        except TypeError:
            raise TypeError(
                "add_request: req_id must be hashable (a str), got "
                f"{type(req.req_id).__name__} {req.req_id!r}."
            ) from None
        if live:
            raise ValueError(f"add_request: request id {req.req_id!r} is already live.")
        reason = self.rejection_reason(req)
        if reason is not None:
            req.status, req.reject_reason = RequestStatus.REJECTED, reason
            self.rejected.append(req)
            self.stats["rejected"] += 1
            return False
        as_python_ints(req)
        req.status = RequestStatus.WAITING
        req.wait_reason = None
        self._ids.add(req.req_id)
        self._arrived(req)
        self.enqueue(req, front=False)
        return True

    def _arrived(self, req: Request) -> None:
        self._arrivals[req.req_id] = self._num_arrivals
        self._num_arrivals += 1

    def order(self, req: Request) -> tuple[int, float, int]:
        """The priority order (vLLM's): priority, arrival time, then admission."""
        return (int(req.priority), float(req.arrival_time), self._arrivals[req.req_id])

    def enqueue(self, req: Request, *, front: bool) -> None:
        """Puts `req` into the waiting queue.

        At the back (new) or front (preempted) for FCFS, in priority order for
        ``policy="priority"``.
        """
        if self.policy == "priority":
            key = self.order(req)
            at = next(
                (i for i, w in enumerate(self.waiting) if self.order(w) > key),
                len(self.waiting),
            )
            self.waiting.insert(at, req)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def adopt(self, req: Request, *, num_computed: int) -> list[list[int]] | None:
        """Admits `req` with its first `num_computed` tokens computed elsewhere.

        For a KV cache moved with :func:`import_request` (prefill/decode
        disaggregation): holds blocks for them and marks them computed, so the
        next :meth:`schedule` continues from token `num_computed`.

        A request continued after its first sampled tokens carries them in its
        prompt (``prompt + generated``, with ``max_new_tokens`` the rest).
        Import the KV cache into the returned blocks before the next
        :meth:`schedule` (prefix caching registers them as they are held).

        Returns:
          The request's blocks per KV-cache group (:meth:`KVCacheManager.
          blocks_of`), or ``None`` when too few blocks are free now (nothing
          changed).

        Raises:
          TypeError: If `req` is not a :class:`Request`.
          ValueError: If the request would be rejected (the reason), is live
            already, or `num_computed` is not in ``[1, len(prompt) - 1]`` (the
            last prompt token is computed here: its logits are sampled).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
          >>> s = jaxkv.Scheduler(plan)
          >>> r = jaxkv.Request("r", prompt=[1] * 40 + [7], max_new_tokens=2)
          >>> s.adopt(r, num_computed=40)
          [[1, 2], [3, 4], [0, 5]]
          >>> [(q.req_id, n) for q, n in s.schedule().batch], r.num_computed
          ([('r', 1)], 40)
        """
        if not isinstance(req, Request):
            raise TypeError(
                f"adopt: expected a jaxkv.Request, got {type(req).__name__}."
            )
        if req.req_id in self._ids:
            raise ValueError(f"adopt: request id {req.req_id!r} is already live.")
        reason = self.rejection_reason(req)
        if reason is not None:
            raise ValueError(f"adopt: request {req.req_id!r} {reason}.")
        n = num_computed
        if (
            not isinstance(n, int)
            or isinstance(n, bool)
            or not 1 <= n < len(req.prompt)
        ):
            raise ValueError(
                f"adopt: num_computed={n!r} for request {req.req_id!r} must be in "
                f"[1, {len(req.prompt) - 1}] (its last prompt token is computed "
                "here)."
            )
        as_python_ints(req)
        if not self.manager.allocate(req, n):
            return None
        req.num_computed = n
        self.manager.commit(req)
        req.status = RequestStatus.RUNNING
        self._ids.add(req.req_id)
        self._arrived(req)
        self.running.append(req)
        return self.manager.blocks_of(req)

    def make_stats(self) -> SchedulerStats:
        """A snapshot for monitoring (vLLM's ``Scheduler.make_stats``).

        ``.metrics()`` names its figures as vLLM's Prometheus metrics (an
        example: :class:`SchedulerStats`).
        """
        usable = self.manager.num_usable_blocks
        live = [*self.running, *self.waiting]
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=1.0 - self.manager.num_free_blocks / usable,
            prefix_cache_stats=PrefixCacheStats(**self.lookups),
            num_preemptions=self.stats["preemptions"],
            num_generation_tokens=self._generated_by_finished
            + sum(len(r.output) - r.num_pending for r in live),
            num_cached_prompt_tokens=self.stats["cached_tokens"],
            num_rejected_reqs=self.stats["rejected"],
            num_steps=self.stats["steps"],
            spec_decoding_stats=self.spec_decoding.stats(),
        )

    def schedule(self) -> ScheduledStep:
        """Picks this step's requests and tokens and holds their blocks.

        A step scheduled but never applied (its device step failed before it
        ran) is superseded: its blocks stay held and the new step recomputes
        its tokens.

        Raises:
          RuntimeError: If :meth:`update` of the latest step raised midway
            (finish it with ``update(step, tokens)`` first).
        """
        return self.planner.schedule()

    @checks_own_arguments
    def schedule_decode(self, num_steps: int) -> ScheduledStep | None:
        """A step of `num_steps` decode iterations on the device, or ``None``.

        A step of `num_steps` decode iterations on the device (multi-step
        decoding, as vLLM's ``num_scheduler_steps``), or ``None`` when the
        batch is not in steady decoding.

        Steady decoding: nothing waiting, every running request one token from
        its end (its last token known, or pending from a multi-step step
        :meth:`advance` applied, never from an ordinary one), the batch
        within ``max_num_seqs`` and the token budget, and no Mamba prefix
        caching (whose states are kept at block boundaries). Each request gets
        its blocks for ``k = min(num_steps, max_new_tokens - len(output))``
        tokens now; the device computes them one iteration at a time, each
        sampled token the next iteration's input, and :meth:`update`
        takes up to ``k`` tokens per request (a stop token ends it; what was
        computed after it is dropped with its blocks). When the blocks do not
        fit, ``None`` (what was allocated stays held for the next tokens:
        :meth:`schedule` runs as usual, preempting as it needs).

        The step is the ordinary decode step of its first iteration
        (``builder.prepare`` takes it) with ``num_steps``, ``step_slots``
        and ``steps_per_request`` set. To schedule the next block while this
        one runs, apply it with :meth:`advance` instead and fill its
        tokens later with :meth:`resolve`.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
          >>> s = jaxkv.Scheduler(plan)
          >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=6))
          >>> s.update(s.schedule(), [5])  # the prefill samples the first token
          []
          >>> step = s.schedule_decode(4)
          >>> step.num_steps, step.steps_per_request.tolist(), step.positions.tolist()
          (4, [4], [3])
          >>> s.update(step, [[1, 2, 3, 4]]), s.running[0].output
          ([], [5, 1, 2, 3, 4])
          >>> s.schedule_decode(4).steps_per_request.tolist()  # one token left
          [1]

        Raises:
          ValueError: If `num_steps` is not an int >= 1.
          RuntimeError: If :meth:`update` of the latest step raised midway.
        """
        return self.planner.schedule_decode(num_steps)

    @checks_own_arguments
    def update(
        self, step: ScheduledStep, sampled_token_ids: Sequence[int | Sequence[int]]
    ) -> list[Request]:
        """Advances the step's requests; returns those that finished.

        Args:
          step: The step :meth:`schedule` returned, after it ran.
          sampled_token_ids: One token per request of ``step.sampled``, in
            order. For a request verifying drafts (``step.spec_token_ids``),
            the tokens it accepts instead, as a list: the drafts kept (a
            prefix of its drafts), then the token sampled after them (1 to
            ``k + 1``); a list of one token stands for that token anywhere.
            For a :meth:`schedule_decode` step, one row per request of
            ``step.batch``: the tokens its iterations sampled (at least its
            ``steps_per_request``; more are ignored), a stop token ending the
            request there (``step.filled_by_iteration`` lists those taken).

        Everything is checked before anything changes, so after a refused
        call (the errors below) the requests and blocks are exactly as before
        and the step can be applied again with good tokens. If applying fails
        midway (a fault inside the block manager, an interrupt), call
        ``update(step, tokens)`` again with the same step: it finishes the
        step, applying no entry twice; :meth:`schedule` refuses until then.
        Requests aborted (:meth:`finish`) since the step was scheduled are
        skipped, their tokens dropped.

        Raises:
          ValueError: If not one token per sampling request comes, a token is
            outside ``[0, vocab_size)`` (int32 without a vocabulary), or the
            step was already applied or is not the latest scheduled one.
          TypeError: If the tokens are not integers (floats, NaN, bools) or
            are traced values.
        """
        return self.applier.update(step, sampled_token_ids)

    def advance(self, step: ScheduledStep) -> None:
        """Applies `step` before its sampled tokens are known.

        Async scheduling, as vLLM's ``async_scheduling``: the next step can
        be scheduled while this one runs on the device.

        Each sampling request gets a placeholder output token
        (``-(k + 1)`` for the ``k``-th of ``step.sampled``; a decode of it
        in the next step reads ``next_tokens[k]`` on the device) and
        ``num_pending`` counts it; blocks are committed, and requests that
        reach ``max_new_tokens`` finish now (their blocks go back).
        :meth:`resolve` fills the tokens, in the order steps were advanced;
        a stop token found then ends its request, and the next step's work
        for it (already scheduled) is dropped. Prefix-cache blocks are only
        hashed once every token in them is known. A :meth:`schedule_decode`
        step is advanced the same way, each request getting its
        ``steps_per_request`` placeholders (the last one is the next step's
        input: ``tokens[num_steps - 1][k]`` of this step, read on the device).
        A step verifying drafts (``step.spec_token_ids``) changes nothing
        here: the tokens it accepts decide how far its requests got, so
        :meth:`schedule` refuses until :meth:`resolve` has them.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
          >>> s = jaxkv.Scheduler(plan)
          >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=3))
          >>> first = s.schedule(); s.advance(first)
          >>> second = s.schedule(); second.token_ids.tolist()  # next_tokens[0]
          [-1]
          >>> s.advance(second); s.running[0].output
          [-1, -1]
          >>> s.resolve(first, [5]), s.resolve(second, [6]), s.running[0].output
          ([], [], [5, 6])

        Raises:
          RuntimeError: If :meth:`update` of the latest step raised midway.
          ValueError: If `step` is not the latest scheduled one, or was
            already applied.
        """
        self.ledger.check_not_midway("advance")
        self.applier.check_latest(step, "advance")
        self.applier.advance(step, finish_early=True)

    @checks_own_arguments
    def resolve(
        self,
        step: ScheduledStep,
        sampled_token_ids: Sequence[int] | Sequence[Sequence[int]],
    ) -> list[Request]:
        """Fills the tokens of the oldest step :meth:`advance` applied.

        Returns the requests now complete (finished, no token pending).

        The tokens are shaped as for :meth:`update`: one per sampling request,
        or for a :meth:`schedule_decode` step one row per request. A request
        whose token is a stop token finishes here: the output ends at it, and
        what a later advanced step computed for it is dropped. Tokens are
        checked before anything changes, as in :meth:`update`.

        Raises:
          ValueError: If `step` is not the oldest unresolved one, or the
            tokens are not one valid id per request of ``step.sampled``.
        """
        self.ledger.check_not_midway("resolve")
        self.ledger.check_oldest(step)
        rows = self.applier.checked("resolve", step, sampled_token_ids)
        return self.applier.resolve(step, rows)

    def resize(self, plan: KVCachePlan) -> None:
        """Schedules over `plan`'s blocks: the same model, another ``num_blocks``.

        Every request keeps its blocks and the prefix cache its entries
        (:meth:`KVCacheManager.resize`); the pools are the caller's to copy
        (:meth:`jaxkv.ServingLoop.resize` does). Not while a step is midway.

        Example:
          >>> import jaxkv
          >>> cfg = jaxkv.tiny_hybrid_config()
          >>> s = jaxkv.Scheduler(jaxkv.make_plan(cfg, num_blocks=8))
          >>> s.resize(jaxkv.make_plan(cfg, num_blocks=32))
          >>> s.manager.num_usable_blocks
          31
        """
        self.ledger.check_not_midway("resize")
        self.manager.resize(plan)

    def recompute_all(self) -> list[Request]:
        """Forgets what the KV cache held: every running request is requeued.

        Each goes back to the front of the waiting queue, to be recomputed
        from its prompt and the tokens it generated; the prefix cache is
        emptied and the latest scheduled step can no longer be applied.

        For a device step that failed after its donated pools were consumed
        (the cache's contents are gone): allocate new pools, call this, and
        schedule again. Returns the requests requeued, in queue order.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
          >>> s = jaxkv.Scheduler(plan)
          >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=2))
          >>> s.update(s.schedule(), [5])
          []
          >>> [r.req_id for r in s.recompute_all()], s.waiting[0].num_computed
          (['a'], 0)
        """
        self.ledger.check_not_midway("recompute_all")
        # Tokens on the device are lost: placeholders go; requests advance()
        # finished before their last token was read are live (and counted) again.
        for req in self.ledger.forget():
            if req.num_pending:
                self._generated_by_finished -= len(req.output) - req.num_pending
                self.running.append(req)
                self._ids.add(req.req_id)
                self._arrived(req)
        for req in [*self.running, *self.waiting]:
            if req.num_pending:
                del req.output[len(req.output) - req.num_pending :]
                req.num_pending = 0
        requeued = []
        while self.running:
            req = self.running.pop()
            self.manager.free(req)
            req.num_computed = 0
            req.status = RequestStatus.WAITING
            self.enqueue(req, front=True)
            requeued.append(req)
        self.manager.reset_prefix_cache()
        self.stats["recomputed"] += len(requeued)
        return requeued[::-1]

    def finish(self, req: Request) -> None:
        """Frees `req`'s blocks and forgets it (finished or aborted).

        Output tokens still pending on the device are dropped.
        """
        self.retire(req, keep_pending=False)

    def retire(
        self, req: Request, *, keep_pending: bool, keep_blocks: bool = False
    ) -> None:
        """Finishes `req`, keeping its pending tokens or blocks if asked.

        :meth:`finish` drops both; a step applied before its tokens are read
        keeps them, and a multi-step decode its blocks until they are cached.
        """
        if req.num_pending and not keep_pending:
            del req.output[len(req.output) - req.num_pending :]
            req.num_pending = 0
        if not keep_blocks:
            self.manager.free(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._ids.discard(req.req_id)
        if req.req_id in self._arrivals:
            self._generated_by_finished += len(req.output) - req.num_pending
        self._arrivals.pop(req.req_id, None)
        req.status = RequestStatus.FINISHED


def _within_config(name: str, value: object, limit: int) -> int:
    """A step budget: the config's `limit` by default, never above it.

    The step buffers and buckets (:class:`StepMetadataBuilder`) are sized to
    the config's limits: a larger budget would schedule steps no program can
    take (refused when prepared, every time).
    """
    if value is None:
        return limit
    value = check_positive_int("Scheduler", name, value)
    if value > limit:
        raise ValueError(
            f"Scheduler: {name}={value} is above the config's {name}={limit} "
            "(the step buffers and buckets are sized to it); give at most "
            f"{limit}, or raise it in the RunnerConfig."
        )
    return value
