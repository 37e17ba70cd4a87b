"""Continuous batching with admission, preemption and prefix caching.

The scheduler decides, each step, which requests compute how many tokens,
and holds their blocks through a :class:`KVCacheManager`; it knows nothing of
the model. Its output, a :class:`ScheduledStep`, is the
:class:`StepArrays` that :meth:`StepMetadataBuilder.prepare` takes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxkv._util import check_positive_int, host_int_array
from jaxkv.cache import KVCachePlan
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._request import Request, RequestStatus
from jaxkv.sched._scheduled import ScheduledStep, sampled_token_indices

_INT32_LIMIT = 2**31  # token ids travel to the device as int32
MAX_REJECTED_KEPT = 1024  # Scheduler.rejected keeps the latest this many


class Scheduler:
    """Continuous batching over a :class:`KVCacheManager`.

    Each :meth:`schedule` gives running requests their next tokens (a decode
    token, or the next prefill chunk) in arrival order under the token budget,
    then admits waiting requests while blocks and budget last, each starting
    after its longest prefix-cache hit. When a running request's blocks cannot
    be allocated, the most recently admitted running request is preempted: its
    blocks go back (cached ones stay reusable) and it waits at the front of
    the queue to be recomputed from its prompt and the tokens it has
    generated; no other request is disturbed. :meth:`update` takes the sampled
    tokens, commits the step's blocks and frees finished requests.

    :meth:`add_request` rejects, with a reason on the request, what can never
    be served: an empty prompt, ``max_new_tokens < 1``, prompt plus new tokens
    over ``max_model_len``, token ids outside ``[0, vocab_size)``, or more
    blocks than the pool holds. Rejection touches no other request.

    With prefix caching on a model with Mamba groups, prefill chunks end
    where every group's blocks end (the lcm of the block sizes), the last one
    at the last boundary before the final token, so the Mamba state there is
    kept for later hits (vLLM's align mode; see :meth:`_chunk`).

    Args:
      plan: The model's plan.
      max_num_batched_tokens: Token budget per step (default: the config's).
      max_num_seqs: Requests per step (default: the config's).
      enable_prefix_caching: Reuse cached prefixes.
      vocab_size: Check prompt token ids against it (``None``: no check).
      num_blocks: Blocks to manage (default: the plan's).

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

    def __init__(
        self,
        plan: KVCachePlan,
        *,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool = False,
        vocab_size: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """Creates the block manager; no requests yet."""
        cfg = plan.runner_config
        self.manager = KVCacheManager(
            plan, enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks
        )
        # Given limits are checked, never replaced by the config's (0 is not
        # "the default").
        self.max_num_batched_tokens = (
            cfg.max_num_batched_tokens
            if max_num_batched_tokens is None
            else check_positive_int(
                "Scheduler", "max_num_batched_tokens", max_num_batched_tokens
            )
        )
        self.max_num_seqs = (
            cfg.max_num_seqs
            if max_num_seqs is None
            else check_positive_int("Scheduler", "max_num_seqs", max_num_seqs)
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
        self._applied: ScheduledStep | None = None
        self._latest: ScheduledStep | None = None
        self._applying: ScheduledStep | None = None
        self._ids: set[str] = set()
        # Steps advance() applied whose tokens resolve() has not filled yet.
        self._unresolved: deque[ScheduledStep] = deque()
        # With prefix caching and Mamba groups, prefill chunks end where every
        # group's blocks end (the lcm of the block sizes), so a hit there finds
        # full attention blocks and the Mamba state after them.
        has_mamba = any(self.manager.is_mamba)
        self._align = (
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

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    @property
    def unresolved(self) -> tuple[ScheduledStep, ...]:
        """Steps :meth:`advance` applied that :meth:`resolve` has not, oldest first."""
        return tuple(self._unresolved)

    @property
    def last_applied(self) -> ScheduledStep | None:
        """The latest step :meth:`update` finished applying."""
        return self._applied

    def rejection_reason(self, req: Request) -> str | None:
        """Why `req` can never be served, or ``None``.

        Checks every field that enters the scheduler, so a bad request is
        rejected here and never fails a later step: the prompt (a sequence of
        ints in ``[0, vocab_size)``, or within int32 without a vocabulary),
        ``max_new_tokens``, ``stop_token_ids``, ``cache_salt``, the model
        length and the blocks it needs.
        """
        try:
            ids = np.asarray(req.prompt)
        except (TypeError, ValueError) as e:
            return f"prompt must be a sequence of token ids ({e})"
        if isinstance(req.prompt, str | bytes) or ids.ndim != 1:
            return (
                "prompt must be a flat sequence of token ids, got "
                f"{type(req.prompt).__name__} of shape {ids.shape}"
            )
        if ids.size == 0:
            return "empty prompt"
        if not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
            return f"prompt token ids must be ints, got dtype {ids.dtype}"
        top = _INT32_LIMIT if self.vocab_size is None else self.vocab_size
        if ids.min() < 0 or ids.max() >= top:
            return (
                f"prompt token ids must be in [0, {top}), got "
                f"[{ids.min()}, {ids.max()}]"
            )
        if isinstance(req.max_new_tokens, bool):
            return f"max_new_tokens must be a positive int, got {req.max_new_tokens!r}"
        stops = req.stop_token_ids
        if isinstance(stops, str | bytes) or not isinstance(stops, Sequence | set):
            return (
                "stop_token_ids must be a sequence of ints, got "
                f"{type(stops).__name__} {stops!r}"
            )
        if not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in stops
        ):
            return f"stop_token_ids must be ints, got {list(stops)!r}"
        if req.cache_salt is not None and not isinstance(req.cache_salt, str):
            return (
                "cache_salt must be a str or None, got "
                f"{type(req.cache_salt).__name__} {req.cache_salt!r}"
            )
        if req.status is not RequestStatus.WAITING or req.num_computed:
            return (
                f"the request was already served (status {req.status.value}, "
                f"{req.num_computed} tokens computed); submit a new Request"
            )
        if req.output:
            return (
                f"the request already has {len(req.output)} output tokens; submit a "
                "new Request"
            )
        if (
            not isinstance(req.max_new_tokens, int | np.integer)
            or req.max_new_tokens < 1
        ):
            return f"max_new_tokens must be a positive int, got {req.max_new_tokens!r}"
        total = len(ids) + int(req.max_new_tokens)
        if total > self.max_model_len:
            return (
                f"prompt ({len(ids)} tokens) + max_new_tokens "
                f"({req.max_new_tokens}) > max_model_len ({self.max_model_len})"
            )
        need = self.manager.max_blocks_needed(total, self.max_num_batched_tokens)
        if need > self.manager.num_usable_blocks:
            return (
                f"needs up to {need} KV-cache blocks at once, the pool holds "
                f"{self.manager.num_usable_blocks}"
            )
        return None

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
        # Stored as Python ints: a tuple or NumPy prompt serves like a list.
        req.prompt = [int(t) for t in req.prompt]
        req.stop_token_ids = tuple(int(t) for t in req.stop_token_ids)
        req.max_new_tokens = int(req.max_new_tokens)
        req.status = RequestStatus.WAITING
        self._ids.add(req.req_id)
        self.waiting.append(req)
        return True

    def _chunk(self, req: Request, budget: int, start: int) -> int:
        """Tokens `req` computes from `start` under `budget`.

        With Mamba prefix caching, a prefill chunk ends on a block boundary (the
        lcm of the groups' block sizes) and never runs past the last boundary a
        later request can hit (``(len(tokens) - 1) // lcm * lcm``, the last
        token being always recomputed): vLLM's ``_mamba_block_aligned_split``
        in align mode, a prompt's only chunk included. The result may be 0 (a
        chunk that would end before the next boundary): the request waits.
        """
        tokens = req.num_tokens
        n = min(tokens - start, budget)
        bs = self._align
        prefill_end = max(len(req.prompt), tokens - 1)
        if not bs or start >= prefill_end:
            return n
        end = start + n
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.max_num_batched_tokens:
                end = aligned
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            (tokens - 1) // bs * bs,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _preempt(self, req: Request) -> None:
        self.manager.free(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledStep:
        """Picks this step's requests and tokens and holds their blocks.

        A step scheduled but never applied (its device step failed before it
        ran) is superseded: its blocks stay held and the new step recomputes
        its tokens.

        Raises:
          RuntimeError: If :meth:`update` of the latest step raised midway
            (finish it with ``update(step, tokens)`` first).
        """
        if self._applying is not None:
            raise RuntimeError(
                "schedule: update() of the latest step raised midway; call "
                "update(step, tokens) again with the same step to finish it."
            )
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        align = self._align
        while i < len(self.running) and budget and len(batch) < self.max_num_seqs:
            req = self.running[i]
            n = (
                self._chunk(req, budget, req.num_computed)
                if align
                else min(req.num_tokens - req.num_computed, budget)
            )
            if not n:  # an aligned chunk does not fit this step's budget
                i += 1
                continue
            while not self.manager.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.append((req, n))
                budget -= n
                i += 1
        while (
            self.waiting and budget and len(batch) < self.max_num_seqs and not preempted
        ):
            req = self.waiting[0]
            hit = self.manager.find_cache_hit(req)
            n = self._chunk(req, budget, hit)
            if not n or not self.manager.allocate(req, n, num_cached=hit):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.stats["cached_tokens"] += hit
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        if not batch and self.waiting and not self.running:
            # Admission guarantees a request fits alone: only held (leaked)
            # blocks can block it. Fail loudly rather than spin.
            raise RuntimeError(
                f"Scheduler: request {self.waiting[0].req_id!r} cannot be scheduled "
                f"with nothing running ({self.manager.num_free_blocks} of "
                f"{self.manager.num_usable_blocks} blocks free): blocks were not "
                "given back."
            )
        # Decodes first (the order backends with a decode threshold expect).
        prefill = [
            max(0, min(len(r.prompt), r.num_computed + n) - r.num_computed)
            for r, n in batch
        ]
        if any(prefill):
            batch.sort(key=lambda rn: rn[0].num_computed < len(rn[0].prompt))
        self.stats["steps"] += bool(batch)
        self.stats["prefill_tokens"] += sum(prefill)
        self._latest = self._scheduled_step(batch, preempted)
        return self._latest

    def _scheduled_step(
        self, batch: list[tuple[Request, int]], preempted: list[Request]
    ) -> ScheduledStep:
        """The step and its host arrays."""
        q_lens = np.fromiter((n for _, n in batch), np.int32, len(batch))
        starts = np.fromiter((r.num_computed for r, _ in batch), np.int32, len(batch))
        qsl = np.zeros(len(batch) + 1, np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        blocks = self.manager.step_blocks(batch)
        samples = sampled_token_indices(batch)
        token_ids: list[int] = []
        for r, n in batch:
            if n == 1:  # a decode: one token, no list
                p, c = len(r.prompt), r.num_computed
                token_ids.append(r.prompt[c] if c < p else r.output[c - p])
            else:
                token_ids += r.token_range(r.num_computed, r.num_computed + n)
        return ScheduledStep(
            batch=batch,
            preempted=preempted,
            query_start_loc=qsl,
            seq_lens=starts + q_lens,
            # Each token's position: its request's start plus its rank in it.
            positions=(
                np.arange(num_tokens, dtype=np.int32)
                + np.repeat(starts - qsl[:-1], q_lens)
            ).astype(np.int32),
            block_tables=blocks.block_tables,
            slot_mappings=blocks.slot_mappings,
            logits_indices=np.asarray(samples, np.int32) if samples else None,
            # Sampled tokens before each request's end.
            cu_num_logits=np.concatenate(
                [[0], np.searchsorted(samples, qsl[1:])]
            ).astype(np.int32),
            token_ids=np.asarray(token_ids, np.int32),
            is_prefilling=starts
            < np.fromiter((len(r.prompt) for r, _ in batch), np.int32, len(batch)),
        )

    def update(
        self, step: ScheduledStep, sampled_token_ids: Sequence[int]
    ) -> list[Request]:
        """Advances the step's requests; returns those that finished.

        Args:
          step: The step :meth:`schedule` returned, after it ran.
          sampled_token_ids: One token per request of ``step.sampled``, in
            order.

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
        if self._unresolved:
            raise RuntimeError(
                f"update: {len(self._unresolved)} advanced steps are not resolved; "
                "with advance() every step is finished by resolve()."
            )
        if step is self._applied:
            raise ValueError(
                "update: this step was already applied (a retry?); schedule() the "
                "next step instead."
            )
        if step is not self._latest:
            raise ValueError(
                "update: the step is not the one schedule() returned last; apply "
                "each scheduled step once, in order."
            )
        # Validated before anything changes: a bad token leaves every request
        # and block as it was.
        tokens_in = self._checked_tokens("update", step, sampled_token_ids)
        # Each entry is applied from the counts recorded when it was scheduled
        # (set, not added; a token appended once; commit() frees only what the
        # count says): if something fails midway (a fault in the manager, an
        # interrupt), update() again with the same step finishes it, applying
        # nothing twice. Requests aborted since schedule() are skipped (their
        # token dropped).
        self._applying = step
        tokens = iter(int(t) for t in tokens_in)
        live = []
        for (req, n), (computed, outputs) in zip(step.batch, step._before, strict=True):
            sample = computed + n == len(req.prompt) + outputs
            token = next(tokens) if sample else None
            if req.req_id not in self._ids or req.status is not RequestStatus.RUNNING:
                continue
            live.append(req)
            req.num_computed = computed + n
            if token is not None and len(req.output) == outputs:
                req.output.append(token)
            self.manager.commit(req)
        finished = [req for req in live if req.finished]
        for req in finished:
            self.finish(req)
        self._applied = step
        self._applying = None
        return finished

    def _checked_tokens(
        self, caller: str, step: ScheduledStep, sampled_token_ids: Sequence[int]
    ) -> np.ndarray:
        sampled = step.sampled
        if len(sampled_token_ids) != len(sampled):
            raise ValueError(
                f"{caller}: {len(sampled)} requests sample a token this step "
                f"({[r.req_id for r in sampled][:8]}), got "
                f"{len(sampled_token_ids)} tokens."
            )
        top = _INT32_LIMIT if self.vocab_size is None else self.vocab_size
        tokens_in = (
            host_int_array(sampled_token_ids, f"{caller}: sampled tokens")
            if sampled
            else np.zeros(0, np.int64)
        )
        bad = np.flatnonzero((tokens_in < 0) | (tokens_in >= top))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{caller}: request {sampled[i].req_id!r} sampled token "
                f"{tokens_in[i]}, outside [0, {top})."
            )
        return tokens_in

    # --- async scheduling -------------------------------------------------------

    def advance(self, step: ScheduledStep) -> None:
        """Applies `step` before its sampled tokens are known (async
        scheduling, as vLLM's ``async_scheduling``): the next step can be
        scheduled while this one runs on the device.

        Each sampling request gets a placeholder output token
        (``-(k + 1)`` for the ``k``-th of ``step.sampled``; a decode of it
        in the next step reads ``next_tokens[k]`` on the device) and
        ``num_pending`` counts it; blocks are committed, and requests that
        reach ``max_new_tokens`` finish now (their blocks go back).
        :meth:`resolve` fills the tokens, in the order steps were advanced;
        a stop token found then ends its request, and the next step's work
        for it (already scheduled) is dropped. Prefix-cache blocks are only
        hashed once every token in them is known.

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
        """  # noqa: D205
        if self._applying is not None:
            raise RuntimeError(
                "advance: update() of the latest step raised midway; call "
                "update(step, tokens) again with the same step first."
            )
        if step is self._applied:
            raise ValueError("advance: this step was already applied.")
        if step is not self._latest:
            raise ValueError(
                "advance: the step is not the one schedule() returned last; "
                "advance each scheduled step once, in order."
            )
        sampled = step.sampled
        rank = {id(r): k for k, r in enumerate(sampled)}
        for (req, n), (computed, outputs) in zip(step.batch, step._before, strict=True):
            if req.req_id not in self._ids or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed = computed + n
            k = rank.get(id(req))
            if k is not None and len(req.output) == outputs:
                req.output.append(-(k + 1))
                req.num_pending += 1
            self.manager.commit(req)
            if len(req.output) >= req.max_new_tokens:
                step._early.append(req)
                self._finish(req, keep_pending=True)
        self._applied = step
        self._unresolved.append(step)

    def resolve(
        self, step: ScheduledStep, sampled_token_ids: Sequence[int]
    ) -> list[Request]:
        """Fills the tokens of the oldest step :meth:`advance` applied; returns
        the requests that are now complete (finished, no token pending).

        A request whose token is a stop token finishes here: the output ends
        at it, and what a later advanced step computed for it is dropped.
        Tokens are checked before anything changes, as in :meth:`update`.

        Raises:
          ValueError: If `step` is not the oldest unresolved one, or the
            tokens are not one valid id per request of ``step.sampled``.
        """  # noqa: D205
        if not self._unresolved or step is not self._unresolved[0]:
            raise ValueError(
                "resolve: the step is not the oldest advanced and unresolved one; "
                "resolve steps once each, in the order they were advanced."
            )
        tokens_in = self._checked_tokens("resolve", step, sampled_token_ids)
        done = []
        k = -1
        for (req, n), (computed, outputs) in zip(step.batch, step._before, strict=True):
            if computed + n != len(req.prompt) + outputs:
                continue  # samples nothing this step
            k += 1
            token = int(tokens_in[k])
            if not (
                req.num_pending
                and len(req.output) > outputs
                and req.output[outputs] == -(k + 1)
            ):
                continue  # aborted, recomputed, or ended by an earlier stop token
            req.output[outputs] = token
            req.num_pending -= 1
            step.filled.append((k, req, token))
            if token in req.stop_token_ids:
                del req.output[outputs + 1 :]
                req.num_pending = 0
                if req.status is not RequestStatus.FINISHED:
                    self._finish(req, keep_pending=False)
            if req.status is RequestStatus.FINISHED and not req.num_pending:
                done.append(req)
        self._unresolved.popleft()
        return done

    def recompute_all(self) -> list[Request]:
        """Forgets what the KV cache held: every running request goes back to
        the front of the waiting queue, to be recomputed from its prompt and
        the tokens it generated; the prefix cache is emptied and the latest
        scheduled step can no longer be applied.

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
        """  # noqa: D205
        if self._applying is not None:
            raise RuntimeError(
                "recompute_all: update() of the latest step raised midway; call "
                "update(step, tokens) again first."
            )
        # Tokens still on the device are lost with it: placeholders go, and
        # requests advance() finished before their last token was read are
        # served again.
        for step in self._unresolved:
            for req in step._early:
                if req.num_pending:
                    self.running.append(req)
                    self._ids.add(req.req_id)
        self._unresolved.clear()
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
            self.waiting.appendleft(req)
            requeued.append(req)
        self.manager.reset_prefix_cache()
        self.stats["recomputed"] += len(requeued)
        self._latest = None
        return requeued[::-1]

    def finish(self, req: Request) -> None:
        """Frees `req`'s blocks and forgets it (finished or aborted); output
        tokens still pending on the device are dropped.
        """  # noqa: D205
        self._finish(req, keep_pending=False)

    def _finish(self, req: Request, *, keep_pending: bool) -> None:
        if req.num_pending and not keep_pending:
            del req.output[len(req.output) - req.num_pending :]
            req.num_pending = 0
        self.manager.free(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._ids.discard(req.req_id)
        req.status = RequestStatus.FINISHED
