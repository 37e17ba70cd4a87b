"""Run by tests/test_transfer.py: prefill in one process, decode in another,
the KV cache moved over ``jax.experimental.transfer`` on the loopback address.

``prefill DIR``: the demo hybrid model on blocks-first pools of block 16
computes each prompt and its first token, exports the cache and offers it
(``send_request``); writes its transfer server's address and the first tokens
to ``DIR/prefill.txt`` and serves until ``DIR/done`` appears (or 120 s).
``decode DIR``: the same model on K/V-first pools of block 64 pulls each cache
(``receive_request``), continues the request (``ServingLoop.adopt``) and
checks its tokens against a one-process run; prints ``OK``.

With ``mesh`` as a third argument each process simulates 4 CPU devices:
prefill runs on a 1x4 tensor-parallel mesh (the cache read from every tensor
rank, heads joined), decode on a 2x2 mesh (heads re-split, requests placed
on the data ranks).
"""  # noqa: D205

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # never when pytest imports this file for doctests
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[3:] == ["mesh"]:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_force_host_platform_device_count=4"
        )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import transfer  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402
from tests.mesh_cases import transfer_engine  # noqa: E402

PROMPTS = [
    np.random.default_rng(s).integers(1, 64, 30 + 11 * s).tolist() for s in range(3)
]
NEW = 6


MESH: tuple[int, int] | None = None  # set by ``mesh``: this process's mesh


def _engine(
    backend: str, block_size: int, mesh: tuple[int, int] | None = None
) -> jaxkv.demo.Engine:
    m = None if mesh is None else jax.make_mesh(mesh, ("data", "tensor"))
    # 4 query heads split over 4 tensor ranks (the 2 KV heads replicated).
    heads = 4 if MESH else 2
    return transfer_engine(backend, block_size, mesh=m, num_heads=heads)[0]


def _server() -> Any:
    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])


def prefill(folder: Path) -> None:
    engine = _engine("JAX_PAGED", 16, (1, 4) if MESH else None)
    server = _server()
    firsts = []
    for i, prompt in enumerate(PROMPTS):
        req = jaxkv.Request(f"p{i}", prompt=prompt, max_new_tokens=NEW)
        engine.submit(req)
        while not req.output:
            engine.step()
        jaxkv.transfer.send_request(server, engine.export_request(req), uuid=10 * i)
        firsts.append(req.output[0])
        next(s for s in engine.schedulers if req in s.running).finish(req)
    info = {"address": server.address(), "first": firsts}
    # Atomically: the decode process polls for the file and must never read
    # it created but not yet written.
    (folder / "prefill.tmp").write_text(json.dumps(info))
    (folder / "prefill.tmp").replace(folder / "prefill.txt")
    deadline = time.time() + 120
    while not (folder / "done").exists() and time.time() < deadline:
        time.sleep(0.1)


def decode(folder: Path) -> None:
    deadline = time.time() + 120
    while not (folder / "prefill.txt").exists():
        if time.time() > deadline:
            raise TimeoutError("no prefill.txt")
        time.sleep(0.1)
    info = json.loads((folder / "prefill.txt").read_text())
    engine = _engine("JAX_PAGED_KV_FIRST", 64, (2, 2) if MESH else None)
    # The arrays pulled are the global model's (all heads): shaped by a plan
    # of it (on a mesh, engine.plan is a rank's, with its local heads).
    shapes = engine.plan if not MESH else _engine("JAX_PAGED_KV_FIRST", 64).plan
    connection = _server().connect(info["address"])
    moved = []
    for i, prompt in enumerate(PROMPTS):
        kv = jaxkv.transfer.receive_request(connection, shapes, uuid=10 * i)
        assert kv.num_tokens == len(prompt), kv.num_tokens
        req = jaxkv.Request(
            f"d{i}", prompt=prompt + [info["first"][i]], max_new_tokens=NEW - 1
        )
        assert engine.adopt(req, kv)
        moved.append(req)
    while engine.has_unfinished:
        engine.step()
    (folder / "done").write_text("")
    if MESH:
        steps = [s.stats["steps"] for s in engine.schedulers]
        assert all(steps), ("a data rank left idle", steps)
    # One process, never moved.
    ref = _engine("JAX_PAGED", 16)
    want = [
        jaxkv.Request(f"r{i}", prompt=p, max_new_tokens=NEW)
        for i, p in enumerate(PROMPTS)
    ]
    for r in want:
        ref.submit(r)
    while ref.has_unfinished:
        ref.step()
    for i, (got, w) in enumerate(zip(moved, want, strict=True)):
        tokens = [info["first"][i], *got.output]
        assert tokens == w.output, (i, tokens, w.output)
    print("OK")


if __name__ == "__main__":
    role, folder = sys.argv[1], Path(sys.argv[2])
    if sys.argv[3:] == ["mesh"]:
        assert jax.device_count() == 4, jax.device_count()
        MESH = (1, 4) if role == "prefill" else (2, 2)
    (prefill if role == "prefill" else decode)(folder)
