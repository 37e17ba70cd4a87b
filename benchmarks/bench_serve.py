"""Steady decoding through ``jaxkv.ServingLoop`` against a dense-cache decode loop.

One small GQA decoder (``--layers`` attention layers, random weights), two
ways, same batch, same tokens, compilation excluded on both sides:

* **jaxkv**: ``ServingLoop`` (paged pools, Scheduler, one compiled program per
  bucket), multi-step (``decode_steps``, as vLLM's ``num_scheduler_steps``)
  and one step at a time, each with ``overlap=True`` (the next step or block
  of iterations scheduled, packed and dispatched while the one before runs,
  its tokens kept on the device) and ``overlap=False`` (each read before the
  next is scheduled). Beside them the device time: every program call the
  loop made, replayed back to back on the same inputs; wall minus it is the
  time the device waited on the host.
* **dense**: the same model with a dense ``(batch, max_len)`` KV cache per
  layer, every decode step inside one jitted ``lax.fori_loop`` (no host work
  at all): the floor.

Prints ms per decode step of each, the device-idle time per jaxkv step with
and without overlap, and jaxkv (overlap) / dense (target <= 1.5x at batch 16
with the host hidden).

    python benchmarks/bench_serve.py --batch 16 --prompt 32 --new 64
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    GQA_VOCAB,
    default_implementation,
    gqa_forward,
    gqa_params,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402

VOCAB = GQA_VOCAB


class Measured(NamedTuple):
    """One loop's run: wall and device seconds per decode step (or
    iteration), its outputs, compilations, and its recorded dispatches that
    found the device idle, of all of them.
    """  # noqa: D205

    wall: float
    device: float
    outputs: list[list[int]]
    compiles: int
    found_idle: int
    dispatches: int


class Recorder:
    """A loop's ``Programs``, recording each call made while ``on``, to be
    replayed back to back (:meth:`replay`).
    """  # noqa: D205

    def __init__(self, programs: Any) -> None:
        self.programs = programs
        self.calls: list[tuple[Any, ...]] = []
        self.on = False
        # Recorded calls that found the device idle: the previous call's
        # tokens already computed when this one was dispatched (the device
        # then waited on the host). With the host hidden, none do.
        self.found_idle = 0
        self._last: Any = None

    def __call__(self, key: Any, pools: Any, params: Any, *rest: Any) -> Any:
        if self.on:
            self.calls.append((key, *rest))
            self.found_idle += self._last is not None and self._last.is_ready()
        out = self.programs(key, pools, params, *rest)
        self._last = out[1]
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.found_idle = 0
        self._last = None

    def replay(self, pools: Any, params: Any) -> tuple[Any, list[float]]:
        """Runs every recorded call again, each waited for; returns the pools
        and each call's seconds (its program on the device, the transfer of
        its inputs included, as in the loop).
        """  # noqa: D205
        times = []
        for key, *rest in self.calls:
            t0 = time.perf_counter()
            pools, tokens, *_ = self.programs(key, pools, params, *rest)
            jax.block_until_ready(tokens)
            times.append(time.perf_counter() - t0)
        self.calls.clear()
        return pools, times


def run(args: Any) -> dict[str, Any]:
    heads, kv_heads, head = args.heads, args.kv_heads, args.head
    max_len = args.prompt + args.new
    # A decode block of more iterations than a request can decode is refused.
    args.decode_steps = min(args.decode_steps, max_len)
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        block_size=16,
        max_model_len=max_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.prompt,
        token_buckets=(args.batch, args.batch * args.prompt),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=args.batch * (-(-max_len // 16)) + 2)
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]
    params = gqa_params(args.layers, heads, kv_heads, head)
    scale = head**-0.5

    forward = gqa_forward(layers, scale, default_implementation())

    loop = jaxkv.ServingLoop(plan, forward, params)
    warm_s = loop.warm_up()
    num_programs = len(loop.programs)
    multi = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        execution=jaxkv.ExecutionOptions(decode_steps=args.decode_steps),
    )
    multi.warm_up()
    # Every program call the loops make while they are timed is recorded, then
    # replayed back to back (the same programs on the same inputs, each
    # waited for): the device's own time for that work. Wall minus it is the
    # time the device waited on the host.
    loop.runner.programs = Recorder(loop.runner.programs)  # type: ignore[assignment]
    multi.runner.decode_programs = Recorder(multi.runner.decode_programs)  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, VOCAB, (args.batch, args.prompt))

    def requests() -> list[jaxkv.Request]:
        return [
            jaxkv.Request(f"r{i}", prompt=p.tolist(), max_new_tokens=args.new)
            for i, p in enumerate(prompts)
        ]

    def decode_steps(overlap: bool) -> Measured:
        """Median wall time of a steady decode step and median device time of
        the steps they dispatched.
        """  # noqa: D205
        loop.set_overlap(overlap)
        loop.reset()
        reqs = requests()
        for r in reqs:
            loop.submit(r)
        walls = []
        recorder = cast(Recorder, loop.runner.programs)
        recorder.reset()
        with jaxkv.count_compilations() as compiles:
            while loop.has_unfinished:
                running = loop.scheduler.running
                decode = bool(running) and not loop.scheduler.waiting
                decode = decode and all(
                    r.num_computed >= len(r.prompt) for r in running
                )
                recorder.on = decode
                t0 = time.perf_counter()
                loop.step()
                if decode:
                    walls.append(time.perf_counter() - t0)
        recorder.on = False
        idle, dispatches = recorder.found_idle, len(recorder.calls)
        loop.pools, times = recorder.replay(loop.pools, params)
        return Measured(
            wall=statistics.median(walls),
            device=statistics.median(times),
            outputs=[r.output for r in reqs],
            compiles=len(compiles),
            found_idle=idle,
            dispatches=dispatches,
        )

    def multi_steps(overlap: bool) -> Measured:
        """Wall time per decode iteration of the multi-step loop: from the
        prefill's tokens read (``resume()``) to the last token, over the
        iterations run (every call counts, the last blocks' reads included);
        the device's time for the same blocks, per iteration. With overlap,
        each block is dispatched before the one in flight is read.
        """  # noqa: D205
        multi.set_overlap(overlap)
        multi.reset()
        reqs = requests()
        for r in reqs:
            multi.submit(r)
        recorder = cast(Recorder, multi.runner.decode_programs)
        recorder.reset()
        with jaxkv.count_compilations() as compiles:
            multi.step()  # the prefill
            multi.resume()  # its tokens read (with overlap it is in flight)
            before = multi.counters["decode_iterations"]
            recorder.on = True
            t0 = time.perf_counter()
            while multi.has_unfinished:
                multi.step()
            total = time.perf_counter() - t0
            recorder.on = False
        iterations = multi.counters["decode_iterations"] - before
        if iterations < args.new // 2:
            raise RuntimeError(
                f"bench_serve: only {iterations} of {args.new} decode iterations "
                "ran as multi-step blocks"
            )
        idle, dispatches = recorder.found_idle, len(recorder.calls)
        multi.pools, times = recorder.replay(multi.pools, params)
        return Measured(
            wall=total / iterations,
            device=sum(times) / iterations,
            outputs=[r.output for r in reqs],
            compiles=len(compiles),
            found_idle=idle,
            dispatches=dispatches,
        )

    # jaxkv, each way (the loops' walls, then their device time).
    multi_on, multi_off = multi_steps(True), multi_steps(False)
    one_off, one_on = decode_steps(False), decode_steps(True)

    # dense: the whole decode in one fori_loop.
    def layer_step(x, w, kc, vc, pos):
        q, k, v = (jnp.einsum("bd,dhk->bhk", x, w[n]) for n in ("wq", "wk", "wv"))
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k[:, None], pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v[:, None], pos, axis=1)
        g = heads // kv_heads
        qg = q.reshape(q.shape[0], kv_heads, g, head)
        s = jnp.einsum("bhgd,blhd->bhgl", qg, kc) * scale
        s = jnp.where(jnp.arange(max_len)[None, None, None] <= pos, s, -jnp.inf)
        out = jnp.einsum("bhgl,blhd->bhgd", jax.nn.softmax(s, axis=-1), vc)
        return x + out.reshape(x.shape[0], -1) @ w["wo"], kc, vc

    def prefill(params, prompt):
        caches = []
        x = params["embed"][prompt]  # (B, P, D)
        p = prompt.shape[1]
        causal = jnp.arange(p)[:, None] >= jnp.arange(p)[None]
        for w in params["layers"]:
            q, k, v = (jnp.einsum("bpd,dhk->bphk", x, w[n]) for n in ("wq", "wk", "wv"))
            kr, vr = (
                jnp.repeat(k, heads // kv_heads, 2),
                jnp.repeat(v, heads // kv_heads, 2),
            )
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) * scale
            s = jnp.where(causal[None, None], s, -jnp.inf)
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vr)
            x = x + out.reshape(x.shape[0], p, -1) @ w["wo"]
            pad = ((0, 0), (0, max_len - p), (0, 0), (0, 0))
            caches.append((jnp.pad(k, pad), jnp.pad(v, pad)))
        return jnp.argmax(x[:, -1] @ params["unembed"], -1), caches

    @jax.jit
    def dense_decode(params, token, caches):
        def body(i, carry):
            token, caches, out = carry
            x = params["embed"][token]
            new = []
            for w, (kc, vc) in zip(params["layers"], caches, strict=True):
                x, kc, vc = layer_step(x, w, kc, vc, args.prompt + i)
                new.append((kc, vc))
            token = jnp.argmax(x @ params["unembed"], -1).astype(jnp.int32)
            return token, new, out.at[:, i].set(token)

        out = jnp.zeros((token.shape[0], args.new - 1), jnp.int32)
        return jax.lax.fori_loop(0, args.new - 1, body, (token, caches, out))[2]

    first, caches = jax.jit(prefill)(params, jnp.asarray(prompts))
    first = first.astype(jnp.int32)
    compiled = dense_decode.lower(params, first, caches).compile()
    dense_out = np.asarray(compiled(params, first, caches))
    times = []
    for _ in range(max(3, args.iters // 10)):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, first, caches))
        times.append(time.perf_counter() - t0)
    dense = statistics.median(times) / (args.new - 1)
    outputs = one_on.outputs
    same = [o[1:] for o in outputs] == dense_out.tolist() and [
        o[0] for o in outputs
    ] == np.asarray(first).tolist()
    runs = (multi_on, multi_off, one_on, one_off)
    same = same and all(m.outputs == outputs for m in runs)
    compiles = sum(m.compiles for m in runs)

    def row(path: str, m: Measured) -> dict[str, Any]:
        return {
            "path": path,
            "ms/step": m.wall * 1e3,
            "device ms": m.device * 1e3,
            "wall - device ms": (m.wall - m.device) * 1e3,
            "found device idle": f"{m.found_idle}/{m.dispatches}",
            "tokens/s": args.batch / m.wall,
        }

    k = args.decode_steps
    rows = [
        row(f"jaxkv ServingLoop, decode_steps={k}, overlap, per iteration", multi_on),
        row(
            f"jaxkv ServingLoop, decode_steps={k}, no overlap, per iteration", multi_off
        ),
        row("jaxkv ServingLoop, one step at a time, overlap", one_on),
        row("jaxkv ServingLoop, one step at a time, no overlap", one_off),
        {
            "path": "dense cache, lax.fori_loop",
            "ms/step": dense * 1e3,
            "device ms": dense * 1e3,
            "wall - device ms": 0.0,
            "found device idle": "-",
            "tokens/s": args.batch / dense,
        },
    ]
    print_table(
        f"Decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.layers} layers {heads}/{kv_heads} heads x {head}; "
        f"{num_programs} programs warmed up in {warm_s:.1f} s. device: the same "
        "program calls replayed back to back; found device idle: dispatches "
        "made after the previous one had finished",
        rows,
    )
    print(
        f"\njaxkv multi-step (decode_steps={k}) with overlap / dense: "
        f"{multi_on.wall / dense:.2f}x per decode step (target <= 1.5x, host "
        f"hidden: {multi_on.found_idle} of {multi_on.dispatches} blocks "
        f"dispatched onto an idle device; without overlap "
        f"{multi_off.wall / dense:.2f}x, {multi_off.found_idle} of "
        f"{multi_off.dispatches}); one step at a time: overlap / dense "
        f"{one_on.wall / dense:.2f}x ({one_on.found_idle} of {one_on.dispatches} "
        f"idle), no overlap / dense {one_off.wall / dense:.2f}x "
        f"({one_off.found_idle} of {one_off.dispatches}); device program / "
        f"dense: {one_on.device / dense:.2f}x; same tokens (dense, all loops): "
        f"{same}; compiles while serving: {compiles}"
    )
    return {
        "multi_ms": multi_on.wall * 1e3,
        "multi_over_dense": multi_on.wall / dense,
        "multi_device_ms": multi_on.device * 1e3,
        "multi_found_idle": multi_on.found_idle,
        "multi_dispatches": multi_on.dispatches,
        "multi_no_overlap_ms": multi_off.wall * 1e3,
        "multi_no_overlap_over_dense": multi_off.wall / dense,
        "multi_no_overlap_found_idle": multi_off.found_idle,
        "wall_ms": one_on.wall * 1e3,
        "wall_no_overlap_ms": one_off.wall * 1e3,
        "device_ms": one_on.device * 1e3,
        "found_idle": one_on.found_idle,
        "found_idle_no_overlap": one_off.found_idle,
        "dispatches": one_on.dispatches,
        "dense_ms": dense * 1e3,
        "jaxkv_over_dense": one_on.wall / dense,
        "no_overlap_over_dense": one_off.wall / dense,
        "device_over_dense": one_on.device / dense,
        "same_tokens": same,
        "compiles": compiles,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Steady decoding through ServingLoop vs a dense-cache decode loop.")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=16)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_serve",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
