"""A serving loop's KV cache grown or shrunk without a restart (issue 59):
`ServingLoop.resize` keeps every block's id, so running requests, the prefix
cache and the host tier carry on with the tokens and hits of a loop started
at the new size; what cannot fit, another model's plan and a forward of the
old plan are refused before anything changes.
"""  # noqa: D205

import numpy as np
import pytest

import jaxkv
from tests.test_serve_loop import HD, SHAPE, VOCAB, _params, _qkv, _rms


def _forward_for(plan):
    layers = [plan.attention_layer(layer.name) for layer in plan.runner_config.layers]

    def forward(params, pools, meta, tokens, sample):
        x = params["embed"][tokens]
        for layer, w in zip(layers, params["layers"], strict=True):
            m = meta[layer.name]
            q, k, v = _qkv(w, x, m.positions)
            pools = jaxkv.write_kv(pools, layer, k, v, m)
            out = jaxkv.paged_attention(q, pools, layer, m, scale=HD**-0.5)
            x = x + out.reshape(x.shape[0], -1) @ w["wo"]
        return pools, _rms(x[sample]) @ params["unembed"]

    return forward


CFG = jaxkv.pattern_config("LG", num_layers=2, **SHAPE)
PARAMS = _params(2)


def _wave(tag, *, n=3, shared=16, seed=1):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, shared).tolist()
    return [
        jaxkv.Request(
            f"{tag}{i}",
            prompt=prefix + rng.integers(0, VOCAB, int(rng.integers(3, 20))).tolist(),
            max_new_tokens=6,
        )
        for i in range(n)
    ]


def _loop(num_blocks, **scheduling):
    plan = jaxkv.make_plan(CFG, num_blocks=num_blocks)
    return jaxkv.ServingLoop(
        plan,
        _forward_for(plan),
        PARAMS,
        vocab_size=VOCAB,
        scheduling=jaxkv.SchedulingOptions(enable_prefix_caching=True, **scheduling),
    )


def _backend_compiles(events):
    return sum(e.endswith("backend_compile_duration") for e in events)


def _serve(loop, grow_to=None):
    """Waves a and f (f evicts a's prefix to the host tier of a small pool),
    wave b (a's prefix; grown after two steps), then wave c (a's prefix).
    """  # noqa: D205
    first = loop.run(_wave("a")) + loop.run(_wave("f", seed=7))
    grown = _wave("b")
    for r in grown:
        loop.submit(r)
    loop.step()
    loop.step()
    warming: list[str] = []
    if grow_to is not None:
        plan = jaxkv.make_plan(CFG, num_blocks=grow_to)
        loop.resize(plan, forward=_forward_for(plan))
        with jaxkv.count_compilations() as warming:
            loop.warm_up()
    with jaxkv.count_compilations() as serving:
        while loop.has_unfinished:
            loop.step()
        last = loop.run(_wave("c"))
    compiles = (_backend_compiles(warming), _backend_compiles(serving))
    return {r.req_id: r.output for r in first + grown + last}, compiles


def test_growing_mid_run_serves_the_tokens_of_a_loop_started_large():
    # The host tier, the prefix cache and a wave in flight carry over.
    started_large = _loop(96, host_blocks=32)
    want, _ = _serve(started_large)
    grown = _loop(24, host_blocks=32)
    got, compiles = _serve(grown, grow_to=96)
    assert got == want
    host = grown.scheduler.manager.host
    assert host is not None
    assert host.stats["restored_blocks"] > 0  # wave b's prefix, before growing
    hits = grown.scheduler.stats["cached_tokens"]
    assert hits >= started_large.scheduler.stats["cached_tokens"] > 0
    assert grown.scheduler.manager.num_usable_blocks == 95
    assert grown.pools[0].shape == started_large.pools[0].shape
    # The new pools' programs compile in the warm-up (the host tier's copy
    # programs too, unless this process compiled them for 96 blocks already:
    # the loop started large did), and nothing compiles while serving on.
    warming, serving = compiles
    assert warming > 0
    assert serving == 0


def test_shrinking_refuses_a_held_block_past_the_end_and_serves_on():
    loop, want = _loop(64), _loop(64)
    held_plan = loop.plan
    requests = _wave("a")
    for r in requests:
        loop.submit(r)
    loop.step()
    held = max(b for b in range(1, 64) if loop.scheduler.manager.allocator.ref_count(b))
    small = jaxkv.make_plan(CFG, num_blocks=held)
    with pytest.raises(ValueError, match=rf"held by requests.*at least {held + 1}"):
        loop.resize(small, forward=_forward_for(small))
    assert loop.plan is held_plan
    while loop.has_unfinished:
        loop.step()
    reference = {r.req_id: r.output for r in want.run(_wave("a"))}
    assert {r.req_id: r.output for r in requests} == reference
    # Nothing held now: the cache shrinks, cached blocks past the end dropped.
    cached = loop.scheduler.manager.allocator.num_cached
    tiny = jaxkv.make_plan(CFG, num_blocks=12)
    loop.resize(tiny, forward=_forward_for(tiny))
    assert loop.scheduler.manager.allocator.num_cached < cached
    assert loop.scheduler.manager.num_usable_blocks == 11
    [again] = loop.run([_wave("c", n=1)[0]])
    assert again.output == reference["a0"]


def test_another_models_plan_or_options_are_refused_naming_what_differs():
    loop = _loop(32)
    other = jaxkv.pattern_config("LL", num_layers=2, **SHAPE)
    with pytest.raises(ValueError, match="runner_config"):
        loop.resize(jaxkv.make_plan(other, num_blocks=64))
    typed = jaxkv.make_plan(CFG, num_blocks=64, storage="typed")
    if typed.storage != loop.plan.storage:
        with pytest.raises(ValueError, match="storage"):
            loop.resize(typed)
    with pytest.raises(TypeError, match="KVCachePlan"):
        loop.resize(64)  # type: ignore[arg-type]
    assert loop.plan.num_blocks == 32


def test_a_forward_of_the_old_plan_is_refused_before_anything_changes():
    loop = _loop(32)
    requests = _wave("a", n=2)
    for r in requests:
        loop.submit(r)
    loop.step()
    pools = loop.pools
    with pytest.raises(ValueError, match="view of 32 blocks.*hold 64"):
        loop.resize(jaxkv.make_plan(CFG, num_blocks=64))  # forward= forgotten
    assert loop.plan.num_blocks == 32
    assert loop.pools is pools
    loop.run([])
    assert all(len(r.output) == r.max_new_tokens for r in requests)


def test_a_shrink_reports_the_cached_blocks_it_drops_as_removed():
    plan = jaxkv.make_plan(CFG, num_blocks=40)
    sched = jaxkv.Scheduler(
        plan, enable_prefix_caching=True, enable_kv_cache_events=True
    )
    (r,) = _wave("a", n=1)
    sched.add_request(r)
    while sched.has_unfinished:
        step = sched.schedule()
        sched.update(step, [1] * len(step.sampled))
    sched.manager.take_events()
    allocator = sched.manager.allocator
    cached = [b for b in range(1, 40) if allocator.key_of(b) is not None]
    keep = 1 + min(cached)
    sched.resize(jaxkv.make_plan(CFG, num_blocks=keep))
    events = sched.manager.take_events()
    removed = [e for e in events if isinstance(e, jaxkv.sched.BlockRemoved)]
    assert len(removed) == len(cached) - 1
    assert allocator.num_cached == 1
    assert sorted(allocator.free_queue()) == list(range(1, keep))
