from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from tests.helpers import examples


def _setup(layout, block_size=8, kernel=None, num_blocks=24, heads=2, head=4) -> Any:
    backend = jaxkv.AttentionBackend(
        name=f"B_{layout}_{kernel}",
        layout={
            "nhd": jaxkv.KVCacheLayout.BLOCKS_FIRST,
            "kv_first": jaxkv.KVCacheLayout.KV_FIRST,
        }[layout],
        supported_kernel_block_sizes=(kernel,)
        if kernel
        else (jaxkv.vllm.MultipleOf(1),),
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name="l", spec=spec, backend=backend)]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=num_blocks)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    bound = jaxkv.vllm.bind_kv_caches(views, ["l"], kv, cfg, groups)
    return groups, kv, pools, bound["l"]


def _reference(
    q,
    keys,
    values,
    q_pos,
    kv_len,
    scale,
    window=None,
    chunk=None,
    cap=None,
    causal=True,
    ranges=(),
):
    """Dense masked softmax for one request (NumPy, no paging)."""
    out = np.zeros((len(q_pos), q.shape[1], values.shape[-1]))
    groups = q.shape[1] // keys.shape[1]
    for i, p in enumerate(q_pos):
        for h in range(q.shape[1]):
            kh = h // groups
            allowed = []
            for j in range(kv_len):
                ok = (
                    (not causal)
                    or j <= p
                    or any(s <= p <= e and s <= j <= e for s, e in ranges)
                )
                if window is not None and not j > p - window:
                    ok = False
                if chunk is not None and j // chunk != p // chunk:
                    ok = False
                allowed.append(ok)
            allowed = np.array(allowed, bool)
            if not allowed.any():
                continue
            s = keys[:kv_len, kh] @ q[i, h] * scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ values[:kv_len, kh]
    return out


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 3))
    reqs = []
    for _ in range(num_reqs):
        q_len = draw(st.integers(1, 6))
        ctx = draw(st.integers(0, 30))
        reqs.append((q_len, ctx + q_len))
    # Masks combine (a window or a local chunk, a soft cap, PrefixLM ranges);
    # cross-attention stands alone. 2 KV heads serve 2, 4 or 6 query heads.
    if draw(st.integers(0, 5)) == 0:
        mask = frozenset({"cross"})
    else:
        local = draw(st.sampled_from([(), ("window",), ("chunk",)]))
        extra = draw(st.sets(st.sampled_from(["cap", "mm"])))
        mask = frozenset(local) | extra
    layout = draw(st.sampled_from(["nhd", "kv_first", "split"]))
    chunk = draw(st.sampled_from([1, 3, 4, 64]))
    tile = draw(st.sampled_from([1, 2, 4]))
    q_heads = draw(st.sampled_from([2, 4, 6]))
    contraction = draw(st.sampled_from(["dot", "reduce", "auto"]))
    head = draw(st.sampled_from([4, 16]))  # 16: the kernel's vector loops
    return (
        reqs,
        mask,
        layout,
        (chunk, tile, q_heads, contraction, head),
        draw(st.integers(0, 2**31 - 1)),
    )


