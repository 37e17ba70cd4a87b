"""Speculative decoding in a :class:`jaxkv.ServingLoop`: drafts in, accepted tokens out.

Before each step the loop asks its :class:`Drafter` for draft tokens of the
requests that decode next (:class:`NgramDrafter`: vLLM's prompt lookup, or
your draft model); the step computes each request's last token and its
drafts and samples at every one of them, and :func:`accept_drafts` keeps,
inside the same jitted program, the drafts the target model agrees with and
the token it sampled after them.

Verification: the target's token at each position is sampled exactly as
without drafts (the same key: seed, request, position; greedy is argmax),
and a draft is kept while it equals that token. For drafts that are one
token per position (n-gram drafts, draft models decoding greedily, as
vLLM's proposers do: no draft probabilities) this is rejection sampling:
a draft ``d`` is kept with probability ``p(d) = min(1, p(d) / q(d))`` for
``q`` the point mass on ``d``, and after a rejection the token is drawn from
``p`` without ``d``, renormalized (``max(0, p - q)``): the target
distribution, whatever the drafts. Being coupled by the key, the tokens are
those of the same loop without drafts, token for token, at any temperature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxkv._util import checks_own_arguments, is_int
from jaxkv.sched import Request, ScheduledStep


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the requests a loop decodes next.

    ``drafter(requests) -> drafts``: one sequence of token ids per request
    (empty: no draft for it), called by :class:`jaxkv.ServingLoop` before each
    step with its running requests whose every token is known
    (``req.prompt + req.output``); the loop cuts each draft to what fits the
    step. A draft model is a drafter: run it on the requests' tokens (a
    jitted program of your own, greedy) and return its tokens.

    Example (always propose the last token again):
      >>> import jaxkv
      >>> def repeat_last(requests):
      ...     return [[(r.prompt + r.output)[-1]] * 2 for r in requests]
      >>> isinstance(repeat_last, jaxkv.serve.Drafter)
      True
    """

    def __call__(self, requests: Sequence[Request], /) -> Sequence[Sequence[int]]:
        """Draft tokens for each of `requests`, in order."""
        ...


