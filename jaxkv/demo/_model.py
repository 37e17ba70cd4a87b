"""The built-in hybrid model (Flax NNX) and its paged and dense forward passes.

Attention, sliding-window attention, Mamba-style state layers sharing pools
with attention, and a trailing run of YOCO layers.

Two forward passes over the same weights:

* :func:`forward_paged` runs a ragged step through jaxkv: K/V written through
  layer views with the slot mapping, attention read through views and block
  tables, Mamba states read and written through per-state views of the same
  pools, YOCO layers on their target's cache, the fast-prefill path when armed.
* :func:`forward_dense` runs one whole sequence with no cache at all: the
  oracle the paged path must reproduce token for token.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import (
    AttentionSpec,
    MambaSpec,
    RunnerConfig,
    SlidingWindowSpec,
    paged_attention,
    token_requests_and_positions,
)
from jaxkv.kv import Pools, read_mamba_state, write_kv, write_mamba_state
from jaxkv.plan import AttentionLayer, LayerView, MambaView
from jaxkv.step import CommonAttentionMetadata


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding over the last dim of ``(T, heads, dim)``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class AttentionBlock(nnx.Module):
    """Pre-norm attention block; a KV-sharing (YOCO) layer has no K/V projections."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        spec: AttentionSpec,
        shares_kv: bool,
        rngs: nnx.Rngs,
    ) -> None:
        """Creates the projections."""
        if spec.head_size % 2:
            raise ValueError(
                f"AttentionBlock: head_size={spec.head_size} must be even (rotary "
                "embeddings rotate pairs of dimensions)."
            )
        self.num_heads, self.head_size = num_heads, spec.head_size
        self.num_kv_heads = spec.num_kv_heads
        self.sliding_window = (
            spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        )
        self.norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.wq = nnx.Linear(
            hidden, num_heads * spec.head_size, use_bias=False, rngs=rngs
        )
        self.wo = nnx.Linear(
            num_heads * spec.head_size, hidden, use_bias=False, rngs=rngs
        )
        kv = spec.num_kv_heads * spec.head_size
        # A YOCO layer reads its target's cache: no K/V projections of its own.
        self.wk = nnx.data(
            None if shares_kv else nnx.Linear(hidden, kv, use_bias=False, rngs=rngs)
        )
        self.wv = nnx.data(
            None if shares_kv else nnx.Linear(hidden, kv, use_bias=False, rngs=rngs)
        )

    def qkv(
        self, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """Rotated queries and (if owned) rotated keys and values."""
        h = self.norm(x)
        t = x.shape[0]
        q = rope(self.wq(h).reshape(t, self.num_heads, self.head_size), positions)
        if self.wk is None or self.wv is None:
            return q, None, None
        k = rope(self.wk(h).reshape(t, self.num_kv_heads, self.head_size), positions)
        v = self.wv(h).reshape(t, self.num_kv_heads, self.head_size)
        return q, k, v


class MambaBlock(nnx.Module):
    """A Mamba-style state layer: a short conv, then a diagonal recurrence.

    A Mamba-style state layer: depthwise conv over 3 tokens, then a diagonal
    state-space recurrence ``h = a * h + u * B``, ``y = h @ C``.
    """

    def __init__(self, hidden: int, spec: MambaSpec, rngs: nnx.Rngs) -> None:
        """Creates the parameters; state shapes come from `spec`."""
        # `channels` (the conv state's width) equals `hidden` in the whole
        # model and hidden / T on one tensor-parallel rank.
        (conv_len, channels), (heads, head, n) = spec.shapes
        self.conv_len, self.heads, self.head, self.n = conv_len, heads, head, n
        self.conv_dtype = spec.dtypes[0]
        self.block_size = spec.block_size
        self.norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.w_in = nnx.Linear(hidden, channels, use_bias=False, rngs=rngs)
        self.w_out = nnx.Linear(channels, hidden, use_bias=False, rngs=rngs)
        key = rngs.params()
        k1, k2, k3, k4 = jax.random.split(key, 4)
        f32 = jnp.float32  # explicit: random defaults to float64 under x64
        self.conv = nnx.Param(
            jax.random.normal(k1, (conv_len, channels), f32) / conv_len
        )
        self.decay = nnx.Param(
            jax.random.uniform(k2, (heads, head, n), f32, minval=0.5, maxval=0.95)
        )
        self.b = nnx.Param(jax.random.normal(k3, (n,), f32) / float(np.sqrt(n)))
        self.c = nnx.Param(jax.random.normal(k4, (n,), f32) / float(np.sqrt(n)))

    def cell(
        self, conv_state: jax.Array, ssm_state: jax.Array, x_t: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One token: ``(conv_state, ssm_state, x_t) -> (conv', ssm', y_t)``."""
        u = self.w_in(self.norm(x_t))
        window = jnp.concatenate([conv_state[1:], u[None].astype(conv_state.dtype)])
        mixed = jnp.sum(window.astype(jnp.float32) * self.conv[...], axis=0)
        mixed = jax.nn.silu(mixed).reshape(self.heads, self.head)
        ssm = (
            self.decay[...] * ssm_state + mixed[..., None] * self.b[...][None, None, :]
        )
        y = jnp.einsum("hdn,n->hd", ssm, self.c[...]).reshape(-1)
        return window, ssm, self.w_out(y)

    def zero_state(self, hidden: int) -> tuple[jax.Array, jax.Array]:
        """The state of a request before its first token."""
        return (
            jnp.zeros((self.conv_len, hidden), self.conv_dtype),
            jnp.zeros((self.heads, self.head, self.n), jnp.float32),
        )


class TinyHybridModel(nnx.Module):
    """The built-in model of a :class:`RunnerConfig` (random weights).

    Example:
      >>> import jaxkv, jaxkv.demo
      >>> from flax import nnx
      >>> model = jaxkv.demo.TinyHybridModel(jaxkv.tiny_hybrid_config(),
      ...                                    vocab_size=64, rngs=nnx.Rngs(0))
      >>> jaxkv.demo.forward_dense(model, jax.numpy.array([1, 2, 3])).shape
      (3, 64)
    """

    def __init__(
        self,
        config: RunnerConfig,
        *,
        vocab_size: int,
        rngs: nnx.Rngs,
        hidden: int | None = None,
    ) -> None:
        """Builds one block per layer of `config`.

        `hidden` (default: query heads x head size of the first attention
        layer) is the residual width; a tensor-parallel rank's model is built
        from its local config with the global `hidden`.
        """
        first = next(
            layer for layer in config.layers if isinstance(layer.spec, AttentionSpec)
        )
        num_heads = first.num_heads or 1
        spec = first.spec
        if not isinstance(spec, AttentionSpec):
            raise TypeError("The model needs at least one attention layer.")
        self.hidden = hidden or num_heads * spec.head_size
        self.names = tuple(layer.name for layer in config.layers)
        self.targets = {
            layer.name: layer.kv_sharing_target
            for layer in config.layers
            if layer.kv_sharing_target is not None
        }
        self.embed = nnx.Embed(vocab_size, self.hidden, rngs=rngs)
        blocks = []
        for layer in config.layers:
            if isinstance(layer.spec, MambaSpec):
                blocks.append(MambaBlock(self.hidden, layer.spec, rngs))
            elif isinstance(layer.spec, AttentionSpec):
                blocks.append(
                    AttentionBlock(
                        self.hidden,
                        layer.num_heads or num_heads,
                        layer.spec,
                        layer.name in self.targets,
                        rngs,
                    )
                )
            else:
                raise TypeError(f"Layer {layer.name!r} has no spec the model can run.")
        self.blocks = nnx.List(blocks)
        self.final_norm = nnx.RMSNorm(self.hidden, rngs=rngs)
        self.lm_head = nnx.Linear(self.hidden, vocab_size, use_bias=False, rngs=rngs)


def forward_dense(model: TinyHybridModel, tokens: jax.Array) -> jax.Array:
    """Logits of every position of one sequence, with no cache (the oracle)."""
    n = tokens.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    x = model.embed(tokens)
    kv: dict[str, tuple[jax.Array, jax.Array]] = {}
    i = jnp.arange(n, dtype=jnp.int32)[:, None]
    j = jnp.arange(n, dtype=jnp.int32)[None, :]
    for name, block in zip(model.names, model.blocks, strict=True):
        if isinstance(block, MambaBlock):
            state = block.zero_state(model.hidden)

            def step(carry, x_t, block=block):
                conv, ssm, y = block.cell(carry[0], carry[1], x_t)
                return (conv, ssm), y

            _, y = jax.lax.scan(step, state, x)
            x = x + y
            continue
        q, k, v = block.qkv(x, pos)
        if k is None or v is None:
            k, v = kv[model.targets[name]]
        kv[name] = (k, v)
        mask = j <= i
        if block.sliding_window is not None:
            mask = mask & (j > i - block.sliding_window)
        g = block.num_heads // k.shape[1]
        kk = jnp.repeat(k, g, axis=1)
        vv = jnp.repeat(v, g, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, kk) / float(np.sqrt(block.head_size))
        s = jnp.where(mask[None], s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("hqk,khd->qhd", w, vv).reshape(n, -1)
        x = x + block.wo(out)
    return model.lm_head(model.final_norm(x))


def forward_paged(
    model: TinyHybridModel,
    pools: Pools,
    layers: Mapping[str, AttentionLayer | LayerView],
    meta: Mapping[str, CommonAttentionMetadata],
    token_ids: jax.Array,
    sample_idx: jax.Array,
    fast_prefill: bool,
    pages_per_chunk: int | None = None,
    query_tile: int | None = None,
    tensor_axis: str | None = None,
    implementation: str | None = None,
) -> tuple[Pools, jax.Array]:
    """One ragged step through jaxkv; returns the new pools and sampled logits.

    Args:
      model: The model.
      pools: The pool arrays.
      layers: ``layer -> AttentionLayer`` (``plan.attention_layer(name)``) for
        attention layers, ``layer -> MambaView`` for Mamba layers.
      meta: ``layer -> metadata`` from :func:`build_attn_metadata`.
      token_ids: ``(max_tokens,)`` input tokens (padding anything).
      sample_idx: ``(num_samples,)`` token indices whose logits are returned.
      fast_prefill: Whether the fast-prefill path is armed (the YOCO layers
        then run on the `sample_idx` tokens only, with reduced metadata).
      pages_per_chunk: Pages per step of the attention's online softmax
        (default: :func:`jaxkv._attention.auto_pages_per_chunk`).
      query_tile: Query tokens of a request sharing one read of its pages
        (default: chosen by :func:`paged_attention` from the bucket).
      tensor_axis: Inside ``shard_map`` over a tensor-parallel axis: the model
        holds this rank's heads, and the attention and Mamba outputs are
        summed over the axis (``psum``) before the residual.
      implementation: The kernels of the writes and the attention (see
        :func:`jaxkv.paged_attention`); ``"native"`` runs jaxkv's C++
        kernels where they apply (every write, rows of one query token) and
        XLA's path for prefill rows.

    Returns:
      ``(pools, logits (num_samples, vocab))``.
    """
    x = model.embed(token_ids)
    reduced = False
    for name, block in zip(model.names, model.blocks, strict=True):
        m = meta[name]
        view = layers[name]
        if isinstance(block, MambaBlock):
            if not isinstance(view, MambaView):
                raise TypeError(f"Layer {name!r} needs a MambaView.")
            pools, y = _mamba_paged(block, pools, view, m, x)
            x = x + _tensor_sum(y, tensor_axis)
            continue
        if not isinstance(view, AttentionLayer):
            raise TypeError(
                f"Layer {name!r} needs an AttentionLayer (plan.attention_layer), got "
                f"{type(view).__name__}."
            )
        if fast_prefill and name in model.targets and not reduced:
            x = x[sample_idx]  # YOCO early exit: only the tokens that need logits
            reduced = True
        _, positions, _ = token_requests_and_positions(m, x.shape[0])
        q, k, v = block.qkv(x, positions)
        if k is not None and v is not None:
            pools = write_kv(
                pools, view.view, k, v, m.slot_mapping, implementation=implementation
            )
        tile = query_tile or (16 if q.shape[0] > m.max_reqs else 1)
        out = paged_attention(  # window from the layer's spec
            q,
            pools,
            view,
            m,
            scale=float(1.0 / np.sqrt(block.head_size)),
            pages_per_chunk=pages_per_chunk,
            query_tile=tile,
            implementation="xla"
            if implementation == "native" and tile > 1
            else implementation,
        )
        x = x + _tensor_sum(block.wo(out.reshape(x.shape[0], -1)), tensor_axis)
    if not reduced:
        x = x[sample_idx]
    return pools, model.lm_head(model.final_norm(x))


def _mamba_paged(
    block: MambaBlock,
    pools: Pools,
    view: MambaView,
    meta: CommonAttentionMetadata,
    x: jax.Array,
) -> tuple[Pools, jax.Array]:
    """Mamba states in, a token-ordered scan over the ragged batch, states out."""
    src, dst = meta.mamba_state_blocks()
    conv, ssm = read_mamba_state(pools, view, src)
    fresh = src < 0  # nothing computed before (or a padded row): zero state
    conv = jnp.where(fresh[:, None, None], 0, conv)
    ssm = jnp.where(fresh[:, None, None, None], 0, ssm)
    req, _, valid = token_requests_and_positions(meta, x.shape[0])

    def step(carry, inputs):
        conv_all, ssm_all = carry
        r, ok, x_t = inputs
        c, s, y = block.cell(conv_all[r], ssm_all[r], x_t)
        conv_all = conv_all.at[r].set(jnp.where(ok, c, conv_all[r]))
        ssm_all = ssm_all.at[r].set(jnp.where(ok, s, ssm_all[r]))
        return (conv_all, ssm_all), jnp.where(ok, y, 0)

    (conv, ssm), y = jax.lax.scan(
        step, (conv.astype(block.conv_dtype), ssm), (req, valid, x)
    )
    pools = write_mamba_state(pools, view, dst, [conv, ssm])
    return pools, y


def _tensor_sum(y: jax.Array, tensor_axis: str | None) -> jax.Array:
    """Partial sums of a row-split projection, added up over the tensor axis."""
    return y if tensor_axis is None else jax.lax.psum(y, tensor_axis)
