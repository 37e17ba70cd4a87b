"""A request's KV cache exported from one plan and imported into another:
every pair of layouts (blocks-first, fused, K/V-first), block sizes and
storages (carrier words, typed, layer-stacked), checked byte by byte against
an oracle that reads the target pool's bytes from its views' strides alone.
"""  # noqa: D205

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
import jaxkv.demo
from tests.mesh_cases import transfer_engine

N = 70  # tokens: crosses blocks of 16, 32 and 64, and the window of 48
# (and 64: the Mamba state then ends exactly on a block boundary)


def _hybrid(backend, block_size):
    cfg = jaxkv.tiny_hybrid_config(
        attention_backend=backend, block_size=block_size, sliding_window=48
    )
    return jaxkv.make_plan(cfg, num_blocks=16)


def _llama(backend, block_size, storage, packed=False):
    cfg = jaxkv.llama_like_config(
        num_layers=4,
        attention_backend=backend,
        block_size=block_size,
        sliding_window=48,
        window_every=2,
    )
    # A packed pool's kernel views are strided: the caller maps its slots.
    return jaxkv.make_plan(
        cfg, num_blocks=24, storage=storage, packed=packed, maps_slot_mapping=packed
    )


HYBRID = {
    "blocks-first/16": ("JAX_PAGED", 16),
    "fused/32": ("JAX_PAGED_FUSED", 32),
    "kv-first/64": ("JAX_PAGED_KV_FIRST", 64),
}
LLAMA = {
    "fused/16/typed": ("JAX_PAGED_FUSED", 16, "typed"),
    "blocks-first/32/stacked": ("JAX_PAGED", 32, "stacked"),
    "kv-first/16/words": ("JAX_PAGED_KV_FIRST", 16, "words"),
    "flashinfer/128 in kernel blocks of 64": ("FLASHINFER", 128, "words"),
    "flashinfer/128 packed, strided kernel blocks": ("FLASHINFER", 128, "words", True),
}


def _plan(name):
    return _hybrid(*HYBRID[name]) if name in HYBRID else _llama(*LLAMA[name])


def _group_of(plan):
    """Layer name -> its KV-cache group."""
    return {
        name: g
        for g, grp in enumerate(plan.kv_cache_config.kv_cache_groups)
        for name in grp.layer_names
    }


def _attn_group(plan, name):
    """The attention group of layer `name` (None: a Mamba layer)."""
    for groups in plan.attn_groups:
        for grp in groups:
            if name in grp.layer_names and not isinstance(
                grp.kv_cache_spec, jaxkv.MambaSpec
            ):
                return grp
    return None


def _kernel_step(plan, name, bs, k):
    """Kernel blocks between two manager blocks of layer `name`: ``bs // k``,
    or a packed pool's stride (spec section 1.8), from the group alone."""
    grp = _attn_group(plan, name)
    stride = 0 if grp is None else grp.kernel_block_stride
    return stride or bs // k


def _owning(plan):
    seen, out = set(), {}
    for name, view in plan.views.items():
        if id(view) not in seen:
            seen.add(id(view))
            out[name] = view
    return out


