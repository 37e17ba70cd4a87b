"""Every attention implementation against XLA's path over one case matrix
(``tests/attention_cases.py``), and XLA's path against a dense oracle. The
Pallas kernels run in Pallas's interpret modes here (Triton's and the TPU's),
the native kernel compiled for this CPU.
"""  # noqa: D205

import os

import numpy as np
import pytest

import jaxkv
from jaxkv._native import available
from tests.attention_cases import CASES, build, dense, run

_TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}
# The TPU interpreter and the native kernel's build cost seconds a case: the
# README's command runs them on these cases, CI's slow pass on all of them.
_QUICK = {
    "decode_fused_bf16_bits",
    "mixed_kv_window",
    "decode_hnd_cap",
    "mixed_kernel_blocks_window_cap",
    "decode_past_table",  # one rule for keys past the table, native included
    "decode_waves_of_2",  # the TPU kernel's DMA waves, several per row
    "mixed_kv_waves_window",
    "decode_fused_bf16_head128_strided",  # the TPU kernel's strided head loads
}


# CI's 64-bit pass (JAXKV_QUICK=1) checks index dtypes on the quick cases only.
_ALL_GPU = os.environ.get("JAXKV_QUICK") != "1"


def _matrix(cases, implementations):
    return [
        pytest.param(
            case,
            impl,
            id=f"{case.name}-{impl}",
            marks=()
            if (impl == "pallas_gpu" and _ALL_GPU) or case.name in _QUICK
            else (pytest.mark.slow,),
        )
        for case in cases
        for impl in implementations
    ]


@pytest.fixture(scope="module")
def xla_outputs():
    return {}


def _xla(case, cache):
    if case.name not in cache:
        built = build(case)
        cache[case.name] = (built, run(built, "xla"))
    return cache[case.name]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_xla_path_matches_the_dense_oracle(case, xla_outputs):
    built, out = _xla(case, xla_outputs)
    want = dense(case, built)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=_TOL[case.dtype], rtol=_TOL[case.dtype])


@pytest.mark.parametrize(
    ("case", "implementation"), _matrix(CASES, ["pallas_gpu", "pallas_tpu", "native"])
)
def test_implementation_matches_the_xla_path(case, implementation, xla_outputs):
    built, want = _xla(case, xla_outputs)
    if implementation == "native" and not available():
        pytest.skip("no C++ compiler for the native kernel")
    call_fits = _fits(built, implementation)
    if call_fits is not None:
        # An implementation that cannot run a case says why, by name.
        with pytest.raises(ValueError, match=f"implementation='{implementation}'"):
            run(built, implementation)
        if implementation == "pallas_tpu":  # Mosaic takes no float16 arguments
            assert case.dtype == "float16", call_fits
            assert "float16 pages" in call_fits
            return
        assert implementation == "native", call_fits
        assert case.tile > 1, call_fits
        return
    out = run(built, implementation)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=_TOL[case.dtype], rtol=_TOL[case.dtype])


def _fits(built, implementation):
    try:
        run_shapes = built.q.shape
        from jaxkv.attention._call import Call
        from jaxkv.attention._rows import Mask

        kw = built.kw
        call = Call(
            Mask(
                True,
                kw.get("sliding_window"),
                kw.get("attention_chunk_size"),
                bool(kw.get("cross_attention")),
                False,
            ),
            kw["scale"],
            kw.get("logits_soft_cap"),
            None,
            kw["query_tile"],
            "auto",
        )
        jaxkv.attention.choose_implementation(
            implementation, built.view, call, run_shapes
        )
    except ValueError as err:
        return str(err)
    return None


_WRITE_CASES = [
    c
    for c in CASES
    if c.name
    in (
        "decode_fused_f32",
        "decode_fused_bf16_bits",
        "mixed_kv_window",
        "mixed_kv_first_bf16_chunk",
        "decode_hnd_cap",
        "mixed_kernel_blocks_window_cap",
        "decode_head80_gqa5",  # heads and dims padded by masked stores
        "mixed_kv_head96_block12_tile3",
    )
]


