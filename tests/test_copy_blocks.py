"""copy_blocks: block ``src`` lands in block ``dst`` through every layer's view,
byte for byte, on every layout and storage, and nothing else changes.

Pools are filled with random nonzero bytes (NaN and denormal patterns among
them), so any byte moved through a float, any byte outside the destination
blocks and any byte no view addresses would show.
"""  # noqa: D205

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import AttentionBackend, KVCacheLayout
from jaxkv.kv._copy import _copy
from jaxkv.plan import MambaView

SRC = [3, 1, 6]
DST = [2, 7, 5]


def _kernel_backend(kernel_block_size: int) -> AttentionBackend:
    return AttentionBackend(
        name=f"JaxPagedK{kernel_block_size}Backend",
        layout=KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(kernel_block_size,),
    )


CASES = {
    # Attention, sliding window and Mamba layers sharing pools; YOCO layers.
    "hybrid-words": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(), num_blocks=8, storage="words"
    ),
    "hybrid-packed": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(), num_blocks=8, storage="words", packed=True
    ),
    # A manager block of 32 tokens is four kernel blocks of 8.
    "hybrid-kernel-blocks": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(attention_backend=_kernel_backend(8)),
        num_blocks=8,
        storage="words",
    ),
    "hybrid-packed-kernel-blocks": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(attention_backend=_kernel_backend(8)),
        num_blocks=8,
        storage="words",
        packed=True,
        maps_slot_mapping=True,
    ),
    **{
        f"{backend}-{storage}-{dtype}": (
            lambda backend=backend, storage=storage, dtype=dtype: jaxkv.make_plan(
                jaxkv.llama_like_config(
                    num_layers=3,
                    sliding_window=32,
                    window_every=3,
                    dtype=dtype,
                    attention_backend=backend,
                ),
                num_blocks=8,
                storage=storage,
            )
        )
        for backend in (
            "JAX_PAGED",
            "JAX_PAGED_FUSED",
            "JAX_PAGED_KV_FIRST",
            "FLASHINFER",
        )
        for storage, dtype in (
            ("words", "float32"),
            ("words", "bfloat16"),
            ("typed", "bfloat16"),
            ("stacked", "float32"),
        )
    },
}


def _random_pools(plan, seed=0):
    rng = np.random.default_rng(seed)
    pools = []
    for pool in plan.allocate():
        raw = rng.integers(1, 256, pool.nbytes, dtype=np.uint8)
        pools.append(jnp.asarray(raw.view(pool.dtype).reshape(pool.shape)))
    return tuple(pools)


def _bytes(pools):
    return [np.asarray(p).reshape(-1).view(np.uint8).copy() for p in pools]


def _leaf_views(plan):
    """(owning layer, its state or KV view, the kernel id map of its group)."""
    out = []
    for _, name, group in plan.owning_layers():
        view = plan.views[name]
        for v in view.states if isinstance(view, MambaView) else (view,):
            out.append((name, v, group))
    return out


def _ids(group, ids):
    if group is None or group.kernel_block_size is None:
        return np.asarray(ids)
    return np.asarray(
        group.map_to_kernel_block_table(np.asarray(ids)[:, None])
    ).reshape(-1)


def _logical_bits(pools, v):
    out = np.asarray(
        jaxkv.read_view(pools, v, layer=v.layer)
        if v.typed
        else jaxkv.read_view(pools, v)
    )
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[out.dtype.itemsize]
    return np.moveaxis(out.view(bits), v.block_dim, 0)


@pytest.mark.parametrize("case", list(CASES))
def test_a_copied_block_reads_back_through_every_view_and_nothing_else_changes(case):
    plan = CASES[case]()
    before_pools = _random_pools(plan)
    before = _bytes(before_pools)
    logical = {id(v): _logical_bits(before_pools, v) for _, v, _ in _leaf_views(plan)}
    # The bytes no view addresses: zeroing every block of every view leaves
    # them (and only them) as they were (the random bytes are never 0).
    zeroed = before_pools
    for _, v, _ in _leaf_views(plan):
        zeroed = jaxkv.zero_blocks(
            tuple(jnp.array(p) for p in zeroed), (v,), jnp.arange(v.num_blocks)
        )
    unaddressed = [z != 0 for z in _bytes(zeroed)]
    assert any(u.size and not u.all() for u in unaddressed)

    after_pools = jaxkv.copy_blocks(
        tuple(jnp.array(p) for p in before_pools), plan, src=SRC, dst=DST
    )
    after = _bytes(after_pools)
    for i, (a, b, u) in enumerate(zip(after, before, unaddressed, strict=True)):
        np.testing.assert_array_equal(a[u], b[u], err_msg=f"{case}: pool {i} padding")
    for name, v, group in _leaf_views(plan):
        want = logical[id(v)].copy()
        src, dst = _ids(group, SRC), _ids(group, DST)
        want[dst] = want[src]
        # A packed pool's kernel view also spans other layers' pages (ids it
        # does not own); those are checked through their own layers' views.
        own = v.owns(np.arange(v.num_blocks))
        np.testing.assert_array_equal(
            _logical_bits(after_pools, v)[own], want[own], err_msg=f"{case}: {name}"
        )


