"""The block manager, prefix caching, admission and preemption (host side and
through the demo Engine against the dense model)."""

import re
from typing import Any

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
import jaxkv.demo
from jaxkv.config._specs import get_num_skipped_tokens
from tests.helpers import reset_loop

# --- host side: allocator, hashes, hit rules, manager --------------------------


def test_allocator_counts_references_and_evicts_cached_blocks_lru():
    a = jaxkv.sched.BlockAllocator(5)
    x, y = a.allocate(2)
    a.touch([x])  # a second request shares x
    a.cache(x, key="kx")
    a.cache(y, key="ky")
    a.free([x, y])
    assert a.num_free == 3
    assert a.ref_count(x) == 1
    a.free([x])
    assert a.num_free == 4
    assert a.lookup("kx") == x
    # The free queue hands out never-cached blocks first, then y (freed
    # first), then x: allocation evicts what it hands out.
    got = a.allocate(3)
    assert got[-1] == y
    assert a.lookup("ky") is None
    assert a.lookup("kx") == x
    a.touch([x])  # a hit on a free cached block takes it off the queue
    assert a.num_free == 0
    with pytest.raises(RuntimeError, match="need 1, 0 free"):
        a.allocate(1)
    with pytest.raises(ValueError, match="not held"):
        a.free([0])
    a.free([x])
    with pytest.raises(ValueError, match="not held"):
        a.free([x])  # a double free would hand one block to two requests


def test_block_hashes_chain_and_salt():
    h = jaxkv.sched.hash_token_blocks(list(range(10)), 4)
    assert len(h) == 2
    assert jaxkv.sched.hash_token_blocks(list(range(4, 10)), 4, parent=h[0]) == h[1:]
    # Same second block, different first block: different hash (chained).
    other = jaxkv.sched.hash_token_blocks([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert other[1] != h[1]
    assert jaxkv.sched.hash_token_blocks(list(range(8)), 4, salt="t")[0] != h[0]


def _spec(kind, bs=4):
    if kind == "full":
        return jaxkv.FullAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=8, dtype="float32"
        )
    if kind == "swa":
        return jaxkv.SlidingWindowSpec(
            block_size=bs,
            num_kv_heads=1,
            head_size=8,
            dtype="float32",
            sliding_window=6,
        )
    return jaxkv.MambaSpec(block_size=bs, shapes=((4,),), dtypes=("float32",))


@pytest.mark.parametrize(
    ("kind", "cached", "want"),
    [
        ("full", {0, 1, 2, 4, 5}, 3),  # a hole ends the prefix
        ("full", set(), 0),
        # Window 6, block 4: from position 4k a query sees keys > 4k - 6, so
        # blocks (4k - 5) // 4 .. k - 1 are needed; 0 and 1 may be gone.
        ("swa", {2, 3, 4}, 5),
        ("swa", {3, 4}, 5),  # from 20: keys > 14, blocks 3-4 only
        ("swa", {2, 4}, 0),  # every hit length misses a visible block
        ("swa", {1, 2, 4}, 3),
        ("mamba", {1, 3}, 4),  # the state after block 3 is cached
        ("mamba", {0}, 1),
        ("mamba", set(), 0),
    ],
)
def test_longest_cache_hit_rules(kind, cached, want):
    got = jaxkv.sched.longest_cache_hit(
        _spec(kind), num_blocks=5, is_cached=cached.__contains__
    )
    assert got == want


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["full", "window", "chunk", "mamba"]),
    size=st.integers(1, 24),
    bs=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(0, 40),
    cached=st.sets(st.integers(0, 39)),
)
def test_longest_cache_hit_is_the_largest_valid_hit_looked_up_once(
    kind, size, bs, num_blocks, cached
):
    kw: dict[str, Any] = dict(
        block_size=bs, num_kv_heads=1, head_size=8, dtype="float32"
    )
    spec = {
        "full": None,
        "window": jaxkv.SlidingWindowSpec(sliding_window=size, **kw),
        "chunk": jaxkv.ChunkedLocalAttentionSpec(attention_chunk_size=size * bs, **kw),
        "mamba": jaxkv.MambaSpec(block_size=bs, shapes=((4,),), dtypes=("float32",)),
    }[kind]

    def valid(k):
        if kind == "mamba":
            return k == 0 or k - 1 in cached
        first = 0 if spec is None else get_num_skipped_tokens(spec, k * bs) // bs
        return all(j in cached for j in range(first, k))

    want = max(k for k in range(num_blocks + 1) if valid(k))
    looked: list[int] = []

    def is_cached(j):
        looked.append(j)
        return j in cached

    got = jaxkv.sched.longest_cache_hit(
        spec, num_blocks=num_blocks, is_cached=is_cached
    )
    assert got == want
    if kind == "full":  # up to the first miss, no further
        assert looked == list(range(min(want + 1, num_blocks)))
    else:  # each block about once (a window's blocks again per candidate)
        assert len(looked) <= num_blocks + size + 1


