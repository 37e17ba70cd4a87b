"""Multi-step decoding: ``Scheduler.schedule_decode`` / ``update`` and
``ServingLoop(decode_steps=K)`` give the tokens, logits and streams of one
step at a time, on the sliding-window + global model of test_serve_loop.
"""  # noqa: D205

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_serve_loop import VOCAB, _model, _params, _requests

import jaxkv
from tests.helpers import reset_loop


@pytest.fixture(scope="module")
def model():
    plan, forward, windows = _model()
    return plan, forward, _params(len(windows))


def _loop(model, *, scheduling=None, **execution):
    """A warmed-up loop over the module's model, recording logits."""
    plan, forward, params = model
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=VOCAB,
        scheduling=scheduling,
        execution=jaxkv.ExecutionOptions(record_logits=True, **execution),
    )
    loop.warm_up()
    return loop


def _serve(model, *, decode_steps, overlap, stops=(), num_blocks=None, **scheduling):
    loop = _loop(
        model,
        overlap=overlap,
        decode_steps=decode_steps,
        scheduling=jaxkv.SchedulingOptions(**scheduling),
    )
    if num_blocks is not None:  # a smaller pool: preemption
        loop.reset(num_blocks=num_blocks)
    seen: dict[str, list[int]] = {}
    outs = []
    with jaxkv.count_compilations() as compiles:
        for seed in (3, 4):  # twice: the second run hits the first's prefixes
            reqs = _requests(shared=16, seed=seed, new=11)
            for r in reqs:
                r.stop_token_ids = stops
            loop.run(
                reqs, on_token=lambda r, t: seen.setdefault(r.req_id, []).append(t)
            )
            outs += [list(r.output) for r in reqs]
            assert seen == {r.req_id: r.output for r in reqs}
            seen.clear()
    m = loop.scheduler.manager
    assert m.num_free_blocks == m.num_usable_blocks
    logits = {k: np.stack(v) for k, v in loop.logits.items()}
    return outs, logits, loop, len(compiles)


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_step_equals_one_step_at_a_time(model, overlap):
    base, base_logits, _, _ = _serve(model, decode_steps=1, overlap=False)
    stops = tuple({o[4] for o in base})  # stop tokens hit mid-run
    base, base_logits, _, _ = _serve(
        model, decode_steps=1, overlap=False, stops=stops, enable_prefix_caching=True
    )
    assert any(len(o) < 11 for o in base)
    outs, logits, loop, compiles = _serve(
        model,
        decode_steps=4,
        overlap=overlap,
        stops=stops,
        enable_prefix_caching=True,
    )
    assert outs == base
    assert logits.keys() == base_logits.keys()
    for k in logits:
        np.testing.assert_allclose(logits[k], base_logits[k], atol=1e-5)
    assert compiles == 0
    assert loop.counters["decode_iterations"] > 0
    assert loop.scheduler.stats["cached_tokens"] > 0


def test_multi_step_under_preemption_equals_one_step_at_a_time(model):
    base, _, _, _ = _serve(model, decode_steps=1, overlap=True, num_blocks=14)
    outs, _, loop, _ = _serve(model, decode_steps=3, overlap=True, num_blocks=14)
    assert outs == base
    assert loop.scheduler.stats["preemptions"] > 0
    assert loop.counters["decode_iterations"] > 0


def _decoding_scheduler(**kw):
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=32)
    s = jaxkv.Scheduler(plan, **kw)
    for i, new in enumerate((6, 3)):
        s.add_request(jaxkv.Request(f"r{i}", prompt=[7, 8, 9, i], max_new_tokens=new))
    s.update(s.schedule(), [5, 5])
    return s


