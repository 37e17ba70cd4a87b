import jax
import pytest

import jaxkv


def test_block_dims_and_shapes():
    fa = jaxkv.get_backend("FLASH_ATTN")
    rocm = jaxkv.get_backend("ROCM_ATTN")
    mla = jaxkv.get_backend("FLASHMLA")
    assert fa.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)
    assert rocm.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert mla.get_kv_cache_shape(10, 64, 1, 576) == (10, 64, 576)
    assert fa.get_kv_cache_block_dim(16, 8, 128) == 0
    assert rocm.get_kv_cache_block_dim(16, 8, 128) == 1
    assert mla.get_kv_cache_block_dim(64, 1, 576) == 0
    assert jaxkv.get_backend("FLASHINFER").get_kv_cache_stride_order() == (
        0,
        1,
        3,
        2,
        4,
    )
    assert fa.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)


def test_fused_layout_allows_different_value_head():
    b = jaxkv.AttentionBackend(
        name="Fused", layout=jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED
    )
    assert b.get_kv_cache_shape(4, 16, 2, 64, head_size_v=32) == (4, 16, 2, 96)
    with pytest.raises(ValueError, match="head_size_v == head_size"):
        jaxkv.get_backend("FLASH_ATTN").get_kv_cache_shape(4, 16, 2, 64, head_size_v=32)


def test_supported_block_sizes():
    fi = jaxkv.get_backend("FLASHINFER")
    assert fi.supports_block_size(32)
    assert not fi.supports_block_size(48)
    assert jaxkv.get_backend("FLASH_ATTN").supports_block_size(48)
    assert not jaxkv.get_backend("FLASH_ATTN").supports_block_size(8)


def test_backend_is_static_pytree_and_dict_key():
    fa = jaxkv.get_backend("FLASH_ATTN")
    assert jax.tree.leaves(fa) == []
    assert {fa: 1}[jaxkv.get_backend("FLASH_ATTN")] == 1

    @jax.jit
    def f(backend, x):
        return x + backend.get_kv_cache_block_dim(16, 1, 8)

    assert int(f(jaxkv.get_backend("ROCM_ATTN"), jax.numpy.int32(1))) == 2


def test_fast_prefill_wrapper_is_distinct_with_same_flags():
    fa = jaxkv.get_backend("FLASH_ATTN")
    w = jaxkv.vllm.create_fast_prefill_custom_backend("FastPrefill", fa)
    assert w != fa
    assert hash(w) != hash(fa)
    assert w.class_name == "FastPrefillFlashAttentionBackend"
    assert w.supported_kernel_block_sizes == fa.supported_kernel_block_sizes
    assert w.cudagraph_support == fa.cudagraph_support
    # Wrapping twice is a no-op.
    assert jaxkv.vllm.create_fast_prefill_custom_backend("FastPrefill", w) == w


def test_query_lens_mismatch_default_is_not_ssm():
    assert jaxkv.get_backend("FLASH_ATTN").supports_device_cpu_query_lens_mismatch()
    assert not jaxkv.get_backend("MAMBA2").supports_device_cpu_query_lens_mismatch()
    b = jaxkv.AttentionBackend(
        name="X", layout=jaxkv.KVCacheLayout.MAMBA, supports_query_lens_mismatch=True
    )
    assert b.supports_device_cpu_query_lens_mismatch()


def test_registry():
    assert "FLASH_ATTN" in jaxkv.registered_backends()
    with pytest.raises(KeyError, match="Unknown backend 'NOPE'"):
        jaxkv.get_backend("NOPE")
    with pytest.raises(ValueError, match="already registered"):
        jaxkv.register_backend("FLASH_ATTN", jaxkv.get_backend("ROCM_ATTN"))


def test_bad_backends():
    with pytest.raises(ValueError, match="not a permutation"):
        jaxkv.AttentionBackend(
            name="B", layout=jaxkv.KVCacheLayout.BLOCKS_FIRST, stride_order=(0, 1, 2)
        )
    with pytest.raises(ValueError, match="moves the first two"):
        jaxkv.AttentionBackend(
            name="B",
            layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
            stride_order=(1, 0, 2, 3, 4),
        )
    with pytest.raises(ValueError, match="must not be empty"):
        jaxkv.AttentionBackend(
            name="B",
            layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
            supported_kernel_block_sizes=(),
        )
    with pytest.raises(TypeError, match="KVCacheLayout"):
        jaxkv.AttentionBackend(name="B", layout="blocks_first")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="base must be positive"):
        jaxkv.vllm.MultipleOf(0)
