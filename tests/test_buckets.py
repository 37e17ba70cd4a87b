import gc

import jax
import jax.numpy as jnp
import pytest

import jaxkv
from tests.helpers import count_compiles

S = jaxkv.vllm.AttentionCGSupport


def _dispatcher(**kw):
    d = jaxkv.BucketDispatcher(
        token_buckets=(1, 2, 4, 8, 16), max_num_tokens=16, max_num_reqs=8, **kw
    )
    d.mark_ready()
    return d


def test_smallest_bucket_and_no_padding_above_largest():
    d = _dispatcher()
    assert d.dispatch(num_reqs=3, num_tokens=5).num_tokens == 8
    assert d.dispatch(num_reqs=1, num_tokens=16).num_tokens == 16
    above = d.dispatch(num_reqs=1, num_tokens=17)
    assert (above.num_tokens, above.cg_mode) == (17, jaxkv.vllm.CompileMode.NONE)
    cold = jaxkv.BucketDispatcher(token_buckets=(8,), max_num_tokens=8, max_num_reqs=8)
    assert (
        cold.dispatch(num_reqs=1, num_tokens=3).cg_mode == jaxkv.vllm.CompileMode.NONE
    )


def test_request_padding():
    d = _dispatcher(request_buckets=(2, 4))
    assert d.dispatch(num_reqs=3, num_tokens=3).num_reqs == 4
    assert d.dispatch(num_reqs=5, num_tokens=5).cg_mode == jaxkv.vllm.CompileMode.NONE
    assert _dispatcher().dispatch(num_reqs=3, num_tokens=5).num_reqs == 8


@pytest.mark.parametrize(
    ("support", "uniform", "mode"),
    [
        (S.ALWAYS, None, "FULL"),
        (S.UNIFORM_BATCH, None, "PIECEWISE"),
        (S.UNIFORM_BATCH, 2, "FULL"),
        (S.UNIFORM_SINGLE_TOKEN_DECODE, 2, "PIECEWISE"),
        (S.UNIFORM_SINGLE_TOKEN_DECODE, 1, "FULL"),
        (S.NEVER, 1, "PIECEWISE"),
    ],
)
def test_mode_follows_support(support, uniform, mode):
    d = _dispatcher(cg_support=support)
    assert (
        d.dispatch(num_reqs=2, num_tokens=2, uniform_token_count=uniform).cg_mode.name
        == mode
    )


def test_check_and_bad_buckets():
    d = _dispatcher()
    d.check(num_reqs=8, num_tokens=16)
    with pytest.raises(
        ValueError, match="9 requests exceeds the largest request bucket"
    ):
        d.check(num_reqs=9, num_tokens=16)
    with pytest.raises(ValueError, match="strictly ascending"):
        jaxkv.BucketDispatcher(token_buckets=(4, 2), max_num_tokens=8, max_num_reqs=2)


def test_programs_compile_every_bucket_from_shapes_without_allocating():
    d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=8, max_num_reqs=4)
    progs = jaxkv.Programs(lambda x, y: x.sum() + y.sum())
    gc.collect()  # earlier tests' garbage must not be freed mid-count
    live = len(jax.live_arrays())
    for desc in d.executables():
        progs.compile(
            (desc.num_tokens, desc.num_reqs),
            jaxkv.step.shape_struct((desc.num_tokens,), jnp.int32),
            jaxkv.step.shape_struct((desc.num_reqs,), jnp.int32),
        )
    assert len(jax.live_arrays()) <= live
    # FULL and PIECEWISE buckets of equal sizes are one program.
    assert len(progs) == len({(e.num_tokens, e.num_reqs) for e in d.executables()})
    x = jax.device_put(jnp.ones(4, jnp.int32))
    with count_compiles() as compiles:
        out = progs((4, 4), x, x)
    assert int(out) == 8
    assert compiles == []


def test_sampled_tokens_are_padded_only_up_to_the_request_capacity():
    # 4 requests sample at most 4 tokens: one sample padding (4) per token
    # bucket, 3 programs (6 if paddings went up to the token capacity).
    cfg = jaxkv.tiny_hybrid_config(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=(4, 16, 64),
        request_buckets=(4,),
        kv_sharing_fast_prefill=False,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=16)
    inputs = jaxkv.StepMetadataBuilder(plan, model_inputs=True).abstract_inputs()
    assert sorted((x.capacity.max_tokens, x.capacity.num_samples) for x in inputs) == [
        (4, 4),
        (16, 4),
        (64, 4),
    ]
