"""The plan object, the core/demo split, fields jaxkv rejects rather than ignores."""

import dataclasses
import functools
import subprocess
import sys

import numpy as np
import pytest

import jaxkv
from jaxkv.plan import KVCacheView


def test_core_import_loads_no_demo_libraries():
    code = (
        "import sys, jaxkv\n"
        "print(sorted({'flax', 'optax', 'chex', 'matplotlib', 'jaxkv.demo',"
        " 'prometheus_client'}"
        " & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_plan_matches_the_seed_functions():
    cfg = jaxkv.tiny_hybrid_config(max_model_len=256)
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    groups, info, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    pools, views = jaxkv.plan.planned_pools(kv, cfg, sizes, groups)
    bound = jaxkv.vllm.bind_kv_caches(
        views, [layer.name for layer in cfg.layers], kv, cfg, groups
    )
    assert plan.kernel_block_sizes == tuple(sizes)
    assert plan.cg_support == info
    assert plan.pools == pools
    assert plan.views == bound
    assert [[g.layer_names for g in gs] for gs in plan.attn_groups] == [
        [g.layer_names for g in gs] for gs in groups
    ]
    assert plan.kv_cache_config == jaxkv.groups.with_kv_sharing_layers(kv, cfg)
    # 256 tokens in blocks of 32: 8 columns; the Mamba group holds one block.
    assert plan.block_table_widths == (8, 8, 8)


def test_plan_pages_and_strides_by_hand():
    """The page arithmetic from the config's numbers, not from jaxkv's functions."""
    cfg = jaxkv.tiny_hybrid_config(max_model_len=256)
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    block, heads, dim, f32 = 32, 2, 32, 4
    page = 2 * block * heads * dim * f32  # K and V: 16 KiB, the Mamba page too
    assert page == 16384
    assert [p.size_bytes for p in plan.pools] == [8 * page, 8 * page]
    assert plan.pool_bytes == 2 * 8 * page
    view = plan.views["layers.0.self_attn"]
    assert isinstance(view, KVCacheView)
    assert view.axes == ("block", "kv", "token", "head", "dim")
    assert view.shape == (8, 2, block, heads, dim)
    words = page // f32
    assert view.strides == (words, words // 2, heads * dim, dim, 1)
    # YOCO: layer 7 reads layer 4's cache, through the same view.
    assert plan.views["layers.7.self_attn"] is plan.views["layers.4.self_attn"]


def test_equal_plans_are_one_static_argument():
    """Two plans built apart compare and hash equal, so a jit keyed on the plan
    traces once for both; a different plan is a different key."""
    import jax
    import jax.numpy as jnp

    cfg = jaxkv.tiny_hybrid_config(max_model_len=256)
    a, b = jaxkv.make_plan(cfg, num_blocks=8), jaxkv.make_plan(cfg, num_blocks=8)
    other = jaxkv.make_plan(cfg, num_blocks=9)
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert other != a
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def blocks(plan, x):
        traces.append(plan.num_blocks)
        return x + plan.num_blocks

    assert int(blocks(a, jnp.int32(0))) == 8
    assert int(blocks(b, jnp.int32(0))) == 8
    assert int(blocks(other, jnp.int32(0))) == 9
    assert traces == [8, 9]


def test_plan_from_a_memory_budget_probes_one_block():
    cfg = jaxkv.tiny_hybrid_config()
    one = jaxkv.make_plan(cfg, num_blocks=2).pool_bytes // 2
    assert one == 2 * 16384  # two pools of one 16 KiB page
    budget = jaxkv.kv_cache_budget(cfg, memory_bytes=10 * one + one // 2)
    assert budget.bytes_per_block == one
    assert budget.pool_bytes_per_block == (16384, 16384)
    with pytest.raises(ValueError, match="at least 2 are needed"):
        jaxkv.make_plan(cfg, num_blocks=1)
    plan = jaxkv.make_plan(cfg, memory_bytes=10 * one + one // 2)
    assert plan.num_blocks == 10
    assert plan.pool_bytes <= 10 * one + one // 2
    with pytest.raises(ValueError, match="at least 2 are needed"):
        jaxkv.make_plan(cfg, memory_bytes=one)
    with pytest.raises(ValueError, match="exactly one of num_blocks and memory_bytes"):
        jaxkv.make_plan(cfg, num_blocks=4, memory_bytes=one * 4)
    with pytest.raises(ValueError, match="exactly one"):
        jaxkv.make_plan(cfg)


def test_plan_allocates_its_pools():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    pools = plan.allocate()
    assert [(p.shape, p.dtype) for p in pools] == [
        (s.shape, s.dtype) for s in plan.pools
    ]
    assert not np.asarray(pools[0]).any()


def test_equal_bindings_are_equal_and_hash_equal():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    _, views = jaxkv.plan.planned_pools(kv, cfg, sizes, groups)
    names = [layer.name for layer in cfg.layers]
    a = jaxkv.vllm.bind_kv_caches(views, names, kv, cfg, groups)
    b = jaxkv.vllm.bind_kv_caches(views, list(reversed(names)), kv, cfg, groups)
    assert a == b
    assert hash(a) == hash(b)
    c = jaxkv.vllm.bind_kv_caches(views, [*names, "encoder.attn"], kv, cfg, groups)
    assert c != a


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: jaxkv.FullAttentionSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=8,
                dtype="float32",
                kv_quant_mode="nvfp4",
            ),
            "kv_quant_mode",
        ),
        (
            lambda: jaxkv.SlidingWindowSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=8,
                dtype="float32",
                sliding_window=32,
                extra_retained_tokens=4,
            ),
            "extra_retained_tokens",
        ),
        (
            lambda: jaxkv.MambaSpec(
                block_size=16,
                shapes=((4,),),
                dtypes=("float32",),
                mamba_cache_mode="all",
            ),
            "mamba_cache_mode",
        ),
        (
            lambda: jaxkv.MambaSpec(
                block_size=16,
                shapes=((4,),),
                dtypes=("float32",),
                num_speculative_blocks=2,
            ),
            "num_speculative_blocks",
        ),
    ],
)
def test_unsupported_spec_fields_raise_instead_of_being_ignored(make, field):
    with pytest.raises(NotImplementedError, match=f"{field}=.*not implemented"):
        make()


