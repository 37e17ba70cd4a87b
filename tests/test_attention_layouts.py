"""paged_attention on every layout the registry ships, against a NumPy reference.

Each case plans a model through :func:`jaxkv.make_plan`, fills the pools with
random bytes (so any wrong page, offset or stride shows up as garbage or NaN),
writes each request's K/V through the layer's view and compares a mixed
prefill/decode batch with dense masked softmax in NumPy. Also: the pages a
windowed attention reads are counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import jaxkv.attention._xla
from tests.test_attention import _reference

FUSED = jaxkv.AttentionBackend(
    name="FusedKV",
    layout=jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED,
    supported_kernel_block_sizes=(jaxkv.vllm.MultipleOf(1),),
)
SPLIT8 = jaxkv.AttentionBackend(
    name="Split8",
    layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
    supported_kernel_block_sizes=(8,),
)


def _full(block, heads=2, head=8, **kw):
    return jaxkv.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype="float32", **kw
    )


def _one_layer(spec, backend, *, packed=False, extra=0):
    """`extra` layers of the same spec before "l", so "l" sits at an offset."""
    layers = [
        jaxkv.LayerConfig(name=f"x{i}", spec=spec, backend=backend)
        for i in range(extra)
    ]
    layers.append(jaxkv.LayerConfig(name="l", spec=spec, backend=backend))
    cfg = jaxkv.RunnerConfig(layers=layers, max_model_len=256)
    return cfg, "l", packed


def _hybrid_offset():
    # Packed hybrid pool: layers.3 (full attention) starts one page into each
    # block, behind layers.0/1/2's pages (attention, window, padded Mamba).
    cfg = jaxkv.tiny_hybrid_config(
        kv_sharing_fast_prefill=False, max_model_len=256, head_size=8
    )
    return cfg, "layers.3.self_attn", True


CASES = {
    "blocks_first_nhd": lambda: _one_layer(_full(16), jaxkv.get_backend("FLASH_ATTN")),
    "blocks_first_hnd": lambda: _one_layer(_full(16), jaxkv.get_backend("FLASHINFER")),
    "fused_kv": lambda: _one_layer(_full(16, head_size_v=4), FUSED),
    "kv_first": lambda: _one_layer(_full(16), jaxkv.get_backend("ROCM_ATTN")),
    "kv_first_jax": lambda: _one_layer(
        _full(16), jaxkv.get_backend("JAX_PAGED_KV_FIRST")
    ),
    "mla_latent": lambda: _one_layer(
        jaxkv.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=16, dtype="float32"
        ),
        jaxkv.get_backend("FLASHMLA"),
    ),
    "kernel_split": lambda: _one_layer(_full(32), SPLIT8),
    "packed_kernel_split": lambda: _one_layer(_full(32), SPLIT8, packed=True, extra=2),
    "packed_offset": lambda: _one_layer(
        _full(16), jaxkv.get_backend("FLASH_ATTN"), packed=True, extra=2
    ),
    "hybrid_padded_offset": _hybrid_offset,
}


def _setup(case: str, num_blocks: int = 24) -> Any:
    cfg, name, packed = CASES[case]()
    plan = jaxkv.make_plan(
        cfg, num_blocks=num_blocks, packed=packed, maps_slot_mapping=True
    )
    rng = np.random.default_rng(7)
    # Random words everywhere: a read of the wrong bytes is garbage or NaN.
    pools = tuple(
        jnp.asarray(rng.integers(0, 2**31, p.shape, dtype=np.int64).astype(p.dtype))
        for p in plan.pools
    )
    gid = plan.kv_cache_config.group_of(name)
    (group,) = [g for g in plan.attn_groups[gid] if name in g.layer_names]
    return plan, pools, plan.views[name], group, gid


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_on_every_layout_matches_numpy(case):
    plan, pools, view, group, gid = _setup(case)
    spec = group.kv_cache_spec
    mla = isinstance(spec, jaxkv.MLAAttentionSpec)
    heads_kv = spec.num_kv_heads
    d, dv = spec.head_size, (spec.head_size if mla else spec.head_size_v)
    block = spec.block_size
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    reqs = [(5, 37), (1, 20), (1, 3), (3, 3)]  # (query, context after the step)
    width = plan.block_table_widths[gid]
    ids = rng.permutation(np.arange(1, plan.num_blocks))
    tables = np.zeros((len(reqs), width), np.int32)
    all_k, all_v = [], []
    free = iter(ids)  # distinct block ids across requests
    for r, (_, seq) in enumerate(reqs):
        n = -(-seq // block)
        tables[r, :n] = [next(free) for _ in range(n)]
        k = rng.standard_normal((seq, heads_kv, d)).astype(np.float32)
        v = rng.standard_normal((seq, heads_kv, dv)).astype(np.float32)
        pos = np.arange(seq)
        slots = (tables[r][pos // block] * block + pos % block).astype(np.int32)
        slots = np.asarray(group.map_to_kernel_slot_mapping(slots))
        if mla:
            pools = jaxkv.write_kv(pools, view, k[:, 0], None, slots)
            v = k
        else:
            pools = jaxkv.write_kv(pools, view, k, v, slots)
        all_k.append(k)
        all_v.append(v)
    q_lens = [q for q, _ in reqs]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    max_reqs, max_tokens = 6, num_tokens + 4
    q = rng.standard_normal((max_tokens, 2 * heads_kv, d)).astype(np.float32)
    n_groups = len(plan.attn_groups)
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        len(reqs),
        num_tokens,
        np.pad(qsl, (0, max_reqs - len(reqs)), mode="edge"),
        None,
        max(q_lens),
        np.pad([s for _, s in reqs], (0, max_reqs - len(reqs))),
        max(s for _, s in reqs),
        [np.pad(tables, ((0, max_reqs - len(reqs)), (0, 0)))] * n_groups,
        [np.full(max_tokens, -1, np.int32)] * n_groups,
        plan.kv_cache_config,
    )[group.layer_names[0]]
    out = np.asarray(
        jaxkv.paged_attention(
            jnp.asarray(q), pools, view, meta, scale=0.3, pages_per_chunk=2
        )
    )
    for r, (q_len, seq) in enumerate(reqs):
        want = _reference(
            q[qsl[r] : qsl[r + 1]],
            all_k[r],
            all_v[r],
            np.arange(seq - q_len, seq),
            seq,
            0.3,
        )
        np.testing.assert_allclose(
            out[qsl[r] : qsl[r + 1]], want, rtol=2e-5, atol=2e-5, err_msg=case
        )
    np.testing.assert_array_equal(out[num_tokens:], 0.0)


def test_windowed_attention_reads_only_the_pages_of_its_window(monkeypatch):
    """A decode at position 999 with a 64-token window reads 5 pages, not 63."""
    cfg, name, _ = _one_layer(_full(16), jaxkv.get_backend("FLASH_ATTN"))
    cfg = dataclasses.replace(cfg, max_model_len=1024)
    plan = jaxkv.make_plan(cfg, num_blocks=80)
    view = plan.views[name]
    pools = plan.allocate()
    table = np.arange(1, 65, dtype=np.int32)[None, :]  # 64 pages, 1024 tokens
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        1,
        1,
        np.array([0, 1]),
        None,
        1,
        np.array([1000]),
        1000,
        [table],
        [np.full(1, -1, np.int32)],
        plan.kv_cache_config,
    )[name]
    read: list[np.ndarray] = []
    real_gather = jaxkv.attention._xla.gather_kv_pages

    def counting_gather(pools, view, block_table, **kwargs):
        read.append(np.asarray(block_table))
        return real_gather(pools, view, block_table, **kwargs)

    monkeypatch.setattr(jaxkv.attention._xla, "gather_kv_pages", counting_gather)
    q = jnp.ones((1, 4, 8), jnp.float32)
    with jax.disable_jit():  # the loop runs in Python, one gather per chunk
        jaxkv.paged_attention(
            q,
            pools,
            view,
            meta,
            scale=1.0,
            sliding_window=64,
            pages_per_chunk=1,
            implementation="xla",  # XLA's chunk loop
        )
    pages = sorted({int(p) for chunk in read for p in chunk.ravel()})
    # Keys 936..999 are visible: pages 58..62 hold them (ids 59..63).
    assert pages == [59, 60, 61, 62, 63], pages
    read.clear()
    with jax.disable_jit():
        jaxkv.paged_attention(
            q, pools, view, meta, scale=1.0, pages_per_chunk=1, implementation="xla"
        )
    assert len({int(p) for chunk in read for p in chunk.ravel()}) == 63
