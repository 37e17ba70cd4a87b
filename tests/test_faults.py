"""Faults at every point of a serving step, then resumption: outputs and
logits equal a fault-free run on the hybrid model (full attention, sliding
window, Mamba, prefix caching), every block is given back and no request is
lost.
"""  # noqa: D205

import jax
import numpy as np
import pytest
from flax import nnx

import jaxkv
import jaxkv.demo
import jaxkv.serve._pipeline as pipeline_module
from tests.helpers import reset_loop


class Fault(Exception):
    """The injected fault."""


@pytest.fixture(scope="module")
def engine():
    cfg = jaxkv.tiny_hybrid_config(
        block_size=16,
        head_size=16,
        num_heads=2,
        sliding_window=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=(8, 64),
        request_buckets=(4,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(3))
    eng = jaxkv.demo.Engine(cfg, model, num_blocks=64, record_logits=True)
    eng.warm_up()
    return eng


def _requests():
    rng = np.random.default_rng(7)
    shared = rng.integers(1, 64, 40).tolist()
    return [
        jaxkv.demo.EngineRequest(
            req_id=f"r{i}",
            prompt=shared + rng.integers(1, 64, int(rng.integers(2, 30))).tolist(),
            max_new_tokens=6,
            arrival_step=2 * i,
        )
        for i in range(5)
    ]


def _serve(engine, requests):
    reset_loop(engine, enable_prefix_caching=True)
    engine.run(requests)
    return requests


@pytest.fixture(scope="module")
def fault_free(engine):
    return _serve(engine, _requests())


def _once(at):
    """A counter that says True on call number `at` only."""
    calls = [0]

    def hit():
        calls[0] += 1
        return calls[0] == at

    return hit


def _inject(monkeypatch, engine, point, at):
    hit = _once(at)
    if point == "schedule":
        sched = engine.schedulers[0]
        real = sched.schedule

        def schedule():
            if hit():
                raise Fault(point)
            return real()

        monkeypatch.setattr(sched, "schedule", schedule)
    elif point == "prepare":
        real = engine.builder.prepare

        def prepare(*args, **kw):
            if hit():
                raise Fault(point)
            return real(*args, **kw)

        monkeypatch.setattr(engine.builder, "prepare", prepare)
    elif point in ("before_device", "inside_device"):
        real = engine.programs

        class Programs:
            def __call__(self, *args):
                if hit():
                    if point == "inside_device":
                        # The program runs and consumes its donated pools,
                        # then fails, as a failing device execution does.
                        jax.block_until_ready(real(*args))
                    raise Fault(point)
                return real(*args)

        monkeypatch.setattr(engine.runner, "programs", Programs())
    elif point == "after_device":
        real = pipeline_module._to_host

        def to_host(x):
            if hit():
                raise Fault(point)
            return real(x)

        monkeypatch.setattr(pipeline_module, "_to_host", to_host)
    elif point == "inside_update":
        manager = engine.schedulers[0].manager
        real = manager.commit

        def commit(req):
            if hit():
                raise Fault(point)
            return real(req)

        monkeypatch.setattr(manager, "commit", commit)


RESUMED_BY = {
    "schedule": None,
    "prepare": "rerun",
    "before_device": "rerun",
    "inside_device": "recomputed",
    "after_device": "applied",
    "inside_update": "applied",
}


@pytest.mark.parametrize("at", [3, 9])
@pytest.mark.parametrize("point", list(RESUMED_BY))
def test_a_fault_anywhere_in_a_step_resumes_to_the_fault_free_result(
    engine, fault_free, monkeypatch, point, at
):
    requests = _requests()
    reset_loop(engine, enable_prefix_caching=True)
    with monkeypatch.context() as m:
        _inject(m, engine, point, at)
        with pytest.raises(Fault):
            engine.run(requests)
        # The faulty component is back to normal; the engine resumes.
    resumed = engine.resume()
    assert resumed == RESUMED_BY[point]
    engine.run([])
    for got, want in zip(requests, fault_free, strict=True):
        assert got.status is jaxkv.RequestStatus.FINISHED, got.req_id
        assert got.output == want.output, got.req_id
        assert len(got.logits) == len(want.logits)
        # Bit for bit, except after recomputing a lost cache (prefill
        # numerics instead of decode).
        tol = 2e-5 if resumed == "recomputed" else 0
        np.testing.assert_allclose(
            np.stack(got.logits), np.stack(want.logits), rtol=0, atol=tol
        )
    sched = engine.schedulers[0]
    assert not sched.has_unfinished
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks


def test_a_run_interrupted_twice_still_serves_everything(engine, fault_free):
    requests = _requests()
    reset_loop(engine, enable_prefix_caching=True)
    real = engine.programs
    calls = [0]

    class Flaky:
        def __call__(self, *args):
            calls[0] += 1
            if calls[0] in (2, 5):
                raise Fault("flaky")
            return real(*args)

    engine.runner.programs = Flaky()
    try:
        for _ in range(3):
            try:
                engine.run(requests)
                break
            except Fault:
                continue
    finally:
        engine.runner.programs = real
    assert [r.output for r in requests] == [r.output for r in fault_free]


def test_each_step_donates_the_pools_it_replaces(engine):
    # The step consumes the pools (no second copy alive): what a failing
    # device step loses, and why resume() must allocate new ones.
    reset_loop(engine)
    old = jax.tree.leaves(engine.pools)
    engine.run(_requests()[:1])
    assert all(x.is_deleted() for x in old)
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.pools))
