"""What vLLM's scheduler decides at admission and preemption: full-prompt
admission (``scheduler_reserve_full_isl``) and the priority policy.
"""

import numpy as np
import pytest

import jaxkv


def _plan(num_blocks=9, block_size=4, **kw):
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=block_size, **kw)
    return jaxkv.make_plan(cfg, num_blocks=num_blocks)


def _run(s, step, token=1):
    """Applies `step` with one sampled token per request."""
    return s.update(step, [token] * len(step.sampled))


def _nine_blocks(reserve_full):
    """vLLM's worked case: 9 blocks of 4 tokens (8 usable), a running request
    of 16 prompt tokens, then a 24-token prompt whose first chunk is 8 tokens.
    """  # noqa: D205
    s = jaxkv.Scheduler(
        _plan(), max_num_batched_tokens=9, scheduler_reserve_full_isl=reserve_full
    )
    a = jaxkv.Request("a", prompt=list(range(16)), max_new_tokens=8)
    s.add_request(a)
    _run(s, s.schedule())  # 9 prompt tokens
    _run(s, s.schedule())  # the other 7, first token sampled
    b = jaxkv.Request("b", prompt=list(range(24)), max_new_tokens=2)
    s.add_request(b)
    step = s.schedule()
    return s, a, b, step


def test_full_prompt_admission_refuses_a_prompt_the_free_blocks_cannot_hold():
    s, a, b, step = _nine_blocks(reserve_full=True)
    # a's decode takes its 5th block; b's 24 tokens need 6, 3 are free.
    assert [(r.req_id, n) for r, n in step.batch] == [("a", 1)]
    assert s.manager.num_free_blocks == 3
    assert b.wait_reason is not None
    assert "its 24 tokens (from token 0) do not fit the 3 free blocks" in b.wait_reason
    assert "scheduler_reserve_full_isl=True" in b.wait_reason
    # Nothing is preempted while a decodes; b is admitted when a finishes.
    while a.status is not jaxkv.RequestStatus.FINISHED:
        step = s.schedule()
        assert not step.preempted
        _run(s, step)
    step = s.schedule()
    assert [(r.req_id, n) for r, n in step.batch] == [("b", 9)]
    assert b.wait_reason is None
    assert s.stats["preemptions"] == 0


def test_first_chunk_admission_admits_then_preempts():
    s, a, b, step = _nine_blocks(reserve_full=False)
    assert [(r.req_id, n) for r, n in step.batch] == [("a", 1), ("b", 8)]
    _run(s, step)
    step = s.schedule()  # b's next chunk does not fit: b is preempted
    assert [r.req_id for r in step.preempted] == ["b"]
    assert b.num_preemptions == 1
    # ... and admitted again as soon as blocks free up, only to thrash.
    _run(s, step)
    assert ("b", 8) in [(r.req_id, n) for r, n in s.schedule().batch]


def test_full_prompt_admission_counts_the_prefix_hit_and_windows():
    # The nine-block case again, but b's first 16 tokens are a's prompt: a
    # prefix hit on blocks a holds.
    s = jaxkv.Scheduler(_plan(), max_num_batched_tokens=9, enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(16)), max_new_tokens=8)
    s.add_request(a)
    _run(s, s.schedule())
    _run(s, s.schedule())
    # b's prompt runs 4 tokens past this chunk: 3 blocks in all, 3 free.
    b = jaxkv.Request("b", prompt=list(range(16)) + [99] * 12, max_new_tokens=2)
    s.add_request(b)
    step = s.schedule()
    assert [(r.req_id, n) for r, n in step.batch] == [("a", 1), ("b", 8)]
    assert b.num_cached_tokens == 16
    assert b.wait_reason is None
    # A sliding-window layer holds at most window + chunk blocks per request:
    # a prompt of 50 blocks is admitted to a pool of 39.
    cfg = jaxkv.llama_like_config(
        num_layers=1, block_size=4, sliding_window=8, window_every=2
    )
    assert isinstance(cfg.layers[0].spec, jaxkv.SlidingWindowSpec)
    s = jaxkv.Scheduler(jaxkv.make_plan(cfg, num_blocks=40), max_num_batched_tokens=8)
    assert s.add_request(jaxkv.Request("long", prompt=[1] * 200, max_new_tokens=1))
    assert [n for _, n in s.schedule().batch] == [8]


def _priority(num_blocks=9, **kw):
    return jaxkv.Scheduler(_plan(num_blocks=num_blocks), policy="priority", **kw)


