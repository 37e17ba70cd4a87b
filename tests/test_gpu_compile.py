"""The Triton attention kernel compiled for NVIDIA GPUs on this CPU host.

Each configuration's Triton module (caught as ``jax.export`` lowers a step
for CUDA) is compiled by PyPI's triton for sm_80 and sm_90
(``tests/gpu_compile.py``): no register spills, shared memory within an
A100's 163 KB, tensor-core ``mma`` in decode and in prefill tiles, and
``cp.async`` copies (the pipelined page loads). The report
(``benchmarks/kernel_report.py``) reads the same builds.
"""

import pytest

from tests.device_compile import Step, attention_step
from tests.gpu_compile import compile_triton, triton_missing, triton_modules

pytestmark = pytest.mark.skipif(
    triton_missing() is not None, reason=str(triton_missing())
)

A100_SHARED = 163 * 1024

# Decode rows of 1 and a mixed batch (prefill tiles of 16), heads of 64 to
# 256, blocks of 16 to 128, GQA 4 and 5, head 96.
_FAST = [Step("decode_256x4096_b16"), Step("mixed_b16", decode=192, prefill=4)]
_SLOW = [
    Step("decode_256x4096_b64", block=64),
    Step("decode_256x4096_b128", block=128),
    Step("decode_4x32k", decode=4, context=32768),
    Step("decode_head256", head=256),
    Step("decode_head64", head=64),
    Step("mixed_head256_b64", decode=192, prefill=4, head=256, block=64),
    Step("decode_gqa_40_8", q_heads=40, kv_heads=8),
    Step("decode_head96", head=96, q_heads=32, kv_heads=8),
]


@pytest.mark.parametrize(
    "step",
    [pytest.param(s, id=s.name) for s in _FAST]
    + [pytest.param(s, id=s.name, marks=pytest.mark.slow) for s in _SLOW],
)
def test_the_triton_kernel_compiles_without_spills_onto_tensor_cores(step):
    fn, args = attention_step(step, implementation="pallas_gpu")
    [module] = triton_modules(fn, args)
    for arch in (80, 90):
        build = compile_triton(module, arch)
        assert build.spill_bytes == 0, build
        assert build.shared_bytes <= A100_SHARED, build
        assert build.mma > 0, build  # bf16 dots on tensor cores
        assert build.cp_async > 0, build  # page loads pipelined


def test_fp8_pages_compile_for_sm_90_and_are_refused_below_sm_89():
    # fp8 per-tensor pages (issue 58): read as bytes, converted to bfloat16 in
    # the kernel; Triton converts e4m3 on sm_89 and newer only, so an A100
    # (sm_80) leaves them to XLA's path (gpu_unfit says why).
    step = Step("decode_fp8_256x4096_b16", quant="fp8_per_tensor")
    fn, args = attention_step(step, implementation="pallas_gpu")
    [module] = triton_modules(fn, args)
    build = compile_triton(module, 90)
    assert build.spill_bytes == 0, build
    assert build.mma > 0, build
    assert build.cp_async > 0, build
    with pytest.raises(Exception, match="PassManager"):
        compile_triton(module, 80)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step("write_16384_tokens", decode=16384), id="16384_tokens"),
        pytest.param(
            Step("write_head96_gqa5", decode=512, head=96, kv_heads=5, q_heads=40),
            id="head96_kv5",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_kv_write_stores_whole_rows_in_16_byte_vectors(step):
    fn, args = attention_step(step, implementation="pallas_gpu", write="pallas")
    [write] = [m for m in triton_modules(fn, args) if "write" in m.name]
    for arch in (80, 90):
        build = compile_triton(write, arch)
        assert build.spill_bytes == 0, build
        assert build.vector_stores > 0, build  # st.global.v4: 16 bytes a lane
