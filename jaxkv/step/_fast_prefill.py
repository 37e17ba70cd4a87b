"""The KV-sharing fast-prefill path: arming and logits-index staging (§2.2-§2.3)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from jaxkv._util import checks_own_arguments, host_field, pytree_dataclass
from jaxkv.step._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step._programs import Programs


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class FastPrefillBatchMetadata:
    """Per-step inputs for the KV-sharing fast prefill path.

    Args:
      logits_indices_padded: ``(padded,)`` int32 token indices whose hidden
        states feed the logits, padded with copies of the last real index (so
        every entry is a valid token index).
      num_logits_indices: Real indices, an int32 scalar leaf.
      max_logits_per_req: Most logits positions of any request, int32 leaf.
      num_logits_indices_cpu: Host copy (``None`` inside jit).
      max_logits_per_req_cpu: Host copy (``None`` inside jit).
      logits_indices_cpu: Host copy of the ``n`` real indices (``None`` inside
        jit); gives the reduced record its host ``query_start_loc``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> m = jaxkv.vllm.FastPrefillBatchMetadata(
      ...     logits_indices_padded=jnp.array([3, 7, 12, 12], jnp.int32),
      ...     num_logits_indices=jnp.int32(3), max_logits_per_req=jnp.int32(1))
      >>> len(jax.tree.leaves(m))
      3
    """

    logits_indices_padded: Int[Array, " padded"]
    num_logits_indices: Int[Array, ""]
    max_logits_per_req: Int[Array, ""]
    num_logits_indices_cpu: int | None = host_field()
    max_logits_per_req_cpu: int | None = host_field()
    logits_indices_cpu: np.ndarray | None = host_field()


# keep_unused: the result never reads the old buffer, but keeping it as a
# (donated) parameter lets XLA write the new indices into its memory.
@functools.partial(jax.jit, donate_argnums=0, keep_unused=True)
def stage_logits_indices(
    buffer: Int[ArrayLike, " max_num_tokens"],
    logits_indices: Int[ArrayLike, " padded"],
    num_logits: Int[ArrayLike, ""],
) -> tuple[Int[Array, " max_num_tokens"], Int[Array, " padded"]]:
    """Stages logits indices into the persistent buffer (donated); jitted kernel.

    ``buffer[:n] = indices[:n]`` and ``buffer[n:] = indices[n - 1]``: the whole
    tail is rewritten every step, so no stale index survives and every padded
    entry is a valid token index. Entries of `logits_indices` past ``n`` are
    ignored (use any sentinel). ``n`` is clamped to ``[1, padded]``: the kernel
    never reads or writes outside its buffers.

    Args:
      buffer: ``(max_num_tokens,)`` int32 staging buffer (donated).
      logits_indices: ``(padded,)`` int32, the real indices first.
      num_logits: Real indices ``n`` (int32 scalar).

    Returns:
      ``(new buffer, new_buffer[:padded])``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> buf = jnp.zeros(16, jnp.int32)
      >>> buf, padded = jaxkv.step.stage_logits_indices(
      ...     buf, jnp.array([3, 7, 12, -1, -1, -1, -1, -1], jnp.int32), jnp.int32(3))
      >>> padded.tolist()
      [3, 7, 12, 12, 12, 12, 12, 12]
    """
    buffer = jnp.asarray(buffer)
    idx = jnp.asarray(logits_indices).astype(jnp.int32)
    padded = idx.shape[0]
    if padded > buffer.shape[0]:
        raise ValueError(
            f"logits_indices.shape={idx.shape} exceeds the staging buffer "
            f"({buffer.shape[0]},)."
        )
    n = jnp.clip(jnp.asarray(num_logits, jnp.int32), 1, padded)
    last = idx[n - 1]
    pos = jnp.arange(buffer.shape[0], dtype=jnp.int32)
    src = idx[jnp.minimum(pos, padded - 1)]
    new = jnp.where(pos < n, src, last).astype(buffer.dtype)
    return new, new[:padded]


def _stage_packed(
    buffer: jax.Array, packed: jax.Array
) -> tuple[jax.Array, FastPrefillBatchMetadata]:
    """One transfer, one call: ``packed = [n, max_logits_per_req, *indices]``."""
    buffer, staged = stage_logits_indices(buffer, packed[2:], packed[0])
    meta = FastPrefillBatchMetadata(
        logits_indices_padded=staged,
        num_logits_indices=packed[0],
        max_logits_per_req=packed[1],
    )
    return buffer, meta


def _rank_stager(rows: NamedSharding) -> Any:
    """:func:`_stage_packed` on every data-parallel rank's row.

    Under ``shard_map`` (each rank stages its own indices; nothing crosses ranks).
    """

    def per_rank(buffer: jax.Array, packed: jax.Array) -> Any:
        buffer, meta = _stage_packed(buffer[0], packed[0])
        return buffer[None], jax.tree.map(lambda x: x[None], meta)

    return jax.shard_map(
        per_rank,
        mesh=rows.mesh,
        in_specs=(rows.spec, rows.spec),
        out_specs=(rows.spec, rows.spec),
    )


class FastPrefillHelper:
    """Arms the KV-sharing fast prefill path per step and stages its indices.

    Decides per step whether to arm the KV-sharing fast prefill path, and
    stages the logits indices it runs on.

    Owns a persistent int32 staging buffer of ``max_num_tokens`` entries,
    donated to :func:`stage_logits_indices` every step, and the bucket
    dispatcher used to pad the indices (so the padding matches the main step's
    executable). With `rows` (data-parallel ranks on a mesh) the buffer has one
    row per rank and :meth:`prepare_ranks` stages every rank's indices on its
    own row in one call.

    Args:
      cudagraph_manager: The :class:`BucketDispatcher`.
      max_num_tokens: Staging buffer length.
      rows: ``NamedSharding(mesh, P(data_axis))``: one buffer row per
        data-parallel rank (``None``: one device).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> d = jaxkv.BucketDispatcher(token_buckets=(1, 2, 4, 8, 16),
      ...     max_num_tokens=16, max_num_reqs=16)
      >>> d.mark_ready()
      >>> helper = jaxkv.vllm.FastPrefillHelper(d, 16)
      >>> desc = jaxkv.vllm.BatchDescriptor(num_tokens=16, num_reqs=3,
      ...                              cg_mode=jaxkv.vllm.CompileMode.PIECEWISE)
      >>> m = helper.prepare(np.array([3, 7, 12]), 3, np.array([0, 1, 2, 3]),
      ...                    True, desc)
      >>> m.logits_indices_padded.tolist()
      [3, 7, 12, 12]
      >>> m.num_logits_indices_cpu, m.max_logits_per_req_cpu
      (3, 1)
    """

    def __init__(
        self,
        cudagraph_manager: BucketDispatcher,
        max_num_tokens: int,
        *,
        rows: NamedSharding | None = None,
    ) -> None:
        """Allocates the staging buffer (zeros)."""
        self.cudagraph_manager = cudagraph_manager
        self.max_num_tokens = max_num_tokens
        self.rows = rows
        #: Data-parallel ranks staged per call (1 without `rows`).
        self.num_ranks = 1 if rows is None else _num_rows(rows)
        self.buffer = self._new_buffer()
        stager: Any = _stage_packed if rows is None else _rank_stager(rows)
        # One staging program per padded length; the buffer is donated.
        self.programs = Programs(stager, donate_argnums=0, keep_unused=True)

    def _new_buffer(self) -> jax.Array:
        if self.rows is None:
            return jnp.zeros(self.max_num_tokens, jnp.int32)
        shape = (self.num_ranks, self.max_num_tokens)
        return jax.device_put(np.zeros(shape, np.int32), self.rows)

    def _stage(
        self, padded: int, host: np.ndarray | jax.Array
    ) -> FastPrefillBatchMetadata:
        """Runs the staging kernel.

        Every entry of the buffer is rewritten each call, so a buffer consumed by a call
        that failed is replaced by a fresh one with no change to any later step.
        """
        if self.buffer.is_deleted():
            self.buffer = self._new_buffer()
        self.buffer, meta = self.programs(padded, self.buffer, host)
        return meta

    def paddings(self) -> list[int]:
        """Every padded length :meth:`prepare` can produce (one kernel each)."""
        buckets = self.cudagraph_manager.token_buckets
        return sorted({min(b, self.max_num_tokens) for b in buckets})

    def _shape(self, *shape: int) -> jax.ShapeDtypeStruct:
        if self.rows is None:
            return jax.ShapeDtypeStruct(shape, jnp.int32)
        return jax.ShapeDtypeStruct(
            (self.num_ranks, *shape), jnp.int32, sharding=self.rows
        )

    def warm_up(self) -> None:
        """Compiles the staging kernel for every padding, from shapes only."""
        buf = self._shape(self.max_num_tokens)
        for p in self.paddings():
            self.programs.compile(p, buf, self._shape(p + 2))

    @staticmethod
    def armed(has_prefill: bool, batch_desc: BatchDescriptor) -> bool:
        """The arming rule.

        The arming rule: a step with a prefill, not one fully compiled
        executable (``FULL``), not split into micro-batches.
        """
        return (
            has_prefill
            and batch_desc.cg_mode != CompileMode.FULL
            and batch_desc.num_ubatches <= 1
        )

    def padding(self, num_reqs: int, n: int, num_active_loras: int = 0) -> int:
        """Padded length of `n` staged indices: the main dispatcher's bucket."""
        desc = self.cudagraph_manager.dispatch(
            num_reqs=num_reqs, num_tokens=n, num_active_loras=num_active_loras
        )
        return min(desc.num_tokens, self.max_num_tokens)

    def _host_indices(self, logits_indices: object, owner: str) -> np.ndarray:
        if isinstance(logits_indices, jax.Array):
            raise ValueError(
                f"{owner} takes host (NumPy) logits_indices; a device array "
                "would need a host sync to size its bucket."
            )
        idx = np.asarray(logits_indices, np.int32).reshape(-1)
        if idx.shape[0] > self.max_num_tokens:
            raise ValueError(
                f"{owner}: {idx.shape[0]} logits indices exceed the staging "
                f"buffer of {self.max_num_tokens}."
            )
        return idx

    def _check_ranks(self, owner: str, ranks: int | None) -> None:
        """`ranks` ``None``: the one-device :meth:`prepare`."""
        if ranks is None and self.rows is not None:
            raise ValueError(
                f"FastPrefillHelper.prepare: this helper stages {self.num_ranks} "
                "data-parallel rank(s) on rows of a mesh; use prepare_ranks."
            )
        if ranks is not None and (self.rows is None or ranks != self.num_ranks):
            what = "one device" if self.rows is None else f"{self.num_ranks} rank(s)"
            raise ValueError(
                f"FastPrefillHelper.{owner}: {ranks} rank(s) given to a helper "
                f"staging for {what}."
            )

    @checks_own_arguments
    def prepare(
        self,
        logits_indices: np.ndarray,
        num_reqs: int,
        cu_num_logits_np: np.ndarray,
        has_prefill: bool,
        batch_desc: BatchDescriptor,
        num_active_loras: int = 0,
    ) -> FastPrefillBatchMetadata | None:
        """Arms fast prefill for a step and stages its logits indices.

        Not armed (``None``) if the step has no prefill, runs as one fully
        compiled executable (``FULL``), or is split into micro-batches.

        Args:
          logits_indices: ``(n,)`` host (NumPy) token indices, ascending; ``n > 0``.
          num_reqs: Requests in the step.
          cu_num_logits_np: ``(num_reqs + 1,)`` host cumulative logits counts.
          has_prefill: Whether the step has a prefill.
          batch_desc: The main step's descriptor.
          num_active_loras: LoRA variant, so the padding matches the main step.

        Returns:
          The step's fast-prefill metadata, or ``None``.

        Raises:
          ValueError: For an empty or device-resident `logits_indices`, more
            indices than the buffer holds, or a helper with `rows`.
        """
        if not self.armed(has_prefill, batch_desc):
            return None
        self._check_ranks("prepare", None)
        idx = self._host_indices(logits_indices, "FastPrefillHelper.prepare")
        n = idx.shape[0]
        if n == 0:
            raise ValueError(
                "logits_indices is empty; a step with a prefill has logits."
            )
        padded = self.padding(num_reqs, n, num_active_loras)
        max_per_req = _max_per_req(cu_num_logits_np, num_reqs)
        host = np.full(padded + 2, -1, np.int32)  # [n, max, indices..., sentinels]
        host[0], host[1] = n, max_per_req
        host[2 : n + 2] = idx
        meta = self._stage(padded, host)
        return dataclasses.replace(
            meta,
            num_logits_indices_cpu=n,
            max_logits_per_req_cpu=max_per_req,
            logits_indices_cpu=idx,
        )

    def prepare_ranks(
        self,
        logits_indices: Sequence[np.ndarray | None],
        cu_num_logits: Sequence[np.ndarray | None],
        *,
        num_reqs: Sequence[int],
        has_prefill: bool,
        batch_desc: BatchDescriptor,
        padding: int,
    ) -> FastPrefillBatchMetadata | None:
        """Every data-parallel rank's :meth:`prepare` in one staging call.

        Armed for all ranks (one program) or none; leaves ``(ranks, ...)``.

        Args:
          logits_indices: Per rank, its host token indices (``None`` or empty:
            a rank without logits, staged as index 0 with ``n = 0``).
          cu_num_logits: Per rank, its cumulative logits counts.
          num_reqs: Per rank, its requests.
          has_prefill: Whether any rank's step has a prefill.
          batch_desc: The ranks' common descriptor.
          padding: The ranks' common padded length (``>=`` every rank's ``n``).

        Returns:
          The staged metadata of every rank, or ``None`` when not armed.

        Raises:
          ValueError: For a count of ranks other than the helper's, a rank with
            more indices than `padding`, or device-resident indices.
        """
        if not self.armed(has_prefill, batch_desc):
            return None
        self._check_ranks("prepare_ranks", len(logits_indices))
        host = np.zeros((self.num_ranks, padding + 2), np.int32)
        for rank, (li, cu, r) in enumerate(
            zip(logits_indices, cu_num_logits, num_reqs, strict=True)
        ):
            idx = np.zeros(0, np.int32)
            if li is not None:
                idx = self._host_indices(li, f"prepare_ranks (rank {rank})")
            if idx.shape[0] > padding:
                raise ValueError(
                    f"FastPrefillHelper.prepare_ranks: rank {rank} has "
                    f"{idx.shape[0]} logits indices, more than padding={padding}."
                )
            n = idx.shape[0]
            host[rank, 0] = n
            host[rank, 1] = 0 if cu is None else _max_per_req(cu, r)
            host[rank, 2 : n + 2] = idx
        return self._stage(padding, jax.device_put(host, self.rows))


def _num_rows(rows: NamedSharding) -> int:
    axis = rows.spec[0] if len(rows.spec) else None
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([rows.mesh.shape[a] for a in names]))


def _max_per_req(cu_num_logits: ArrayLike, num_reqs: int) -> int:
    cu = np.asarray(cu_num_logits)
    return int(np.diff(cu[: num_reqs + 1]).max(initial=0))
