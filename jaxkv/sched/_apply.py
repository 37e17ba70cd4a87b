"""Applying a step: ``advance`` before its tokens are known, ``resolve`` after.

One way to apply a step, whatever its shape: :meth:`StepApplier.advance`
counts the step's tokens as computed, commits its blocks and gives each
sampling request placeholder outputs; :meth:`StepApplier.resolve` fills them
with the sampled tokens (one per request, a row per request of a multi-step
decode, or the accepted tokens of a step verifying drafts), ends requests at
stop tokens and finishes those complete. ``update`` is the two at once.
Tokens are checked before anything changes, and each phase is applied from
the counts the step recorded when it was scheduled, so applying it again
after an exception midway changes nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import numpy as np

from jaxkv._util import checks_own_arguments, host_int_array
from jaxkv.sched._ledger import StepLedger
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._metrics import SpecDecodingCounter
from jaxkv.sched._request import INT32_LIMIT, Request, RequestStatus
from jaxkv.sched._scheduled import ScheduledStep

Tokens = Sequence[int | Sequence[int]]


@runtime_checkable
class StepOwner(Protocol):
    """What applying a step reads and changes of its scheduler."""

    manager: KVCacheManager
    ledger: StepLedger
    vocab_size: int | None
    num_lookahead_tokens: int
    spec_decoding: SpecDecodingCounter

    def is_live(self, req: Request) -> bool:
        """Whether `req` is running (not finished, aborted or recomputed)."""
        ...

    def retire(
        self, req: Request, *, keep_pending: bool, keep_blocks: bool = False
    ) -> None:
        """Finishes `req` (see :meth:`Scheduler.finish`)."""
        ...

    def count_generated(self, n: int) -> None:
        """Counts `n` tokens filled in for a request already finished."""
        ...


class StepApplier:
    """Applies scheduled steps to their scheduler's requests and blocks.

    Example:
      >>> import jaxkv
      >>> s = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(),
      ...                                     num_blocks=8))
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2))
      >>> step = s.schedule(); s.applier.advance(step, finish_early=True)
      >>> s.running[0].output  # a placeholder: the step's first sampled token
      [-1]
      >>> rows = s.applier.checked("resolve", step, [7])  # [[7]]
      >>> s.applier.resolve(step, rows), s.running[0].output
      ([], [7])
    """

    def __init__(self, owner: StepOwner) -> None:
        """Applies steps to `owner`'s requests, blocks and ledger."""
        self.owner = owner

    @checks_own_arguments
    def update(self, step: ScheduledStep, tokens: Tokens) -> list[Request]:
        """:meth:`advance` then :meth:`resolve` (see :meth:`Scheduler.update`)."""
        ledger = self.owner.ledger
        retry = ledger.applying is step
        if ledger.unresolved and not (retry and ledger.unresolved == (step,)):
            raise RuntimeError(
                f"update: {len(ledger.unresolved)} advanced steps are not "
                "resolved; with advance() every step is finished by resolve()."
            )
        if not retry:
            self.check_latest(step, "update")
        rows = self.checked("update", step, tokens)
        ledger.start(step)
        if ledger.unresolved != (step,):
            # Requests finish once their tokens are known (resolve, below).
            self.advance(step, finish_early=False)
        done = self.resolve(step, rows)
        ledger.close(step)
        return done

    def check_latest(self, step: ScheduledStep, op: str) -> None:
        """Raises unless `step` is the latest scheduled one and may be applied.

        Raises unless `step` is the latest scheduled one, not applied, and
        ran after the host tier's copies its scheduling recorded.
        """
        host = self.owner.manager.host
        if host is not None and host.num_pending:
            raise RuntimeError(
                f"{op}: the host tier still holds {host.num_pending} copies recorded "
                "when this step was scheduled, so the step ran before "
                "manager.host.flush(pools): its writes went into blocks whose old "
                "bytes the tier was to keep, and it read blocks the tier was to "
                "restore. Call flush(pools) after schedule() and before "
                "dispatching each step (ServingLoop does)."
            )
        made_by = (
            "schedule()" if step.steps_per_request is None else "schedule_decode()"
        )
        self.owner.ledger.check_latest(step, op, made_by)

    def advance(self, step: ScheduledStep, *, finish_early: bool) -> None:
        """Applies `step` before its tokens are known (checked by the caller).

        Each request's tokens count as computed and its blocks are committed;
        the ``k``-th sampling request gets placeholder outputs ``-(k + 1)``
        (counted by ``num_pending``). With `finish_early`, a request that
        reaches ``max_new_tokens`` finishes now (a multi-step decode's keeps
        its blocks until :meth:`resolve` has cached those its tokens fill).
        A step verifying drafts changes nothing here: its accepted tokens
        decide how far its requests got (:meth:`resolve`).
        """
        owner = self.owner
        early: list[Request] = []
        if not step.spec_token_ids:
            counts = step.steps_per_request
            samplers = {id(r): k for k, r in enumerate(step.sampled)}
            for k, ((req, n), (computed, outputs)) in enumerate(
                zip(step.batch, step.scheduled_counts, strict=True)
            ):
                if not owner.is_live(req):
                    continue
                if counts is not None:  # a multi-step decode: n placeholders
                    n, rank = int(counts[k]), k
                else:
                    rank = samplers.get(id(req))
                req.num_computed = computed + n
                if rank is not None and len(req.output) == outputs:  # once
                    placeholders = 1 if counts is None else n
                    req.output += [-(rank + 1)] * placeholders
                    req.num_pending += placeholders
                owner.manager.commit(req)
                if finish_early and len(req.output) >= req.max_new_tokens:
                    early.append(req)
                    owner.retire(req, keep_pending=True, keep_blocks=counts is not None)
        owner.ledger.advanced(step, early)

    @checks_own_arguments
    def resolve(self, step: ScheduledStep, rows: list[list[int]]) -> list[Request]:
        """Fills the oldest advanced step's tokens; returns the requests complete.

        `rows`: :meth:`checked`'s, one per sampling request (a step verifying
        drafts: its accepted tokens; a multi-step decode: one per request of
        the batch). A stop token ends its request there: the output stops at
        it and what later advanced steps computed for it is dropped. Requests
        finish in batch order once every entry is filled.
        """
        owner = self.owner
        filled: set[int] = set()
        if step.spec_token_ids:
            self._resolve_drafts(step, rows)
            entries = []
        elif step.steps_per_request is None:
            entries = self._sampling_entries(step, rows)
        else:
            step.filled_by_iteration = [[] for _ in range(step.num_steps)]
            entries = [
                (k, req, outputs, row)
                for k, ((req, _), (_, outputs), row) in enumerate(
                    zip(step.batch, step.scheduled_counts, rows, strict=True)
                )
            ]
        for k, req, outputs, row in entries:
            if not _pending_at(req, k, outputs, len(row)):
                continue  # aborted, recomputed, or ended by an earlier stop token
            was_finished = req.status is RequestStatus.FINISHED
            taken = _until_stop(req, row)
            req.output[outputs : outputs + len(taken)] = taken
            req.num_pending -= len(row)
            if (
                taken and taken[-1] in req.stop_token_ids
            ):  # later placeholders are dropped
                req.num_computed -= len(req.output) - outputs - len(taken)
                del req.output[outputs + len(taken) :]
                req.num_pending = 0
            if was_finished:
                owner.count_generated(len(taken))
            filled.add(id(req))
            if step.steps_per_request is None:
                step.filled.append((k, req, taken[0]))
                continue
            for i, token in enumerate(taken):
                step.filled_by_iteration[i].append((k, req, token))
            if owner.manager.holds_blocks(req):
                # Its tokens are known up to here: the blocks whose K/V this
                # step computed are cached.
                owner.manager.register_computed(
                    req, num_tokens=len(req.prompt) + outputs + len(taken) - 1
                )
                owner.manager.commit(req)
        done = []
        for req, _ in step.batch:
            if owner.is_live(req):
                if req.finished:
                    owner.retire(req, keep_pending=False)
                    done.append(req)
            elif id(req) in filled and not req.num_pending:
                if req.status is RequestStatus.FINISHED:
                    if owner.manager.holds_blocks(req):  # a multi-step early finish
                        owner.manager.free(req)
                    done.append(req)
        owner.ledger.resolved(step)
        return done

    @checks_own_arguments
    def _sampling_entries(
        self, step: ScheduledStep, rows: list[list[int]]
    ) -> list[tuple[int, Request, int, list[int]]]:
        """``(k, request, outputs, row)`` per sampling request of `step`."""
        entries, k = [], 0
        for (req, n), (computed, outputs) in zip(
            step.batch, step.scheduled_counts, strict=True
        ):
            if computed + n == len(req.prompt) + outputs:
                entries.append((k, req, outputs, rows[k]))
                k += 1
        return entries

    @checks_own_arguments
    def _resolve_drafts(self, step: ScheduledStep, rows: list[list[int]]) -> None:
        """Applies a step verifying drafts: how far each request got is its row's."""
        owner = self.owner
        accepted = iter(rows)
        logits_row = 0  # the first logits row of the request (1 + k each)
        seen = {id(r) for _, r, _ in step.filled}  # a retry counts nothing twice
        for (req, n), (computed, outputs) in zip(
            step.batch, step.scheduled_counts, strict=True
        ):
            k = len(step.spec_token_ids.get(req.req_id, ()))
            row = (
                next(accepted)
                if computed + n - k == len(req.prompt) + outputs
                else None
            )
            first, logits_row = logits_row, logits_row + (0 if row is None else k + 1)
            if not owner.is_live(req):
                continue
            if row is None:
                req.num_computed = computed + n
            else:
                # K/V is right up to the last accepted draft; the token sampled
                # after it is computed next step.
                req.num_computed = computed + n - k + len(row) - 1
                taken = _until_stop(req, row)[: req.max_new_tokens - outputs]
                req.output[outputs:] = taken
                if id(req) not in seen:
                    step.filled += [(first + i, req, t) for i, t in enumerate(taken)]
                    owner.spec_decoding.observe(
                        num_draft_tokens=k, num_accepted=len(row) - 1
                    )
                if len(row) <= k:  # drafts rejected: their slots go back
                    owner.manager.free_beyond(
                        req, req.num_computed + 1 + owner.num_lookahead_tokens
                    )
            owner.manager.commit(req)

    @checks_own_arguments
    def checked(self, op: str, step: ScheduledStep, tokens: Tokens) -> list[list[int]]:
        """`step`'s sampled tokens as rows of ints, checked before anything changes.

        One token per sampling request (a row of one), the accepted tokens of
        a step verifying drafts, or one row per request of a multi-step
        decode.

        Raises:
          ValueError: If the count or a token id is wrong (named).
          TypeError: If the tokens are not integers.
        """
        top = INT32_LIMIT if self.owner.vocab_size is None else self.owner.vocab_size
        if step.steps_per_request is not None:
            return _checked_rows(op, step, cast(Sequence[Sequence[int]], tokens), top)
        if step.spec_token_ids or any(isinstance(t, list | tuple) for t in tokens):
            return _checked_accepted(step, tokens, top)
        sampled = step.sampled
        if len(tokens) != len(sampled):
            raise ValueError(
                f"{op}: {len(sampled)} requests sample a token this step "
                f"({[r.req_id for r in sampled][:8]}), got {len(tokens)} tokens."
            )
        arr = (
            host_int_array(tokens, f"{op}: sampled tokens")
            if sampled
            else np.zeros(0, np.int64)
        )
        bad = np.flatnonzero((arr < 0) | (arr >= top))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{op}: request {sampled[i].req_id!r} sampled token "
                f"{arr[i]}, outside [0, {top})."
            )
        return [[int(t)] for t in arr.reshape(-1)]


