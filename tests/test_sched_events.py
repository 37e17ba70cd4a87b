"""KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) and
the scheduler's stats under vLLM's metric names.
"""  # noqa: D205

from collections import Counter

import numpy as np
import prometheus_client
import pytest

import jaxkv
from jaxkv.sched import AllBlocksCleared, BlockRemoved, BlockStored


def _plan(num_blocks=9, block_size=4):
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=block_size)
    return jaxkv.make_plan(cfg, num_blocks=num_blocks)


def _run(s, step):
    return s.update(step, [7] * len(step.sampled))


def test_a_stored_block_carries_its_tokens_parent_and_group():
    # vLLM's cache_full_blocks: one BlockStored per group per caching call,
    # covering every block that became full, the parent of the first.
    s = jaxkv.Scheduler(
        _plan(), enable_prefix_caching=True, enable_kv_cache_events=True
    )
    s.add_request(jaxkv.Request("a", prompt=list(range(10)), max_new_tokens=3))
    _run(s, s.schedule())
    (first,) = s.manager.take_events()
    assert isinstance(first, BlockStored)
    hashes = jaxkv.sched.hash_token_blocks(list(range(10)), 4)
    assert first.block_hashes == (hashes[0], hashes[1])
    assert first.parent_block_hash is None
    assert first.token_ids == tuple(range(8))
    assert (first.block_size, first.group_idx, first.medium) == (4, 0, "GPU")
    assert first.kv_cache_spec_kind == "full_attention"
    assert first.kv_cache_spec_sliding_window is None
    assert s.manager.take_events() == []  # taken
    # The third block fills with two sampled tokens: its event has them.
    _run(s, s.schedule())
    _run(s, s.schedule())
    (third,) = s.manager.take_events()
    assert isinstance(third, BlockStored)
    assert third.block_hashes == (
        jaxkv.sched.hash_token_blocks([*range(10), 7, 7], 4)[2],
    )
    assert third.token_ids == (8, 9, 7, 7)
    assert third.parent_block_hash == hashes[1]


def test_each_groups_event_names_its_kind_and_window():
    cfg = jaxkv.pattern_config(
        "LG", num_layers=2, sliding_window=4, num_heads=2, num_kv_heads=1,
        head_size=8, block_size=4, max_model_len=64,
    )  # fmt: skip
    s = jaxkv.Scheduler(
        jaxkv.make_plan(cfg, num_blocks=32),
        enable_prefix_caching=True,
        enable_kv_cache_events=True,
    )
    s.add_request(jaxkv.Request("a", prompt=list(range(12)), max_new_tokens=2))
    _run(s, s.schedule())
    events = {
        e.group_idx: e for e in s.manager.take_events() if isinstance(e, BlockStored)
    }
    kinds = {g: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
             for g, e in events.items()}  # fmt: skip
    assert sorted(kinds.values()) == [("full_attention", None), ("sliding_window", 4)]
    for e in events.values():
        assert e.token_ids == tuple(range(12))  # the range: blocks 0-2
        assert e.parent_block_hash is None
        assert len(e.block_hashes) == 3  # all written this step: all cached


def test_an_evicted_block_is_removed_and_a_reset_clears_all():
    s = jaxkv.Scheduler(
        _plan(num_blocks=5), enable_prefix_caching=True, enable_kv_cache_events=True
    )
    s.add_request(jaxkv.Request("a", prompt=list(range(9)), max_new_tokens=1))
    while s.has_unfinished:
        _run(s, s.schedule())
    stored = [e for e in s.manager.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2
    # 4 usable blocks: a new 13-token prompt needs all of them, evicting both.
    s.add_request(jaxkv.Request("b", prompt=[50] * 13, max_new_tokens=1))
    _run(s, s.schedule())
    events = s.manager.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        h for e in stored for h in e.block_hashes
    )
    assert all(e.group_idx == 0 for e in removed)
    while s.has_unfinished:
        _run(s, s.schedule())
    s.manager.take_events()
    assert s.manager.reset_prefix_cache()
    assert s.manager.take_events() == [AllBlocksCleared()]
    # Without events on, nothing is kept.
    quiet = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    quiet.add_request(jaxkv.Request("a", prompt=list(range(9)), max_new_tokens=1))
    _run(quiet, quiet.schedule())
    assert quiet.manager.take_events() == []


def _cached(manager):
    """The prefix cache as a router sees it: (group, hash) -> copies."""
    return Counter(
        {key: len(copies) for key, copies in manager.allocator._cached.items()}
    )


def _replay(view, events):
    for e in events:
        if isinstance(e, AllBlocksCleared):
            view.clear()
        elif isinstance(e, BlockStored):
            for h in e.block_hashes:
                view[(e.group_idx, h)] += 1
        elif isinstance(e, BlockRemoved):
            key = (e.group_idx, e.block_hashes[0])
            view[key] -= 1
            assert view[key] >= 0, key
            if not view[key]:
                del view[key]


