import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from tests.helpers import count_compiles, examples

PIECEWISE = jaxkv.vllm.BatchDescriptor(
    num_tokens=16, num_reqs=3, cg_mode=jaxkv.vllm.CompileMode.PIECEWISE
)


def _helper(buckets=(1, 2, 4, 8, 16), max_num_tokens=16):
    d = jaxkv.BucketDispatcher(
        token_buckets=buckets, max_num_tokens=max_num_tokens, max_num_reqs=16
    )
    d.mark_ready()
    return jaxkv.vllm.FastPrefillHelper(d, max_num_tokens)


def test_worked_example():
    helper = _helper()
    m = helper.prepare(np.array([3, 7, 12]), 3, np.array([0, 1, 2, 3]), True, PIECEWISE)
    assert m is not None
    assert m.logits_indices_padded.tolist() == [3, 7, 12, 12]
    assert int(m.num_logits_indices) == 3
    assert int(m.max_logits_per_req) == 1
    # A dispatcher that pads 3 to 8.
    helper8 = _helper(buckets=(8, 16))
    m = helper8.prepare(
        np.array([3, 7, 12]), 3, np.array([0, 1, 2, 3]), True, PIECEWISE
    )
    assert m is not None
    assert m.logits_indices_padded.tolist() == [3, 7, 12, 12, 12, 12, 12, 12]
    # The whole buffer tail holds the last index (I7).
    assert helper8.buffer.tolist() == [3, 7, 12] + [12] * 13


def test_arming_rules():
    helper = _helper()
    args = (np.array([3]), 1, np.array([0, 1]))
    assert helper.prepare(*args, False, PIECEWISE) is None
    full = jaxkv.vllm.BatchDescriptor(
        num_tokens=4, num_reqs=1, cg_mode=jaxkv.vllm.CompileMode.FULL
    )
    assert helper.prepare(*args, True, full) is None
    ubatched = jaxkv.vllm.BatchDescriptor(
        num_tokens=4,
        num_reqs=1,
        num_ubatches=2,
        cg_mode=jaxkv.vllm.CompileMode.PIECEWISE,
    )
    assert helper.prepare(*args, True, ubatched) is None
    assert helper.prepare(*args, True, PIECEWISE) is not None


def test_before_warm_up_and_above_largest_no_padding_and_cap():
    d = jaxkv.BucketDispatcher(token_buckets=(4,), max_num_tokens=16, max_num_reqs=16)
    helper = jaxkv.vllm.FastPrefillHelper(d, 16)  # dispatcher not ready: padded = n
    m = helper.prepare(np.array([1, 2, 5]), 2, np.array([0, 1, 3]), True, PIECEWISE)
    assert m is not None
    assert m.logits_indices_padded.tolist() == [1, 2, 5]
    assert int(m.max_logits_per_req) == 2
    d.mark_ready()
    m = helper.prepare(np.arange(6), 6, np.arange(7), True, PIECEWISE)  # above 4
    assert m is not None
    assert m.logits_indices_padded.shape == (6,)


def test_max_logits_counts_zero_logit_requests():
    m = _helper().prepare(
        np.array([4, 5, 9]), 4, np.array([0, 0, 2, 2, 3]), True, PIECEWISE
    )
    assert m is not None
    assert m.max_logits_per_req_cpu == 2


def test_an_exactly_full_staging_buffer_is_accepted():
    # 16 logits indices in a buffer of 16: the largest batch fits.
    m = _helper().prepare(np.arange(16), 16, np.arange(17), True, PIECEWISE)
    assert m is not None
    assert m.logits_indices_padded.tolist() == list(range(16))
    assert m.num_logits_indices_cpu == 16


def test_bad_input():
    helper = _helper()
    with pytest.raises(ValueError, match="empty"):
        helper.prepare(np.array([], np.int32), 1, np.array([0, 0]), True, PIECEWISE)
    with pytest.raises(ValueError, match="17 logits indices exceed"):
        helper.prepare(np.arange(17), 1, np.array([0, 17]), True, PIECEWISE)
    with pytest.raises(ValueError, match="host"):
        helper.prepare(jnp.arange(3), 1, np.array([0, 3]), True, PIECEWISE)  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        ValueError, match="strictly ascending; logits_indices\\[2\\] = 3"
    ):
        jaxkv.step.validate_logits_indices(np.array([1, 4, 3]), np.array([0, 8]))
    with pytest.raises(ValueError, match="outside the batch"):
        jaxkv.step.validate_logits_indices(np.array([-1]), np.array([0, 8]))
    with pytest.raises(ValueError, match="exceed the staging buffer of 2"):
        jaxkv.step.validate_logits_indices(
            np.array([0, 1, 2]), np.array([0, 8]), buffer_size=2
        )
    with pytest.raises(ValueError, match="must start at 0"):
        jaxkv.step.validate_query_start_loc(np.array([1, 4]))


def test_staging_never_writes_outside_and_clamps():
    buf = jnp.zeros(8, jnp.int32)
    buf, out = jaxkv.step.stage_logits_indices(
        buf, jnp.array([5, 6, 7, 9], jnp.int32), jnp.int32(99)
    )
    assert out.tolist() == [5, 6, 7, 9]
    assert buf.tolist() == [5, 6, 7, 9, 9, 9, 9, 9]
    buf, out = jaxkv.step.stage_logits_indices(
        buf, jnp.array([5, 6], jnp.int32), jnp.int32(0)
    )
    assert out.tolist() == [5, 5]
    with pytest.raises(ValueError, match="exceeds the staging buffer"):
        jaxkv.step.stage_logits_indices(buf, jnp.zeros(9, jnp.int32), jnp.int32(1))


def _loop_reference(buffer_len, indices, n):
    out = []
    for i in range(buffer_len):
        out.append(indices[i] if i < n else indices[n - 1])
    return out


@settings(max_examples=examples(100), deadline=None)
@given(data=st.data())
def test_staging_matches_loop_reference(data):
    padded = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = data.draw(st.integers(1, padded))
    real = sorted(
        data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n, unique=True))
    )
    idx = np.full(padded, -1, np.int32)  # sentinel padding
    idx[:n] = real
    buf = jnp.asarray(np.random.default_rng(n).integers(0, 9, 16), jnp.int32)  # stale
    buf, out = jaxkv.step.stage_logits_indices(buf, idx, np.int32(n))
    want = _loop_reference(16, real, n)
    np.testing.assert_array_equal(buf, want)
    np.testing.assert_array_equal(out, want[:padded])


def test_prepare_does_not_sync_or_retrace_after_warm_up():
    helper = _helper()
    helper.warm_up()
    cu = np.array([0, 1, 2, 3])
    helper.prepare(np.array([1, 2, 3]), 3, cu, True, PIECEWISE)
    with count_compiles() as compiles, jax.transfer_guard_device_to_host("disallow"):
        for idx in ([0, 5, 9], [2, 3, 4], [1, 8, 15]):
            helper.prepare(np.array(idx), 3, cu, True, PIECEWISE)
        helper.prepare(np.arange(9), 3, np.array([0, 3, 6, 9]), True, PIECEWISE)
    assert compiles == []


def test_buffer_is_donated():
    helper = _helper()
    old = helper.buffer
    helper.prepare(np.array([1]), 1, np.array([0, 1]), True, PIECEWISE)
    assert old.is_deleted()
