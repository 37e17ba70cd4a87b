"""Quantized KV caches (issue 58): vLLM's quantization modes and their page
arithmetic, with vLLM 0.32's numbers (``AttentionSpec.page_size_bytes`` after
the Triton / MLA backends' ``customize_spec``: per-token-head pages carry a
float32 scale pair per token and head).
"""  # noqa: D205

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._native import available, unavailable_reason
from tests.attention_cases import (
    PER_HEAD_CASE,
    QUANT_CASES,
    Case,
    build,
    dense,
    run,
    stored,
)


def _full(**kw):
    base = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    return jaxkv.FullAttentionSpec(**{**base, **kw})


@pytest.mark.parametrize(
    ("spec", "page"),
    [
        (_full(), 65536),  # 16 * 8 * (128 + 128) * 2
        (_full(dtype="float8_e4m3fn", kv_quant_mode="fp8_per_tensor"), 32768),
        (_full(dtype="float8_e5m2", kv_quant_mode="fp8_per_tensor"), 32768),
        # 16 * 8 * ((128 + 128) * 1 + 2 * 4): vLLM's TritonAttentionBackend
        (_full(dtype="int8", kv_quant_mode="int8_per_token_head"), 33792),
        (_full(dtype="float8_e4m3fn", kv_quant_mode="fp8_per_token_head"), 33792),
        # head_size_v != head_size: (192 + 128) * 1 + 8 per head and token
        (
            _full(
                head_size=192,
                head_size_v=128,
                dtype="int8",
                kv_quant_mode="int8_per_token_head",
            ),
            16 * 8 * 328,
        ),
        # MLA (DeepSeek's 576-wide latent, no values): 576 * 1 + 8, one slot
        (
            jaxkv.MLAAttentionSpec(
                block_size=64,
                num_kv_heads=1,
                head_size=576,
                dtype="float8_e4m3fn",
                kv_quant_mode="fp8_per_token_head",
            ),
            64 * 584,
        ),
        (
            jaxkv.SlidingWindowSpec(
                block_size=16,
                num_kv_heads=8,
                head_size=128,
                dtype="int8",
                sliding_window=128,
                kv_quant_mode="int8_per_token_head",
            ),
            33792,
        ),
    ],
    ids=lambda x: x if isinstance(x, int) else None,
)
def test_page_sizes_are_vllms(spec, page):
    assert spec.page_size_bytes == page


def test_the_same_memory_holds_1_94x_the_blocks_of_bf16_with_scales():
    # 8 KV heads of 128, blocks of 16: 65536 / 33792 = 1.939 (issue 58's
    # acceptance: >= 1.9x with per-token-head scales); 2x per tensor.
    bf16 = _full().page_size_bytes
    pth = _full(dtype="int8", kv_quant_mode="int8_per_token_head").page_size_bytes
    per_tensor = _full(dtype="float8_e4m3fn", kv_quant_mode="fp8_per_tensor")
    budget = 1 << 30
    assert (budget // pth) / (budget // bf16) == pytest.approx(1.939, abs=1e-3)
    assert bf16 // per_tensor.page_size_bytes == 2


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(kv_quant_mode="int8_per_token_head"), ValueError, "int8.*bfloat16"),
        (
            dict(dtype="int8", kv_quant_mode="fp8_per_tensor"),
            ValueError,
            "float8_e4m3fn.*int8",
        ),
        (dict(kv_quant_mode="int8"), ValueError, "must be one of"),
        (dict(dtype="uint8", kv_quant_mode="nvfp4"), NotImplementedError, "NVFP4"),
        (
            dict(dtype="int8", kv_quant_mode="int4_per_token_head"),
            NotImplementedError,
            "INT4_PER_TOKEN_HEAD",
        ),
    ],
)
def test_modes_vllm_refuses_or_jaxkv_lacks_are_named(kw, error, match):
    with pytest.raises(error, match=match):
        _full(**kw)


@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: c.name)
def test_xla_path_reads_8_bit_pages_as_the_oracle_of_what_was_stored(case):
    # The dense oracle over the dequantized cache (exact scales), NaN pages
    # past each seq_len included (written before: never leak); and against
    # the same case unquantized, the error quantization itself makes.
    built = build(case)
    out = run(built, None)  # None picks XLA's path for quantized pages
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense(case, built), atol=2e-5, rtol=2e-5)
    plain = dataclasses.replace(case, quant="none", k_scale=None, v_scale=None)
    reference = run(build(plain), "xla")
    # int8 keeps 7 bits of a token-head's range, e4m3 3 mantissa bits, e5m2 2;
    # the cases' score scale is 0.5, not 1/sqrt(head): heads of 128 give
    # scores four times sharper than a model's (rounding errors to match).
    tol = {"int8": 0.05, "float8_e5m2": 0.5}.get(built.view.dtype.name, 0.2)
    tol *= 1.5 if case.head >= 128 else 1.0
    np.testing.assert_allclose(out, reference, atol=tol)


