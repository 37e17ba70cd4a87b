"""Jit buckets: the JAX counterpart of CUDA-graph capture sizes (spec §4)."""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax

from jaxkv._util import check_positive_int
from jaxkv.config import AttentionCGSupport


class CompileMode(enum.Enum):
    """How a step runs: the counterpart of vLLM's ``CUDAGraphMode``.

    ``FULL``: the whole step is one executable whose attention metadata capacity
    is fixed by the bucket. ``PIECEWISE``: the step is bucketed but attention
    planning may vary (the fast-prefill branch is only taken here). ``NONE``:
    no bucket (before warm-up, or a batch above the largest bucket).
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchDescriptor:
    """The executable a step will use: padded sizes and compile mode.

    Example:
      >>> import jaxkv
      >>> d = jaxkv.vllm.BatchDescriptor(num_tokens=16, num_reqs=4,
      ...     cg_mode=jaxkv.vllm.CompileMode.FULL)
      >>> d.key
      (16, 4, 'full', 0, 1)
    """

    num_tokens: int
    num_reqs: int
    cg_mode: CompileMode
    num_active_loras: int = 0
    num_ubatches: int = 1

    @property
    def key(self) -> tuple[int, int, str, int, int]:
        """Hashable identity of the executable."""
        return (
            self.num_tokens,
            self.num_reqs,
            self.cg_mode.value,
            self.num_active_loras,
            self.num_ubatches,
        )


def smallest_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket ``>= n``, or ``None`` past the largest.

    Example:
      >>> import jaxkv
      >>> from jaxkv.step import smallest_bucket
      >>> smallest_bucket((1, 2, 4, 8, 16), 3), smallest_bucket((8,), 9)
      (4, None)
    """
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class BucketDispatcher:
    """Picks the smallest token (and request) bucket for a step, on the host.

    Before :meth:`warm_up` (or :meth:`mark_ready`), with no buckets, or for a
    batch above the largest bucket, nothing is padded and the mode is ``NONE``.
    Otherwise the step is padded to the smallest bucket that fits; the mode is
    ``FULL`` when the backends' compile support covers the batch composition
    (``ALWAYS``: any; ``UNIFORM_BATCH``: uniform query lengths;
    ``UNIFORM_SINGLE_TOKEN_DECODE``: pure decode), else ``PIECEWISE``.

    Args:
      token_buckets: Ascending token buckets.
      request_buckets: Ascending request buckets; empty means requests are
        padded to ``min(token bucket, max_num_reqs)``.
      max_num_tokens: Most tokens in a step.
      max_num_reqs: Most requests in a step.
      cg_support: Weakest compile support of the model's backends.

    Example:
      >>> import jaxkv
      >>> d = jaxkv.BucketDispatcher(token_buckets=(1, 2, 4, 8, 16),
      ...     max_num_tokens=16, max_num_reqs=8)
      >>> d.dispatch(num_reqs=3, num_tokens=3).cg_mode.name  # not warmed up
      'NONE'
      >>> d.mark_ready()
      >>> desc = d.dispatch(num_reqs=3, num_tokens=3)
      >>> desc.num_tokens, desc.num_reqs, desc.cg_mode.name
      (4, 4, 'FULL')
    """

    def __init__(
        self,
        *,
        token_buckets: Sequence[int],
        max_num_tokens: int,
        max_num_reqs: int,
        request_buckets: Sequence[int] = (),
        cg_support: AttentionCGSupport = AttentionCGSupport.ALWAYS,
    ) -> None:
        """Validates and stores the buckets."""
        check_positive_int("BucketDispatcher", "max_num_tokens", max_num_tokens)
        check_positive_int("BucketDispatcher", "max_num_reqs", max_num_reqs)
        for name, buckets in (
            ("token_buckets", token_buckets),
            ("request_buckets", request_buckets),
        ):
            if list(buckets) != sorted(set(buckets)) or any(b <= 0 for b in buckets):
                raise ValueError(
                    f"BucketDispatcher.{name} must be positive and strictly ascending, "
                    f"got {tuple(buckets)}."
                )
        self.token_buckets = tuple(b for b in token_buckets if b <= max_num_tokens)
        self.request_buckets = tuple(b for b in request_buckets if b <= max_num_reqs)
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.cg_support = AttentionCGSupport(cg_support)
        self.ready = False

    def mark_ready(self) -> None:
        """Start padding to buckets (as after capture)."""
        self.ready = True

    def _full_ok(self, uniform_token_count: int | None) -> bool:
        support = self.cg_support
        if support == AttentionCGSupport.ALWAYS:
            return True
        if support == AttentionCGSupport.UNIFORM_BATCH:
            return uniform_token_count is not None
        if support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            return uniform_token_count == 1
        return False

    def token_bucket(self, num_tokens: int) -> int | None:
        """The smallest token bucket holding `num_tokens`, or ``None``."""
        return smallest_bucket(self.token_buckets, num_tokens)

    def request_bucket(self, num_reqs: int, num_tokens_padded: int) -> int | None:
        """Padded request count for a step of `num_tokens_padded` tokens."""
        if self.request_buckets:
            return smallest_bucket(self.request_buckets, num_reqs)
        padded = min(num_tokens_padded, self.max_num_reqs)
        return padded if padded >= num_reqs else None

    def dispatch(
        self,
        *,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        num_ubatches: int = 1,
    ) -> BatchDescriptor:
        """The descriptor (padded sizes, mode) of a step.

        Args:
          num_reqs: Real requests in the step.
          num_tokens: Real tokens in the step.
          uniform_token_count: Tokens per request if all requests have the same
            query length, else ``None``.
          num_active_loras: LoRA variant of the executable.
          num_ubatches: Micro-batches.

        Returns:
          The descriptor.
        """
        none = BatchDescriptor(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            cg_mode=CompileMode.NONE,
            num_active_loras=num_active_loras,
            num_ubatches=num_ubatches,
        )
        if not self.ready or not self.token_buckets or num_tokens <= 0:
            return none
        tokens = smallest_bucket(self.token_buckets, num_tokens)
        if tokens is None:
            return none
        reqs = self.request_bucket(num_reqs, tokens)
        if reqs is None:
            return none
        mode = (
            CompileMode.FULL
            if self._full_ok(uniform_token_count)
            else CompileMode.PIECEWISE
        )
        return BatchDescriptor(
            num_tokens=tokens,
            num_reqs=reqs,
            cg_mode=mode,
            num_active_loras=num_active_loras,
            num_ubatches=num_ubatches,
        )

    def check(self, *, num_reqs: int, num_tokens: int) -> None:
        """Host-side check that a step fits the largest bucket and the limits.

        Raises:
          ValueError: Naming the size that does not fit.

        Example:
          >>> import jaxkv
          >>> d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=8,
          ...     max_num_reqs=4)
          >>> d.check(num_reqs=2, num_tokens=9)
          Traceback (most recent call last):
          ...
          ValueError: A step of 9 tokens exceeds the largest token bucket (8).
        """
        largest = self.token_buckets[-1] if self.token_buckets else self.max_num_tokens
        if num_tokens > min(largest, self.max_num_tokens):
            raise ValueError(
                f"A step of {num_tokens} tokens exceeds the largest token bucket "
                f"({min(largest, self.max_num_tokens)})."
            )
        largest_reqs = (
            self.request_buckets[-1] if self.request_buckets else self.max_num_reqs
        )
        if num_reqs > min(largest_reqs, self.max_num_reqs):
            raise ValueError(
                f"A step of {num_reqs} requests exceeds the largest request bucket "
                f"({min(largest_reqs, self.max_num_reqs)})."
            )

    def executables(self) -> list[BatchDescriptor]:
        """Every (token bucket, request bucket, mode) a warmed-up config can use.

        Example:
          >>> import jaxkv
          >>> d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=8,
          ...     max_num_reqs=4)
          >>> [(e.num_tokens, e.num_reqs, e.cg_mode.name) for e in d.executables()]
          [(4, 4, 'PIECEWISE'), (4, 4, 'FULL'), (8, 4, 'PIECEWISE'), (8, 4, 'FULL')]
        """
        modes = [CompileMode.PIECEWISE]
        if self.cg_support != AttentionCGSupport.NEVER:
            modes.append(CompileMode.FULL)
        out = []
        for tokens in self.token_buckets:
            reqs_options = (
                [r for r in self.request_buckets]
                if self.request_buckets
                else [min(tokens, self.max_num_reqs)]
            )
            for reqs in reqs_options:
                for mode in modes:
                    out.append(
                        BatchDescriptor(num_tokens=tokens, num_reqs=reqs, cg_mode=mode)
                    )
        return out


def shape_struct(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    """Shorthand for ``jax.ShapeDtypeStruct(tuple(shape), dtype)``."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype)