def _filled(plan, seed, n=None):
    """A request of N tokens with random K/V and states, through the public
    write path; its windows' old blocks given back (commit)."""
    n = N if n is None else n
    rng = np.random.default_rng(seed)
    m = jaxkv.KVCacheManager(plan)
    req = jaxkv.Request("r", prompt=list(range(n)), max_new_tokens=1)
    assert m.allocate(req, n)
    blocks = m.step_blocks([(req, n)])
    pools = plan.allocate()
    want_kv, want_state = {}, {}
    groups = _group_of(plan)
    for name, view in _owning(plan).items():
        g = groups[name]
        if isinstance(view, jaxkv.MambaView):
            states = [
                rng.standard_normal((1, *s.shape[1:])).astype(s.dtype)
                for s in view.states
            ]
            block = blocks.block_tables[g][0, (n - 1) // plan.block_sizes[g]]
            pools = jaxkv.write_mamba_state(pools, view, np.array([block]), states)
            want_state[name] = states
            continue
        heads, dim = view.shape[view.axes.index("head")], view.head_size
        k = rng.standard_normal((n, heads, dim)).astype(np.float32)
        v = rng.standard_normal((n, heads, dim)).astype(np.float32)
        grp = _attn_group(plan, name)
        assert grp is not None
        slots = grp.map_to_kernel_slot_mapping(blocks.slot_mappings[g])
        pools = jaxkv.write_kv(pools, view, k, v, slots)
        want_kv[name] = (k, v)
    req.num_computed = n
    m.commit(req)
    return pools, m.blocks_of(req), want_kv, want_state


def _pool_bytes(pools, i):
    """Pool `i`'s bytes (a list of byte arrays passes through)."""
    if isinstance(pools[i], np.ndarray) and pools[i].dtype == np.uint8:
        return pools[i]
    return np.asarray(jax.device_get(pools[i])).reshape(-1).view(np.uint8)


def _element_addresses(view, fixed):
    """Byte address of every element of `view` with the dims in `fixed` set
    (a dict axis name -> index array, broadcast against each other)."""
    addr = view.offset
    for d, axis in enumerate(view.axes):
        addr = (
            addr + np.asarray(fixed[axis], np.int64) * view.strides[d] * view.itemsize
        )
    return addr


def _oracle_kv(plan, pools, name, view, ids, bs, n):
    """Per token (n, heads, dim) K and V read from the bytes, and which tokens
    the target holds."""
    k = view.block_size
    tok = np.arange(n)
    block = np.asarray(ids)[tok // bs]
    held = block != 0
    kb = block * _kernel_step(plan, name, bs, k) + (tok % bs) // k
    off = tok % k
    heads, dim = view.shape[view.axes.index("head")], view.head_size
    h = np.arange(heads)[None, :, None]
    e = np.arange(dim)[None, None, :]
    raw = _pool_bytes(pools, view.pool)
    out = []
    for which in (0, 1):
        fixed = {"block": kb[:, None, None], "token": off[:, None, None], "head": h}
        if "kv" in view.axes:
            fixed["kv"], fixed["dim"] = which, e
        else:  # fused: K then V along the last dim
            fixed["dim"] = e + which * dim
        addr = _element_addresses(view, fixed)
        b = raw[addr[..., None] + np.arange(view.itemsize)]
        out.append(b.reshape(-1).view(view.dtype).reshape(n, heads, dim))
    return out[0], out[1], held


def _oracle_state(pools, view, block):
    out = []
    for s in view.states:
        fixed_shape = s.shape[1:]
        idx = np.indices(fixed_shape).reshape(len(fixed_shape), -1)
        addr = s.offset + block * s.strides[0] * s.itemsize
        for d in range(len(fixed_shape)):
            addr = addr + idx[d] * s.strides[d + 1] * s.itemsize
        raw = _pool_bytes(pools, s.pool)
        b = raw[addr[:, None] + np.arange(s.itemsize)]
        out.append(b.reshape(-1).view(s.dtype).reshape(fixed_shape))
    return out


def _check_moved(dst, pools, before, ids, want_kv, want_state, src_ids, src_plan, n):
    groups = _group_of(dst)
    src_groups = _group_of(src_plan)
    for name, view in _owning(dst).items():
        g = groups[name]
        bs = dst.block_sizes[g]
        if isinstance(view, jaxkv.MambaView):
            block = ids[g][(n - 1) // bs]
            for got, want in zip(
                _oracle_state(pools, view, block), want_state[name], strict=True
            ):
                np.testing.assert_array_equal(got, want[0])
            continue
        k, v, held = _oracle_kv(dst, pools, name, view, ids[g], bs, n)
        sg = src_groups[name]
        src_held = (
            np.asarray(src_ids[sg])[np.arange(n) // src_plan.block_sizes[sg]] != 0
        )
        both = held & src_held
        # Every token a future query of the window sees is held on both sides.
        window = getattr(dst.runner_config.layer(name).spec, "sliding_window", None)
        if window:
            assert both[n - window + 1 :].all(), name
        else:
            assert both.all(), name
        np.testing.assert_array_equal(k[both], want_kv[name][0][both], err_msg=name)
        np.testing.assert_array_equal(v[both], want_kv[name][1][both], err_msg=name)
        # Held by the target but gone from the source: written nowhere.
        k0, _, _ = _oracle_kv(dst, before, name, view, ids[g], bs, n)
        stale = held & ~src_held
        np.testing.assert_array_equal(k[stale], k0[stale], err_msg=name)


def _move(src_name, dst_name, n=N):
    src = _plan(src_name)
    dst = _plan(dst_name)
    pools, src_ids, want_kv, want_state = _filled(src, seed=len(src_name), n=n)
    kv = jaxkv.transfer.export_request(src, pools, block_ids=src_ids, num_tokens=n)
    # Each cache once: KV-sharing layers read their target's.
    assert set(kv.attention) | set(kv.states) == set(_owning(src))
    m = jaxkv.KVCacheManager(dst)
    filler = jaxkv.Request("other", prompt=[1] * 40, max_new_tokens=1)
    m.allocate(filler, 40)  # the request does not land on blocks 1, 2, ...
    req = jaxkv.Request("r", prompt=list(range(n)), max_new_tokens=1)
    assert m.allocate(req, n)
    ids = m.blocks_of(req)
    # The target's pools hold other bytes already: what the import does not
    # write must keep them.
    target = tuple(jax.numpy.full(p.shape, 7, p.dtype) for p in dst.allocate())
    before = [_pool_bytes(target, i).copy() for i in range(len(target))]
    out = jaxkv.transfer.import_request(dst, target, kv, block_ids=ids)
    _check_moved(dst, out, before, ids, want_kv, want_state, src_ids, src, n)
    # Nothing outside the request's blocks was written (the bytes every view
    # addresses in them, K and V halves, page padding, other layers' pages).
    owned = [np.zeros(_pool_bytes(out, i).size, bool) for i in range(len(out))]
    groups = _group_of(dst)
    for name, view in _owning(dst).items():
        g = groups[name]
        blocks = np.array([b for b in ids[g] if b])
        parts = view.states if isinstance(view, jaxkv.MambaView) else [view]
        for part in parts:
            r = dst.block_sizes[g] // part.block_size if part.block_size else 1
            t = _kernel_step(dst, name, dst.block_sizes[g], part.block_size or 1)
            t = t if part.block_size else 1
            kernel = (blocks[:, None] * t + np.arange(r)[None]).ravel()
            owned[part.pool][_block_bytes(part, kernel)] = True
    for i in range(len(out)):
        np.testing.assert_array_equal(
            _pool_bytes(out, i)[~owned[i]], before[i][~owned[i]]
        )


def _block_bytes(view, blocks):
    """Every byte address `view` has in `blocks` (its block axis)."""
    axes = [
        blocks if axis == "block" else np.arange(n)
        for axis, n in zip(view.axes, view.shape, strict=True)
    ]
    grids = np.ix_(*axes)
    addr = view.offset
    for d, grid in enumerate(grids):
        addr = addr + grid.astype(np.int64) * view.strides[d] * view.itemsize
    return (addr.reshape(-1, 1) + np.arange(view.itemsize)).ravel()


@pytest.mark.parametrize("n", [N, 64])
@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(HYBRID, 2)))
def test_a_hybrid_request_moves_between_layouts_and_block_sizes(src, dst, n):
    _move(src, dst, n)


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(LLAMA, 2)))
def test_a_request_moves_between_storages_layouts_and_block_sizes(src, dst):
    _move(src, dst)


