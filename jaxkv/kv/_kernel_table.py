"""Kernel tables: which implementation of an operation each platform runs, as data.

One :class:`KernelTable` per operation (``write_kv``'s, ``paged_attention``'s)
lists its kernels (:class:`Kernel`): the platforms each is compiled for, the
family name that asks for it there (``"pallas"``), whether ``None`` picks it,
why it cannot take a call, and its tuned constants per platform. Both
operations choose through the same :meth:`KernelTable.pick`; adding a platform
or a kernel is one :meth:`KernelTable.register`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

GPU_PLATFORMS = ("cuda", "rocm")
"""The GPU platforms JAX lowers for (Triton runs on both)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of one operation: an entry of a :class:`KernelTable`.

    Attributes:
      name: What ``implementation=`` names (``"pallas_gpu"``).
      run: The kernel, called with the operation's arguments and
        ``interpret=`` (``True`` on a platform it is not compiled for) and
        ``platform=`` (the one lowered for).
      platforms: The platforms it is compiled for; ``()``: every platform
        (the table's fallback).
      unfit: ``unfit(*call) -> reason | None``: why it cannot take a call
        (the operation's static arguments); ``None``: it can.
      family: The family name that asks for it on its platforms
        (``"pallas"``); a platform with no kernel of the family runs the
        family's first kernel, interpreted.
      default: Whether ``implementation=None`` picks it on its platforms
        where it fits (the first such kernel registered wins).
      interpretable: Whether it runs interpreted on the other platforms (a
        Pallas kernel); otherwise it is called as on its own.
      tuning: Tuned constants per platform (``"*"``: every other one), read
        with :meth:`KernelTable.tuned`.
    """

    name: str
    run: Callable[..., Any]
    platforms: tuple[str, ...] = ()
    unfit: Callable[..., str | None] = lambda *_: None
    family: str | None = None
    default: bool = False
    interpretable: bool = False
    tuning: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def runs_on(self, platform: str) -> bool:
        """Whether it is compiled for `platform` (not interpreted there)."""
        return not self.platforms or platform in self.platforms


class KernelTable:
    """The kernels of one operation and how a call picks one per platform.

    Args:
      operation: The operation's name, for errors (``"write_kv"``).
      fallback: The kernel every platform can run for every call (XLA's).

    Example:
      >>> from jaxkv.kv import Kernel, KernelTable
      >>> table = KernelTable("op", Kernel("xla", run=lambda: "xla"))
      >>> table.register(Kernel("fast", run=lambda: "fast", platforms=("tpu",),
      ...     family="pallas", default=True,
      ...     unfit=lambda n: "too big" if n > 4 else None))
      >>> table.platforms, table.implementations
      (('cpu', 'tpu'), (None, 'xla', 'pallas', 'fast'))
      >>> table.pick(None, 2), table.pick(None, 8)
      ({'cpu': 'xla', 'tpu': 'fast'}, {'cpu': 'xla', 'tpu': 'xla'})
      >>> table.pick("pallas", 2)  # on CPU: the family's kernel, interpreted
      {'cpu': 'fast', 'tpu': 'fast'}
      >>> table.pick("fast", 8)
      Traceback (most recent call last):
      ...
      ValueError: op: implementation='fast' (fast) cannot run this call: too big.
    """

    def __init__(self, operation: str, fallback: Kernel) -> None:
        self.operation = operation
        self.fallback = fallback
        self._kernels: dict[str, Kernel] = {fallback.name: fallback}

    def register(self, kernel: Kernel) -> None:
        """Adds `kernel` (replacing one of the same name).

        A program already traced keeps the kernel it picked: register before
        the first call (or clear JAX's caches).
        """
        if kernel.name == self.fallback.name or kernel.name in self.families:
            raise ValueError(
                f"{self.operation}: a kernel may not be named {kernel.name!r} (the "
                "fallback's or a family's name)."
            )
        self._kernels[kernel.name] = kernel

    def unregister(self, name: str) -> None:
        """Removes the kernel `name` (not the fallback)."""
        if name == self.fallback.name:
            raise ValueError(f"{self.operation}: the fallback stays registered.")
        del self._kernels[name]

    @contextmanager
    def registered(self, kernel: Kernel) -> Iterator[Kernel]:
        """`kernel` registered inside the ``with`` block, the table as it was after.

        The table as it was afterwards (a kernel it replaced comes back).
        """
        before = dict(self._kernels)
        self.register(kernel)
        try:
            yield kernel
        finally:
            self._kernels = before

    def __getitem__(self, name: str) -> Kernel:
        """The kernel `name`."""
        return self._kernels[name]

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        """Every kernel, the fallback first, then in registration order."""
        return tuple(self._kernels.values())

    @property
    def platforms(self) -> tuple[str, ...]:
        """``"cpu"`` and every platform a kernel is compiled for, in order."""
        seen = ["cpu"]
        for kernel in self.kernels:
            seen += [p for p in kernel.platforms if p not in seen]
        return tuple(seen)

    @property
    def families(self) -> tuple[str, ...]:
        """The family names, in registration order."""
        names = [k.family for k in self.kernels if k.family is not None]
        return tuple(dict.fromkeys(names))

    @property
    def implementations(self) -> tuple[str | None, ...]:
        """What ``implementation=`` takes: ``None``, the families, each kernel."""
        rest = [k.name for k in self.kernels if k is not self.fallback]
        return (None, self.fallback.name, *self.families, *rest)

    def tuned(self, name: str, platform: str) -> Mapping[str, Any]:
        """Kernel `name`'s tuned constants on `platform` (``"*"``'s elsewhere)."""
        tuning = self[name].tuning
        return tuning.get(platform, tuning.get("*", {}))

    def _on(self, implementation: str | None, platform: str, call: tuple) -> str:
        if implementation is None:
            for kernel in self.kernels:
                if (
                    kernel.default
                    and platform in kernel.platforms
                    and kernel.unfit(*call) is None
                ):
                    return kernel.name
            return self.fallback.name
        if implementation in self.families:
            family = [k for k in self.kernels if k.family == implementation]
            own = [k for k in family if platform in k.platforms]
            return (own or family)[0].name
        return implementation

    def pick(
        self, implementation: str | None, *call: Any, platforms: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """The kernel each platform runs for `implementation` and this call.

        Args:
          implementation: One of :attr:`implementations`.
          call: The operation's static arguments, as each kernel's ``unfit``
            takes them.
          platforms: The platforms to pick for (``()``: all of
            :attr:`platforms`).

        Returns:
          ``platform -> kernel name``.

        Raises:
          ValueError: For a name not in :attr:`implementations`, or one asked
            for by name (or family) that cannot take the call on one of the
            platforms (naming why).
        """
        if implementation not in self.implementations:
            raise ValueError(
                f"{self.operation}: implementation={implementation!r}, expected one "
                f"of {self.implementations}."
            )
        picks = {
            p: self._on(implementation, p, call) for p in platforms or self.platforms
        }
        if implementation is not None:
            for name in dict.fromkeys(picks.values()):
                reason = self[name].unfit(*call)
                if reason is not None:
                    raise ValueError(
                        f"{self.operation}: implementation={implementation!r} "
                        f"({name}) cannot run this call: {reason}."
                    )
        return picks
