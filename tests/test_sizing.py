"""The KV cache sized from a memory budget and the compiled step's own bytes
(``size_kv_cache``): the sized pools plus the step fit, one more block would
not; budgets too small or unknown are refused naming the numbers.
"""  # noqa: D205

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv.plan import step_bytes
from tests.test_shard import _run_check

CFG = jaxkv.llama_like_config(num_layers=2, token_buckets=(16,))


def _compile(plan, *, hidden=256):
    """A decoder step: weights, per layer a write and attention, pools donated."""
    layers = [plan.attention_layer(layer.name) for layer in CFG.layers]
    builder = jaxkv.StepMetadataBuilder(plan)
    (inputs,) = builder.abstract_inputs()

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pools, weights, inputs, x):
        meta = builder.metadata(inputs)
        for layer in layers:
            h = (x.reshape(x.shape[0], -1) @ weights).reshape(x.shape)
            pools = jaxkv.write_kv(pools, layer, h[:, :2], h[:, :2], meta[layer.name])
            x = x + jaxkv.paged_attention(h, pools, layer, meta[layer.name], scale=0.1)
        return pools, x

    weights = jax.ShapeDtypeStruct((hidden // 2, hidden // 2), jnp.float32)
    x = jax.ShapeDtypeStruct((inputs.capacity.max_tokens, 4, 32), jnp.float32)
    return step.lower(jax.eval_shape(plan.allocate), weights, inputs, x).compile()


def test_the_sized_pools_and_the_step_fit_and_one_more_block_would_not():
    budget = 3 * 2**20
    sizing = jaxkv.size_kv_cache(CFG, _compile, memory_bytes=budget)
    n = sizing.num_blocks
    at = step_bytes(_compile(jaxkv.make_plan(CFG, num_blocks=n)))
    over = step_bytes(_compile(jaxkv.make_plan(CFG, num_blocks=n + 1)))
    assert at <= budget < over, (n, at, over)
    assert sizing.step_bytes == at
    # The pools are most of it; the weights (64 KiB) and the step's own
    # buffers are counted once.
    per_block = jaxkv.kv_cache_budget(CFG, memory_bytes=budget).bytes_per_block
    assert sizing.pool_bytes_per_block == per_block
    assert sizing.fixed_bytes > 64 * 2**10
    assert n * per_block + sizing.fixed_bytes <= budget
    text = str(sizing)
    assert f"KV cache sized: {n} blocks" in text
    assert "memory_bytes" in text


def test_a_budget_without_room_for_two_blocks_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"budget of 100000 bytes.*holds fewer than 2"):
        jaxkv.size_kv_cache(CFG, _compile, memory_bytes=100_000)


def test_a_backend_without_a_memory_limit_asks_for_bytes():
    class NoLimit:
        def memory_stats(self):
            return None

        def __str__(self):
            return "cpu:0"

    with pytest.raises(
        ValueError, match=r"cpu:0 reports no memory limit.*memory_bytes="
    ):
        jaxkv.size_kv_cache(CFG, _compile, device=NoLimit())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="memory_fraction must be in"):
            jaxkv.size_kv_cache(CFG, _compile, memory_fraction=bad)
    with pytest.raises(ValueError, match="probe_blocks must be two block counts"):
        jaxkv.size_kv_cache(CFG, _compile, memory_bytes=2**22, probe_blocks=(8, 8))


def test_a_device_limit_is_read_where_the_backend_reports_one():
    class Limited:
        def memory_stats(self):
            return {"bytes_limit": 4 * 2**20, "bytes_in_use": 0}

        def __str__(self):
            return "tpu:0"

    sizing = jaxkv.size_kv_cache(CFG, _compile, device=Limited(), memory_fraction=0.75)
    assert sizing.budget_bytes == 3 * 2**20
    assert "0.75 x bytes_limit 4194304 of tpu:0" in sizing.budget_source


@pytest.mark.slow
def test_on_a_2x4_mesh_a_block_costs_each_device_its_share():
    _run_check(Path(__file__).with_name("sizing_mesh_check.py"))


def test_a_step_growing_faster_than_its_pools_is_sized_by_what_fits():
    # Bytes quadratic in the blocks (a step that copies per pair of blocks):
    # the linear fit overshoots, the checks step down to a count that fits.
    def compile_step(plan):
        n = plan.num_blocks
        return 1000 + 10 * n + n * n

    sizing = jaxkv.size_kv_cache(CFG, compile_step, memory_bytes=10**6)
    n = sizing.num_blocks
    assert compile_step(jaxkv.make_plan(CFG, num_blocks=n)) <= 10**6
    assert sizing.step_bytes <= 10**6
    assert n >= 8  # at least what the probes showed fits
    assert len(sizing.probes) <= 2 + 8


def _toy_loop(plan):
    layer = plan.attention_layer("layers.0.self_attn")

    def forward(params, pools, meta, tokens, sample):
        x, m = params[tokens], meta[layer.name]
        pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
        out = jaxkv.paged_attention(x[:, None], pools, layer, m, scale=1.0)
        return pools, out[sample, 0] @ params.T

    return jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)


def _loop_bytes(plan):
    loop = _toy_loop(plan)
    loop.warm_up()
    return max(step_bytes(exe) for exe in loop.programs.executables())


def test_a_serving_loop_is_sized_by_its_largest_program():
    cfg = jaxkv.pattern_config(
        "G", num_layers=1, num_heads=1, num_kv_heads=1, head_size=8,
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
        token_buckets=(4, 16),
    )  # fmt: skip
    budget = 2**19
    sizing = jaxkv.serve.size_loop_kv_cache(cfg, _toy_loop, memory_bytes=budget)
    n = sizing.num_blocks
    assert _loop_bytes(jaxkv.make_plan(cfg, num_blocks=n)) <= budget
    assert _loop_bytes(jaxkv.make_plan(cfg, num_blocks=n + 1)) > budget
    # The sized loop serves.
    loop = _toy_loop(jaxkv.make_plan(cfg, num_blocks=n))
    r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=3)
    loop.run([r])
    assert r.output == [3, 3, 3]
