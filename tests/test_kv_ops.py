from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jaxkv
from tests.helpers import (
    count_compiles,
    examples,
    full_spec,
    layer,
    single_group_config,
)
from tests.oracle import Oracle
from tests.strategies import EXPECTED_ERRORS, hybrid_cases, plan


def _pool_bytes(pools):
    return [np.asarray(p).view(np.uint8).reshape(-1).copy() for p in pools]


def _read_bits(values):
    """Bits of float values read back, with 16-bit subnormals as signed zeros.

    XLA:CPU materialises bf16 through float32 with denormals off, so a subnormal
    that another layer's bytes form in a bf16 view reads back as +-0; the pool
    bytes themselves are compared exactly.
    """
    values = np.asarray(values)
    if values.dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        bits = values.view(np.uint16).copy()
        exp_mask = 0x7F80 if values.dtype == np.dtype(jnp.bfloat16) else 0x7C00
        bits[(bits & exp_mask) == 0] &= 0x8000
        return bits
    return values.view(np.uint8)


def _setup(cfg, kv, **kw) -> tuple[Any, Any, Any, dict[str, Any]]:
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg, **kw)
    pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    return groups, sizes, pools, views


def _kv_inputs(view, n, rng):
    """Random small-integer K/V (exact in every dtype) shaped for `view`."""
    dims = {a: view.shape[d] for d, a in enumerate(view.axes)}
    if "head" not in view.axes:
        key_shape, value_shape = (n, dims["dim"]), None
    elif "kv" in view.axes:
        key_shape = value_shape = (n, dims["head"], dims["dim"])
    else:
        key_shape = (n, dims["head"], view.head_size)
        value_shape = (n, dims["head"], dims["dim"] - view.head_size)

    def make(shape):
        return None if shape is None else rng.integers(-8, 9, shape).astype(view.dtype)

    return make(key_shape), make(value_shape)


@settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(case=hybrid_cases(), seed=st.integers(0, 2**31 - 1))
def test_writes_match_the_oracle_byte_for_byte(case, seed):
    _check_against_oracle(case, seed)


