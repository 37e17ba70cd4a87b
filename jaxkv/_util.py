"""Small pytree helpers shared by the rest of the package."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

import jax
import numpy as np

_T = TypeVar("_T")
F = TypeVar("F", bound=Callable[..., Any])


def static_field(**kwargs: Any) -> Any:
    """Dataclass field kept in the treedef: hashable, part of jit's cache key."""
    metadata = {**kwargs.pop("metadata", {}), "static": True}
    return dataclasses.field(metadata=metadata, **kwargs)


def host_field(**kwargs: Any) -> Any:
    """Dataclass field left out of the pytree: a host copy, ``None`` inside jit."""
    metadata = {**kwargs.pop("metadata", {}), "host": True}
    return dataclasses.field(default=None, metadata=metadata, **kwargs)


def pytree_dataclass(cls: type[_T]) -> type[_T]:
    """Registers a dataclass as a pytree from its field declarations alone.

    Fields made with :func:`static_field` go to the treedef, fields made with
    :func:`host_field` are dropped (rebuilt as ``None``), every other field is a
    leaf: each field is declared once, where it is defined.
    """
    fields = dataclasses.fields(cls)  # pyright: ignore[reportArgumentType]
    # JAX rebuilds a pytree node with whatever leaves a transformation carries
    # (tracers, ShapeDtypeStructs, lowering's ArgInfo, None), so its fields'
    # annotations describe the arrays, and run-time checkers skip __init__.
    cls.__no_type_check__ = True  # pyright: ignore[reportAttributeAccessIssue]
    return jax.tree_util.register_dataclass(
        cls,
        data_fields=[
            f.name for f in fields if not ({"static", "host"} & set(f.metadata))
        ],
        meta_fields=[f.name for f in fields if f.metadata.get("static")],
        drop_fields=[f.name for f in fields if f.metadata.get("host")],
    )


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(
        value, bool | np.bool_
    )


def check_positive_int(owner: str, name: str, value: object) -> int:
    """`value` as an int; raises unless it is a positive int.

    Python or NumPy; bools rejected.
    """
    if not is_int(value):
        raise TypeError(
            f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})."
        )
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be positive, got {value}.")
    return int(value)


def check_non_negative_int(owner: str, name: str, value: object) -> int:
    """`value` as an int; raises unless it is a non-negative int.

    Python or NumPy; bools rejected.
    """
    if not is_int(value):
        raise TypeError(
            f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})."
        )
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value}.")
    return int(value)


def check_bool(owner: str, name: str, value: object) -> bool:
    """`value`; raises unless it is a bool (``"no"``, ``1`` or ``None`` are not).

    Example:
      >>> from jaxkv._util import check_bool
      >>> check_bool("Opts", "overlap", False)
      False
      >>> check_bool("Opts", "overlap", "no")
      Traceback (most recent call last):
      ...
      TypeError: Opts.overlap must be True or False, got 'no' (str).
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{owner}.{name} must be True or False, got {value!r} "
            f"({type(value).__name__})."
        )
    return bool(value)


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


def host_int_array(value: object, name: str) -> np.ndarray:
    """`value` as a host NumPy array of integers (ids, counts, positions).

    Raises:
      TypeError: If `value` is a traced value (host checks run before jit)
        or does not hold integers (float ids would be truncated, NaN would
        become 0). `name` names the argument in the message.
    """
    try:
        arr = np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(
            f"{name} is a traced value: host checks look at values before jit "
            "(inside jit, invalid ids are dropped instead)."
        ) from None
    if arr.size == 0 and arr.dtype.kind == "f":  # [] is float64 to NumPy
        return arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integer ids, got dtype {arr.dtype} (float ids would "
            "be truncated and NaN would become 0)."
        )
    return arr


def checks_own_arguments(fn: F) -> F:
    """Marks `fn` as validating its arguments itself, with errors naming them.

    Run-time type checkers (jaxtyping's import hook with beartype, switched on
    for the test suite) skip such a function, so a bad argument gets its own
    message ("slot_mapping.shape=(3,), expected (4,) ...") rather than a
    generic type-check error; its annotations still document the shapes and
    static checkers still read them. Place it directly above ``def``:
    jaxtyping's hook wraps the bare function and reads the mark on its own
    wrapper.
    """
    fn.__no_type_check__ = True  # pyright: ignore[reportFunctionMemberAccess]
    return fn


def varying_like(values: Any, refs: tuple[Any, ...]) -> Any:
    """`values` cast to vary over every mesh axis some of `refs` vary over.

    Outside ``shard_map`` nothing varies and `values` come back unchanged.
    """
    axes: set[Any] = set()
    for ref in refs:
        axes |= varying_axes(ref)
    if not axes:
        return values

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, values)


def varying_axes(x: Any) -> set[Any]:
    """Mesh axes `x` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return set(manual.varying)
    return set(getattr(aval, "vma", None) or ())  # later jax


def kernel_operands(
    operands: tuple[Any, ...], out_shape: tuple[int, ...], dtype: Any
) -> tuple[tuple[Any, ...], jax.ShapeDtypeStruct]:
    """A Pallas call's operands and output type under ``shard_map``.

    With ``check_vma`` on, a kernel's operands and result must agree on the
    mesh axes they vary over: the operands are cast to vary over every axis
    one of them varies over, and the result is declared to vary over those.
    Outside ``shard_map`` they come back as they are.
    """
    operands = varying_like(operands, operands)
    axes: set[Any] = set()
    mats = []
    for x in operands:
        axes |= varying_axes(x)
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
        if mat is not None:
            mats.append(mat)
    if not mats:  # jax without manual axis types
        return operands, jax.ShapeDtypeStruct(out_shape, dtype)
    mat = mats[0].update(varying=frozenset(axes))
    return operands, jax.ShapeDtypeStruct(out_shape, dtype, manual_axis_type=mat)
