"""Run by tests/test_shard.py in a subprocess: the demo Engine on a mesh.

Serves the same requests on one device and on each ``D x T`` mesh given
(``python tests/engine_mesh_check.py [--quant MODE] 1x8 2x4``; ``MODE`` a
``kv_quant_mode``: 8-bit pages whose scales shard with their heads) of simulated
CPU devices (tensor-parallel heads, data-parallel requests) and checks that
greedy tokens are identical, logits equal within float32 rounding, nothing
compiles after warm-up, every device holds 1/(D*T) of the pools, and the
compiled step programs have no collective but the model's small all-reduces.
Prints ``OK``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402
from jaxkv import count_compilations  # noqa: E402
from tests.mesh_cases import demo_config, demo_requests  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

_SHAPE = re.compile(r"(f32|s32|u32|bf16|f16|pred|u8|s8)\[([0-9,]*)\]")
_BYTES = {
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "pred": 1,
    "u8": 1,
    "s8": 1,
}


def _requests() -> list[jaxkv.demo.EngineRequest]:
    return demo_requests(seed=0, count=6, new_tokens=5, arrival_every=3)


def main(meshes: list[tuple[int, int]], quant: str = "none") -> None:
    cfg = demo_config(quant)
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(0))
    single = jaxkv.demo.Engine(cfg, model, num_blocks=512, record_logits=True)
    single.warm_up()
    want = _requests()
    single.run(want)
    for d, t in meshes:
        _check_mesh(cfg, model, want, d, t, quantized=quant != "none")
        print(f"{d}x{t} {quant} OK")
    print("OK")


def _check_mesh(
    cfg: jaxkv.RunnerConfig,
    model: jaxkv.demo.TinyHybridModel,
    want: list[jaxkv.demo.EngineRequest],
    d: int,
    t: int,
    *,
    quantized: bool,
) -> None:
    mesh = jax.make_mesh((d, t), ("data", "tensor"))
    engine = jaxkv.demo.Engine(
        cfg, model, num_blocks=512, mesh=mesh, record_logits=True
    )
    engine.warm_up()
    got = _requests()
    with count_compilations() as compiles:
        engine.run(got)
    assert compiles == [], compiles
    # Fast prefill armed on the mesh too (staged per data rank by the builder).
    assert engine.counters["fast_prefill_armed"] > 0, engine.counters
    for a, b in zip(want, got, strict=True):
        assert a.output == b.output, (a.req_id, a.output, b.output)
        # 8-bit pages: a K/V value rounded across a quantization step by the
        # model's all-reduce order moves a logit by about one step's share.
        tol = 2e-3 if quantized else 1e-4
        np.testing.assert_allclose(
            np.stack(b.logits), np.stack(a.logits), rtol=tol, atol=tol
        )
    assert len({r.rank for r in got}) == min(d, len(got))  # ranks share the load

    per_device = 0  # 512 blocks: pools (MiBs) large next to activations
    for pool in engine.pools:
        shards = pool.addressable_shards
        assert len(shards) == d * t
        assert all(s.data.nbytes * d * t == pool.nbytes for s in shards)
        per_device += shards[0].data.nbytes
    for exe in engine.programs.executables():
        text = exe.as_text() or ""
        for op in ("all-gather", "all-to-all", "collective-permute"):
            assert f" {op}(" not in text, op
            assert f"{op}-start(" not in text, op
        for line in text.splitlines():
            if "all-reduce(" not in line and "all-reduce-start(" not in line:
                continue
            lhs = line.split("=", 1)[1] if "=" in line else line
            m = _SHAPE.search(lhs)
            assert m is not None, line
            n = int(np.prod([int(x) for x in m.group(2).split(",") if x] or [1]))
            size = n * _BYTES[m.group(1)]
            assert size * 10 <= per_device, (size, per_device, line[:200])
        analysis = exe.memory_analysis()
        assert analysis.temp_size_in_bytes <= per_device, analysis


if __name__ == "__main__":
    argv = sys.argv[1:]
    mode = "none"
    if argv[:1] == ["--quant"]:
        mode, argv = argv[1], argv[2:]
    main([(int(m.split("x")[0]), int(m.split("x")[1])) for m in argv], mode)
