"""The native XLA:CPU decode kernel (``implementation="native"``) against XLA's path."""

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._native import available, unavailable_reason
from tests.helpers import run_asan_check

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.skipif(
        not available(), reason=f"native kernel unavailable: {unavailable_reason()}"
    ),
    pytest.mark.skipif(
        jax.default_backend() != "cpu", reason="the native kernel runs on XLA:CPU"
    ),
]


def _decode(
    *,
    storage="typed",
    dtype="float32",
    heads=2,
    q_heads=8,
    head=32,
    block=8,
    seq_lens=(1, 9, 30, 17),
    width=5,
    layout=None,
    tensor_layout=None,
    seed=0,
):
    """A decode step (one token per request, two padded tokens) over random K/V.

    With `tensor_layout` (a vLLM 0.33 ``TensorLayout``), K/V live in layer 1 of
    a two-layer tensor of that layout over a flat word pool instead of the
    plan's pool.
    """
    rng = np.random.default_rng(seed)
    backend = jaxkv.AttentionBackend(
        name=f"N_{layout}",
        layout=layout or jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(jaxkv.vllm.MultipleOf(1),),
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype
    )
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name="l", spec=spec, backend=backend)]
    )
    num_reqs = len(seq_lens)
    num_blocks = num_reqs * width + 1
    plan = jaxkv.make_plan(cfg, num_blocks=num_blocks, storage=storage)
    view = plan.views["l"]
    pools = plan.allocate()
    if tensor_layout is not None:
        shape, strides = jaxkv.vllm.layout_strides(
            spec, num_blocks=num_blocks, num_layers=2, layout=tensor_layout
        )
        size = int(np.prod(shape))  # bytes: the content axis is in bytes
        tensor = jaxkv.vllm.LayerTensor(
            size=size,
            layers=("other", "l"),
            layer_stride=strides[0],
            block_stride=strides[1],
        )
        pool_specs, views = jaxkv.vllm.allocate_layer_tensors(
            [tensor],
            dict.fromkeys(tensor.layers, spec),
            num_blocks=num_blocks,
            layout=tensor_layout,
        )
        view, pools = views["l"], jaxkv.plan.allocate_pools(pool_specs)
    tables = np.zeros((num_reqs, width), np.int32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    for r, seq_len in enumerate(seq_lens):
        tables[r] = [free.pop() for _ in range(width)]
        k = rng.standard_normal((seq_len, heads, head)).astype(np.float32)
        v = rng.standard_normal((seq_len, heads, head)).astype(np.float32)
        pos = np.arange(seq_len)
        slots = tables[r][pos // block] * block + pos % block
        pools = jaxkv.write_kv(
            pools, view, jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots
        )
    # Two padded tokens, and request rows for them (a decode bucket holds no
    # more tokens than request rows: rows of one token).
    t_pad = num_reqs + 2
    qsl = np.pad(np.arange(num_reqs + 1, dtype=np.int32), (0, 2), mode="edge")
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        num_reqs,
        num_reqs,
        qsl,
        None,
        1,
        np.pad(np.asarray(seq_lens, np.int32), (0, 2)),
        max(seq_lens),
        [np.pad(tables, ((0, 2), (0, 0)))],
        [np.full(t_pad, -1, np.int32)],
        plan.kv_cache_config,
    )["l"]
    q = jnp.asarray(rng.standard_normal((t_pad, q_heads, head)), dtype)
    return pools, view, meta, q, tables


def _both(pools, view, meta, q, **kw):
    attend = functools.partial(jaxkv.paged_attention, scale=0.3, **kw)
    native = np.asarray(
        attend(q, pools, view, meta, implementation="native"), np.float32
    )
    xla = np.asarray(attend(q, pools, view, meta, implementation="xla"), np.float32)
    return native, xla


@pytest.mark.parametrize(
    ("storage", "dtype", "heads", "q_heads", "head", "layout"),
    [
        ("typed", "float32", 2, 8, 32, None),  # groups of 4, vector paths
        ("words", "float32", 2, 8, 32, None),  # a carrier-word pool, in place
        ("typed", "bfloat16", 2, 4, 64, None),  # bf16 as uint16 bits on CPU
        ("words", "bfloat16", 1, 8, 16, None),  # bf16 words, one KV head
        ("typed", "float32", 2, 6, 32, None),  # groups of 3: the scalar loops
        ("typed", "float32", 4, 4, 8, None),  # head 8: not a multiple of 16
        ("words", "float32", 2, 16, 32, jaxkv.KVCacheLayout.KV_FIRST),
        ("words", "float32", 2, 2, 32, jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED),
        ("stacked", "float32", 2, 8, 32, None),
    ],
)
def test_native_decode_equals_xla_across_layouts_dtypes_and_groups(
    storage, dtype, heads, q_heads, head, layout
):
    pools, view, meta, q, _ = _decode(
        storage=storage,
        dtype=dtype,
        heads=heads,
        q_heads=q_heads,
        head=head,
        layout=layout,
    )
    native, xla = _both(pools, view, meta, q)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(native, xla, rtol=tol, atol=tol)
    assert np.isfinite(native).all()
    assert not native[-2:].any()  # padded tokens: zeros


@pytest.mark.parametrize(
    "tensor_layout",
    [
        jaxkv.vllm.TensorLayout.LBNHC,  # K and V side by side per token and head
        jaxkv.vllm.TensorLayout.LBHNC,  # per head, its tokens together
        jaxkv.vllm.TensorLayout.LHBNC,  # heads outermost: a head's pages far apart
        jaxkv.vllm.TensorLayout.BHLNC,  # blocks outermost, then heads, then layers
    ],
)
@pytest.mark.parametrize(("heads", "q_heads"), [(2, 8), (3, 3)])
def test_native_decode_reads_vllm_0_33_tensor_views_as_xla_does(
    tensor_layout, heads, q_heads
):
    # The kernel reads a page's keys and values through the view's strides
    # and asks for the next page's lines per head: on LHBNC and BHLNC a head's
    # keys of one page are far from the next head's.
    pools, view, meta, q, _ = _decode(
        heads=heads, q_heads=q_heads, tensor_layout=tensor_layout
    )
    native, xla = _both(pools, view, meta, q)
    np.testing.assert_allclose(native, xla, rtol=1e-5, atol=1e-5)
    assert np.isfinite(native).all()
    assert (np.abs(native[:-2]).max(axis=(1, 2)) > 0).all()


@pytest.mark.parametrize(
    "mask",
    [
        {"sliding_window": 5},
        {"sliding_window": 1},
        {"attention_chunk_size": 8},
        {"logits_soft_cap": 2.0},
        {"sliding_window": 12, "logits_soft_cap": 1.5},
        {"cross_attention": True},
    ],
)
def test_native_decode_masks_equal_xla(mask):
    pools, view, meta, q, _ = _decode(seq_lens=(1, 9, 30, 17, 40), width=5)
    if mask.get("cross_attention"):
        meta = dataclasses.replace(
            meta, encoder_seq_lens=jnp.asarray([3, 8, 1, 0, 33], jnp.int32)
        )
    native, xla = _both(pools, view, meta, q, **mask)
    np.testing.assert_allclose(native, xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mask", [{}, {"attention_chunk_size": 8}, {"sliding_window": 5}]
)
def test_a_non_causal_request_sees_its_whole_context_or_chunk(mask):
    pools, view, meta, q, _ = _decode(seq_lens=(12, 20, 30, 5, 6))
    # Request 0 has 5 query tokens (positions 7..11) in rows of one token: a
    # non-causal one sees past itself, up to its local chunk's end (8).
    meta = dataclasses.replace(
        meta,
        request_causal=jnp.asarray([False, True, False, True, True, True, True]),
        query_start_loc=jnp.asarray([0, 5, 6, 7, 7, 7, 7, 7], jnp.int32),
        num_actual_tokens=jnp.int32(7),
    )
    native, xla = _both(pools, view, meta, q, **mask)
    np.testing.assert_allclose(native, xla, rtol=1e-5, atol=1e-5)


def test_a_bad_page_id_that_a_row_reads_is_nan_one_it_skips_is_not():
    pools, view, meta, q, tables = _decode(seq_lens=(20, 20, 4))
    bad = np.array(tables)
    bad[0, 1] = view.num_blocks + 7  # read by row 0 (keys 8..15)
    bad[1, 1] = -3
    bad[2, 3] = 10**6  # past row 2's keys: never read
    meta = dataclasses.replace(meta, block_table_tensor=jnp.asarray(bad))
    native, xla = _both(pools, view, meta, q, sliding_window=6)
    # Rows 0 and 1 see keys 14..19: pages 1 and 2; row 2 sees page 0 only.
    assert np.isnan(native[:2]).all()
    np.testing.assert_array_equal(np.isnan(native), np.isnan(xla))
    np.testing.assert_allclose(native[2], xla[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [8, 16, 12])
def test_nan_in_a_query_or_a_key_spreads_as_on_xla(block):
    """A NaN query makes its own head NaN; a NaN key makes every query head
    of its KV head NaN on the rows that see it: the NaN pattern and every
    finite value equal XLA's, on full pages (scaled 8 scores at a time) and
    partial ones.
    """  # noqa: D205
    pools, view, meta, q, tables = _decode(block=block, seq_lens=(20, 33, 5, 16))
    q = q.at[0, 1].set(jnp.nan)  # row 0, query head 1 (KV head 0)
    # Row 1's key 21 on KV head 1: its page and offset from the table.
    slot = int(tables[1][21 // block]) * block + 21 % block
    k = jnp.zeros((1, 2, 32), jnp.float32).at[0, 1, 3].set(jnp.nan)
    pools = jaxkv.write_kv(pools, view, k, jnp.zeros_like(k), np.array([slot]))
    native, xla = _both(pools, view, meta, q)
    np.testing.assert_array_equal(np.isnan(native), np.isnan(xla))
    assert np.isnan(native[0, 1]).all()
    assert not np.isnan(native[0, [0, 2, 3, 4]]).any()
    assert np.isnan(native[1, 4:]).all()  # KV head 1's query heads 4-7
    assert not np.isnan(native[1, :4]).any()
    finite = ~np.isnan(xla)
    np.testing.assert_allclose(native[finite], xla[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["words", "typed"])
def test_a_view_of_another_plan_is_refused_before_the_kernel_reads_a_byte(storage):
    pools, _, _, q, _ = _decode(storage=storage, seq_lens=(4, 4))
    _, big_view, big_meta, _, _ = _decode(storage=storage, seq_lens=(4, 4), width=40)
    with pytest.raises(ValueError, match="another plan"):
        jaxkv.paged_attention(
            q, pools, big_view, big_meta, scale=1.0, implementation="native"
        )


def test_a_traced_layer_inside_a_scan_reads_its_own_slot_and_bad_slots_are_nan():
    cfg = jaxkv.llama_like_config(num_layers=3, max_model_len=64)
    plan = jaxkv.make_plan(cfg, num_blocks=8, storage="stacked")
    names = [f"layers.{i}.self_attn" for i in range(3)]
    stack = plan.layer_stack(names)
    view = stack.layer.view
    rng = np.random.default_rng(1)
    pools = plan.allocate()
    shape = (20, view.shape[view.dim("head")], view.head_size)
    for i, name in enumerate(names):
        k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        pools = jaxkv.write_kv(
            pools, plan.views[name], k, k * 2 + i, jnp.arange(20) + 16
        )
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        2,
        2,
        np.array([0, 1, 2], np.int32),
        None,
        1,
        np.array([20, 7], np.int32),
        20,
        [np.array([[1, 2, 3, 0], [1, 0, 0, 0]], np.int32)],
        [np.full(2, -1, np.int32)],
        plan.kv_cache_config,
    )[names[0]]
    q = jnp.asarray(rng.standard_normal((2, 4, view.head_size)), jnp.float32)

    @functools.partial(jax.jit, static_argnames="implementation")
    def scanned(pools, slots, implementation):
        def body(_, slot):
            out = jaxkv.paged_attention(
                q,
                pools,
                stack.layer,
                meta,
                scale=0.2,
                layer=slot,
                implementation=implementation,
            )
            return None, out

        return jax.lax.scan(body, None, slots)[1]

    slots = jnp.asarray([*stack.slots, 3, -1, 2**31 - 1], jnp.int32)
    xla = np.asarray(scanned(pools, slots, "xla"))
    assert not np.allclose(xla[0], xla[1])  # each slot its own cache
    assert np.isnan(xla[3:]).all()  # a slot outside the pool reads as NaN
    for implementation in ("native", "pallas_gpu", "pallas_tpu"):
        out = np.asarray(scanned(pools, slots, implementation))
        np.testing.assert_allclose(out[:3], xla[:3], rtol=1e-5, atol=1e-5)
        assert np.isnan(out[3:]).all(), implementation


def test_native_runs_only_when_asked_for():
    pools, view, meta, q, _ = _decode()

    def hlo(implementation, query_tile=None):
        fn = jax.jit(
            lambda pools, q, meta: jaxkv.paged_attention(
                q,
                pools,
                view,
                meta,
                scale=1.0,
                implementation=implementation,
                query_tile=query_tile,
            )
        )
        return fn.lower(pools, q, meta).as_text()

    assert "jaxkv_paged_decode" in hlo("native")
    # None on CPU is XLA's path: the C++ kernel is opt-in.
    assert "jaxkv_paged_decode" not in hlo(None)
    assert "jaxkv_paged_decode" not in hlo("xla")


def test_native_refuses_what_it_cannot_run_naming_why():
    pools, view, meta, q, _ = _decode()
    with pytest.raises(ValueError, match="rows of 4 query tokens"):
        jaxkv.paged_attention(
            q, pools, view, meta, scale=1.0, implementation="native", query_tile=4
        )
    with pytest.raises(ValueError, match="use_mm_prefix"):
        jaxkv.paged_attention(
            q, pools, view, meta, scale=1.0, implementation="native", use_mm_prefix=True
        )
    pools8, view8, meta8, q8, _ = _decode(dtype="float16")
    with pytest.raises(ValueError, match="dtype float16"):
        jaxkv.paged_attention(
            q8, pools8, view8, meta8, scale=1.0, implementation="native"
        )
    out = jaxkv.paged_attention(q8, pools8, view8, meta8, scale=1.0)
    assert out.shape == q8.shape


def _run(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)} | env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_PROBE = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from tests.test_native_decode import _decode
    import jaxkv
    pools, view, meta, q, _ = _decode()
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    outs = [
        jax.jit(jax.shard_map(
            lambda p, q, m, i=i: jaxkv.paged_attention(
                q, p, view, m, scale=1.0, implementation=i),
            mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
            check_vma=True))(pools, q, meta)
        for i in ("native", "xla")
    ]
    print("shard_map equal:", bool(np.allclose(*outs, atol=1e-5)))
"""


def test_native_by_name_inside_shard_map_on_several_devices():
    # A custom call cannot be split by the SPMD partitioner: on a mesh it
    # runs per device inside shard_map (check_vma on).
    out = _run(
        _PROBE,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    assert "shard_map equal: True" in out, out


_CACHED = """
    import warnings
    from jaxkv import _native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = _native.unavailable_reason()
    print("reason:", reason)
    print("warned:", [str(w.message) for w in caught])
    import jaxkv
    from tests.test_native_decode import _decode
    pools, view, meta, q, _ = _decode()
    try:
        out = jaxkv.paged_attention(q, pools, view, meta, scale=1.0,
                                    implementation="native")
        print("native ok", out.shape)
    except ValueError as err:
        print("native refused:", err)
    out = jaxkv.paged_attention(q, pools, view, meta, scale=1.0)
    print("default ok", out.shape)
"""


@pytest.mark.slow  # three builds of the library (about 20 s each on 2 cores)
def test_the_library_is_cached_and_a_truncated_or_foreign_one_never_crashes(tmp_path):
    """Built once, then found (not compiled again); a truncated cached library
    or one without its record is rebuilt; a foreign one is refused by name.
    """  # noqa: D205
    code = """
        import time
        from jaxkv import _native
        t = time.perf_counter()
        path = _native.build()
        print(path, time.perf_counter() - t)
    """
    first = _run(code, JAXKV_CACHE_DIR=str(tmp_path)).split()
    second = _run(code, JAXKV_CACHE_DIR=str(tmp_path)).split()
    assert first[0] == second[0]
    assert first[0].startswith(str(tmp_path))
    assert float(second[1]) < 0.5  # found, not compiled again
    name = os.path.basename(first[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, name + ".sha256"]
    lib = Path(first[0])
    record = lib.with_name(lib.name + ".sha256")
    good = lib.read_bytes()
    # Truncated (a build cut short, a full disk): loading it would SIGBUS.
    lib.write_bytes(good[: len(good) // 3])
    out = _run(_CACHED, JAXKV_CACHE_DIR=str(tmp_path))
    assert "reason: None" in out, out
    assert "does not match its record" in out, out
    assert "rebuilding" in out, out
    assert "native ok" in out
    assert "default ok" in out
    assert lib.read_bytes() == good or len(lib.read_bytes()) > len(good) // 2
    # No record beside it (an older jaxkv's cache, a copied file): rebuilt.
    record.unlink()
    out = _run(_CACHED, JAXKV_CACHE_DIR=str(tmp_path))
    assert "has no size and hash record" in out, out
    assert "native ok" in out, out
    # A foreign library with a record that matches it: loaded, found to lack
    # the kernels, refused by name; the default path still serves.
    libm = next(
        p
        for p in (
            Path("/lib/x86_64-linux-gnu/libm.so.6"),
            Path("/usr/lib/x86_64-linux-gnu/libm.so.6"),
            Path("/lib/aarch64-linux-gnu/libm.so.6"),
        )
        if p.exists()
    )
    foreign = libm.read_bytes()
    lib.write_bytes(foreign)
    import hashlib

    record.write_text(f"{len(foreign)} {hashlib.sha256(foreign).hexdigest()}\n")
    out = _run(_CACHED, JAXKV_CACHE_DIR=str(tmp_path))
    assert "lacks the kernels' symbols" in out, out
    assert "native refused" in out, out
    assert "default ok" in out, out


def test_the_kernel_reads_nothing_past_the_table_or_pool_into_a_guard_page(tmp_path):
    # The same check without ASan (a 3-4 s build): the pool, table and bounds
    # each end at an inaccessible page, so the next page's prefetch read past
    # the table's last column (issue 56's mutation 6) faults here.
    run_asan_check(
        Path(__file__).with_name("native_decode_bounds_check.cc"),
        tmp_path,
        guard_pages=True,
    )


@pytest.mark.slow  # builds the kernels with AddressSanitizer (10-15 s)
def test_the_kernel_reads_no_byte_outside_the_pool_or_table_under_asan(tmp_path):
    # tests/native_decode_bounds_check.cc runs rows with page ids outside the
    # pool, key ranges past the table and from before 0 on buffers of exactly
    # their bytes; AddressSanitizer aborts on any read outside them.
    run_asan_check(Path(__file__).with_name("native_decode_bounds_check.cc"), tmp_path)
