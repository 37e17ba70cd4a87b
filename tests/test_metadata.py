import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from tests.helpers import examples, full_spec

i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731


def test_metadata_pytree_structure():
    m = jaxkv.CommonAttentionMetadata.empty(max_reqs=4, max_tokens=8, max_blocks=2)
    m = dataclasses.replace(m, query_start_loc_cpu=np.zeros(5, np.int32))
    leaves, treedef = jax.tree.flatten(m)
    assert len(leaves) == 18  # request_causal included
    assert all(isinstance(x, jax.Array) for x in leaves)
    back = jax.tree.unflatten(treedef, leaves)
    assert back.causal is True
    assert back.query_start_loc_cpu is None  # host copy stays outside the leaves

    @jax.jit
    def f(meta):
        assert meta.query_start_loc_cpu is None
        return meta.num_reqs + 1

    assert int(f(m)) == 1
    other = dataclasses.replace(m, causal=False)
    assert jax.tree.structure(other) != jax.tree.structure(m)


def _groups_2_16():
    """spec §2.16: groups [G0a, G0b], [], [M2], [M3]; M2, M3 Mamba, same spec."""
    attn = full_spec(block_size=16, heads=1, head=8, dtype="float32")
    mamba = jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
    fa, tri, m2 = (
        jaxkv.get_backend(k) for k in ("FLASH_ATTN", "TRITON_ATTN", "MAMBA2")
    )
    g0a = jaxkv.vllm.AttentionGroup(
        backend=fa, layer_names=("a",), kv_cache_spec=attn, kv_cache_group_id=0
    )
    g0b = jaxkv.vllm.AttentionGroup(
        backend=tri, layer_names=("b",), kv_cache_spec=attn, kv_cache_group_id=0
    )
    gm2 = jaxkv.vllm.AttentionGroup(
        backend=m2, layer_names=("m2",), kv_cache_spec=mamba, kv_cache_group_id=2
    )
    gm3 = jaxkv.vllm.AttentionGroup(
        backend=m2, layer_names=("m3",), kv_cache_spec=mamba, kv_cache_group_id=3
    )
    groups = [[g0a, g0b], [], [gm2], [gm3]]
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=n, kv_cache_spec=s)
            for n, s in (
                (["a", "b"], attn),
                (["x"], attn),
                (["m2"], mamba),
                (["m3"], mamba),
            )
        ],
    )
    return groups, kv


def _build(groups, kv, **kw):
    tables = [i32([[g + 1, 0], [g + 5, g + 6]]) for g in range(4)]
    slots = [i32([16 * (g + 1) + t for t in range(5)] + [-1, -1, -1]) for g in range(4)]
    return (
        jaxkv.vllm.build_attn_metadata(
            groups,
            i32(2),
            i32(5),
            i32([0, 4, 5]),
            np.array([0, 4, 5]),
            i32(4),
            i32([4, 20]),
            i32(20),
            tables,
            slots,
            kv,
            **kw,
        ),
        tables,
        slots,
    )


def test_build_attn_metadata_worked_example():
    groups, kv = _groups_2_16()
    meta, tables, slots = _build(groups, kv, causal={0: False})
    assert set(meta) == {"a", "b", "m2", "m3"}
    assert meta["a"].causal is False
    assert meta["b"].causal is False
    assert meta["a"] is not meta["b"]  # one record per attention group
    assert meta["m2"].causal is True
    np.testing.assert_array_equal(meta["m3"].block_table_tensor, tables[3])
    np.testing.assert_array_equal(meta["m3"].slot_mapping, slots[3])
    # M3 is M2's record with group 3's table, slots and id (no fresh build).
    assert (meta["m2"].group, meta["m3"].group) == (2, 3)
    for field in dataclasses.fields(jaxkv.CommonAttentionMetadata):
        if field.name in ("block_table_tensor", "slot_mapping", "group"):
            continue
        assert getattr(meta["m3"], field.name) is getattr(meta["m2"], field.name)
    assert meta["m3"].seq_lens is meta["m2"].seq_lens
    # Padding tokens belong to no real request (index num_reqs).
    assert meta["a"].token_to_req.tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    np.testing.assert_array_equal(meta["a"].query_start_loc_cpu, [0, 4, 5])


def test_kernel_block_table_of_split_group():
    groups, kv = _groups_2_16()
    spec = full_spec(block_size=32, heads=1, head=8, dtype="float32")
    split = jaxkv.vllm.AttentionGroup(
        backend=jaxkv.get_backend("JAX_PAGED"),
        layer_names=("a",),
        kv_cache_spec=spec,
        kv_cache_group_id=0,
        kernel_block_size=16,
    )
    meta, _, _ = _build([[split]], kv)
    assert meta["a"].block_table_tensor.tolist() == [[2, 3, 0, 1], [10, 11, 12, 13]]


