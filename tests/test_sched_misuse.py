"""Bad requests, tokens and arguments at the scheduler's boundary: each is
rejected (with a reason) or refused (with an error naming it) where it enters,
never failing a later step, and a refused call changes nothing.
"""

import math
import re

import numpy as np
import pytest

import jaxkv
from jaxkv.sched._scheduler import MAX_REJECTED_KEPT
from tests.helpers import one_layer_config


def _plan():
    spec = jaxkv.FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float32"
    )
    cfg = one_layer_config(spec, max_model_len=64, max_num_seqs=4, tokens=32)
    return jaxkv.make_plan(cfg, num_blocks=32)


def _serve(s, good):
    for _ in range(100):
        if not s.has_unfinished:
            break
        step = s.schedule()
        s.update(step, [1] * len(step.sampled))
    assert all(r.status is jaxkv.RequestStatus.FINISHED for r in good)
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("prompt", [2**40], "in \\[0, 2147483648\\)"),
        ("prompt", [1.5, 2.0], "must be ints"),
        ("prompt", [True, False], "must be ints"),
        ("prompt", "abc", "flat sequence"),
        ("prompt", [[1, 2]], "flat sequence"),
        ("prompt", [], "empty prompt"),
        ("max_new_tokens", True, "max_new_tokens"),
        ("max_new_tokens", 2.0, "max_new_tokens"),
        ("stop_token_ids", 5, "stop_token_ids must be a sequence"),
        ("stop_token_ids", (1.5,), "stop_token_ids must be ints"),
        ("cache_salt", 123, "cache_salt must be a str"),
        ("cache_salt", b"x", "cache_salt must be a str"),
        ("output", [3], "output tokens"),
    ],
)
def test_a_bad_request_is_rejected_and_the_others_are_served(field, value, reason):
    s = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    good = [
        jaxkv.Request(f"g{i}", prompt=[1, 2, 3], max_new_tokens=2) for i in range(2)
    ]
    bad = jaxkv.Request("bad", prompt=[1, 2], max_new_tokens=2)
    setattr(bad, field, value)
    assert s.add_request(good[0])
    assert not s.add_request(bad)
    assert bad.status is jaxkv.RequestStatus.REJECTED
    assert bad.reject_reason is not None
    assert re.search(reason, bad.reject_reason), bad.reject_reason
    assert s.add_request(good[1])
    _serve(s, good)


@pytest.mark.parametrize(
    "prompt", [(5, 6, 7), np.array([5, 6, 7]), np.array([5, 6, 7], np.int64)]
)
def test_tuple_and_numpy_prompts_serve_like_lists(prompt):
    s = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    r = jaxkv.Request("r", prompt=prompt, max_new_tokens=2, stop_token_ids=[9])  # type: ignore[arg-type]
    assert s.add_request(r)
    assert r.prompt == [5, 6, 7]
    assert r.stop_token_ids == (9,)
    _serve(s, [r])
    assert r.output == [1, 1]


def test_unhashable_ids_and_non_requests_are_refused():
    s = jaxkv.Scheduler(_plan())
    with pytest.raises(TypeError, match="req_id must be hashable"):
        s.add_request(jaxkv.Request(["x"], prompt=[1], max_new_tokens=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a jaxkv.Request"):
        s.add_request("r")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"max_num_batched_tokens": 0},
            ValueError,
            "max_num_batched_tokens must be positive",
        ),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be positive"),
        ({"max_num_seqs": -1}, ValueError, "max_num_seqs"),
        (
            {"max_num_batched_tokens": 1.5},
            TypeError,
            "max_num_batched_tokens must be an int",
        ),
        ({"vocab_size": 0}, ValueError, "vocab_size must be positive"),
        ({"vocab_size": True}, TypeError, "vocab_size must be an int"),
    ],
)
def test_scheduler_limits_are_checked_not_defaulted(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxkv.Scheduler(_plan(), **kwargs)


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ([math.nan, 1], TypeError, "sampled tokens must hold integer ids"),
        ([1.0, 1], TypeError, "sampled tokens must hold integer ids"),
        ([True, False], TypeError, "sampled tokens must hold integer ids"),
        ([-1, 1], ValueError, "'a' sampled token -1"),
        ([1, 10**12], ValueError, "'b' sampled token 1000000000000"),
        ([1, 100], ValueError, "outside \\[0, 100\\)"),
        ([1], ValueError, "2 requests sample a token"),
        ([1, 2, 3], ValueError, "2 requests sample a token .* got 3 tokens"),
    ],
)
def test_a_bad_sampled_token_changes_nothing(tokens, error, match):
    s = jaxkv.Scheduler(_plan(), vocab_size=100)
    a = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3)
    b = jaxkv.Request("b", prompt=[4, 5], max_new_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    before = (a.num_computed, b.num_computed, list(a.output), s.manager.num_free_blocks)
    with pytest.raises(error, match=match):
        s.update(step, tokens)
    assert (
        a.num_computed,
        b.num_computed,
        a.output,
        s.manager.num_free_blocks,
    ) == before
    s.update(step, [7, 8])  # the same step, with good tokens, still applies
    assert (a.output, b.output) == ([7], [8])
    _serve(s, [a, b])


def test_a_step_is_applied_once_and_in_order():
    s = jaxkv.Scheduler(_plan())
    a = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3)
    s.add_request(a)
    step = s.schedule()
    s.update(step, [7])
    with pytest.raises(ValueError, match="already applied"):
        s.update(step, [7])  # a retry would advance the request twice
    assert (a.num_computed, a.output) == (3, [7])
    first = s.schedule()
    s.schedule()
    with pytest.raises(ValueError, match="not the one schedule\\(\\) returned last"):
        s.update(first, [7])


