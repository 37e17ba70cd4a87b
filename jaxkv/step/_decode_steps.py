"""Several decode iterations in one dispatch (multi-step decoding).

Several decode iterations in one dispatch: a decode step's packed buffer
advanced on the host, one row per iteration (multi-step decoding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.step._step_inputs import StepInputs


def decode_step_inputs(
    inputs: StepInputs, *, num_reqs: int, step_slots: Sequence[np.ndarray]
) -> StepInputs:
    """The inputs of `num_steps` decode iterations from those of the first.

    Iteration ``i`` is the decode step ``i`` tokens later: positions, context
    lengths and the longest context ``+ i``, each group's slots from
    `step_slots` (``-1``: the request has had its tokens, its write dropped),
    and every input token the placeholder of its own request's token sampled
    by iteration ``i - 1`` (``-(k + 1)`` for request ``k``, read on the
    device). The block tables are the first step's: they hold every
    iteration's blocks (:meth:`Scheduler.schedule_decode` allocates them).

    Args:
      inputs: The first iteration's inputs (``builder.prepare`` of a decode
        step of one token per request, every request sampled, packed buffer
        still on the host, with model inputs).
      num_reqs: The step's requests (= its tokens).
      step_slots: Per KV-cache group ``(num_steps, num_reqs)`` slots.

    Returns:
      The inputs with a ``(num_steps, capacity.size)`` packed buffer.

    Raises:
      ValueError: If the slots are not one ``(num_steps, num_reqs)`` array per
        group of the capacity, or the capacity packs no model inputs.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> from jaxkv.step import StepCapacity, pack_step, decode_step_inputs
      >>> capacity = StepCapacity(max_reqs=2, max_tokens=2, block_table_widths=(2,),
      ...                     num_samples=2)
      >>> packed = pack_step(capacity, query_start_loc=np.array([0, 1]),
      ...     seq_lens=np.array([5]), positions=np.array([4]),
      ...     block_tables=[np.array([[1, 2]])], slot_mappings=[np.array([20])],
      ...     token_ids=np.array([9]), sample_idx=np.array([0]))
      >>> inputs = jaxkv.StepInputs(packed=packed, fast_prefill=None, capacity=capacity)
      >>> out = decode_step_inputs(inputs, num_reqs=1,
      ...                          step_slots=[np.array([[20], [21], [-1]])])
      >>> off = capacity.offsets()
      >>> [int(row[off["positions"][0]]) for row in out.packed]
      [4, 5, 6]
      >>> [int(row[off["token_ids"][0]]) for row in out.packed]
      [9, -1, -1]
      >>> [(int(row[off["seq_lens"][0]]), int(row[off["max_seq_len"][0]]))
      ...  for row in out.packed]  # the longest context grows with the rest
      [(5, 5), (6, 6), (7, 7)]
    """
    capacity = inputs.capacity
    groups = len(capacity.block_table_widths)
    if not capacity.num_samples:
        raise ValueError(
            "decode_step_inputs: the capacity packs no model inputs (a builder made "
            "with model_inputs=True)."
        )
    if len(step_slots) != groups:
        raise ValueError(
            f"decode_step_inputs: {len(step_slots)} slot arrays for the capacity's "
            f"{groups} KV-cache groups."
        )
    num_steps = int(np.shape(step_slots[0])[0]) if groups else 1
    for g, slots in enumerate(step_slots):
        if np.shape(slots) != (num_steps, num_reqs):
            raise ValueError(
                f"decode_step_inputs: step_slots[{g}].shape={np.shape(slots)}, "
                f"expected ({num_steps}, {num_reqs})."
            )
    first = np.asarray(inputs.packed)
    if first.shape != (capacity.size,):
        raise ValueError(
            f"decode_step_inputs: inputs.packed.shape={first.shape}, expected one "
            f"step's ({capacity.size},)."
        )
    off = capacity.offsets()
    packed = np.repeat(first[None], num_steps, axis=0)
    ahead = np.arange(num_steps, dtype=np.int32)[:, None]
    n = num_reqs

    def field(name: str, size: int) -> np.ndarray:
        start = off[name][0]
        return packed[:, start : start + size]

    field("positions", n)[...] += ahead
    field("seq_lens", n)[...] += ahead
    field("max_seq_len", 1)[...] += ahead
    for g, slots in enumerate(step_slots):
        field(f"slot_mapping.{g}", n)[...] = slots
    field("token_ids", n)[1:] = -(np.arange(n, dtype=np.int32) + 1)
    return dataclasses.replace(inputs, packed=packed)
