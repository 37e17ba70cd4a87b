"""Run by tests/test_transfer.py: prefill in one process, decode in another,
the KV cache moved over ``jax.experimental.transfer`` on the loopback address.

``prefill DIR``: the demo hybrid model on blocks-first pools of block 16
computes each prompt and its first token, exports the cache and offers it
(``send_request``); writes its transfer server's address and the first tokens
to ``DIR/prefill.txt`` and serves until ``DIR/done`` appears (or 120 s).
``decode DIR``: the same model on K/V-first pools of block 64 pulls each cache
(``receive_request``), continues the request (``ServingLoop.adopt``) and
checks its tokens against a one-process run; prints ``OK``.
"""  # noqa: D205

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # never when pytest imports this file for doctests
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def _engine(backend: str, block_size: int) -> jaxkv.demo.Engine:
    return transfer_engine(backend, block_size)[0]


def _server() -> Any:
    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])


def prefill(folder: Path) -> None:
    engine = _engine("JAX_PAGED", 16)
    server = _server()
    firsts = []
    for i, prompt in enumerate(PROMPTS):
        req = jaxkv.Request(f"p{i}", prompt=prompt, max_new_tokens=NEW)
        engine.submit(req)
        while not req.output:
            engine.step()
        jaxkv.transfer.send_request(server, engine.export_request(req), uuid=10 * i)
        firsts.append(req.output[0])
        engine.scheduler.finish(req)
    info = {"address": server.address(), "first": firsts}
    (folder / "prefill.txt").write_text(json.dumps(info))
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
    engine = _engine("JAX_PAGED_KV_FIRST", 64)
    connection = _server().connect(info["address"])
    moved = []
    for i, prompt in enumerate(PROMPTS):
        kv = jaxkv.transfer.receive_request(connection, engine.plan, uuid=10 * i)
        assert kv.num_tokens == len(prompt), kv.num_tokens
        req = jaxkv.Request(
            f"d{i}", prompt=prompt + [info["first"][i]], max_new_tokens=NEW - 1
        )
        assert engine.adopt(req, kv)
        moved.append(req)
    while engine.has_unfinished:
        engine.step()
    (folder / "done").write_text("")
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
    (prefill if role == "prefill" else decode)(folder)