@settings(
    max_examples=examples(6),
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(case=hybrid_cases(), seed=st.integers(0, 2**31 - 1))
def test_row_pools_match_the_oracle_byte_for_byte(case, seed):
    # Every word pool stored as one row per block where its views allow (as
    # pools of 2**31 words or more are): the same bytes, every read the same.
    _check_against_oracle(case, seed, max_flat_words=0)


def test_row_pools_hold_packed_and_hybrid_pools():
    for packed in (False, True):
        cfg = jaxkv.tiny_hybrid_config()
        kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=6, packed=packed)
        groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
        specs, _ = jaxkv.plan.planned_pools(kv, cfg, sizes, groups, max_flat_words=0)
        assert all(p.rows == 6 for p in specs), specs
        assert all(p.shape == (6, p.size_bytes // p.word // 6) for p in specs)


def _check_against_oracle(case, seed, **plan_kw):
    try:
        groups, sizes, pool_specs, _, bound = plan(case, **plan_kw)
    except ValueError as err:
        assume(not any(m in str(err) for m in EXPECTED_ERRORS))
        raise
    rng = np.random.default_rng(seed)
    pools = jaxkv.plan.allocate_pools(pool_specs)
    oracle = Oracle(case.kv, case.cfg, sizes, groups)
    group_of = {n: g for gs in groups for g in gs for n in g.layer_names}
    for step in range(2):
        for name, view in bound.items():
            if isinstance(view, jaxkv.MambaView):
                ids = rng.integers(-1, view.num_blocks + 1, 3).astype(np.int32)
                # Unique ids, as in a real step: which of two writes to one id
                # wins is unspecified for a scatter (GPUs do not keep order).
                ids[1:][np.isin(ids[1:], ids[:1]) & (ids[1:] >= 0)] = -1
                if ids[2] == ids[1]:
                    ids[2] = -1
                states = [
                    rng.integers(-8, 9, (3, *s.shape[1:])).astype(s.dtype)
                    for s in view.states
                ]
                pools = jaxkv.write_mamba_state(pools, view, ids, states)
                oracle.write_mamba(name, ids, states)
                continue
            n = int(rng.integers(1, 6))
            limit = view.num_blocks * view.block_size
            slots = rng.integers(0, limit, n).astype(np.int32)
            slots[rng.random(n) < 0.3] = -1  # padding
            if n > 1:
                slots[-1] = limit + int(rng.integers(0, 3))  # out of range: dropped
            # A slot is unique in a real step; keep the last write of duplicates
            # out of the comparison by deduplicating.
            _, first = np.unique(slots, return_index=True)
            keep = np.zeros(n, bool)
            keep[first] = True
            slots = np.where(keep | (slots < 0), slots, -1).astype(np.int32)
            key, value = _kv_inputs(view, n, rng)
            pools = jaxkv.write_kv(pools, view, key, value, slots)
            oracle.write_kv(name, key, value, slots)
        for got, want in zip(_pool_bytes(pools), oracle.buffers, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=case.description)
        # Reads through every view agree with the oracle's strided views.
        for name, view in bound.items():
            if isinstance(view, jaxkv.MambaView):
                ids = np.arange(view.num_blocks, dtype=np.int32)
                for got, lay in zip(
                    jaxkv.read_mamba_state(pools, view, ids),
                    oracle.layers[name],
                    strict=True,
                ):
                    np.testing.assert_array_equal(
                        _read_bits(got), _read_bits(lay.array(oracle.buffers))
                    )
                continue
            np.testing.assert_array_equal(
                _read_bits(jaxkv.read_view(pools, view)),
                _read_bits(oracle.layers[name].array(oracle.buffers)),
                err_msg=f"{name}: {case.description}",
            )
        # Zero a block of one group through all its layers, in their id space.
        if step == 0:
            g = group_of[next(iter(bound))]
            names = [n for n in g.layer_names if n in bound]
            block = np.array([int(rng.integers(0, case.kv.num_blocks))], np.int32)
            ids = np.asarray(g.map_to_kernel_block_table(block[None])).ravel()
            views = tuple(dict.fromkeys(bound[n] for n in names))
            pools = jaxkv.zero_blocks(pools, views, ids)
            oracle.zero_blocks(list(dict.fromkeys(names)), ids)


def _bf16_layer(num_blocks=64):
    s = full_spec(block_size=16, heads=8, head=128)
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s, "JAX_PAGED")])
    return cfg, single_group_config(["l"], s, num_blocks=num_blocks)


def test_padding_and_out_of_range_slots_write_nothing():
    cfg, kv = _bf16_layer(num_blocks=4)
    _, _, pools, views = _setup(cfg, kv)
    v = views["l"]
    before = _pool_bytes(pools)
    k = jnp.ones((4, 8, 128), jnp.bfloat16)
    pools = jaxkv.write_kv(pools, v, k, k, jnp.array([-1, -1, 64, 1000], jnp.int32))
    np.testing.assert_array_equal(_pool_bytes(pools)[0], before[0])
    # The last slot of the pool is writable; -1 must not alias it (no wrap).
    pools = jaxkv.write_kv(pools, v, k[:1], k[:1], jnp.array([63], jnp.int32))
    after = _pool_bytes(pools)[0]
    pools = jaxkv.write_kv(pools, v, 2 * k[:1], 2 * k[:1], jnp.array([-1], jnp.int32))
    np.testing.assert_array_equal(_pool_bytes(pools)[0], after)


