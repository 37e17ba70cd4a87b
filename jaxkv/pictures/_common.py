"""What every picture needs: matplotlib on demand, index checks that never wrap."""

from __future__ import annotations

import importlib
from typing import Any

from jaxkv._util import is_int
from jaxkv.plan import KVCachePlan


def _pyplot() -> Any:
    try:
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "jaxkv.pictures needs matplotlib: pip install 'jaxkv[pictures]'."
        ) from err


def _check_plan(fn: str, name: str, plan: object) -> None:
    """`plan` a :class:`KVCachePlan` (``make_plan``'s), or a clear error."""
    if not isinstance(plan, KVCachePlan):
        raise TypeError(
            f"{fn}: {name} must be a KVCachePlan (jaxkv.make_plan's), got "
            f"{type(plan).__name__}."
        )


def _check_index(fn: str, name: str, value: object, n: int) -> int:
    """`value` as an index in ``[0, n)``, or a clear error (never wrapped)."""
    if not is_int(value):
        raise TypeError(f"{fn}: {name} must be an int, got {value!r}.")
    if not 0 <= int(value) < n:
        raise ValueError(f"{fn}: {name}={value} is not in [0, {n}).")
    return int(value)