def test_moving_to_the_same_plan_round_trips():
    _move("blocks-first/16", "blocks-first/16")


def test_what_cannot_move_is_refused_naming_what_differs():
    src = _hybrid("JAX_PAGED", 32)
    pools, ids, _, _ = _filled(src, seed=0)
    kv = jaxkv.transfer.export_request(src, pools, block_ids=ids, num_tokens=N)
    other_heads = jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(num_kv_heads=4, num_heads=8, sliding_window=48),
        num_blocks=16,
    )
    with pytest.raises(
        ValueError, match="layer 'layers.0.self_attn': the target's keys"
    ):
        jaxkv.transfer.import_request(
            other_heads, other_heads.allocate(), kv, block_ids=ids
        )
    llama = _llama("JAX_PAGED", 32, "words")
    with pytest.raises(ValueError, match="cached layers differ"):
        jaxkv.transfer.import_request(
            llama, llama.allocate(), kv, block_ids=[ids[0]] * len(llama.block_sizes)
        )
    with pytest.raises(ValueError, match="block_ids has 2 tables, the plan has 3"):
        jaxkv.transfer.export_request(src, pools, block_ids=ids[:2], num_tokens=N)
    with pytest.raises(ValueError, match=r"block_ids\[0\] has 1 blocks; 70 tokens"):
        jaxkv.transfer.export_request(
            src, pools, block_ids=[[1], *ids[1:]], num_tokens=N
        )
    with pytest.raises(ValueError, match=r"block_ids\[0\]\[0\] = 99 is not a block"):
        jaxkv.transfer.export_request(
            src, pools, block_ids=[[99, 1, 2], *ids[1:]], num_tokens=N
        )
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        jaxkv.transfer.export_request(src, pools, block_ids=ids, num_tokens=0)
    with pytest.raises(ValueError, match="Mamba layer 'layers.2.mixer' has no block"):
        jaxkv.transfer.export_request(
            src, pools, block_ids=[ids[0], ids[1], [0, 0, 0]], num_tokens=N
        )


