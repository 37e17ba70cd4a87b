"""Steps in flight: prepared and dispatched (ahead of their tokens with
overlap), resolved in order, applied once, and brought back to a consistent
state after a fault (:meth:`~StepPipeline.resume`).
"""  # noqa: D205

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.kv import Pools, any_deleted
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.sched import Request, ScheduledStep, Scheduler
from jaxkv.serve._sampling import SamplingParams, sampling_rows
from jaxkv.step import (
    Programs,
    StepInputs,
    StepMetadataBuilder,
    decode_step_inputs,
)


class StepPipeline:
    """The half of :class:`ServingLoop` that takes a step from dispatched to
    applied: the tokens read back (they are the only host sync), each
    scheduler advanced and resolved once, logits recorded and tokens
    streamed, and the recovery rules after an exception.
    """  # noqa: D205

    # State owned by ServingLoop.__init__.
    builder: StepMetadataBuilder
    programs: Programs
    decode_programs: Programs
    _decode_steps: int
    params: Any
    sampling: SamplingParams
    per_request_sampling: bool
    counters: dict[str, int]
    _width: int
    plan: KVCachePlan
    sharded: ShardedPlan | None
    num_ranks: int
    _overlap: bool
    record_logits: bool
    schedulers: list[Scheduler]
    pools: Pools
    logits: dict[str, list[np.ndarray]]
    _request_sampling: dict[str, Any]
    _inflight: list[ScheduledStep] | None
    _results: tuple[jax.Array, jax.Array] | None
    _on_token: Callable[[Request, int], None] | None
    _pipeline: deque[tuple[list[ScheduledStep], jax.Array, jax.Array]]
    _prev_tokens: jax.Array

    @property
    def decode_steps(self) -> int:
        """Decode iterations per dispatch in steady decoding (read-only: its
        programs are compiled by :meth:`warm_up`; make a new loop to change it).
        """  # noqa: D205
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
        """Multi-step decoding (``decode_steps > 1``, one device): when the
        batch is in steady decoding, runs ``decode_steps`` iterations in one
        program. With overlap the block is dispatched before the one in flight
        is read (:meth:`Scheduler.advance_decode`), so the host schedules,
        packs and reads back while the device computes. Returns whether it
        ran and the requests finished.
        """  # noqa: D205
        sched = self.schedulers[0]
        blocks = bool(self._pipeline) and self._pipeline[-1][0][0].num_steps > 1
        if sched.waiting or not sched.running:
            # An ordinary step starts from known tokens: read the blocks first.
            return False, (self._resolve_all() if blocks else [])
        done = [] if blocks else self._resolve_all()
        step = sched.schedule_decode(self.decode_steps)
        if step is None and self._pipeline:
            # Not steady, or its blocks do not fit yet: with every token known
            # (stop tokens free blocks), once more; else an ordinary step.
            done += self._resolve_all()
            step = sched.schedule_decode(self.decode_steps)
        if step is None:
            return False, done
        if not self._overlap:
            return True, done + self._run_decode(step)
        self._dispatch_ahead([step])
        while len(self._pipeline) > 1:
            done += self._resolve_oldest()
        return True, done

    def _dispatch_decode(
        self, step: ScheduledStep, prev_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dispatches a multi-step decode: ``(tokens (num_steps, width),
        logits, its last iteration's tokens)``; `prev_tokens` fills its first
        iteration's placeholders.
        """  # noqa: D205
        first = self.builder.prepare(step)
        inputs = decode_step_inputs(
            first, num_reqs=step.num_reqs, step_slots=step.step_slots or []
        )
        seeds = self._seeds([step], first.layout.num_samples)
        seeds = jax.tree.map(lambda x: x[0], seeds)
        self._flush_host_tiers()
        self.pools, tokens, logits, last = self.decode_programs(
            self._decode_key(first), self.pools, self.params, inputs, seeds, prev_tokens
        )
        self.counters["steps"] += 1
        self.counters["decode_iterations"] += step.num_steps
        return tokens, logits, last

    def _run_decode(self, step: ScheduledStep) -> list[Request]:
        self._inflight, self._results = [step], None
        tokens, logits, _ = self._dispatch_decode(step, self._no_tokens())
        # It ran: on resume() it is applied, never run again.
        self._results = tokens, logits
        return self._apply()

    def _apply_decode(self, step: ScheduledStep) -> list[Request]:
        """Applies a multi-step decode step from ``self._results``."""
        if self._results is None:
            raise RuntimeError("ServingLoop: no step result to apply.")
        tokens = _to_host(self._results[0])  # (num_steps, width)
        host_logits = self._host_decode_logits(self._results[1])
        sched = self.schedulers[0]
        rows = tokens[:, : step.num_reqs].T.tolist()
        finished = [] if sched.last_applied is step else sched.update_decode(step, rows)
        self._inflight = self._results = None
        self._forget(finished)
        self._deliver_iterations(step, host_logits)
        return finished

    def _resolve_decode(
        self, step: ScheduledStep, tokens: jax.Array, logits: jax.Array | None
    ) -> list[Request]:
        """Reads and resolves the oldest block in flight (overlap)."""
        host_tokens = _to_host(tokens)  # waits for it
        host_logits = self._host_decode_logits(logits)
        sched = self.schedulers[0]
        finished = []
        if step in sched.unresolved:  # once, after a fault too
            rows = host_tokens[:, : step.num_reqs].T.tolist()
            finished = sched.resolve_decode(step, rows)
        self._pipeline.popleft()
        self._forget(finished)
        self._deliver_iterations(step, host_logits)
        return finished

    def _host_decode_logits(self, logits: jax.Array | None) -> np.ndarray | None:
        return _to_host(logits) if logits is not None and self.record_logits else None

    def _deliver_iterations(
        self, step: ScheduledStep, host_logits: np.ndarray | None
    ) -> None:
        """Streams a multi-step decode's tokens in the order they were sampled."""
        for i, filled in enumerate(step.filled_by_iteration):
            if filled:
                self._deliver(filled, None if host_logits is None else host_logits[i])

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
        if steps[0].num_steps > 1:  # a multi-step decode (one device)
            # The next step's placeholders are its last iteration's tokens.
            next_tokens, logits, prev = self._dispatch_decode(
                steps[0], self._prev_tokens
            )
        else:
            next_tokens, logits = self._dispatch(steps, self._prev_tokens)
            prev = next_tokens
        # It ran: from here resume() advances and resolves it, never reruns it.
        self._pipeline.append((steps, next_tokens, logits))
        self._prev_tokens = prev
        self._inflight = None
        self._advance(steps)

    def _advance(self, steps: list[ScheduledStep]) -> None:
        for sched, step in zip(self.schedulers, steps, strict=True):
            if sched.last_applied is step:  # each once, after a fault too
                continue
            if step.num_steps > 1:
                sched.advance_decode(step)
            else:
                sched.advance(step)

    def _resolve_oldest(self) -> list[Request]:
        steps, next_tokens, logits = self._pipeline[0]
        if steps[0].num_steps > 1:
            return self._resolve_decode(steps[0], next_tokens, logits)
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
        if steps[0].num_steps > 1:
            return self._apply_decode(steps[0])
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
        if not self._overlap:
            decoding = self._inflight is not None and self._inflight[0].num_steps > 1
            if self._inflight is None:
                return None
            if self._results is not None:
                self._apply()
                return "applied"
            if any_deleted(self.pools):
                self._recompute_all()
                return "recomputed"
            if decoding:
                self._run_decode(self._inflight[0])
            else:
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


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host; over several processes, gathered from all
    (sampled tokens and logits only: a few KB a step).
    """  # noqa: D205
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
