"""The TPU kernels compile for v5e and v6e on this CPU host (libtpu's Mosaic and
XLA:TPU compilers, ``tests/device_compile.py``), a named implementation's
program holds only its kernel (no interpreter), and no trace of a step reads
``jax.default_backend()``.

Skipped with the reason where libtpu is absent (the ``tpu-compile`` extra,
which CI installs).
"""  # noqa: D205

import jax
import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv.kv._pallas_write import mosaic_dtype_unfit, tpu_write_unfit
from tests.attention_cases import CASES, build
from tests.device_compile import (
    CHIPS,
    Step,
    attention_step,
    compile_for_tpu,
    interpreted_ops,
    kernel_calls,
    libtpu_missing,
    pool_sized_ops,
    scan_step,
    stacked_plan,
)

needs_libtpu = pytest.mark.skipif(
    libtpu_missing() is not None, reason=str(libtpu_missing())
)


@needs_libtpu
@pytest.mark.parametrize("chip", list(CHIPS))
@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas", None])
@pytest.mark.parametrize(("tokens", "pool_dtype"), [(4, "element"), (8, "bits")])
def test_a_layer_scan_compiles_to_the_tpu_kernels_alone(
    chip, implementation, tokens, pool_dtype
):
    # Decode rows (4 tokens, 4 requests) and prefill tiles (8 tokens), the
    # layer slot traced, the pool donated: the write and the attention are
    # each one Mosaic kernel, nothing of an interpreter, no pool copied.
    plan, stack = stacked_plan(pool_dtype=pool_dtype, head_size=128)
    fn, args = scan_step(
        plan, stack, write=implementation, attend=implementation, tokens=tokens
    )
    compiled = compile_for_tpu(fn, args, chip, donate=(0,))
    text = compiled.as_text()
    assert text is not None
    assert kernel_calls(text) == ["jaxkv_kv_write_tpu", "jaxkv_paged_attention_tpu"]
    assert interpreted_ops(text) == []
    assert pool_sized_ops(text, args[0][0].shape) == []  # no relayout of the pool
    stats = compiled.memory_analysis()
    pool_bytes = args[0][0].size * args[0][0].dtype.itemsize
    assert stats.temp_size_in_bytes < pool_bytes // 4
    assert stats.alias_size_in_bytes >= pool_bytes  # the pool donated, in place