def test_a_blocked_head_of_the_queue_is_not_looked_up_again_while_nothing_changes():
    plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1), num_blocks=8)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
    warm = jaxkv.Request("warm", prompt=list(range(40)), max_new_tokens=1)
    assert m.allocate(warm, 40)
    warm.num_computed = 40
    m.commit(warm)
    r = jaxkv.Request("r", prompt=list(range(40)) + [7], max_new_tokens=1)
    calls = []
    lookup = m._is_cached
    m._is_cached = lambda key: calls.append(key) or lookup(key)
    assert m.find_cache_hit(r) == 32
    assert len(calls) == 2  # blocks 0 and 1; block 2 holds the last token
    calls.clear()
    assert m.find_cache_hit(r) == 32
    assert calls == []  # the cache is unchanged
    m.free(warm)  # freed, still cached: unchanged for a lookup
    assert m.find_cache_hit(r) == 32
    assert calls == []
    m.allocator.allocate(m.num_free_blocks)  # evicts: looked up again
    assert m.find_cache_hit(r) == 0
    assert calls


def _plan(num_blocks=24, **kw):
    cfg = jaxkv.tiny_hybrid_config(
        block_size=16, head_size=16, num_heads=2, sliding_window=32, **kw
    )
    return jaxkv.make_plan(cfg, num_blocks=num_blocks, maps_slot_mapping=True)


def _groups(plan):
    specs = [g.kv_cache_spec for g in plan.kv_cache_config.kv_cache_groups]
    full = next(i for i, s in enumerate(specs) if type(s) is jaxkv.FullAttentionSpec)
    swa = next(i for i, s in enumerate(specs) if isinstance(s, jaxkv.SlidingWindowSpec))
    mamba = next(i for i, s in enumerate(specs) if isinstance(s, jaxkv.MambaSpec))
    return full, swa, mamba


def _run(manager, req, n):
    assert manager.allocate(req, n)
    req.num_computed += n
    manager.commit(req)


@pytest.mark.parametrize("free_skipped_at", ["commit", "allocate"])
def test_manager_frees_windows_and_old_states_and_returns_every_block(free_skipped_at):
    plan = _plan()
    m = jaxkv.KVCacheManager(plan, free_skipped_at=free_skipped_at)
    full, swa, mamba = _groups(plan)
    r = jaxkv.Request("r", prompt=list(range(100)), max_new_tokens=1)
    _run(m, r, 70)  # positions 0..69: 5 blocks per attention group
    if free_skipped_at == "allocate":  # vLLM's time: kept until the next one
        assert all(m.blocks_of(r)[swa])
        assert m.allocate(r, 0)
    blocks = m.blocks_of(r)
    assert all(blocks[full])
    assert len(blocks[full]) == 5
    # Window 32 from position 70: keys > 38, so blocks 0 and 1 are given back.
    assert blocks[swa][:2] == [0, 0]
    assert all(blocks[swa][2:])
    # Mamba: only the block of token 69 (column 4) holds the state.
    assert blocks[mamba] == [0, 0, 0, 0, blocks[mamba][4]]
    assert blocks[mamba][4]
    held = sum(b != 0 for g in blocks for b in g)
    assert m.num_free_blocks == 23 - held
    _run(m, r, 30)  # next chunk reads column 4, writes column 6
    if free_skipped_at == "allocate":
        assert m.allocate(r, 0)
    assert m.blocks_of(r)[mamba][:6] == [0] * 6
    m.free(r)
    assert m.num_free_blocks == 23


def test_manager_allocation_is_all_or_nothing():
    plan = _plan(num_blocks=8)
    m = jaxkv.KVCacheManager(plan)
    r = jaxkv.Request("r", prompt=list(range(60)), max_new_tokens=1)
    assert not m.allocate(r, 60)  # 4 + 4 + 1 blocks > 7
    assert m.num_free_blocks == 7
    assert m.blocks_of(r) == []
    assert m.allocate(r, 32)