def test_schedule_decode_allocates_ahead_and_update_stops():
    s = _decoding_scheduler()
    step = s.schedule_decode(4)
    assert step is not None
    assert step.steps_per_request is not None
    assert step.step_slots is not None
    assert step.steps_per_request.tolist() == [4, 2]  # r1 has 2 tokens left
    assert step.positions.tolist() == [4, 4]
    for slots in step.step_slots:  # iterations past a request's count: -1
        assert slots.shape == (4, 2)
    attn = [g for g, m in enumerate(s.manager.is_mamba) if not m]
    for g in attn:
        assert (step.step_slots[g][2:, 1] == -1).all()
        assert (step.step_slots[g][:, 0] >= 0).all()
        bs = s.manager.block_sizes[g]
        table = step.block_tables[g][0]
        want = [table[p // bs] * bs + p % bs for p in range(4, 8)]
        assert step.step_slots[g][:, 0].tolist() == want
    with pytest.raises(ValueError, match="request 'r0' sampled 4 tokens this step"):
        s.update(step, [1, 1])  # one token per request: a single step's shape
    with pytest.raises(ValueError, match="request 'r0' sampled 4 tokens"):
        s.update(step, [[1], [2, 3]])
    with pytest.raises(ValueError, match="outside"):
        s.update(step, [[1, 2, 3, 4], [2, -3]])
    s.running[0].stop_token_ids = (2,)
    done = s.update(step, [[1, 2, 3, 4], [6, 6, 6, 6]])
    assert [r.req_id for r in done] == ["r0", "r1"]
    assert [r.output for r in done] == [[5, 1, 2], [5, 6, 6]]
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    with pytest.raises(ValueError, match="already applied"):
        s.update(step, [[1, 2, 3, 4], [6, 6, 6, 6]])


def test_schedule_decode_declines_unless_steadily_decoding():
    s = _decoding_scheduler()
    s.add_request(jaxkv.Request("w", prompt=[1, 2], max_new_tokens=2))
    assert s.schedule_decode(4) is None  # a request waits
    s = _decoding_scheduler()
    s.advance(s.schedule())  # a token still on the device
    assert s.schedule_decode(4) is None
    with pytest.raises(ValueError, match="num_steps"):
        _decoding_scheduler().schedule_decode(0)


def test_decode_steps_is_checked(model):
    plan, forward, params = model
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="decode_steps"):
            jaxkv.ServingLoop(
                plan,
                forward,
                params,
                execution=jaxkv.ExecutionOptions(
                    decode_steps=bad  # pyright: ignore[reportArgumentType]
                ),
            )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fault_while_applying_a_multi_step_decode_resumes_to_the_same_tokens(
    model, overlap
):
    base, _, _, _ = _serve(model, decode_steps=1, overlap=False)
    plan, forward, params = model
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(overlap=overlap, decode_steps=4),
    )
    # A block's tokens are filled by resolve(), with overlap or without.
    applier = loop.scheduler.applier
    real, calls = applier.resolve, [0]

    def apply(step, rows):
        calls[0] += step.num_steps > 1
        if calls[0] == 2 and step.num_steps > 1:
            raise KeyboardInterrupt
        return real(step, rows)

    applier.resolve = apply
    reqs = _requests(shared=16, seed=3, new=11)
    with pytest.raises(KeyboardInterrupt):
        loop.run(reqs)
    applier.resolve = real
    assert loop.resume() == "applied"  # its iterations ran: never run again
    loop.run()
    assert [r.output for r in reqs] == base[: len(reqs)]


