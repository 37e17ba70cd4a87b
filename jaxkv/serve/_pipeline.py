"""The steps between dispatch and their tokens: one pipeline, with overlap or without.

Every step a :class:`jaxkv.ServingLoop` runs goes the same way: dispatched
(its program queued on the device), advanced on every rank's scheduler
(:meth:`jaxkv.Scheduler.advance`: its tokens count as computed, placeholders
stand for what it samples), then resolved once its tokens are read
(:meth:`jaxkv.Scheduler.resolve`), oldest first. Without overlap a step is
resolved before the next is scheduled (a pipeline of depth 0 between
steps); with overlap one stays in flight while the host schedules and packs
the next (depth 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxkv.sched import Request, ScheduledStep, Scheduler
from jaxkv.serve._drafts import accepted_rows

#: Runs a step's programs: ``run(steps, prev_tokens) -> (tokens, logits,
#: tokens the next step's placeholders read)``.
RunSteps = Callable[
    [list[ScheduledStep], jax.Array], tuple[jax.Array, jax.Array | None, jax.Array]
]
#: Streams taken tokens: ``deliver([(k, request, token)], logits rows or None)``.
Deliver = Callable[[list[tuple[int, Request, int]], np.ndarray | None], None]


class StepPipeline:
    """Steps dispatched and advanced whose tokens are not read yet, oldest first.

    One entry per dispatch: the steps (one per data-parallel rank, or one
    multi-step decode), their sampled tokens and logits on the device.

    Example (steps of a loop's toy model; ``loop.pipeline`` is the loop's):
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=1,
      ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
      ...     max_num_batched_tokens=16, token_buckets=(4, 16))
      >>> plan = jaxkv.make_plan(cfg, num_blocks=8)
      >>> layer = plan.attention_layer("layers.0.self_attn")
      >>> def forward(params, pools, meta, tokens, sample):
      ...     x = params[tokens]
      ...     m = meta[layer.name]
      ...     pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
      ...     out = jaxkv.paged_attention(x[:, None], pools, layer, m, scale=1.0)
      ...     return pools, out[sample, 0] @ params.T
      >>> loop = jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)
      >>> _ = loop.submit(jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3))
      >>> _ = loop.step(); len(loop.pipeline)  # overlap: one step in flight
      1
      >>> loop.set_overlap(False); len(loop.pipeline)
      0
    """

    def __init__(
        self,
        *,
        no_tokens: jax.Array,
        num_ranks: int,
        record_logits: bool,
        deliver: Deliver,
        forget: Callable[[list[Request]], object],
    ) -> None:
        """An empty pipeline; `no_tokens` stand for the tokens before the first step."""
        self.entries: deque[tuple[list[ScheduledStep], jax.Array, jax.Array | None]] = (
            deque()
        )
        #: The latest dispatched step's tokens, which the next step's decode
        #: placeholders index on the device.
        self.prev_tokens = no_tokens
        #: Steps whose dispatch started and has not returned (a fault there
        #: leaves them to be dispatched again).
        self.inflight: list[ScheduledStep] | None = None
        self._num_ranks = num_ranks
        self._record_logits = record_logits
        self._deliver = deliver
        self._forget = forget

    def __len__(self) -> int:
        """Dispatches whose tokens are not read yet."""
        return len(self.entries)

    def dispatch(
        self,
        schedulers: Sequence[Scheduler],
        steps: list[ScheduledStep],
        run: RunSteps,
    ) -> None:
        """Runs `steps` (`run`) and advances the schedulers past them."""
        self.inflight = steps
        tokens, logits, prev = run(steps, self.prev_tokens)
        # It ran: from here it is advanced and resolved, never run again.
        self.entries.append((steps, tokens, logits))
        self.prev_tokens = prev
        self.inflight = None
        self.advance(schedulers, steps)

    def advance(
        self, schedulers: Sequence[Scheduler], steps: list[ScheduledStep]
    ) -> None:
        """Advances each rank's scheduler past its step, once (after a fault too)."""
        for sched, step in zip(schedulers, steps, strict=True):
            if sched.last_applied is not step:
                sched.advance(step)

    def unadvanced(self, schedulers: Sequence[Scheduler]) -> bool:
        """Whether the latest dispatch ran but a scheduler was not advanced past it."""
        return bool(self.entries) and any(
            sched.last_applied is not step
            for sched, step in zip(schedulers, self.entries[-1][0], strict=True)
        )

    def drain(self, schedulers: Sequence[Scheduler], depth: int = 0) -> list[Request]:
        """Resolves the oldest dispatches until `depth` are left; the requests done."""
        finished = []
        while len(self.entries) > depth:
            finished += self.resolve_oldest(schedulers)
        return finished

    def decode_ahead(
        self,
        schedulers: Sequence[Scheduler],
        num_steps: int,
        run: RunSteps,
        *,
        depth: int,
    ) -> tuple[bool, list[Request]]:
        """Multi-step decoding: dispatches a block of iterations when it can.

        When the batch is in steady decoding (one device), a block of
        `num_steps` iterations (:meth:`Scheduler.schedule_decode`) goes
        through the pipeline like a step: with overlap it is dispatched
        before the block in flight is read. Returns whether it ran and the
        requests finished.
        """
        sched = schedulers[0]
        blocks = bool(self.entries) and self.entries[-1][0][0].num_steps > 1
        if sched.waiting or not sched.running:
            # An ordinary step starts from known tokens: read the blocks first.
            return False, (self.drain(schedulers) if blocks else [])
        done = [] if blocks else self.drain(schedulers)
        step = sched.schedule_decode(num_steps)
        if step is None and self.entries:
            # Not steady, or its blocks do not fit yet: with every token known
            # (stop tokens free blocks), once more; else an ordinary step.
            done += self.drain(schedulers)
            step = sched.schedule_decode(num_steps)
        if step is None:
            return False, done
        self.dispatch(schedulers, [step], run)
        return True, done + self.drain(schedulers, depth)

    def resolve_oldest(self, schedulers: Sequence[Scheduler]) -> list[Request]:
        """Reads the oldest dispatch's tokens and resolves it on every rank."""
        steps, tokens, logits = self.entries[0]
        host = _to_host(tokens)  # waits for it
        rows = None
        if logits is not None and self._record_logits:
            rows = _to_host(logits)
        finished = []
        if steps[0].num_steps > 1:  # a multi-step decode: (num_steps, width)
            step, sched = steps[0], schedulers[0]
            if step in sched.unresolved:  # once, after a fault too
                finished = sched.resolve(step, host[:, : step.num_reqs].T.tolist())
            self.entries.popleft()
            self._forget(finished)
            for i, filled in enumerate(step.filled_by_iteration):
                if filled:
                    self._deliver(filled, None if rows is None else rows[i])
            return finished
        host = host.reshape(self._num_ranks, -1)
        if rows is not None:
            rows = rows.reshape(self._num_ranks, *rows.shape[-2:])
        for rank, (sched, step) in enumerate(zip(schedulers, steps, strict=True)):
            if step in sched.unresolved:  # each once, after a fault too
                if step.spec_token_ids:  # each request's accepted tokens
                    finished += sched.resolve(step, accepted_rows(step, host[rank]))
                else:
                    n = len(step.sampled)
                    finished += sched.resolve(step, host[rank, :n].tolist())
        self.entries.popleft()
        self._forget(finished)
        for rank, step in enumerate(steps):
            self._deliver(step.filled, None if rows is None else rows[rank])
        return finished

    def clear(self, no_tokens: jax.Array) -> None:
        """Forgets every step in flight (their pools are gone)."""
        self.entries.clear()
        self.prev_tokens = no_tokens
        self.inflight = None


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered over processes).

    The whole array on this host; over several processes, gathered from all
    (sampled tokens and logits only: a few KB a step).
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