def test_prefix_hit_agrees_over_groups_and_needs_the_mamba_state():
    plan = _plan(num_blocks=40)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True, free_skipped_at="commit")
    prefix = list(range(64))
    a = jaxkv.Request("a", prompt=[*prefix, 1, 2, 3], max_new_tokens=1)
    _run(m, a, 48)  # ends on a block boundary: state after 48 kept
    _run(m, a, 12)  # ends inside block 3: its page holds the state after 60
    _run(m, a, 7)  # moves on to block 4: block 3 never held the state after 64
    b = jaxkv.Request("b", prompt=[*prefix, 7], max_new_tokens=1)
    # Attention could reuse 64 tokens; the Mamba group only 48.
    assert m.find_cache_hit(b) == 48
    free = m.num_free_blocks
    assert m.allocate(b, 17, num_cached=48)
    assert b.num_computed == 48
    assert b.num_cached_tokens == 48
    full, swa, mamba = _groups(plan)
    ba, bb = m.blocks_of(a), m.blocks_of(b)
    assert bb[full][:3] == ba[full][:3]  # shared
    # The window (32) at position 48 sees blocks 1 and 2 only; a already gave
    # block 1 back (its window moved on), but it stayed cached.
    assert bb[swa][0] == 0
    assert ba[swa][1] == 0
    assert bb[swa][1]
    assert bb[swa][2] == ba[swa][2]
    # Held anew: 5 new blocks for positions 48..64 (2 + 2 + 1) and two cached
    # blocks a had given back (window block 1, the state after 48).
    assert bb[mamba][2]
    assert ba[mamba][2] == 0
    assert free - m.num_free_blocks == 7
    # Salt separates caches.
    c = jaxkv.Request("c", prompt=[*prefix, 7], max_new_tokens=1, cache_salt="x")
    assert m.find_cache_hit(c) == 0
    # The last token is always computed, even if the whole prompt is cached:
    # 48 cached tokens of a 48-token prompt give at most 32 (whole blocks below
    # 48), and no Mamba state after 32 was kept, so nothing; with one more
    # token, all 48.
    d = jaxkv.Request("d", prompt=prefix[:48], max_new_tokens=1)
    assert m.find_cache_hit(d) == 0
    e = jaxkv.Request("e", prompt=prefix[:49], max_new_tokens=1)
    assert m.find_cache_hit(e) == 48


def test_a_cache_hit_counts_the_free_blocks_it_takes():
    plan = _plan(num_blocks=12)  # 11 usable
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(40)), max_new_tokens=1)
    _run(m, a, 32)  # 5 blocks; full, window and Mamba blocks after 32 cached
    _run(m, a, 1)  # 3 more
    m.free(a)  # all 8 free; 5 of them cached
    hog = jaxkv.Request("hog", prompt=[99] * 16, max_new_tokens=1)
    assert m.allocate(hog, 16)  # takes the 3 never-used blocks, evicts nothing
    assert m.num_free_blocks == 8
    b = jaxkv.Request("b", prompt=[*range(32), *range(100, 118)], max_new_tokens=1)
    assert m.find_cache_hit(b) == 32
    # The hit takes 5 cached blocks off the free queue and b needs 5 new ones:
    # 10 > 8, so nothing is taken and nothing changes.
    assert not m.allocate(b, 18, num_cached=32)
    assert b.num_computed == 0
    assert m.blocks_of(b) == []
    assert m.num_free_blocks == 8
    assert m.find_cache_hit(b) == 32  # still cached


def test_prefix_caching_refuses_encoder_caches():
    spec = jaxkv.CrossAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="x",
                spec=spec,
                backend=jaxkv.get_backend("JAX_PAGED"),
                attn_type="encoder_decoder",
            )
        ],
        max_model_len=64,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=4)
    with pytest.raises(ValueError, match="CrossAttentionSpec"):
        jaxkv.KVCacheManager(plan, enable_prefix_caching=True)


