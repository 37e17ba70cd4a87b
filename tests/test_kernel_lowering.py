"""The Pallas kernels lower for the devices they are for, on this CPU-only
machine (``jax.export`` for CUDA and TPU), and a layer scan over a stacked pool
hands each kernel the pool itself: no pool-sized copy, convert or slice.
"""  # noqa: D205

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.device_compile import scan_step, stacked_plan

_KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


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
@pytest.mark.parametrize(
    ("tokens", "pool_dtype"),
    [(8, "element"), (4, "bits")],  # prefill tiles of 16 / decode rows of 1
)
def test_a_stacked_layer_scan_hands_each_kernel_the_pool_itself(
    platform, tokens, pool_dtype
):
    plan, stack = stacked_plan(pool_dtype=pool_dtype)
    fn, args = scan_step(plan, stack, tokens=tokens)
    text = _export(fn, args, platform)
    # implementation=None picks the platform's Pallas attention and write.
    kernels = re.findall(r"custom_call @([\w$.]+)\(", text)
    assert kernels.count(_KERNEL_CALLS[platform]) == 2, kernels  # write, attention
    pool_shape = args[0][0].shape
    ops = _pool_ops(text, pool_shape)
    if pool_dtype == "bits":  # the kernels bitcast pages, never the pool
        assert "stablehlo.bitcast_convert" not in ops
    allowed = {
        "stablehlo.reshape",  # the (L, *physical) view of the pool: a bitcast
        "stablehlo.custom_call",  # a kernel, the pool aliased (the write)
        "stablehlo.while",  # the scan's carry
        "call",  # jitted functions' results
        "func.call",
    }
    assert ops, text[:2000]
    assert set(ops) <= allowed, ops
    # Nor is one layer's slot sliced out of the stack (a per-layer copy).
    assert _pool_ops(text, pool_shape[1:]) == []


def test_the_xla_path_on_gpu_and_the_native_kernel_are_not_lowered_elsewhere():
    plan, stack = stacked_plan()
    fn, args = scan_step(plan, stack, write="xla", attend="xla")
    text = _export(fn, args, "cuda")
    assert _KERNEL_CALLS["cuda"] not in text
    # On CPU nothing of the Pallas branches is lowered (platform_dependent
    # resolves at lowering): no interpreter loop, no custom call.
    fn, args = scan_step(plan, stack)
    cpu = fn.lower(*args).as_text()
    assert "triton" not in cpu
    assert "tpu_custom_call" not in cpu


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
    k = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="write_kv: implementation='pallas'.*word"):
        jaxkv.write_kv(pools, view, k, k, jnp.array([1, 2]), implementation="pallas")
    # None keeps XLA's path for what the kernels cannot take.
    assert jaxkv.paged_attention(q, pools, view, meta, scale=1.0).shape == (2, 2, 64)


@pytest.mark.parametrize("write", ["xla", "native"])
def test_the_kernel_hand_off_in_a_cpu_layer_scan_copies_no_stack(write):
    # A kernel of one's own in a scan over a stacked bf16 pool (bits on CPU,
    # the default): per layer, write_kv, kernel_cache(layer=), the kernel's
    # update, put_kernel_cache(layer=). No pool-sized copy or convert.
    from jaxkv._native import available

    if write == "native" and not available():
        pytest.skip("no C++ compiler")
    plan, stack = stacked_plan(pool_dtype="bits")
    view = stack.layer.view
    k = jnp.ones((8, 2, 64), jnp.bfloat16)
    slots = jnp.arange(8, dtype=jnp.int32)

    def step(pools, layer_ids):
        def body(pools, layer):
            pools = jaxkv.write_kv(
                pools, view, k, k, slots, layer=layer, implementation=write
            )
            cache = jaxkv.kernel_cache(pools, view, layer=layer)
            cache = cache.at[0, 0].set(cache[1, 1])  # the kernel's own write
            return jaxkv.put_kernel_cache(pools, view, cache, layer=layer), None

        return jax.lax.scan(body, pools, layer_ids)[0]

    pools = jax.eval_shape(plan.allocate)
    compiled = (
        jax.jit(step, donate_argnums=0)
        .lower(pools, jax.ShapeDtypeStruct((4,), jnp.int32))
        .compile()
    )
    shape = ",".join(map(str, pools[0].shape))
    text = compiled.as_text()
    assert text is not None
    big = [
        line
        for line in text.splitlines()
        if f"[{shape}]" in line and (" copy(" in line or " convert(" in line)
    ]
    assert big == []
    stats = compiled.memory_analysis()
    assert stats is not None
    # At most the one layer slot kernel_cache hands out, never the stack.
    slot_bytes = pools[0].size * pools[0].dtype.itemsize // 4
    assert stats.temp_size_in_bytes <= slot_bytes + (64 << 10)


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_the_pallas_kernels_run_inside_shard_map_with_check_vma(implementation):
    # Operands vary over the data axis (the pools, the queries): the kernels'
    # operands and results are typed to vary alike (check_vma on).
    from jax.sharding import PartitionSpec as P

    from tests.attention_cases import CASES, build

    case = next(c for c in CASES if c.name == "decode_fused_bf16_bits")
    built = build(case)
    mesh = jax.make_mesh((1,), ("data",))
    view, kw = built.view, built.kw
    k = jnp.ones((2, case.kv_heads, case.head), jnp.dtype(case.dtype))

    def step(pools, q, meta, layer):
        pools = jaxkv.write_kv(
            pools,
            view,
            k,
            k,
            jnp.array([3, 4], jnp.int32),
            layer=layer,
            implementation=implementation,
        )
        out = jaxkv.paged_attention(
            q, pools, view, meta, layer=layer, implementation=implementation, **kw
        )
        return pools, out

    spec = jax.tree.map(lambda _: P(), (built.pools, built.q, built.meta, built.layer))
    sharded = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=spec, out_specs=(spec[0], P()), check_vma=True
        )
    )
    plain = jax.jit(step)
    args = (built.pools, built.q, built.meta, built.layer)
    got = sharded(*args)
    want = plain(*args)  # neither program donates
    np.testing.assert_allclose(
        np.asarray(got[1], np.float32), np.asarray(want[1], np.float32), atol=1e-2
    )


@pytest.mark.parametrize(
    ("platform", "name"), [("cuda", "pallas_gpu"), ("tpu", "pallas_tpu")]
)
def test_a_kernel_named_for_its_own_platform_lowers_compiled_not_interpreted(
    platform, name
):
    # One name for every platform still lowers per platform: compiled where
    # it is the kernel's own (no interpreter's loop), interpreted on CPU.
    plan, stack = stacked_plan()
    fn, args = scan_step(plan, stack, write=name, attend=name, tokens=4)
    text = _export(fn, args, platform)
    kernels = re.findall(r"custom_call @([\w$.]+)\(", text)
    assert kernels.count(_KERNEL_CALLS[platform]) == 2, kernels  # write, attention
    fn, args = scan_step(plan, stack, tokens=4)  # None: the platform's own
    loops = _export(fn, args, platform).count("stablehlo.while")
    assert text.count("stablehlo.while") == loops  # no interpreter's loop
