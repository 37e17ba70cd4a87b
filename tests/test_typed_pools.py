"""Typed, layer-stacked pools: the same bytes as word pools, read and written in
place, scanned over layers, handed to real kernels without a copy."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

L0, L1, L2 = (f"layers.{i}.self_attn" for i in range(3))


def _view(plan, name) -> jaxkv.KVCacheView:
    view = plan.views[name]
    assert isinstance(view, jaxkv.KVCacheView)
    return view


def _ops(plan, dtype, seed=0):
    """Writes, reads, zeroes every layer of a 3-layer plan; everything read."""
    rng = np.random.default_rng(seed)
    pools = plan.allocate()
    out = []
    for name in (L0, L1, L2):
        view = _view(plan, name)
        heads = view.shape[view.dim("head")]
        k, v = (
            jnp.asarray(rng.normal(size=(5, heads, view.head_size)), dtype)
            for _ in "kv"
        )
        slots = np.array([17, -1, 40, 10**6, view.num_blocks * view.block_size - 1])
        pools = jaxkv.write_kv(pools, view, k, v, slots)
        out.append(jaxkv.gather_kv_pages(pools, view, np.array([[1, 2], [5, -3]])))
        out.append(jaxkv.read_view(pools, view))
    pools = jaxkv.zero_blocks(pools, [plan.views[L1]], np.array([2, -1]))
    out.append(jaxkv.read_view(pools, plan.views[L1]))
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(out)], pools


@pytest.mark.parametrize(
    ("backend", "dtype"),
    # Two layouts in the fast pass (fused K|V fp32, blocks-first bf16); the
    # other three, 4-5 s each, in the slow pass.
    [
        ("JAX_PAGED_FUSED", "float32"),
        pytest.param("JAX_PAGED_FUSED", "bfloat16", marks=pytest.mark.slow),
        ("JAX_PAGED", "bfloat16"),
        pytest.param("FLASHINFER", "float32", marks=pytest.mark.slow),
        pytest.param("JAX_PAGED_KV_FIRST", "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_typed_and_stacked_pools_hold_what_word_pools_hold(backend, dtype):
    cfg = jaxkv.llama_like_config(
        num_layers=3, dtype=dtype, attention_backend=backend, block_size=32
    )
    want, _ = _ops(jaxkv.make_plan(cfg, num_blocks=6, storage="words"), dtype)
    for storage, pool_dtype in [("typed", "element"), ("stacked", "bits")]:
        plan = jaxkv.make_plan(
            cfg, num_blocks=6, storage=storage, pool_dtype=pool_dtype
        )
        assert all(p.typed for p in plan.pools)
        got, pools = _ops(plan, dtype)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
        if storage == "stacked":
            assert len(pools) == 1
            assert pools[0].shape[0] == 3
        if pool_dtype == "bits" and dtype == "bfloat16":
            assert pools[0].dtype == jnp.uint16


def test_a_kernel_split_view_of_a_typed_pool_equals_the_word_pool():
    # FlashInfer takes kernel blocks of 64 at most: manager blocks of 128 split.
    cfg = jaxkv.llama_like_config(
        num_layers=3, attention_backend="FLASHINFER", block_size=128
    )
    words = jaxkv.make_plan(cfg, num_blocks=3, storage="words")
    stacked = jaxkv.make_plan(cfg, num_blocks=3, storage="stacked")
    assert _view(stacked, L0).block_size == 64
    assert _view(stacked, L0).num_blocks == 6
    want, _ = _ops(words, "float32")
    got, _ = _ops(stacked, "float32")
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pools_that_typed_storage_cannot_hold_stay_words():
    # Attention sharing pages with Mamba state (padded), and packed pools.
    hybrid = jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(), num_blocks=4, storage="stacked"
    )
    assert not any(p.typed for p in hybrid.pools)
    packed = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=2),
        num_blocks=4,
        storage="stacked",
        packed=True,
    )
    assert not any(p.typed for p in packed.pools)
    default = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    assert default.storage == jaxkv.plan.resolve_storage("auto", "auto")[0]
    assert not any(p.typed for p in default.pools)  # on every platform


def test_lbnhc_places_k_and_v_side_by_side_per_token_and_head():
    # vLLM 0.32+'s default FlashAttention layout LBNHC: in layer l's tensor,
    # element (block b, token t, head h, K|V c, dim d) is at byte
    # (((b * B + t) * H + h) * 2 + c) * D + d, times the itemsize, after the
    # layer's own bytes start; layers stacked at l * (N * B * H * 2D).
    n, b, h, d = 4, 16, 2, 32
    cfg = jaxkv.llama_like_config(
        num_layers=2, block_size=b, num_kv_heads=h, head_size=d
    )
    plan = jaxkv.make_plan(cfg, num_blocks=n, storage="stacked")
    (spec,) = plan.pools
    assert spec.shape == (2, n, b, h, 2 * d)
    view = _view(plan, L1)
    k = jnp.zeros((1, h, d)).at[0, 1, 5].set(7.0)
    v = jnp.zeros((1, h, d)).at[0, 1, 5].set(9.0)
    pools = jaxkv.write_kv(plan.allocate(), view, k, v, jnp.array([2 * b + 3]))
    raw = np.asarray(pools[0]).reshape(-1)
    layer = n * b * h * 2 * d
    at_k = layer + (((2 * b + 3) * h + 1) * 2 + 0) * d + 5
    at_v = layer + (((2 * b + 3) * h + 1) * 2 + 1) * d + 5
    assert raw[at_k] == 7.0
    assert raw[at_v] == 9.0
    assert np.count_nonzero(raw) == 2
    assert view.byte_address((2, 3, 1, 5)) == 4 * at_k
    assert view.byte_address((2, 3, 1, d + 5)) == 4 * at_v


def test_layer_index_is_checked_on_the_host_and_dropped_inside_jit():
    plan = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="stacked"
    )
    view = plan.views[L0]
    k = jnp.ones((1, 2, 32))
    with pytest.raises(
        ValueError, match=r"layer=3, expected an integer scalar in \[0, 3\)"
    ):
        jaxkv.write_kv(plan.allocate(), view, k, k, jnp.array([20]), layer=3)
    with pytest.raises(TypeError, match="layer must hold integer"):
        jaxkv.write_kv(plan.allocate(), view, k, k, jnp.array([20]), layer=1.0)
    words = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="words"
    )
    with pytest.raises(TypeError, match="flat word pool"):
        jaxkv.write_kv(
            words.allocate(), words.views[L0], k, k, jnp.array([20]), layer=0
        )

    @jax.jit
    def write_at(pools, layer):
        return jaxkv.write_kv(pools, view, k, k, jnp.array([20]), layer=layer)

    for bad in (-1, 3, 2**31 - 1):
        pools = write_at(plan.allocate(), jnp.int32(bad))
        assert not np.asarray(pools[0]).any(), bad
    pools = write_at(plan.allocate(), jnp.int32(2))
    assert np.asarray(pools[0])[2].any()
    assert not np.asarray(pools[0])[:2].any()


def test_a_word_view_on_a_typed_pool_is_refused():
    words = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="words"
    )
    stacked = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="stacked"
    )
    with pytest.raises(ValueError, match="another plan"):
        jaxkv.gather_kv_pages(stacked.allocate(), words.views[L0], jnp.array([[1]]))
    with pytest.raises(ValueError, match="another plan"):
        jaxkv.gather_kv_pages(words.allocate(), stacked.views[L0], jnp.array([[1]]))


def _pool_sized_ops(hlo: str, elements: int) -> list[str]:
    """Compiled-HLO copies, converts, transposes and bitcast-converts with an
    output of at least `elements` elements."""
    out = []
    for line in hlo.splitlines():
        m = re.search(
            r"= \w+\[([\d,]*)\]\S* (copy|convert|transpose|bitcast-convert)\(", line
        )
        if m and int(np.prod([int(x) for x in m.group(1).split(",") if x])) >= elements:
            out.append(line.strip())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_writes_and_reads_of_a_stacked_pool_copy_nothing(dtype):
    cfg = jaxkv.llama_like_config(num_layers=4, dtype=dtype)
    plan = jaxkv.make_plan(cfg, num_blocks=64, storage="stacked")
    pools = plan.allocate()
    view = plan.views[L1]
    k = jnp.ones((8, 2, 32), dtype)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pools, layer, slots, table):
        pools = jaxkv.write_kv(pools, view, k, k, slots, layer=layer)
        kp, _ = jaxkv.gather_kv_pages(pools, view, table, layer=layer)
        return pools, kp.sum()

    compiled = step.lower(
        pools, jnp.int32(2), jnp.arange(8), jnp.ones((2, 4), jnp.int32)
    ).compile()
    elements = int(np.prod(pools[0].shape[1:]))  # one layer's cache
    hlo = compiled.as_text()
    assert hlo is not None
    assert _pool_sized_ops(hlo, elements) == []
    mem = compiled.memory_analysis()
    assert mem is not None
    assert mem.temp_size_in_bytes < pools[0].nbytes // 8
    assert mem.alias_size_in_bytes == pools[0].nbytes  # donated, updated in place


def _forward(plan, params, pools, meta, tokens, *, scan):
    """A 4-layer attention model: scanned over the stack, or unrolled."""
    names = [f"layers.{i}.self_attn" for i in range(4)]
    x = params["embed"][tokens]

    def layer_step(x, pools, w, layer, slot):
        q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in "qkv")
        pools = jaxkv.write_kv(pools, layer.view, k, v, meta.slot_mapping, layer=slot)
        out = jaxkv.paged_attention(q, pools, layer, meta, scale=32**-0.5, layer=slot)
        return x + out.reshape(x.shape), pools

    if scan:
        stack = plan.layer_stack(names)

        def body(carry, xs):
            x, pools = carry
            w, slot = xs
            return layer_step(x, pools, w, stack.layer, slot), None

        (x, pools), _ = jax.lax.scan(
            body, (x, pools), (params["layers"], jnp.asarray(stack.slots))
        )
    else:
        for i, name in enumerate(names):
            w = jax.tree.map(lambda a, i=i: a[i], params["layers"])
            x, pools = layer_step(x, pools, w, plan.attention_layer(name), None)
    return pools, x @ params["unembed"]


@pytest.mark.slow
def test_a_scan_over_layers_gives_the_unrolled_model_s_logits():
    cfg = jaxkv.llama_like_config(
        num_layers=4,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(32,),
    )
    keys = iter(jax.random.split(jax.random.key(0), 8))
    params = {
        "embed": jax.random.normal(next(keys), (50, 128)),
        "layers": {
            n: jax.random.normal(next(keys), (4, 128, h, 32)) / 11
            for n, h in zip("qkv", (4, 2, 2), strict=True)
        },
        "unembed": jax.random.normal(next(keys), (128, 50)),
    }
    logits = {}
    for storage, scan in (("words", False), ("stacked", True), ("stacked", False)):
        plan = jaxkv.make_plan(cfg, num_blocks=16, storage=storage)
        builder = jaxkv.StepMetadataBuilder(plan, model_inputs=True)
        sched = jaxkv.Scheduler(plan)
        for i in range(3):
            sched.add_request(
                jaxkv.Request(
                    f"r{i}", prompt=list(range(i, 20 + 5 * i)), max_new_tokens=3
                )
            )

        @functools.partial(jax.jit, donate_argnums=0)
        def step(pools, inputs, plan=plan, builder=builder, scan=scan):
            (meta,) = {id(m): m for m in builder.metadata(inputs).values()}.values()
            tokens, sample = builder.model_inputs_of(inputs)
            pools, out = _forward(plan, params, pools, meta, tokens, scan=scan)
            return pools, out[sample]

        pools, seen = plan.allocate(), []
        while sched.has_unfinished:
            scheduled = sched.schedule()
            inputs = builder.prepare(scheduled)
            pools, out = step(pools, inputs)
            out = np.asarray(out)[: len(scheduled.sampled)]
            seen.append(out)
            sched.update(scheduled, out.argmax(-1))
        logits[(storage, scan)] = np.concatenate(seen)
    want = logits[("words", False)]
    for key in (("stacked", True), ("stacked", False)):
        np.testing.assert_allclose(logits[key], want, rtol=1e-5, atol=1e-5)


def test_layer_stack_refuses_layers_that_cannot_scan_together():
    cfg = jaxkv.llama_like_config(num_layers=3, sliding_window=16, window_every=3)
    plan = jaxkv.make_plan(cfg, num_blocks=4, storage="stacked")
    # Two full-attention layers, but each in its own KV-cache group (two
    # full + one sliding: groups of one layer): their block tables differ.
    assert plan.group_of(L0) != plan.group_of(L1)
    with pytest.raises(ValueError, match="read different groups' metadata"):
        plan.layer_stack([L0, L1])
    plain = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="stacked"
    )
    assert plain.layer_stack([L0, L1]).slots.tolist() == [
        _view(plain, L0).layer,
        _view(plain, L1).layer,
    ]
    # One group, but a soft cap on one layer only: one AttentionLayer cannot
    # serve both.
    base = jaxkv.llama_like_config(num_layers=2)
    capped = dataclasses.replace(base.layers[1], logits_soft_cap=30.0)
    cfg2 = dataclasses.replace(base, layers=[base.layers[0], capped])
    two = jaxkv.make_plan(cfg2, num_blocks=4, storage="stacked")
    assert two.group_of(L0) == two.group_of(L1)
    with pytest.raises(ValueError, match="cannot be scanned together"):
        two.layer_stack([L0, L1])
    words = jaxkv.make_plan(cfg, num_blocks=4, storage="words")
    with pytest.raises(ValueError, match="word pool"):
        words.layer_stack([L0])


def _write_hlo(pools, view, *, xla):
    """The lowered text of a one-token ``write_kv``: on XLA's scatter (`xla`)
    or on the path ``write_kv`` takes here (the native kernel on one CPU
    device, which addresses bytes in int64).
    """  # noqa: D205
    k = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
    return (
        jax.jit(
            jaxkv.write_kv.__wrapped__,
            donate_argnums=0,
            static_argnames="implementation",
        )
        .lower(
            pools,
            view,
            k,
            k,
            jax.ShapeDtypeStruct((1,), jnp.int32),
            implementation="xla" if xla else "native",
        )
        .as_text()
    )


def _check_native_write_hlo(pools, view):
    """Where the native write is taken: one custom call, its byte extent past
    2**31 as an int64 attribute (no int32 offset anywhere).
    """  # noqa: D205
    hlo = _write_hlo(pools, view, xla=False)
    if "jaxkv_kv_write" not in hlo:
        return
    assert hlo.count('"stablehlo.scatter"(') == 0
    attr = {
        name: int(re.findall(rf"{name} = (\d+) : i64", hlo)[0])
        for name in ("byte_offset", "extent_bytes", "slot_bytes")
    }
    pool = pools[view.pool]
    pool_bytes = int(np.prod(pool.shape)) * np.dtype(pool.dtype).itemsize
    if attr["slot_bytes"]:  # a stacked pool: the last layer slot's bytes
        last = (pool_bytes // attr["slot_bytes"] - 1) * attr["slot_bytes"]
    else:  # a word pool: the view's own bytes
        last = attr["byte_offset"]
    assert last + attr["extent_bytes"] > 2**31
    assert last + attr["extent_bytes"] <= pool_bytes


def test_plans_of_32_and_120_gib_are_addressed_by_block():
    cfg = jaxkv.llama_like_config(
        num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16
    )
    for gib in (32, 120):
        plan = jaxkv.make_plan(cfg, memory_bytes=gib << 30, storage="stacked")
        (spec,) = plan.pools
        assert spec.size_bytes <= gib << 30
        assert spec.size_bytes > (gib - 1) << 30
        assert int(np.prod(spec.shape)) > 2**31
        pools = jax.eval_shape(plan.allocate)
        view = plan.views["layers.31.self_attn"]
        last = (plan.num_blocks - 1) * 16 + 15
        _check_native_write_hlo(pools, view)
        hlo = _write_hlo(pools, view, xla=True)
        # One scatter into (32, N, 16, 8, 256) indexed by (layer, block, token)
        # in int32: no flat element index to overflow.
        # bf16 bits in uint16 on XLA:CPU, bf16 itself elsewhere.
        carrier = "ui16" if jax.default_backend() == "cpu" else "bf16"
        assert f"tensor<32x{plan.num_blocks}x16x8x256x{carrier}>" in hlo
        assert hlo.count('"stablehlo.scatter"(') == 1
        assert "tensor<1x3xi32>" in hlo
        assert last < 2**31
    # A dense K/V-first layer cannot be stored in rows (its K and V halves are
    # half a pool apart): refused, pointing to typed storage.
    kv_first = jaxkv.llama_like_config(
        num_layers=2,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        attention_backend="JAX_PAGED_KV_FIRST",
    )
    with pytest.raises(ValueError, match="past int32 indexing.*storage='typed'"):
        jaxkv.make_plan(kv_first, memory_bytes=32 << 30, storage="words")
    assert jaxkv.make_plan(kv_first, memory_bytes=32 << 30, storage="typed").pools


@pytest.mark.parametrize("packed", [False, True])
def test_word_pools_past_two_to_the_31_words_are_stored_in_rows(packed):
    # 2 layers from 32 GiB: 16 GiB per layer pool, or one packed pool of 32 GiB
    # (refused before as past int32 indexing); 120 GiB for 32 layers packed.
    for layers, gib in ((2, 32), (32, 120)):
        cfg = jaxkv.llama_like_config(
            num_layers=layers,
            num_kv_heads=8,
            head_size=128,
            dtype="bfloat16",
            attention_backend="JAX_PAGED",
        )
        plan = jaxkv.make_plan(
            cfg, memory_bytes=gib << 30, storage="words", packed=packed
        )
        assert plan.pool_bytes <= gib << 30
        for spec in plan.pools:  # 32 unpacked layers: 3.75 GiB each, flat
            big = spec.size_bytes // spec.word >= 2**31
            assert spec.rows == (plan.num_blocks if big else 0)
        assert any(spec.rows for spec in plan.pools) or (layers, packed) == (32, False)
        view = _view(plan, f"layers.{layers - 1}.self_attn")
        if not plan.pools[view.pool].rows:
            continue
        pools = jax.eval_shape(plan.allocate)
        _check_native_write_hlo(pools, view)
        hlo = _write_hlo(pools, view, xla=True)
        rows, width = plan.pools[view.pool].shape
        assert f"tensor<{rows}x{width}xui32>" in hlo
        # (row, word) pairs, one per window: the token's K and its V.
        assert "tensor<2x2xi32>" in hlo


def test_a_write_past_two_to_the_31_elements_lands_at_its_block():
    # A uint8 (fp8) stacked pool of 2**31 + elements: the last token of the
    # last block of the last layer is written and read back where it belongs.
    cfg = jaxkv.llama_like_config(
        num_layers=2, num_kv_heads=1, head_size=64, dtype="float8_e4m3fn", block_size=16
    )
    per_block = 2 * 16 * 128  # layers x tokens x (K|V) bytes
    plan = jaxkv.make_plan(cfg, num_blocks=2**31 // per_block + 2, storage="stacked")
    (spec,) = plan.pools
    assert int(np.prod(spec.shape)) > 2**31
    view = plan.views[L1]
    last = plan.num_blocks * 16 - 1
    k = jnp.full((1, 1, 64), 2.0, jnp.float8_e4m3fn)
    pools = jaxkv.write_kv(plan.allocate(), view, k, k * 2, jnp.array([last]))
    kp, vp = jaxkv.gather_kv_pages(pools, view, jnp.array([[plan.num_blocks - 1]]))
    assert float(kp[0, 0, 15].astype(jnp.float32).sum()) == 128.0
    assert float(vp[0, 0, 15].astype(jnp.float32).sum()) == 256.0
    raw = pools[0]
    assert raw.shape == (2, plan.num_blocks, 16, 128)  # the unit head dim left out
    assert int(raw[1, -1, -1, -1]) != 0
    assert int(raw[0].max()) == 0
