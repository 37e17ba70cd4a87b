"""Counting traces and compilations, for "a new step does not recompile" checks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/backend_compile_duration",
)


@contextlib.contextmanager
def count_compilations() -> Iterator[list[str]]:
    """Yields a list that gains one entry per jaxpr trace or backend compile.

    Build a block's inputs before entering it: eager ops trace too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxkv
      >>> f = jax.jit(lambda x: x + 1)
      >>> x = jnp.ones(3)
      >>> with jaxkv.count_compilations() as events:
      ...     _ = f(x)
      ...     _ = f(x)
      >>> len(events)  # one trace and one compile, then the cache
      2
    """
    events: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        del duration_secs, kwargs
        if event in _EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
