from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings

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


def _views(cfg, kv, **kw) -> tuple[Any, dict[str, Any]]:
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg, **kw)
    return jaxkv.plan.planned_pools(kv, cfg, sizes, groups)


def _one_layer(backend) -> Any:
    s = full_spec()  # B=16, H=8, D=128, bf16, U=65536
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s, backend)])
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[jaxkv.vllm.KVCacheTensor(size=655360, shared_by=["l"])],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["l"], kv_cache_spec=s)
        ],
    )
    return _views(cfg, kv)[1]["l"]


def test_v1_nhd_worked_example():
    v = _one_layer("FLASH_ATTN")
    assert v.shape == (10, 2, 16, 8, 128)
    assert v.strides == (32768, 16384, 1024, 128, 1)
    assert v.byte_address((3, 1, 5, 2, 7)) == 240142


def test_v1_hnd_worked_example():
    v = _one_layer("FLASHINFER")
    assert v.strides == (32768, 16384, 128, 2048, 1)
    assert v.byte_address((3, 1, 5, 2, 7)) == 238862


def test_v2_kv_first_worked_example():
    v = _one_layer("ROCM_ATTN")
    assert v.shape == (2, 10, 16, 8, 128)
    assert v.strides == (163840, 16384, 1024, 128, 1)
    assert v.byte_address((0, 3, 0, 0, 0)) == 98304
    assert v.byte_address((1, 3, 0, 0, 0)) == 425984


def test_v3_page_aligned_when_sharing_with_mamba():
    s = full_spec()
    mamba = jaxkv.MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=("float32",), page_size_padded=65536
    )
    cfg = jaxkv.RunnerConfig(
        layers=[layer("attn", s, "ROCM_ATTN"), layer("mamba", mamba, "MAMBA2")]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=10)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(
        groups, sizes, "auto", kv
    ) == {"attn"}
    v: Any = jaxkv.plan.planned_pools(kv, cfg, sizes, groups)[1]["attn"]
    assert v.strides == (16384, 32768, 1024, 128, 1)
    assert v.byte_address((0, 3, 0, 0, 0)) == 196608
    assert v.byte_address((1, 3, 0, 0, 0)) == 229376


def test_kv_first_layers_sharing_pool_with_mamba_example():
    # spec §2.12: g0 K/V-first [attn.0, attn.1], g1 Mamba [mamba.0], g2
    # blocks-first [swa.0]; T0 = [attn.0, mamba.0, swa.0], T1 = [attn.1].
    s = full_spec()
    mamba = jaxkv.MambaSpec(
        block_size=16, shapes=((4,),), dtypes=("float32",), page_size_padded=65536
    )
    swa = jaxkv.SlidingWindowSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        sliding_window=32,
    )
    g = [
        jaxkv.vllm.AttentionGroup(
            backend=jaxkv.get_backend("ROCM_ATTN"),
            layer_names=("attn.0", "attn.1"),
            kv_cache_spec=s,
            kv_cache_group_id=0,
        ),
        jaxkv.vllm.AttentionGroup(
            backend=jaxkv.get_backend("MAMBA2"),
            layer_names=("mamba.0",),
            kv_cache_spec=mamba,
            kv_cache_group_id=1,
        ),
        jaxkv.vllm.AttentionGroup(
            backend=jaxkv.get_backend("FLASH_ATTN"),
            layer_names=("swa.0",),
            kv_cache_spec=swa,
            kv_cache_group_id=2,
        ),
    ]
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_groups=[],
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(
                size=4 * 65536, shared_by=["attn.0", "mamba.0", "swa.0"]
            ),
            jaxkv.vllm.KVCacheTensor(size=4 * 65536, shared_by=["attn.1"]),
        ],
    )
    assert jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(
        g, [16, 16, 16], "auto", kv
    ) == {"attn.0"}
    assert (
        jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(
            [g], [16, 16, 16], "auto", None
        )
        == set()
    )
    # The group-id guard: with one kernel size only group 0 is considered.
    assert jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(g, [16], "auto", kv) == {
        "attn.0"
    }
    assert (
        jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(g, [], "auto", kv) == set()
    )


