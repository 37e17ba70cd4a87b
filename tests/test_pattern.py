"""Layer patterns as runner configs: the kinds, names and specs each letter
gives, recurrent states sharing the attention pools, and clear errors.
"""  # noqa: D205

from typing import Any

import pytest

import jaxkv

GRIFFIN_STATE = (((3, 256), (256,)), ("float32", "float32"))


def _spec(cfg, i) -> Any:
    spec = cfg.layers[i].spec
    assert spec is not None
    return spec


def _kinds(cfg):
    names = {
        jaxkv.FullAttentionSpec: "G",
        jaxkv.SlidingWindowSpec: "L",
        jaxkv.ChunkedLocalAttentionSpec: "C",
        jaxkv.MambaSpec: "R",
    }
    return "".join(names[type(layer.spec)] for layer in cfg.layers)


def test_gemma3_pattern_repeats_five_local_to_one_global():
    cfg = jaxkv.pattern_config(
        "LLLLL:G",
        num_layers=26,
        num_heads=8,
        num_kv_heads=4,
        head_size=32,
        sliding_window=512,
        logits_soft_cap=50.0,
        max_model_len=1024,
    )
    assert _kinds(cfg) == ("LLLLLG" * 5)[:26]
    assert cfg.layers[0].spec == jaxkv.SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=32, dtype="float32", sliding_window=512
    )
    assert {layer.logits_soft_cap for layer in cfg.layers} == {50.0}
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    # vLLM's grouping: groups of equal size, 22 local layers in 6 groups of
    # (up to) 4 beside the 4 global ones.
    assert plan.group_kinds == ("window",) * 6 + ("full",)
    assert plan.attention_layer("layers.5.self_attn").sliding_window is None
    assert plan.attention_layer("layers.4.self_attn").sliding_window == 512


def test_griffin_pattern_shares_pools_between_states_and_local_attention():
    cfg = jaxkv.pattern_config(
        "R, R, L",
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_size=64,
        sliding_window=2049,
        recurrent_state=GRIFFIN_STATE,
        max_model_len=4096,
    )
    assert _kinds(cfg) == "RRLRRL"
    assert [layer.name for layer in cfg.layers][:3] == [
        "layers.0.mixer",
        "layers.1.mixer",
        "layers.2.self_attn",
    ]
    state, attn = _spec(cfg, 0), _spec(cfg, 2)
    assert state.page_size_bytes == attn.page_size_bytes  # padded
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    assert plan.group_kinds == ("mamba", "mamba", "window")
    # Recurrent and attention layers share the same pools (one page size):
    # two pools of three layers each, not six.
    assert len(plan.pools) == 2


def test_a_state_larger_than_a_page_raises_the_attention_block_size():
    big = (((64, 1024),), ("float32",))  # 256 KiB, an attention page is 8 KiB
    cfg = jaxkv.pattern_config(
        "RG",
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_size=64,
        recurrent_state=big,
        max_model_len=4096,
    )
    attn, state = _spec(cfg, 1), _spec(cfg, 0)
    assert attn.block_size > 16
    assert attn.page_size_bytes >= state.real_page_size_bytes


@pytest.mark.parametrize(
    ("pattern", "kwargs", "match"),
    [
        ("", {}, "got none"),
        ("LXG", {"sliding_window": 8}, r"got \['X'\]"),
        ("LG", {}, "sliding_window=None is needed by the local"),
        ("G", {"sliding_window": 8}, "sliding_window=8 is given, but 'G' has no L"),
        ("CG", {}, "attention_chunk_size=None is needed"),
        ("RG", {}, "recurrent_state=None is needed"),
    ],
)
def test_a_bad_pattern_names_what_is_missing(pattern, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.pattern_config(
            pattern, num_layers=4, num_heads=2, num_kv_heads=1, head_size=8, **kwargs
        )
