"""Run by tests/test_shard.py: one of two processes serving on one 2 x 4 mesh.

Each process has 4 simulated CPU devices; ``jax.distributed`` joins them over
the loopback address with gloo CPU collectives, so the mesh spans both
processes (data-parallel ranks on different processes). Both run the same
host loop (SPMD); process 0 also serves the requests on one local device and
prints ``OK`` if the tokens are identical.

    python tests/multihost_check.py PROCESS_ID PORT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402
from tests.mesh_cases import demo_config, demo_requests  # noqa: E402


def _requests() -> list[jaxkv.demo.EngineRequest]:
    return demo_requests(seed=1, count=5, new_tokens=4, arrival_every=2)


def main(process_id: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 8
    assert jax.local_device_count() == 4
    cfg = demo_config()
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=64, mesh=mesh)
    for pool in engine.pools:  # process-local allocation: 4 of the 8 shards here
        assert len(pool.addressable_shards) == 4
        assert not pool.is_fully_addressable
    engine.warm_up()
    got = _requests()
    engine.run(got)
    if process_id == 0:
        with jax.default_device(jax.local_devices()[0]):
            single = jaxkv.demo.Engine(cfg, model, num_blocks=64)
            single.warm_up()
            want = _requests()
            single.run(want)
        for a, b in zip(want, got, strict=True):
            assert a.output == b.output, (a.req_id, a.output, b.output)
        print("OK", [r.output for r in got])
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