def _encoder_decoder(cross_backend: str | jaxkv.AttentionBackend = "FLASH_ATTN"):
    # spec §2.13: N=4, B=k=16, H=1, D=2, fp32 (U=256), one pool for both.
    s = full_spec(heads=1, head=2, dtype="float32")
    cross = jaxkv.CrossAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=2, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("self", s, "ROCM_ATTN"),
            jaxkv.LayerConfig(
                name="cross",
                spec=cross,
                attn_type="encoder_decoder",
                backend=cross_backend
                if isinstance(cross_backend, jaxkv.AttentionBackend)
                else jaxkv.get_backend(cross_backend),
            ),
        ]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    return cfg, kv


def test_align_mixed_layouts_worked_example():
    cfg, kv = _encoder_decoder()
    assert [t.shared_by for t in kv.kv_cache_tensors] == [("self", "cross")]
    views = _views(cfg, kv)[1]
    assert views["self"].strides == (128, 32, 2, 2, 1)
    assert views["cross"].strides == (32, 128, 2, 2, 1)
    assert views["cross"].byte_address((2, 1, 0, 0, 0)) == 192 * 4
    assert views["self"].byte_address((1, 2, 0, 0, 0)) == 192 * 4


def test_align_mixed_layouts_without_kv_axis_raises():
    fused = jaxkv.AttentionBackend(
        name="Fused", layout=jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED
    )
    cfg, kv = _encoder_decoder(fused)
    with pytest.raises(ValueError, match="needs a K/V axis"):
        _views(cfg, kv)


def test_single_layer_example_and_bad_pool_size():
    v = _one_layer("FLASH_ATTN")
    assert v.num_blocks == 10
    s = full_spec()
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s)])
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[jaxkv.vllm.KVCacheTensor(size=655361, shared_by=["l"])],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["l"], kv_cache_spec=s)
        ],
    )
    with pytest.raises(ValueError, match="not a multiple of its page of 65536"):
        _views(cfg, kv)


def test_padded_kv_first_and_padded_split_raise():
    s = jaxkv.FullAttentionSpec(
        block_size=32,
        num_kv_heads=1,
        head_size=8,
        dtype="float32",
        page_size_padded=4096,
    )
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s, "ROCM_ATTN")])
    with pytest.raises(ValueError, match="needs dense, unpadded pages"):
        _views(cfg, single_group_config(["l"], s))
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s, "FLASHINFER")])  # 32 fits: no split
    _views(cfg, single_group_config(["l"], s))
    s48 = jaxkv.FullAttentionSpec(
        block_size=48,
        num_kv_heads=1,
        head_size=8,
        dtype="float32",
        page_size_padded=4096,
    )
    cfg = jaxkv.RunnerConfig(layers=[layer("l", s48, "FLASHINFER")])  # 48 -> 16
    with pytest.raises(ValueError, match="kernel-split view needs dense"):
        _views(cfg, single_group_config(["l"], s48))


def test_layer_in_no_tensor():
    s = full_spec()
    cfg = jaxkv.RunnerConfig(layers=[layer("a", s), layer("b", s)])
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[jaxkv.vllm.KVCacheTensor(size=65536, shared_by=["a"])],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=s)
        ],
    )
    with pytest.raises(ValueError, match="Layer 'b' of KV-cache group 0 is in no"):
        _views(cfg, kv)


def test_kernel_split_views_and_packed_kernel_view():
    s = full_spec(block_size=32, heads=1, head=8, dtype="float32")  # U = 2048
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("a", s, "FLASH_ATTN"),
            layer("b", s, "FLASH_ATTN", kv_sharing_target="a"),
        ]
    )
    only16 = jaxkv.AttentionBackend(
        name="Only16",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(16,),
    )
    cfg16 = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="a", spec=s, backend=only16),
            jaxkv.LayerConfig(name="b", spec=s, backend=only16, kv_sharing_target="a"),
        ]
    )
    kv = single_group_config(["a"], s, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg16)
    views: dict[str, Any] = jaxkv.plan.planned_pools(kv, cfg16, sizes, groups)[1]
    assert views["a"].shape == (8, 2, 16, 1, 8)
    assert views["a"].block_stride_bytes == 1024
    bound: Any = jaxkv.vllm.bind_kv_caches(views, ["a", "b"], kv, cfg16, groups)
    assert bound["a"] is bound["b"]
    assert bound["a"].shape == (8, 2, 16, 1, 8)
    # Same in a packed pool: views stay at manager granularity, binding re-views.
    stride = 2 * s.page_size_bytes
    packed = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(
                size=4 * stride, shared_by=["a"], block_stride=stride
            )
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=s)
        ],
    )
    groups, _, sizes = jaxkv.vllm.init_attn_backend(packed, cfg16)
    views = jaxkv.plan.planned_pools(packed, cfg16, sizes, groups)[1]
    assert views["a"].shape == (4, 2, 32, 1, 8)
    with pytest.raises(ValueError, match="slot mappings are not mapped"):
        jaxkv.vllm.bind_kv_caches(views, ["a"], packed, cfg16, groups)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(
        packed, cfg16, maps_slot_mapping=True
    )
    views = jaxkv.plan.planned_pools(packed, cfg16, sizes, groups)[1]
    kview: Any = jaxkv.vllm.bind_kv_caches(views, ["a", "b"], packed, cfg16, groups)[
        "b"
    ]
    # s = 4096 / 1024 = 4 kernel pages per manager block; (N-1)*s + r ids.
    assert kview.shape == (3 * 4 + 2, 2, 16, 1, 8)
    assert kview.block_stride_bytes == 1024
    assert kview.strides[1] == 16 * 8
    del cfg


