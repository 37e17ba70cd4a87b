import dataclasses

import pytest

import jaxkv
from tests.helpers import count_compiles, full_spec, layer, single_group_config


def _worked_example(fast_prefill):
    s = full_spec(block_size=16)
    cfg = jaxkv.RunnerConfig(
        kv_sharing_fast_prefill=fast_prefill,
        layers=[
            layer("l0", s, "FLASH_ATTN", num_heads=32),
            layer("l1", s, "TRITON_ATTN", num_heads=32),
            layer("l2", s, "FLASH_ATTN", num_heads=32, kv_sharing_target="l0"),
        ],
    )
    kv = single_group_config(["l0", "l1"], s)
    return cfg, kv


def _summary(groups):
    return [
        [(g.backend.class_name, g.num_heads, list(g.layer_names)) for g in gs]
        for gs in groups
    ]


def test_grouping_worked_example_fast_prefill_on():
    cfg, kv = _worked_example(True)
    groups, info, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert _summary(groups) == [
        [
            ("FlashAttentionBackend", 32, ["l0"]),
            ("TritonAttentionBackend", 32, ["l1"]),
            ("FastPrefillFlashAttentionBackend", 32, ["l2"]),
        ]
    ]
    assert sizes == [16]
    assert info == jaxkv.vllm.AttentionCGSupportInfo()
    # The input config is not mutated; the augmented one has l2.
    assert kv.kv_cache_groups[0].layer_names == ("l0", "l1")
    assert jaxkv.groups.with_kv_sharing_layers(kv, cfg).kv_cache_groups[
        0
    ].layer_names == (
        "l0",
        "l1",
        "l2",
    )


def test_grouping_worked_example_fast_prefill_off_and_idempotent():
    cfg, kv = _worked_example(False)
    groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert _summary(groups) == [
        [
            ("FlashAttentionBackend", 32, ["l0", "l2"]),
            ("TritonAttentionBackend", 32, ["l1"]),
        ]
    ]
    # Passing an already augmented config does not duplicate l2.
    again, _, _ = jaxkv.vllm.init_attn_backend(
        jaxkv.groups.with_kv_sharing_layers(kv, cfg), cfg
    )
    assert _summary(again) == _summary(groups)


def test_active_layer_names_preserve_group_order_and_drafts_join():
    s = full_spec()
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("b", s, num_heads=8),
            layer("a", s, num_heads=8),
            layer("d.x", s, is_draft=True, num_heads=8),
            layer("d.y", s, is_draft=True, num_heads=4),
        ]
    )
    kv = single_group_config(["b", "a", "d.x", "d.y"], s)
    groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert [g.layer_names for g in groups[0]] == [("b", "a", "d.x"), ("d.y",)]
    groups, _, _ = jaxkv.vllm.init_attn_backend(
        kv, cfg, active_layer_names={"d.y", "a", "b"}
    )
    assert [g.layer_names for g in groups[0]] == [("b", "a"), ("d.y",)]
    groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg, active_layer_names=set())
    assert groups == [[]]


def test_kernel_block_sizes_hybrid_and_encoder_only():
    # B = 80 (a hybrid-aligned block): FlashInfer needs 16, Mamba keeps 80,
    # encoder-only groups get no entry.
    attn = full_spec(block_size=80, heads=1, head=8, dtype="float32")
    enc = jaxkv.EncoderOnlyAttentionSpec(
        block_size=80, num_kv_heads=1, head_size=8, dtype="float32"
    )
    mamba = jaxkv.MambaSpec(
        block_size=80,
        shapes=((4,),),
        dtypes=("float32",),
        page_size_padded=attn.page_size_bytes,
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("a", attn, "FLASHINFER"),
            layer("m", mamba, "MAMBA2"),
            layer("e", enc, attn_type="encoder_only"),
        ]
    )
    page = attn.page_size_bytes
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(size=4 * page, shared_by=["a", "m"])
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=attn),
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["m"], kv_cache_spec=mamba),
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["e"], kv_cache_spec=enc),
        ],
    )
    groups, info, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert sizes == [16, 80]
    assert groups[0][0].kernel_block_size == 16
    assert groups[0][0].kernel_block_stride == 0
    assert groups[1][0].kernel_block_size is None
    assert groups[2][0].kernel_block_size is None
    assert info == jaxkv.vllm.AttentionCGSupportInfo(
        jaxkv.vllm.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "FlashInferBackend"
    )


def test_packed_group_keeps_block_size_but_group_refines_with_stride():
    s = full_spec(block_size=32, heads=1, head=8, dtype="float32")  # U = 2048
    cfg = jaxkv.RunnerConfig(
        layers=[layer("a", s, "FLASHINFER"), layer("b", s, "FLASH_ATTN")]
    )
    stride = 2 * s.page_size_bytes
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(
                size=4 * stride, shared_by=["a"], block_stride=stride
            ),
            jaxkv.vllm.KVCacheTensor(
                size=4 * stride,
                shared_by=["b"],
                offset=s.page_size_bytes,
                block_stride=stride,
            ),
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=s)
        ],
    )
    # FlashInfer accepts 32 exactly, so nothing splits.
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert sizes == [32]
    assert groups[0][0].kernel_block_size is None
    # A backend that only takes 16 splits inside the packed pool: s = 4096 / 1024.
    only16 = jaxkv.AttentionBackend(
        name="Only16",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(16,),
    )
    cfg = dataclasses.replace(
        cfg, layers=(jaxkv.LayerConfig(name="a", spec=s, backend=only16), cfg.layers[1])
    )
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg, slot_mapped_layers={"a"})
    assert sizes == [32]
    a = groups[0][0]
    assert (a.kernel_block_size, a.kernel_block_stride, a.maps_slot_mapping) == (
        16,
        4,
        True,
    )
    assert groups[0][1].maps_slot_mapping is False


