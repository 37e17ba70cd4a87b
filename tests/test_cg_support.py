import pytest

import jaxkv
from tests.helpers import full_spec

S = jaxkv.vllm.AttentionCGSupport


def _group(name, support=S.ALWAYS, layers=None, bound=None, mismatch=None, ssm=False):
    backend = jaxkv.AttentionBackend(
        name=name,
        layout=jaxkv.KVCacheLayout.MAMBA if ssm else jaxkv.KVCacheLayout.BLOCKS_FIRST,
        cudagraph_support=support,
        varlen_cudagraph_max_query_len=bound,
        supports_query_lens_mismatch=mismatch,
    )
    return jaxkv.vllm.AttentionGroup(
        backend=backend,
        layer_names=tuple(layers or [name.lower()]),
        kv_cache_spec=full_spec(),
        kv_cache_group_id=0,
    )


def test_narrow_worked_example():
    info = jaxkv.vllm.AttentionCGSupportInfo()
    assert info == jaxkv.vllm.AttentionCGSupportInfo(S.ALWAYS, None)
    x = info.narrow(S.UNIFORM_BATCH, "X")
    assert x == jaxkv.vllm.AttentionCGSupportInfo(S.UNIFORM_BATCH, "X")
    assert x.narrow(S.UNIFORM_BATCH, "Y") is x
    assert x.narrow(S.ALWAYS, "Z") is x
    assert x.narrow(S.NEVER, None) == jaxkv.vllm.AttentionCGSupportInfo(S.NEVER, None)


def test_get_attn_cg_support_worked_example():
    groups = [
        [_group("A"), _group("B", S.UNIFORM_BATCH)],
        [
            _group("C", S.UNIFORM_SINGLE_TOKEN_DECODE),
            _group("D", S.UNIFORM_SINGLE_TOKEN_DECODE),
        ],
    ]
    assert jaxkv.vllm.get_attn_cg_support(groups) == jaxkv.vllm.AttentionCGSupportInfo(
        S.UNIFORM_SINGLE_TOKEN_DECODE, "C"
    )
    assert jaxkv.vllm.get_attn_cg_support([]) == jaxkv.vllm.AttentionCGSupportInfo()
    assert (
        jaxkv.vllm.get_attn_cg_support(groups, None, {"a", "b"}).min_cg_attn_backend
        == "B"
    )
    assert (
        jaxkv.vllm.get_attn_cg_support(groups, None, set())
        == jaxkv.vllm.AttentionCGSupportInfo()
    )


def test_query_lens_mismatch_worked_example():
    t = _group("T", layers=["target"])
    s = _group("S", layers=["mamba"], ssm=True)
    assert jaxkv.vllm.get_query_lens_mismatch_unsupported_backend([[t, s]]) == "S"
    assert (
        jaxkv.vllm.get_query_lens_mismatch_unsupported_backend([[t, s]], {"target"})
        is None
    )
    s2 = _group("S", layers=["mamba", "target"], ssm=True)
    assert (
        jaxkv.vllm.get_query_lens_mismatch_unsupported_backend([[t, s2]], {"target"})
        == "S"
    )
    assert jaxkv.vllm.get_query_lens_mismatch_unsupported_backend([]) is None


@pytest.mark.parametrize(
    ("max_query_len", "checked", "expected"),
    [(8, None, None), (9, None, ("_DraftBackend", 8)), (9, {"target"}, None)],
)
def test_varlen_worked_example(max_query_len, checked, expected):
    groups = [
        [
            _group("_TargetBackend", layers=["target"]),
            _group("_DraftBackend", S.UNIFORM_BATCH, layers=["draft"], bound=8),
        ]
    ]
    got = jaxkv.vllm.get_varlen_cudagraph_unsupported_backend(
        groups, None, max_query_len, checked
    )
    assert got == expected


def test_varlen_never_ignores_bound_and_none_bound_fails():
    never = [[_group("_DraftBackend", S.NEVER, bound=8)]]
    assert jaxkv.vllm.get_varlen_cudagraph_unsupported_backend(never, None, 1) == (
        "_DraftBackend",
        None,
    )
    unbounded = [[_group("U", S.UNIFORM_BATCH)]]
    assert jaxkv.vllm.get_varlen_cudagraph_unsupported_backend(unbounded, None, 1) == (
        "U",
        None,
    )