@needs_libtpu
@pytest.mark.parametrize("chip", ["v6e", pytest.param("v5e", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "step",
    [
        Step("decode_256x4096_block16"),
        Step("decode_256x4096_block64", block=64),
        Step("mixed_128_decode_8_prefill", decode=128, prefill=8),
        Step("decode_kv_halves", decode=8, context=1024, layout="kv"),
    ],
    ids=lambda s: s.name,
)
def test_the_report_shapes_compile_for_the_chip(chip, step):
    fn, args = attention_step(step, implementation="pallas_tpu", write="pallas_tpu")
    compiled = compile_for_tpu(fn, args, chip, donate=(0,))
    text = compiled.as_text()
    assert text is not None
    assert kernel_calls(text) == ["jaxkv_kv_write_tpu", "jaxkv_paged_attention_tpu"]
    assert interpreted_ops(text) == []
    assert pool_sized_ops(text, args[0][0].shape) == []


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("chip", "case"),
    # v6e compiles every case, v5e every other one (the report's shapes and
    # the fp8 pages compile on both chips above): CI's time.
    [
        pytest.param(chip, case, id=f"{case.name}-{chip}")
        for i, case in enumerate(CASES)
        for chip in CHIPS
        if chip == "v6e" or i % 2 == 0
    ],
)
def test_the_case_matrix_compiles_for_the_chip(chip, case):
    built = build(case)
    # Mosaic takes no float16 arguments: such pages run XLA's path on a TPU
    # (implementation=None), written by XLA's scatter, nothing interpreted.
    xla_only = mosaic_dtype_unfit(built.view) is not None

    def attend(q, pools, meta, layer):
        k = jnp.zeros((q.shape[0], case.kv_heads, case.head), q.dtype)
        slots = jnp.arange(q.shape[0], dtype=jnp.int32)
        pools = jaxkv.write_kv(
            pools, built.view, k, k, slots, layer=layer, implementation=None
        )
        out = jaxkv.paged_attention(
            q,
            pools,
            built.view,
            meta,
            layer=layer,
            implementation=None if xla_only else "pallas_tpu",
            **built.kw,
        )
        return pools, out

    args = (built.q, built.pools, built.meta, built.layer)
    text = compile_for_tpu(attend, args, chip, donate=(1,)).as_text()
    assert text is not None
    # None writes with the Mosaic kernel where it takes the view (head-first
    # pages put tokens in the tiled dims: XLA's scatter writes those).
    write = [] if tpu_write_unfit(built.view) else ["jaxkv_kv_write_tpu"]
    attention = [] if xla_only else ["jaxkv_paged_attention_tpu"]
    assert kernel_calls(text) == [*write, *attention]
    assert interpreted_ops(text) == []


def test_a_named_kernel_off_its_device_is_interpreted_and_checked_here():
    # The other half of the rule: on CPU the TPU kernels run interpreted (what
    # the case matrix checks), and interpreted_ops sees their bodies.
    plan, stack = stacked_plan(head_size=128)
    fn, args = scan_step(plan, stack, write="pallas_tpu", attend="pallas_tpu", tokens=4)
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert text is not None
    assert kernel_calls(text) == []
    assert interpreted_ops(text)


@pytest.mark.parametrize("storage", ["words", "stacked"])
def test_no_step_trace_reads_the_default_backend(monkeypatch, storage):
    # What a step compiles to must not depend on the host that traces it: a
    # program lowered on a CPU host for a TPU is the one a TPU host lowers.
    cfg = jaxkv.llama_like_config(num_layers=2, token_buckets=(16,))
    plan = jaxkv.make_plan(cfg, num_blocks=16, storage=storage)
    builder = jaxkv.StepMetadataBuilder(plan)
    scheduler = jaxkv.Scheduler(plan)
    scheduler.add_request(jaxkv.Request("a", prompt=list(range(20)), max_new_tokens=1))
    inputs = builder.prepare(scheduler.schedule())
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]

    def step(pools, inputs, implementation=None):
        metas = builder.metadata(inputs)
        outs = []
        for layer in layers:
            meta = metas[layer.name]
            view = layer.view
            heads, head = view.shape[view.dim("head")], view.head_size
            x = jnp.ones((meta.slot_mapping.shape[0], heads, head), jnp.float32)
            pools = jaxkv.write_kv(pools, layer, x, x, meta)
            q = jnp.ones((x.shape[0], 2 * heads, head), jnp.float32)
            outs.append(
                jaxkv.paged_attention(
                    q, pools, layer, meta, scale=0.1, implementation=implementation
                )
            )
        return pools, outs

    def refuse():
        raise AssertionError("jax.default_backend() read while tracing a step")

    pools = jax.eval_shape(plan.allocate)
    monkeypatch.setattr(jax, "default_backend", refuse)
    for implementation in (None, "xla"):
        fn = jax.jit(step, static_argnums=2)
        assert fn.lower(pools, inputs, implementation).as_text()
        for platform in ("tpu", "cuda"):
            exported = jax.export.export(
                fn,
                platforms=[platform],
                disabled_checks=[
                    jax.export.DisabledSafetyCheck.custom_call(name)
                    for name in ("tpu_custom_call", "__gpu$xla.gpu.triton")
                ],
            )(pools, inputs, implementation)
            assert exported.mlir_module()


@needs_libtpu
@pytest.mark.parametrize("chip", ["v6e", pytest.param("v5e", marks=pytest.mark.slow)])
def test_fp8_pages_compile_to_the_attention_kernel_for_the_chip(chip):
    # fp8 pages with per-tensor scales (issue 58): the attention kernel DMAs
    # the bytes and converts them in VMEM; XLA's scatter writes them (the
    # Mosaic write takes no 8-bit pages yet), in place: no copy of the pool.
    step = Step("decode_fp8", quant="fp8_per_tensor", decode=8, context=1024)
    fn, args = attention_step(step, implementation="pallas_tpu", write=None)
    text = compile_for_tpu(fn, args, chip, donate=(0,)).as_text()
    assert text is not None
    assert kernel_calls(text) == ["jaxkv_paged_attention_tpu"]
    assert interpreted_ops(text) == []
    sized = pool_sized_ops(text, args[0][0].shape)
    assert sized
    assert not [op for op in sized if op.startswith("copy")]