def test_rejected_requests_are_bounded():
    s = jaxkv.Scheduler(_plan())
    n = MAX_REJECTED_KEPT + 10
    for i in range(n):
        s.add_request(jaxkv.Request(f"x{i}", prompt=[], max_new_tokens=1))
    assert len(s.rejected) == MAX_REJECTED_KEPT
    assert s.rejected[-1].req_id == f"x{n - 1}"
    assert s.stats["rejected"] == n


def test_a_request_aborted_between_schedule_and_update_is_skipped():
    s = jaxkv.Scheduler(_plan())
    a = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3)
    b = jaxkv.Request("b", prompt=[4, 5], max_new_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    s.finish(a)  # aborted while its step runs
    assert s.update(step, [7, 8]) == []
    assert (a.output, b.output) == ([], [8])
    _serve(s, [b])


def test_an_update_that_fails_midway_is_finished_by_applying_it_again():
    s = jaxkv.Scheduler(_plan())
    reqs = [jaxkv.Request(n, prompt=[1, 2, 3], max_new_tokens=2) for n in "abc"]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()
    real, calls = s.manager.commit, []

    def commit(req):
        calls.append(req.req_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(req)

    s.manager.commit = commit
    with pytest.raises(KeyboardInterrupt):
        s.update(step, [7, 8, 9])
    with pytest.raises(RuntimeError, match="raised midway"):
        s.schedule()
    s.update(step, [7, 8, 9])  # finishes the step; nothing applied twice
    assert [(r.num_computed, r.output) for r in reqs] == [
        (3, [7]),
        (3, [8]),
        (3, [9]),
    ]
    s.manager.commit = real
    _serve(s, reqs)


def test_an_update_that_fails_while_finishing_requests_is_finished_by_a_retry():
    # The fault comes after the step was advanced (its tokens counted), while
    # its tokens are filled in and finished requests freed: the retry neither
    # advances it twice nor skips the request whose finishing failed.
    s = jaxkv.Scheduler(_plan())
    reqs = [
        jaxkv.Request(n, prompt=[1, 2, 3], max_new_tokens=4, stop_token_ids=(9,))
        for n in "abc"
    ]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()
    real, calls = s.manager.free, []

    def free(req):
        calls.append(req.req_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(req)

    s.manager.free = free
    with pytest.raises(KeyboardInterrupt):
        s.update(step, [9, 5, 9])  # a and c stop
    with pytest.raises(RuntimeError, match="raised midway"):
        s.schedule()
    assert s.update(step, [9, 5, 9]) == [reqs[0], reqs[2]]
    s.manager.free = real
    assert s.unresolved == ()
    assert [(r.num_computed, r.output, r.status.value) for r in reqs] == [
        (3, [9], "finished"),
        (3, [5], "running"),
        (3, [9], "finished"),
    ]
    _serve(s, reqs)
    assert reqs[1].output == [5, 1, 1, 1]


def test_recompute_all_requeues_running_requests_and_empties_the_cache():
    s = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(20)), max_new_tokens=3)
    s.add_request(a)
    s.update(s.schedule(), [7])
    step = s.schedule()
    assert s.manager.allocator.num_cached > 0
    assert s.recompute_all() == [a]
    assert (a.num_computed, a.output, a.status) == (0, [7], jaxkv.RequestStatus.WAITING)
    assert s.manager.allocator.num_cached == 0
    with pytest.raises(ValueError, match="not the one schedule"):
        s.update(step, [1])
    _serve(s, [a])
    assert a.output == [7, 1, 1]