def test_init_attn_backend_rejects_a_device_it_would_ignore():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    with pytest.raises(ValueError, match="device=.*not used by jaxkv"):
        jaxkv.vllm.init_attn_backend(kv, cfg, "cuda:0")


def test_capability_checks_reject_groups_of_another_model():
    cfg = jaxkv.tiny_hybrid_config()
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
    other = jaxkv.RunnerConfig(layers=[cfg.layers[0]])
    with pytest.raises(ValueError, match="'layers.3.self_attn' is not a layer"):
        jaxkv.vllm.get_attn_cg_support(groups, other)
    with pytest.raises(ValueError, match="is not a layer"):
        jaxkv.vllm.get_varlen_cudagraph_unsupported_backend(groups, other, 4)


def test_build_attn_metadata_rejects_a_config_with_fewer_groups():
    cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
    plan = jaxkv.make_plan(cfg, num_blocks=4)
    small = jaxkv.vllm.KVCacheConfig(
        num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[]
    )
    i32 = np.int32
    with pytest.raises(ValueError, match="3 attention-group lists for a KVCacheConfig"):
        jaxkv.vllm.build_attn_metadata(
            plan.attn_groups,
            i32(1),
            i32(1),
            np.array([0, 1], i32),
            None,
            i32(1),
            np.array([1], i32),
            i32(1),
            [np.zeros((1, 1), i32)] * 3,
            [np.zeros(1, i32)] * 3,
            small,
        )


def _mixed_pages(full_head=8, swa_head=16, mla=False):
    full: jaxkv.AttentionSpec = (
        jaxkv.MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=full_head, dtype="float32"
        )
        if mla
        else jaxkv.FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=full_head, dtype="float32"
        )
    )
    swa = jaxkv.SlidingWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=swa_head,
        dtype="float32",
        sliding_window=32,
    )
    be = jaxkv.get_backend("JAX_PAGED")
    return jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name=f"l{i}", spec=s, backend=be, num_heads=1)
            for i, s in enumerate([full, swa, full, swa])
        ],
        max_model_len=256,
    )


@pytest.mark.parametrize("packed", [False, True])
def test_mixed_page_sizes_are_unified_as_vllm_does(packed):
    # vLLM 0.32 (unify_kv_cache_spec_page_size): full layers of head size 8
    # beside sliding-window layers of head size 16, block 16: the full layers'
    # block size is raised to 32 so both pages are 2048 bytes.
    plan = jaxkv.make_plan(_mixed_pages(), num_blocks=8, packed=packed)
    specs = [g.kv_cache_spec for g in plan.kv_cache_config.kv_cache_groups]
    assert sorted((type(s).__name__, s.block_size) for s in specs) == [
        ("FullAttentionSpec", 32),
        ("SlidingWindowSpec", 16),
    ]
    assert {s.page_size_bytes for s in specs} == {2048}
    spec = plan.runner_config.layer("l0").spec
    assert spec is not None
    assert spec.block_size == 32
    view = plan.views["l0"]
    assert isinstance(view, jaxkv.KVCacheView)
    assert view.block_size == 32
    # The scheduler and manager follow the plan's block sizes.
    m = jaxkv.KVCacheManager(plan)
    assert sorted(m.block_sizes) == [16, 32]
    r = jaxkv.Request("r", prompt=list(range(40)), max_new_tokens=1)
    assert m.allocate(r, 40)
    assert sorted(len(t) for t in m.blocks_of(r)) == [2, 3]


def test_mixed_pages_that_do_not_divide_are_padded_or_refused():
    # Head sizes 12 and 16: 1536 does not divide 2048, so the page is padded.
    plan = jaxkv.make_plan(_mixed_pages(full_head=12), num_blocks=4)
    spec = plan.runner_config.layer("l0").spec
    assert spec is not None
    assert (spec.block_size, spec.page_size_bytes) == (16, 2048)
    # An MLA page can be neither raised to a divisor nor padded.
    with pytest.raises(ValueError, match=r"\['l0', 'l2'\].*\['l1', 'l3'\].*block size"):
        jaxkv.make_plan(_mixed_pages(full_head=24, swa_head=16, mla=True), num_blocks=4)


def test_unified_pages_pad_a_smaller_mamba_state():
    cfg = _mixed_pages()
    state = jaxkv.MambaSpec(block_size=16, shapes=((256,),), dtypes=("float32",))
    mixer = jaxkv.LayerConfig(
        name="mixer", spec=state, backend=jaxkv.get_backend("MAMBA2"), num_heads=1
    )
    cfg = dataclasses.replace(cfg, layers=(*cfg.layers, mixer))
    out = jaxkv.vllm.unify_page_sizes(cfg).layer("mixer").spec
    assert out is not None
    assert (state.page_size_bytes, out.page_size_bytes) == (1024, 2048)


def test_block_tables_are_wide_enough_for_a_max_model_len_off_the_block_grid():
    # 100 tokens in blocks of 32: 4 columns (3.125 rounded up).
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(max_model_len=100), num_blocks=4)
    assert plan.block_sizes == (32, 32, 32)
    assert plan.block_table_widths == (4, 4, 4)