def test_static_scales_per_kv_head_are_stored_and_read_per_head():
    # vLLM's per-attention-head scales: head h stored as fp8(x / s_h), read
    # as stored * s_h by XLA's path (the float64 oracle of the stored cache);
    # equal scales per head read exactly as the one per-tensor scale.
    case = PER_HEAD_CASE
    built = build(case)
    out = run(built, None)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense(case, built), atol=2e-5, rtol=2e-5)
    plain = dataclasses.replace(case, quant="none", k_scale=None, v_scale=None)
    np.testing.assert_allclose(out, run(build(plain), "xla"), atol=0.2)
    # The bytes: head 1 of K holds k / 2.0, head 0 k / 0.25.
    view = built.view
    k = jnp.asarray(np.full((1, 2, case.head), 1.0, np.float32))
    pools = jaxkv.write_kv(
        jax.tree.map(jnp.copy, built.pools),
        view,
        k,
        k,
        jnp.array([0], jnp.int32),
        k_scale=jnp.array([0.25, 2.0]),
        v_scale=np.array([4.0, 0.5]),
    )
    ks, vs = jaxkv.gather_kv_pages(pools, view, jnp.zeros((1, 1), jnp.int32))
    assert np.asarray(ks[0, 0, 0].astype(jnp.float32))[:, 0].tolist() == [4.0, 0.5]
    assert np.asarray(vs[0, 0, 0].astype(jnp.float32))[:, 0].tolist() == [0.25, 2.0]
    same = dataclasses.replace(case, k_scale=(0.5, 0.5), v_scale=(2.0, 2.0))
    scalar = dataclasses.replace(case, k_scale=0.5, v_scale=2.0)
    np.testing.assert_array_equal(run(build(same), None), run(build(scalar), None))


@pytest.mark.parametrize("implementation", ["native", "pallas_gpu", "pallas_tpu"])
def test_the_kernels_refuse_scales_per_head_by_name(implementation):
    built = build(dataclasses.replace(PER_HEAD_CASE, tile=1))
    with pytest.raises(ValueError, match="static scales per KV head"):
        run(built, implementation)


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        ((0.5, 0.5, 0.5), ValueError, r"one per KV head \(2 for this view\)"),
        ((0.5, -1.0), ValueError, "finite and > 0"),
        ("0.5", TypeError, "one float per KV head"),
    ],
)
def test_bad_scales_per_head_are_named(scale, error, match):
    built = build(PER_HEAD_CASE)
    kw = {**built.kw, "k_scale": scale}
    with pytest.raises(error, match=match):
        jaxkv.paged_attention(built.q, built.pools, built.view, built.meta, **kw)
    if error is ValueError and len(scale) == 3:
        with pytest.raises(ValueError, match="one entry per head"):
            jaxkv.write_kv(
                jax.tree.map(jnp.copy, built.pools),
                built.view,
                jnp.zeros((1, 2, PER_HEAD_CASE.head)),
                jnp.zeros((1, 2, PER_HEAD_CASE.head)),
                jnp.zeros((1,), jnp.int32),
                k_scale=jnp.array(scale),
            )


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize(
    "case", [c for c in QUANT_CASES if c.typed], ids=lambda c: c.name
)
def test_the_pallas_kernels_dequantize_fp8_per_tensor_pages_in_the_kernel(
    implementation, case
):
    # Both kernels (interpreted here) read the fp8 bytes and compute in
    # bfloat16: K's static scale folded into the scores, V's into the output.
    built = build(case)
    out = run(built, implementation)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, run(built, "xla"), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(out, dense(case, built), atol=3e-2, rtol=3e-2)
    # Per-token-head pages (a scale per token in the page) stay refused.
    with pytest.raises(ValueError, match="int8_per_token_head pages"):
        run(build(QUANT_CASES[0]), implementation)


