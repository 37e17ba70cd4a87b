"""The KV-sharing fast-prefill path: arming and logits-index staging (§2.2-§2.3)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from jaxkv._util import checks_own_arguments, host_field, pytree_dataclass
from jaxkv.step._buckets import BatchDescriptor, BucketDispatcher, CompileMode
from jaxkv.step._common_metadata import CommonAttentionMetadata
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


class FastPrefillHelper:
    """Decides per step whether to arm the KV-sharing fast prefill path, and
    stages the logits indices it runs on.

    Owns a persistent int32 staging buffer of ``max_num_tokens`` entries,
    donated to :func:`stage_logits_indices` every step, and the bucket
    dispatcher used to pad the indices (so the padding matches the main step's
    executable).

    Args:
      cudagraph_manager: The :class:`BucketDispatcher`.
      max_num_tokens: Staging buffer length.

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
    """  # noqa: D205

    def __init__(
        self, cudagraph_manager: BucketDispatcher, max_num_tokens: int
    ) -> None:
        """Allocates the staging buffer (zeros)."""
        self.cudagraph_manager = cudagraph_manager
        self.max_num_tokens = max_num_tokens
        self.buffer = jnp.zeros(max_num_tokens, jnp.int32)
        # One staging program per padded length; the buffer is donated.
        self.programs = Programs(_stage_packed, donate_argnums=0, keep_unused=True)

    def paddings(self) -> list[int]:
        """Every padded length :meth:`prepare` can produce (one kernel each)."""
        buckets = self.cudagraph_manager.token_buckets
        return sorted({min(b, self.max_num_tokens) for b in buckets})

    def warm_up(self) -> None:
        """Compiles the staging kernel for every padding, from shapes only."""
        buf = jax.ShapeDtypeStruct((self.max_num_tokens,), jnp.int32)
        for p in self.paddings():
            self.programs.compile(p, buf, jax.ShapeDtypeStruct((p + 2,), jnp.int32))

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
          ValueError: For an empty or device-resident `logits_indices`, or more
            indices than the buffer holds.
        """
        if not has_prefill or batch_desc.cg_mode == CompileMode.FULL:
            return None
        if batch_desc.num_ubatches > 1:
            return None
        if isinstance(logits_indices, jax.Array):
            raise ValueError(
                "FastPrefillHelper.prepare takes host (NumPy) logits_indices; a "
                "device array would need a host sync to size its bucket."
            )
        idx = np.asarray(logits_indices, np.int32)
        n = idx.shape[0]
        if n == 0:
            raise ValueError(
                "logits_indices is empty; a step with a prefill has logits."
            )
        if n > self.max_num_tokens:
            raise ValueError(
                f"{n} logits indices exceed the staging buffer of "
                f"{self.max_num_tokens}."
            )
        desc = self.cudagraph_manager.dispatch(
            num_reqs=num_reqs, num_tokens=n, num_active_loras=num_active_loras
        )
        padded = min(desc.num_tokens, self.max_num_tokens)
        cu = np.asarray(cu_num_logits_np)
        max_per_req = int(np.diff(cu[: num_reqs + 1]).max(initial=0))
        host = np.full(padded + 2, -1, np.int32)  # [n, max, indices..., sentinels]
        host[0], host[1] = n, max_per_req
        host[2 : n + 2] = idx
        self.buffer, meta = self.programs(padded, self.buffer, host)
        return dataclasses.replace(
            meta,
            num_logits_indices_cpu=n,
            max_logits_per_req_cpu=max_per_req,
            logits_indices_cpu=idx,
        )


