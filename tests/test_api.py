"""The public surface: every exported name is documented with a runnable example,
and importing jaxkv compiles nothing."""

import inspect
import subprocess
import sys

import pytest

import jaxkv

# Plain data records and enums whose docstring describes fields, not calls.
NO_EXAMPLE = {
    "KVCacheSpec",
    "LayerView",
    "LayerKV",
    "HybridBlockAlignment",
    "BoundKVCaches",
    "KVCacheLayout",
    "CompileMode",
    "token_requests_and_positions",
    "planned_pools",
    "unpack_step",
    "pack_step",
    "shape_struct",
}


def test_every_public_name_has_a_docstring_with_an_example():
    missing = []
    for name in jaxkv.__all__:
        obj = getattr(jaxkv, name)
        doc = inspect.getdoc(obj) or ""
        if not doc:
            missing.append(f"{name}: no docstring")
        elif ">>>" not in doc and name not in NO_EXAMPLE and not inspect.ismodule(obj):
            missing.append(f"{name}: no example")
    assert not missing, missing


def test_all_is_sorted_and_complete():
    assert list(jaxkv.__all__) == sorted(jaxkv.__all__)
    for name in jaxkv.__all__:
        assert hasattr(jaxkv, name)


def test_import_compiles_nothing():
    code = (
        "import jax\n"
        "events = []\n"
        "jax.monitoring.register_event_duration_secs_listener("
        "lambda e, d, **k: events.append(e))\n"
        "import jaxkv\n"
        "print(len([e for e in events if 'compile' in e]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "0"


# Every name the seeds (vLLM's attn_utils and its documentation page) define.
SEED_NAMES = (
    "AttentionCGSupportInfo",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "_align_mixed_attention_kv_cache_views",
    "_kv_first_layers_sharing_pool_with_mamba",
    "bind_kv_caches",
    "compute_mm_prefix_ranges",
    "get_attn_cg_support",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_query_lens_mismatch_unsupported_backend",
    "get_varlen_cudagraph_unsupported_backend",
    "init_attn_backend",
)


def test_seed_names_live_in_jaxkv_vllm_only():
    import jaxkv.vllm

    for name in SEED_NAMES:
        assert name in jaxkv.vllm.__all__, name
        assert not hasattr(jaxkv, name), name
    ns: dict = {}
    exec("from jaxkv.vllm import init_attn_backend, bind_kv_caches", ns)
    assert ns["init_attn_backend"] is jaxkv.vllm.init_attn_backend
    with pytest.raises(ImportError, match="init_attn_backend"):
        exec("from jaxkv import init_attn_backend", ns)


SUB_PACKAGES = (
    "attention",
    "config",
    "groups",
    "kv",
    "plan",
    "sched",
    "serve",
    "step",
    "transfer",
    "vllm",
)


def test_the_plan_first_namespace_is_exactly_its_all():
    # About 60 names and the sub-packages; vLLM's names are not in it, no
    # module-level __getattr__ resolves others, and dir() holds nothing else
    # public.
    assert 50 <= len(jaxkv.__all__) <= 80, len(jaxkv.__all__)
    assert not set(SEED_NAMES) & set(jaxkv.__all__)
    assert not [n for n in jaxkv.__all__ if n.startswith("_")]
    assert set(SUB_PACKAGES) <= set(jaxkv.__all__)
    assert "__getattr__" not in vars(jaxkv)
    public = {n for n in dir(jaxkv) if not n.startswith("_")}
    assert public - {"demo", "pictures"} == set(jaxkv.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        jaxkv.no_such_name  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]
    for pkg in SUB_PACKAGES:
        mod = getattr(jaxkv, pkg)
        assert "__getattr__" not in vars(mod), pkg
        names = {n for n in dir(mod) if not n.startswith("_")}
        # A sub-package lists its API; its private modules are not in it.
        assert names <= set(mod.__all__), (pkg, names - set(mod.__all__))


def test_every_sub_package_name_has_a_docstring():
    import importlib

    missing = []
    for mod in SUB_PACKAGES:
        module = importlib.import_module(f"jaxkv.{mod}")
        assert list(module.__all__) == sorted(module.__all__), mod
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.getdoc(obj) or "") and not isinstance(
                obj, type(tuple[int])
            ):
                missing.append(f"jaxkv.{mod}.{name}")
    assert not missing, missing


def test_the_suite_checks_shapes_and_dtypes_at_run_time():
    # tests/conftest.py switches jaxtyping + beartype on for the annotated
    # modules: a call whose arrays disagree with the annotations is refused.
    import jax.numpy as jnp
    import jaxtyping

    ok = jaxkv.sample_tokens(
        jnp.zeros((3, 5)),
        params=jaxkv.SamplingParams(),
        request_seeds=jnp.zeros(3, jnp.int32),
        positions=jnp.zeros(3, jnp.int32),
    )
    assert ok.shape == (3,)
    with pytest.raises(jaxtyping.TypeCheckError, match="request_seeds"):
        jaxkv.sample_tokens(
            jnp.zeros((3, 5)),
            params=jaxkv.SamplingParams(),
            request_seeds=jnp.zeros(2, jnp.int32),
            positions=jnp.zeros(3, jnp.int32),
        )
    with pytest.raises(jaxtyping.TypeCheckError, match="positions"):
        jaxkv.sample_tokens(
            jnp.zeros((3, 5)),
            params=jaxkv.SamplingParams(),
            request_seeds=jnp.zeros(3, jnp.int32),
            positions=jnp.zeros(3, jnp.float32),
        )


def test_the_whole_package_is_type_checked_in_the_suite():
    # Not only the modules with array annotations: a plain annotation of a
    # host-side planning function is enforced too (tests/conftest.py).
    import jaxtyping

    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    assert jaxkv.vllm.hnc_shape(spec) == (1, 16, 64)  # K then V, 8 floats each
    with pytest.raises(jaxtyping.TypeCheckError, match="kernel_block_size"):
        jaxkv.vllm.hnc_shape(spec, kernel_block_size="16")  # pyright: ignore[reportArgumentType]
