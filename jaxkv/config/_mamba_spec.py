"""The spec of a Mamba-style layer: per-request state arrays, one block each."""

from __future__ import annotations

import math

import numpy as np
from jax.typing import DTypeLike

from jaxkv._util import (
    check_positive_int,
    is_int,
    reject_unsupported,
)
from jaxkv.config._specs import (
    KVCacheSpec,
    draft_field,
    normalize_dtype,
    spec_dataclass,
)


@spec_dataclass
class MambaSpec(KVCacheSpec):
    """Recurrent state of a Mamba-style layer: one page per block.

    State ``i`` occupies ``prod(shapes[i]) * itemsize(dtypes[i])`` bytes and
    starts at ``state_offsets[i]`` inside the page; states are packed in
    declaration order and ``[U, P)`` is padding. ``shard_axes[i]`` is the axis
    of state ``i`` split over a tensor-parallel mesh axis (its heads or
    channels), ``None`` to replicate it; empty: every state replicated (a jaxkv
    extension, see :func:`local_runner_config`).

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.MambaSpec(block_size=80, shapes=((3, 2304), (8, 64, 128)),
      ...     dtypes=("bfloat16", "float32"), page_size_padded=327680)
      >>> spec.real_page_size_bytes, spec.page_size_bytes, spec.state_offsets
      (275968, 327680, (0, 13824))
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DTypeLike, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    shard_axes: tuple[int | None, ...] = ()
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    is_draft: bool = draft_field()

    def __post_init__(self) -> None:
        check_positive_int("MambaSpec", "block_size", self.block_size)
        object.__setattr__(self, "block_size", int(self.block_size))
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, tuple | list) or not all(map(is_int, shape)):
                raise TypeError(
                    f"MambaSpec.shapes[{i}]={shape!r} must be a tuple of ints (one "
                    "shape per state, e.g. shapes=((3, 256), (8, 64, 16)))."
                )
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if not shapes:
            raise ValueError("MambaSpec.shapes must name at least one state, got ().")
        for shape in shapes:
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(
                    "MambaSpec.shapes must hold non-empty positive shapes, "
                    f"got {shape}."
                )
        if len(self.dtypes) != len(shapes):
            raise ValueError(
                f"MambaSpec.dtypes has {len(self.dtypes)} entries but shapes has "
                f"{len(shapes)}; give one dtype per state."
            )
        dtypes = tuple(normalize_dtype("MambaSpec", d) for d in self.dtypes)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        axes = tuple(self.shard_axes)
        if axes and (
            len(axes) != len(shapes)
            or any(
                a is not None and not 0 <= a < len(s)
                for a, s in zip(axes, shapes, strict=True)
            )
        ):
            raise ValueError(
                f"MambaSpec.shard_axes={axes} must give one axis (or None) per "
                f"state of shapes {shapes}."
            )
        object.__setattr__(self, "shard_axes", axes)
        reject_unsupported(
            "MambaSpec", "num_speculative_blocks", self.num_speculative_blocks, 0
        )
        reject_unsupported(
            "MambaSpec", "mamba_cache_mode", self.mamba_cache_mode, "none"
        )
        for offset, dtype in zip(self.state_offsets, dtypes, strict=True):
            if offset % np.dtype(dtype).itemsize:
                raise ValueError(
                    f"MambaSpec state of dtype {np.dtype(dtype).name} starts at "
                    f"byte {offset}, which is not a multiple of its itemsize; "
                    "reorder the states."
                )
        if self.page_size_padded is not None:
            check_positive_int("MambaSpec", "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(
                    f"MambaSpec.page_size_padded={self.page_size_padded} is smaller "
                    f"than the unpadded page of {self.real_page_size_bytes} bytes."
                )

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state (``S_i``)."""
        return tuple(
            math.prod(s) * np.dtype(d).itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state inside a page (``off_i``)."""
        offsets, total = [], 0
        for size in self.state_bytes:
            offsets.append(total)
            total += size
        return tuple(offsets)

    @property
    def real_page_size_bytes(self) -> int:
        """``U = sum(S_i)``."""
        return sum(self.state_bytes)

    @property
    def page_size_bytes(self) -> int:
        """``P``: ``page_size_padded`` if set, else ``U``."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes
