"""Seed conformance: per-request causality, the reduced record's host copy,
hybrid block-size alignment, spec kinds without per-layer views (spec §1.1,
§1.9, §1.12, §2.7.2, §2.16, §2.17.1), each with the spec's worked numbers."""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.test_attention import _reference
from tests.test_metadata import _build, _groups_2_16

i32 = np.int32


def _host(x: Any) -> list[int]:
    assert x is not None, "no host copy"
    return np.asarray(x).tolist()


def _spec(cfg: jaxkv.RunnerConfig, name: str) -> Any:
    return cfg.layer(name).spec


# --- 1. per-request causality ----------------------------------------------------


def test_per_request_causal_array_is_handed_to_every_group():
    groups, kv = _groups_2_16()
    meta, _, _ = _build(groups, kv, causal=np.array([True, False]))
    for name in ("a", "b", "m2", "m3"):
        assert meta[name].causal is True  # the static, group-level flag
        assert meta[name].request_causal.tolist() == [True, False]
    # A mapping still sets group causality, with every request causal.
    meta, _, _ = _build(groups, kv, causal={0: False})
    assert meta["a"].causal is False
    assert meta["a"].request_causal.tolist() == [True, True]


def test_per_request_causal_array_of_the_wrong_length_is_refused():
    groups, kv = _groups_2_16()
    with pytest.raises(ValueError, match="has 3 entries, expected num_reqs=2"):
        _build(groups, kv, causal=np.array([True, False, True]))
    with pytest.raises(ValueError, match="1-D boolean array"):
        _build(groups, kv, causal=np.array([[True, False]]))


def test_paged_attention_honours_a_per_request_mask():
    """Request 0 causal, request 1 bidirectional over its whole context."""
    spec = jaxkv.FullAttentionSpec(
        block_size=8, num_kv_heads=2, head_size=4, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="l", spec=spec, backend=jaxkv.get_backend("JAX_PAGED")
            )
        ],
        max_model_len=32,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=12)
    view, pools = plan.views["l"], plan.allocate()
    rng = np.random.default_rng(0)
    reqs = [(5, 12), (6, 9)]  # (query, context after the step)
    tables = np.array([[1, 2, 0, 0], [5, 6, 0, 0]], i32)
    ks, vs = [], []
    for r, (_, seq) in enumerate(reqs):
        k = rng.standard_normal((seq, 2, 4)).astype(np.float32)
        v = rng.standard_normal((seq, 2, 4)).astype(np.float32)
        pos = np.arange(seq)
        pools = jaxkv.write_kv(pools, view, k, v, tables[r][pos // 8] * 8 + pos % 8)
        ks.append(k)
        vs.append(v)
    qsl = np.array([0, 5, 11], i32)
    q = rng.standard_normal((11, 4, 4)).astype(np.float32)
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        2,
        11,
        qsl,
        qsl,
        6,
        np.array([12, 9], i32),
        12,
        [tables],
        [np.full(11, -1, i32)],
        plan.kv_cache_config,
        causal=np.array([True, False]),
    )["l"]
    out = np.asarray(
        jaxkv.paged_attention(jnp.asarray(q), pools, view, meta, scale=0.5)
    )
    for r, ((q_len, seq), causal) in enumerate(zip(reqs, (True, False), strict=True)):
        want = _reference(
            q[qsl[r] : qsl[r + 1]],
            ks[r],
            vs[r],
            np.arange(seq - q_len, seq),
            seq,
            0.5,
            causal=causal,
        )
        np.testing.assert_allclose(out[qsl[r] : qsl[r + 1]], want, rtol=2e-5, atol=2e-5)
    # The same through the step builder's packed buffer.
    builder = jaxkv.StepMetadataBuilder(plan)
    step = builder.prepare(
        jaxkv.StepArrays(
            query_start_loc=qsl,
            seq_lens=np.array([12, 9]),
            positions=np.concatenate([np.arange(7, 12), np.arange(3, 9)]),
            block_tables=[tables],
            slot_mappings=[np.full(11, -1, i32)],
            request_causal=np.array([True, False]),
        )
    )
    packed_meta = builder.build(step)["l"]
    assert packed_meta.request_causal[:2].tolist() == [True, False]
    out2 = jaxkv.paged_attention(jnp.asarray(q), pools, view, packed_meta, scale=0.5)
    np.testing.assert_allclose(np.asarray(out2)[:11], out[:11], rtol=1e-6, atol=1e-6)


# --- 2. the reduced fast-prefill record keeps a host copy -------------------------


def _fast_prefill_groups():
    groups, kv = _groups_2_16()
    wrapped = dataclasses.replace(
        groups[0][1],
        backend=jaxkv.vllm.create_fast_prefill_custom_backend(
            "FastPrefill", groups[0][1].backend
        ),
        fast_prefill=True,
    )
    return [[groups[0][0], wrapped], [], groups[2], groups[3]], kv


def test_reduced_record_carries_the_host_query_start_loc():
    """Spec §2.17.1: qsl = [0, 15, 20, 28], idx = [14, 18, 19, 27] -> [0, 1, 3, 4]."""
    groups, kv = _fast_prefill_groups()
    fp = jaxkv.vllm.FastPrefillBatchMetadata(
        logits_indices_padded=jnp.array([14, 18, 19, 27, 27, 27, 27, 27], jnp.int32),
        num_logits_indices=jnp.int32(4),
        max_logits_per_req=jnp.int32(2),
    )
    qsl = np.array([0, 15, 20, 28], i32)
    meta = jaxkv.vllm.build_attn_metadata(
        groups,
        3,
        28,
        np.pad(qsl, (0, 1), mode="edge"),
        qsl,
        15,
        np.array([41, 31, 40, 0], i32),
        41,
        [np.zeros((4, 3), i32)] * 4,
        [np.full(32, -1, i32)] * 4,
        kv,
        fast_prefill=fp,
    )
    assert _host(meta["b"].query_start_loc_cpu) == [0, 1, 3, 4]
    assert meta["b"].query_start_loc[:4].tolist() == [0, 1, 3, 4]
    assert _host(meta["a"].query_start_loc_cpu) == [0, 15, 20, 28]


def test_reduced_record_host_copy_from_the_helper_and_pure_decode():
    d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=32, max_num_reqs=4)
    d.mark_ready()
    helper = jaxkv.vllm.FastPrefillHelper(d, 32)
    desc = jaxkv.vllm.BatchDescriptor(
        num_tokens=32, num_reqs=4, cg_mode=jaxkv.vllm.CompileMode.PIECEWISE
    )
    fp = helper.prepare(
        np.array([14, 18, 19, 27]), 3, np.array([0, 1, 3, 4]), True, desc
    )
    assert fp is not None
    np.testing.assert_array_equal(fp.logits_indices_cpu, [14, 18, 19, 27])
    m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=28, max_blocks=1)
    m = dataclasses.replace(
        m,
        query_start_loc=jnp.array([0, 15, 20, 28], jnp.int32),
        query_start_loc_cpu=np.array([0, 15, 20, 28]),
        max_query_len=jnp.int32(15),
        logits_indices_padded=fp.logits_indices_padded,
        num_logits_indices=fp.num_logits_indices,
        max_logits_per_req=fp.max_logits_per_req,
        logits_indices_cpu=fp.logits_indices_cpu,
        fast_prefill=True,
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(m)
    assert _host(r.query_start_loc_cpu) == [0, 1, 3, 4]
    # A one-token request whose logits index is its first token (the boundary
    # of the query ranges): qsl = [0, 15, 16, 20], idx = [14, 15, 19].
    mixed = dataclasses.replace(
        m,
        query_start_loc=jnp.array([0, 15, 16, 20], jnp.int32),
        query_start_loc_cpu=np.array([0, 15, 16, 20]),
        logits_indices_padded=jnp.array([14, 15, 19, 19], jnp.int32),
        num_logits_indices=jnp.int32(3),
        max_logits_per_req=jnp.int32(1),
        logits_indices_cpu=np.array([14, 15, 19]),
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(mixed)
    assert _host(r.query_start_loc_cpu) == [0, 1, 2, 3]
    assert r.query_start_loc.tolist() == [0, 1, 2, 3]
    # Pure decode: vLLM keeps the record, so the host copy is the original.
    decode = dataclasses.replace(
        m,
        query_start_loc=jnp.array([0, 1, 2, 3], jnp.int32),
        query_start_loc_cpu=np.array([0, 1, 2, 3]),
        max_query_len=jnp.int32(1),
        logits_indices_cpu=np.array([0, 1, 2]),
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(decode)
    assert _host(r.query_start_loc_cpu) == [0, 1, 2, 3]
    assert r.query_start_loc.tolist() == [0, 1, 2, 3]


# --- 3. hybrid block-size alignment -------------------------------------------------


def _hybrid(block_size: int = 16, backend: Any = "FLASH_ATTN") -> jaxkv.RunnerConfig:
    if isinstance(backend, str):
        backend = jaxkv.get_backend(backend)
    attn = jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    mamba = jaxkv.MambaSpec(
        block_size=block_size,
        shapes=((3, 2304), (8, 64, 128)),
        dtypes=("bfloat16", "float32"),
    )
    return jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="attn0", spec=attn, backend=backend),
            jaxkv.LayerConfig(
                name="mamba0", spec=mamba, backend=jaxkv.get_backend("MAMBA2")
            ),
            jaxkv.LayerConfig(name="attn1", spec=attn, backend=backend),
            jaxkv.LayerConfig(
                name="mamba1", spec=mamba, backend=jaxkv.get_backend("MAMBA2")
            ),
        ],
        max_model_len=256,
    )


def test_hybrid_alignment_worked_example():
    """Spec §1.9: a1 = 4096, m = 275968, B = 16 * cdiv(275968, 65536) = 80."""
    a = jaxkv.plan.align_hybrid_block_size(_hybrid())
    assert (a.mamba_page_size_bytes, a.block_size, a.page_size_bytes) == (
        275968,
        80,
        327680,
    )
    cfg = a.runner_config
    assert _spec(cfg, "attn0").block_size == 80
    assert _spec(cfg, "attn0").page_size_bytes == 327680
    assert _spec(cfg, "mamba0").page_size_bytes == 327680
    assert _spec(cfg, "mamba0").real_page_size_bytes == 275968
    # A larger starting block size is the alignment unit: 32 * cdiv(m, 131072).
    assert jaxkv.plan.align_hybrid_block_size(_hybrid(block_size=32)).block_size == 96
    # FlashInfer declares 16, 32, 64: its smallest (16) sets the unit.
    assert (
        jaxkv.plan.align_hybrid_block_size(_hybrid(backend="FLASHINFER")).block_size
        == 80
    )
    # A backend of 64-token kernels only: align = 64, 64 * cdiv(m, 262144) = 128.
    k64 = jaxkv.AttentionBackend(
        name="K64",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(64,),
    )
    assert jaxkv.plan.align_hybrid_block_size(_hybrid(backend=k64)).block_size == 128


def test_planner_aligns_a_hybrid_model_when_asked():
    with pytest.raises(ValueError, match="equal page sizes.*align_hybrid"):
        jaxkv.make_plan(_hybrid(), num_blocks=4)
    plan = jaxkv.make_plan(_hybrid(), num_blocks=4, align_hybrid=True)
    views: Any = plan.views
    assert _spec(plan.runner_config, "attn1").block_size == 80
    assert [p.size_bytes for p in plan.pools] == [4 * 327680] * 2
    assert views["attn0"].block_size == 80
    # Attention and Mamba views of one pool address the same pages.
    assert views["attn0"].strides[0] * 2 == 327680  # bf16 elements per page
    assert views["mamba0"].states[1].offset == 3 * 2304 * 2


