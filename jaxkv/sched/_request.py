"""A generation request as the scheduler and the block manager see it."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Sequence

import numpy as np

from jaxkv._util import checks_own_arguments

INT32_LIMIT = 2**31  # token ids travel to the device as int32


class RequestStatus(enum.Enum):
    """Where a request is: waiting, running, finished or rejected.

    Example:
      >>> import jaxkv
      >>> jaxkv.Request("a", prompt=[1], max_new_tokens=1).status.value
      'waiting'
    """

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclasses.dataclass(eq=False)
@checks_own_arguments
class Request:
    """One generation request and its progress.

    Requests compare by identity (two requests with the same prompt are two
    requests).

    Attributes:
      req_id: Identifier (unique among the scheduler's live requests).
      prompt: Prompt token ids.
      max_new_tokens: Tokens to generate; the request finishes after them (or
        at a stop token).
      stop_token_ids: Generated tokens that finish the request (kept in the
        output).
      cache_salt: Separates this request's prefix-cache entries from requests
        with another salt (``None``: shared).
      num_computed: Tokens whose K/V (and state) are in the cache.
      output: Generated tokens.
      status: See :class:`RequestStatus`.
      reject_reason: Why the request was rejected (``None`` otherwise).
      num_cached_tokens: Tokens taken from the prefix cache, over all
        admissions (a preempted request is admitted again).
      num_preemptions: Times its blocks were taken back and it was requeued.
      num_pending: Output tokens sampled on the device whose values the host
        has not read yet (:meth:`Scheduler.advance`, async scheduling): the
        last ``num_pending`` entries of ``output`` are placeholders
        (negative) until :meth:`Scheduler.resolve` fills them.
      priority: With ``Scheduler(policy="priority")``, a lower value is
        served first and preempted last (vLLM's convention).
      arrival_time: Seconds (``time.time()`` when the request was made by
        default); orders requests of equal priority.
      wait_reason: Why the request was not admitted at the latest step it
        headed the waiting queue (``None`` once admitted).
      spec_token_ids: Draft tokens for the next step to verify (speculative
        decoding, vLLM's name): set them after the step that sampled the
        request's last token; the next :meth:`Scheduler.schedule` takes as
        many as fit and clears them.

    Example:
      >>> import jaxkv
      >>> r = jaxkv.Request("a", prompt=[5, 6], max_new_tokens=2, stop_token_ids=(0,))
      >>> r.output.append(0); r.tokens, r.finished  # a stop token ends it early
      ([5, 6, 0], True)
    """

    req_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    num_computed: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    reject_reason: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_pending: int = 0
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.time)
    wait_reason: str | None = None
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(self.tokens)``, without building the list."""
        return len(self.prompt) + len(self.output)

    def token_range(self, start: int, stop: int) -> list[int]:
        """``self.tokens[start:stop]``, without building the whole list."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p : stop - p]
        return self.prompt[start:] + self.output[: stop - p]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host knows (placeholders not counted)."""
        return len(self.prompt) + len(self.output) - self.num_pending

    @property
    def finished(self) -> bool:
        """Whether it generated all its tokens or a stop token."""
        return len(self.output) >= self.max_new_tokens or bool(
            self.output and self.output[-1] in self.stop_token_ids
        )


def as_python_ints(req: Request) -> None:
    """Stores `req`'s token fields as Python ints (a NumPy prompt serves as a list)."""
    req.prompt = [int(t) for t in req.prompt]
    req.stop_token_ids = tuple(int(t) for t in req.stop_token_ids)
    req.max_new_tokens = int(req.max_new_tokens)


def request_problem(req: Request, *, vocab_size: int | None) -> str | None:
    """What is wrong with a request's own fields, or ``None``.

    The prompt (a flat sequence of ints in ``[0, vocab_size)``, or within int32 without
    a vocabulary), ``max_new_tokens``, ``stop_token_ids``, ``cache_salt``, and that it
    was never served.
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
    top = INT32_LIMIT if vocab_size is None else vocab_size
    if ids.min() < 0 or ids.max() >= top:
        return f"prompt token ids must be in [0, {top}), got [{ids.min()}, {ids.max()}]"
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
    outside = [int(t) for t in stops if not 0 <= t < top]
    if outside:
        return (
            f"stop_token_ids must be in [0, {top}) (no other id is ever "
            f"sampled, so the request would never stop on them), got {outside}"
        )
    if req.cache_salt is not None and not isinstance(req.cache_salt, str):
        return (
            "cache_salt must be a str or None, got "
            f"{type(req.cache_salt).__name__} {req.cache_salt!r}"
        )
    if not isinstance(req.priority, int | np.integer) or isinstance(req.priority, bool):
        return f"priority must be an int, got {req.priority!r}"
    if (
        not isinstance(req.arrival_time, int | float | np.integer | np.floating)
        or isinstance(req.arrival_time, bool)
        or not math.isfinite(req.arrival_time)
    ):
        return (
            f"arrival_time must be a finite number of seconds, got {req.arrival_time!r}"
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
    if not isinstance(req.max_new_tokens, int | np.integer) or req.max_new_tokens < 1:
        return f"max_new_tokens must be a positive int, got {req.max_new_tokens!r}"
    return None
