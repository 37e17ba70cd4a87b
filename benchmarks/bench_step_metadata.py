"""Host overhead of one step's metadata, and the fast-prefill staging kernel.

For `--num-reqs` requests (decodes plus a few prefill chunks) on the built-in
hybrid model: (1) host time from NumPy step inputs to every layer's metadata
on device, with jaxkv's single packed transfer vs a naive version that
transfers each field separately; (2) device time of the jitted staging kernel
vs staging the logits indices with a Python loop and one transfer.

    python benchmarks/bench_step_metadata.py --num-reqs 256
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import measure_host, parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402


def _step_inputs(
    rng, num_reqs, num_prefills, chunk, block_size, width, num_blocks
) -> dict[str, Any]:
    q_lens = np.ones(num_reqs, np.int32)
    q_lens[:num_prefills] = chunk
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = (q_lens + rng.integers(0, block_size * width - chunk, num_reqs)).astype(
        np.int32
    )
    positions = np.concatenate(
        [np.arange(s - q, s) for s, q in zip(seq_lens, q_lens, strict=True)]
    )
    tables = rng.integers(1, num_blocks, (num_reqs, width)).astype(np.int32)
    req = np.repeat(np.arange(num_reqs), q_lens)
    slots = (
        tables[req, positions // block_size] * block_size + positions % block_size
    ).astype(np.int32)
    logits = qsl[1:] - 1
    cu = np.arange(num_reqs + 1, dtype=np.int32)
    return dict(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        positions=positions.astype(np.int32),
        block_tables=[tables] * 3,
        slot_mappings=[slots] * 3,
        logits_indices=logits.astype(np.int32),
        cu_num_logits=cu,
    )


def run(args) -> dict:
    rng = np.random.default_rng(0)
    block_size, width = 32, args.max_model_len // 32
    cfg = jaxkv.tiny_hybrid_config(
        block_size=block_size,
        max_num_seqs=args.num_reqs,
        max_num_batched_tokens=args.max_tokens,
    )
    kv = jaxkv.make_kv_cache_config(cfg, num_blocks=4096)
    groups, info, _ = jaxkv.init_attn_backend(kv, cfg)
    buckets = tuple(
        b for b in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if b <= args.max_tokens
    )
    dispatcher = jaxkv.BucketDispatcher(
        token_buckets=buckets,
        max_num_tokens=args.max_tokens,
        max_num_reqs=args.num_reqs,
        request_buckets=(args.num_reqs,),
        cg_support=info.min_cg_support,
    )
    helper = jaxkv.FastPrefillHelper(dispatcher, args.max_tokens)
    builder = jaxkv.StepMetadataBuilder(
        groups,
        kv,
        dispatcher,
        block_table_widths=(width,) * 3,
        fast_prefill_helper=helper,
    )
    inputs = _step_inputs(
        rng, args.num_reqs, args.num_prefills, args.chunk, block_size, width, 4096
    )
    t0 = time.perf_counter()
    builder.warm_up()
    warm_s = time.perf_counter() - t0
    num_tokens = int(inputs["query_start_loc"][-1])
    desc = dispatcher.dispatch(num_reqs=args.num_reqs, num_tokens=num_tokens)
    padding = helper.paddings()

    def packed_host():
        return builder.prepare(**inputs)

    def packed_full():
        jax.block_until_ready(builder.build(builder.prepare(**inputs)))

    t_packed = measure_host(packed_host, iters=args.iters)
    t_packed_full = measure_host(packed_full, iters=args.iters)

    # Naive: every field padded on the host and transferred on its own, the
    # logits indices padded and transferred with their two counts.
    layout = builder.layout(desc)
    host_inputs = {
        k: v for k, v in inputs.items() if k not in ("logits_indices", "cu_num_logits")
    }

    @jax.jit
    def naive_build(f, fp):
        return jaxkv.build_attn_metadata_from_step(groups, f, kv, fast_prefill=fp)

    def naive_host():
        packed = jaxkv.pack_step(layout, **host_inputs)
        fields = {  # one transfer per field
            name: jax.device_put(packed[o : o + int(np.prod(shape))].reshape(shape))
            for name, (o, shape) in layout.offsets().items()
        }
        n = int(inputs["logits_indices"].size)
        p = jaxkv.smallest_bucket(buckets, n) or n
        idx = np.full(p, inputs["logits_indices"][-1], np.int32)
        idx[:n] = inputs["logits_indices"]
        fp = jaxkv.FastPrefillBatchMetadata(
            logits_indices_padded=jax.device_put(idx),
            num_logits_indices=jax.device_put(np.int32(n)),
            max_logits_per_req=jax.device_put(np.int32(1)),
        )
        return fields, fp

    def naive_full():
        jax.block_until_ready(naive_build(*naive_host()))

    naive_full()  # compile outside the timing
    t_naive = measure_host(naive_host, iters=args.iters)
    t_naive_full = measure_host(naive_full, iters=args.iters)
    n_transfers = len(layout.offsets()) + 3

    # Staging: jitted kernel on a persistent donated buffer vs a Python loop.
    n = int(inputs["logits_indices"].size)
    p = jaxkv.smallest_bucket(buckets, n) or n
    host_idx = np.full(p, -1, np.int32)
    host_idx[:n] = inputs["logits_indices"]
    buf = jnp.zeros(args.max_tokens, jnp.int32)
    stage = jaxkv.stage_logits_indices.lower(buf, host_idx, np.int32(n)).compile()
    dev_idx, dev_n = jax.device_put(host_idx), jax.device_put(np.int32(n))
    state = {"buf": buf}

    def kernel():
        state["buf"], out = stage(state["buf"], dev_idx, dev_n)
        jax.block_until_ready(out)

    t_kernel = measure_host(kernel, iters=args.iters)
    idx_list = inputs["logits_indices"].tolist()

    def python_loop():
        staged = [
            idx_list[i] if i < n else idx_list[n - 1] for i in range(args.max_tokens)
        ]
        jax.block_until_ready(jax.device_put(np.asarray(staged[:p], np.int32)))

    t_loop = measure_host(python_loop, iters=args.iters)
    rows = [
        {
            "what": "host overhead",
            "impl": f"naive ({n_transfers} transfers)",
            "ms": t_naive * 1e3,
            "ratio": 1.0,
        },
        {
            "what": "host overhead",
            "impl": "jaxkv prepare (1 transfer + staging)",
            "ms": t_packed * 1e3,
            "ratio": t_packed / t_naive,
        },
        {
            "what": "to metadata on device",
            "impl": "naive + jit build",
            "ms": t_naive_full * 1e3,
            "ratio": 1.0,
        },
        {
            "what": "to metadata on device",
            "impl": "jaxkv prepare + compiled build",
            "ms": t_packed_full * 1e3,
            "ratio": t_packed_full / t_naive_full,
        },
        {
            "what": "logits staging",
            "impl": "python loop + transfer",
            "ms": t_loop * 1e3,
            "ratio": 1.0,
        },
        {
            "what": "logits staging",
            "impl": "jaxkv jitted kernel",
            "ms": t_kernel * 1e3,
            "ratio": t_kernel / t_loop,
        },
    ]
    print_table(
        f"Step metadata: {args.num_reqs} requests, {desc.num_tokens}-token bucket, "
        f"{len(padding)} staging paddings",
        rows,
    )
    print(f"\nhost overhead naive / jaxkv: {t_naive / t_packed:.2f}x  (target >= 3x)")
    print(f"staging python loop / jaxkv kernel: {t_loop / t_kernel:.1f}x")
    print(f"warm-up: {len(builder.compiled)} executables in {warm_s:.1f} s")
    return {
        "packed_ms": t_packed * 1e3,
        "naive_ms": t_naive * 1e3,
        "naive_over_packed": t_naive / t_packed,
        "kernel_ms": t_kernel * 1e3,
        "loop_ms": t_loop * 1e3,
        "packed_full_ms": t_packed_full * 1e3,
        "naive_full_ms": t_naive_full * 1e3,
        "loop_over_kernel": t_loop / t_kernel,
        "executables": len(builder.compiled),
        "warm_up_s": warm_s,
        "transfers_naive": n_transfers,
    }


def main(argv=None) -> dict:
    p = parser("Host overhead of step metadata and the fast-prefill staging kernel.")
    p.add_argument("--num-reqs", type=int, default=256)
    p.add_argument("--num-prefills", type=int, default=16)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_step_metadata",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