def validate_logits_indices(
    logits_indices: ArrayLike,
    query_start_loc: ArrayLike,
    *,
    buffer_size: int | None = None,
) -> None:
    """Host-side check of a step's logits indices against its batch.

    Raises:
      ValueError: If `query_start_loc` is not a non-decreasing sequence from 0,
        an index is outside the batch or not strictly ascending, or there are
        more indices than `buffer_size`.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.step.validate_logits_indices(np.array([3, 9]), np.array([0, 4, 10]))
      >>> jaxkv.step.validate_logits_indices(np.array([3, 10]), np.array([0, 4, 10]))
      Traceback (most recent call last):
      ...
      ValueError: logits_indices[1] = 10 is outside the batch of 10 tokens.
    """
    qsl = np.asarray(query_start_loc)
    validate_query_start_loc(qsl)
    idx = np.asarray(logits_indices)
    num_tokens = int(qsl[-1])
    bad = np.flatnonzero((idx < 0) | (idx >= num_tokens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"logits_indices[{i}] = {int(idx[i])} is outside the batch of "
            f"{num_tokens} tokens."
        )
    if idx.size > 1:
        steps = np.flatnonzero(np.diff(idx) <= 0)
        if steps.size:
            i = int(steps[0]) + 1
            raise ValueError(
                f"logits_indices must be strictly ascending; logits_indices[{i}] = "
                f"{int(idx[i])} follows {int(idx[i - 1])}."
            )
    if buffer_size is not None and idx.size > buffer_size:
        raise ValueError(
            f"{idx.size} logits indices exceed the staging buffer of {buffer_size}."
        )


def validate_query_start_loc(query_start_loc: ArrayLike) -> None:
    """Host-side check: starts at 0 and never decreases.

    Raises:
      ValueError: Naming the first bad entry.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.step.validate_query_start_loc(np.array([0, 4, 3]))
      Traceback (most recent call last):
      ...
      ValueError: query_start_loc must not decrease; entry 2 is 3 after 4.
    """
    qsl = np.asarray(query_start_loc)
    if qsl.ndim != 1 or qsl.size == 0 or qsl[0] != 0:
        raise ValueError(
            "query_start_loc must be a 1-D array starting at 0, got "
            f"{qsl.tolist()[:8]}."
        )
    drops = np.flatnonzero(np.diff(qsl) < 0)
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(
            f"query_start_loc must not decrease; entry {i} is {int(qsl[i])} after "
            f"{int(qsl[i - 1])}."
        )


def make_kv_sharing_fast_prefill_common_attn_metadata(
    common: CommonAttentionMetadata,
) -> CommonAttentionMetadata:
    """The reduced record of the fast-prefill (KV-sharing) layers (spec §2.17).

    Keeps only the logits positions: request ``r``'s query becomes its logits
    tokens, ``query_start_loc' = [0, cumsum(counts)]``; ``seq_lens``, block
    table and slot mapping are unchanged (logits positions are each request's
    trailing tokens, so they attend exactly as in the full batch);
    ``num_actual_tokens = num_logits_indices``, ``max_query_len =
    max_logits_per_req``, causal. Per-token optional fields are cleared.
    Returns `common` unchanged if fast prefill is not armed. When
    ``max_query_len == 1`` vLLM returns the record unchanged; here the counts are
    selected on device to the same values, but the optional per-token fields are
    still cleared, since a jitted step cannot change its structure on a value.

    Example:
      >>> import dataclasses
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> i32 = lambda x: jnp.asarray(x, jnp.int32)
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=28,
      ...                                         max_blocks=1)
      >>> m = dataclasses.replace(m, query_start_loc=i32([0, 15, 20, 28]),
      ...     seq_lens=i32([41, 31, 40]), num_reqs=i32(3), max_query_len=i32(15),
      ...     logits_indices_padded=i32([14, 18, 19, 27, 27, 27, 27, 27]),
      ...     num_logits_indices=i32(4), max_logits_per_req=i32(2), fast_prefill=True)
      >>> r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(m)
      >>> r.query_start_loc.tolist(), int(r.num_actual_tokens), int(r.max_query_len)
      ([0, 1, 3, 4], 4, 2)
      >>> m = dataclasses.replace(m, query_start_loc_cpu=np.array([0, 15, 20, 28]))
      >>> jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(
      ...     m).query_start_loc_cpu.tolist()  # the host copy too
      [0, 1, 3, 4]
    """
    if not common.fast_prefill:
        return common
    qsl = common.query_start_loc
    idx = common.logits_indices_padded
    n = common.num_logits_indices
    max_reqs = common.max_reqs
    # Owning request of each index: qsl = [0, 15, 20, 28], idx = [14, 18, 19, 27]
    # -> [0, 1, 1, 2]; entries past n (padding) get max_reqs and are dropped.
    owner = jnp.searchsorted(qsl[1:], idx, side="right").astype(jnp.int32)
    valid = jnp.arange(idx.shape[0], dtype=jnp.int32) < n
    owner = jnp.where(valid, owner, max_reqs)
    counts = jnp.zeros(max_reqs, jnp.int32).at[owner].add(1, mode="drop")
    reduced_qsl = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)]
    )
    decode_only = common.max_query_len == 1
    max_tokens = common.positions.shape[0]
    return dataclasses.replace(
        common,
        query_start_loc=jnp.where(decode_only, qsl, reduced_qsl),
        num_actual_tokens=jnp.where(decode_only, common.num_actual_tokens, n),
        max_query_len=jnp.where(
            decode_only, common.max_query_len, common.max_logits_per_req
        ),
        positions=jnp.zeros(max_tokens, jnp.int32),
        is_prefilling=jnp.zeros(max_reqs, jnp.bool_),
        token_to_req=jnp.zeros(max_tokens, jnp.int32),
        encoder_seq_lens=jnp.zeros(max_reqs, jnp.int32),
        mm_prefix_ranges=jnp.zeros_like(common.mm_prefix_ranges),
        mm_num_ranges=jnp.zeros(max_reqs, jnp.int32),
        request_causal=jnp.ones(max_reqs, jnp.bool_),
        causal=True,
        query_start_loc_cpu=_reduced_query_start_loc_cpu(common),
    )


def _reduced_query_start_loc_cpu(common: CommonAttentionMetadata) -> np.ndarray | None:
    """The host copy of the reduced ``query_start_loc`` (spec §2.17.1), or ``None``.

    Computed on the host by the same rule as on device, from the host query
    start locations and the host logits indices (the record's host copy, or the
    device values when they are concrete, outside jit). ``None`` where the host
    data is not there (inside jit).
    """
    qsl = common.query_start_loc_cpu
    if qsl is None:
        return None
    qsl = np.asarray(qsl)
    if np.diff(qsl).max(initial=0) == 1:  # pure decode: vLLM keeps the record
        return qsl
    idx = common.logits_indices_cpu
    if idx is None:
        try:
            n = int(common.num_logits_indices)
            idx = np.asarray(common.logits_indices_padded)[:n]
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerIntegerConversionError,
            jax.errors.TracerArrayConversionError,
        ):  # traced device values (a record built inside jit)
            return None
    owner = np.searchsorted(qsl[1:], np.asarray(idx), side="right")
    counts = np.bincount(owner, minlength=qsl.size - 1)[: qsl.size - 1]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
