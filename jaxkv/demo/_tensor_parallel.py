"""The built-in model split over a tensor-parallel axis (Megatron-style, by heads).

Rank ``t`` holds: the query-head columns ``[t*H/T, (t+1)*H/T)`` of ``wq`` and
the matching rows of ``wo``; its KV heads' columns of ``wk``/``wv`` (the same
rule as the cache, :func:`jaxkv.plan.local_kv_heads`, so a replicated KV head is
replicated in the weights too); the Mamba channels ``[t*C/T, (t+1)*C/T)`` of
``w_in``, ``conv`` and ``w_out`` and the heads of ``decay``. Embedding, norms,
``b``, ``c`` and the LM head are replicated. The outputs of ``wo`` and
``w_out`` are partial sums, added over the axis by ``forward_paged``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxkv import RunnerConfig
from jaxkv.demo._model import AttentionBlock, MambaBlock, TinyHybridModel
from jaxkv.plan import local_kv_heads


def _split(x: np.ndarray, axis: int, t: int, parts: int) -> np.ndarray:
    n = x.shape[axis] // parts
    return np.take(x, np.arange(t * n, (t + 1) * n), axis=axis)


def _kv_columns(x: np.ndarray, kv_heads: int, head: int, t: int, parts: int):
    local = local_kv_heads(kv_heads, parts)
    first = t * kv_heads // parts if kv_heads < parts else t * local
    return x[:, first * head : (first + local) * head]


def tensor_parallel_state(
    model: TinyHybridModel,
    local_config: RunnerConfig,
    *,
    tensor_parallel: int,
    vocab_size: int,
) -> tuple[Any, Any, Any]:
    """``(graphdef, state, split)`` of the rank-local model.

    A leaf that differs per rank is stacked ``(T, ...)`` (``split`` is
    ``True`` there): shard its leading axis over the tensor axis and take
    ``[0]`` inside ``shard_map``. A replicated leaf is the global array
    (``split`` ``False``). Leaves are host (NumPy) arrays.

    Raises:
      ValueError: If heads or channels do not split over `tensor_parallel`.
    """
    t_count = tensor_parallel
    local_model = nnx.eval_shape(
        lambda: TinyHybridModel(
            local_config, vocab_size=vocab_size, rngs=nnx.Rngs(0), hidden=model.hidden
        )
    )
    graphdef, local_state = nnx.split(local_model)
    _, global_state = nnx.split(model)
    flat_global = dict(jax.tree_util.tree_flatten_with_path(global_state)[0])
    paths, local_treedef = jax.tree_util.tree_flatten_with_path(local_state)
    stacked, split = [], []
    for path, local_leaf in paths:
        x = np.asarray(flat_global[path])
        keys: list[Any] = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        ranks = []
        for t in range(t_count):
            if keys[0] == "blocks":
                block = model.blocks[int(keys[1])]
                name = keys[2]
                if isinstance(block, AttentionBlock):
                    if name == "wq":
                        x_t = _split(x, 1, t, t_count)
                    elif name == "wo":
                        x_t = _split(x, 0, t, t_count)
                    elif name in ("wk", "wv"):
                        x_t = _kv_columns(
                            x, block.num_kv_heads, block.head_size, t, t_count
                        )
                    else:
                        x_t = x
                elif isinstance(block, MambaBlock):
                    if name in ("w_in", "conv"):
                        x_t = _split(x, 1, t, t_count)
                    elif name == "w_out":
                        x_t = _split(x, 0, t, t_count)
                    elif name == "decay":
                        x_t = _split(x, 0, t, t_count)
                    else:
                        x_t = x
                else:
                    x_t = x
            else:
                x_t = x
            if x_t.shape != local_leaf.shape:
                raise ValueError(
                    f"{jax.tree_util.keystr(path)}: rank {t} slice {x_t.shape} does "
                    f"not match the local model's {local_leaf.shape}."
                )
            ranks.append(x_t)
        replicated = all(r is x for r in ranks)
        stacked.append(x if replicated else np.stack(ranks))
        split.append(not replicated)
    return (
        graphdef,
        jax.tree_util.tree_unflatten(local_treedef, stacked),
        jax.tree_util.tree_unflatten(local_treedef, split),
    )
