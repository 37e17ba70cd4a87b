"""The Pallas kernels lower for the devices they are for, on this CPU-only
machine (``jax.export`` for CUDA and TPU), and a layer scan over a stacked pool
hands each kernel the pool itself: no pool-sized copy, convert or slice.
"""  # noqa: D205

import re

import jax
import jax.numpy as jnp
import pytest

import jaxkv

_KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _stacked(dtype="bfloat16", layers=4):
    cfg = jaxkv.llama_like_config(
        num_layers=layers, num_kv_heads=2, head_size=64, dtype=dtype, block_size=16
    )
    plan = jaxkv.make_plan(cfg, num_blocks=64, storage="stacked", pool_dtype="native")
    stack = plan.layer_stack([layer.name for layer in cfg.layers])
    return plan, stack


def _step(plan, stack, *, write=None, attend=None):
    view = stack.layer.view
    layer_attn = stack.layer
    tokens, reqs = 8, 4

    def step(pools, q, k, slots, meta, layer_ids):
        def body(pools, layer):
            pools = jaxkv.write_kv(
                pools, view, k, k, slots, layer=layer, implementation=write
            )
            out = jaxkv.paged_attention(
                q, pools, layer_attn, meta, scale=0.1, layer=layer,
                implementation=attend,
            )
            return pools, out

        return jax.lax.scan(body, pools, layer_ids)

    meta = jaxkv.CommonAttentionMetadata.empty(
        max_reqs=reqs, max_tokens=tokens, max_blocks=4
    )
    args = (
        jax.eval_shape(plan.allocate),
        jax.ShapeDtypeStruct((tokens, 4, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, 2, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
        meta,
        jax.ShapeDtypeStruct((len(stack.slots),), jnp.int32),
    )
    return jax.jit(step, donate_argnums=0), args


def _export(fn, args, platform):
    exported = jax.export.export(
        fn,
        platforms=[platform],
        disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(_KERNEL_CALLS[platform])
        ],
    )(*args)
    return exported.mlir_module()


def _pool_ops(text, pool_shape):
    """The ops whose result is a whole pool, of any dtype."""
    dims = "x".join(map(str, pool_shape))
    ops = []
    for line in text.splitlines():
        m = re.match(r"\s*%[\w#:]+ = \"?([\w.]+)", line)
        results = line.rsplit("->", 1)[-1] if "->" in line else line
        if m and f"tensor<{dims}x" in results:
            ops.append(m.group(1))
    return ops


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_stacked_layer_scan_hands_each_kernel_the_pool_itself(platform):
    plan, stack = _stacked()
    fn, args = _step(plan, stack)
    text = _export(fn, args, platform)
    # implementation=None picks the platform's Pallas attention, and the
    # GPU's Pallas write (XLA's in-place scatter on TPU).
    assert text.count(_KERNEL_CALLS[platform]) >= 1
    kernels = re.findall(r"custom_call @([\w$.]+)\(", text)
    if platform == "cuda":
        assert kernels.count(_KERNEL_CALLS["cuda"]) == 2, kernels  # write, attention
    else:
        assert kernels.count("tpu_custom_call") == 1, kernels
        assert "stablehlo.scatter" in text
    pool_shape = args[0][0].shape
    ops = _pool_ops(text, pool_shape)
    allowed = {
        "stablehlo.reshape",  # the (L, *physical) view of the pool: a bitcast
        "stablehlo.custom_call",  # a kernel, the pool aliased (the write)
        "stablehlo.scatter",  # XLA's in-place write (TPU)
        "stablehlo.while",  # the scan's carry
        "call",  # jitted functions' results
        "func.call",
    }
    assert ops and set(ops) <= allowed, ops
    # Nor is one layer's slot sliced out of the stack (a per-layer copy).
    assert _pool_ops(text, pool_shape[1:]) == []


def test_the_xla_path_on_gpu_and_the_native_kernel_are_not_lowered_elsewhere():
    plan, stack = _stacked()
    fn, args = _step(plan, stack, write="xla", attend="xla")
    text = _export(fn, args, "cuda")
    assert _KERNEL_CALLS["cuda"] not in text
    # On CPU nothing of the Pallas branches is lowered (platform_dependent
    # resolves at lowering): no interpreter loop, no custom call.
    fn, args = _step(plan, stack)
    cpu = fn.lower(*args).as_text()
    assert "triton" not in cpu and "tpu_custom_call" not in cpu


def test_a_kernel_asked_for_by_name_that_cannot_run_says_why():
    cfg = jaxkv.llama_like_config(num_layers=1, head_size=64)
    words = jaxkv.make_plan(cfg, num_blocks=8, storage="words")
    view = words.views["layers.0.self_attn"]
    pools = words.allocate()
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=2, max_tokens=2, max_blocks=2)
    q = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="implementation='pallas'.*word pool"):
        jaxkv.paged_attention(q, pools, view, meta, scale=1.0, implementation="pallas")
    with pytest.raises(ValueError, match="implementation='cuda'.*expected one of"):
        jaxkv.paged_attention(q, pools, view, meta, scale=1.0, implementation="cuda")
    with pytest.raises(ValueError, match="write_kv: implementation='pallas'.*word"):
        k = jnp.zeros((2, 2, 64), jnp.float32)
        jaxkv.write_kv(pools, view, k, k, jnp.array([1, 2]), implementation="pallas")
    # None keeps XLA's path for what the kernels cannot take.
    assert jaxkv.paged_attention(q, pools, view, meta, scale=1.0).shape == (2, 2, 64)