def _pending_at(req: Request, k: int, outputs: int, n: int) -> bool:
    """Whether `req` still waits for `n` tokens of sampling rank `k` at `outputs`."""
    return (
        req.num_pending >= n
        and len(req.output) >= outputs + n
        and req.output[outputs] == -(k + 1)
    )


def _until_stop(req: Request, row: list[int]) -> list[int]:
    """`row`'s tokens up to and with the first of `req`'s stop tokens."""
    for i, t in enumerate(row):
        if t in req.stop_token_ids:
            return row[: i + 1]
    return row


@checks_own_arguments
def _checked_rows(
    op: str, step: ScheduledStep, tokens: Sequence[Sequence[int]], top: int
) -> list[list[int]]:
    """Per request of a multi-step step, its ``steps_per_request`` tokens, checked."""
    counts = cast(np.ndarray, step.steps_per_request)
    if len(tokens) != len(step.batch):
        raise ValueError(
            f"{op}: {len(step.batch)} requests decode this step, got "
            f"{len(tokens)} rows of tokens."
        )
    rows = []
    for (req, _), k, row in zip(step.batch, counts, tokens, strict=True):
        arr = host_int_array(row, f"{op}: tokens of request {req.req_id!r}")
        arr = arr.reshape(-1)
        if arr.size < k:
            raise ValueError(
                f"{op}: request {req.req_id!r} sampled {int(k)} tokens this "
                f"step, got {arr.size}."
            )
        arr = arr[: int(k)]
        bad = np.flatnonzero((arr < 0) | (arr >= top))
        if bad.size:
            raise ValueError(
                f"{op}: request {req.req_id!r} sampled token {arr[bad[0]]}, "
                f"outside [0, {top})."
            )
        rows.append(arr.tolist())
    return rows


