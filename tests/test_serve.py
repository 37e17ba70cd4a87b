import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
import jaxkv.demo
from tests.helpers import count_compiles


def _backend(kernel=None):
    """A blocks-first backend with kernel blocks of `kernel` tokens (or any)."""
    return jaxkv.AttentionBackend(
        name=f"K{kernel}",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(kernel,)
        if kernel
        else (jaxkv.vllm.MultipleOf(1),),
    )


def _engine(fast_prefill=True, kernel=None, record_logits=False):
    cfg = jaxkv.tiny_hybrid_config(
        kv_sharing_fast_prefill=fast_prefill,
        attention_backend=_backend(kernel),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=(8, 64),  # a decode bucket and a prefill bucket
        request_buckets=(8,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=96, rngs=nnx.Rngs(1))
    return model, jaxkv.demo.Engine(
        cfg, model, num_blocks=96, record_logits=record_logits
    )


def _requests(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return [
        jaxkv.demo.EngineRequest(
            req_id=f"r{i}",
            prompt=rng.integers(1, 96, int(rng.integers(3, 60))).tolist(),
            max_new_tokens=int(rng.integers(4, 12)),
            arrival_step=i % 3,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("fast_prefill", "kernel"),
    # Fast prefill in the fast pass; without it and with kernel blocks, slow.
    [
        (True, None),
        pytest.param(False, None, marks=pytest.mark.slow),
        pytest.param(True, 16, marks=pytest.mark.slow),
    ],
)
def test_step_loop_matches_dense_oracle_and_compiles_nothing(fast_prefill, kernel):
    model, engine = _engine(fast_prefill, kernel)
    if kernel:
        attn = [
            g
            for gs in engine.plan.attn_groups
            for g in gs
            if g.backend.name == f"K{kernel}"
        ]
        assert attn
        assert all(g.kernel_block_size == kernel for g in attn)
    engine.warm_up()
    requests = _requests()
    with count_compiles() as compiles:
        steps, generated = engine.run(requests)
    assert compiles == [], f"{len(compiles)} compilations after warm-up"
    assert generated == sum(r.max_new_tokens for r in requests)
    assert engine.counters["partial_prefills"] > 0  # chunked prefill happened
    if fast_prefill:
        assert engine.counters["fast_prefill_armed"] > 0
    else:
        assert engine.counters["fast_prefill_armed"] == 0
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    for r in requests:
        assert r.output == jaxkv.demo.generate_dense(
            model, r.prompt, r.max_new_tokens, max_len
        ), r.req_id
    # Every block went back to the allocator.
    assert engine.allocator.num_free == 95
    assert steps > 0


@pytest.mark.parametrize(
    ("fast_prefill", "kernel"),
    # Each case compiles every bucket (24-31 s on the 2-core VM): the slow
    # pass. The default pass keeps the dense-oracle test below.
    [
        pytest.param(True, None, marks=pytest.mark.slow),
        pytest.param(False, 16, marks=pytest.mark.slow),
    ],
)
def test_step_loop_logits_equal_the_dense_model(fast_prefill, kernel):
    """Every sampled token's logits, not only its argmax, equal the dense model's."""
    model, engine = _engine(fast_prefill, kernel, record_logits=True)
    engine.warm_up()
    requests = _requests(seed=3, n=6)
    engine.run(requests)
    for r in requests:
        tokens = jnp.asarray(r.prompt + r.output, jnp.int32)
        dense = np.asarray(jaxkv.demo.forward_dense(model, tokens))
        # Token i of the output was sampled from the logits at position
        # len(prompt) - 1 + i.
        want = dense[len(r.prompt) - 1 : len(r.prompt) - 1 + len(r.output)]
        got = np.stack(r.logits)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=r.req_id)


@pytest.mark.parametrize("kernel", [None, pytest.param(8, marks=pytest.mark.slow)])
def test_sliding_window_blocks_are_freed_and_outputs_still_match(kernel):
    # kernel=8: freed manager blocks become null entries of a kernel-block table.
    cfg = jaxkv.tiny_hybrid_config(
        attention_backend=_backend(kernel),
        block_size=16,
        head_size=16,
        num_heads=2,
        num_kv_heads=2,
        sliding_window=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        token_buckets=(4, 32),
        request_buckets=(4,),
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=64, rngs=nnx.Rngs(2))
    engine = jaxkv.demo.Engine(cfg, model, num_blocks=160)
    manager = engine.schedulers[0].manager
    swa = [
        i
        for i, s in enumerate(manager.specs)
        if s is not None and not manager.is_mamba[i]
    ]
    assert swa, "the sliding-window group may free blocks"
    if kernel:
        assert {g.kernel_block_size for gs in engine.plan.attn_groups for g in gs} >= {
            kernel
        }
    engine.warm_up()
    free = engine.allocator

    def serve(free_skipped: bool):
        rng = np.random.default_rng(3)
        requests = [
            jaxkv.demo.EngineRequest(
                req_id=f"r{i}",
                prompt=rng.integers(1, 64, int(rng.integers(30, 70))).tolist(),
                max_new_tokens=int(rng.integers(10, 24)),
            )
            for i in range(4)
        ]
        specs = list(manager.specs)
        if not free_skipped:
            for g in swa:
                manager.specs[g] = None
        low = [free.num_free]
        allocate = free.allocate

        def tracked(n):
            out = allocate(n)
            low.append(free.num_free)
            return out

        free.allocate = tracked
        try:
            engine.run(requests)
        finally:
            free.allocate = allocate
            manager.specs[:] = specs
        return requests, free.num_free - min(low)

    with count_compiles() as compiles:
        freed, peak_freed = serve(True)
        kept, peak_kept = serve(False)
    assert compiles == []
    assert free.num_free == 159  # the null block never entered the free list
    assert peak_freed < peak_kept, (peak_freed, peak_kept)
    max_len = max(len(r.prompt) + r.max_new_tokens for r in freed)
    for a, b in zip(freed, kept, strict=True):
        dense = jaxkv.demo.generate_dense(model, a.prompt, a.max_new_tokens, max_len)
        assert a.output == dense == b.output, a.req_id


def test_get_num_skipped_tokens_follows_vllm():
    get_num_skipped_tokens = jaxkv.vllm.get_num_skipped_tokens
    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": "float32"}
    swa = jaxkv.SlidingWindowSpec(**common, sliding_window=128)
    local = jaxkv.ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    full = jaxkv.FullAttentionSpec(**common)
    # vLLM: max(0, n - window + 1); (n // chunk) * chunk; 0 for full attention.
    assert [get_num_skipped_tokens(swa, n) for n in (0, 127, 128, 300)] == [
        0,
        0,
        1,
        173,
    ]
    assert [get_num_skipped_tokens(local, n) for n in (0, 63, 64, 130)] == [
        0,
        0,
        64,
        128,
    ]
    assert get_num_skipped_tokens(full, 10_000) == 0


def test_allocator_errors():
    a = jaxkv.sched.BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(RuntimeError, match="need 1, 0 free"):
        a.allocate(1)


def test_main_job_runs(capsys):
    from jaxkv.__main__ import main

    # One token bucket: two programs (CI runs the default main job too).
    argv = ["--num-requests", "3", "--max-new-tokens", "3", "--token-buckets", "32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out
    assert "compilations during serving: 0" in out
    assert "match the dense oracle: 3/3" in out


def test_main_job_sizing_from_memory_asks_for_bytes_on_cpu():
    from jaxkv.__main__ import main

    with pytest.raises(SystemExit, match="reports no memory limit.*memory_bytes="):
        main(["--num-blocks", "auto"])


@pytest.mark.slow  # three warm-ups to size the pools, about 70 s
def test_main_job_sizes_its_pools_from_a_byte_budget(capsys):
    from jaxkv.__main__ import main

    argv = ["--num-requests", "3", "--max-new-tokens", "3", "--num-blocks", "auto"]
    argv += ["--token-buckets", "32"]  # one bucket: fewer programs to size
    assert main([*argv, "--memory-bytes", "4000000"]) == 0
    out = capsys.readouterr().out
    assert "KV cache sized: " in out
    assert "match the dense oracle: 3/3" in out


@pytest.mark.slow  # more step executables on a 1x1 mesh
@pytest.mark.parametrize("argv", [["--mesh", "1x1"], ["--implementation", "native"]])
def test_main_job_runs_on_a_1x1_mesh_and_on_the_native_kernels(capsys, argv):
    from jaxkv.__main__ import main

    base = ["--num-requests", "2", "--max-new-tokens", "3", "--token-buckets", "32"]
    assert main([*base, *argv]) == 0
    out = capsys.readouterr().out
    assert "match the dense oracle: 2/2" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--seed", "-1"], "--seed: expected an int >= 0, got '-1'"),
        (["--head-size", "3"], "--head-size: expected an even head size"),
        (["--vocab-size", "1"], "--vocab-size: expected an int >= 2, got '1'"),
        (["--num-requests", "0"], "--num-requests: expected a positive int"),
        (["--mesh", "2by4"], "--mesh takes DATAxTENSOR"),
    ],
)
def test_the_main_job_names_a_bad_option(capsys, argv, match):
    from jaxkv.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2  # a usage error, before anything runs
    assert match in capsys.readouterr().err


def test_the_demo_model_refuses_an_odd_head_size():
    cfg = jaxkv.tiny_hybrid_config(head_size=3)
    with pytest.raises(ValueError, match="head_size=3 must be even"):
        jaxkv.demo.TinyHybridModel(cfg, vocab_size=8, rngs=nnx.Rngs(0))
