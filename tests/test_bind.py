from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.helpers import full_spec, layer, single_group_config


def _model(backend="FLASH_ATTN", block_size=32):
    s = full_spec(block_size=block_size, heads=1, head=8, dtype="float32")
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("a", s, backend),
            layer("b", s, backend, kv_sharing_target="a"),
            layer("c", s, backend),
        ]
    )
    kv = single_group_config(["a", "c"], s, num_blocks=4)
    return cfg, kv


def test_bind_worked_example():
    cfg, kv = _model()
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    views = jaxkv.plan.build_kv_cache_views(kv, cfg, sizes, groups)
    without_b = {k: v for k, v in views.items() if k != "b"}
    bound = jaxkv.vllm.bind_kv_caches(
        without_b, {"a": object(), "b": object()}, kv, cfg, groups
    )
    assert dict(bound) == {"a": views["a"], "b": views["a"]}
    assert bound["b"] is bound["a"]
    assert "c" in without_b  # not bound, still in kv_caches
    with pytest.raises(KeyError, match="not in the forward context"):
        bound["c"]


def test_bind_kernel_split_binds_kernel_view_for_sharing_layer():
    only16 = jaxkv.AttentionBackend(
        name="Only16",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(16,),
    )
    s = full_spec(block_size=32, heads=1, head=8, dtype="float32")
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="a", spec=s, backend=only16),
            jaxkv.LayerConfig(name="b", spec=s, backend=only16, kv_sharing_target="a"),
        ]
    )
    kv = single_group_config(["a"], s, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert groups[0][0].kernel_block_size == 16
    _, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    bound: Any = jaxkv.vllm.bind_kv_caches(views, ["a", "b"], kv, cfg, groups)
    assert bound["a"].num_blocks == 8
    assert bound["a"].block_size == 16
    assert bound["b"] is bound["a"]


def test_uncached_forward_context_layers_are_reported():
    cfg, kv = _model()
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    _, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    bound = jaxkv.vllm.bind_kv_caches(views, ["a", "encoder.0"], kv, cfg, groups)
    assert bound.uncached_layers == ("encoder.0",)
    with pytest.raises(KeyError, match="has no KV cache"):
        bound["encoder.0"]
    assert hash(bound) == hash(
        jaxkv.vllm.bind_kv_caches(views, ["a", "encoder.0"], kv, cfg, groups)
    )


def test_yoco_pools_donated_once():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    bound = jaxkv.vllm.bind_kv_caches(
        views, [layer.name for layer in cfg.layers], kv, cfg, groups
    )
    # Eight layers, two pools: sharing layers alias their target's view.
    assert len(pools) == 2
    assert len({id(v) for v in bound.values()}) == 6
    assert bound["layers.7.self_attn"] is bound["layers.4.self_attn"]

    # A step writing every attention layer, YOCO readers included, with the
    # pools donated: each pool is an alias of an output once (no copy of a
    # pool), and the caller's buffers are consumed.
    attn = [n for n in bound if "self_attn" in n]
    k = jnp.ones((2, 2, 32), jnp.float32)
    slots = jnp.array([33, 40], jnp.int32)

    def step(pools):
        for name in attn:
            pools = jaxkv.write_kv(pools, bound[name], k, k, slots)
        return pools

    pools = tuple(pools)
    compiled = jax.jit(step, donate_argnums=0).lower(pools).compile()
    mem = compiled.memory_analysis()
    assert mem is not None
    pool_bytes = sum(p.nbytes for p in pools)
    assert mem.alias_size_in_bytes == pool_bytes
    assert mem.temp_size_in_bytes < min(p.nbytes for p in pools)
    out = compiled(pools)
    assert all(p.is_deleted() for p in pools)
    assert all(np.count_nonzero(np.asarray(p)) for p in out)


def test_build_slot_mappings_by_layer():
    cfg, kv = _model()
    rows = [np.arange(4, dtype=np.int32)]
    got = jaxkv.plan.build_slot_mappings_by_layer(rows, kv)
    assert set(got) == {"a", "c"}
    assert got["a"] is rows[0]
    got = jaxkv.plan.build_slot_mappings_by_layer(rows, kv, runner_config=cfg)
    assert got["b"] is rows[0]
    assert jaxkv.plan.build_slot_mappings_by_layer([], kv) == {}