@pytest.mark.parametrize(
    ("case", "implementation"),
    _matrix(_WRITE_CASES, ["pallas_gpu", "pallas_tpu", "native"]),
)
def test_write_implementation_writes_the_bytes_xla_writes(case, implementation):
    import jax
    import jax.numpy as jnp

    if implementation == "native" and not available():
        pytest.skip("no C++ compiler for the native kernel")
    built = build(case)
    view = built.view
    if implementation == "pallas_tpu" and case.layout == "hnd":
        # Tokens in the TPU's tiled dims: refused, naming why.
        k = jnp.zeros((1, case.kv_heads, case.head), jnp.dtype(case.dtype))
        with pytest.raises(ValueError, match="head-first page"):
            jaxkv.write_kv(
                built.pools, view, k, k, np.array([0]), implementation=implementation
            )
        return
    rng = np.random.default_rng(1)
    n_slots = view.num_blocks * view.block_size
    # Padding, a slot past the view's blocks, int32's end and real slots.
    slots = np.array(
        [-1, n_slots, 2**31 - 1, 0, 5, n_slots - 1, 3 * view.block_size + 2],
        np.int32,
    )
    dtype = jnp.dtype(case.dtype)
    k = jnp.asarray(rng.standard_normal((7, case.kv_heads, case.head)), dtype)
    v = jnp.asarray(rng.standard_normal((7, case.kv_heads, case.head)), dtype)

    @jax.jit
    def write(pools, layer, implementation=implementation):
        return jaxkv.write_kv(
            pools, view, k, v, slots, layer=layer, implementation=implementation
        )

    def bits(pools):
        return [np.asarray(p).view(np.uint8) for p in pools]

    for layer in (case.layer, 5, -1):  # a layer outside the pool writes nothing
        fresh = build(case).pools
        want = bits(
            jax.jit(
                lambda p, i: jaxkv.write_kv(
                    p, view, k, v, slots, layer=i, implementation="xla"
                )
            )(fresh, jnp.int32(layer))
        )
        got = bits(write(build(case).pools, jnp.int32(layer)))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        if layer == 5:
            np.testing.assert_array_equal(got[0], bits(build(case).pools)[0])


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu", "native"])
def test_a_page_id_at_the_pools_end_or_negative_reads_as_nan_as_on_xla(
    implementation,
):
    # The boundary ids: num_blocks itself (one past the last block) and -1,
    # on pages the rows read; a bad id past what a row reads changes nothing.
    import dataclasses

    import jax.numpy as jnp

    if implementation == "native" and not available():
        pytest.skip("no C++ compiler for the native kernel")
    case = next(c for c in CASES if c.name == "decode_waves_of_2")
    built = build(case)
    table = np.asarray(built.meta.block_table_tensor).copy()
    orig = table.copy()
    table[0, 3] = built.view.num_blocks  # request 0 (33 keys) reads page 3
    table[1, 0] = -1  # request 1 (9 keys) reads page 0
    table[2, 4] = built.view.num_blocks  # request 2 (40 keys) reads page 4
    table[1, 3] = built.view.num_blocks  # past request 1's keys: never read
    meta = dataclasses.replace(built.meta, block_table_tensor=jnp.asarray(table))
    bad = dataclasses.replace(built, meta=meta)
    want = run(bad, "xla")
    got = run(bad, implementation)
    assert np.isnan(want[:3]).all()  # each request's row sees a bad page
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    table[0, 3], table[1, 0], table[2, 4] = orig[0, 3], orig[1, 0], orig[2, 4]
    meta = dataclasses.replace(built.meta, block_table_tensor=jnp.asarray(table))
    fine = run(dataclasses.replace(built, meta=meta), implementation)
    assert np.isfinite(fine).all()


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu", "native"])
def test_a_layer_slot_outside_the_pool_reads_as_nan_as_on_xla(implementation):
    # Slot 2 is one past a 2-layer stack and -1 is before it: every query
    # that sees a key reads NaN, never another layer's pages or a wrapped id.
    import dataclasses

    import jax.numpy as jnp

    if implementation == "native" and not available():
        pytest.skip("no C++ compiler for the native kernel")
    case = next(c for c in CASES if c.name == "decode_waves_of_2")
    built = build(case)
    for layer in (2, -1):
        bad = dataclasses.replace(built, layer=jnp.int32(layer))
        want = run(bad, "xla")
        assert np.isnan(want[: built.num_tokens]).all()
        got = run(bad, implementation)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
