"""Edge cases of the block manager and the scheduler that the serving tests
run past: chunked-local bounds, eviction order, sampled-token counts, the
preemption queue, admission bounds and stop tokens, each with its worked
numbers.
"""  # noqa: D205

import jaxkv
from tests.helpers import one_layer_config


def _full(bs=16):
    return jaxkv.FullAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=8, dtype="float32"
    )


def _serve(s, steps=1000):
    for _ in range(steps):
        if not s.has_unfinished:
            return
        step = s.schedule()
        s.update(step, [1] * len(step.sampled))
    raise AssertionError("not finished")


def test_chunked_local_bound_covers_every_block_a_request_holds():
    # Chunk 24, block 16, prefill steps of 24 tokens after a first one of 23:
    # the step computing [47, 71) reads the local chunk [24, 48) from position
    # 47 and writes up to 71: blocks 1-4 held at once. The bound is
    # cdiv(24 + 24, 16) + 1 = 4 (3 without the + 1).
    spec = jaxkv.ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype="float32",
        attention_chunk_size=24,
    )
    plan = jaxkv.make_plan(one_layer_config(spec), num_blocks=32)
    m = jaxkv.KVCacheManager(plan)
    req = jaxkv.Request("r", prompt=list(range(200)), max_new_tokens=1)
    bound = m.max_blocks_needed(201, 24)
    held = 0
    while req.num_computed < 200:
        n = min(24 if req.num_computed else 23, 200 - req.num_computed)
        assert m.allocate(req, n)
        held = max(held, sum(b != 0 for b in m.blocks_of(req)[0]))
        req.num_computed += n
        m.commit(req)
    assert (held, bound) == (4, 4)


def test_a_finished_request_is_evicted_tail_first():
    # Blocks of a finished request are freed last block first, so later
    # allocations evict its tail and keep its head: after two one-block
    # allocations the first three of its five blocks are still a hit.
    plan = jaxkv.make_plan(one_layer_config(_full()), num_blocks=6)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
    a = jaxkv.Request("a", prompt=list(range(80)), max_new_tokens=1)
    assert m.allocate(a, 80)
    a.num_computed = 80
    m.commit(a)
    m.free(a)
    for name in ("x", "y"):
        other = jaxkv.Request(name, prompt=[7] * 4, max_new_tokens=1)
        assert m.allocate(other, 4)
    b = jaxkv.Request("b", prompt=list(range(80)) + [1], max_new_tokens=1)
    assert m.find_cache_hit(b) == 48


def test_two_decodes_sample_one_token_each():
    plan = jaxkv.make_plan(one_layer_config(_full()), num_blocks=16)
    s = jaxkv.Scheduler(plan)
    for name in "ab":
        s.add_request(jaxkv.Request(name, prompt=[1, 2, 3], max_new_tokens=3))
    s.update(s.schedule(), [5, 5])
    arrays = s.schedule()
    assert arrays.cu_num_logits is not None
    assert arrays.cu_num_logits.tolist() == [0, 1, 2]
    assert arrays.logits_indices is not None
    assert arrays.logits_indices.tolist() == [0, 1]


def test_a_preempted_request_waits_at_the_front():
    # Two running requests that outgrow 6 blocks and one waiting: the
    # preempted one is admitted again before the one that never ran.
    plan = jaxkv.make_plan(one_layer_config(_full(4), tokens=64), num_blocks=9)
    s = jaxkv.Scheduler(plan, max_num_seqs=2)
    reqs = [jaxkv.Request(n, prompt=[1] * 10, max_new_tokens=10) for n in "abc"]
    for r in reqs:
        assert s.add_request(r)
    for _ in range(20):
        step = s.schedule()
        if step.preempted:
            victim = step.preempted[0]
            assert s.waiting[0] is victim
            assert [r.req_id for r in s.waiting] == [victim.req_id, "c"]
            break
        s.update(step, [1] * len(step.sampled))
    else:
        raise AssertionError("nothing was preempted")
    _serve(s)
    assert all(len(r.output) == 10 for r in reqs)


def test_admission_counts_the_new_tokens_too():
    # 30 prompt tokens fit 8 blocks of 4; 30 + 10 need 10: rejected at
    # admission instead of failing a later schedule().
    plan = jaxkv.make_plan(one_layer_config(_full(4)), num_blocks=9)
    s = jaxkv.Scheduler(plan)
    req = jaxkv.Request("r", prompt=[1] * 30, max_new_tokens=10)
    assert not s.add_request(req)
    assert req.reject_reason == (
        "needs up to 10 KV-cache blocks at once, the pool holds 8"
    )
    ok = jaxkv.Request("ok", prompt=[1] * 30, max_new_tokens=2)
    assert s.add_request(ok)
    _serve(s)
    assert len(ok.output) == 2


def test_a_step_holds_at_most_max_num_seqs_requests():
    plan = jaxkv.make_plan(one_layer_config(_full()), num_blocks=32)
    s = jaxkv.Scheduler(plan, max_num_seqs=2)
    for name in "abc":
        s.add_request(jaxkv.Request(name, prompt=[1, 2], max_new_tokens=2))
    step = s.schedule()
    assert [r.req_id for r, _ in step.batch] == ["a", "b"]
    assert s.waiting[0].req_id == "c"


def test_a_stop_token_anywhere_in_the_output_ends_the_request():
    req = jaxkv.Request("r", prompt=[1], max_new_tokens=5, stop_token_ids=(9,))
    req.output += [3]
    assert not req.finished
    req.output += [9]
    assert req.finished
    plan = jaxkv.make_plan(one_layer_config(_full()), num_blocks=16)
    s = jaxkv.Scheduler(plan)
    r = jaxkv.Request("s", prompt=[1, 2], max_new_tokens=5, stop_token_ids=(9,))
    s.add_request(r)
    for token in (3, 9):
        s.update(s.schedule(), [token])
    assert r.output == [3, 9]
    assert r.status is jaxkv.RequestStatus.FINISHED
    assert not s.has_unfinished


def test_a_recycled_block_table_row_starts_zeroed():
    # A finished request's row goes to the next request: its columns past the
    # new request's blocks read 0 (the null block), not the old request's ids.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    m = jaxkv.KVCacheManager(plan)
    a = jaxkv.Request("a", prompt=[1] * 90, max_new_tokens=1)
    assert m.allocate(a, 90)
    assert m.step_blocks([(a, 90)]).block_tables[0][0, :3].tolist() == [1, 2, 3]
    m.free(a)
    b = jaxkv.Request("b", prompt=[2] * 5, max_new_tokens=1)
    assert m.allocate(b, 5)
    table = m.step_blocks([(b, 5)]).block_tables[0][0]
    assert table[0] != 0
    assert table[1:].tolist() == [0] * (len(table) - 1)
