import numpy as np
import pytest
from flax import nnx

import jaxkv
from tests.helpers import count_compiles


def _engine(fast_prefill=True, kernel=None):
    backend = jaxkv.AttentionBackend(
        name=f"K{kernel}",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(kernel,) if kernel else (jaxkv.MultipleOf(1),),
    )
    cfg = jaxkv.tiny_hybrid_config(
        kv_sharing_fast_prefill=fast_prefill,
        attention_backend=backend,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=(8, 32, 64),
        request_buckets=(8,),
    )
    model = jaxkv.TinyHybridModel(cfg, vocab_size=96, rngs=nnx.Rngs(1))
    return model, jaxkv.Engine(cfg, model, num_blocks=96)


def _requests(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return [
        jaxkv.Request(
            req_id=f"r{i}",
            prompt=rng.integers(1, 96, int(rng.integers(3, 60))).tolist(),
            max_new_tokens=int(rng.integers(4, 12)),
            arrival_step=i % 3,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("fast_prefill", "kernel"), [(True, None), (False, None), (True, 16)]
)
def test_step_loop_matches_dense_oracle_and_compiles_nothing(fast_prefill, kernel):
    model, engine = _engine(fast_prefill, kernel)
    if kernel:
        attn = [g for gs in engine.groups for g in gs if g.backend.name == f"K{kernel}"]
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
        assert r.output == jaxkv.generate_dense(
            model, r.prompt, r.max_new_tokens, max_len
        ), r.req_id
    # Every block went back to the allocator.
    assert engine.allocator.num_free == 95
    assert steps > 0


def test_allocator_errors():
    a = jaxkv.BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(RuntimeError, match="need 1, 0 free"):
        a.allocate(1)


def test_main_job_runs(capsys):
    from jaxkv.__main__ import main

    assert main(["--num-requests", "3", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out
    assert "compilations during serving: 0" in out
    assert "match the dense oracle: 3/3" in out
