"""Shared benchmark harness: compile apart, warm-up, block_until_ready, medians."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxkv


def paged_layers(
    dtype: str,
    block: int,
    heads: int,
    head: int,
    num_blocks: int,
    count: int = 1,
    storage: str = "words",
    tensor_layout: str | None = None,
) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """`count` full-attention JAX_PAGED layers, one pool of `num_blocks` each
    (`storage`: ``"words"``, ``"typed"`` or ``"stacked"``, as in ``make_plan``).

    With `tensor_layout` (a vLLM 0.33 ``TensorLayout`` name, e.g. ``"LHBNC"``)
    the layers are one tensor of that layout in a flat word pool instead,
    their views where vLLM 0.33 puts them (``jaxkv.vllm.tensor_views``).

    Returns:
      ``(kv_cache_config, attention groups, pools, views in layer order)``.
    """
    spec = jaxkv.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype
    )
    names = [f"layers.{i}" for i in range(count)]
    backend = jaxkv.get_backend("JAX_PAGED")
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name=n, spec=spec, backend=backend) for n in names]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=num_blocks)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups, storage=storage)
    if tensor_layout is not None:
        layout = jaxkv.vllm.TensorLayout[tensor_layout]
        shape, strides = jaxkv.vllm.layout_strides(
            spec, num_blocks=num_blocks, num_layers=count, layout=layout
        )
        size = int(np.prod(shape))  # bytes: the content axis is in bytes
        tensor = jaxkv.vllm.LayerTensor(
            size=size,
            layers=tuple(names),
            layer_stride=strides[0],
            block_stride=strides[1],
        )
        pool_specs, views = jaxkv.vllm.allocate_layer_tensors(
            [tensor], dict.fromkeys(names, spec), num_blocks=num_blocks, layout=layout
        )
        pools = jaxkv.plan.allocate_pools(pool_specs)
    return kv, groups, pools, tuple(views[n] for n in names)


def measure(fn: Any, *args: Any, iters: int = 50) -> tuple[float, float]:
    """Returns (compile seconds, median steady-state seconds) of a jitted fn."""
    t0 = time.perf_counter()
    compiled: Callable[..., Any] = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - t0)
    return compile_s, statistics.median(samples)


def measure_donated(
    fn: Any, state: Any, *args: Any, iters: int = 50
) -> tuple[float, float, Any]:
    """Like :func:`measure` for ``state = fn(state, *args)`` with `state` donated.

    Returns:
      (compile seconds, median seconds, final state).
    """
    t0 = time.perf_counter()
    compiled: Callable[..., Any] = fn.lower(state, *args).compile()
    compile_s = time.perf_counter() - t0
    state = jax.block_until_ready(compiled(state, *args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state = jax.block_until_ready(compiled(state, *args))
        samples.append(time.perf_counter() - t0)
    return compile_s, statistics.median(samples), state


def measure_pipelined(
    compiled: Callable[..., Any],
    state: Any,
    *args: Any,
    calls: int = 20,
    rounds: int = 20,
) -> tuple[float, Any]:
    """Per-call seconds of `calls` chained calls ``state = compiled(state, *args)``.

    Calls are dispatched back to back and waited for once, as a step loop does:
    the runtime's per-call wake-up of the caller is paid once per round, not per
    call. Returns (median over `rounds`, final state).
    """
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            state = compiled(state, *args)
        state = jax.block_until_ready(state)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples), state


def measure_host(fn: Callable[[], Any], iters: int = 50) -> float:
    """Median seconds of a host (NumPy) callable."""
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the common flags (--iters, --json)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path, default=None, help="write results here")
    return p


def add_attention_shape_args(p: argparse.ArgumentParser) -> None:
    """Layer-shape flags of the attention benchmarks: heads, head dim, page, dtype."""
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", default="float32")


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Prints rows (dicts with the same keys) as an aligned table."""
    print(f"\n{title}  [{jax.default_backend()}: {jax.devices()[0].device_kind}]")
    keys = list(rows[0])
    cells = [[_fmt(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_json(path: Path | None, name: str, payload: dict[str, Any]) -> None:
    """Writes `payload` to `path`, or to $OUT/<name>.json when OUT is set."""
    if path is None and os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"{name}.json"
    if path is None:
        return
    payload = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        **payload,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


#: The GQA decoder of bench_serve.py and bench_offload.py: vocabulary, width.
GQA_VOCAB, GQA_D = 256, 128


def gqa_params(layers: int, heads: int, kv_heads: int, head: int) -> dict[str, Any]:
    """Random weights of the GQA decoder (`layers` attention layers)."""
    keys = iter(jax.random.split(jax.random.key(0), 4 * layers + 2))
    return {
        "embed": jax.random.normal(next(keys), (GQA_VOCAB, GQA_D)),
        "layers": [
            {
                "wq": jax.random.normal(next(keys), (GQA_D, heads, head)) / 11,
                "wk": jax.random.normal(next(keys), (GQA_D, kv_heads, head)) / 11,
                "wv": jax.random.normal(next(keys), (GQA_D, kv_heads, head)) / 11,
                "wo": jax.random.normal(next(keys), (heads * head, GQA_D)) / 11,
            }
            for _ in range(layers)
        ],
        "unembed": jax.random.normal(next(keys), (GQA_D, GQA_VOCAB)),
    }


def default_implementation() -> str | None:
    """The kernels the benchmarks run: jaxkv's C++ kernels on CPU (opt-in,
    named), the platform's choice (``None``: Pallas) on accelerators.
    """  # noqa: D205
    import jax

    return "native" if jax.default_backend() == "cpu" else None


def gqa_forward(
    layers: Any, scale: float, implementation: str | None = None
) -> Callable[..., Any]:
    """The GQA decoder's step through jaxkv (a ``ServingLoop`` forward) over
    `layers` (``plan.attention_layer(name)`` each), its writes and attention
    on `implementation` (``"native"``: the C++ decode kernel for rows of one
    token, XLA's path for prefill chunks, which it does not take).
    """  # noqa: D205
    import jax.numpy as jnp

    def forward(params, pools, meta, tokens, sample):
        x = params["embed"][tokens]
        for layer, w in zip(layers, params["layers"], strict=True):
            q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in ("wq", "wk", "wv"))
            m = meta[layer.name]
            pools = jaxkv.write_kv(
                pools, layer.view, k, v, m.slot_mapping, implementation=implementation
            )
            decode = q.shape[0] <= m.max_reqs  # rows of one token
            attend = (
                "xla" if implementation == "native" and not decode else implementation
            )
            out = jaxkv.paged_attention(
                q, pools, layer, m, scale=scale, implementation=attend
            )
            x = x + out.reshape(x.shape[0], -1) @ w["wo"]
        return pools, x[sample] @ params["unembed"]

    return forward
