"""The program every step runs: metadata from the packed step, the decode
placeholders filled from the previous step's tokens, your `forward`, sampling;
on a mesh, the same per data-parallel rank under ``shard_map`` with fast-prefill
indices staged on each rank's row.
"""  # noqa: D205

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxkv.cache import Pools, ShardedPlan
from jaxkv.serve._checks import check_forward_result
from jaxkv.serve._sampling import SamplingParams, sample_rows
from jaxkv.step import (
    FastPrefillBatchMetadata,
    StepInputs,
    StepMetadataBuilder,
    stage_logits_indices,
)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DeviceStep:
    """``(pools, params, inputs, seeds, prev_tokens[, buffer, fp_packed]) ->
    (pools, tokens, logits[, buffer])``, traced once per bucket by
    :class:`ServingLoop`'s programs.

    Attributes:
      builder: The step builder (metadata and model inputs from the packed step).
      forward: Your step function (see :class:`Forward`).
      sharded: The mesh plan, or ``None`` on one device.
      param_specs: The parameters' partition specs on a mesh.
      width: Sampled tokens per step, padded (the next step's placeholders
        index them).
      sampling: Sampling parameters of requests without their own.
      per_request_sampling: Whether each row samples with its own parameters.
    """  # noqa: D205

    builder: StepMetadataBuilder
    forward: Any
    sharded: ShardedPlan | None
    param_specs: Any
    width: int
    sampling: SamplingParams
    per_request_sampling: bool

    def rank_step(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array,
        prev_tokens: jax.Array,
    ) -> tuple[Pools, jax.Array, jax.Array]:
        """One rank's step: ``(pools, tokens padded to width, logits)``."""
        meta = self.builder.metadata(inputs)
        tokens, sample = self.builder.model_inputs_of(inputs)
        # A placeholder -(k + 1) (async scheduling) is the previous step's
        # k-th sampled token, still on the device.
        src = jnp.clip(-tokens - 1, 0, self.width - 1)
        tokens = jnp.where(tokens < 0, prev_tokens[src], tokens)
        out = self.forward(params, pools, meta, tokens, sample)
        pools, logits = check_forward_result(out, pools, sample)
        positions = next(iter(meta.values())).positions[sample]
        next_tokens = sample_rows(
            logits,
            seeds,
            per_request=self.per_request_sampling,
            default=self.sampling,
            positions=positions,
        )
        padded = jnp.zeros(self.width, jnp.int32)
        padded = padded.at[: next_tokens.shape[0]].set(next_tokens.astype(jnp.int32))
        return pools, padded, logits

    def __call__(
        self,
        pools: Pools,
        params: Any,
        inputs: StepInputs,
        seeds: jax.Array,
        prev_tokens: jax.Array,
        buffer: jax.Array | None = None,
        fp_packed: jax.Array | None = None,
    ) -> Any:
        """One step; on a mesh `buffer` (donated) and `fp_packed` arm fast
        prefill: ``fp_packed (ranks, 2 + padding)`` holds ``[n,
        max_logits_per_req, indices...]`` per rank, staged on its row.
        """  # noqa: D205
        sp = self.sharded
        if sp is None:
            return self.rank_step(pools, params, inputs, seeds, prev_tokens)
        layout = inputs.layout
        stage = () if buffer is None else (buffer, fp_packed)

        def per_rank(
            pools: Any, params: Any, packed: Any, seeds: Any, prev: Any, *stage: Any
        ) -> Any:
            fp = buf = None
            if stage:
                buf, staged = stage_logits_indices(
                    stage[0][0], stage[1][0, 2:], stage[1][0, 0]
                )
                fp = FastPrefillBatchMetadata(
                    logits_indices_padded=staged,
                    num_logits_indices=stage[1][0, 0],
                    max_logits_per_req=stage[1][0, 1],
                )
            local = StepInputs(packed=packed[0], fast_prefill=fp, layout=layout)
            pools, tokens, logits = self.rank_step(
                sp.local_pools(pools),
                params,
                local,
                jax.tree.map(lambda x: x[0], seeds),
                prev[0],
            )
            out = (sp.global_pools(pools), tokens[None], logits[None])
            return out if buf is None else (*out, buf[None])

        rows = P(sp.data_axis)
        extra = (rows, rows) if stage else ()
        return jax.shard_map(
            per_rank,
            mesh=sp.mesh,
            in_specs=(sp.pool_spec, self.param_specs, rows, rows, rows, *extra),
            out_specs=(sp.pool_spec, rows, rows, *extra[:1]),
        )(pools, params, inputs.packed, seeds, prev_tokens, *stage)