def test_fast_prefill_fields_attached_and_wrapped_group_reduced():
    groups, kv = _groups_2_16()
    wrapped = dataclasses.replace(
        groups[0][1],
        backend=jaxkv.vllm.create_fast_prefill_custom_backend(
            "FastPrefill", groups[0][1].backend
        ),
        fast_prefill=True,
    )
    fp = jaxkv.vllm.FastPrefillBatchMetadata(
        logits_indices_padded=i32([3, 4, 4, 4]),
        num_logits_indices=i32(2),
        max_logits_per_req=i32(1),
    )
    meta, _, _ = _build(
        [[groups[0][0], wrapped], [], groups[2], groups[3]], kv, fast_prefill=fp
    )
    assert all(m.fast_prefill for m in meta.values())
    assert meta["a"].query_start_loc.tolist() == [0, 4, 5]
    assert meta["b"].query_start_loc.tolist() == [0, 1, 2]
    assert int(meta["b"].num_actual_tokens) == 2
    assert int(meta["b"].max_query_len) == 1


def test_reduction_worked_example_and_decode_passthrough():
    m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=28, max_blocks=1)
    m = dataclasses.replace(
        m,
        query_start_loc=i32([0, 15, 20, 28]),
        seq_lens=i32([41, 31, 40]),
        num_reqs=i32(3),
        num_actual_tokens=i32(28),
        max_query_len=i32(15),
        logits_indices_padded=i32([14, 18, 19, 27, 27, 27, 27, 27]),
        num_logits_indices=i32(4),
        max_logits_per_req=i32(2),
        fast_prefill=True,
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(m)
    assert r.query_start_loc.tolist() == [0, 1, 3, 4]
    assert int(r.num_actual_tokens) == 4
    assert int(r.max_query_len) == 2
    assert r.seq_lens.tolist() == [41, 31, 40]
    assert r.causal is True
    decode = dataclasses.replace(
        m,
        query_start_loc=i32([0, 1, 2, 3]),
        max_query_len=i32(1),
        num_actual_tokens=i32(3),
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(decode)
    assert r.query_start_loc.tolist() == [0, 1, 2, 3]
    assert int(r.num_actual_tokens) == 3
    unarmed = dataclasses.replace(m, fast_prefill=False)
    assert (
        jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(unarmed) is unarmed
    )


def _reduce_reference(qsl, idx):
    """Loop reference sharing no code with the kernel."""
    counts = []
    for lo, hi in zip(qsl[:-1], qsl[1:], strict=True):
        counts.append(sum(1 for i in idx if lo <= i < hi))
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out, max(counts, default=0)


@st.composite
def ragged_batches(draw, max_reqs=8):
    q_lens = draw(st.lists(st.integers(0, 12), min_size=1, max_size=max_reqs))
    assume_tokens = sum(q_lens)
    if assume_tokens < 2:
        q_lens = [*q_lens[:-1], 2]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    # Logits positions: the trailing tokens of each request (1..q_len of them).
    idx = []
    for lo, hi in zip(qsl[:-1], qsl[1:], strict=True):
        if hi > lo:
            k = draw(st.integers(0, min(3, hi - lo)))
            idx.extend(range(hi - k, hi))
    if not idx:
        idx = [int(qsl[-1]) - 1]
    padded_reqs = max_reqs
    qsl_padded = np.pad(qsl, (0, padded_reqs + 1 - qsl.size), mode="edge")
    return qsl_padded, qsl, np.array(idx, np.int32)


@settings(max_examples=examples(150), deadline=None)
@given(batch=ragged_batches(), pad=st.integers(0, 5))
def test_reduction_matches_loop_reference(batch, pad):
    qsl_padded, qsl, idx = batch
    n = idx.size
    padded = np.concatenate([idx, np.full(pad, -1, np.int32)])  # sentinel padding
    max_per_req = _reduce_reference(qsl, idx)[1]
    m = jaxkv.CommonAttentionMetadata.empty(max_reqs=8, max_tokens=128, max_blocks=1)
    m = dataclasses.replace(
        m,
        query_start_loc=i32(qsl_padded),
        num_reqs=i32(qsl.size - 1),
        num_actual_tokens=i32(qsl[-1]),
        max_query_len=i32(np.diff(qsl).max()),
        logits_indices_padded=i32(padded),
        num_logits_indices=i32(n),
        max_logits_per_req=i32(max_per_req),
        fast_prefill=True,
    )
    r = jaxkv.vllm.make_kv_sharing_fast_prefill_common_attn_metadata(m)
    want, _ = _reduce_reference(qsl_padded, idx)
    if int(np.diff(qsl).max()) == 1:
        want = qsl_padded.tolist()
    np.testing.assert_array_equal(r.query_start_loc, want)
    got = np.asarray(r.query_start_loc)
    assert got[0] == 0
    assert (np.diff(got) >= 0).all()  # I8
    assert (np.diff(got) <= max(max_per_req, 1)).all()


def test_pack_unpack_round_trip_and_padding():
    layout = jaxkv.step.StepCapacity(
        max_reqs=4, max_tokens=8, block_table_widths=(3, 2), max_mm_ranges=1
    )
    packed = jaxkv.step.pack_step(
        layout,
        query_start_loc=np.array([0, 3, 4]),
        seq_lens=np.array([3, 9]),
        positions=np.array([0, 1, 2, 8]),
        block_tables=[np.array([[1], [2]]), np.array([[3, 4], [5, 6]])],
        slot_mappings=[np.array([16, 17, 18, 40]), np.array([1, 2, 3, 4])],
        mm_prefix_ranges={1: [(0, 5)]},
    )
    assert packed.dtype == np.int32
    assert packed.size == layout.size
    f = jaxkv.step.unpack_step(jnp.asarray(packed), layout)
    scalars = [f.num_reqs, f.num_tokens, f.max_query_len, f.max_seq_len]
    assert [int(s) for s in scalars] == [2, 4, 3, 9]
    assert f.query_start_loc.tolist() == [0, 3, 4, 4, 4]
    assert f.seq_lens.tolist() == [3, 9, 0, 0]
    assert f.is_prefilling.tolist() == [True, False, False, False]
    assert f.token_to_req.tolist()[:4] == [0, 0, 0, 1]
    assert f.block_tables[0].tolist() == [[1, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert f.slot_mappings[1].tolist() == [1, 2, 3, 4, -1, -1, -1, -1]
    assert f.mm_prefix_ranges[1].tolist() == [[0, 5]]
    assert f.mm_num_ranges.tolist() == [0, 1, 0, 0]
    assert f.request_causal.tolist() == [True] * 4
    assert f.token_ids is None
    assert f.sample_idx is None
    with pytest.raises(ValueError, match="does not fit the step's capacity"):
        jaxkv.step.pack_step(
            layout,
            query_start_loc=np.array([0, 9]),
            seq_lens=np.array([9]),
            positions=np.arange(9),
            block_tables=[np.zeros((1, 1))] * 2,
            slot_mappings=[np.arange(9)] * 2,
        )
    with pytest.raises(ValueError, match="one per KV-cache group"):
        jaxkv.step.pack_step(
            layout,
            query_start_loc=np.array([0, 1]),
            seq_lens=np.array([1]),
            positions=np.arange(1),
            block_tables=[np.zeros((1, 1))],
            slot_mappings=[np.arange(1)],
        )


def test_mamba_state_blocks_come_from_the_group_not_the_caller():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
    mamba = next(
        n for n, v in plan.views.items() if not isinstance(v, jaxkv.KVCacheView)
    )
    bs = plan.block_sizes[2]
    meta = jaxkv.vllm.build_attn_metadata(
        plan.attn_groups,
        1,
        1,
        np.array([0, 1]),
        None,
        1,
        np.array([bs + 1]),
        bs + 1,
        [np.array([[1, 2]], np.int32)] * 3,
        [np.array([bs + 1], np.int32)] * 2 + [np.array([-1], np.int32)],
        plan.kv_cache_config,
    )[mamba]
    assert meta.block_size == bs
    src, dst = meta.mamba_state_blocks()
    assert (src.tolist()[0], dst.tolist()[0]) == (1, 2)  # state after bs, bs + 1
    with pytest.raises(ValueError, match=f"block_size={2 * bs} contradicts"):
        meta.mamba_state_blocks(2 * bs)
    bare = jaxkv.CommonAttentionMetadata.empty(max_reqs=1, max_tokens=1, max_blocks=1)
    with pytest.raises(ValueError, match="pass block_size"):
        bare.mamba_state_blocks()


@settings(max_examples=examples(15), deadline=None)
@given(q_lens=st.lists(st.integers(0, 6), min_size=1, max_size=5))
def test_request_token_rows_list_each_request_s_tokens(q_lens):
    max_reqs = 6
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    padded = np.pad(qsl, (0, max_reqs + 1 - qsl.size), mode="edge")
    m = dataclasses.replace(
        jaxkv.CommonAttentionMetadata.empty(
            max_reqs=max_reqs, max_tokens=32, max_blocks=1
        ),
        num_reqs=jnp.int32(len(q_lens)),
        query_start_loc=jnp.asarray(padded),
    )
    rows = np.asarray(jaxkv.request_token_rows(m, 6))
    for r in range(max_reqs):
        want = list(range(qsl[r], qsl[r + 1])) if r < len(q_lens) else []
        assert rows[r].tolist() == want + [-1] * (6 - len(want))


def test_vllm_signature_and_packed_step_give_the_same_records():
    # build_attn_metadata (vLLM's positional arguments) and the packed path
    # (pack_step in NumPy, unpack_step, build_attn_metadata_from_step) must
    # agree on every field of every record when every optional field is given.
    cfg = jaxkv.tiny_hybrid_config(kv_sharing_fast_prefill=False)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    groups, _, _ = jaxkv.vllm.init_attn_backend(kv, cfg)
    n = len(groups)
    layout = jaxkv.step.StepCapacity(
        max_reqs=4, max_tokens=8, block_table_widths=(2,) * n, max_mm_ranges=1
    )
    qsl, seq = np.array([0, 4, 5]), np.array([6, 9])
    positions = np.array([2, 3, 4, 5, 8])
    tables = [np.array([[1, 2], [3, 4]]) + g for g in range(n)]
    slots = [np.array([34, 35, 36, 37, 104]) + g for g in range(n)]
    encoder = np.array([3, 1])
    causal = np.array([True, False])
    packed = jaxkv.step.pack_step(
        layout,
        query_start_loc=qsl,
        seq_lens=seq,
        positions=positions,
        block_tables=tables,
        slot_mappings=slots,
        encoder_seq_lens=encoder,
        mm_prefix_ranges={0: [(2, 4)]},
        request_causal=causal,
    )
    fields = jaxkv.step.unpack_step(jnp.asarray(packed), layout)
    want = jaxkv.step.build_attn_metadata_from_step(groups, fields, kv)
    pad = lambda a, n, fill=0: np.concatenate([a, np.full(n - a.size, fill)])  # noqa: E731
    ranges = np.zeros((4, 1, 2), np.int32)
    ranges[0, 0] = (2, 4)
    got = jaxkv.vllm.build_attn_metadata(
        groups,
        2,
        5,
        pad(qsl, 5, 5),
        qsl,
        4,
        pad(seq, 4),
        9,
        [np.pad(t, ((0, 2), (0, 0))) for t in tables],
        [pad(s, 8, -1) for s in slots],
        kv,
        positions=pad(positions, 8),
        is_prefilling=np.array([1, 0, 0, 0]),
        encoder_seq_lens=pad(encoder, 4),
        mm_prefix_ranges=ranges,
        mm_num_ranges=np.array([1, 0, 0, 0]),
        request_causal=causal,
    )
    assert set(got) == set(want)
    for name in want:
        for f in dataclasses.fields(jaxkv.CommonAttentionMetadata):
            if f.name == "query_start_loc_cpu":
                continue
            a, b = getattr(got[name], f.name), getattr(want[name], f.name)
            if isinstance(b, jax.Array):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}.{f.name}")
            else:
                assert a == b, (name, f.name)
    assert want["layers.0.self_attn"].positions.tolist()[:5] == positions.tolist()
    assert want["layers.0.self_attn"].request_causal.tolist() == [1, 0, 1, 1]


def test_packed_multimodal_ranges_keep_every_range_of_a_request():
    layout = jaxkv.step.StepCapacity(
        max_reqs=3, max_tokens=8, block_table_widths=(1,), max_mm_ranges=3
    )
    packed = jaxkv.step.pack_step(
        layout,
        query_start_loc=np.array([0, 6, 8]),
        seq_lens=np.array([6, 2]),
        positions=np.array([0, 1, 2, 3, 4, 5, 0, 1]),
        block_tables=[np.array([[1], [2]])],
        slot_mappings=[np.arange(8)],
        mm_prefix_ranges={0: [(0, 1), (3, 5)], 1: [(0, 1)]},
    )
    f = jaxkv.step.unpack_step(jnp.asarray(packed), layout)
    assert f.mm_num_ranges.tolist() == [2, 1, 0]
    assert f.mm_prefix_ranges[0, :2].tolist() == [[0, 1], [3, 5]]
    assert f.mm_prefix_ranges[1, :1].tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="Request 0 has 4 multimodal ranges"):
        jaxkv.step.pack_step(
            layout,
            query_start_loc=np.array([0, 6]),
            seq_lens=np.array([6]),
            positions=np.arange(6),
            block_tables=[np.array([[1]])],
            slot_mappings=[np.arange(6)],
            mm_prefix_ranges={0: [(0, 0), (1, 1), (2, 2), (3, 3)]},
        )