def test_alignment_rejects_attention_layers_that_cannot_share_one_page():
    cfg = _hybrid()
    other = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype="bfloat16"
    )
    layers = [*cfg.layers[:3], dataclasses.replace(cfg.layers[2], name="x", spec=other)]
    with pytest.raises(ValueError, match="share bytes per token"):
        jaxkv.plan.align_hybrid_block_size(dataclasses.replace(cfg, layers=layers))


# --- 4. spec kinds without per-layer views ------------------------------------------


def test_a_spec_kind_without_views_gets_no_attention_group_and_raw_pages():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    raw = jaxkv.RawPageSpec(block_size=16, page_bytes=spec.page_size_bytes)
    fa = jaxkv.get_backend("FLASH_ATTN")
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="a0", spec=spec, backend=fa),
            jaxkv.LayerConfig(name="idx0", spec=raw, backend=fa),
            jaxkv.LayerConfig(name="a1", spec=spec, backend=fa),
            jaxkv.LayerConfig(name="idx1", spec=raw, backend=fa),
        ],
        max_model_len=64,
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert [[g.layer_names for g in gs] for gs in groups] == [[("a0", "a1")], []]
    assert sizes == [16, 16]  # a kind without views keeps its block size
    plan = jaxkv.make_plan(cfg, num_blocks=4)
    view: Any = plan.views["idx0"]
    assert (view.shape, view.dtype, view.axes) == (
        (4, 2048),
        np.uint8,
        ("block", "state"),
    )
    # Block 2 of idx0 is bytes [4096, 6144) of the pool it shares with a0.
    assert set(view.block_byte_set(2).tolist()) == set(range(4096, 6144))
    assert set(view.block_byte_set(2).tolist()) == set(
        plan.views["a0"].block_byte_set(2).tolist()
    )
    pools = plan.allocate()
    pools = jaxkv.zero_blocks(pools, (view,), jnp.array([1], jnp.int32))
    assert jaxkv.read_view(pools, view).shape == (4, 2048)
    # Metadata skips the group (no attention group), as vLLM does.
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        1,
        1,
        np.array([0, 1], i32),
        None,
        1,
        np.array([1], i32),
        1,
        [np.zeros((1, 4), i32)] * 2,
        [np.zeros(1, i32)] * 2,
        plan.kv_cache_config,
    )
    assert set(meta) == {"a0", "a1"}
    # Packed: idx1 shares the second page of each packed block with a1.
    packed = jaxkv.make_plan(cfg, num_blocks=4, packed=True)
    view = packed.views["idx1"]
    assert isinstance(view, jaxkv.KVCacheView)
    assert view.offset == 2048
    assert view.strides == (2 * 2048, 1)
    assert set(view.block_byte_set(1).tolist()) == set(range(6144, 8192))


def test_a_kind_of_ones_own_registers_by_subclassing():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class IndexerSpec(jaxkv.RawPageSpec):
        top_k: int = 8

    spec = IndexerSpec(block_size=16, page_bytes=1024)
    assert not spec.has_layer_views
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="i", spec=spec, backend=jaxkv.get_backend("FLASH_ATTN")
            )
        ]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=2)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert groups == [[]]
    assert sizes == [16]


@pytest.mark.parametrize("kind", ["attention", "raw"])
def test_a_group_layer_in_no_tensor_is_named(kind):
    attn = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    spec = (
        attn
        if kind == "attention"
        else jaxkv.RawPageSpec(block_size=16, page_bytes=attn.page_size_bytes)
    )
    fa = jaxkv.get_backend("FLASH_ATTN")
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name=n, spec=spec, backend=fa) for n in "ab"]
    )
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(size=2 * spec.page_size_bytes, shared_by=["a"])
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=spec)
        ],
    )
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    with pytest.raises(
        ValueError, match="'b' of KV-cache group 0 is in no KVCacheTensor"
    ):
        jaxkv.plan.build_kv_cache_views(kv, cfg, sizes, groups)
