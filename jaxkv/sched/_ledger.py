"""The scheduler's ledger of steps in flight: which step may be applied, and how far.

One object the :class:`Scheduler` holds: the step it made last (the only one
that may be applied next), the last one applied (a retry is refused), a step
whose ``update`` stopped midway (applied again before anything else), the
steps ``advance`` applied whose tokens ``resolve`` has not filled (oldest
first), and per such step the requests it finished early (their last tokens
still on the device). Each request's counts when a step was made are the
step's own record (:attr:`ScheduledStep.scheduled_counts`).
"""

from __future__ import annotations

from collections import deque

from jaxkv.sched._request import Request
from jaxkv.sched._scheduled import ScheduledStep


class StepLedger:
    """Steps made, applied and in flight (see the module docstring).

    Example:
      >>> import jaxkv
      >>> s = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(),
      ...                                     num_blocks=8))
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2))
      >>> step = s.schedule(); s.advance(step)
      >>> s.ledger.latest is s.ledger.applied is step, s.ledger.unresolved == (step,)
      (True, True)
    """

    def __init__(self) -> None:
        """An empty ledger: nothing made yet."""
        self.latest: ScheduledStep | None = None
        self.applied: ScheduledStep | None = None
        self.applying: ScheduledStep | None = None
        self._unresolved: deque[ScheduledStep] = deque()
        self._early: dict[int, list[Request]] = {}

    @property
    def unresolved(self) -> tuple[ScheduledStep, ...]:
        """Steps advanced and not resolved yet, oldest first."""
        return tuple(self._unresolved)

    def made(self, step: ScheduledStep) -> ScheduledStep:
        """Records `step` as the latest made; returns it."""
        self.latest = step
        return step

    def check_latest(self, step: ScheduledStep, op: str, made_by: str) -> None:
        """Raises unless `step` is the latest made and not applied yet."""
        if step is self.applied:
            raise ValueError(
                f"{op}: this step was already applied (a retry?); schedule the "
                "next step instead."
            )
        if step is not self.latest:
            raise ValueError(
                f"{op}: the step is not the one {made_by} returned last; apply "
                "each scheduled step once, in order."
            )

    def check_not_midway(self, op: str) -> None:
        """Raises if an ``update`` stopped midway (it must be applied again first)."""
        if self.applying is not None:
            raise RuntimeError(
                f"{op}: update() of the latest step raised midway; call "
                "update(step, tokens) again with the same step first."
            )

    def check_drafts_resolved(self, op: str) -> None:
        """Raises while a step verifying drafts is advanced and not resolved.

        Its accepted tokens decide where its requests continue, so nothing
        can be scheduled after it until they are known.
        """
        if any(step.spec_token_ids for step in self._unresolved):
            raise RuntimeError(
                f"{op}: a step verifying draft tokens is advanced but not "
                "resolved; resolve it first (the tokens it accepts decide where "
                "its requests continue)."
            )

    def start(self, step: ScheduledStep) -> None:
        """`step` is being applied by ``update`` (retried if this stops midway)."""
        self.applying = step

    def close(self, step: ScheduledStep) -> None:
        """``update`` applied `step` whole."""
        self.applied = step
        self.applying = None

    def advanced(self, step: ScheduledStep, early: list[Request]) -> None:
        """``advance`` applied `step`; `early`: the requests it finished."""
        self.applied = step
        self._unresolved.append(step)
        self._early[id(step)] = early

    def check_oldest(self, step: ScheduledStep) -> None:
        """Raises unless `step` is the oldest advanced and unresolved step."""
        if not self._unresolved or step is not self._unresolved[0]:
            raise ValueError(
                "resolve: the step is not the oldest advanced and unresolved "
                "one; resolve steps once each, in the order they were advanced."
            )

    def resolved(self, step: ScheduledStep) -> None:
        """``resolve`` filled the tokens of `step` (the oldest)."""
        self._unresolved.popleft()
        self._early.pop(id(step), None)

    def forget(self) -> list[Request]:
        """Drops every step in flight; returns the requests they finished early.

        The cache's contents are gone (``recompute_all``): no step made
        before may be applied, and requests finished before their last token
        was read are served again.
        """
        early = [req for step in self._unresolved for req in self._early[id(step)]]
        self._unresolved.clear()
        self._early.clear()
        self.latest = None
        return early
