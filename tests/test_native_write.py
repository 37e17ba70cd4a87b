"""``write_kv`` on the native XLA:CPU kernel against XLA's scatter, byte for byte."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._native import available, unavailable_reason
from jaxkv.kv import _native_write
from tests.helpers import run_asan_check

pytestmark = [
    pytest.mark.skipif(
        not available(), reason=f"native kernel unavailable: {unavailable_reason()}"
    ),
    pytest.mark.skipif(
        jax.default_backend() != "cpu", reason="the native kernel runs on XLA:CPU"
    ),
]


def _plan(storage, dtype, layout, *, layers=1, heads=2, head=16, block=8, blocks=6):
    backend = jaxkv.AttentionBackend(
        name=f"W_{layout.name}",
        layout=layout,
        supported_kernel_block_sizes=(jaxkv.vllm.MultipleOf(1),),
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name=f"l{i}", spec=spec, backend=backend)
            for i in range(layers)
        ]
    )
    return jaxkv.make_plan(cfg, num_blocks=blocks, storage=storage)


def _both(fn):
    """``fn(implementation)`` on the native kernel, then on XLA's path."""
    return fn("native"), fn("xla")


def _kv(plan, name) -> jaxkv.KVCacheView:
    view = plan.views[name]
    assert isinstance(view, jaxkv.KVCacheView)
    return view


def _text(compiled) -> str:
    text = compiled.as_text()
    assert text is not None
    return text


def _hlo(pools, view, k, v, slots, implementation: str | None = "native"):
    return (
        jax.jit(
            jaxkv.write_kv.__wrapped__,
            static_argnums=1,
            static_argnames="implementation",
            donate_argnums=0,
        )
        .lower(pools, view, k, v, slots, implementation=implementation)
        .compile()
    )


