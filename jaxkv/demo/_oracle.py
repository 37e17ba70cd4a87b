"""The dense oracle: greedy generation with no cache, to check the paged path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.demo._model import TinyHybridModel, forward_dense


def generate_dense(
    model: TinyHybridModel, prompt: Sequence[int], max_new_tokens: int, max_len: int
) -> list[int]:
    """Greedy tokens from the dense oracle (no cache; one padded length, one jit)."""
    fn = _dense_logits_at(max_len)
    tokens = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        padded = np.zeros(max_len, np.int32)
        padded[: len(tokens)] = tokens
        nxt = int(fn(model, jnp.asarray(padded), jnp.int32(len(tokens) - 1)))
        out.append(nxt)
        tokens.append(nxt)
    return out


_DENSE: dict[int, Any] = {}


def _dense_logits_at(max_len: int) -> Any:
    if max_len not in _DENSE:

        @nnx.jit
        def fn(
            model: TinyHybridModel, tokens: jax.Array, index: jax.Array
        ) -> jax.Array:
            # Causal masks and the left-to-right scan keep padding after `index`
            # from reaching it.
            return jnp.argmax(forward_dense(model, tokens)[index]).astype(jnp.int32)

        _DENSE[max_len] = fn
    return _DENSE[max_len]
