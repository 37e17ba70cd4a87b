"""``python -m jaxkv``: serve synthetic requests on the built-in hybrid model.

Builds the model's specs and config, groups the layers (init_attn_backend),
allocates the shared pools and views, compiles one step per bucket, serves the
requests with continuous batching and chunked prefill, and checks the greedy
outputs against the dense (unpaged) model.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxkv import (
    AttentionBackend,
    KVCacheLayout,
    RunnerConfig,
    count_compilations,
    tiny_hybrid_config,
)
from jaxkv.demo._engine import Engine, EngineRequest
from jaxkv.demo._model import TinyHybridModel
from jaxkv.demo._oracle import generate_dense
from jaxkv.serve import size_loop_kv_cache
from jaxkv.vllm import MultipleOf


def _buckets(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--token-buckets takes comma-separated positive ints, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(
            f"--token-buckets takes comma-separated positive ints, got {text!r}"
        )
    return out


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least `minimum` (a usage error otherwise)."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _num_blocks(text: str) -> int | str:
    """An argparse type: a positive int, or ``auto`` (sized from memory)."""
    return "auto" if text == "auto" else _positive(text)


def _even(text: str) -> int:
    """An argparse type: a positive even int (rotary embeddings rotate pairs)."""
    value = _positive(text)
    if value % 2:
        raise argparse.ArgumentTypeError(
            f"expected an even head size (rotary embeddings rotate pairs), got {text!r}"
        )
    return value


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        data, tensor = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh takes DATAxTENSOR, e.g. 2x4, got {text!r}"
        ) from None
    if data < 1 or tensor < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
    return data, tensor


def _make_mesh(data: int, tensor: int) -> jax.sharding.Mesh:
    """A data x tensor mesh; on CPU, simulated devices when there are too few."""
    need = data * tensor
    config: Any = jax.config
    if config.jax_platforms in (None, "", "cpu"):
        try:  # before the backend starts; simulated CPU devices
            if config.jax_num_cpu_devices < need:
                jax.config.update("jax_num_cpu_devices", need)
        except RuntimeError:
            pass  # the backend already started: use the devices there are
    if jax.device_count() < need:
        raise SystemExit(
            f"--mesh {data}x{tensor} needs {need} devices, found "
            f"{jax.device_count()} ({jax.default_backend()})."
        )
    return jax.make_mesh((data, tensor), ("data", "tensor"))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the process exit code (1 if outputs differ)."""
    args = _parser().parse_args(argv)
    mesh = None if args.mesh is None else _make_mesh(*args.mesh)
    cfg = _runner_config(args)
    model, engine = _engine(args, cfg, mesh)
    requests = _serve(args, engine)
    if args.no_check:
        return 0
    served = [r for r in requests if r.reject_reason is None]
    max_len = max(len(r.prompt) for r in requests) + args.max_new_tokens
    matches = sum(
        generate_dense(model, r.prompt, r.max_new_tokens, max_len) == r.output
        for r in served
    )
    print(f"greedy outputs match the dense oracle: {matches}/{len(served)} requests")
    if args.kv_cache_dtype != "auto":
        # 8-bit pages round K and V: greedy tokens may part from the float
        # oracle's; how many agree is the measure.
        agree = total = 0
        for r in served:
            want = generate_dense(model, r.prompt, r.max_new_tokens, max_len)
            agree += sum(a == b for a, b in zip(want, r.output, strict=False))
            total += len(want)
        print(
            f"{args.kv_cache_dtype} KV cache: {agree}/{total} greedy tokens as the "
            "float oracle's"
        )
        return 0
    return 0 if matches == len(served) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxkv",
        description="Serve synthetic requests on the built-in hybrid model.",
    )
    p.add_argument("--num-requests", type=_positive, default=8)
    p.add_argument("--max-new-tokens", type=_positive, default=12)
    p.add_argument("--num-heads", type=_positive, default=4)
    p.add_argument("--num-kv-heads", type=_positive, default=2)
    p.add_argument("--head-size", type=_even, default=32)
    p.add_argument("--block-size", type=_positive, default=32)
    p.add_argument(
        "--kernel-block-size",
        type=_non_negative,
        default=0,
        help="attention backend kernel block (0: same as block size)",
    )
    p.add_argument(
        "--vocab-size",
        type=_int_at_least(2),
        default=128,
        help="token ids (prompts draw from 1 .. vocab_size - 1)",
    )
    p.add_argument("--token-buckets", type=_buckets, default=(8, 32, 64))
    p.add_argument("--max-num-seqs", type=_positive, default=8)
    p.add_argument(
        "--num-blocks",
        type=_num_blocks,
        default=96,
        help="blocks per pool, or auto: sized from --memory-bytes (size_kv_cache)",
    )
    p.add_argument(
        "--memory-bytes",
        type=_positive,
        default=None,
        help="with --num-blocks auto: bytes per device for the step and its pools "
        "(needed on CPU, which reports no memory limit)",
    )
    p.add_argument("--no-fast-prefill", action="store_true")
    p.add_argument(
        "--prefix-caching", action="store_true", help="reuse cached prompt prefixes"
    )
    p.add_argument(
        "--shared-prefix",
        type=_non_negative,
        default=0,
        help="tokens every prompt starts with (a shared system prompt)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="8-bit KV pages: fp8 (a static scale per tensor, vLLM's 'fp8'), or "
        "int8/fp8 with a scale per token and head (docs/quantization.md)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the dense oracle")
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument(
        "--mesh",
        type=_mesh_shape,
        default=None,
        help="serve over a DATAxTENSOR device mesh, e.g. 2x4 (simulated on CPU)",
    )
    p.add_argument(
        "--implementation",
        choices=("xla", "pallas", "native"),
        default=None,
        help="the kernels of the writes and attention (default: the platform's "
        "choice, jaxkv.paged_attention's table; native: jaxkv's C++ kernels "
        "on CPU, one device)",
    )
    return p


KV_CACHE_DTYPES = {
    "auto": "none",
    "fp8": "fp8_per_tensor",
    "int8_per_token_head": "int8_per_token_head",
    "fp8_per_token_head": "fp8_per_token_head",
}
"""``--kv-cache-dtype`` (vLLM's names) and the spec's ``kv_quant_mode``."""


def _runner_config(args: argparse.Namespace) -> RunnerConfig:
    """The built-in hybrid model's config for the command line's options."""
    backend: str | AttentionBackend = "JAX_PAGED"
    if args.kernel_block_size:
        backend = AttentionBackend(
            name=f"JaxPagedK{args.kernel_block_size}Backend",
            layout=KVCacheLayout.BLOCKS_FIRST,
            supported_kernel_block_sizes=(args.kernel_block_size,),
        )
    else:
        backend = AttentionBackend(
            name="JaxPagedAttentionBackend",
            layout=KVCacheLayout.BLOCKS_FIRST,
            supported_kernel_block_sizes=(MultipleOf(1),),
            supports_batch_invariance=True,
            supports_update_block_table=True,
        )
    max_tokens = max(args.token_buckets)
    cfg = tiny_hybrid_config(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        kv_sharing_fast_prefill=not args.no_fast_prefill,
        attention_backend=backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=max(256, args.shared_prefix + 48 + args.max_new_tokens),
        token_buckets=args.token_buckets,
        request_buckets=(args.max_num_seqs,),
        kv_quant_mode=KV_CACHE_DTYPES[args.kv_cache_dtype],
    )
    return cfg


def _engine(
    args: argparse.Namespace, cfg: RunnerConfig, mesh: Any
) -> tuple[TinyHybridModel, Engine]:
    """The model and its Engine, with a line on the pools (and the mesh)."""
    model = TinyHybridModel(cfg, vocab_size=args.vocab_size, rngs=nnx.Rngs(args.seed))
    num_blocks = args.num_blocks
    if num_blocks == "auto":
        num_blocks = _sized(args, cfg, model, mesh)
    engine = Engine(
        cfg,
        model,
        num_blocks=num_blocks,
        mesh=mesh,
        enable_prefix_caching=args.prefix_caching,
        implementation=args.implementation,
    )
    pools_mib = sum(p.nbytes for p in engine.pools) / 2**20
    print(
        f"model: {len(cfg.layers)} layers (full, sliding window, Mamba, YOCO), "
        f"{len(engine.pools)} pools of {pools_mib:.2f} MiB in all, fast prefill "
        f"{'on' if engine.fast_prefill else 'off'}"
    )
    if args.mesh is not None:
        data, tensor = args.mesh
        per_device = (
            sum(p.addressable_shards[0].data.nbytes for p in engine.pools) / 2**20
        )
        print(
            f"mesh {data}x{tensor} (data x tensor): "
            f"{per_device:.2f} MiB of pools per device"
        )
    return model, engine


def _sized(
    args: argparse.Namespace, cfg: RunnerConfig, model: TinyHybridModel, mesh: Any
) -> int:
    """The blocks the memory budget leaves beside the compiled steps (printed)."""
    if mesh is not None:
        raise SystemExit("--num-blocks auto: not on a mesh yet; give --num-blocks N")

    def make_loop(plan: Any) -> Engine:  # the Engine plans the same pools
        return Engine(
            cfg, model, num_blocks=plan.num_blocks, implementation=args.implementation
        )

    try:
        sizing = size_loop_kv_cache(
            cfg, make_loop, memory_bytes=args.memory_bytes, maps_slot_mapping=True
        )
    except ValueError as err:
        raise SystemExit(f"--num-blocks auto: {err}") from None
    print(sizing)
    return sizing.num_blocks


def _serve(args: argparse.Namespace, engine: Engine) -> list[EngineRequest]:
    """Warms up, serves the synthetic requests and prints what it measured."""
    warm = engine.warm_up(progress_bar("compiling"))
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(1, args.vocab_size, args.shared_prefix).tolist()
    requests = [
        EngineRequest(
            req_id=f"req{i}",
            prompt=prefix
            + rng.integers(1, args.vocab_size, int(rng.integers(4, 48))).tolist(),
            max_new_tokens=args.max_new_tokens,
            arrival_step=2 * i,
        )
        for i in range(args.num_requests)
    ]
    t0 = time.perf_counter()
    with count_compilations() as compiles:
        steps, generated = engine.run(requests, progress_bar("serving"))
    seconds = time.perf_counter() - t0
    print(
        f"served {len(requests)} requests: {generated} tokens in {steps} steps, "
        f"{seconds:.2f} s, {generated / seconds:.0f} tokens/s, "
        f"{steps / seconds:.0f} steps/s"
    )
    print(
        f"compiled {len(engine.programs)} step executables in {warm:.1f} s; "
        f"compilations during serving: {len(compiles)}"
    )
    stats = engine.stats
    print(
        f"prompt tokens computed: {stats['prefill_tokens']}, from the prefix cache: "
        f"{stats['cached_tokens']}; preemptions: {stats['preemptions']}; "
        f"rejected: {stats['rejected']}"
    )
    for r in requests:
        if r.reject_reason:
            print(f"  rejected {r.req_id}: {r.reject_reason}")
    return requests


def progress_bar(label: str) -> Callable[[int, int], None]:
    """A text progress bar on stderr."""

    def show(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if done >= total else ""
        print(f"\r{label} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)

    return show