@pytest.mark.parametrize(
    ("layout", "packed"),
    [("FLASH_ATTN", True), ("ROCM_ATTN", True), ("ROCM_ATTN", False)],
)
def test_negative_ids_touch_nothing_where_they_would_land_inside_the_pool(
    layout, packed
):
    """Block -1 of a view that does not start at the pool's byte 0 is live memory.

    Packed: layers behind others start one or two pages in. Dense K/V-first:
    the V half starts mid-pool, so V of block -1 is K of the last block. Only
    jaxkv's guard (not XLA's drop of negative flat indices) keeps them safe.
    """
    spec = full_spec(block_size=16, heads=2, head=8, dtype="float32")
    cfg = jaxkv.RunnerConfig(
        layers=[layer(f"l{i}", spec, layout) for i in range(3)], max_model_len=64
    )
    plan = jaxkv.make_plan(cfg, num_blocks=4, packed=packed)
    rng = np.random.default_rng(0)
    pools = tuple(
        jnp.asarray(rng.integers(0, 2**31, p.shape).astype(p.dtype)) for p in plan.pools
    )
    before = _pool_bytes(pools)
    for name in ("l1", "l2"):
        view = plan.views[name]
        k = jnp.full((3, 2, 8), 7.0, jnp.float32)
        # -1 (padding), -16 (token 0 of block -1), 4 * 16 (one block past).
        slots = jnp.array([-1, -16, 64], jnp.int32)
        pools = jaxkv.write_kv(pools, view, k, k, slots)
        after = _pool_bytes(pools)
        for i, (a, b) in enumerate(zip(after, before, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} pool {i}")
        pools = jaxkv.zero_blocks(pools, (view,), jnp.array([-1, 4], jnp.int32))
        after = _pool_bytes(pools)
        for i, (a, b) in enumerate(zip(after, before, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} pool {i}")
        kp, vp = jaxkv.gather_kv_pages(pools, view, jnp.array([[-1, 4]], jnp.int32))
        assert np.isnan(np.asarray(kp)).all()
        assert np.isnan(np.asarray(vp)).all()


def _check_no_pool_copy(fn, pools, *args, reads_only=False):
    compiled = fn.lower(pools, *args).compile()
    analysis = compiled.memory_analysis()
    pool_bytes = sum(p.nbytes for p in pools)
    assert analysis.temp_size_in_bytes <= 0.05 * pool_bytes, analysis
    if not reads_only:
        assert analysis.alias_size_in_bytes >= pool_bytes, analysis
    # No instruction copies a pool-sized buffer (e.g. a transpose of the pool).
    pool_shapes = {f"u{p.dtype.itemsize * 8}[{p.shape[0]}]" for p in pools}
    for line in compiled.as_text().splitlines():
        if "copy(" in line or "transpose(" in line:
            assert not any(shape in line for shape in pool_shapes), line


def test_write_and_read_never_copy_a_pool():
    cfg = jaxkv.tiny_hybrid_config(head_size=64, num_kv_heads=4)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=512)  # 2 x 32 MiB pools
    groups, _, pools, views = _setup(cfg, kv)
    attn, mamba = views["layers.0.self_attn"], views["layers.2.mixer"]
    k = jnp.ones((256, 4, 64), jnp.float32)
    slots = jnp.arange(256, dtype=jnp.int32) * 3
    _check_no_pool_copy(jaxkv.write_kv, pools, attn, k, k, slots)
    ids = jnp.arange(8, dtype=jnp.int32)
    states = [jnp.ones((8, *s.shape[1:]), s.dtype) for s in mamba.states]
    _check_no_pool_copy(jaxkv.write_mamba_state, pools, mamba, ids, states)
    _check_no_pool_copy(jaxkv.zero_blocks, pools, (attn, mamba), ids)
    table = jnp.arange(64, dtype=jnp.int32).reshape(8, 8)
    _check_no_pool_copy(jaxkv.gather_kv_pages, pools, attn, table, reads_only=True)
    del groups


def test_bf16_write_has_no_pool_copy_and_donates():
    cfg, kv = _bf16_layer(num_blocks=1024)  # 64 MiB pool, 1 MiB of K/V
    _, _, pools, views = _setup(cfg, kv)
    k = jnp.ones((256, 8, 128), jnp.bfloat16)
    slots = jnp.arange(256, dtype=jnp.int32) * 7
    _check_no_pool_copy(jaxkv.write_kv, pools, views["l"], k, k, slots)
    # Temp memory scales with the bytes written (the bf16 -> uint32 words), not
    # with the pool.
    temp = jaxkv.write_kv.lower(pools, views["l"], k, k, slots).compile()
    analysis = temp.memory_analysis()
    assert analysis is not None
    assert analysis.temp_size_in_bytes <= 2 * (k.nbytes * 2)
    old = pools[0]
    pools = jaxkv.write_kv(pools, views["l"], k, k, slots)
    assert old.is_deleted()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU kernel layout")
def test_kv_write_is_one_native_call_or_one_scatter_and_two_small_kernels():
    # On XLA:CPU each kernel of a small program costs a thread hand-off (tens of
    # microseconds on a 2-core machine). The native write is one custom call
    # and nothing else; on XLA's path (the default) K and V rows go out in one
    # scatter, after one data kernel (carrier words) and one index kernel
    # (offsets).
    from jaxkv._native import available

    cfg, kv = _bf16_layer(num_blocks=64)
    _, _, pools, views = _setup(cfg, kv)
    k = jnp.ones((16, 8, 128), jnp.bfloat16)
    slots = jnp.arange(16, dtype=jnp.int32)

    def kernels(implementation=None):
        jax.clear_caches()
        hlo = (
            jaxkv.write_kv.lower(
                pools, views["l"], k, k, slots, implementation=implementation
            )
            .compile()
            .as_text()
        )
        entry = hlo[hlo.index("\nENTRY") :]
        return [
            ln for ln in entry.splitlines() if " fusion(" in ln or "custom-call(" in ln
        ]

    if available():
        (call,) = kernels("native")
        assert 'custom_call_target="jaxkv_kv_write"' in call
    xla = kernels()
    assert sum("scatter" in line for line in xla) == 1, xla
    assert len(xla) <= 3, xla
    assert not any("custom-call" in line for line in xla)


def test_new_step_values_do_not_retrace():
    cfg, kv = _bf16_layer(num_blocks=8)
    _, _, pools, views = _setup(cfg, kv)
    k = jnp.ones((4, 8, 128), jnp.bfloat16)
    s1 = jnp.array([0, 1, 2, -1], jnp.int32)
    s2 = jnp.array([17, 5, -1, -1], jnp.int32)
    pools = jaxkv.write_kv(pools, views["l"], k, k, s1)
    with count_compiles() as compiles:
        pools = jaxkv.write_kv(pools, views["l"], k, k, s2)
        jax.block_until_ready(pools)
    assert compiles == []


def test_write_input_errors():
    cfg, kv = _bf16_layer(num_blocks=4)
    _, _, pools, views = _setup(cfg, kv)
    k = jnp.ones((4, 8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"key.shape=\(4, 8, 64\), expected"):
        jaxkv.write_kv(pools, views["l"], k[..., :64], k, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping.shape=\(3,\)"):
        jaxkv.write_kv(pools, views["l"], k, k, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="value is missing"):
        jaxkv.write_kv(pools, views["l"], k, None, jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match="write_kv needs a KVCacheView"):
        jaxkv.write_kv(
            pools, jaxkv.MambaView(states=(views["l"],)), k, k, jnp.zeros(4, jnp.int32)
        )


def test_validators_name_layer_and_first_bad_index():
    cfg, kv = _bf16_layer(num_blocks=4)
    _, _, _, views = _setup(cfg, kv)
    jaxkv.validate_slot_mapping(np.array([0, 63, -1]), views["l"], "l")
    with pytest.raises(ValueError, match="layer 'l': entry 2 is -5"):
        jaxkv.validate_slot_mapping(np.array([0, 1, -5, 99]), views["l"], "l")
    with pytest.raises(
        ValueError, match=r"layer 'l': entry \(1, 0\) is 4, outside \[0, 4\)"
    ):
        jaxkv.validate_block_ids(np.array([[0, 1], [4, 0]]), views["l"], "l")


def test_hybrid_pool_shared_by_attention_and_mamba_without_duplication():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    _, _, pools, views = _setup(cfg, kv)
    assert len(pools) == 2
    assert sum(p.nbytes for p in pools) == sum(t.size for t in kv.kv_cache_tensors)
    # Block 3 of the Mamba layer overlays block 3 of the attention layers (I3).
    pools = jaxkv.write_mamba_state(
        pools,
        views["layers.2.mixer"],
        jnp.array([3]),
        [jnp.full((1, 3, 128), 7.0), jnp.ones((1, 4, 32, 16))],
    )
    kp, _ = jaxkv.gather_kv_pages(
        pools, views["layers.0.self_attn"], jnp.array([[3, 2]])
    )
    assert float(kp[0, 0, 0, 0, 0]) == 7.0
    assert float(jnp.abs(kp[0, 1]).sum()) == 0.0


def test_allocation_with_sharding():
    cfg, kv = _bf16_layer(num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pools, _ = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups, sharding=sharding)
    assert pools[0].sharding == sharding
    assert pools[0].dtype == jnp.uint32
    assert not np.asarray(pools[0]).any()


def test_reads_and_writes_keep_every_bit():
    """NaN payloads and ordinary bf16 bit patterns survive writes and reads.

    Data moves as integers, so nothing canonicalises NaNs; subnormals may read
    back as signed zeros on XLA:CPU (see `_read_bits`), never as other values.
    """
    cfg = jaxkv.tiny_hybrid_config(dtype="bfloat16", num_kv_heads=4)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    _, _, pools, views = _setup(cfg, kv)
    bits = np.array([0x0044, 0x8001, 0x7FC1, 0xFFFF, 0x0001, 0x3F80], np.uint16)
    conv = np.resize(bits, (1, 3, 128)).view(jnp.bfloat16)
    ssm = np.zeros((1, 4, 32, 16), np.float32)
    mamba = views["layers.2.mixer"]
    pools = jaxkv.write_mamba_state(pools, mamba, np.array([1], np.int32), [conv, ssm])
    got = np.asarray(jaxkv.read_mamba_state(pools, mamba, np.array([1], np.int32))[0])
    np.testing.assert_array_equal(_read_bits(got), _read_bits(conv))
    attn = views["layers.0.self_attn"]
    k = np.resize(bits, (2, 4, 32)).view(jnp.bfloat16)
    pools = jaxkv.write_kv(pools, attn, k, k, np.array([64, 65], np.int32))
    kp, vp = jaxkv.gather_kv_pages(pools, attn, np.array([[2]], np.int32))
    np.testing.assert_array_equal(_read_bits(np.asarray(kp)[0, 0, :2]), _read_bits(k))
    np.testing.assert_array_equal(_read_bits(np.asarray(vp)[0, 0, :2]), _read_bits(k))


def test_device_ids_past_int32_are_dropped_never_wrapped():
    """With x64 on, int64 ids on the device reach jit: past int32 they write and
    read nothing (a wrap would hit slot 33 / block 1)."""
    with jax.enable_x64(True):
        plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
        view = plan.views["layers.0.self_attn"]
        pools = plan.allocate()
        k = jnp.ones((2, 2, 32), jnp.float32)
        slots = jnp.array([2**32 + 33, -(2**32) + 34], jnp.int64)
        pools = jaxkv.write_kv(pools, view, k, k, slots)
        assert not any(np.asarray(p).any() for p in pools)
        table = jnp.array([[2**32 + 1]], jnp.int64)
        kp, _ = jaxkv.gather_kv_pages(pools, view, table)
        ones = jaxkv.gather_kv_pages(pools, view, jnp.array([[-1]], jnp.int32))[0]
        np.testing.assert_array_equal(
            np.asarray(kp).view(np.uint32), np.asarray(ones).view(np.uint32)
        )


def test_a_view_ending_at_the_pools_last_byte_fits_and_one_element_past_does_not():
    cfg = jaxkv.llama_like_config(num_layers=1)
    plan = jaxkv.make_plan(cfg, num_blocks=4, storage="words")
    view = plan.views["layers.0.self_attn"]
    assert isinstance(view, jaxkv.KVCacheView)
    a = jaxkv.kv.raw_address(view)
    # The raw extent spans the view's first to last element, inclusive.
    assert int(a["byte_offset"]) + int(a["extent_bytes"]) == view.extent_bytes
    word = np.dtype(plan.allocate()[view.pool].dtype).itemsize
    exact = jnp.zeros((view.extent_bytes // word,), plan.allocate()[view.pool].dtype)
    jaxkv.kv.check_fits((exact,), view)
    short = exact[: (view.extent_bytes - view.itemsize) // word]
    with pytest.raises(ValueError, match="reaches byte"):
        jaxkv.kv.check_fits((short,), view)
