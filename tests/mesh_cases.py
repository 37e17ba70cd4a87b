"""The model and requests the mesh checks serve (imported by the check scripts)."""

from __future__ import annotations

from typing import Any

import numpy as np

import jaxkv
import jaxkv.demo


def demo_config(kv_quant_mode: str = "none") -> jaxkv.RunnerConfig:
    """8 query heads, 4 KV heads (replicated over 8 tensor ranks at 1x8).

    `kv_quant_mode`: the attention layers' 8-bit pages (``"none"``: float32).
    """
    return jaxkv.tiny_hybrid_config(
        kv_quant_mode=kv_quant_mode,
        num_heads=8,
        num_kv_heads=4,
        head_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        token_buckets=(32,),  # one bucket: fewer programs to compile per mesh
        request_buckets=(4,),
    )


def demo_requests(
    *, seed: int, count: int, new_tokens: int, arrival_every: int
) -> list[jaxkv.demo.EngineRequest]:
    """`count` random prompts of 3-29 tokens, arriving over a few steps."""
    rng = np.random.default_rng(seed)
    return [
        jaxkv.demo.EngineRequest(
            req_id=f"r{i}",
            prompt=rng.integers(1, 64, int(rng.integers(3, 30))).tolist(),
            max_new_tokens=new_tokens,
            arrival_step=i % arrival_every,
        )
        for i in range(count)
    ]


def rank_steps(
    builder: jaxkv.StepMetadataBuilder,
    *,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    positions: np.ndarray,
    tables: list,
    slots: list,
) -> jaxkv.StepInputs:
    """Every data-parallel rank's step prepared by a mesh `builder` at once:
    leaves ``(D, ...)`` sharded over the data axis.
    """  # noqa: D205
    return builder.prepare_ranks(
        [
            jaxkv.StepArrays(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                positions=positions,
                block_tables=tb,
                slot_mappings=sl,
            )
            for tb, sl in zip(tables, slots, strict=True)
        ]
    )


def transfer_engine(
    backend: str,
    block_size: int,
    model: jaxkv.demo.TinyHybridModel | None = None,
    *,
    record_logits: bool = False,
    mesh: Any = None,
    num_heads: int = 2,
) -> tuple[jaxkv.demo.Engine, jaxkv.demo.TinyHybridModel]:
    """The demo hybrid model on `backend` pools of `block_size` (the KV-cache
    moves of tests/test_transfer.py and disagg_check.py), and its model; on
    `mesh` (data x tensor) when given.
    """  # noqa: D205
    from flax import nnx

    cfg = jaxkv.tiny_hybrid_config(
        attention_backend=backend,
        block_size=block_size,
        head_size=16,
        num_heads=num_heads,
        sliding_window=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=(8, 64),
        request_buckets=(4,),
        kv_sharing_fast_prefill=False,
    )
    if model is None:
        model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(3))
    engine = jaxkv.demo.Engine(
        cfg, model, num_blocks=64, record_logits=record_logits, mesh=mesh
    )
    return engine, model
