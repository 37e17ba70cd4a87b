"""Applying a scheduled step's outcome to its requests and blocks: with the
sampled tokens (:meth:`~StepOutcomes.update`), or before them and filled in
later (async scheduling: :meth:`~StepOutcomes.advance`,
:meth:`~StepOutcomes.resolve`), and forgetting the cache
(:meth:`~StepOutcomes.recompute_all`).
"""  # noqa: D205

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import cast

import numpy as np

from jaxkv._util import host_int_array
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._request import INT32_LIMIT, Request, RequestStatus
from jaxkv.sched._scheduled import ScheduledStep


def _until_stop(req: Request, row: list[int]) -> list[int]:
    """`row`'s tokens up to and with the first of `req`'s stop tokens."""
    for i, t in enumerate(row):
        if t in req.stop_token_ids:
            return row[: i + 1]
    return row


def _record(step: ScheduledStep, k: int, req: Request, taken: list[int]) -> None:
    for i, token in enumerate(taken):
        step.filled_by_iteration[i].append((k, req, token))


class StepOutcomes:
    """The half of :class:`Scheduler` that applies what a step produced.

    :class:`Scheduler` decides what runs (admission, chunks, preemption);
    these methods apply each step once it ran (or, async, once it is
    dispatched), in order, so that a step is applied exactly once even after
    a fault midway.
    """

    # State owned by Scheduler.__init__.
    manager: KVCacheManager
    vocab_size: int | None
    waiting: deque[Request]
    running: list[Request]
    stats: dict[str, int]
    _applied: ScheduledStep | None
    _latest: ScheduledStep | None
    _applying: ScheduledStep | None
    _ids: set[str]
    _unresolved: deque[ScheduledStep]

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
        if step.num_steps > 1:
            raise ValueError(
                "update: a schedule_decode() step of several iterations; apply it "
                "with update_decode()."
            )
        self._check_latest(step, "update", "schedule()")
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

    def update_decode(
        self, step: ScheduledStep, sampled_token_ids: Sequence[Sequence[int]]
    ) -> list[Request]:
        """Applies a :meth:`~Scheduler.schedule_decode` step; returns the
        requests that finished.

        Args:
          step: The step, after its iterations ran.
          sampled_token_ids: Per request of ``step.batch``, in order, the
            tokens its iterations sampled (at least ``steps_per_request`` of
            them; more are ignored). A stop token ends the request there.

        Checked before anything changes (as :meth:`update`); applying again
        after a fault midway finishes the step, applying no entry twice.
        ``step.filled_by_iteration`` lists the tokens taken.

        Raises:
          ValueError: If the step is not the latest scheduled one, was
            applied, is not a multi-step decode, or the tokens are not one
            row per request, each with its count of valid ids.
          TypeError: If the tokens are not integers.
          RuntimeError: If steps :meth:`advance_decode` applied are not
            resolved.
        """  # noqa: D205
        if self._unresolved:
            raise RuntimeError(
                f"update_decode: {len(self._unresolved)} advanced steps are not "
                "resolved; with advance_decode() every step is finished by "
                "resolve_decode()."
            )
        self._check_decode_step(step, "update_decode")
        self._check_latest(step, "update_decode", "schedule_decode()")
        rows = self._checked_rows("update_decode", step, sampled_token_ids)
        self._applying = step
        live = []
        step.filled_by_iteration = [[] for _ in range(step.num_steps)]
        for k, ((req, _), (computed, outputs), row) in enumerate(
            zip(step.batch, step._before, rows, strict=True)
        ):
            if req.req_id not in self._ids or req.status is not RequestStatus.RUNNING:
                continue
            live.append(req)
            taken = _until_stop(req, row)
            # Set from the recorded counts: a retry appends nothing twice.
            del req.output[outputs:]
            req.output += taken
            req.num_computed = computed + len(taken)
            _record(step, k, req, taken)
            self.manager.register_computed(req)
            self.manager.commit(req)
        finished = [req for req in live if req.finished]
        for req in finished:
            self.finish(req)
        self._applied = step
        self._applying = None
        return finished

    def advance_decode(self, step: ScheduledStep) -> None:
        """Applies a :meth:`~Scheduler.schedule_decode` step before its tokens
        are known (async multi-step decoding): the next block of iterations
        can be scheduled while this one runs on the device.

        Request ``k`` of ``step.batch`` gets ``steps_per_request[k]``
        placeholder tokens ``-(k + 1)`` (its last one is the next step's input:
        ``tokens[num_steps - 1][k]`` of this step, read on the device) counted
        by ``num_pending``; its tokens count as computed and its blocks are
        committed; a request that reaches ``max_new_tokens`` finishes now
        (its blocks go back once its tokens are resolved, the blocks they fill
        cached first). :meth:`resolve_decode` fills the tokens, in the
        order steps were advanced; a stop token found then ends its request,
        and what later advanced steps computed for it is dropped.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
          >>> s = jaxkv.Scheduler(plan)
          >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=7))
          >>> s.update(s.schedule(), [5])
          []
          >>> first = s.schedule_decode(3); s.advance_decode(first)
          >>> second = s.schedule_decode(3); second.token_ids.tolist()  # tokens[2][0]
          [-1]
          >>> s.advance_decode(second); s.running, s.unresolved == (first, second)
          ([], True)
          >>> s.resolve_decode(first, [[1, 2, 3]]), first.filled_by_iteration[2]
          ([], [(0, Request(req_id='a', ...), 3)])
          >>> [r.output for r in s.resolve_decode(second, [[4, 5, 6]])]
          [[5, 1, 2, 3, 4, 5, 6]]

        Raises:
          RuntimeError: If :meth:`update` of the latest step raised midway.
          ValueError: If `step` is not a multi-step decode, not the latest
            scheduled step, or was already applied.
        """  # noqa: D205
        if self._applying is not None:
            raise RuntimeError(
                "advance_decode: update() of the latest step raised midway; call "
                "update(step, tokens) again with the same step first."
            )
        self._check_decode_step(step, "advance_decode")
        self._check_latest(step, "advance_decode", "schedule_decode()")
        counts = cast(np.ndarray, step.steps_per_request)  # checked above
        for k, ((req, _), (computed, outputs), n) in enumerate(
            zip(step.batch, step._before, counts.tolist(), strict=True)
        ):
            if req.req_id not in self._ids or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed = computed + n
            if len(req.output) == outputs:  # each once, after a fault too
                req.output += [-(k + 1)] * n
                req.num_pending += n
            self.manager.commit(req)
            if len(req.output) >= req.max_new_tokens:
                # Its blocks stay until its tokens are known: resolve_decode()
                # caches the blocks they fill (as update_decode() would), then
                # gives them back.
                step._early.append(req)
                self._finish(req, keep_pending=True, keep_blocks=True)
        self._applied = step
        self._unresolved.append(step)

    def resolve_decode(
        self, step: ScheduledStep, sampled_token_ids: Sequence[Sequence[int]]
    ) -> list[Request]:
        """Fills the tokens of the oldest step :meth:`advance_decode` applied;
        returns the requests that are now complete (finished, no token
        pending).

        Args:
          step: The oldest unresolved step.
          sampled_token_ids: As for :meth:`update_decode`.

        A stop token ends its request there (the output stops at it; what
        later advanced steps computed for it is dropped). Checked before
        anything changes, as :meth:`update_decode`; ``step.filled_by_iteration``
        lists the tokens taken.

        Raises:
          ValueError: If `step` is not the oldest unresolved one, is not a
            multi-step decode, or the tokens are not one row per request with
            its count of valid ids.
          TypeError: If the tokens are not integers.
        """  # noqa: D205
        self._check_decode_step(step, "resolve_decode")
        if not self._unresolved or step is not self._unresolved[0]:
            raise ValueError(
                "resolve_decode: the step is not the oldest advanced and unresolved "
                "one; resolve steps once each, in the order they were advanced."
            )
        rows = self._checked_rows("resolve_decode", step, sampled_token_ids)
        step.filled_by_iteration = [[] for _ in range(step.num_steps)]
        done = []
        for k, ((req, _), (_, outputs), row) in enumerate(
            zip(step.batch, step._before, rows, strict=True)
        ):
            n = len(row)
            if not (
                req.num_pending >= n
                and len(req.output) >= outputs + n
                and req.output[outputs] == -(k + 1)
            ):
                continue  # aborted, recomputed, or ended by an earlier stop token
            taken = _until_stop(req, row)
            req.output[outputs : outputs + len(taken)] = taken
            req.num_pending -= n
            _record(step, k, req, taken)
            stopped = bool(taken) and taken[-1] in req.stop_token_ids
            if stopped:
                del req.output[outputs + len(taken) :]
                req.num_pending = 0
            if self.manager.holds_blocks(req):
                # Its tokens are known up to here: the blocks whose K/V this
                # step computed are cached, as update_decode() caches them.
                self.manager.register_computed(
                    req, num_tokens=len(req.prompt) + outputs + len(taken) - 1
                )
                self.manager.commit(req)
                if req.status is RequestStatus.FINISHED and (
                    stopped or not req.num_pending
                ):
                    self.manager.free(req)  # finished by advance_decode()
            if stopped and req.status is not RequestStatus.FINISHED:
                self._finish(req, keep_pending=False)
            if req.status is RequestStatus.FINISHED and not req.num_pending:
                done.append(req)
        self._unresolved.popleft()
        return done

    @staticmethod
    def _check_decode_step(step: ScheduledStep, op: str) -> None:
        if step.steps_per_request is None:
            raise ValueError(
                f"{op}: the step is not a schedule_decode() step; it is applied "
                "with update(), or advance() and resolve()."
            )

    def _checked_rows(
        self, op: str, step: ScheduledStep, sampled_token_ids: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """Per request of a multi-step step, its ``steps_per_request`` tokens,
        checked (the errors of :meth:`update_decode`).
        """  # noqa: D205
        counts = cast(np.ndarray, step.steps_per_request)  # a decode step
        if len(sampled_token_ids) != len(step.batch):
            raise ValueError(
                f"{op}: {len(step.batch)} requests decode this step, got "
                f"{len(sampled_token_ids)} rows of tokens."
            )
        top = INT32_LIMIT if self.vocab_size is None else self.vocab_size
        rows = []
        for (req, _), k, row in zip(step.batch, counts, sampled_token_ids, strict=True):
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

    def _check_latest(self, step: ScheduledStep, op: str, made_by: str) -> None:
        """Raises unless `step` is the latest scheduled one, not applied, and
        ran after the host tier's copies its scheduling recorded.
        """  # noqa: D205
        host = self.manager.host
        if host is not None and host.num_pending:
            raise RuntimeError(
                f"{op}: the host tier still holds {host.num_pending} copies recorded "
                "when this step was scheduled, so the step ran before "
                "manager.host.flush(pools): its writes went into blocks whose old "
                "bytes the tier was to keep, and it read blocks the tier was to "
                "restore. Call flush(pools) after schedule() and before "
                "dispatching each step (ServingLoop does)."
            )
        if step is self._applied:
            raise ValueError(
                f"{op}: this step was already applied (a retry?); schedule the "
                "next step instead."
            )
        if step is not self._latest:
            raise ValueError(
                f"{op}: the step is not the one {made_by} returned last; apply "
                "each scheduled step once, in order."
            )

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
        top = INT32_LIMIT if self.vocab_size is None else self.vocab_size
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
        if step.num_steps > 1:
            raise ValueError(
                "advance: a schedule_decode() step runs its iterations on the "
                "device and is applied with update_decode(), not advanced."
            )
        self._check_latest(step, "advance", "schedule()")
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
        if step.num_steps > 1:
            raise ValueError(
                "resolve: a schedule_decode() step of several iterations; resolve "
                "it with resolve_decode()."
            )
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

    def _finish(
        self, req: Request, *, keep_pending: bool, keep_blocks: bool = False
    ) -> None:
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
        req.status = RequestStatus.FINISHED
