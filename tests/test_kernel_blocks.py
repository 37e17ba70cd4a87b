import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.helpers import full_spec


def test_select_common_block_size_rules():
    fa = jaxkv.get_backend("FLASH_ATTN")
    fi = jaxkv.get_backend("FLASHINFER")
    only_32 = jaxkv.AttentionBackend(
        name="Only32",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(32, 8),
    )
    assert jaxkv.vllm.select_common_block_size(64, [fa]) == 64
    assert (
        jaxkv.vllm.select_common_block_size(80, [fa, fi]) == 16
    )  # 16 | 80, FA accepts 16
    # Candidates come from any backend's ints, largest first, accepted by all.
    assert jaxkv.vllm.select_common_block_size(128, [fi, only_32]) == 32
    assert jaxkv.vllm.select_common_block_size(80, [only_32]) == 8
    with pytest.raises(ValueError, match="No kernel block size divides block_size=80"):
        jaxkv.vllm.select_common_block_size(80, [only_32, fi])
    with pytest.raises(ValueError, match=r"FlashInferBackend: \[16, 32, 64\]"):
        jaxkv.vllm.select_common_block_size(24, [fi])


def test_select_ties_prefer_largest_candidate():
    a = jaxkv.AttentionBackend(
        name="A",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(16, 32, jaxkv.vllm.MultipleOf(8)),
    )
    b = jaxkv.AttentionBackend(
        name="B",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(16, 32),
    )
    assert jaxkv.vllm.select_common_block_size(96, [a, b]) == 32


@pytest.mark.parametrize("xp", [np, jnp])
def test_expand_block_table_worked_example(xp):
    table = xp.asarray([[2, 5]], dtype=xp.int32)
    np.testing.assert_array_equal(
        jaxkv.groups.expand_block_table(table, 32, 16), [[4, 5, 10, 11]]
    )
    np.testing.assert_array_equal(
        jaxkv.groups.expand_block_table(table, 32, 16, 3), [[6, 7, 15, 16]]
    )


def test_expand_is_jittable_and_identity_when_unsplit():
    table = jnp.array([[1, 2, 3], [0, 0, 7]], jnp.int32)
    out = jax.jit(jaxkv.groups.expand_block_table, static_argnums=(1, 2, 3))(
        table, 64, 16, 0
    )
    assert out.shape == (2, 12)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(jaxkv.groups.expand_block_table(table, 16, 16), table)


def test_slot_mapping_to_kernel():
    slots = np.array([0, 15, 16, 31, 33, -1], np.int32)
    np.testing.assert_array_equal(
        jaxkv.groups.map_slot_mapping_to_kernel(slots, 32, 16), slots
    )
    # Packed stride 3: manager block 1 starts at kernel block 3.
    np.testing.assert_array_equal(
        jaxkv.groups.map_slot_mapping_to_kernel(slots, 32, 16, 3),
        [0, 15, 16, 31, 49, -1],
    )


def test_slot_mapping_consistent_with_block_table():
    rng = np.random.default_rng(0)
    for b, k, s in [(32, 16, 0), (32, 8, 0), (64, 16, 5), (32, 16, 2)]:
        slots = rng.integers(0, 10 * b, 50).astype(np.int32)
        mapped = jaxkv.groups.map_slot_mapping_to_kernel(slots, b, k, s)
        table = jaxkv.groups.expand_block_table((slots // b)[:, None], b, k, s)
        # The kernel block of a mapped slot is the right column of the expanded row.
        np.testing.assert_array_equal(
            mapped // k, table[np.arange(50), (slots % b) // k]
        )
        np.testing.assert_array_equal(mapped % k, slots % k)


def test_bad_kernel_block_size():
    with pytest.raises(
        ValueError, match="block_size=32 is not a multiple of kernel_block_size=12"
    ):
        jaxkv.groups.expand_block_table(np.zeros((1, 1), np.int32), 32, 12)
    with pytest.raises(ValueError, match="block_size=32 is not a multiple of"):
        jaxkv.vllm.AttentionGroup(
            backend=jaxkv.get_backend("JAX_PAGED"),
            layer_names=("a",),
            kv_cache_spec=full_spec(block_size=32),
            kv_cache_group_id=0,
            kernel_block_size=12,
        )
    with pytest.raises(ValueError, match="does not accept kernel block size 8"):
        jaxkv.vllm.AttentionGroup(
            backend=jaxkv.get_backend("FLASH_ATTN"),
            layer_names=("a",),
            kv_cache_spec=full_spec(block_size=32),
            kv_cache_group_id=0,
            kernel_block_size=8,
        )