def test_bad_configs():
    s = full_spec()
    cfg = jaxkv.RunnerConfig(layers=[layer("a", s), layer("nospec", None)])
    with pytest.raises(
        ValueError, match="lists layer 'zz', which is not an attention-like"
    ):
        jaxkv.vllm.init_attn_backend(single_group_config(["a", "zz"], s), cfg)
    with pytest.raises(
        ValueError, match="lists layer 'nospec', which has no KV-cache spec"
    ):
        jaxkv.vllm.init_attn_backend(single_group_config(["a", "nospec"], s), cfg)
    only32 = jaxkv.AttentionBackend(
        name="Only32",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(32,),
    )
    cfg2 = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name="a", spec=s, backend=only32)]
    )
    with pytest.raises(ValueError, match="No kernel block size divides block_size=16"):
        jaxkv.vllm.init_attn_backend(single_group_config(["a"], s), cfg2)
    cfg3 = jaxkv.RunnerConfig(
        layers=[layer("a", s, "FLASHINFER")], batch_invariant=True
    )
    with pytest.raises(RuntimeError, match="does not support batch invariance"):
        jaxkv.vllm.init_attn_backend(single_group_config(["a"], s), cfg3)


def _hybrid_40_layers():
    attn = full_spec(block_size=80, heads=8, head=128)
    swa = jaxkv.SlidingWindowSpec(
        block_size=80,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        sliding_window=1024,
    )
    mamba = jaxkv.MambaSpec(
        block_size=80,
        shapes=((3, 2304), (8, 64, 128)),
        dtypes=("bfloat16", "float32"),
        page_size_padded=attn.page_size_bytes,
    )
    layers = []
    for i in range(40):
        if i >= 36:
            layers.append(
                layer(
                    f"layers.{i}.attn",
                    attn,
                    kv_sharing_target="layers.0.attn",
                    num_heads=32,
                )
            )
        elif i % 3 == 2:
            layers.append(layer(f"layers.{i}.mixer", mamba, "MAMBA2"))
        else:
            layers.append(
                layer(
                    f"layers.{i}.attn",
                    attn if i % 3 == 0 else swa,
                    "FLASHINFER" if i % 2 else "FLASH_ATTN",
                    num_heads=32,
                )
            )
    return jaxkv.RunnerConfig(layers=layers, kv_sharing_fast_prefill=True)


def test_40_layer_hybrid_compiles_nothing():
    with count_compiles() as compiles:
        cfg = _hybrid_40_layers()
        kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=64)
        groups, info, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
        jaxkv.vllm.get_varlen_cudagraph_unsupported_backend(groups, cfg, 4)
        jaxkv.vllm.get_query_lens_mismatch_unsupported_backend(groups)
    assert compiles == []
    assert set(sizes) == {16, 80}
    flat = [g for gs in groups for g in gs]
    names = [n for g in flat for n in g.layer_names]
    assert len(names) == len(set(names)) == 40  # grouping is a partition (I11)
    assert any(g.backend.class_name == "FastPrefillFlashAttentionBackend" for g in flat)
    assert (
        info.min_cg_support == jaxkv.vllm.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def test_an_encoder_only_group_before_attention_groups_mis_sizes_no_view():
    # Groups [encoder-only, FlashInfer 80, FlashAttn 32]: kernel_block_sizes is
    # [16, 32] (no entry for the encoder-only group). Indexing that list by
    # group id would give group 1 the size 32 (group 2's) and group 2 no view;
    # the views are sized by group: group 1's kernel blocks are 16 tokens.
    a = full_spec(block_size=80, heads=1, head=8, dtype="float32")
    b = full_spec(block_size=32, heads=1, head=8, dtype="float32")
    enc = jaxkv.EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("e", enc, attn_type="encoder_only"),
            layer("a", a, "FLASHINFER"),
            layer("b", b, "FLASH_ATTN"),
        ]
    )
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(size=4 * enc.page_size_bytes, shared_by=["e"]),
            jaxkv.vllm.KVCacheTensor(size=4 * a.page_size_bytes, shared_by=["a"]),
            jaxkv.vllm.KVCacheTensor(size=4 * b.page_size_bytes, shared_by=["b"]),
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["e"], kv_cache_spec=enc),
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=a),
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["b"], kv_cache_spec=b),
        ],
    )
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert sizes == [16, 32]
    assert groups[1][0].kernel_block_size == 16
    assert groups[2][0].kernel_block_size is None  # its own block size
    _, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    assert isinstance(views["a"], jaxkv.KVCacheView)
    assert isinstance(views["b"], jaxkv.KVCacheView)
    assert views["a"].block_size == 16  # 80-token blocks split in 5
    assert views["a"].num_blocks == 4 * 5
    assert views["b"].block_size == 32
