"""One step's host inputs packed into one int32 buffer, and unpacked on device."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCapacity:
    """Capacities of a step and where each host field sits in the packed buffer.

    One int32 host buffer holds every per-step field of every group, so a step
    costs one host-to-device transfer; :func:`unpack_step` slices it on device.

    Args:
      max_reqs: Request capacity (the request bucket).
      max_tokens: Token capacity (the token bucket).
      block_table_widths: Block-table columns per KV-cache group.
      max_mm_ranges: Multimodal prefix ranges per request (0: none).
      num_samples: Room for the model's inputs too: ``token_ids``
        (``max_tokens``) and ``sample_idx`` (``num_samples``) when positive.

    Example:
      >>> import jaxkv
      >>> from jaxkv.step import StepCapacity
      >>> capacity = StepCapacity(max_reqs=4, max_tokens=8, block_table_widths=(2,))
      >>> capacity.size
      61
    """

    max_reqs: int
    max_tokens: int
    block_table_widths: tuple[int, ...]
    max_mm_ranges: int = 0
    num_samples: int = 0

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every packed field, in buffer order."""
        r, t = self.max_reqs, self.max_tokens
        out = [
            ("num_reqs", ()),
            ("num_tokens", ()),
            ("max_query_len", ()),
            ("max_seq_len", ()),
            ("query_start_loc", (r + 1,)),
            ("seq_lens", (r,)),
            ("positions", (t,)),
            ("is_prefilling", (r,)),
            ("token_to_req", (t,)),
            ("encoder_seq_lens", (r,)),
            ("mm_prefix_ranges", (r, self.max_mm_ranges, 2)),
            ("mm_num_ranges", (r,)),
            ("request_causal", (r,)),
        ]
        for g, width in enumerate(self.block_table_widths):
            out.append((f"block_table.{g}", (r, width)))
            out.append((f"slot_mapping.{g}", (t,)))
        if self.num_samples:
            out.append(("token_ids", (t,)))
            out.append(("sample_idx", (self.num_samples,)))
        return out

    @functools.cached_property
    def _offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out, pos = {}, 0
        for name, shape in self.fields():
            out[name] = (pos, shape)
            pos += math.prod(shape)
        return out

    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """``name -> (offset, shape)`` in the packed buffer (computed once)."""
        return self._offsets

    @property
    def size(self) -> int:
        """Int32 entries of the packed buffer."""
        return sum(math.prod(s) for _, s in self.fields())