def test_every_layer_of_every_group_is_copied():
    """The hybrid model: attention, sliding-window and Mamba layers each
    (YOCO layers read their targets' views)."""
    plan = CASES["hybrid-words"]()
    names = {name for name, _, _ in _leaf_views(plan)}
    assert names == {
        f"layers.{i}.{'mixer' if i in (2, 5) else 'self_attn'}" for i in range(6)
    }


def test_the_copy_is_in_place_and_moves_no_pool_sized_buffer():
    """64 blocks: what the copy holds at once scales with the blocks it
    copies, not with the pools."""
    plan = jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(attention_backend=_kernel_backend(8)),
        num_blocks=64,
        storage="words",
        packed=True,
        maps_slot_mapping=True,
    )
    pools = plan.allocate()
    views, srcs, dsts = [], [], []
    for _, name, group in plan.owning_layers():
        views.append(plan.views[name])
        srcs.append(jnp.asarray(_ids(group, SRC), jnp.int32))
        dsts.append(jnp.asarray(_ids(group, DST), jnp.int32))
    compiled = _copy.lower(pools, tuple(views), tuple(srcs), tuple(dsts)).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    text = compiled.as_text()
    assert text is not None
    pool_bytes = sum(p.nbytes for p in pools)
    assert analysis.alias_size_in_bytes >= pool_bytes, analysis
    per_block = pool_bytes // plan.num_blocks
    assert analysis.temp_size_in_bytes <= 2 * len(SRC) * per_block, analysis
    assert analysis.temp_size_in_bytes <= 0.05 * pool_bytes, analysis
    shapes = {f"[{p.shape[0]}]" for p in pools} | {str(list(p.shape)) for p in pools}
    for line in text.splitlines():
        if " copy(" in line or "transpose(" in line:
            assert not any(
                s.replace(" ", "") in line.replace(" ", "") for s in shapes
            ), line
    out = jaxkv.copy_blocks(pools, plan, src=SRC, dst=DST)
    assert all(p.is_deleted() for p in pools)
    assert len(out) == len(pools)


@pytest.mark.parametrize(
    ("src", "dst", "error", "match"),
    [
        ([1, 2], [3], ValueError, "src has 2 blocks and dst 1"),
        ([0], [3], ValueError, r"src\[0\] = 0 is not a block .*null block"),
        ([1], [8], ValueError, r"dst\[0\] = 8 is not a block .*num_blocks=8"),
        ([1], [-1], ValueError, r"dst\[0\] = -1"),
        ([1, 2], [3, 3], ValueError, "dst repeats block 3"),
        ([1, 2], [2, 3], ValueError, r"dst\[0\] = 2 is also a source"),
        ([[1]], [[2]], ValueError, "must be 1-D"),
        ([1.0], [2], TypeError, "integer ids"),
        ([2**32 + 1], [2], ValueError, r"src\[0\] = 4294967297"),
    ],
)
def test_bad_pairs_are_refused_before_anything_changes(src, dst, error, match):
    plan = CASES["hybrid-words"]()
    pools = _random_pools(plan)
    before = _bytes(pools)
    with pytest.raises(error, match=match):
        jaxkv.copy_blocks(pools, plan, src=src, dst=dst)
    assert not any(p.is_deleted() for p in pools)
    for a, b in zip(_bytes(pools), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_donated_pools_are_refused_by_name():
    plan = CASES["hybrid-words"]()
    pools = plan.allocate()
    jaxkv.copy_blocks(pools, plan, src=[1], dst=[2])
    with pytest.raises(ValueError, match="copy_blocks"):
        jaxkv.copy_blocks(pools, plan, src=[1], dst=[2])
