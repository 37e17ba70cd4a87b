"""Run by tests/test_shard.py in a subprocess: a fault on one data-parallel
rank of two, at every point of a step, resumes to the fault-free tokens.

The demo Engine (a ServingLoop) on a 2x1 mesh of simulated CPU devices, with
overlap on and off: an exception raised by rank 1's scheduler while it
advances or resolves a step (rank 0 already done), and by the
device step, is recovered by ``run()`` again (each rank's step applied once,
never twice), and the tokens equal the run without a fault. Prints ``OK``.
"""  # noqa: D205

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402
from tests.mesh_cases import demo_config, demo_requests  # noqa: E402


class Fault(Exception):
    """The injected fault."""


def _requests() -> list[jaxkv.demo.EngineRequest]:
    return demo_requests(seed=1, count=6, new_tokens=5, arrival_every=2)


def _serve(
    engine: jaxkv.demo.Engine, fault: tuple[str, int] | None = None
) -> dict[str, list[int]]:
    reqs = _requests()
    engine.reset()  # new schedulers: the fault goes into these
    faults = [0]
    if fault is not None:
        _inject(engine, *fault, faults)
    for _ in range(50):
        try:
            engine.run(reqs)  # after a fault: resumes, requests not added twice
            break
        except Fault:
            continue
    assert faults[0] == (fault is not None), faults  # it fired, once
    return {r.req_id: list(r.output) for r in reqs}


def _inject(engine: jaxkv.demo.Engine, method: str, at: int, faults: list[int]) -> None:
    """Rank 1's scheduler raises on its `at`-th call of `method` (once)."""
    sched = engine.schedulers[1]
    real = getattr(sched, method)
    calls = [0]

    def faulty(*args, **kw):
        calls[0] += 1
        if calls[0] == at:
            faults[0] += 1
            raise Fault(method)
        return real(*args, **kw)

    setattr(sched, method, faulty)


def main() -> None:
    cfg = demo_config()
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 1), ("data", "tensor"))
    for overlap in (True, False):
        engine = jaxkv.demo.Engine(
            cfg, model, num_blocks=256, mesh=mesh, overlap=overlap
        )
        engine.warm_up()
        want = _serve(engine)
        assert all(want.values()), want
        # One pipeline either way: every step is advanced, then resolved.
        for method in ("advance", "resolve"):
            for at in (2, 5):
                # The same engine (its programs compiled once): _serve resets
                # its schedulers, and the fault goes into the new ones.
                got = _serve(engine, (method, at))
                assert got == want, (overlap, method, at, got, want)
                print(f"overlap={overlap} {method}@{at} OK")
    print("OK")


if __name__ == "__main__":
    main()