@pytest.mark.parametrize(
    ("model", "policy"), [("llama", "priority"), ("hybrid", "fcfs")]
)
def test_a_router_replaying_the_events_knows_the_prefix_cache_at_every_step(
    model, policy
):
    rng = np.random.default_rng(0)
    if model == "llama":
        plan = _plan(num_blocks=12)
    else:
        plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=14)
    s = jaxkv.Scheduler(
        plan,
        enable_prefix_caching=True,
        enable_kv_cache_events=True,
        max_num_batched_tokens=24,
        scheduler_reserve_full_isl=False,  # preemptions too
        policy=policy,
    )
    prefixes = [rng.integers(0, 50, 32).tolist() for _ in range(3)]
    view: Counter = Counter()
    made = removed = 0
    for _ in range(120):
        if rng.random() < 0.4 and made < 30:
            p = prefixes[int(rng.integers(3))][: int(rng.integers(4, 33))]
            tail = rng.integers(0, 50, int(rng.integers(1, 10))).tolist()
            req = jaxkv.Request(
                f"r{made}", prompt=p + tail, max_new_tokens=6, priority=made % 3
            )
            s.add_request(req)
            made += 1
        if s.has_unfinished:
            step = s.schedule()
            s.update(step, rng.integers(0, 50, len(step.sampled)).tolist())
        events = s.manager.take_events()
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        _replay(view, events)
        assert view == _cached(s.manager)
    assert s.stats["preemptions"] > 0
    assert s.manager.allocator.num_evictions > 0
    assert removed >= s.manager.allocator.num_evictions


def test_a_block_registered_by_a_step_that_never_ran_is_removed():
    # lazy (priority 9, 14 prompt tokens: 4 blocks) decodes; urgent (priority
    # 0, 16 tokens) takes the other 4. Next step lazy's decode fills block 3,
    # registered at once; then urgent's decode needs a block: lazy, already in
    # the batch, is preempted, and block 3's registration (never computed) is
    # withdrawn.
    s = jaxkv.Scheduler(
        _plan(),
        enable_prefix_caching=True,
        enable_kv_cache_events=True,
        max_num_batched_tokens=64,
        policy="priority",
    )
    lazy = jaxkv.Request("lazy", prompt=list(range(14)), max_new_tokens=8, priority=9)
    s.add_request(lazy)
    _run(s, s.schedule())
    s.add_request(jaxkv.Request("urgent", prompt=[40] * 16, max_new_tokens=4))
    _run(s, s.schedule())
    view: Counter = Counter()
    _replay(view, s.manager.take_events())
    step = s.schedule()
    assert [r.req_id for r in step.preempted] == ["lazy"]
    events = s.manager.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    stored, removed = events
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == (12, 13, 7, 7)
    assert removed == BlockRemoved(block_hashes=stored.block_hashes, group_idx=0)
    _replay(view, events)
    assert view == _cached(s.manager)


def test_stats_count_lookups_tokens_and_usage():
    s = jaxkv.Scheduler(_plan(), enable_prefix_caching=True)
    for i in range(2):
        s.add_request(jaxkv.Request(f"r{i}", prompt=list(range(9)), max_new_tokens=2))
    stats = s.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (2, 0)
    assert stats.kv_cache_usage == 0.0
    _run(s, s.schedule())  # r0 (9 tokens, 3 blocks); r1 hits r0's 2 blocks
    stats = s.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (0, 2)
    assert stats.prefix_cache_stats.requests == 2
    assert stats.prefix_cache_stats.queries == 18
    assert stats.prefix_cache_stats.hits == 8
    assert stats.prefix_cache_stats.hit_rate == 8 / 18
    assert stats.kv_cache_usage == 4 / 8  # 2 shared + 1 each
    while s.has_unfinished:
        _run(s, s.schedule())
    metrics = s.make_stats().metrics()
    assert metrics == {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:kv_cache_usage_perc": 0.0,
        "vllm:prefix_cache_queries": 18.0,
        "vllm:prefix_cache_hits": 8.0,
        "vllm:num_preemptions": 0.0,
        "vllm:generation_tokens": 4.0,
        "vllm:prompt_tokens_cached": 8.0,
    }


def test_the_prometheus_collector_reads_every_rank_at_each_scrape():
    ranks = [jaxkv.Scheduler(_plan()) for _ in range(2)]
    ranks[1].add_request(jaxkv.Request("a", prompt=[1] * 9, max_new_tokens=2))
    registry = prometheus_client.CollectorRegistry()
    registry.register(jaxkv.sched.PrometheusCollector(lambda: ranks, model_name="m"))

    def value(name, engine):
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine})

    assert value("vllm:num_requests_waiting", "0") == 0.0
    assert value("vllm:num_requests_waiting", "1") == 1.0
    _run(ranks[1], ranks[1].schedule())
    assert value("vllm:num_requests_running", "1") == 1.0
    assert value("vllm:kv_cache_usage_perc", "1") == 3 / 8
    assert value("vllm:num_preemptions_total", "1") == 0.0
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:generation_tokens_total{engine="1",model_name="m"} 1.0' in text