@pytest.mark.skipif(not available(), reason=f"no native kernel: {unavailable_reason()}")
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: c.name)
def test_the_native_kernel_reads_8_bit_pages_as_stored(case):
    # One byte per element read in place (int8, e4m3, e5m2), each key's
    # score times its K scale and each value's weight times its V scale (per
    # token and head), or the static scales (per tensor); rows of one query
    # token, as the kernel takes them. NaN pages past each seq_len (written
    # before, NaN scales included) never leak.
    case = dataclasses.replace(case, tile=1)
    built = build(case)
    out = run(built, "native")
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense(case, built), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out, run(built, "xla"), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not available(), reason=f"no native kernel: {unavailable_reason()}")
def test_the_native_kernel_reads_a_nan_written_token_as_nan_where_seen():
    # A NaN key written into an int8 page stores 0 with a NaN scale: the rows
    # that see it are NaN on both paths, the others untouched.
    case = dataclasses.replace(QUANT_CASES[0], tile=1)
    built = build(case)
    table = np.asarray(built.meta.block_table_tensor)
    slot = int(table[1, 0]) * built.view.block_size  # request 1's first key
    nan = jnp.full((1, case.kv_heads, case.head), jnp.nan)
    pools = jaxkv.write_kv(
        built.pools, built.view, nan, nan, jnp.array([slot], jnp.int32)
    )
    built = dataclasses.replace(built, pools=pools)
    out, xla = run(built, "native"), run(built, "xla")
    assert np.isnan(out[1]).all()
    assert np.isnan(xla[1]).all()
    np.testing.assert_allclose(out[[0, 2]], xla[[0, 2]], atol=2e-5, rtol=2e-5)
    assert np.isfinite(out[[0, 2]]).all()


def test_the_write_quantizes_as_vllm_does():
    # scale = max(absmax / 127, 1e-6) per token and head; x / scale rounded
    # half away from zero, clamped to [-128, 127]; a zero head keeps 1e-6;
    # a NaN head stores 0 with a NaN scale (reads NaN, as it was written).
    from jaxkv.kv._quant import quantize

    view = build(QUANT_CASES[0]).view
    x = np.zeros((3, 2, 16), np.float32)
    x[0, 0, :4] = [1.27, -0.635, 0.0063, -1.27]
    x[2, 1, 3] = np.nan
    q, s = quantize(jnp.asarray(x), view, None)
    q, s = np.asarray(q), np.asarray(s)
    assert s[0, 0] == pytest.approx(0.01)
    assert q[0, 0, :4].tolist() == [127, -64, 1, -127]  # -63.5 -> -64
    assert s[1, 0] == pytest.approx(1e-6)
    assert (q[1] == 0).all()
    assert np.isnan(s[2, 1])
    assert (q[2, 1] == 0).all()
    assert q.dtype == np.int8


def test_scales_are_only_for_the_pages_that_take_them():
    built = build(QUANT_CASES[0])
    with pytest.raises(ValueError, match="fp8_per_tensor"):
        jaxkv.paged_attention(
            built.q, built.pools, built.view, built.meta, k_scale=0.5, **built.kw
        )
    with pytest.raises(ValueError, match="fp8_per_tensor"):
        jaxkv.write_kv(
            built.pools,
            built.view,
            jnp.zeros((1, 2, 16)),
            jnp.zeros((1, 2, 16)),
            jnp.zeros((1,), jnp.int32),
            k_scale=0.5,
        )


def test_quantized_blocks_are_never_moved_through_a_requantizing_write():
    # Gathered 8-bit values carry no per-token-head scales: writing them
    # again through the quantized view is refused; block copies, the host
    # tier and a resize move them through jaxkv.kv.raw_views, transfers as
    # dequantized values (tests below).
    built = build(QUANT_CASES[0])
    k, v = jaxkv.gather_kv_pages(built.pools, built.view, jnp.array([[1]]))
    k, v = (x.reshape(-1, *x.shape[3:]) for x in (k, v))
    slots = jnp.arange(k.shape[0], dtype=jnp.int32)
    with pytest.raises(ValueError, match="carry no scales"):
        jaxkv.write_kv(built.pools, built.view, k, v, slots)


def test_a_block_copy_moves_the_pages_scales_with_them():
    from tests.attention_cases import stored

    case = QUANT_CASES[0]
    built = build(case)
    plan_view = built.view
    # The plan of the case's view: rebuild it as build() does.
    plan = _case_plan(case)
    assert plan.views["a"] == plan_view
    src = int(np.asarray(built.meta.block_table_tensor)[0, 0])
    free = sorted(
        set(range(1, 24))
        - set(np.asarray(built.meta.block_table_tensor).ravel().tolist())
    )
    pools = jaxkv.copy_blocks(built.pools, plan, [src], [free[0]])
    k, _ = stored(pools, plan_view, case)
    kb = plan_view.block_size
    np.testing.assert_array_equal(
        k[free[0] * kb : (free[0] + 1) * kb], k[src * kb : (src + 1) * kb]
    )