LAYOUTS = [
    jaxkv.KVCacheLayout.BLOCKS_FIRST,
    jaxkv.KVCacheLayout.KV_FIRST,
    jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED,
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("storage", ["words", "typed", "stacked"])
def test_native_write_equals_xla_byte_for_byte(storage, dtype, layout):
    plan = _plan(storage, dtype, layout, layers=2)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(9, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(9, 2, 16)), jnp.float32)
    # Padding (-1), a slot of the last block's last token (47), one past the
    # view (48), far past it, and ordinary slots in several blocks.
    slots = jnp.array([3, -1, 47, 48, 100, 8, 9, 30, -7], jnp.int32)

    def run(impl):
        pools = plan.allocate()
        pools = jaxkv.write_kv(pools, _kv(plan, "l1"), k, v, slots, implementation=impl)
        pools = jaxkv.write_kv(
            pools, _kv(plan, "l0"), 2 * k, -v, slots[::-1], implementation=impl
        )
        return [np.asarray(p).view(np.uint8) for p in pools]

    native, xla = _both(run)
    assert len(native) == len(xla)
    for a, b in zip(native, xla, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(a.any() for a in native)  # something was written
    view = _kv(plan, "l1")
    hlo = _text(_hlo(plan.allocate(), view, k, v, slots))
    assert 'custom_call_target="jaxkv_kv_write"' in hlo


def test_the_write_is_in_place_under_donation_and_a_kept_pool_is_untouched():
    plan = _plan("words", "bfloat16", jaxkv.KVCacheLayout.BLOCKS_FIRST, blocks=64)
    pools = plan.allocate()
    view = _kv(plan, "l0")
    k = jnp.ones((4, 2, 16), jnp.bfloat16)
    slots = jnp.array([0, 9, 17, 511], jnp.int32)
    compiled = _hlo(pools, view, k, k, slots)
    text = _text(compiled)
    assert text.count("custom-call(") == 1
    assert "output_to_operand_aliasing={{}: (0, {})}" in text
    pool_shape = f"u32[{pools[0].shape[0]}]"
    copies = [ln for ln in text.splitlines() if " copy(" in ln and pool_shape in ln]
    assert copies == []
    stats = compiled.memory_analysis()
    assert stats is not None
    assert stats.alias_size_in_bytes == pools[0].nbytes
    assert stats.temp_size_in_bytes < pools[0].nbytes // 8
    # Not donated (the caller keeps the pool): XLA copies it; the old one is kept.
    before = np.asarray(pools[0]).copy()
    new = jax.jit(
        lambda p: jaxkv.write_kv(p, view, k, k, slots, implementation="native")
    )(pools)
    np.testing.assert_array_equal(np.asarray(pools[0]), before)
    assert not np.array_equal(np.asarray(new[0]), before)


def test_a_traced_layer_in_a_scan_writes_its_slot_and_a_bad_slot_writes_nothing():
    plan = _plan("stacked", "float32", jaxkv.KVCacheLayout.BLOCKS_FIRST, layers=3)
    stack = plan.layer_stack(["l0", "l1", "l2"])
    view = stack.layer.view
    k = jnp.arange(3 * 2 * 16, dtype=jnp.float32).reshape(3, 2, 16)
    slots = jnp.array([1, 12, 40], jnp.int32)
    # 2**31 - 1: a slot at int32's end (the kernel compares it as a count).
    layer_ids = jnp.asarray(
        [stack.slots[2], 3, -1, 2**31 - 1, stack.slots[0]], jnp.int32
    )

    @functools.partial(jax.jit, static_argnames="impl")
    def scanned(pools, impl):
        def body(pools, x):
            i, layer = x
            new = jaxkv.write_kv(
                pools, view, k + i, -k - i, slots, layer=layer, implementation=impl
            )
            return new, None

        xs = (jnp.arange(5, dtype=jnp.float32), layer_ids)
        return jax.lax.scan(body, pools, xs)[0]

    def run(impl):
        return [np.asarray(p) for p in scanned(plan.allocate(), impl)]

    native, xla = _both(run)
    for impl in ("pallas_gpu", "pallas_tpu"):
        for a, b in zip(run(impl), xla, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(native, xla, strict=True):
        np.testing.assert_array_equal(a, b)
    table = jnp.arange(6, dtype=jnp.int32)[None]
    pools = tuple(jnp.asarray(p) for p in native)
    got = {
        name: np.asarray(jaxkv.gather_kv_pages(pools, plan.views[name], table)[0])
        for name in ("l0", "l1", "l2")
    }
    assert got["l2"][0, 0, 1, 0, 0] == 0.0  # k + 0 at slot 1
    assert got["l0"][0, 0, 1, 0, 0] == 4.0  # k + 4 at slot 1
    assert not got["l1"].any()  # slots 3, -1 and 2**31 - 1 wrote nothing


def test_views_the_kernel_cannot_take_stay_on_xla_and_a_foreign_view_is_refused():
    plan = _plan("words", "float32", jaxkv.KVCacheLayout.BLOCKS_FIRST)
    k = jnp.ones((2, 2, 16), jnp.float32)
    slots = jnp.array([0, 1], jnp.int32)
    view = _kv(plan, "l0")
    assert _native_write.native_write_unfit(view, k) is None
    assert "MLA" in str(_native_write.native_write_unfit(view, None))
    # Kernel blocks of 8 in a packed pool: each layer's kernel view owns a
    # quarter of every 32-token block's pages, the others are another layer's.
    split8 = jaxkv.AttentionBackend(
        name="Split8",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(8,),
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name=n, spec=spec, backend=split8)
            for n in ("x0", "x1", "l")
        ],
        max_model_len=256,
    )
    packed = jaxkv.make_plan(cfg, num_blocks=8, packed=True, maps_slot_mapping=True)
    owned = _kv(packed, "l")
    assert owned.owned is not None
    assert owned.offset > 0
    assert "packed" in str(_native_write.native_write_unfit(owned, k))
    with pytest.raises(ValueError, match="raw_address: cannot address.*packed pool"):
        jaxkv.kv.raw_address(owned)
    with pytest.raises(ValueError, match="implementation='native'.*packed pool"):
        _hlo(packed.allocate(), owned, k, k, slots)
    hlo = _text(_hlo(packed.allocate(), owned, k, k, slots, implementation=None))
    assert "jaxkv_kv_write" not in hlo
    assert "scatter" in hlo
    big = _plan("words", "float32", jaxkv.KVCacheLayout.BLOCKS_FIRST, blocks=60)
    with pytest.raises(ValueError, match="another plan"):
        jaxkv.write_kv(plan.allocate(), big.views["l0"], k, k, slots)


def test_a_vmapped_write_equals_xla():
    plan = _plan("typed", "bfloat16", jaxkv.KVCacheLayout.BLOCKS_FIRST)
    view = _kv(plan, "l0")
    (pool,) = plan.allocate()
    k = jnp.arange(2 * 3 * 2 * 16, dtype=jnp.float32).reshape(2, 3, 2, 16)
    slots = jnp.array([[1, 9, -1], [40, 2, 3]], jnp.int32)

    def run(impl):
        def one(pool, k, slots):
            return jaxkv.write_kv((pool,), view, k, -k, slots, implementation=impl)[0]

        return np.asarray(jax.vmap(one)(jnp.stack([pool, pool]), k, slots))

    native, xla = _both(run)
    np.testing.assert_array_equal(native, xla)
    assert native.any()


@pytest.mark.slow  # builds the kernels with AddressSanitizer (10-15 s)
def test_the_write_kernel_touches_no_byte_outside_the_pool_under_asan(tmp_path):
    # tests/native_write_bounds_check.cc calls the kernel on a heap block of exactly
    # the pool's bytes with bad layer and token slots; AddressSanitizer aborts
    # on any write outside it (which no comparison with XLA can observe).
    run_asan_check(Path(__file__).with_name("native_write_bounds_check.cc"), tmp_path)
