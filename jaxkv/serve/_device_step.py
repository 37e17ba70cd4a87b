"""The program every step runs, on one device or per data rank.

The program every step runs: metadata from the packed step, the decode
placeholders filled from the previous step's tokens, your `forward`, sampling;
on a mesh, the same per data-parallel rank under ``shard_map``, each rank on
its own row of the step's inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxkv.kv import Pools
from jaxkv.plan import ShardedPlan
from jaxkv.serve._checks import check_forward_result
from jaxkv.serve._drafts import accept_drafts
from jaxkv.serve._sampling import SamplingParams, sample_rows
from jaxkv.serve._write_check import check_forward_writes
from jaxkv.step import CommonAttentionMetadata, StepInputs, StepMetadataBuilder


@runtime_checkable
class Forward(Protocol):
    """Your model's step, traced inside the loop's jitted program.

    ``forward(params, pools, meta, token_ids, sample_idx) -> (pools, logits)``:
    `meta` maps every layer to its :class:`CommonAttentionMetadata`,
    `token_ids` are the step's ``(max_tokens,)`` padded tokens (their positions
    are ``meta[name].positions``), `sample_idx` the ``(num_samples,)`` token
    indices whose logits are sampled; return the updated pools and
    ``(num_samples, vocab)`` logits.

    Example:
      >>> import jaxkv
      >>> def forward(params, pools, meta, token_ids, sample_idx):
      ...     return pools, params[token_ids[sample_idx]]  # a bigram table
      >>> f: jaxkv.Forward = forward  # any function of this signature
    """

    def __call__(
        self,
        params: Any,
        pools: Pools,
        meta: Mapping[str, CommonAttentionMetadata],
        token_ids: jax.Array,
        sample_idx: jax.Array,
        /,
    ) -> tuple[Pools, jax.Array]:
        """One step of the model (positional arguments: name them as you like)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DeviceStep:
    """One step's program, traced once per bucket.

    ``(pools, params, inputs, seeds, prev_tokens) -> (pools, tokens,
    logits)``, traced once per bucket by :class:`ServingLoop`'s programs.

    Attributes:
      builder: The step builder (metadata and model inputs from the packed step).
      forward: Your step function (a :class:`Forward`).
      sharded: The mesh plan, or ``None`` on one device.
      param_specs: The parameters' partition specs on a mesh.
      width: Sampled tokens per step, padded (the next step's placeholders
        index them).
      sampling: Sampling parameters of requests without their own.
      per_request_sampling: Whether each row samples with its own parameters.
      vocab_size: The loop's vocabulary: `forward`'s logits may not be wider.
      speculative: Whether steps verify drafts: the sampling inputs are then
        ``{"sampling": rows, "drafts": the draft after each row}`` and each
        request's rows past its first rejected draft come back as ``-1``
        (:func:`accept_drafts`).
    """

    builder: StepMetadataBuilder
    forward: Forward
    sharded: ShardedPlan | None
    param_specs: Any
    width: int
    sampling: SamplingParams
    per_request_sampling: bool
    vocab_size: int | None = None
    speculative: bool = False
    # Whether `forward`'s writes were checked (check_forward_writes): once.
    _writes_checked: list[bool] = dataclasses.field(default_factory=list)

    def check_writes(self, pools: Pools, params: Any, inputs: StepInputs) -> tuple:
        """Refuses a `forward` that drops a KV-owning layer's write (once).

        Traced (``jax.eval_shape``) by :class:`ServingLoop` before it queues
        a request; see :func:`check_forward_writes`. On a mesh, not checked.
        """
        meta = self.builder.metadata(inputs)
        tokens, sample = self.builder.model_inputs_of(inputs)
        self._check_writes(params, pools, meta, tokens, sample)
        return ()

    @property
    def writes_checked(self) -> bool:
        """Whether `forward`'s writes were checked (they are, once)."""
        return bool(self._writes_checked)

    def _check_writes(self, *args: Any) -> None:
        if self.sharded is None and not self._writes_checked:
            check_forward_writes(
                self.forward, self.builder.plan, args, check_result=self._result
            )
            self._writes_checked.append(True)

    def _result(self, out: Any, pools: Pools, sample: jax.Array) -> Any:
        return check_forward_result(out, pools, sample, vocab_size=self.vocab_size)

    def rank_step(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array | Mapping[str, jax.Array],
        prev_tokens: jax.Array,
    ) -> tuple[Pools, jax.Array, jax.Array]:
        """One rank's step: ``(pools, tokens padded to width, logits)``."""
        meta = self.builder.metadata(inputs)
        tokens, sample = self.builder.model_inputs_of(inputs)
        # A placeholder -(k + 1) (async scheduling) is the previous step's
        # k-th sampled token, still on the device.
        src = jnp.clip(-tokens - 1, 0, self.width - 1)
        tokens = jnp.where(tokens < 0, prev_tokens[src], tokens)
        self._check_writes(params, pools, meta, tokens, sample)
        out = self.forward(params, pools, meta, tokens, sample)
        pools, logits = self._result(out, pools, sample)
        positions = next(iter(meta.values())).positions[sample]
        rows = seeds["sampling"] if self.speculative else seeds
        next_tokens = sample_rows(
            logits,
            rows,
            per_request=self.per_request_sampling,
            default=self.sampling,
            positions=positions,
        )
        if self.speculative:  # the drafts verified in the same program
            next_tokens = accept_drafts(next_tokens, seeds["drafts"])
        padded = jnp.zeros(self.width, jnp.int32)
        padded = padded.at[: next_tokens.shape[0]].set(next_tokens.astype(jnp.int32))
        return pools, padded, logits

    def decode_steps(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array,
        prev_tokens: jax.Array,
    ) -> tuple[Pools, jax.Array, jax.Array, jax.Array]:
        """Several decode iterations in one program (multi-step decoding).

        `inputs` packs one row per iteration (:func:`decode_step_inputs`); each
        iteration is :meth:`rank_step`, its input tokens the previous iteration's
        sampled ones, the pools carried through a ``lax.scan``.

        Returns:
          ``(pools, tokens (num_steps, width), logits (num_steps, samples,
          vocab), last (width,))``: `last` is the last iteration's tokens,
          which the next step's placeholders index.
        """

        def body(
            carry: tuple[Pools, jax.Array], packed: jax.Array
        ) -> tuple[tuple[Pools, jax.Array], tuple[jax.Array, jax.Array]]:
            pools, prev = carry
            step = dataclasses.replace(inputs, packed=packed)
            pools, tokens, logits = self.rank_step(pools, params, step, seeds, prev)
            return (pools, tokens), (tokens, logits)

        (pools, last), (tokens, logits) = jax.lax.scan(
            body, (pools, prev_tokens), inputs.packed
        )
        return pools, tokens, logits, last

    def __call__(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array | Mapping[str, jax.Array],
        prev_tokens: jax.Array,
    ) -> Any:
        """One step (on a mesh, each input has a leading ranks axis).

        One step; on a mesh every leaf of `inputs`, `seeds` and
        `prev_tokens` has a leading ranks axis (one row per data-parallel rank,
        :meth:`StepMetadataBuilder.prepare_ranks`).
        """
        sp = self.sharded
        if sp is None:
            return self.rank_step(pools, params, inputs, seeds, prev_tokens)

        def per_rank(
            pools: Any, params: Any, rows: StepInputs, seeds: Any, prev: Any
        ) -> Any:
            pools, tokens, logits = self.rank_step(
                sp.local_pools(pools),
                params,
                rows.local(),
                jax.tree.map(lambda x: x[0], seeds),
                prev[0],
            )
            return sp.global_pools(pools), tokens[None], logits[None]

        rows = P(sp.data_axis)
        return jax.shard_map(
            per_rank,
            mesh=sp.mesh,
            in_specs=(sp.pool_spec, self.param_specs, rows, rows, rows),
            out_specs=(sp.pool_spec, rows, rows),
        )(pools, params, inputs, seeds, prev_tokens)