@pytest.mark.parametrize("where", ["trace", "pools", "advance"])
def test_a_fault_dispatching_a_pipelined_block_resumes_to_the_same_tokens(model, where):
    """With overlap, a block of iterations whose dispatch raised is rerun
    (pools untouched), recomputed with every request in flight (its donated
    pools consumed), or only advanced (it ran; advance_decode raised): the
    tokens are those of one step at a time, every block comes back.
    """  # noqa: D205
    base, _, _, _ = _serve(model, decode_steps=1, overlap=False)
    plan, forward, params = model
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(decode_steps=3),
    )
    patched = "advance" if where == "advance" else "dispatch_decode"
    owner = loop.scheduler.applier if where == "advance" else loop.runner
    real, calls = getattr(owner, patched), [0]

    def faulty(*args, **kwargs):
        calls[0] += args[0].num_steps > 1
        if args[0].num_steps == 1:
            return real(*args, **kwargs)
        if calls[0] == 3:  # a block dispatched while another is in flight
            assert loop.pipeline, "no block in flight"
            if where == "pools":
                jax.tree.map(lambda a: a.delete(), loop.pools)
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    setattr(owner, patched, faulty)
    reqs = _requests(shared=16, seed=3, new=11)
    with pytest.raises(RuntimeError, match="injected"):
        loop.run(reqs)
    setattr(owner, patched, real)
    want = {"trace": "rerun", "pools": "recomputed", "advance": "applied"}[where]
    assert loop.resume() == want
    loop.run()
    assert [r.output for r in reqs] == base[: len(reqs)]
    m = loop.scheduler.manager
    assert m.num_free_blocks == m.num_usable_blocks


def test_advance_and_resolve_pipeline_multi_step_blocks():
    """A block is scheduled while the one before it is in flight: its input
    token is a placeholder of the block before; stop tokens found when
    resolving end the request and drop what the later block computed.
    """  # noqa: D205
    s = _decoding_scheduler()
    r0, r1 = s.running
    first = s.schedule_decode(2)
    assert first is not None
    with pytest.raises(ValueError, match="not the oldest advanced"):
        s.resolve(first, [[1], [1]])
    s.advance(first)
    assert [r.output for r in (r0, r1)] == [[5, -1, -1], [5, -2, -2]]
    assert (r0.num_pending, r1.num_pending) == (2, 2)
    # r1 (3 new tokens) has had its last 2: finished now, blocks back.
    assert s.running == [r0]
    assert r1.status is jaxkv.RequestStatus.FINISHED
    second = s.schedule_decode(2)
    assert second is not None
    assert np.asarray(second.token_ids).tolist() == [-1]  # tokens[1][0], block 1
    with pytest.raises(ValueError, match="oldest"):
        s.resolve(second, [[1, 1]])
    with pytest.raises(ValueError, match="outside"):
        s.resolve(first, [[1, 2], [3, -1]])
    s.advance(second)
    r0.stop_token_ids = (9,)
    done = s.resolve(first, [[1, 9], [3, 4]])
    assert [r.req_id for r in done] == ["r0", "r1"]
    assert (r0.output, r1.output) == ([5, 1, 9], [5, 3, 4])
    assert [[(k, t) for k, _, t in it] for it in first.filled_by_iteration] == [
        [(0, 1), (1, 3)],
        [(0, 9), (1, 4)],
    ]
    assert s.resolve(second, [[7, 7]]) == []  # r0 ended: dropped
    assert r0.output == [5, 1, 9]
    assert not second.filled_by_iteration[0]
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


@pytest.mark.parametrize("num_steps", [None, 2])
def test_advance_raising_midway_and_called_again_applies_each_request_once(num_steps):
    # The block manager raises committing the second request: the first was
    # already advanced. advance() again finishes the step without giving the
    # first its placeholders twice; resolving gives what a clean run gives.
    def run(fault):
        s = _decoding_scheduler()
        step = s.schedule() if num_steps is None else s.schedule_decode(num_steps)
        assert step is not None
        real, calls = s.manager.commit, [0]

        def commit(req):
            calls[0] += 1
            if fault and calls[0] == 2:
                raise RuntimeError("injected")
            return real(req)

        s.manager.commit = commit
        if fault:
            with pytest.raises(RuntimeError, match="injected"):
                s.advance(step)
        s.advance(step)
        tokens = [[1], [2]] if num_steps is None else [[1, 2], [3, 4]]
        s.resolve(step, [t[0] for t in tokens] if num_steps is None else tokens)
        return [(r.req_id, list(r.output), r.num_computed) for r, _ in step.batch]

    assert run(fault=True) == run(fault=False)