def test_planning_compiles_nothing():
    cfg = jaxkv.tiny_hybrid_config()
    with count_compiles() as compiles:
        kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=64, packed=True)
        groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
        jaxkv.plan.planned_pools(kv, cfg, sizes, groups)
    assert compiles == []


def test_carrier_word_choice():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    pools, _ = jaxkv.plan.planned_pools(kv, cfg, sizes, groups)
    assert [p.word for p in pools] == [4, 4]
    odd = jaxkv.FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=3, dtype="float8_e4m3fn"
    )
    cfg = jaxkv.RunnerConfig(layers=[layer("l", odd, "JAX_PAGED")])
    pools, views = _views(cfg, single_group_config(["l"], odd))
    assert pools[0].word == 1
    assert views["l"].word == 1


def _byte_sets(views, num_ids):
    """Byte set of each (layer, block id) per pool, from jaxkv's descriptors."""
    per_pool = {}
    seen = set()
    for name, view in views.items():
        if id(view) in seen:
            continue
        seen.add(id(view))
        for b in range(num_ids(view)):
            per_pool.setdefault(view.pool, []).append(
                (name, b, set(view.block_byte_set(b)))
            )
    return per_pool


@settings(
    max_examples=examples(400),
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(case=hybrid_cases())
def test_distinct_block_ids_never_overlap(case):
    """I1/I2/I4 over jaxkv's views and, independently, the oracle's."""
    try:
        groups, sizes, _, _, bound = plan(case)
    except ValueError as err:
        assume(not any(m in str(err) for m in EXPECTED_ERRORS))
        raise
    group_of = {
        n: g.kv_cache_group_id for gs in groups for g in gs for n in g.layer_names
    }
    # Manager block b of a layer = the union of its kernel ids (spec §1.6 / I5).
    ratio = {
        n: (
            g.block_size // g.effective_kernel_block_size,
            g.kernel_block_stride or g.block_size // g.effective_kernel_block_size,
        )
        for gs in groups
        for g in gs
        for n in g.layer_names
    }
    oracle = Oracle(case.kv, case.cfg, sizes, groups)
    n_manager = case.kv.num_blocks
    for source in ("jaxkv", "oracle"):
        owned = {}
        for name, view in bound.items():
            r, t = ratio[name]
            for b in range(n_manager):
                ids = [b * t + j for j in range(r)]
                if source == "jaxkv":
                    data = set().union(
                        *(set(view.block_byte_set(i).tolist()) for i in ids)
                    )
                else:
                    data = set().union(*(oracle.block_bytes(name, i) for i in ids))
                owned[(name, b)] = (view.pool, data)
        items = list(owned.items())
        for i, ((n1, b1), (p1, s1)) in enumerate(items):
            for (n2, b2), (p2, s2) in items[i + 1 :]:
                if p1 != p2:
                    continue
                same_target = bound[n1] is bound[n2]
                if b1 != b2:
                    assert s1.isdisjoint(s2), (source, n1, b1, n2, b2, case.description)
                elif group_of[n1] == group_of[n2] and not same_target:
                    assert s1.isdisjoint(s2), ("I4", source, n1, n2, case.description)
        # Views agree with the oracle on every byte address.
        if source == "oracle":
            for name in bound:
                for b in range(n_manager):
                    r, t = ratio[name]
                    ids = [b * t + j for j in range(r)]
                    mine = set().union(
                        *(set(bound[name].block_byte_set(i).tolist()) for i in ids)
                    )
                    assert mine == owned[(name, b)][1], (name, b, case.description)
