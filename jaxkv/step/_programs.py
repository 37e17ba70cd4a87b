"""One cache of compiled executables per jitted function, keyed by the program."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax


class Programs:
    """Compiles a function ahead of time per program and runs the right one.

    A *program* is a hashable key that determines the compiled code: for a step,
    its packed capacity and fast-prefill padding (two buckets that give the same
    program share one executable). :meth:`compile` lowers and compiles from
    ``jax.ShapeDtypeStruct`` arguments, allocating nothing; :meth:`__call__`
    runs the compiled executable of a key, or falls back to ``jax.jit`` (which
    compiles on first use) for a key that was never compiled. The function must
    be pure: it is traced once per program.

    Args:
      fn: The function.
      donate_argnums: Arguments donated to every call.
      keep_unused: Keep arguments the function does not read (a donated
        buffer whose memory the result reuses).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxkv
      >>> progs = jaxkv.Programs(lambda x: x * 2)
      >>> progs.compile(4, jax.ShapeDtypeStruct((4,), jnp.int32))
      >>> progs(4, jnp.arange(4, dtype=jnp.int32)).tolist(), len(progs)
      ([0, 2, 4, 6], 1)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        donate_argnums: int | Sequence[int] = (),
        keep_unused: bool = False,
    ) -> None:
        """Wraps `fn` in one ``jax.jit``."""
        self._jit = jax.jit(fn, donate_argnums=donate_argnums, keep_unused=keep_unused)
        self._compiled: dict[Hashable, Any] = {}

    def compile(self, key: Hashable, *abstract_args: Any) -> None:
        """Compiles the program `key` from abstract arguments (once per key)."""
        if key not in self._compiled:
            self._compiled[key] = self._jit.lower(*abstract_args).compile()

    def __call__(self, key: Hashable, *args: Any) -> Any:
        """Runs program `key` (compiled ahead of time, or jitted on first use)."""
        exe = self._compiled.get(key)
        return self._jit(*args) if exe is None else exe(*args)

    def __contains__(self, key: object) -> bool:
        """Whether program `key` was compiled ahead of time."""
        return key in self._compiled

    def __len__(self) -> int:
        """Programs compiled ahead of time."""
        return len(self._compiled)

    def keys(self) -> list[Hashable]:
        """Keys of the programs compiled ahead of time."""
        return list(self._compiled)

    def executables(self) -> list[Any]:
        """The compiled executables (``jax.stages.Compiled``), for inspection."""
        return list(self._compiled.values())
