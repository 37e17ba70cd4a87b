"""Real kernels on jaxkv's typed pools, in place: EasyDeL's ragged paged
attention v3 (ejkernel 0.0.80.3, its XLA path: it writes the new K/V into the
cache itself) and JAX's TPU reference ragged paged attention (pure JAX, read
only). The cache array is a reshape of the pool; nothing is converted."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ejkernel.kernels._xla.ragged_page_attention_v3 import ragged_page_attention_v3
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ref_ragged_paged_attention,
)

import jaxkv

H, D, QH, B, N = 2, 128, 4, 16, 32
NAME = "layers.0.self_attn"
# Two requests: a 20-token prefill, and a decode whose 9 earlier tokens are
# already cached (pages 1-2 for the first, page 3 for the second).
PAGES = np.array([[1, 2, 0, 0], [3, 0, 0, 0]], np.int32)
KV_LENS = np.array([20, 10], np.int32)
QSL = np.array([0, 20, 21], np.int32)


def _plan(dtype, storage="typed", backend="RPA_V3"):
    cfg = jaxkv.llama_like_config(
        num_layers=1,
        num_kv_heads=H,
        head_size=D,
        num_heads=QH,
        block_size=B,
        dtype=dtype,
        attention_backend=backend,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=N, storage=storage, pool_dtype="element")
    view = plan.views[NAME]
    assert isinstance(view, jaxkv.KVCacheView)
    return plan, view


def _inputs(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(21, n, D)), dtype) for n in (QH, H, H))
    old_k, old_v = (jnp.asarray(rng.normal(size=(9, H, D)), dtype) for _ in "kv")
    return q, k, v, old_k, old_v


def _slots():
    new = [1 * B + t for t in range(16)] + [2 * B + t for t in range(4)] + [3 * B + 9]
    return np.array(new, np.int32), np.arange(3 * B, 3 * B + 9, dtype=np.int32)


def _reference(q, k, v, old_k, old_v):
    """Dense causal attention per request (NumPy, float64)."""
    q, k, v, old_k, old_v = (np.asarray(x, np.float64) for x in (q, k, v, old_k, old_v))
    out = np.zeros((21, QH, D))
    for rows, keys, values in (
        (range(20), k[:20], v[:20]),
        (
            range(20, 21),
            np.concatenate([old_k, k[20:]]),
            np.concatenate([old_v, v[20:]]),
        ),
    ):
        rows = list(rows)
        n = len(keys)
        qq = q[rows]
        kk, vv = np.repeat(keys, QH // H, axis=1), np.repeat(values, QH // H, axis=1)
        s = np.einsum("qhd,khd->hqk", qq, kk) * D**-0.5
        qpos = np.arange(n - len(rows), n)[:, None]
        s = np.where(np.arange(n)[None] <= qpos, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[rows] = np.einsum("hqk,khd->qhd", p, vv)
    return out


def _pool_sized_ops(hlo, elements):
    found = []
    for line in hlo.splitlines():
        m = re.search(
            r"= \w+\[([\d,]*)\]\S* (copy|convert|transpose|bitcast-convert)\(", line
        )
        if m and np.prod([int(x) for x in m.group(1).split(",") if x]) >= elements:
            found.append(m.group(2))
    return found


@pytest.mark.skipif(
    jax.config.read("jax_enable_x64"),
    reason="ejkernel 0.0.80.3's XLA path itself fails with x64 on (its "
    "dynamic_slice mixes int32 and int64 indices)",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ejkernel_rpa_v3_writes_and_reads_a_typed_pool_in_place(dtype):
    plan, view = _plan(dtype)
    pack = 4 // jnp.dtype(dtype).itemsize
    shape = (N, B, 2 * H // pack, pack, D)
    assert plan.pools[0].shape == shape  # the pool is the kernel's cache array
    q, k, v, old_k, old_v = _inputs(dtype)
    new_slots, old_slots = _slots()
    pools = jaxkv.write_kv(plan.allocate(), view, old_k, old_v, old_slots)
    args = (
        q,
        k,
        v,
        jnp.asarray(KV_LENS),
        jnp.asarray(PAGES.reshape(-1)),
        jnp.asarray(QSL),
        jnp.asarray([0, 0, 2], jnp.int32),
    )
    kernel = functools.partial(ragged_page_attention_v3, softmax_scale=D**-0.5)

    @functools.partial(jax.jit, donate_argnums=0)
    def through_jaxkv(pools, q, k, v, *meta):
        cache = jaxkv.kernel_cache(pools, view, shape=shape)
        out, cache = kernel(q, k, v, cache, *meta)
        return jaxkv.put_kernel_cache(pools, view, cache), out

    @functools.partial(jax.jit, donate_argnums=0)
    def own_cache(cache, q, k, v, *meta):
        out, cache = kernel(q, k, v, cache, *meta)
        return cache, out

    own = jnp.array(jaxkv.kernel_cache(pools, view, shape=shape))  # a copy
    elements = N * B * 2 * H * D
    ours_hlo = through_jaxkv.lower(pools, *args).compile().as_text()
    own_hlo = own_cache.lower(own, *args).compile().as_text()
    ours, theirs = (
        _pool_sized_ops(ours_hlo, elements),
        _pool_sized_ops(own_hlo, elements),
    )
    assert len(ours) <= len(theirs), (ours, theirs)
    if dtype == "float32":
        assert ours == []
        assert theirs == []
    pools, out = through_jaxkv(pools, *args)
    own, own_out = own_cache(own, *args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(own_out))
    np.testing.assert_array_equal(
        np.asarray(jaxkv.kernel_cache(pools, view, shape=shape)), np.asarray(own)
    )
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float64),
        _reference(q, k, v, old_k, old_v),
        atol=tol,
        rtol=tol,
    )
    # The kernel's writes are jaxkv's writes: the same bytes write_kv gives.
    want = jaxkv.write_kv(
        jaxkv.write_kv(plan.allocate(), view, old_k, old_v, old_slots),
        view,
        k,
        v,
        new_slots,
    )
    np.testing.assert_array_equal(np.asarray(pools[0]), np.asarray(want[0]))


def test_jax_tpu_reference_reads_a_typed_pool_with_no_copy():
    plan, view = _plan("float32", storage="stacked", backend="JAX_PAGED_FUSED")
    q, k, v, old_k, old_v = _inputs("float32")
    new_slots, old_slots = _slots()
    pools = jaxkv.write_kv(plan.allocate(), view, old_k, old_v, old_slots)
    pools = jaxkv.write_kv(pools, view, k, v, new_slots)
    host: list = [KV_LENS, PAGES, QSL, np.array([2], np.int32)]

    @jax.jit
    def attend(pools, q):
        # The reference slices queries by cu_q_lens in Python: host constants.
        kv_pages = jaxkv.kernel_cache(pools, view, shape=(N, B, 2 * H, D))
        return ref_ragged_paged_attention(q, kv_pages, *host, sm_scale=D**-0.5)

    args = (pools, q)
    hlo = attend.lower(*args).compile().as_text()
    assert _pool_sized_ops(hlo, N * B * 2 * H * D) == []
    np.testing.assert_allclose(
        np.asarray(attend(*args), np.float64),
        _reference(q, k, v, old_k, old_v),
        atol=1e-5,
        rtol=1e-5,
    )
