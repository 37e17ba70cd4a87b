"""Memory per device and step time against mesh shape (data x tensor).

Serves the same requests with the demo Engine on one device and on meshes of
simulated devices (`--meshes 1x2,2x1,2x2,...`): pools and weights per device,
and the step loop's ms per step with everything compiled beforehand (warm-up
excluded on every side). On CPU the simulated devices share this machine's
cores, so step times show the cost of running sharded (collectives, more
programs in flight), not a speed-up; memory per device is the figure that
carries over to accelerators.

    python benchmarks/bench_mesh.py --meshes 1x2,2x1,2x2,1x4,4x1,2x4,1x8,8x1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.demo  # noqa: E402


def _meshes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        d, t = part.lower().split("x")
        out.append((int(d), int(t)))
    return out


def _requests(n: int, max_prompt: int, new: int) -> list[jaxkv.demo.EngineRequest]:
    rng = np.random.default_rng(0)
    return [
        jaxkv.demo.EngineRequest(
            req_id=f"r{i}",
            prompt=rng.integers(1, 64, int(rng.integers(4, max_prompt))).tolist(),
            max_new_tokens=new,
        )
        for i in range(n)
    ]


def _serve(cfg: Any, model: Any, args: Any, mesh: Any) -> dict[str, Any]:
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=args.num_blocks, mesh=mesh)
    engine.warm_up()
    pools = sum(p.addressable_shards[0].data.nbytes for p in engine.pools)
    weights = sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(engine.state)
    )
    times = []
    outputs = None
    for _ in range(args.iters):
        reqs = _requests(args.num_requests, args.max_prompt, args.max_new_tokens)
        t0 = time.perf_counter()
        steps, _ = engine.run(reqs)
        times.append((time.perf_counter() - t0) / steps)
        outputs = [r.output for r in reqs]
    return {
        "pools_mib": pools / 2**20,
        "weights_mib": weights / 2**20,
        "ms_per_step": float(np.median(times)) * 1e3,
        "outputs": outputs,
    }


def run(args: Any) -> dict[str, Any]:
    meshes = _meshes(args.meshes)
    need = max(d * t for d, t in meshes)
    config: Any = jax.config
    try:  # simulated CPU devices, before the backend starts
        if config.jax_num_cpu_devices < need:
            config.update("jax_num_cpu_devices", need)
    except RuntimeError:
        pass
    cfg = jaxkv.tiny_hybrid_config(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=tuple(int(b) for b in args.token_buckets.split(",")),
        request_buckets=(args.max_num_seqs,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(0))
    base = _serve(cfg, model, args, None)
    rows = [
        {
            "mesh": "1 device",
            "pools MiB/device": base["pools_mib"],
            "weights MiB/device": base["weights_mib"],
            "ms/step": base["ms_per_step"],
            "pools vs 1": 1.0,
            "same tokens": "(reference)",  # what the mesh rows are compared with
        }
    ]
    skipped = []
    results: dict[str, Any] = {
        "single": {k: v for k, v in base.items() if k != "outputs"}
    }
    for d, t in meshes:
        if d * t > jax.device_count():
            skipped.append(f"{d}x{t}")
            continue
        mesh = jax.make_mesh((d, t), ("data", "tensor"))
        r = _serve(cfg, model, args, mesh)
        rows.append(
            {
                "mesh": f"{d}x{t}",
                "pools MiB/device": r["pools_mib"],
                "weights MiB/device": r["weights_mib"],
                "ms/step": r["ms_per_step"],
                "pools vs 1": r["pools_mib"] / base["pools_mib"],
                "same tokens": r["outputs"] == base["outputs"],
            }
        )
        results[f"{d}x{t}"] = {k: v for k, v in r.items() if k != "outputs"} | {
            "same_tokens": r["outputs"] == base["outputs"]
        }
    print_table(
        f"Mesh shapes (data x tensor): {args.num_requests} requests, "
        f"{args.num_heads}/{args.num_kv_heads} heads, {args.num_blocks} blocks per "
        "data-parallel rank",
        rows,
    )
    if skipped:
        print(f"skipped (need more devices than {jax.device_count()}): {skipped}")
    print(
        "pools per device shrink with the tensor axis (heads split) and stay the "
        "size of one rank's blocks along the data axis (each rank has its own)."
    )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Memory per device and step time against mesh shape.")
    p.add_argument("--meshes", default="1x2,2x1,2x2,1x4,4x1,2x4,1x8,8x1")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--token-buckets", default="8,32,64")
    p.set_defaults(iters=3)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_mesh",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