def _case_plan(case):
    """The plan `build(case)` makes for a quantized case (its layers a and b)."""
    spec = jaxkv.FullAttentionSpec(
        block_size=case.block,
        num_kv_heads=case.kv_heads,
        head_size=case.head,
        dtype="int8",
        kv_quant_mode=case.quant,
    )
    backend = jaxkv.AttentionBackend(
        name=f"cases_{case.layout}_{case.kernel_block}",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED,
        supported_kernel_block_sizes=(jaxkv.vllm.MultipleOf(1),),
    )
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name=n, spec=spec, backend=backend) for n in "ab"]
    )
    return jaxkv.make_plan(cfg, num_blocks=24, storage="words")


def _quantized(cfg):
    """`cfg` with int8 pages and per-token-head scales in its attention layers."""
    layers = [
        dataclasses.replace(
            layer,
            spec=dataclasses.replace(
                layer.spec, dtype="int8", kv_quant_mode="int8_per_token_head"
            ),
        )
        for layer in cfg.layers
    ]
    return dataclasses.replace(cfg, layers=layers)


def test_the_host_tier_moves_quantized_blocks_with_their_scales():
    case = QUANT_CASES[0]
    built = build(case)
    table = np.asarray(built.meta.block_table_tensor)
    src = int(table[0, 0])
    plan = _case_plan(case)
    host = jaxkv.sched.HostKVCache(plan, num_blocks=2)
    host.record_offload(group=0, block=src, key=(0, b"prefix"))
    pools = host.flush(built.pools)
    free = sorted(set(range(1, 24)) - set(table.ravel().tolist()))
    host.record_restore(key=(0, b"prefix"), block=free[0])
    pools = host.flush(pools)
    from tests.attention_cases import stored

    k, v = stored(pools, built.view, case)
    kb = built.view.block_size
    for x in (k, v):
        np.testing.assert_array_equal(
            x[free[0] * kb : (free[0] + 1) * kb], x[src * kb : (src + 1) * kb]
        )


def test_a_loop_of_int8_pages_grows_to_the_tokens_of_one_started_large():
    from tests.test_resize import CFG, PARAMS, VOCAB, _forward_for, _wave

    cfg = _quantized(CFG)

    def loop(num_blocks):
        plan = jaxkv.make_plan(cfg, num_blocks=num_blocks)
        return jaxkv.ServingLoop(plan, _forward_for(plan), PARAMS, vocab_size=VOCAB)

    want = {r.req_id: r.output for r in loop(64).run(_wave("a", n=2))}
    small = loop(16)
    requests = _wave("a", n=2)
    for r in requests:
        small.submit(r)
    small.step()
    small.step()
    big = jaxkv.make_plan(cfg, num_blocks=64)
    small.resize(big, forward=_forward_for(big))
    small.run([])
    assert {r.req_id: r.output for r in requests} == want