@checks_own_arguments
@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramDrafter:
    """Prompt-lookup drafts, as vLLM's ``NgramProposer`` (``method="ngram"``).

    For each request, the longest suffix of its tokens of ``prompt_lookup_min``
    to ``prompt_lookup_max`` tokens that occurred before (its earliest
    occurrence) proposes the ``num_speculative_tokens`` tokens that followed
    it (:func:`ngram_drafts`).

    Attributes:
      num_speculative_tokens: Draft tokens per request and step (vLLM's
        ``num_speculative_tokens``).
      prompt_lookup_min: The shortest suffix matched.
      prompt_lookup_max: The longest suffix matched.

    Example:
      >>> import jaxkv
      >>> drafter = jaxkv.serve.NgramDrafter(num_speculative_tokens=2)
      >>> drafter([jaxkv.Request("a", prompt=[1, 2, 3, 4, 1, 2], max_new_tokens=4)])
      [[3, 4]]
    """

    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        """Each count an int >= 1, and min <= max (named)."""
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(
                    f"NgramDrafter.{name} must be an int >= 1, got {value!r}."
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"NgramDrafter: prompt_lookup_min ({self.prompt_lookup_min}) > "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    def __call__(self, requests: Sequence[Request], /) -> list[list[int]]:
        """The drafts of each request (see the class)."""
        return [
            ngram_drafts(
                [*r.prompt, *r.output],
                min_n=self.prompt_lookup_min,
                max_n=self.prompt_lookup_max,
                k=self.num_speculative_tokens,
            )
            for r in requests
        ]


def ngram_drafts(tokens: Sequence[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier match of the longest suffix.

    vLLM's ``_find_longest_matched_ngram_and_propose_tokens``: the longest
    ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens occur earlier (an
    occurrence that is not the suffix itself), its earliest occurrence, and
    the (at most `k`) tokens after it.

    Example (vLLM's test numbers):
      >>> from jaxkv.serve import ngram_drafts
      >>> ngram_drafts([1, 2, 3, 4, 1, 2, 3], min_n=2, max_n=2, k=3)
      [4, 1, 2]
      >>> ngram_drafts([1, 3, 6, 2, 3, 4, 1, 2, 3], min_n=1, max_n=1, k=2)
      [6, 2]
    """
    t = np.asarray(tokens, np.int64).reshape(-1)
    total = t.size
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows that end before the last token: t[s:s + n], s + n < total.
        windows = np.lib.stride_tricks.sliding_window_view(t[: total - 1], n)
        hits = np.flatnonzero((windows == t[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return t[start : start + k].tolist()
    return []


def accept_drafts(
    tokens: Int[Array, " rows"], drafts: Int[Array, " rows"]
) -> Int[Array, " rows"]:
    """Each request's tokens up to its first rejected draft (jittable).

    Row ``i`` is a sampled row; ``drafts[i]`` is the draft token that follows
    row ``i``'s token in the step (``-1`` on a request's last row: the next
    row starts another request). A request's rows are kept while every
    earlier row's token equals its draft; the first row whose token differs
    from its draft is kept too (the token sampled instead), later rows become
    ``-1``.

    Example (a request with drafts [5, 6] whose target said 5 then 9, then a
    request without drafts):
      >>> import jax.numpy as jnp
      >>> from jaxkv.serve import accept_drafts
      >>> accept_drafts(jnp.array([5, 9, 4, 8]), jnp.array([5, 6, -1, -1])).tolist()
      [5, 9, -1, 8]
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    drafts = jnp.asarray(drafts, jnp.int32)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    rejected = ((drafts >= 0) & (tokens != drafts)).astype(jnp.int32)
    # Rejections strictly before each row, and before its request's first row
    # (one past the last row without a draft before it).
    before = jnp.cumsum(rejected) - rejected
    first = jax.lax.cummax(jnp.where(drafts < 0, rows + 1, 0), axis=0)
    first = jnp.concatenate([jnp.zeros(1, jnp.int32), first[:-1]])
    return jnp.where(before == before[first], tokens, -1)


def draft_rows(step: ScheduledStep, num_rows: int) -> tuple[list[str], np.ndarray]:
    """Per logits row of `step`: its request id, and the draft that follows it.

    ``(request ids, drafts (num_rows,) int32)``: a request verifying ``k``
    drafts has ``1 + k`` rows, the first ``k`` followed by its drafts, the
    last by ``-1`` (as every other request's one row); padding rows too.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1), num_blocks=8)
      >>> s = jaxkv.Scheduler(plan)
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1, 2], max_new_tokens=5))
      >>> _ = s.update(s.schedule(), [3]); s.running[0].spec_token_ids = [4, 5]
      >>> ids, drafts = jaxkv.serve.draft_rows(s.schedule(), 4)
      >>> ids, drafts.tolist()
      (['a', 'a', 'a'], [4, 5, -1, -1])
    """
    ids: list[str] = []
    drafts = np.full(num_rows, -1, np.int32)
    for req in step.sampled:
        spec = step.spec_token_ids.get(req.req_id, [])
        drafts[len(ids) : len(ids) + len(spec)] = spec
        ids += [req.req_id] * (len(spec) + 1)
    return ids, drafts


def accepted_rows(step: ScheduledStep, tokens: np.ndarray) -> list[list[int]]:
    """Per request of ``step.sampled``, its tokens that :func:`accept_drafts` kept.

    `tokens`: the step's sampled rows on the host (``-1`` past a rejection),
    laid out as :func:`draft_rows`.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1), num_blocks=8)
      >>> s = jaxkv.Scheduler(plan)
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1, 2], max_new_tokens=5))
      >>> _ = s.update(s.schedule(), [3]); s.running[0].spec_token_ids = [4, 5]
      >>> jaxkv.serve.accepted_rows(s.schedule(), np.array([4, 7, -1, 0]))
      [[4, 7]]
    """
    out, row = [], 0
    for req in step.sampled:
        n = len(step.spec_token_ids.get(req.req_id, [])) + 1
        seg = [int(t) for t in tokens[row : row + n]]
        out.append(seg[: seg.index(-1)] if -1 in seg else seg)
        row += n
    return out
