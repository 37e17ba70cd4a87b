import jaxkv
from tests.helpers import full_spec, layer


def _model(share, fast_prefill=True):
    s = full_spec()
    return jaxkv.RunnerConfig(
        kv_sharing_fast_prefill=fast_prefill,
        layers=[
            layer(f"L{i}", s, kv_sharing_target=share.get(f"L{i}")) for i in range(6)
        ],
    )


def test_get_kv_cache_spec_worked_example():
    s = full_spec()
    mamba = jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
    cfg = jaxkv.RunnerConfig(
        layers=[
            layer("attn0", s),
            layer("attn1", s, kv_sharing_target="attn0"),
            layer("enc", None, attn_type="encoder_only"),
            layer("mamba0", mamba, backend="MAMBA2"),
            layer("draft.attn0", s, is_draft=True),
        ]
    )
    specs = jaxkv.vllm.get_kv_cache_spec(cfg)
    assert list(specs) == ["attn0", "mamba0", "draft.attn0"]
    assert specs["draft.attn0"].is_draft
    assert specs["draft.attn0"] == specs["attn0"]
    assert not specs["attn0"].is_draft


def test_eligible_layers_worked_example():
    cfg = _model({"L3": "L1", "L4": "L2", "L5": "L1"})
    assert jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(cfg, {"L4"}) == {
        "L3",
        "L5",
    }
    assert jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(cfg) == {
        "L3",
        "L4",
        "L5",
    }


def test_eligible_layers_edge_cases():
    # Switch off, no sharing, and a non-sharing last layer all give the empty set.
    assert (
        jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(
            _model({"L5": "L1"}, fast_prefill=False)
        )
        == set()
    )
    assert jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(_model({})) == set()
    assert (
        jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(_model({"L3": "L1"}))
        == set()
    )
    # The walk stops at the first non-sharing layer: L2 shares but L3 does not.
    assert jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(
        _model({"L2": "L0", "L4": "L1", "L5": "L1"})
    ) == {"L4", "L5"}


def test_eligible_set_is_a_suffix_of_sharing_layers():
    for mask in range(1, 64):
        share = {f"L{i}": "L0" for i in range(1, 6) if mask >> i & 1}
        got = jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(_model(share))
        names = [f"L{i}" for i in range(6)]
        suffix = []
        for n in reversed(names):
            if n not in share:
                break
            suffix.append(n)
        assert got == set(suffix)
