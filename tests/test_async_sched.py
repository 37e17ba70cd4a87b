"""Async scheduling (:meth:`Scheduler.advance` / :meth:`Scheduler.resolve`):
the next step is scheduled before this one's tokens are known. Driven against
the synchronous ``update()`` with a deterministic stand-in for the model (the
token sampled after position p of request r is a function of r and p): the
same outputs, stop tokens a step late with the extra work dropped, blocks all
returned, and no prefix-cache key ever hashed from a placeholder.
"""  # noqa: D205

import hashlib

import numpy as np
import pytest

import jaxkv

VOCAB = 50


def _token(req, position):
    """The 'model': the token after `position` tokens of `req` (deterministic)."""
    digest = hashlib.sha256(f"{req.req_id}:{position}".encode()).digest()
    return digest[0] % VOCAB


def _requests(n=12, seed=0, stops=(3, 7)):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 40).tolist()
    return [
        jaxkv.Request(
            f"r{i}",
            prompt=(shared if i % 2 else [])
            + rng.integers(0, VOCAB, 5 + 9 * i).tolist(),
            max_new_tokens=int(rng.integers(1, 30)),
            stop_token_ids=stops,
        )
        for i in range(n)
    ]


def _scheduler(prefix=True, num_blocks=40, **kw):
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=num_blocks)
    return jaxkv.Scheduler(
        plan,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        vocab_size=VOCAB,
        **kw,
    )


def _sampled(step):
    return [
        _token(r, c + n)
        for (r, n), (c, _) in zip(step.batch, step.scheduled_counts, strict=True)
        if c + n == len(r.prompt) + _
    ]


def _serve_sync(s, requests):
    for r in requests:
        s.add_request(r)
    while s.has_unfinished:
        step = s.schedule()
        s.update(step, _sampled(step))


def _serve_async(s, requests, *, check_keys=None):
    for r in requests:
        s.add_request(r)
    pending: list = []
    while s.has_unfinished or pending:
        step = s.schedule()
        if step.batch:
            # The 'device' sees real tokens: a placeholder is the previous
            # step's sampled token (what the loop's program substitutes).
            prev = pending[-1][1] if pending else []
            for t in step.token_ids:
                assert t >= 0 or -t - 1 < len(prev)
            s.advance(step)
            pending.append((step, _sampled(step)))
        while len(pending) > (1 if step.batch else 0):
            old, tokens = pending.pop(0)
            s.resolve(old, tokens)
        if check_keys is not None:
            check_keys(s)


def _valid_keys(requests, block_size=32):
    keys = set()
    for r in requests:
        hashes = jaxkv.sched.hash_token_blocks(r.tokens, block_size, salt=r.cache_salt)
        keys |= set(hashes)
    return keys


@pytest.mark.parametrize(
    "kw",
    [{"prefix": False}, {"prefix": True}, {"prefix": True, "num_blocks": 14}],
    ids=["plain", "prefix", "preempt"],
)
def test_async_outputs_equal_sync_and_hash_only_known_tokens(kw):
    sync, ahead = _requests(), _requests()
    s1, s2 = _scheduler(**kw), _scheduler(**kw)
    _serve_sync(s1, sync)
    final = {r.req_id: r for r in sync}
    valid = _valid_keys(sync)
    seen_keys = set()

    def check_keys(s):
        m = s.manager
        for b in range(1, m.allocator.num_blocks):
            key = m.allocator.key_of(b)
            if key is not None:
                seen_keys.add(key[1])

    _serve_async(s2, ahead, check_keys=check_keys)
    assert [r.output for r in ahead] == [r.output for r in sync]
    assert any(len(r.output) < r.max_new_tokens for r in sync)  # stop tokens hit
    assert all(r.num_pending == 0 and r.status.value == "finished" for r in ahead)
    for s in (s1, s2):
        assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    assert seen_keys <= valid  # never a hash of a placeholder
    # Tokens filled in after a request finished (at max_new_tokens) count.
    gen = [s.make_stats().num_generation_tokens for s in (s1, s2)]
    assert gen[0] == gen[1] == sum(len(r.output) for r in sync)
    if kw.get("prefix"):
        assert seen_keys
        assert s2.stats["cached_tokens"] > 0
    if "num_blocks" in kw:
        assert s2.stats["preemptions"] > 0
    assert final  # the sync run is the reference


def test_a_stop_token_found_late_drops_the_step_computed_after_it():
    s = _scheduler(prefix=False)
    r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=10, stop_token_ids=(9,))
    s.add_request(r)
    first = s.schedule()
    s.advance(first)
    second = s.schedule()  # decodes the placeholder of `first`
    assert np.asarray(second.token_ids).tolist() == [-1]
    s.advance(second)
    assert (r.output, r.num_pending) == ([-1, -1], 2)
    assert s.resolve(first, [9]) == [r]  # a stop: complete now
    assert (r.output, r.num_pending, r.status.value) == ([9], 0, "finished")
    assert s.resolve(second, [4]) == []  # its token is dropped
    assert r.output == [9]
    assert second.filled == []
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    assert not s.has_unfinished


