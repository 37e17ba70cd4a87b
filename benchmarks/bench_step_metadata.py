"""Host overhead of one step's metadata, and the fast-prefill staging kernel.

For `--num-reqs` requests (decodes plus a few prefill chunks) on the built-in
hybrid model, both sides starting from the same NumPy step inputs and paying
every transfer:
(1) inputs on device: jaxkv's `prepare` plus the one transfer of its packed
    buffer, vs a naive version that transfers each field separately;
(2) metadata on device: the above plus the compiled build on both sides;
(3) staged logits indices on device: jaxkv's `FastPrefillHelper.prepare` (one
    packed transfer, the jitted staging kernel on a donated buffer) vs a Python
    loop that pads the indices and transfers them.

    python benchmarks/bench_step_metadata.py --num-reqs 256
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import jax
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
        block_tables=[tables, tables, tables],  # Mamba: a column per block too
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
        max_model_len=args.max_model_len,
    )
    buckets = tuple(
        b for b in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if b <= args.max_tokens
    )
    plan = jaxkv.make_plan(cfg, num_blocks=4096)
    groups, kv = plan.attn_groups, plan.kv_cache_config
    dispatcher = jaxkv.BucketDispatcher(
        token_buckets=buckets,
        max_num_tokens=args.max_tokens,
        max_num_reqs=args.num_reqs,
        request_buckets=(args.num_reqs,),
        cg_support=plan.cg_support.min_cg_support,
    )
    builder = jaxkv.StepMetadataBuilder(plan, dispatcher)
    helper = builder.fast_prefill_helper
    assert helper is not None
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
        step = builder.prepare(jaxkv.StepArrays(**inputs))
        jax.block_until_ready(jax.device_put(step))  # the one transfer

    def packed_unchecked():  # the same without validate_step (caller-checked arrays)
        step = builder.prepare(jaxkv.StepArrays(**inputs), validate=False)
        jax.block_until_ready(jax.device_put(step))

    def packed_full():
        jax.block_until_ready(
            builder.build(builder.prepare(jaxkv.StepArrays(**inputs)))
        )

    t_packed = measure_host(packed_host, iters=args.iters)
    t_unchecked = measure_host(packed_unchecked, iters=args.iters)
    t_packed_full = measure_host(packed_full, iters=args.iters)

    # Naive: every field padded on the host and transferred on its own, the
    # logits indices padded and transferred with their two counts.
    layout = builder.capacity(desc)
    # The naive side arms fast prefill too, with the same staged indices.
    host_inputs = {
        k: v for k, v in inputs.items() if k not in ("logits_indices", "cu_num_logits")
    }

    @jax.jit
    def naive_build(f, fp):
        fields = jaxkv.step.StepFields.of_layout_fields(f, layout)
        return jaxkv.step.build_attn_metadata_from_step(
            groups, fields, kv, fast_prefill=fp
        )

    def naive_host():
        packed = jaxkv.step.pack_step(layout, **host_inputs)
        fields = {  # one transfer per field
            name: jax.device_put(packed[o : o + int(np.prod(shape))].reshape(shape))
            for name, (o, shape) in layout.offsets().items()
        }
        n = int(inputs["logits_indices"].size)
        p = jaxkv.step.smallest_bucket(buckets, n) or n
        idx = np.full(p, inputs["logits_indices"][-1], np.int32)
        idx[:n] = inputs["logits_indices"]
        fp = jaxkv.vllm.FastPrefillBatchMetadata(
            logits_indices_padded=jax.device_put(idx),
            num_logits_indices=jax.device_put(np.int32(n)),
            max_logits_per_req=jax.device_put(np.int32(1)),
        )
        return fields, fp

    def naive_transfer():
        jax.block_until_ready(naive_host())

    def naive_full():
        jax.block_until_ready(naive_build(*naive_host()))

    naive_full()  # compile outside the timing
    t_naive = measure_host(naive_transfer, iters=args.iters)
    t_naive_full = measure_host(naive_full, iters=args.iters)
    n_transfers = len(layout.offsets()) + 3

    # Staging, like with like: from host indices to the padded indices on
    # device. jaxkv: the helper's one packed transfer and its jitted kernel on
    # the persistent donated buffer. Baseline: a Python loop pads, one transfer.
    n = int(inputs["logits_indices"].size)
    p = jaxkv.step.smallest_bucket(buckets, n) or n
    has_prefill = True

    def kernel():
        fp = helper.prepare(
            inputs["logits_indices"],
            args.num_reqs,
            inputs["cu_num_logits"],
            has_prefill,
            desc,
        )
        assert fp is not None
        jax.block_until_ready(fp.logits_indices_padded)

    t_kernel = measure_host(kernel, iters=args.iters)
    idx_list = inputs["logits_indices"].tolist()

    def python_loop():
        staged = [idx_list[i] if i < n else idx_list[n - 1] for i in range(p)]
        jax.block_until_ready(jax.device_put(np.asarray(staged, np.int32)))

    t_loop = measure_host(python_loop, iters=args.iters)
    rows = [
        {
            "what": "host overhead",
            "impl": f"naive pack + {n_transfers} transfers",
            "ms": t_naive * 1e3,
            "ratio": 1.0,
        },
        {
            "what": "host overhead",
            "impl": "jaxkv prepare + staging + 1 transfer",
            "ms": t_packed * 1e3,
            "ratio": t_packed / t_naive,
        },
        {
            "what": "host overhead",
            "impl": "jaxkv prepare(validate=False) + staging + 1 transfer",
            "ms": t_unchecked * 1e3,
            "ratio": t_unchecked / t_naive,
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
            "impl": "jaxkv helper: 1 transfer + jitted kernel",
            "ms": t_kernel * 1e3,
            "ratio": t_kernel / t_loop,
        },
    ]
    print_table(
        f"Step metadata: {args.num_reqs} requests, {desc.num_tokens}-token bucket, "
        f"{len(padding)} staging paddings",
        rows,
    )
    print(
        f"\nhost overhead naive / jaxkv: {t_naive / t_packed:.2f}x with validation, "
        f"{t_naive / t_unchecked:.2f}x without  (target >= 3x; the naive side "
        "checks nothing)"
    )
    print(f"staging python loop / jaxkv kernel: {t_loop / t_kernel:.1f}x")
    print(f"warm-up: {len(builder.programs)} executables in {warm_s:.1f} s")
    return {
        "packed_ms": t_packed * 1e3,
        "naive_ms": t_naive * 1e3,
        "naive_over_packed": t_naive / t_packed,
        "naive_over_unchecked": t_naive / t_unchecked,
        "kernel_ms": t_kernel * 1e3,
        "loop_ms": t_loop * 1e3,
        "packed_full_ms": t_packed_full * 1e3,
        "naive_full_ms": t_naive_full * 1e3,
        "loop_over_kernel": t_loop / t_kernel,
        "executables": len(builder.programs),
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
