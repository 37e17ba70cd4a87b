"""Small pytree helpers shared by the rest of the package."""

from __future__ import annotations

import dataclasses
from typing import Any


def static_field(**kwargs: Any) -> Any:
    """Dataclass field kept in the treedef: hashable, part of jit's cache key."""
    metadata = {**kwargs.pop("metadata", {}), "static": True}
    return dataclasses.field(metadata=metadata, **kwargs)


def check_positive_int(owner: str, name: str, value: object) -> None:
    """Raises unless `value` is a positive Python int (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be positive, got {value}.")


def check_non_negative_int(owner: str, name: str, value: object) -> None:
    """Raises unless `value` is a non-negative Python int (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r}.")
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value}.")


def reject_unsupported(owner: str, name: str, value: object, default: object) -> None:
    """Raises if a field jaxkv accepts for vLLM parity but does not implement is set.

    Raises:
      NotImplementedError: Naming the field, its value and the default.
    """
    if value != default:
        raise NotImplementedError(
            f"{owner}.{name}={value!r} is not implemented by jaxkv; only the default "
            f"{default!r} is supported."
        )


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