@settings(
    max_examples=examples(20),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(batch=batches())
def test_paged_attention_matches_dense_reference(batch):
    reqs, mask, layout, (chunk, tile, q_heads, contraction, head), seed = batch
    rng = np.random.default_rng(seed)
    kernel = 4 if layout == "split" else None
    groups, kv, pools, view = _setup(
        "nhd" if layout == "split" else layout, kernel=kernel, head=head
    )
    heads, block = 2, 8
    width = 5  # blocks per request
    # NaN everywhere first: padding pages must never leak into outputs.
    n_slots = view.num_blocks * view.block_size
    nan = jnp.full((n_slots, heads, head), jnp.nan, jnp.float32)
    pools = jaxkv.write_kv(pools, view, nan, nan, jnp.arange(n_slots, dtype=jnp.int32))
    free = list(rng.permutation(np.arange(1, 24)))
    tables = np.zeros((4, width), np.int32)
    q_lens = [q for q, _ in reqs]
    seq_lens = [s for _, s in reqs]
    enc_lens = [int(rng.integers(1, 30)) for _ in reqs]
    all_k, all_v, ranges = [], [], []
    for r, (_, seq_len) in enumerate(reqs):
        tables[r] = [free.pop() for _ in range(width)]
        kv_len = enc_lens[r] if "cross" in mask else seq_len
        k = rng.standard_normal((kv_len, heads, head)).astype(np.float32)
        v = rng.standard_normal((kv_len, heads, head)).astype(np.float32)
        pos = np.arange(kv_len)
        slots = tables[r][pos // block] * block + pos % block
        slots = np.asarray(
            groups[0][0].map_to_kernel_slot_mapping(slots.astype(np.int32))
        )
        pools = jaxkv.write_kv(pools, view, k, v, slots)
        all_k.append(k)
        all_v.append(v)
        # A range that starts before or among the query's tokens, so queries
        # see keys ahead of them inside it.
        q_len = reqs[r][0]
        start = int(rng.integers(max(0, seq_len - q_len - 3), seq_len))
        ranges.append([(start, min(seq_len - 1, start + int(rng.integers(0, 6))))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    t_pad = num_tokens + 3
    q = rng.standard_normal((t_pad, q_heads, head)).astype(np.float32)
    ranges_arr = np.zeros((4, 1, 2), np.int32)
    for r, rs in enumerate(ranges):
        ranges_arr[r, 0] = rs[0]
    meta = jaxkv.vllm.build_attn_metadata(
        groups,
        len(reqs),
        num_tokens,
        np.pad(qsl, (0, 4 - len(reqs)), mode="edge"),
        None,
        max(q_lens),
        np.pad(seq_lens, (0, 4 - len(reqs))),
        max(seq_lens),
        [tables],
        [np.full(t_pad, -1, np.int32)],
        kv,
        encoder_seq_lens=np.pad(enc_lens, (0, 4 - len(reqs))),
        mm_prefix_ranges=ranges_arr,
        mm_num_ranges=np.array([1] * len(reqs) + [0] * (4 - len(reqs))),
    )["l"]
    kw: dict[str, Any] = dict(
        scale=0.5, pages_per_chunk=chunk, query_tile=tile, contraction=contraction
    )
    ref_kw = {}
    if "window" in mask:
        kw["sliding_window"] = ref_kw["window"] = 5
    if "chunk" in mask:
        kw["attention_chunk_size"] = ref_kw["chunk"] = 8
    if "cap" in mask:
        kw["logits_soft_cap"] = ref_kw["cap"] = 2.0
    if "cross" in mask:
        kw["cross_attention"] = True
        ref_kw["causal"] = False
    if "mm" in mask:
        kw["use_mm_prefix"] = True
    out = np.asarray(jaxkv.paged_attention(jnp.asarray(q), pools, view, meta, **kw))
    assert np.isfinite(out).all()
    for r, (q_len, seq_len) in enumerate(reqs):
        q_pos = np.arange(seq_len - q_len, seq_len)
        kv_len = enc_lens[r] if "cross" in mask else seq_len
        want = _reference(
            q[qsl[r] : qsl[r + 1]],
            all_k[r],
            all_v[r],
            q_pos,
            kv_len,
            0.5,
            ranges=ranges[r] if "mm" in mask else (),
            **ref_kw,
        )
        np.testing.assert_allclose(out[qsl[r] : qsl[r + 1]], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[num_tokens:], 0.0)  # padded tokens


def test_the_layer_s_own_cap_and_local_chunk_reach_the_kernel():
    # An AttentionLayer carries its config's soft cap and its full-attention
    # spec's local chunk; 6 query heads over 2 KV heads.
    spec = jaxkv.FullAttentionSpec(
        block_size=8,
        num_kv_heads=2,
        head_size=4,
        dtype="float32",
        attention_chunk_size=8,
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="l",
                spec=spec,
                backend=jaxkv.get_backend("JAX_PAGED"),
                num_heads=6,
                logits_soft_cap=2.0,
            )
        ]
    )
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    layer = plan.attention_layer("l")
    assert (layer.logits_soft_cap, layer.attention_chunk_size) == (2.0, 8)
    rng = np.random.default_rng(0)
    seq_len, q_len = 20, 4
    k = rng.standard_normal((seq_len, 2, 4)).astype(np.float32) * 3
    v = rng.standard_normal((seq_len, 2, 4)).astype(np.float32)
    table = np.array([[3, 1, 2]], np.int32)
    pos = np.arange(seq_len)
    pools = jaxkv.write_kv(
        plan.allocate(), layer.view, k, v, (table[0][pos // 8] * 8 + pos % 8)
    )
    q = rng.standard_normal((q_len, 6, 4)).astype(np.float32) * 3
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        1,
        q_len,
        np.array([0, q_len]),
        None,
        q_len,
        np.array([seq_len]),
        seq_len,
        [table],
        [np.full(q_len, -1, np.int32)],
        plan.kv_cache_config,
    )["l"]
    out = jaxkv.paged_attention(jnp.asarray(q), pools, layer, meta, scale=0.5)
    want = _reference(
        q, k, v, np.arange(seq_len - q_len, seq_len), seq_len, 0.5, chunk=8, cap=2.0
    )
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def test_contraction_is_checked_and_auto_follows_the_platform_and_tile():
    from jaxkv.attention import resolve_contraction

    cpu = jax.default_backend() == "cpu"
    assert resolve_contraction("auto", 16) == ("reduce" if cpu else "dot")
    assert resolve_contraction("auto", 1) == "dot"
    assert resolve_contraction("dot", 16) == "dot"
    groups, kv, pools, view = _setup("nhd")
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=2, max_tokens=4, max_blocks=2)
    with pytest.raises(ValueError, match="contraction='matmul'.*'reduce'"):
        jaxkv.paged_attention(
            jnp.zeros((4, 2, 4)), pools, view, meta, scale=1.0, contraction="matmul"
        )