@checks_own_arguments
def _checked_accepted(step: ScheduledStep, tokens: Tokens, top: int) -> list[list[int]]:
    """The accepted tokens per sampling request of a step with drafts, checked."""
    sampled = step.sampled
    if len(tokens) != len(sampled):
        raise ValueError(
            f"update: {len(sampled)} requests sample this step "
            f"({[r.req_id for r in sampled][:8]}), got {len(tokens)} "
            "entries (one per request: its accepted tokens)."
        )
    out = []
    for req, entry in zip(sampled, tokens, strict=True):
        drafts = step.spec_token_ids.get(req.req_id, [])
        given = [entry] if isinstance(entry, int | np.integer) else entry
        row = (
            host_int_array(given, f"update: request {req.req_id!r} accepted tokens")
            if len(given)
            else np.zeros(0, np.int64)
        ).reshape(-1)
        if not 1 <= row.size <= len(drafts) + 1:
            raise ValueError(
                f"update: request {req.req_id!r} verified {len(drafts)} draft "
                f"tokens and accepts 1 to {len(drafts) + 1} tokens (the drafts "
                f"kept, then one sampled), got {row.size}."
            )
        if ((row < 0) | (row >= top)).any():
            raise ValueError(
                f"update: request {req.req_id!r} accepted tokens must be in "
                f"[0, {top}), got {row.tolist()[:8]}."
            )
        kept = row[:-1].tolist()
        if kept != drafts[: len(kept)]:
            raise ValueError(
                f"update: request {req.req_id!r} accepts {kept} before its "
                f"sampled token, but the step computed drafts {drafts}: only a "
                "prefix of the drafts can be kept (their K/V is in the cache)."
            )
        out.append(row.tolist())
    return out