def _caching_scheduler() -> jaxkv.Scheduler:
    """A one-layer model's scheduler with prefix caching, blocks of 8."""
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_size=8,
        block_size=8,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    return jaxkv.Scheduler(
        jaxkv.make_plan(cfg, num_blocks=16), enable_prefix_caching=True
    )


def test_blocks_a_multi_step_decode_fills_are_cached_at_once():
    s = _caching_scheduler()
    r = jaxkv.Request("r", prompt=[1, 2, 3, 4, 5], max_new_tokens=20)
    s.add_request(r)
    s.update(s.schedule(), [6])
    step = s.schedule_decode(8)
    assert step is not None
    s.update(step, [[7, 8, 9, 10, 11, 12, 13, 14]])
    assert r.num_computed == 13
    # Tokens 0-7 fill block 0 during the decode: a hit for the next request.
    probe = jaxkv.Request(
        "p", prompt=r.prompt + r.output[:3] + [0, 0], max_new_tokens=1
    )
    assert s.manager.find_cache_hit(probe) == 8


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("prompt_len", [5, 11])
def test_the_last_block_of_a_request_caches_what_it_computed(pipelined, prompt_len):
    """A request that ends in a block (its ``max_new_tokens``): the blocks
    that block filled are cached, applied at once (update_decode) or
    pipelined (advance_decode holds them until resolve_decode caches them);
    the last token, never an input, is not counted.
    """  # noqa: D205
    s = _caching_scheduler()
    prompt = list(range(1, prompt_len + 1))
    r = jaxkv.Request("r", prompt=prompt, max_new_tokens=5)
    s.add_request(r)
    s.update(s.schedule(), [20])
    step = s.schedule_decode(4)
    assert step is not None
    assert np.asarray(step.steps_per_request).tolist() == [4]
    tokens = [[21, 22, 23, 24]]
    if pipelined:
        s.advance(step)
        assert r.status is jaxkv.RequestStatus.FINISHED
        assert s.resolve(step, tokens) == [r]
    else:
        assert s.update(step, tokens) == [r]
    assert r.tokens == [*prompt, 20, 21, 22, 23, 24]
    probe = jaxkv.Request("p", prompt=[*r.tokens, 0], max_new_tokens=1)
    # Prompt 5: 10 tokens, positions 0-8 computed, block 0 (0-7) full and
    # filled by the decode block. Prompt 11: 16 tokens, positions 0-14
    # computed: block 1 (8-15) holds token 15, whose K/V was never computed.
    assert s.manager.find_cache_hit(probe) == 8
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_stops_and_preemption_pipelined_equal_one_step_at_a_time(
    model, seed
):
    """Requests of random prompts (some sharing a prefix), lengths and stop
    tokens arrive between steps at random while pipelined blocks are in
    flight, in a pool small enough to preempt, with prefix caching: every
    output equals the one-step-at-a-time loop's (all submitted at once), every
    block comes back.
    """  # noqa: D205
    plan, forward, params = model
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, 16).tolist()

    def requests() -> list[jaxkv.Request]:
        g = np.random.default_rng(seed)
        out = []
        for i in range(8):
            own = g.integers(0, VOCAB, int(g.integers(2, 20))).tolist()
            out.append(
                jaxkv.Request(
                    f"r{i}",
                    prompt=(prefix if g.random() < 0.5 else []) + own,
                    max_new_tokens=int(g.integers(1, 24)),
                    stop_token_ids=tuple(g.integers(0, VOCAB, 2).tolist()),
                )
            )
        return out

    def serve(decode_steps: int, overlap: bool, staggered: bool) -> list[list[int]]:
        loop = jaxkv.ServingLoop(
            plan,
            forward,
            params,
            vocab_size=VOCAB,
            execution=jaxkv.ExecutionOptions(
                overlap=overlap, decode_steps=decode_steps
            ),
        )
        reset_loop(loop, num_blocks=18, enable_prefix_caching=True)
        reqs = requests()
        if not staggered:
            loop.run(reqs)
        else:
            pending = list(reqs)
            while pending or loop.has_unfinished:
                for _ in range(min(int(rng.integers(0, 3)), len(pending))):
                    loop.submit(pending.pop(0))
                if loop.has_unfinished:
                    loop.step()
        m = loop.scheduler.manager
        assert m.num_free_blocks == m.num_usable_blocks
        assert loop.counters["decode_iterations"] > 0 or decode_steps == 1
        return [r.output for r in reqs]

    base = serve(1, False, staggered=False)
    assert serve(3, True, staggered=True) == base


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_overlap_may_change_between_any_two_steps(model, decode_steps):
    # A step or block in flight when `overlap` changes is finished under the
    # mode it was dispatched in: the same tokens and logits as either mode.
    base, base_logits, _, _ = _serve(model, decode_steps=1, overlap=False)
    loop = _loop(model, decode_steps=decode_steps)
    flips_seen_in_flight = 0
    for first, second in [(1, 3), (2, 4), (3, 7), (5, 6)]:
        reset_loop(loop)
        loop.set_overlap(True)
        outs = []
        for seed in (3, 4):
            reqs = _requests(shared=16, seed=seed, new=11)
            for r in reqs:
                loop.submit(r)
            n = 0
            while loop.has_unfinished:
                if n in (first, second):
                    flips_seen_in_flight += bool(loop.pipeline)
                    loop.set_overlap(not loop.overlap)
                loop.step()
                n += 1
            outs += [list(r.output) for r in reqs]
        assert outs == base
        for k, v in loop.logits.items():
            np.testing.assert_allclose(np.stack(v), base_logits[k], atol=1e-5)
        m = loop.scheduler.manager
        assert m.num_free_blocks == m.num_usable_blocks
    assert flips_seen_in_flight > 0


