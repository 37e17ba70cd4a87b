"""A record of the cache writes made while a function is traced.

:class:`ServingLoop` traces your `forward` once under :func:`recording_writes`
to check that every KV-owning layer's write reaches the pools it returns
(``jaxkv/serve/_write_check.py``). While recording, each ``write_kv`` and
``write_mamba_state`` call is logged: its view, its layer slot, and the
pool array it was given and the one it returned (tracers, compared by
identity while the trace is alive; a jitted write returns every pool
anew). Nothing is recorded outside that check.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple


class Write(NamedTuple):
    """One write seen while recording."""

    op: str  # "write_kv" or "write_mamba_state"
    view: Any  # the view written through
    layer: Any  # the layer= argument: None, an int, or a traced slot
    given: tuple  # the pools it was given
    returned: tuple  # the pools it returned (every one a new array under jit)


_local = threading.local()


@contextlib.contextmanager
def recording_writes() -> Iterator[list[Write]]:
    """Logs the writes made inside the block (see the module)."""
    stack = _local.__dict__.setdefault("stack", [])
    log: list[Write] = []
    stack.append(log)
    try:
        yield log
    finally:
        stack.pop()


def record(op: str, view: Any, layer: Any, given: Any, returned: Any) -> None:
    """Logs a write (`given` and `returned`: the pools) when recording."""
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(Write(op, view, layer, tuple(given), tuple(returned)))
