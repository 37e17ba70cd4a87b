"""Choosing each step's work: which requests compute how many tokens.

:class:`StepPlanner` gives running requests their next tokens (a decode
token and the drafts that fit, or the next prefill chunk) under the token
budget, preempting when blocks run out, then admits waiting requests while
blocks and budget last, each after its longest prefix-cache hit; or, in
steady decoding, a block of decode iterations (:meth:`StepPlanner.
schedule_decode`). It works on its scheduler's queues (:class:`PlanOwner`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from jaxkv._util import host_int_array
from jaxkv.sched._ledger import StepLedger
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._request import (
    INT32_LIMIT,
    Request,
    RequestStatus,
    request_problem,
)
from jaxkv.sched._scheduled import ScheduledStep, scheduled_step


@runtime_checkable
class PlanOwner(Protocol):
    """What choosing a step reads and changes of its scheduler."""

    waiting: deque[Request]
    running: list[Request]
    manager: KVCacheManager
    ledger: StepLedger
    policy: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_lookahead_tokens: int
    scheduler_reserve_full_isl: bool
    vocab_size: int | None
    align: int
    stats: dict[str, int]
    lookups: dict[str, int]

    def order(self, req: Request) -> tuple[int, float, int]:
        """The priority order of `req`."""
        ...

    def enqueue(self, req: Request, *, front: bool) -> None:
        """Puts `req` into the waiting queue."""
        ...


class StepPlanner:
    """Chooses each step of its scheduler (see the module docstring).

    Example:
      >>> import jaxkv
      >>> s = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(),
      ...                                     num_blocks=8))
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1] * 30, max_new_tokens=2))
      >>> s.planner.chunk(s.waiting[0], 16, 0)  # its first chunk under 16 tokens
      16
    """

    def __init__(self, owner: PlanOwner) -> None:
        """Plans steps over `owner`'s queues, blocks and ledger."""
        self.owner = owner

    def rejection_reason(self, req: Request) -> str | None:
        """Why `req` can never be served (see :meth:`Scheduler.rejection_reason`)."""
        o = self.owner
        problem = request_problem(req, vocab_size=o.vocab_size)
        if problem is not None:
            return problem
        total = len(req.prompt) + int(req.max_new_tokens)
        if total > o.max_model_len:
            return (
                f"prompt ({len(req.prompt)} tokens) + max_new_tokens "
                f"({req.max_new_tokens}) > max_model_len ({o.max_model_len})"
            )
        need = o.manager.max_blocks_needed(total, o.max_num_batched_tokens)
        if need > o.manager.num_usable_blocks:
            return (
                f"needs up to {need} KV-cache blocks at once, the pool holds "
                f"{o.manager.num_usable_blocks}"
            )
        return None

    def chunk(self, req: Request, budget: int, start: int) -> int:
        """Tokens `req` computes from `start` under `budget`.

        With Mamba prefix caching, a prefill chunk ends on a block boundary (the
        lcm of the groups' block sizes) and never runs past the last boundary a
        later request can hit (``(len(tokens) - 1) // lcm * lcm``, the last
        token being always recomputed): vLLM's ``_mamba_block_aligned_split``
        in align mode, a prompt's only chunk included. The result may be 0 (a
        chunk that would end before the next boundary): the request waits.
        """
        o = self.owner
        tokens = req.num_tokens
        n = min(tokens - start, budget)
        bs = o.align
        prefill_end = max(len(req.prompt), tokens - 1)
        if not bs or start >= prefill_end:
            return n
        end = start + n
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= o.max_num_batched_tokens:
                end = aligned
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            (tokens - 1) // bs * bs,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _preempt(self, req: Request) -> None:
        o = self.owner
        o.manager.free(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        o.stats["preemptions"] += 1
        o.enqueue(req, front=True)

    def schedule(self) -> ScheduledStep:
        """The next step (see :meth:`Scheduler.schedule`)."""
        o = self.owner
        o.ledger.check_not_midway("schedule")
        o.ledger.check_drafts_resolved("schedule")
        self._check_drafts()
        budget = o.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        spec: dict[str, list[int]] = {}
        i = 0
        align = o.align
        while i < len(o.running) and budget and len(batch) < o.max_num_seqs:
            req = o.running[i]
            decoding = req.num_computed == req.num_tokens - 1
            drafts = self._drafts(req, budget) if decoding else []
            n = (
                1 + len(drafts)
                if decoding
                else self.chunk(req, budget, req.num_computed)
                if align
                else min(req.num_tokens - req.num_computed, budget)
            )
            if not n:  # an aligned chunk does not fit this step's budget
                i += 1
                continue
            lookahead = self._lookahead(req.num_computed + n)
            while not o.manager.allocate(req, n, num_lookahead_tokens=lookahead):
                victim = (
                    max(o.running, key=o.order)
                    if o.policy == "priority"
                    else o.running[-1]
                )
                at = o.running.index(victim)
                del o.running[at]
                if at < i:  # given tokens this step already: take them back
                    i -= 1
                    k = next(k for k, (r, _) in enumerate(batch) if r is victim)
                    budget += batch.pop(k)[1]
                    spec.pop(victim.req_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.append((req, n))
                budget -= n
                i += 1
                if drafts:
                    spec[req.req_id] = drafts
        while o.waiting and budget and len(batch) < o.max_num_seqs and not preempted:
            req = o.waiting[0]
            hit = o.manager.find_cache_hit(req)
            n = self.chunk(req, budget, hit)
            if not n:
                req.wait_reason = (
                    f"its next block-aligned chunk does not fit the {budget} tokens "
                    "left in this step"
                )
                break
            if not o.manager.allocate(
                req,
                n,
                num_cached=hit,
                full_sequence_must_fit=o.scheduler_reserve_full_isl,
                num_lookahead_tokens=self._lookahead(hit + n),
            ):
                req.wait_reason = self._wait_reason(req, n, hit)
                break
            o.waiting.popleft()
            if o.manager.enable_prefix_caching:
                self._count_lookup(req, hit)
            req.wait_reason = None
            req.status = RequestStatus.RUNNING
            o.stats["cached_tokens"] += hit
            o.running.append(req)
            batch.append((req, n))
            budget -= n
        if not batch and o.waiting and not o.running:
            # Admission guarantees a request fits alone: only held (leaked)
            # blocks can block it. Fail loudly rather than spin.
            raise RuntimeError(
                f"Scheduler: request {o.waiting[0].req_id!r} cannot be scheduled "
                f"with nothing running ({o.manager.num_free_blocks} of "
                f"{o.manager.num_usable_blocks} blocks free): blocks were not "
                "given back."
            )
        # Decodes first (the order backends with a decode threshold expect).
        prefill = [
            max(0, min(len(r.prompt), r.num_computed + n) - r.num_computed)
            for r, n in batch
        ]
        if any(prefill):
            batch.sort(key=lambda rn: rn[0].num_computed < len(rn[0].prompt))
        o.stats["steps"] += bool(batch)
        o.stats["prefill_tokens"] += sum(prefill)
        for req, _ in batch:  # drafts are used once, all that fit
            if req.spec_token_ids and req.num_computed == req.num_tokens - 1:
                req.spec_token_ids = []
        return o.ledger.made(
            scheduled_step(batch, preempted, o.manager.step_blocks(batch), spec)
        )

    def _lookahead(self, end: int) -> int:
        """Lookahead slots past a step ending at token `end` (within max_model_len).

        vLLM's ``allocate_slots`` holds ``min(end + num_lookahead_tokens,
        max_model_len)`` slots for every request it schedules: decoding,
        admitted, or running a prefill chunk.
        """
        o = self.owner
        return max(0, min(o.num_lookahead_tokens, o.max_model_len - end))

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The draft tokens of decoding `req` that fit this step.

        Cut to the token budget, ``max_new_tokens`` (the last accepted token
        is sampled) and ``max_model_len``.
        """
        o = self.owner
        k = min(
            len(req.spec_token_ids),
            budget - 1,
            req.max_new_tokens - len(req.output) - 1,
            o.max_model_len - req.num_tokens,
        )
        return [int(t) for t in req.spec_token_ids[: max(k, 0)]]

    def _check_drafts(self) -> None:
        """Refuses bad draft tokens before anything is scheduled."""
        o = self.owner
        top = INT32_LIMIT if o.vocab_size is None else o.vocab_size
        for req in o.running:
            drafts = req.spec_token_ids
            if not drafts:
                continue
            if any(o.manager.is_mamba):
                raise ValueError(
                    f"schedule: request {req.req_id!r} has draft tokens, but the "
                    "model has Mamba groups, whose state cannot be rolled back "
                    "past rejected drafts; speculative decoding needs attention "
                    "layers only."
                )
            if isinstance(drafts, str | bytes) or not isinstance(drafts, Sequence):
                raise TypeError(
                    f"schedule: request {req.req_id!r}: spec_token_ids must be a "
                    f"list of token ids, got {type(drafts).__name__}."
                )
            ids = host_int_array(
                drafts, f"schedule: request {req.req_id!r} spec_token_ids"
            )
            if ids.ndim != 1 or ((ids < 0) | (ids >= top)).any():
                raise ValueError(
                    f"schedule: request {req.req_id!r} spec_token_ids must be token "
                    f"ids in [0, {top}), got {list(drafts)[:8]}."
                )

    def _count_lookup(self, req: Request, hit: int) -> None:
        """Counts an admission's prefix-cache lookup (vLLM's ``record``)."""
        o = self.owner
        prefixes = ("", "preempted_") if req.num_preemptions else ("",)
        for prefix in prefixes:
            o.lookups[prefix + "requests"] += 1
            o.lookups[prefix + "queries"] += req.num_tokens
            o.lookups[prefix + "hits"] += hit

    def _wait_reason(self, req: Request, n: int, hit: int) -> str:
        o = self.owner
        free = o.manager.num_free_blocks
        if o.scheduler_reserve_full_isl and req.num_tokens > hit + n:
            return (
                f"its {req.num_tokens} tokens (from token {hit}) do not fit the "
                f"{free} free blocks (full-prompt admission: "
                "scheduler_reserve_full_isl=True)"
            )
        return f"its first chunk of {n} tokens does not fit the {free} free blocks"

    def schedule_decode(self, num_steps: int) -> ScheduledStep | None:
        """A multi-step decode step (see :meth:`Scheduler.schedule_decode`)."""
        o = self.owner
        if (
            not isinstance(num_steps, int)
            or isinstance(num_steps, bool)
            or num_steps < 1
        ):
            raise ValueError(
                f"schedule_decode: num_steps must be an int >= 1, got {num_steps!r}."
            )
        o.ledger.check_not_midway("schedule_decode")
        running = o.running
        # After advance() the tokens of blocks in flight are placeholders
        # (pending), their last one read on the device; after advance() of an
        # ordinary step, not steady.
        if (
            o.align
            or o.waiting
            or any(s.num_steps == 1 for s in o.ledger.unresolved)
            or not running
            or len(running) > min(o.max_num_seqs, o.max_num_batched_tokens)
            or any(r.num_computed != r.num_tokens - 1 for r in running)
            or any(r.spec_token_ids for r in running)
        ):
            return None
        counts = [min(num_steps, r.max_new_tokens - len(r.output)) for r in running]
        for req, k in zip(running, counts, strict=True):
            if not o.manager.allocate(req, k):
                return None
        batch = [(r, 1) for r in running]
        step = scheduled_step(batch, [], o.manager.step_blocks(batch))
        ahead = o.manager.step_blocks(list(zip(running, counts, strict=True)))
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
        o.stats["steps"] += 1
        return o.ledger.made(step)