def test_scheduler_rejects_what_can_never_be_served():
    plan = _plan(num_blocks=12, max_model_len=256)
    s = jaxkv.Scheduler(plan, vocab_size=64, max_num_batched_tokens=32)
    cases = {
        "empty": ([], 1, "empty prompt"),
        "zero": ([1], 0, "max_new_tokens must be a positive int, got 0"),
        "long": (
            [1] * 250,
            10,
            r"\(250 tokens\) \+ max_new_tokens \(10\) > max_model_len",
        ),
        "vocab": ([1, 64], 1, r"must be in \[0, 64\), got \[1, 64\]"),
        "negative": ([-1], 1, r"got \[-1, -1\]"),
        "fit": (
            [1] * 200,
            8,
            "needs up to 20 KV-cache blocks at once, the pool holds 11",  # 13 + 5 + 2
        ),
    }
    for name, (prompt, new, reason) in cases.items():
        req = jaxkv.Request(name, prompt=prompt, max_new_tokens=new)
        assert not s.add_request(req), name
        assert req.status is jaxkv.RequestStatus.REJECTED
        assert req.reject_reason is not None
        assert re.search(reason, req.reject_reason), (name, req.reject_reason)
    ok = jaxkv.Request("ok", prompt=[1] * 40, max_new_tokens=2)
    assert s.add_request(ok)
    with pytest.raises(ValueError, match="already live"):
        s.add_request(jaxkv.Request("ok", prompt=[1], max_new_tokens=1))
    for _ in range(100):
        step = s.schedule()
        s.update(step, [5] * len(step.sampled))
        if not s.has_unfinished:
            break
    assert ok.output == [5, 5]
    assert s.manager.num_free_blocks == 11


def test_scheduler_preempts_the_latest_request_and_recomputes_it():
    plan = _plan(num_blocks=14)
    s = jaxkv.Scheduler(plan, max_num_batched_tokens=64)
    reqs = [
        jaxkv.Request(f"r{i}", prompt=list(range(40)), max_new_tokens=30)
        for i in range(3)
    ]
    for r in reqs:
        assert s.add_request(r)
    preempted = []
    for _ in range(1000):
        step = s.schedule()
        preempted += [r.req_id for r in step.preempted]
        s.update(step, [len(r.output) for r in step.sampled])
        if not s.has_unfinished:
            break
    assert preempted
    assert sum(r.num_preemptions for r in reqs) == len(preempted)
    assert s.stats["preemptions"] == len(preempted)
    # Every request completed with the tokens it would have produced alone.
    assert all(r.output == list(range(30)) for r in reqs)
    assert s.manager.num_free_blocks == 13


# --- through the Engine, against the dense model ---------------------------------


@pytest.fixture(scope="module")
def served():
    cfg = jaxkv.tiny_hybrid_config(
        block_size=16,
        head_size=16,
        num_heads=2,
        num_kv_heads=2,
        sliding_window=32,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=320,
        token_buckets=(8, 128),
        request_buckets=(8,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(5))
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=300)
    return model, engine


def _serve(engine, requests, **reset):
    reset_loop(engine, **reset)
    engine.run(requests)
    free = engine.allocator.num_free
    return [r.output for r in requests], free, engine.stats


def _fresh(requests):
    return [
        jaxkv.demo.EngineRequest(
            r.req_id, prompt=r.prompt, max_new_tokens=r.max_new_tokens
        )
        for r in requests
    ]


@pytest.mark.slow  # the demo Engine end to end (11-12 s); the slow pass
def test_engine_preempts_instead_of_aborting_and_matches_the_dense_model(served):
    model, engine = served
    rng = np.random.default_rng(0)
    requests = [
        jaxkv.demo.EngineRequest(
            f"r{i}",
            prompt=rng.integers(0, 64, int(rng.integers(90, 130))).tolist(),
            max_new_tokens=24,
        )
        for i in range(4)
    ]
    # 25 blocks: each request fits alone (at most 10 + 10 + 2 blocks), and
    # two admitted together outgrow the pool while they decode.
    outputs, free, stats = _serve(engine, requests, num_blocks=26)
    assert stats["preemptions"] > 0
    assert free == 25  # no block leaked
    for req, out in zip(requests, outputs, strict=True):
        dense = jaxkv.demo.generate_dense(model, req.prompt, 24, 160)
        assert out == dense, req.req_id


@pytest.mark.slow  # the demo Engine end to end (11-12 s); the slow pass
def test_engine_prefix_caching_saves_prefill_and_keeps_outputs(served):
    model, engine = served
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 64, 256).tolist()
    requests = [
        jaxkv.demo.EngineRequest(
            f"p{i}", prompt=prefix + rng.integers(0, 64, 16).tolist(), max_new_tokens=3
        )
        for i in range(12)
    ]
    base, free_base, stats_base = _serve(engine, _fresh(requests))
    cached, free_cached, stats = _serve(
        engine, _fresh(requests), enable_prefix_caching=True
    )
    assert cached == base
    assert free_cached == free_base == 299
    saved = 1 - stats["prefill_tokens"] / stats_base["prefill_tokens"]
    assert saved >= 0.8, (stats["prefill_tokens"], stats_base["prefill_tokens"])
    assert stats["cached_tokens"] >= 11 * 256 * 0.9
    # Under pressure (room for about three requests): cached blocks are evicted
    # and requests preempted, outputs unchanged.
    squeezed, free_squeezed, stats_sq = _serve(
        engine, _fresh(requests[:8]), enable_prefix_caching=True, num_blocks=70
    )
    assert squeezed == base[:8]
    assert free_squeezed == 69
    dense = jaxkv.demo.generate_dense(model, requests[0].prompt, 3, 288)
    assert base[0] == dense


