"""Continuous batching with admission, preemption and prefix caching.

The scheduler decides, each step, which requests compute how many tokens,
and holds their blocks through a :class:`KVCacheManager`; it knows nothing of
the model. Its output, a :class:`ScheduledStep`, is the
:class:`StepArrays` that :meth:`StepMetadataBuilder.prepare` takes.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from jaxkv._util import check_positive_int
from jaxkv.plan import KVCachePlan
from jaxkv.sched._host_tier import HostKVCache
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._outcomes import StepOutcomes
from jaxkv.sched._request import Request, RequestStatus, request_problem
from jaxkv.sched._scheduled import ScheduledStep, scheduled_step

MAX_REJECTED_KEPT = 1024  # Scheduler.rejected keeps the latest this many


class Scheduler(StepOutcomes):
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
      host_blocks: Blocks of a host tier for evicted prefix-cache blocks
        (:class:`HostKVCache`, at ``scheduler.manager.host``; needs prefix
        caching; run ``manager.host.flush(pools)`` before each step).
      host: A host tier of your own instead (see :class:`KVCacheManager`).

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
        host_blocks: int = 0,
        host: HostKVCache | None = None,
    ) -> None:
        """Creates the block manager; no requests yet."""
        cfg = plan.runner_config
        self.manager = KVCacheManager(
            plan,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks=num_blocks,
            host_blocks=host_blocks,
            host=host,
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
        problem = request_problem(req, vocab_size=self.vocab_size)
        if problem is not None:
            return problem
        total = len(req.prompt) + int(req.max_new_tokens)
        if total > self.max_model_len:
            return (
                f"prompt ({len(req.prompt)} tokens) + max_new_tokens "
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

    def adopt(self, req: Request, *, num_computed: int) -> list[list[int]] | None:
        """Admits `req` with its first `num_computed` tokens computed elsewhere
        (a KV cache moved with :func:`import_request`: prefill/decode
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
        """  # noqa: D205
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
        req.prompt = [int(t) for t in req.prompt]
        req.stop_token_ids = tuple(int(t) for t in req.stop_token_ids)
        req.max_new_tokens = int(req.max_new_tokens)
        if not self.manager.allocate(req, n):
            return None
        req.num_computed = n
        self.manager.commit(req)
        req.status = RequestStatus.RUNNING
        self._ids.add(req.req_id)
        self.running.append(req)
        return self.manager.blocks_of(req)

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
        self._latest = scheduled_step(batch, preempted, self.manager.step_blocks(batch))
        return self._latest

    def schedule_decode(self, num_steps: int) -> ScheduledStep | None:
        """A step of `num_steps` decode iterations on the device (multi-step
        decoding, as vLLM's ``num_scheduler_steps``), or ``None`` when the
        batch is not in steady decoding.

        Steady decoding: nothing waiting, every running request one token from
        its end (its last token known, or pending from a multi-step step
        :meth:`advance_decode` applied, never from an ordinary one), the batch
        within ``max_num_seqs`` and the token budget, and no Mamba prefix
        caching (whose states are kept at block boundaries). Each request gets
        its blocks for ``k = min(num_steps, max_new_tokens - len(output))``
        tokens now; the device computes them one iteration at a time, each
        sampled token the next iteration's input, and :meth:`update_decode`
        takes up to ``k`` tokens per request (a stop token ends it; what was
        computed after it is dropped with its blocks). When the blocks do not
        fit, ``None`` (what was allocated stays held for the next tokens:
        :meth:`schedule` runs as usual, preempting as it needs).

        The step is the ordinary decode step of its first iteration
        (``builder.prepare`` takes it) with ``num_steps``, ``step_slots``
        and ``steps_per_request`` set. To schedule the next block while this
        one runs, apply it with :meth:`advance_decode` instead and fill its
        tokens later with :meth:`resolve_decode`.

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
          >>> s.update_decode(step, [[1, 2, 3, 4]]), s.running[0].output
          ([], [5, 1, 2, 3, 4])
          >>> s.schedule_decode(4).steps_per_request.tolist()  # one token left
          [1]

        Raises:
          ValueError: If `num_steps` is not an int >= 1.
          RuntimeError: If :meth:`update` of the latest step raised midway.
        """  # noqa: D205
        if (
            not isinstance(num_steps, int)
            or isinstance(num_steps, bool)
            or num_steps < 1
        ):
            raise ValueError(
                f"schedule_decode: num_steps must be an int >= 1, got {num_steps!r}."
            )
        if self._applying is not None:
            raise RuntimeError(
                "schedule_decode: update() of the latest step raised midway; call "
                "update(step, tokens) again with the same step to finish it."
            )
        running = self.running
        # After advance_decode() the tokens of blocks in flight are placeholders
        # (pending), their last one read on the device; after advance() of an
        # ordinary step, not steady.
        if (
            self._align
            or self.waiting
            or any(s.num_steps == 1 for s in self._unresolved)
            or not running
            or len(running) > min(self.max_num_seqs, self.max_num_batched_tokens)
            or any(r.num_computed != r.num_tokens - 1 for r in running)
        ):
            return None
        counts = [min(num_steps, r.max_new_tokens - len(r.output)) for r in running]
        for req, k in zip(running, counts, strict=True):
            if not self.manager.allocate(req, k):
                return None
        batch = [(r, 1) for r in running]
        step = scheduled_step(batch, [], self.manager.step_blocks(batch))
        ahead = self.manager.step_blocks(list(zip(running, counts, strict=True)))
        k_arr = np.asarray(counts, np.int32)
        starts = np.concatenate([[0], np.cumsum(k_arr)[:-1]]).astype(np.int64)
        it = np.arange(num_steps)[:, None]
        live = it < k_arr[None, :]
        at = np.where(live, starts[None, :] + it, 0)
        step.step_slots = [
            np.where(live, slots[at], -1).astype(np.int32)
            for slots in ahead.slot_mappings
        ]
        step.steps_per_request = k_arr
        step.num_steps = num_steps
        self.stats["steps"] += 1
        self._latest = step
        return step