def _engine(backend, block_size, model=None):
    return transfer_engine(backend, block_size, model, record_logits=True)


SERVED = [("JAX_PAGED", 16), ("JAX_PAGED_FUSED", 32), ("JAX_PAGED_KV_FIRST", 64)]
SERVED_PAIRS = [
    # One pair in the default run, every other ordered pair in the slow pass.
    pytest.param(
        a,
        b,
        marks=[] if (a, b) == (SERVED[0], SERVED[2]) else [pytest.mark.slow],
        id=f"{a[0]}/{a[1]}->{b[0]}/{b[1]}",
    )
    for a, b in itertools.permutations(SERVED, 2)
]


@pytest.mark.parametrize(("src", "dst"), SERVED_PAIRS)
def test_a_request_prefilled_on_one_plan_decodes_on_another_as_if_never_moved(src, dst):
    # Prefill on one layout and block size, decode on another (the hybrid
    # model: full and sliding-window attention, Mamba, YOCO): the moved
    # request's tokens and logits equal an unmoved run's.
    prompt = np.random.default_rng(5).integers(1, 64, 50).tolist()
    ref_engine, model = _engine(*src)
    ref = jaxkv.Request("ref", prompt=prompt, max_new_tokens=6)
    ref_engine.submit(ref)
    while ref_engine.has_unfinished:
        ref_engine.step()
    want_logits = ref_engine.logits["ref"]

    prefill, _ = _engine(src[0], src[1], model)
    first = jaxkv.Request("p", prompt=prompt, max_new_tokens=6)
    prefill.submit(first)
    while not first.output:
        prefill.step()
    kv = prefill.export_request(first)
    assert kv.num_tokens == len(prompt)
    decode, _ = _engine(dst[0], dst[1], model)
    moved = jaxkv.Request("d", prompt=prompt + first.output, max_new_tokens=5)
    assert decode.adopt(moved, kv)
    while decode.has_unfinished:
        decode.step()
    assert first.output + moved.output == ref.output
    np.testing.assert_allclose(
        np.stack(decode.logits["d"]), np.stack(want_logits[1:]), rtol=2e-5, atol=2e-5
    )


