"""vLLM 0.33's layout model: [L, B, H, N, C] permutations, tensors, resolution,
and jaxkv's typed pools placing every byte where vLLM 0.33's views do."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

L = jaxkv.vllm.TensorLayout


def _view(plan, name) -> jaxkv.KVCacheView:
    view = plan.views[name]
    assert isinstance(view, jaxkv.KVCacheView)
    return view


SPEC = jaxkv.FullAttentionSpec(
    block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16"
)


@pytest.mark.parametrize(
    ("layout", "strides"),
    [
        # Worked by hand: C = (128 + 128) * 2 = 512 bytes, H = 8, N = 16 tokens,
        # B = 4 blocks, L = 2 layers; innermost first.
        (L.LBNHC, (262144, 65536, 512, 4096, 1)),  # C, H 512, N 4096, B, L
        (L.LBHNC, (262144, 65536, 8192, 512, 1)),  # C, N 512, H 8192
        (L.BLNHC, (65536, 131072, 512, 4096, 1)),  # a block holds both layers
        (L.LHBNC, (262144, 8192, 32768, 512, 1)),  # per head, all blocks
    ],
)
def test_layout_strides_follow_the_permutation(layout, strides):
    shape, got = jaxkv.vllm.layout_strides(
        SPEC, num_blocks=4, num_layers=2, layout=layout
    )
    assert shape == (2, 4, 8, 16, 512)
    assert got == strides


def test_padded_pages_round_the_page_grid_and_refuse_kernel_splits():
    spec = jaxkv.FullAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype="float32",
        page_size_padded=2048,
    )  # a 1024-byte page padded to 2048
    _, strides = jaxkv.vllm.layout_strides(
        spec, num_blocks=3, num_layers=2, layout=L.LBNHC
    )
    assert strides[:2] == (6144, 2048)
    with pytest.raises(ValueError, match="dense, unpadded pages"):
        jaxkv.vllm.layout_strides(
            spec, num_blocks=3, num_layers=2, layout=L.LBNHC, kernel_block_size=8
        )
    dense = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    shape, strides = jaxkv.vllm.layout_strides(
        dense,
        num_blocks=3,
        num_layers=1,
        layout=L.LBNHC,
        kernel_block_size=8,
        block_stride=1024,
    )
    assert shape[1] == 6
    assert strides[1] == 512  # a kernel block is half a page


def test_resolve_layout_as_vllm_does():
    small = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16"
    )
    assert jaxkv.vllm.resolve_layout([[L.LHBNC, L.LBNHC]], [SPEC]) == L.LHBNC
    # Mixed (H, N, page) shapes alias pages only in a block-compact layout.
    assert jaxkv.vllm.resolve_layout([[L.LHBNC, L.LBNHC]], [SPEC, small]) == L.LBNHC
    with pytest.raises(ValueError, match="block-compact"):
        jaxkv.vllm.resolve_layout([[L.LHBNC, L.BHLNC]], [SPEC, small])
    with pytest.raises(ValueError, match="disagree"):
        jaxkv.vllm.resolve_layout([[L.LBNHC], [L.LBHNC]])
    with pytest.raises(ValueError, match="not a valid layout"):
        jaxkv.vllm.resolve_layout([[L.LBNHC]], requested=L.BLNHC)
    assert jaxkv.vllm.resolve_layout([[L.LBNHC, L.BLNHC]], requested=L.BLNHC) == L.BLNHC


def _kv(rng, n, h, d):
    return (jnp.asarray(rng.normal(size=(n, h, d)), jnp.float32) for _ in "kv")


def test_a_stacked_pool_is_vllm_0_33_s_lbnhc_tensor_byte_for_byte():
    # The same K/V written through jaxkv's stacked typed pool and through vLLM
    # 0.33's LBNHC views of one flat backing give identical bytes.
    cfg = jaxkv.llama_like_config(num_layers=3, num_kv_heads=2, head_size=16)
    plan = jaxkv.make_plan(cfg, num_blocks=5, storage="stacked")
    (tensor,) = jaxkv.vllm.plan_tensors(plan)
    assert tensor.layers == tuple(f"layers.{i}.self_attn" for i in range(3))
    spec = cfg.layers[0].spec
    assert isinstance(spec, jaxkv.AttentionSpec)
    views = jaxkv.vllm.tensor_views(tensor, spec, num_blocks=5, layout=L.LBNHC)
    backing = jaxkv.plan.allocate_pools(
        [jaxkv.plan.PoolSpec(size_bytes=tensor.size, word=4)]
    )
    pools = plan.allocate()
    rng = np.random.default_rng(0)
    slots = np.array([3, 17, 40, 79, -1])
    for name in tensor.layers:
        k, v = _kv(rng, 5, 2, 16)
        pools = jaxkv.write_kv(pools, plan.views[name], k, v, slots)
        backing = jaxkv.write_kv(backing, views[name], k, v, slots)
        assert jaxkv.vllm.layout_of_view(_view(plan, name)) == L.LBNHC
    np.testing.assert_array_equal(
        np.asarray(pools[0]).reshape(-1).view(np.uint32), np.asarray(backing[0])
    )
    # Element (layer l, block b, token n, head h, K|V c) at vLLM's byte; the
    # tensor view names it in vLLM's [B, H, N, C] order.
    view = views["layers.2.self_attn"]
    assert view.axes == ("block", "head", "token", "dim")
    for b, n, h, c in [(0, 0, 0, 0), (4, 15, 1, 31), (2, 7, 0, 16)]:
        want = tensor.page_start(layer=2, block=b) + (n * 2 + h) * 128 + c * 4
        assert view.byte_address((b, h, n, c)) == want
        assert _view(plan, "layers.2.self_attn").byte_address((b, n, h, c)) == want


def test_block_outermost_tensor_views_address_vllm_s_bytes():
    spec = jaxkv.FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=2, dtype="float32"
    )
    page = 4 * 2 * 4 * 4
    tensor = jaxkv.vllm.LayerTensor(
        size=3 * 2 * page, layers=("a", "b"), layer_stride=page, block_stride=2 * page
    )
    views = jaxkv.vllm.tensor_views(tensor, spec, num_blocks=3, layout=L.BLNHC)
    pools = jaxkv.plan.allocate_pools(
        [jaxkv.plan.PoolSpec(size_bytes=tensor.size, word=4)]
    )
    k = jnp.full((1, 2, 2), 7.0)
    pools = jaxkv.write_kv(pools, views["b"], k, k + 1, jnp.array([2 * 4 + 1]))
    raw = np.asarray(pools[0]).view(np.float32)
    start = tensor.page_start(layer=1, block=2) + 1 * 2 * 16  # token 1
    np.testing.assert_array_equal(
        raw[start // 4 : start // 4 + 8], [7, 7, 8, 8, 7, 7, 8, 8]
    )
    assert np.count_nonzero(raw) == 8


def test_the_seeds_layouts_are_not_described_as_vllm_0_33_tensors():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    assert jaxkv.vllm.layout_of_view(_view(plan, "layers.0.self_attn")) is None
    assert jaxkv.vllm.plan_tensors(plan) == ()
    with pytest.raises(TypeError, match="KVCachePlan"):
        jaxkv.vllm.plan_tensors(plan.views)


def test_overlaid_group_tensors_alias_one_backing_as_in_vllm():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    page = spec.page_size_bytes
    tensors = [
        jaxkv.vllm.LayerTensor(
            size=2 * 4 * page, layers=names, layer_stride=4 * page, block_stride=page
        )
        for names in (("full.0", "full.1"), ("swa.0", "swa.1"))
    ]
    specs = dict.fromkeys(["full.0", "full.1", "swa.0", "swa.1"], spec)
    pool_specs, views = jaxkv.vllm.allocate_layer_tensors(
        tensors, specs, num_blocks=4, layout=L.LBNHC
    )
    pools = jaxkv.plan.allocate_pools(pool_specs)
    k = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 2, 8)
    pools = jaxkv.write_kv(pools, views["full.1"], k, -k, jnp.array([2 * 16 + 5]))
    kp, vp = jaxkv.gather_kv_pages(pools, views["swa.1"], jnp.array([[2]]))
    np.testing.assert_array_equal(np.asarray(kp[0, 0, 5]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(vp[0, 0, 5]), -np.asarray(k[0]))
    kp0, _ = jaxkv.gather_kv_pages(pools, views["swa.0"], jnp.array([[2]]))
    assert not np.asarray(kp0).any()  # layer 0 is another layer's region
    with pytest.raises(ValueError, match="one backing"):
        jaxkv.vllm.allocate_layer_tensors(
            [
                tensors[0],
                jaxkv.vllm.LayerTensor(
                    size=1, layers=("x",), layer_stride=1, block_stride=1
                ),
            ],
            specs | {"x": spec},
            num_blocks=4,
            layout=L.LBNHC,
        )


def test_a_view_in_vllm_s_bhnc_order_reads_and_writes_as_its_logical_form():
    # vLLM 0.33's create_kv_cache_views names a layer tensor [B, H, N, C]:
    # tensor_views follows it, and every path reading by position (write_kv,
    # gather_kv_pages, paged_attention on XLA and the native kernel) first
    # swaps the axes back (KVCacheView.logical), so the same bytes give the
    # same results in either order, on a heads-outer layout too.
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    backend = jaxkv.get_backend("JAX_PAGED")
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name="l", spec=spec, backend=backend)]
    )
    plan = jaxkv.make_plan(cfg, num_blocks=6)
    slots = jnp.arange(16, 56, dtype=jnp.int32)
    # A prefill of 40 tokens (XLA) and a decode of the 40th (XLA and the
    # native kernel, which takes rows of one query token); half the K/V
    # written by XLA, half by the native write.
    table = [np.array([[1, 2, 3, 0]], np.int32)]
    calls = [
        (jaxkv.vllm.build_attn_metadata(
            plan.attn_groups, 1, n, np.array([0, n], np.int32), None, 1,
            np.array([40], np.int32), 40, table, [np.full(n, -1, np.int32)],
            plan.kv_cache_config,
        )["l"], n, impls)
        for n, impls in ((40, ("xla",)), (1, ("xla", "native")))
    ]  # fmt: skip
    rng = np.random.default_rng(1)
    k, v = _kv(rng, 40, 2, 8)
    q = jnp.asarray(rng.normal(size=(40, 2, 8)), jnp.float32)
    for layout in (L.LBNHC, L.LBHNC):
        shape, strides = jaxkv.vllm.layout_strides(
            spec, num_blocks=6, num_layers=1, layout=layout
        )
        t = jaxkv.vllm.LayerTensor(
            size=int(np.prod(shape)), layers=("l",), layer_stride=strides[0],
            block_stride=strides[1],
        )  # fmt: skip
        bhnc = jaxkv.vllm.tensor_views(t, spec, num_blocks=6, layout=layout)["l"]
        assert bhnc.axes == ("block", "head", "token", "dim")
        assert bhnc.shape == (6, 2, 16, 16)
        nhd = bhnc.logical()
        assert nhd.axes == ("block", "token", "head", "dim")
        outs = []
        for view in (bhnc, nhd):
            pools = jaxkv.plan.allocate_pools(
                [jaxkv.plan.PoolSpec(size_bytes=t.size, word=4)]
            )
            pools = jaxkv.write_kv(pools, view, k[:20], v[:20], slots[:20])
            pools = jaxkv.write_kv(
                pools, view, k[20:], v[20:], slots[20:], implementation="native"
            )
            pages = jaxkv.gather_kv_pages(pools, view, jnp.array([[1, 2, 3]]))
            att = [
                np.asarray(jaxkv.paged_attention(q[-n:], pools, view, meta,
                                                 scale=0.3, implementation=impl))
                for meta, n, impls in calls
                for impl in impls
            ]  # fmt: skip
            outs.append((np.asarray(pools[0]), pages, att))
        (p0, pg0, a0), (p1, pg1, a1) = outs
        np.testing.assert_array_equal(p0, p1)  # the same bytes written
        for x, y in zip(pg0, pg1, strict=True):
            np.testing.assert_array_equal(x, y)  # read back as (.., N, H, D)
        np.testing.assert_array_equal(pg0[0][0, 0, :8], np.asarray(k)[:8])
        np.testing.assert_array_equal(pg0[1][0, 0, :8], np.asarray(v)[:8])
        for got in (a0[0], a1[0]):  # the prefill, in both orders
            np.testing.assert_allclose(got, a0[0], rtol=1e-5, atol=1e-5)
        for got in (*a0[1:], *a1[1:]):  # the decode: its last row
            np.testing.assert_allclose(got, a0[0][-1:], rtol=1e-5, atol=1e-5)
        assert np.abs(a0[0]).max() > 0


def test_a_typed_view_in_bhnc_order_feeds_the_pallas_kernels_as_its_logical_form():
    # The Pallas kernels (interpreted on CPU) read typed pools by position;
    # a typed view named in vLLM's [B, H, N, C] order reaches them swapped
    # back, so attention over it equals attention over the planned view.
    cfg = jaxkv.llama_like_config(num_layers=1, num_kv_heads=2, head_size=16)
    plan = jaxkv.make_plan(cfg, num_blocks=6, storage="typed")
    name = "layers.0.self_attn"
    nhd = plan.views[name]
    assert isinstance(nhd, jaxkv.KVCacheView)
    t, h = nhd.dim("token"), nhd.dim("head")
    order = list(range(len(nhd.axes)))
    order[t], order[h] = h, t
    bhnc = dataclasses.replace(
        nhd,
        shape=tuple(nhd.shape[i] for i in order),
        strides=tuple(nhd.strides[i] for i in order),
        axes=tuple(nhd.axes[i] for i in order),
    )
    assert bhnc.logical() == nhd
    rng = np.random.default_rng(2)
    k, v = _kv(rng, 20, 2, 16)
    q = jnp.asarray(rng.normal(size=(20, 4, 16)), jnp.float32)
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups, 1, 20, np.array([0, 20], np.int32), None, 1,
        np.array([20], np.int32), 20, [np.array([[4, 2] + [0] * 2], np.int32)],
        [np.full(20, -1, np.int32)], plan.kv_cache_config,
    )[name]  # fmt: skip
    slots = jnp.asarray(np.r_[np.arange(64, 80), np.arange(32, 36)], jnp.int32)
    pools = jaxkv.write_kv(plan.allocate(), nhd, k, v, slots)
    outs = [
        np.asarray(jaxkv.paged_attention(q, pools, view, meta, scale=0.25,
                                         implementation="pallas"))
        for view in (bhnc, nhd)
    ]  # fmt: skip
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert np.abs(outs[1]).max() > 0
