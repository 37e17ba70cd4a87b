from typing import Any

import jax
import numpy as np
import pytest

import jaxkv
from tests.helpers import full_spec


def test_attention_page_size_worked_example():
    # spec §1.1: B=16, H=8, D=128, bf16 -> U = 65536.
    assert full_spec().real_page_size_bytes == 65536
    assert full_spec().page_size_bytes == 65536


def test_padded_page_and_head_size_v():
    spec = jaxkv.FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        head_size_v=32,
        dtype="float32",
        page_size_padded=20000,
    )
    assert spec.real_page_size_bytes == 16 * 2 * (64 + 32) * 4
    assert spec.page_size_bytes == 20000


def test_padded_page_smaller_than_unpadded_is_rejected():
    with pytest.raises(ValueError, match="page_size_padded=100 is smaller"):
        jaxkv.FullAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=8,
            dtype="float32",
            page_size_padded=100,
        )
    with pytest.raises(ValueError, match="MambaSpec.page_size_padded"):
        jaxkv.MambaSpec(
            block_size=16, shapes=((4,),), dtypes=("float32",), page_size_padded=8
        )


def test_mla_page_size():
    spec = jaxkv.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16"
    )
    assert spec.head_size_v == 0
    assert spec.page_size_bytes == 64 * 576 * 2
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        jaxkv.MLAAttentionSpec(
            block_size=64, num_kv_heads=2, head_size=8, dtype="float32"
        )


def test_mamba_worked_example():
    # spec §1.9: states (3, 2304) bf16 and (8, 64, 128) fp32, padded to 327680.
    spec = jaxkv.MambaSpec(
        block_size=80,
        shapes=((3, 2304), (8, 64, 128)),
        dtypes=("bfloat16", "float32"),
        page_size_padded=327680,
    )
    assert spec.state_bytes == (13824, 262144)
    assert spec.real_page_size_bytes == 275968
    assert spec.state_offsets == (0, 13824)
    assert spec.page_size_bytes == 327680


def test_mamba_rejects_misaligned_state_and_dtype_mismatch():
    with pytest.raises(ValueError, match="not a multiple of its itemsize"):
        jaxkv.MambaSpec(block_size=16, shapes=((3,), (2,)), dtypes=("uint8", "float32"))
    with pytest.raises(ValueError, match="one dtype per state"):
        jaxkv.MambaSpec(block_size=16, shapes=((3,), (2,)), dtypes=("float32",))


def test_is_draft_excluded_from_equality_and_hash():
    a, b = (
        full_spec(),
        jaxkv.FullAttentionSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype=np.dtype("bfloat16"),
            is_draft=True,
        ),
    )
    assert a == b
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert b.is_draft


def test_dtype_normalised():
    a = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=jax.numpy.bfloat16
    )
    b = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="bfloat16"
    )
    assert a == b
    assert hash(a) == hash(b)


def test_subtypes_differ():
    kw: dict[str, Any] = dict(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    assert jaxkv.CrossAttentionSpec(**kw) != jaxkv.FullAttentionSpec(**kw)
    assert jaxkv.SlidingWindowSpec(**kw, sliding_window=8) != jaxkv.SlidingWindowSpec(
        **kw, sliding_window=16
    )


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("block_size", 0, ValueError),
        ("num_kv_heads", -1, ValueError),
        ("head_size", 1.5, TypeError),
        ("block_size", True, TypeError),
    ],
)
def test_non_positive_sizes(field, value, error):
    kw: dict[str, Any] = dict(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    kw[field] = value
    with pytest.raises(error, match=field):
        jaxkv.FullAttentionSpec(**kw)


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        jaxkv.FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype="notadtype"
        )


def test_uniform_type_specs():
    a = full_spec(head=64)
    b = full_spec(head=128)
    u = jaxkv.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": a, "b": b})
    assert u.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    assert u.first_spec == a
    assert hash(u) == hash(
        jaxkv.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": a, "b": b})
    )
    with pytest.raises(ValueError, match="block_size 32"):
        jaxkv.UniformTypeKVCacheSpecs(
            block_size=16, kv_cache_specs={"a": full_spec(32)}
        )


@pytest.mark.parametrize(
    "spec",
    [
        full_spec(),
        jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)),
    ],
)
def test_specs_are_leafless_static_pytrees(spec):
    assert jax.tree.leaves(spec) == []
    leaves, treedef = jax.tree.flatten(spec)
    assert jax.tree.unflatten(treedef, leaves) == spec

    @jax.jit
    def f(s, x):
        return x * s.block_size

    assert int(f(spec, jax.numpy.int32(2))) == 32