def test_engine_rejects_bad_requests_and_serves_the_others(served):
    model, engine = served
    good = [
        jaxkv.demo.EngineRequest("g0", prompt=[1, 2, 3], max_new_tokens=4),
        jaxkv.demo.EngineRequest(
            "g1", prompt=[4, 5], max_new_tokens=2, arrival_step=10**9
        ),
    ]
    bad = [
        jaxkv.demo.EngineRequest("long", prompt=[1] * 300, max_new_tokens=30),
        jaxkv.demo.EngineRequest("oov", prompt=[1, 99], max_new_tokens=1),
    ]
    reset_loop(engine, num_blocks=30)
    steps, generated = engine.run([bad[0], good[0], bad[1], good[1]])
    assert [r.status for r in bad] == [jaxkv.RequestStatus.REJECTED] * 2
    assert "max_model_len (320)" in (bad[0].reject_reason or "")
    assert "[0, 64)" in (bad[1].reject_reason or "")
    assert [len(r.output) for r in good] == [4, 2]
    assert generated == 6
    # A far-future arrival is reached by skipping idle steps, not by looping.
    assert steps > 10**9


def test_blocks_filled_while_decoding_are_hit_by_a_prompt_that_repeats_them():
    # The hashes a decoding request extends block by block must equal the
    # hashes of the same tokens hashed at once (chained from the previous
    # block): a second prompt of the first's prompt and output then hits
    # every full block but the last token's.
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=4)
    plan = jaxkv.make_plan(cfg, num_blocks=32)
    s = jaxkv.Scheduler(plan, enable_prefix_caching=True)
    first = jaxkv.Request("first", prompt=[1, 2, 3, 4, 5], max_new_tokens=12)
    assert s.add_request(first)
    rng = np.random.default_rng(0)
    while s.has_unfinished:
        step = s.schedule()
        s.update(step, rng.integers(0, 50, len(step.sampled)).tolist())
    tokens = first.prompt + first.output  # 17 tokens: 4 full blocks
    again = jaxkv.Request("again", prompt=tokens, max_new_tokens=1)
    assert s.add_request(again)
    s.schedule()
    assert again.num_cached_tokens == 16


def test_a_step_puts_decodes_before_prefills():
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=4)
    plan = jaxkv.make_plan(cfg, num_blocks=32)
    s = jaxkv.Scheduler(plan)
    first = jaxkv.Request("first", prompt=[1, 2, 3], max_new_tokens=8)
    assert s.add_request(first)
    step = s.schedule()
    s.update(step, [7])  # first now decodes
    s.add_request(jaxkv.Request("second", prompt=[4, 5, 6, 7, 8], max_new_tokens=2))
    step = s.schedule()
    assert [(r.req_id, n) for r, n in step.batch] == [("first", 1), ("second", 5)]
    assert step.query_start_loc.tolist()[:3] == [0, 1, 6]


def test_every_steps_block_tables_are_the_managers_tables_zero_padded():
    # Rows are recycled between requests and out-of-window blocks are freed at
    # commit: a step's table row must hold exactly the request's table (0 for
    # freed columns), zeros past it, in every group.
    plan = _plan(num_blocks=40)
    s = jaxkv.Scheduler(plan, max_num_batched_tokens=48)
    rng = np.random.default_rng(3)
    n = 0
    for _ in range(80):
        if rng.random() < 0.3:
            prompt = rng.integers(0, 50, int(rng.integers(1, 90))).tolist()
            s.add_request(
                jaxkv.Request(
                    f"r{n}", prompt=prompt, max_new_tokens=int(rng.integers(1, 40))
                )
            )
            n += 1
        step = s.schedule()
        for i, (req, _) in enumerate(step.batch):
            for g, table in enumerate(s.manager.blocks_of(req)):
                row = np.asarray(step.block_tables[g][i])
                assert row[: len(table)].tolist() == list(table), (req.req_id, g)
                assert not row[len(table) :].any(), (req.req_id, g)
        s.update(step, rng.integers(0, 50, len(step.sampled)).tolist())
    assert n > 15