def test_overlap_cannot_change_from_on_token_inside_run(model):
    plan, forward, params = model
    loop = jaxkv.ServingLoop(plan, forward, params, vocab_size=VOCAB)
    base = [list(r.output) for r in loop.run(_requests(seed=3))]

    def flip(req, token):
        loop.set_overlap(False)

    reset_loop(loop)
    reqs = _requests(seed=3)
    with pytest.raises(RuntimeError, match="cannot change inside run"):
        loop.run(reqs, on_token=flip)
    assert loop.overlap
    loop.run()  # resumes the step in flight and serves the rest
    assert [list(r.output) for r in reqs] == base


@pytest.mark.parametrize("pipelined", [False, True, "ahead"])
def test_a_decode_block_caches_only_blocks_whose_keys_are_computed(pipelined):
    # Prompt 3 + 1 token, then 4 decode iterations: 8 known tokens, two full
    # blocks of 4, but the last sampled token's K/V is not computed yet, so
    # only the first block may be cached, applied at once or pipelined. With
    # the next block already advanced ("ahead") token 8's K/V is in flight
    # there: a block it completes is cached only when that step resolves (a
    # failed step must not leave a cached block whose keys were never written).
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=4)
    plan = jaxkv.make_plan(cfg, num_blocks=32)
    s = jaxkv.Scheduler(plan, enable_prefix_caching=True)
    req = jaxkv.Request("r", prompt=[1, 2, 3], max_new_tokens=20)
    s.add_request(req)
    s.update(s.schedule(), [4])
    step = s.schedule_decode(4)
    assert step is not None
    nxt = None
    if pipelined:
        s.advance(step)
        if pipelined == "ahead":
            nxt = s.schedule_decode(4)
            assert nxt is not None
            s.advance(nxt)
        s.resolve(step, [[5, 6, 7, 8]])
    else:
        s.update(step, [[5, 6, 7, 8]])
    assert req.num_known_tokens == 8
    probe = jaxkv.Request("p", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9], max_new_tokens=1)
    assert s.manager.find_cache_hit(probe) == 4
    if nxt is not None:
        s.resolve(nxt, [[9, 10, 11, 12]])
        assert s.manager.find_cache_hit(probe) == 8