def test_a_transfer_carries_quantized_pages_as_values_requantized_on_import():
    from tests.test_resize import CFG

    cfg = _quantized(CFG)
    src, dst = (jaxkv.make_plan(cfg, num_blocks=n) for n in (16, 32))
    name = cfg.layers[1].name  # the global layer
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((20, 2, 16)), jnp.float32)
    # The global layer's group (1) on blocks 3, 5, 7; the window's on 2, 4, 6.
    blocks = [3, 5, 7]
    slots = jnp.asarray([blocks[t // 8] * 8 + t % 8 for t in range(20)], jnp.int32)
    pools = jaxkv.write_kv(src.allocate(), src.attention_layer(name), k, -k, slots)
    assert src.group_of(name) == 1
    table = [[2, 4, 6], blocks]
    kv = jaxkv.transfer.export_request(src, pools, block_ids=table, num_tokens=20)
    assert kv.attention[name].keys.dtype == jnp.float32
    np.testing.assert_allclose(kv.attention[name].keys, k, atol=0.02)
    ids = [[8, 10, 12], [9, 11, 13]]
    moved = jaxkv.transfer.import_request(dst, dst.allocate(), kv, block_ids=ids)
    again = jaxkv.transfer.export_request(dst, moved, block_ids=ids, num_tokens=20)
    np.testing.assert_allclose(
        again.attention[name].keys, kv.attention[name].keys, rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_the_demo_serves_the_hybrid_model_from_an_int8_cache(capsys):
    # Full, sliding-window and YOCO layers on int8 pages with per-token-head
    # scales (Mamba states stay float32), through the Engine's ServingLoop.
    from jaxkv.demo._cli import main

    argv = "--kv-cache-dtype int8_per_token_head --num-requests 2 --max-new-tokens 6"
    argv += " --token-buckets 32"  # one bucket: two programs
    assert main(argv.split()) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    agree, total = map(int, line.split(": ")[1].split()[0].split("/"))
    assert total == 12
    assert agree >= 9, line


@pytest.mark.skipif(not available(), reason=f"no native kernel: {unavailable_reason()}")
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_native_kernel_decodes_every_fp8_byte_as_jax_does(dtype):
    # Sixteen requests of one key each (weight 1: the output is the value),
    # their values the 256 bytes of the format, NaN and Inf patterns
    # included, written as stored through the raw view (no quantization).
    from jaxkv.kv._quant import raw_views

    case = Case(
        "bytes",
        quant="fp8_per_tensor",
        typed=True,
        cache_dtype=dtype,
        kv_heads=1,
        q_heads=1,
        head=16,
        block=8,
        cols=1,
        max_reqs=16,
        reqs=((1, 1),) * 16,
        pad_tokens=0,
    )
    built = build(case)
    patterns = jax.lax.bitcast_convert_type(
        jnp.arange(256, dtype=jnp.uint8), jnp.dtype(dtype)
    ).reshape(16, 1, 16)
    slots = jnp.asarray(np.asarray(built.meta.block_table_tensor)[:, 0] * case.block)
    pools = jaxkv.write_kv(
        built.pools,
        raw_views(built.view)[0],
        jnp.zeros_like(patterns),
        patterns,
        slots,
        layer=built.layer,
    )
    out = run(dataclasses.replace(built, pools=pools), "native")
    expect = np.asarray(patterns.astype(jnp.float32)).reshape(16, 16)
    np.testing.assert_array_equal(out.reshape(16, 16), expect)


@pytest.mark.skipif(not available(), reason=f"no native kernel: {unavailable_reason()}")
@pytest.mark.parametrize("case", [*QUANT_CASES, PER_HEAD_CASE], ids=lambda c: c.name)
def test_the_native_write_stores_the_bytes_xla_stores(case):
    # Quantized by XLA on the step's tokens, then the 8-bit values and the
    # scales moved in place by the native kernel: the pool's bytes equal
    # XLA's write's, NaN and Inf tokens, dropped slots and a repeated slot
    # (the later token wins) included.
    built = build(case)
    rng = np.random.default_rng(1)
    shape = (6, case.kv_heads, case.head)
    k = rng.standard_normal(shape).astype(np.float32) * 3
    v = rng.standard_normal(shape).astype(np.float32)
    k[1, 0, 2], v[2, -1, 0], k[3, 0, 0] = np.nan, np.inf, -np.inf
    n_slots = built.view.num_blocks * built.view.block_size
    slots = jnp.array([5, 9, n_slots + 3, -1, 9, 17], jnp.int32)
    scales = {"k_scale": case.k_scale, "v_scale": case.v_scale}
    scales = {n: s for n, s in scales.items() if s is not None}

    before = np.asarray(built.pools[built.view.pool]).view(np.uint8).copy()

    def write(implementation):
        pools = jaxkv.write_kv(
            jax.tree.map(jnp.copy, built.pools),  # an eager native write donates
            built.view,
            jnp.asarray(k),
            jnp.asarray(v),
            slots,
            layer=built.layer,
            implementation=implementation,
            **scales,
        )
        return np.asarray(pools[built.view.pool]).view(np.uint8)

    mine, xla = write("native"), write("xla")
    assert (mine != before).any()
    np.testing.assert_array_equal(mine, xla)
    # And what the pages hold, dequantized with their scales, is what was
    # written (e5m2's 2 mantissa bits: within 1/8 of each value).
    pools = jaxkv.write_kv(
        jax.tree.map(jnp.copy, built.pools),
        built.view,
        jnp.asarray(k),
        jnp.asarray(v),
        slots,
        layer=built.layer,
        implementation="native",
        **scales,
    )
    got_k, got_v = stored(pools, built.view, case, layer=built.layer)
    for t, slot in ((0, 5), (4, 9), (5, 17)):
        np.testing.assert_allclose(got_k[slot], k[t], rtol=0.13, atol=0.05)
        np.testing.assert_allclose(got_v[slot], v[t], rtol=0.13, atol=0.05)