def test_a_request_at_max_new_tokens_frees_its_blocks_before_its_token_is_read():
    s = _scheduler(prefix=False)
    r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=1)
    s.add_request(r)
    step = s.schedule()
    s.advance(step)
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    assert not s.has_unfinished
    assert r.status.value == "finished"
    assert r.output == [-1]
    assert s.resolve(step, [5]) == [r]
    assert r.output == [5]


def test_abort_and_recompute_drop_placeholders():
    s = _scheduler(prefix=False)
    a = jaxkv.Request("a", prompt=[1, 2], max_new_tokens=5)
    b = jaxkv.Request("b", prompt=[3, 4], max_new_tokens=1)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    s.advance(step)
    assert (a.output, b.output, b.status.value) == ([-1], [-2], "finished")
    requeued = s.recompute_all()  # the device lost the step: b is served again
    assert {r.req_id for r in requeued} == {"a", "b"}
    assert (a.output, b.output, a.num_pending, b.num_pending) == ([], [], 0, 0)
    step = s.schedule()
    s.advance(step)
    s.finish(a)  # an abort with a token in flight
    assert a.output == []
    assert a.num_pending == 0
    done = s.resolve(step, [7, 8])
    assert done == [b]
    assert b.output == [8]
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def test_steps_are_advanced_and_resolved_in_order():
    s = _scheduler(prefix=False)
    s.add_request(jaxkv.Request("a", prompt=[1, 2], max_new_tokens=5))
    first = s.schedule()
    with pytest.raises(ValueError, match="not the oldest advanced"):
        s.resolve(first, [1])
    s.advance(first)
    with pytest.raises(ValueError, match="already applied"):
        s.advance(first)
    second = s.schedule()
    s.advance(second)
    with pytest.raises(ValueError, match="not the oldest advanced"):
        s.resolve(second, [1])
    with pytest.raises(RuntimeError, match="not resolved"):
        s.update(s.schedule(), [1])
    with pytest.raises(ValueError, match=r"sampled token 50, outside \[0, 50\)"):
        s.resolve(first, [50])
    assert s.running[0].output == [-1, -1]  # unchanged by the refusal
    assert s.resolve(first, [1]) == []
    assert s.resolve(second, [2]) == []
    assert s.running[0].output == [1, 2]


def _state(s):
    """What applying a step changes: requests, blocks held, counters.

    Block ids are left out: advance() frees a request at ``max_new_tokens``
    at once and update() with the step's other finished requests, so the
    free queue's order may differ.
    """
    m = s.manager
    reqs = sorted([*s.running, *s.waiting], key=lambda r: r.req_id)
    return (
        [(r.req_id, r.num_computed, list(r.output), r.status) for r in reqs],
        [[len(t) for t in m.blocks_of(r)] for r in reqs],
        m.num_free_blocks,
        m.allocator.num_cached,
        dict(s.stats),
        s.make_stats(),
    )


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_update_is_advance_then_resolve_byte_for_byte(decode_steps):
    """``update(step, tokens)`` and ``advance(step)`` then ``resolve(step,
    tokens)`` leave the same requests, blocks held, cache and counters after
    every step (stop tokens, max_new_tokens, preemption and multi-step
    decodes included).
    """  # noqa: D205
    runs = []
    for way in ("update", "advance"):
        s, reqs = _scheduler(num_blocks=14), _requests(n=8, seed=4)
        for r in reqs:
            s.add_request(r)
        states = []
        while s.has_unfinished:
            step = s.schedule_decode(decode_steps) if decode_steps > 1 else None
            if step is not None:
                tokens = [
                    [_token(r, c + 1 + i) for i in range(int(k))]
                    for (r, _), (c, _), k in zip(
                        step.batch,
                        step.scheduled_counts,
                        np.asarray(step.steps_per_request),
                        strict=True,
                    )
                ]
            else:
                step = s.schedule()
                tokens = _sampled(step)
            if way == "update":
                done = s.update(step, tokens)
            else:
                s.advance(step)
                done = s.resolve(step, tokens)
            states.append(([r.req_id for r in done], _state(s)))
        runs.append(states)
    assert runs[0] == runs[1]
    assert any(r for r, _ in runs[0])


def test_recompute_all_counts_a_revived_request_s_tokens_once():
    # A request finished at max_new_tokens before its last token was read is
    # served again by recompute_all(); its known tokens stay counted once.
    s = _scheduler(prefix=False)
    a = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)
    b = jaxkv.Request("b", prompt=[4, 5, 6], max_new_tokens=9)
    for r in (a, b):
        s.add_request(r)
    first = s.schedule()
    s.advance(first)
    s.resolve(first, [7, 8])
    second = s.schedule()
    s.advance(second)  # a reaches max_new_tokens: finished, a token pending
    assert a.status is jaxkv.RequestStatus.FINISHED
    assert a.num_pending == 1
    before = s.make_stats().num_generation_tokens
    assert before == 2  # the tokens known: a's 7 and b's 8
    s.recompute_all()
    assert s.make_stats().num_generation_tokens == before
    while s.has_unfinished:
        step = s.schedule()
        s.update(step, [1] * len(step.sampled))
    assert s.make_stats().num_generation_tokens == len(a.output) + len(b.output)
