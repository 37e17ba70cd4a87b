"""KV-cache events published by a ServingLoop as vLLM publishes them (issue 60):
one `KVEventBatch` per step and rank to `SchedulingOptions.kv_event_sink`,
nothing lost when the sink fails, and the cache's resets and shrinks told.
"""  # noqa: D205

import pytest

import jaxkv
from tests.test_resize import CFG, _forward_for, _wave
from tests.test_resize import _loop as _sized_loop


def _loop(num_blocks=64, **scheduling):
    return _sized_loop(num_blocks, **scheduling)


def _key(event):
    return (type(event).__name__, getattr(event, "block_hashes", ()))


def test_the_sink_gets_each_steps_events_as_take_events_gives_them():
    batches = []
    published = _loop(kv_event_sink=batches.append)
    taken = _loop(enable_kv_cache_events=True)
    want = []
    for r in _wave("a"):
        taken.submit(r)
    while taken.has_unfinished:
        taken.step()
        want += [_key(e) for e in taken.scheduler.manager.take_events()]
    published.run(_wave("a"))
    assert batches
    assert all(isinstance(b, jaxkv.sched.KVEventBatch) for b in batches)
    assert all(b.events and b.data_parallel_rank is None for b in batches)
    assert [_key(e) for b in batches for e in b.events] == want
    assert sorted(b.ts for b in batches) == [b.ts for b in batches]


def test_a_failing_sink_loses_no_event_and_the_reset_and_shrink_are_told():
    batches, fail = [], [True]

    def sink(batch):
        if fail[0]:
            fail[0] = False
            raise ConnectionError("router down")
        batches.append(batch)

    loop = _loop(kv_event_sink=sink)
    (r,) = _wave("a", n=1)
    loop.submit(r)
    with pytest.raises(ConnectionError):
        loop.step()
    loop.run([])
    assert len(r.output) == r.max_new_tokens
    # The batch whose call raised went first on the next call: nothing lost.
    taken = _loop(enable_kv_cache_events=True)
    taken.run(_wave("a", n=1))
    want = [_key(e) for e in taken.scheduler.manager.take_events()]
    assert want
    assert [_key(e) for b in batches for e in b.events] == want
    plan = jaxkv.make_plan(CFG, num_blocks=4)
    loop.resize(plan, forward=_forward_for(plan))
    removed = batches[-1].events
    assert removed
    assert all(isinstance(e, jaxkv.sched.BlockRemoved) for e in removed)
    loop.reset()
    assert [type(e) for e in batches[-1].events] == [jaxkv.sched.AllBlocksCleared]


def test_a_sink_that_is_not_callable_is_named():
    with pytest.raises(TypeError, match="kv_event_sink must be callable"):
        jaxkv.SchedulingOptions(kv_event_sink="tcp://router:5557")  # pyright: ignore[reportArgumentType]
