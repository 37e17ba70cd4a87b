import pytest

import jaxkv
from tests.helpers import full_spec


def test_layer_in_two_groups():
    s = full_spec()
    with pytest.raises(ValueError, match="layer 'a' is in group 0 and group 1"):
        jaxkv.vllm.KVCacheConfig(
            num_blocks=4,
            kv_cache_tensors=[],
            kv_cache_groups=[
                jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=s),
                jaxkv.vllm.KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=s),
            ],
        )


def test_layer_in_two_tensors():
    with pytest.raises(ValueError, match="kv_cache_tensors 0 and 1"):
        jaxkv.vllm.KVCacheConfig(
            num_blocks=4,
            kv_cache_groups=[],
            kv_cache_tensors=[
                jaxkv.vllm.KVCacheTensor(size=8, shared_by=["a"]),
                jaxkv.vllm.KVCacheTensor(size=8, shared_by=["a"]),
            ],
        )


def test_tensor_checks():
    with pytest.raises(ValueError, match="size must be positive"):
        jaxkv.vllm.KVCacheTensor(size=0, shared_by=["a"])
    with pytest.raises(TypeError, match="the string 'a'"):
        jaxkv.vllm.KVCacheTensor(size=8, shared_by="a")
    with pytest.raises(ValueError, match="needs block_stride > 0"):
        jaxkv.vllm.KVCacheTensor(size=8, shared_by=["a"], offset=4)
    with pytest.raises(ValueError, match="same size"):
        jaxkv.vllm.KVCacheConfig(
            num_blocks=1,
            kv_cache_groups=[],
            kv_cache_tensors=[
                jaxkv.vllm.KVCacheTensor(size=8, shared_by=["a"], block_stride=8),
                jaxkv.vllm.KVCacheTensor(
                    size=16, shared_by=["b"], offset=4, block_stride=8
                ),
            ],
        )
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        jaxkv.vllm.KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])


def test_add_kv_sharing_layers_is_idempotent_and_pure():
    s = full_spec()
    cfg = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["l0", "l1"], kv_cache_spec=s)
        ],
    )
    runner_only = set()
    once = jaxkv.vllm.add_kv_sharing_layers_to_kv_cache_groups(
        {"l2": "l0"}, cfg, runner_only
    )
    twice = jaxkv.vllm.add_kv_sharing_layers_to_kv_cache_groups({"l2": "l0"}, once)
    assert once.kv_cache_groups[0].layer_names == ("l0", "l1", "l2")
    assert twice == once
    assert cfg.kv_cache_groups[0].layer_names == ("l0", "l1")
    assert runner_only == {"l2"}
    with pytest.raises(KeyError, match="targets 'zz'"):
        jaxkv.vllm.add_kv_sharing_layers_to_kv_cache_groups({"l3": "zz"}, cfg)


def test_make_kv_cache_config_hybrid_and_packed():
    cfg = jaxkv.tiny_hybrid_config()
    spec = cfg.layer("layers.0.self_attn").spec
    assert spec is not None
    page = spec.page_size_bytes
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    assert [t.size for t in kv.kv_cache_tensors] == [8 * page, 8 * page]
    packed = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8, packed=True)
    assert [(t.offset, t.block_stride) for t in packed.kv_cache_tensors] == [
        (0, 2 * page),
        (page, 2 * page),
    ]
    assert {t.size for t in packed.kv_cache_tensors} == {16 * page}


def test_make_kv_cache_config_rejects_unequal_pages():
    a = jaxkv.LayerConfig(
        name="a", spec=full_spec(), backend=jaxkv.get_backend("FLASH_ATTN")
    )
    m = jaxkv.LayerConfig(
        name="m",
        spec=jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)),
        backend=jaxkv.get_backend("MAMBA2"),
    )
    with pytest.raises(ValueError, match="equal page sizes"):
        jaxkv.plan.make_kv_cache_config(jaxkv.RunnerConfig(layers=[a, m]), num_blocks=4)