def test_a_refused_adoption_changes_nothing():
    src, model = _engine("JAX_PAGED", 16)
    req = jaxkv.Request("p", prompt=list(range(1, 40)), max_new_tokens=3)
    src.submit(req)
    while not req.output:
        src.step()
    kv = src.export_request(req)
    other = jaxkv.tiny_hybrid_config(num_heads=4, num_kv_heads=4, head_size=16)
    wrong = jaxkv.demo.Engine(
        other,
        jaxkv.demo.TinyHybridModel(other, vocab_size=64, rngs=nnx.Rngs(0)),
        num_blocks=64,
    )
    before = [np.asarray(p).copy() for p in wrong.pools]
    moved = jaxkv.Request("d", prompt=req.prompt + req.output, max_new_tokens=2)
    free = wrong.scheduler.manager.num_free_blocks
    with pytest.raises(ValueError, match="the target's keys"):
        wrong.adopt(moved, kv)
    assert wrong.scheduler.manager.num_free_blocks == free
    assert not wrong.scheduler.running
    assert moved.status is jaxkv.RequestStatus.WAITING
    for a, b in zip(before, wrong.pools, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The same request adopts on a plan that fits.
    fits, _ = _engine("JAX_PAGED_FUSED", 32, model)
    with pytest.raises(ValueError, match=r"num_computed=39 .* must be in \[1, 38\]"):
        fits.adopt(jaxkv.Request("x", prompt=req.prompt, max_new_tokens=2), kv)
    assert fits.adopt(moved, kv)
    with pytest.raises(ValueError, match="already live"):
        fits.adopt(moved, kv)


@pytest.mark.slow
def test_a_request_moves_between_tensor_parallel_degrees():
    """1 -> 2x2 (data rank 1) -> 1x4 -> 1x2 -> 1 on 4 simulated devices, with 4
    and with 2 KV heads (replicated over 4 ranks): each rank holds exactly its
    heads and Mamba slices, other ranks' shards unchanged, the round trip
    byte-exact (``transfer_mesh_check.py``).
    """  # noqa: D205
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("transfer_mesh_check.py")
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent.parent,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [pytest.param(["mesh"], id="1x4->2x2")])
def test_prefill_and_decode_in_two_processes_give_the_tokens_of_one(tmp_path, mesh):
    """Two processes on the loopback address, the caches moved with
    ``jax.experimental.transfer`` (``send_request`` / ``receive_request``):
    blocks-first pools of 16 for prefill, K/V-first pools of 64 for decode; the
    tokens of three requests equal a one-process run. Each process has 4
    simulated devices: prefill on a 1x4 tensor-parallel mesh, decode on a 2x2
    mesh (``disagg_check.py`` without ``mesh`` runs them on one device each).
    Both processes stop by themselves (deadlines of 120 s, killed at 240 s).
    """  # noqa: D205
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("disagg_check.py")
    root = script.parent.parent
    prefill = subprocess.Popen(
        [sys.executable, str(script), "prefill", str(tmp_path), *mesh],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        decode = subprocess.run(
            [sys.executable, str(script), "decode", str(tmp_path), *mesh],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        try:
            out, _ = prefill.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            prefill.kill()
            out, _ = prefill.communicate()
    assert decode.returncode == 0, decode.stdout[-3000:] + decode.stderr[-3000:]
    assert prefill.returncode == 0, out[-3000:]
    assert decode.stdout.strip().endswith("OK")


def test_a_packed_pools_strided_kernel_view_round_trips_through_its_blocks():
    """The tiny hybrid on FLASHINFER, block 128 in kernel blocks of 64 of a
    packed pool (stride 4): what is imported into its blocks exports back the
    same, and the oracle reads it from the kernel blocks ``b * 4 + j``."""
    cfg = jaxkv.tiny_hybrid_config(attention_backend="FLASHINFER", block_size=128)
    packed = jaxkv.make_plan(cfg, num_blocks=8, packed=True, maps_slot_mapping=True)
    grp = _attn_group(packed, "layers.0.self_attn")
    assert grp is not None
    assert grp.kernel_block_stride == 4
    plain = jaxkv.make_plan(cfg, num_blocks=8)
    pools, ids, want_kv, _ = _filled(plain, seed=4, n=200)
    kv = jaxkv.transfer.export_request(plain, pools, block_ids=ids, num_tokens=200)
    out = jaxkv.transfer.import_request(packed, packed.allocate(), kv, block_ids=ids)
    back = jaxkv.transfer.export_request(packed, out, block_ids=ids, num_tokens=200)
    for name, (k, v) in want_kv.items():
        held = back.attention[name].present
        got = np.asarray(back.attention[name].keys)
        np.testing.assert_array_equal(got[held], k[held], err_msg=name)
        g = _group_of(packed)[name]
        ok, ov, oheld = _oracle_kv(
            packed, out, name, packed.views[name], ids[g], 128, 200
        )
        np.testing.assert_array_equal(ok[oheld], k[oheld], err_msg=name)
        np.testing.assert_array_equal(ov[oheld], v[oheld], err_msg=name)


def test_an_import_refuses_repeated_blocks_and_blocks_shared_by_groups_of_one_pool():
    src = jaxkv.make_plan(jaxkv.tiny_hybrid_config(block_size=32), num_blocks=8)
    name = "layers.0.self_attn"
    k = jnp.arange(5 * 2 * 32, dtype=jnp.float32).reshape(5, 2, 32)
    pools = jaxkv.write_kv(
        src.allocate(), src.views[name], k, k, jnp.array([32, 33, 34, 35, 36])
    )
    kv = jaxkv.transfer.export_request(src, pools, block_ids=[[1]] * 3, num_tokens=5)
    dst = jaxkv.make_plan(jaxkv.tiny_hybrid_config(block_size=4), num_blocks=16)
    assert dst.block_sizes == (20, 20, 4)  # 5 tokens: 1, 1 and 2 blocks
    target = dst.allocate()
    before = [np.asarray(p).copy() for p in target]
    with pytest.raises(ValueError, match=r"block_ids\[2\] lists block 7 twice"):
        jaxkv.transfer.import_request(dst, target, kv, block_ids=[[3], [5], [7, 7]])
    with pytest.raises(ValueError, match="block 3 is in the tables of groups 0 and"):
        jaxkv.transfer.import_request(dst, target, kv, block_ids=[[3], [3], [7, 8]])
    # With the target's manager: only blocks it gave this request.
    m = jaxkv.KVCacheManager(dst)
    other = jaxkv.Request("other", prompt=[1] * 5, max_new_tokens=1)
    req = jaxkv.Request("req", prompt=[1] * 5, max_new_tokens=1)
    with pytest.raises(ValueError, match="request 'req' holds no blocks"):
        jaxkv.transfer.import_request(
            dst, target, kv, block_ids=[[3], [5], [7, 8]], manager=m, request=req
        )
    assert m.allocate(other, 5)
    assert m.allocate(req, 5)
    mine, theirs = m.blocks_of(req), m.blocks_of(other)
    stolen = [mine[0], mine[1], [mine[2][0], theirs[2][1]]]
    with pytest.raises(ValueError, match=f"block_ids.2. has block {theirs[2][1]}, wh"):
        jaxkv.transfer.import_request(
            dst, target, kv, block_ids=stolen, manager=m, request=req
        )
    with pytest.raises(ValueError, match="pass manager= and request= together"):
        jaxkv.transfer.import_request(dst, target, kv, block_ids=mine, manager=m)
    with pytest.raises(TypeError, match="request must be the Request"):
        jaxkv.transfer.import_request(
            dst, target, kv, block_ids=mine, manager=m, request="req"
        )
    for a, b in zip(target, before, strict=True):  # refused: nothing written
        np.testing.assert_array_equal(np.asarray(a), b)
    out = jaxkv.transfer.import_request(
        dst, dst.allocate(), kv, block_ids=mine, manager=m, request=req
    )
    back = jaxkv.transfer.export_request(dst, out, block_ids=mine, num_tokens=5)
    assert bool((back.attention[name].keys == k).all())
    ids = [[3], [5], [7, 8]]
    out = jaxkv.transfer.import_request(dst, target, kv, block_ids=ids)
    back = jaxkv.transfer.export_request(dst, out, block_ids=ids, num_tokens=5)
    assert bool((back.attention[name].keys == k).all())


def test_receive_request_honours_its_deadline_when_the_peer_never_answers():
    import time

    class Silent:  # a connection to a peer that is not there: pull never returns
        def pull(self, uuid, specs, timeout=None):
            time.sleep(60)

    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="nothing arrived for uuid 7"):
        jaxkv.transfer.receive_request(Silent(), plan, uuid=7, timeout=0.5)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(TypeError, match="timeout must be a datetime"):
        jaxkv.transfer.receive_request(Silent(), plan, uuid=7, timeout="5s")


def test_receive_request_from_a_real_server_with_no_peer_ends_by_its_deadline():
    # JAX's transfer library hands back arrays still arriving: reading them
    # blocked past the deadline (issue 56: not back after 60 s).
    import time

    from jax.experimental import transfer

    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
    client = jax.devices()[0].client
    server = transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="nothing arrived for uuid 7"):
        jaxkv.transfer.receive_request(
            server.connect("127.0.0.1:1"), plan, uuid=7, timeout=1.0
        )
    assert time.perf_counter() - t0 < 10