def test_priority_orders_the_waiting_queue_by_priority_then_arrival():
    s = _priority(num_blocks=64, max_num_batched_tokens=4, max_num_seqs=8)
    reqs = [
        jaxkv.Request(
            "low", prompt=[1] * 4, max_new_tokens=1, priority=5, arrival_time=1.0
        ),
        jaxkv.Request(
            "high-late", prompt=[2] * 4, max_new_tokens=1, priority=0, arrival_time=3.0
        ),
        jaxkv.Request(
            "high-early", prompt=[3] * 4, max_new_tokens=1, priority=0, arrival_time=2.0
        ),
        jaxkv.Request(
            "mid", prompt=[4] * 4, max_new_tokens=1, priority=1, arrival_time=0.0
        ),
    ]
    for r in reqs:
        s.add_request(r)
    assert [r.req_id for r in s.waiting] == ["high-early", "high-late", "mid", "low"]
    order = []
    while s.has_unfinished:
        step = s.schedule()
        order += [r.req_id for r, _ in step.batch]
        _run(s, step)
    assert order == ["high-early", "high-late", "mid", "low"]
    # FCFS serves them as they came.
    s = jaxkv.Scheduler(_plan(num_blocks=64), max_num_batched_tokens=4)
    for r in reqs:
        s.add_request(
            jaxkv.Request(
                r.req_id, prompt=r.prompt, max_new_tokens=1, priority=r.priority
            )
        )
    assert [r.req_id for r in s.waiting] == ["low", "high-late", "high-early", "mid"]


def _first_preemption(s):
    for _ in range(20):
        step = s.schedule()
        if step.preempted:
            return step
        _run(s, step)
    raise AssertionError("no preemption")


def test_priority_preempts_the_lowest_priority_first():
    # 8 usable blocks of 4 tokens; two prompts of 10 tokens (3 blocks each)
    # decode until the 16th token needs a block that is not free.
    s = _priority(max_num_batched_tokens=64)
    lazy = jaxkv.Request(
        "lazy", prompt=[2] * 10, max_new_tokens=10, priority=9, arrival_time=1.0
    )
    urgent = jaxkv.Request(
        "urgent", prompt=[1] * 10, max_new_tokens=10, priority=0, arrival_time=2.0
    )
    s.add_request(lazy)
    s.add_request(urgent)
    assert [r.req_id for r in s.waiting] == ["urgent", "lazy"]
    step = _first_preemption(s)
    assert [r.req_id for r in step.preempted] == ["lazy"]
    assert [r.req_id for r, _ in step.batch] == ["urgent"]
    # FCFS preempts the latest admitted, whatever its priority.
    s = jaxkv.Scheduler(_plan(), max_num_batched_tokens=64)
    s.add_request(
        jaxkv.Request("first", prompt=[2] * 10, max_new_tokens=10, priority=9)
    )
    s.add_request(jaxkv.Request("second", prompt=[1] * 10, max_new_tokens=10))
    assert [r.req_id for r in _first_preemption(s).preempted] == ["second"]


def test_priority_victim_already_in_the_batch_gives_its_tokens_back():
    # lazy (12-token prompt) runs first; urgent (14 tokens) takes the last 4
    # free blocks. At urgent's 17th token, lazy already has its decode token
    # in the step: it is taken out of the batch and its blocks go to urgent.
    s = _priority(max_num_batched_tokens=64)
    lazy = jaxkv.Request(
        "lazy", prompt=[2] * 12, max_new_tokens=10, priority=9, arrival_time=0.0
    )
    s.add_request(lazy)
    _run(s, s.schedule())
    urgent = jaxkv.Request(
        "urgent", prompt=[1] * 14, max_new_tokens=10, priority=0, arrival_time=1.0
    )
    s.add_request(urgent)
    step = _first_preemption(s)
    assert [r.req_id for r in step.preempted] == ["lazy"]
    assert [(r.req_id, n) for r, n in step.batch] == [("urgent", 1)]
    assert step.seq_lens.tolist() == [17]
    assert lazy.status is jaxkv.RequestStatus.WAITING
    assert lazy.num_computed == 0
    assert not s.manager.holds_blocks(lazy)
    _run(s, step)
    assert len(urgent.output) == 4  # the prefill's token and three decodes


def test_bad_policy_and_priority_fields_are_refused():
    with pytest.raises(ValueError, match="policy must be 'fcfs' or 'priority'"):
        jaxkv.Scheduler(_plan(), policy="lifo")
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        jaxkv.Scheduler(_plan(), num_lookahead_tokens=-1)
    with pytest.raises(ValueError, match="free_skipped_at must be 'allocate' or"):
        jaxkv.KVCacheManager(_plan(), free_skipped_at="later")
    s = _priority()
    bad = jaxkv.Request("a", prompt=[1], max_new_tokens=1)
    bad.priority = 1.5  # pyright: ignore[reportAttributeAccessIssue]
    assert not s.add_request(bad)
    assert s.rejected[-1].reject_reason == "priority must be an int, got 1.5"
    assert not s.add_request(
        jaxkv.Request("b", prompt=[1], max_new_tokens=1, arrival_time=float("nan"))
    )
    assert "arrival_time must be a finite number" in s.rejected[-1].reject_reason
    assert not s.waiting
    assert np.isfinite(jaxkv.Request("c", prompt=[1], max_new_tokens=1).arrival_time)
