"""A step's host arrays and device inputs.

A step's two records on its way to the device: its host arrays
(:class:`StepArrays`, what a scheduler produces) and its device inputs
(:class:`StepInputs`, what :meth:`StepMetadataBuilder.prepare` returns and your
jitted step takes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Int

from jaxkv._util import host_field, pytree_dataclass, static_field
from jaxkv.step._buckets import BatchDescriptor
from jaxkv.step._fast_prefill import FastPrefillBatchMetadata
from jaxkv.step._packing import StepCapacity


@dataclasses.dataclass(kw_only=True, eq=False)
class StepArrays:
    """A step's host (NumPy) arrays: the input of :meth:`StepMetadataBuilder.prepare`.

    :meth:`Scheduler.schedule` returns a :class:`ScheduledStep`, which is one;
    a scheduler of your own makes one directly.

    Attributes:
      query_start_loc: ``(num_reqs + 1,)`` cumulative query lengths.
      seq_lens: ``(num_reqs,)`` context lengths after this step.
      positions: ``(num_tokens,)`` token positions.
      block_tables: Per KV-cache group ``(num_reqs, cols)`` block ids.
      slot_mappings: Per KV-cache group ``(num_tokens,)`` slots (``-1``: write
        nothing).
      logits_indices: Tokens whose logits are sampled, ascending (``None``:
        none); they arm fast prefill (with `cu_num_logits`) on a model with
        fast-prefill layers and are the sampled indices of the model inputs.
      cu_num_logits: ``(num_reqs + 1,)`` cumulative logits per request.
      token_ids: ``(num_tokens,)`` input tokens (builders with
        ``model_inputs=True``; a negative id ``-(k + 1)`` is the previous
        step's k-th sampled token, see :meth:`Scheduler.advance`).
      is_prefilling: ``(num_reqs,)`` (default: query length > 1).
      encoder_seq_lens: ``(num_reqs,)`` encoder lengths.
      mm_prefix_ranges: ``request -> inclusive ranges`` of multimodal
        (bidirectional) prefixes.
      request_causal: ``(num_reqs,)`` bools; ``False`` makes a request attend
        to its whole context (default all causal).

    Example:
      >>> import jaxkv
      >>> s = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8))
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=1))
      >>> a = s.schedule()
      >>> isinstance(a, jaxkv.StepArrays)
      True
      >>> a.query_start_loc.tolist(), a.positions.tolist(), a.logits_indices.tolist()
      ([0, 3], [0, 1, 2], [2])
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    block_tables: Sequence[np.ndarray]
    slot_mappings: Sequence[np.ndarray]
    logits_indices: np.ndarray | None = None
    cu_num_logits: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    is_prefilling: np.ndarray | None = None
    encoder_seq_lens: np.ndarray | None = None
    mm_prefix_ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None
    request_causal: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        """Requests in the step."""
        return int(np.asarray(self.query_start_loc).size) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens in the step."""
        qsl = np.asarray(self.query_start_loc)
        return int(qsl[-1]) if qsl.size else 0


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The device inputs of one step: the argument of a jitted step function.

    Its leaves are the packed buffer and the staged fast-prefill indices; its
    capacity is static (it picks the compiled program); the bucket and the host
    copies ride along outside the leaves (``None`` inside jit).

    On a builder of ``R`` data-parallel ranks (:meth:`StepMetadataBuilder.
    prepare_ranks`) every leaf has a leading ``R`` axis sharded over the data
    axis; inside ``shard_map`` :meth:`local` is the rank's own step.

    Attributes:
      packed: ``(capacity.size,)`` int32, every per-step field of every group.
      fast_prefill: Staged fast-prefill inputs, or ``None`` when not armed.
      capacity: Capacities and field offsets (static).
      desc: The bucket the step was dispatched to (host only).
      query_start_loc_cpu: Host copy of the (unpadded) query start locations
        (one rank's step only).
      cu_num_logits_cpu: Host cumulative logits counts: the host copy of the
        reduced ``query_start_loc`` of fast-prefill layers (``None`` when not
        armed).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> from jaxkv.step import StepCapacity
      >>> capacity = StepCapacity(max_reqs=2, max_tokens=4, block_table_widths=(1,))
      >>> inputs = jaxkv.StepInputs(packed=np.zeros(capacity.size, np.int32),
      ...                           fast_prefill=None, capacity=capacity)
      >>> inputs.program == (capacity, None)
      True
    """

    packed: Int[Array, " size"]
    fast_prefill: FastPrefillBatchMetadata | None
    capacity: StepCapacity = static_field()
    desc: BatchDescriptor | None = host_field()
    query_start_loc_cpu: np.ndarray | None = host_field()
    cu_num_logits_cpu: np.ndarray | None = host_field()

    @property
    def program(self) -> tuple[StepCapacity, int | None]:
        """What determines the compiled code: the capacity and fast-prefill padding."""
        fp = self.fast_prefill
        return (
            self.capacity,
            None if fp is None else int(fp.logits_indices_padded.shape[-1]),
        )

    def local(self) -> StepInputs:
        """This rank's row of a :meth:`StepMetadataBuilder.prepare_ranks` step.

        Inside ``shard_map`` over a data axis: this rank's row of a
        :meth:`StepMetadataBuilder.prepare_ranks` step (leaves ``(1, ...)`` ->
        ``(...)``), the argument :meth:`StepMetadataBuilder.metadata` takes.

        Example:
          >>> import numpy as np
          >>> import jaxkv
          >>> from jaxkv.step import StepCapacity
          >>> capacity = StepCapacity(max_reqs=1, max_tokens=2, block_table_widths=(1,))
          >>> rows = jaxkv.StepInputs(packed=np.zeros((1, capacity.size), np.int32),
          ...                         fast_prefill=None, capacity=capacity)
          >>> rows.local().packed.shape == (capacity.size,)
          True
        """
        row: Any = jax.tree.map(lambda x: x[0], self)
        return row