def pack_step(
    capacity: StepCapacity,
    *,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    positions: np.ndarray,
    block_tables: Sequence[np.ndarray],
    slot_mappings: Sequence[np.ndarray],
    is_prefilling: np.ndarray | None = None,
    encoder_seq_lens: np.ndarray | None = None,
    mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    request_causal: np.ndarray | None = None,
    token_ids: np.ndarray | None = None,
    sample_idx: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Packs one step's host arrays into a single int32 buffer (NumPy only).

    Per-request arrays are padded to ``max_reqs`` (``query_start_loc`` repeats
    its last value), per-token arrays to ``max_tokens`` (slots with ``-1``),
    block tables with the null block ``0``.

    Args:
      capacity: The capacities.
      query_start_loc: ``(num_reqs + 1,)`` cumulative query lengths.
      seq_lens: ``(num_reqs,)`` context lengths after this step.
      positions: ``(num_tokens,)`` token positions.
      block_tables: Per KV-cache group ``(num_reqs, cols)`` manager block ids.
      slot_mappings: Per KV-cache group ``(num_tokens,)`` slots.
      is_prefilling: ``(num_reqs,)`` bools (default: query length > 1).
      encoder_seq_lens: ``(num_reqs,)`` encoder lengths (default zeros).
      mm_prefix_ranges: ``request -> inclusive ranges`` from
        :func:`compute_mm_prefix_ranges`.
      request_causal: ``(num_reqs,)`` bools, ``False`` for a request that
        attends to its whole context (default all ``True``).
      token_ids: ``(num_tokens,)`` model inputs (capacities with ``num_samples``).
      sample_idx: Token indices whose logits are sampled; padded with the last.
      out: A preallocated buffer of ``capacity.size`` int32 to fill (reused across
        steps to avoid allocation).

    Returns:
      The packed buffer.

    Raises:
      ValueError: If a field does not fit its capacity.
    """
    qsl = np.asarray(query_start_loc, np.int64)
    num_reqs = qsl.size - 1
    num_tokens = int(qsl[-1])
    if num_reqs > capacity.max_reqs or num_tokens > capacity.max_tokens:
        raise ValueError(
            f"A step of {num_reqs} requests and {num_tokens} tokens does not fit the "
            f"step's capacity ({capacity.max_reqs} requests, "
            f"{capacity.max_tokens} tokens)."
        )
    groups = len(capacity.block_table_widths)
    if len(block_tables) != groups or len(slot_mappings) != groups:
        raise ValueError(
            f"Expected {groups} block tables and slot mappings "
            f"(one per KV-cache group), got {len(block_tables)} and "
            f"{len(slot_mappings)}."
        )
    buf = np.zeros(capacity.size, np.int32) if out is None else out
    offs = capacity.offsets()

    def put(name: str, values: ArrayLike, fill: int = 0) -> None:
        off, shape = offs[name]
        view = buf[off : off + math.prod(shape)].reshape(shape)
        view[...] = fill
        values = np.asarray(values)
        if any(v > s for v, s in zip(values.shape, shape, strict=True)):
            raise ValueError(f"{name}.shape={values.shape} does not fit {shape}.")
        view[tuple(slice(0, n) for n in values.shape)] = values

    q_lens = np.diff(qsl)
    put("num_reqs", np.asarray(num_reqs))
    put("num_tokens", np.asarray(num_tokens))
    put("max_query_len", q_lens.max(initial=0))
    put("max_seq_len", np.max(seq_lens, initial=0))
    put("query_start_loc", qsl, fill=num_tokens)
    put("seq_lens", seq_lens)
    put("positions", positions)
    put("is_prefilling", q_lens > 1 if is_prefilling is None else is_prefilling)
    # Padding tokens belong to no request: max_reqs, what the searchsorted
    # of build_attn_metadata gives over the padded query_start_loc.
    put("token_to_req", np.repeat(np.arange(num_reqs), q_lens), fill=capacity.max_reqs)
    put(
        "encoder_seq_lens",
        np.zeros(num_reqs) if encoder_seq_lens is None else encoder_seq_lens,
    )
    ranges, counts = _mm_ranges(capacity, num_reqs, mm_prefix_ranges or {})
    put("mm_prefix_ranges", ranges)
    put("mm_num_ranges", counts)
    put(
        "request_causal",
        np.ones(0, np.int32) if request_causal is None else request_causal,
        fill=1,
    )
    for g, (table, slots) in enumerate(zip(block_tables, slot_mappings, strict=True)):
        put(f"block_table.{g}", table)
        put(f"slot_mapping.{g}", slots, fill=-1)
    if capacity.num_samples:
        put("token_ids", np.zeros(0, np.int32) if token_ids is None else token_ids)
        samples = (
            np.zeros(0, np.int32) if sample_idx is None else np.asarray(sample_idx)
        )
        put("sample_idx", samples, fill=int(samples[-1]) if samples.size else 0)
    return buf


def _mm_ranges(
    capacity: StepCapacity,
    num_reqs: int,
    mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]],
) -> tuple[np.ndarray, np.ndarray]:
    """``(ranges (num_reqs, max_mm_ranges, 2), counts (num_reqs,))``."""
    ranges = np.zeros((num_reqs, capacity.max_mm_ranges, 2), np.int32)
    counts = np.zeros(num_reqs, np.int32)
    for req, rs in mm_prefix_ranges.items():
        if len(rs) > capacity.max_mm_ranges:
            raise ValueError(
                f"Request {req} has {len(rs)} multimodal ranges; the capacity holds "
                f"{capacity.max_mm_ranges}."
            )
        counts[req] = len(rs)
        if rs:
            ranges[req, : len(rs)] = rs
    return ranges, counts


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "num_reqs",
        "num_tokens",
        "max_query_len",
        "max_seq_len",
        "query_start_loc",
        "seq_lens",
        "positions",
        "is_prefilling",
        "token_to_req",
        "encoder_seq_lens",
        "mm_prefix_ranges",
        "mm_num_ranges",
        "request_causal",
        "block_tables",
        "slot_mappings",
        "token_ids",
        "sample_idx",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepFields:
    """One step's fields on the device, by name: what :func:`unpack_step` gives.

    A pytree of arrays sized by the :class:`StepCapacity` (padding included);
    :func:`build_attn_metadata_from_step` turns it into every layer's
    metadata. Counts are int32 scalars; ``is_prefilling`` and
    ``request_causal`` are booleans.

    Attributes:
      num_reqs: Real requests.
      num_tokens: Real tokens.
      max_query_len: The longest query of the step.
      max_seq_len: The longest context after the step.
      query_start_loc: ``(max_reqs + 1,)`` cumulative query lengths.
      seq_lens: ``(max_reqs,)`` context lengths.
      positions: ``(max_tokens,)`` token positions.
      is_prefilling: ``(max_reqs,)``.
      token_to_req: ``(max_tokens,)`` each token's request (``max_reqs`` for
        padding tokens).
      encoder_seq_lens: ``(max_reqs,)``.
      mm_prefix_ranges: ``(max_reqs, max_mm_ranges, 2)`` inclusive ranges.
      mm_num_ranges: ``(max_reqs,)`` valid ranges per request.
      request_causal: ``(max_reqs,)``; ``False`` attends to the whole context.
      block_tables: Per KV-cache group ``(max_reqs, width)`` manager block ids.
      slot_mappings: Per KV-cache group ``(max_tokens,)`` slots (``-1`` pads).
      token_ids: ``(max_tokens,)`` model inputs, or ``None`` (no model inputs).
      sample_idx: ``(num_samples,)`` sampled token indices, or ``None``.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxkv.step import StepCapacity, pack_step, unpack_step
      >>> capacity = StepCapacity(max_reqs=2, max_tokens=4, block_table_widths=(1,))
      >>> packed = pack_step(capacity, query_start_loc=np.array([0, 3]),
      ...     seq_lens=np.array([3]), positions=np.arange(3),
      ...     block_tables=[np.array([[1]])], slot_mappings=[np.arange(3)])
      >>> f = unpack_step(jnp.asarray(packed), capacity)
      >>> int(f.num_tokens), f.slot_mappings[0].tolist(), f.is_prefilling.tolist()
      (3, [0, 1, 2, -1], [True, False])
    """

    num_reqs: jax.Array
    num_tokens: jax.Array
    max_query_len: jax.Array
    max_seq_len: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    positions: jax.Array
    is_prefilling: jax.Array
    token_to_req: jax.Array
    encoder_seq_lens: jax.Array
    mm_prefix_ranges: jax.Array
    mm_num_ranges: jax.Array
    request_causal: jax.Array
    block_tables: tuple[jax.Array, ...]
    slot_mappings: tuple[jax.Array, ...]
    token_ids: jax.Array | None = None
    sample_idx: jax.Array | None = None

    @classmethod
    def of_layout_fields(
        cls, arrays: Mapping[str, jax.Array], capacity: StepCapacity
    ) -> StepFields:
        """The record of arrays named as :meth:`StepCapacity.fields` names them.

        ``"block_table.0"``, .... Each of its field's shape.
        """
        raw = dict(arrays)
        groups = range(len(capacity.block_table_widths))
        return cls(
            block_tables=tuple(raw.pop(f"block_table.{g}") for g in groups),
            slot_mappings=tuple(raw.pop(f"slot_mapping.{g}") for g in groups),
            is_prefilling=jnp.asarray(raw.pop("is_prefilling")).astype(jnp.bool_),
            request_causal=jnp.asarray(raw.pop("request_causal")).astype(jnp.bool_),
            **raw,
        )


def unpack_step(packed: jax.Array | np.ndarray, capacity: StepCapacity) -> StepFields:
    """Slices a packed step buffer into its named fields (jittable; static slices).

    Empty fields (no multimodal ranges, say) are fresh zero-size arrays, not
    reshaped slices: under ``vmap`` over a buffer sharded on an Explicit mesh
    axis, JAX refuses to reshape a zero-size sharded slice. A host (NumPy)
    buffer is taken as a JAX array first, so every field is one.
    """
    packed = jnp.asarray(packed)
    raw = {}
    for name, (off, shape) in capacity.offsets().items():
        size = math.prod(shape)
        raw[name] = (
            packed[off : off + size].reshape(shape)
            if size
            else jnp.zeros(shape, packed.dtype)
        )
    return StepFields.of_layout_fields(raw, capacity)
