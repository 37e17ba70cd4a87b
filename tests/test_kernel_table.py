"""One kernel table per operation: ``write_kv`` and ``paged_attention`` pick
their kernel per platform through the same ``KernelTable``; adding a platform
or a kernel is one entry, and both operations use it.
"""  # noqa: D205

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import ATTENTION_KERNELS
from jaxkv.kv import WRITE_KERNELS, Kernel


def _setup():
    cfg = jaxkv.llama_like_config(num_layers=1, head_size=64)
    plan = jaxkv.make_plan(cfg, num_blocks=8, storage="typed")
    layer = plan.attention_layer("layers.0.self_attn")
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=2, max_tokens=2, max_blocks=2)
    return plan, layer, meta


def _fake_attention(q, pools, view, meta, layer, call, *, interpret, platform):
    del pools, view, meta, layer, call, interpret, platform
    return jnp.full(q.shape, 7.0, q.dtype)


def _fake_write(pool, view, key, value, slots, layer, *, interpret, platform):
    del view, key, value, slots, layer, interpret, platform
    return jnp.full_like(pool, 3)


def test_a_kernel_for_a_platform_is_one_entry_and_both_operations_use_it():
    plan, layer, meta = _setup()
    q = jnp.zeros((2, 2, 64), jnp.float32)
    k = jnp.ones((2, 2, 64), jnp.float32)
    slots = jnp.array([1, 2], jnp.int32)
    attend = Kernel("fake", run=_fake_attention, platforms=("cpu",), default=True)
    write = Kernel("fake", run=_fake_write, platforms=("cpu",), default=True)
    with ATTENTION_KERNELS.registered(attend), WRITE_KERNELS.registered(write):
        jax.clear_caches()  # programs traced before keep the kernel they picked
        assert "fake" in ATTENTION_KERNELS.implementations
        out = jaxkv.paged_attention(q, plan.allocate(), layer, meta, scale=1.0)
        np.testing.assert_array_equal(np.asarray(out), 7.0)
        pools = jaxkv.write_kv(plan.allocate(), layer, k, k, slots)
        assert (np.asarray(pools[layer.view.pool]) == 3).all()
        # Named, and refused by name where it does not fit.
        jaxkv.paged_attention(q, plan.allocate(), layer, meta, scale=1.0,
                              implementation="fake")  # fmt: skip
    jax.clear_caches()
    # Gone again: XLA's path on CPU.
    assert "fake" not in ATTENTION_KERNELS.implementations
    out = jaxkv.paged_attention(q, plan.allocate(), layer, meta, scale=1.0)
    assert not (np.asarray(out) == 7.0).any()
    pools = jaxkv.write_kv(plan.allocate(), layer, k, k, slots)
    assert not (np.asarray(pools[layer.view.pool]) == 3).all()


def test_a_new_platform_is_one_entry_in_each_table():
    plan, layer, meta = _setup()
    chip = Kernel(
        "fakechip_kernel",
        run=_fake_attention,
        platforms=("fakechip",),
        family="pallas",
        default=True,
        unfit=lambda *call: None,
    )
    with ATTENTION_KERNELS.registered(chip), WRITE_KERNELS.registered(chip):
        for table in (ATTENTION_KERNELS, WRITE_KERNELS):
            assert table.platforms[-1] == "fakechip"
        choice = jaxkv.attention.choose_implementation(
            None, layer.view, _call(), (2, 2, 64)
        )
        assert choice.on("fakechip") == "fakechip_kernel"
        assert choice.on("cpu") == "xla"
        assert choice.on("tpu") == "pallas_tpu"
        view = layer.view
        assert WRITE_KERNELS.pick("pallas", view, jnp.zeros(1))["fakechip"] == (
            "fakechip_kernel"
        )
        assert WRITE_KERNELS.pick(None, view, jnp.zeros(1))["fakechip"] == (
            "fakechip_kernel"
        )
        # A program lowered for CPU still runs XLA's path there.
        out = jax.jit(lambda q, p: jaxkv.paged_attention(q, p, layer, meta, scale=1.0))(
            jnp.zeros((2, 2, 64)), plan.allocate()
        )
        assert not (np.asarray(out) == 7.0).any()
    assert "fakechip" not in ATTENTION_KERNELS.platforms


def _call():
    from jaxkv.attention._call import Call
    from jaxkv.attention._rows import Mask

    return Call(Mask(True, None, None, False, False), 1.0, None, None, 1, "auto")


def test_one_table_refuses_what_it_does_not_hold_in_both_operations():
    plan, layer, meta = _setup()
    q = jnp.zeros((2, 2, 64), jnp.float32)
    for call in (
        lambda: jaxkv.paged_attention(
            q, plan.allocate(), layer, meta, scale=1.0, implementation="cuda"
        ),
        lambda: jaxkv.write_kv(
            plan.allocate(), layer, q, q, meta, implementation="cuda"
        ),
    ):
        with pytest.raises(ValueError, match="implementation='cuda', expected one of"):
            call()
    with pytest.raises(ValueError, match="fallback"):
        WRITE_KERNELS.register(Kernel("xla", run=_fake_write))
    with pytest.raises(ValueError, match="family"):
        ATTENTION_KERNELS.register(Kernel("pallas", run=_fake_attention))


def test_tuned_constants_are_table_data():
    assert ATTENTION_KERNELS.tuned("xla", "cpu")["pages_per_chunk"] == 4
    assert ATTENTION_KERNELS.tuned("xla", "cuda")["pages_per_chunk"] == 64
    assert jaxkv.attention.auto_pages_per_chunk("cpu") == 4
    assert ATTENTION_KERNELS.tuned("pallas_tpu", "v6e")["wave_bytes"] > 0
