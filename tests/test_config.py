from typing import Any

import jax
import pytest

import jaxkv
from tests.helpers import full_spec, layer


def test_runner_config_is_static_and_hashable():
    cfg = jaxkv.tiny_hybrid_config()
    assert jax.tree.leaves(cfg) == []
    assert hash(cfg) == hash(jaxkv.tiny_hybrid_config())
    assert "layers.0.self_attn" in cfg
    assert cfg.layer("layers.2.mixer").layer_type == "mamba"


def test_duplicate_layer_names():
    s = full_spec()
    with pytest.raises(
        ValueError, match="duplicate layer name 'a' at positions 0 and 1"
    ):
        jaxkv.RunnerConfig(layers=[layer("a", s), layer("a", s)])


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (lambda s: [layer("a", s, kv_sharing_target="a")], "itself"),
        (lambda s: [layer("a", s, kv_sharing_target="zz")], "not a layer of the model"),
        (
            lambda s: [layer("a", s, kv_sharing_target="b"), layer("b", s)],
            "registered later",
        ),
        (
            lambda s: [
                layer("a", s, attn_type="encoder"),
                layer("b", s, kv_sharing_target="a"),
            ],
            "attn_type 'encoder'",
        ),
        (
            lambda s: [
                layer("a", s),
                layer("b", s, kv_sharing_target="a"),
                layer("c", s, kv_sharing_target="b"),
            ],
            "chains",
        ),
    ],
)
def test_bad_kv_sharing_targets(layers, message):
    with pytest.raises(ValueError, match=message):
        jaxkv.RunnerConfig(layers=layers(full_spec()))


@pytest.mark.parametrize(
    "field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens"]
)
def test_non_positive_limits(field):
    kwargs: dict[str, Any] = {field: 0}
    with pytest.raises(ValueError, match=field):
        jaxkv.RunnerConfig(layers=[layer("a", full_spec())], **kwargs)


def test_buckets_must_ascend():
    with pytest.raises(ValueError, match="strictly ascending"):
        jaxkv.RunnerConfig(layers=[layer("a", full_spec())], token_buckets=(8, 4))
    with pytest.raises(ValueError, match="token_buckets"):
        jaxkv.RunnerConfig(layers=[layer("a", full_spec())], token_buckets=(0, 4))


def test_layer_config_checks():
    with pytest.raises(ValueError, match="MambaSpec needs a Mamba backend"):
        layer("m", jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)))
    with pytest.raises(TypeError, match="backend must be an AttentionBackend"):
        jaxkv.LayerConfig(name="a", spec=full_spec(), backend="FLASH_ATTN")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="attn_type"):
        layer("a", full_spec(), attn_type="cross")
    assert layer("a", full_spec(), kv_sharing_target="").kv_sharing_target is None


def test_unknown_layer_lookup():
    cfg = jaxkv.RunnerConfig(layers=[layer("a", full_spec())])
    with pytest.raises(KeyError, match="no attention-like layer 'b'"):
        cfg.layer("b")
