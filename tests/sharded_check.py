"""Run by tests/test_shard.py in a subprocess with 8 simulated CPU devices.

For each mesh ``D x T`` (data x tensor) given as ``DxT:axis_type:layout``
and the built-in hybrid model (full and
sliding-window attention and Mamba sharing pools), checks that:

* every device holds 1/(D*T) of every pool, allocated on its device;
* K/V and Mamba state written inside ``shard_map`` (check_vma on) give, on
  each rank, exactly the bytes a single-device run of the rank-local model
  writes;
* attention inside ``shard_map`` equals the single-device global model's,
  head for head, within float32 rounding;
* the compiled step has no collective at all and no pool-sized temp.

Prints ``OK`` on success; any failure raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402
from tests.mesh_cases import rank_steps  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _check_device_map(sp: Any, pools: Any, d: int, t: int, kv_heads: int) -> None:
    # The device map says which device holds which rows and heads, as JAX
    # placed them; its picture draws each device's local byte map.
    from jaxkv.pictures import byte_map, device_map, plot_device_map

    for g in range(3):
        shares = device_map(sp, pool=0, group=g)
        where = {
            (s.index[0].start or 0, s.index[1].start or 0): s.device.id
            for s in pools[0].addressable_shards
        }
        assert {(x.data, x.tensor): x.device for x in shares} == where
        assert all(x.bytes * d * t == pools[0].nbytes for x in shares)
        held = sorted(h for x in shares if x.data == 0 for h in x.heads)
        if g < 2:  # attention groups: each tensor rank holds its own heads
            assert held == list(range(kv_heads)), held
    fig = plot_device_map(sp, pool=0, group=0, max_columns=64)
    local = byte_map(sp.local, pool=0, group=0)
    cols = -(-local.bytes_per_block // 64)
    assert len(fig.axes) == d * t
    for ax in fig.axes:
        np.testing.assert_array_equal(
            np.asarray(ax.images[0].get_array()), local.owners[:, ::cols] + 1
        )
    import io

    png = io.BytesIO()
    fig.savefig(png, format="png")
    assert png.getvalue()[:4] == b"\x89PNG"


def check_device_map_edges() -> None:
    """2 KV heads over 8 tensor ranks are replicated (heads 0,0,0,0,1,1,1,1);
    a pool replicated over a spare mesh axis is on every device; bad ranks and
    axes are named.
    """  # noqa: D205
    from jaxkv.pictures import device_map, plot_device_map

    cfg = jaxkv.tiny_hybrid_config(num_heads=8, num_kv_heads=2, head_size=16)
    mesh = jax.make_mesh((1, 8), ("data", "tensor"))
    sp = jaxkv.shard_plan(cfg, mesh=mesh, num_blocks=4)
    heads = [x.heads for x in device_map(sp, group=0)]
    assert [(h.start, h.stop) for h in heads] == [
        (i // 4, i // 4 + 1) for i in range(8)
    ]
    spare = jax.make_mesh((2, 2, 2), ("data", "tensor", "spare"))
    sp = jaxkv.shard_plan(cfg, mesh=spare, num_blocks=4)
    pools = sp.allocate()
    shares = device_map(sp)
    assert sorted(x.device for x in shares) == sorted(dev.id for dev in jax.devices())
    where = {
        s.device.id: (s.index[0].start or 0, s.index[1].start or 0)
        for s in pools[0].addressable_shards
    }
    assert {x.device: (x.data, x.tensor) for x in shares} == where
    assert len(plot_device_map(sp).axes) == 4  # one panel per (data, tensor) rank
    import pytest

    for kwargs, match in (
        ({"data": 5, "tensor": 0}, "data=5 is outside the mesh's 2"),
        ({"data": 0, "tensor": -1}, "tensor=-1 is outside"),
    ):
        with pytest.raises(ValueError, match=match):
            sp.rank_pool(pools[0], **kwargs)
    with pytest.raises(ValueError, match="both 'tensor'"):
        jaxkv.shard_plan(cfg, mesh=mesh, data_axis="tensor", num_blocks=4)
    # Pools of a 2x4 plan in a 4x2 step: named before JAX's divisibility error.
    two_by_four = jaxkv.shard_plan(
        cfg, mesh=jax.make_mesh((2, 4), ("data", "tensor")), num_blocks=4
    )
    four_by_two = jaxkv.shard_plan(
        cfg, mesh=jax.make_mesh((4, 2), ("data", "tensor")), num_blocks=4
    )
    with pytest.raises(ValueError, match=r"pools\[0\] is .* on a 4x2 .* another mesh"):
        four_by_two.check_pools(two_by_four.allocate())
    four_by_two.check_pools(four_by_two.allocate())
    # Inside shard_map, a block that is not (1, 1, ...) is named too.
    blocks: Any = [
        jax.ShapeDtypeStruct((2, 1, *p.shape), p.dtype) for p in four_by_two.local.pools
    ]
    with pytest.raises(ValueError, match="per-device block"):
        jax.eval_shape(lambda: four_by_two.local_pools(blocks))


def main(d: int, t: int, axis_type: str, packed: bool) -> None:
    types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,) * 2
    mesh = jax.make_mesh((d, t), ("data", "tensor"), axis_types=types)
    heads, kv_heads, head = 16, 8, 16  # GQA: two query heads per KV head
    shape = {
        "head_size": head,
        "block_size": 16,
        "sliding_window": 24,
        "kv_sharing_fast_prefill": False,
        "max_model_len": 128,  # 4 table columns even if blocks grow to 32
    }
    cfg = jaxkv.tiny_hybrid_config(num_heads=heads, num_kv_heads=kv_heads, **shape)
    blocks = 1024  # pools of 2-4 MiB per device: any pool-sized temp shows
    sp = jaxkv.shard_plan(cfg, mesh=mesh, num_blocks=blocks, packed=packed)
    glob = jaxkv.make_plan(cfg, num_blocks=blocks, packed=packed)
    # The rank-local reference is the same model built with 1/T of the heads
    # (its Mamba state follows the head count), not local_runner_config, the
    # function under test; which must agree with it.
    local_cfg = jaxkv.tiny_hybrid_config(
        num_heads=heads // t, num_kv_heads=kv_heads // t, **shape
    )
    split = jaxkv.plan.local_runner_config(cfg, tensor_parallel=t)
    assert [(x.spec, x.num_heads) for x in split.layers] == [
        (x.spec, x.num_heads) for x in local_cfg.layers
    ]
    ref_local = jaxkv.make_plan(local_cfg, num_blocks=blocks, packed=packed)
    # 16 asked for; hybrid page alignment may raise it (vLLM's rule: the Mamba
    # page decides), so the slots below use the plan's.
    bs = glob.block_sizes[0]
    pools = sp.allocate()

    # 1/(D*T) of every pool per device, on its own device.
    for pool, spec in zip(pools, sp.local.pools, strict=True):
        assert pool.shape == (d, t, *spec.shape), pool.shape
        shards = pool.addressable_shards
        assert len(shards) == d * t
        assert {s.device for s in shards} == set(mesh.devices.flat)
        for s in shards:
            assert s.data.nbytes * d * t == pool.nbytes, (s.data.nbytes, pool.nbytes)
    if d > 1 and t > 1 and axis_type == "explicit" and not packed:  # both axes
        _check_device_map(sp, pools, d, t, kv_heads)

    # One step per data-parallel rank: 2 requests each, different per rank.
    rng = np.random.default_rng(d * 10 + t)
    attn = ["layers.0.self_attn", "layers.1.self_attn"]
    mamba = "layers.2.mixer"
    q_lens, seqs = [3, 1], [5, 9]
    qsl = np.array([0, 3, 4], np.int32)
    n_tok = 4
    pos = np.concatenate(
        [np.arange(s - q, s) for s, q in zip(seqs, q_lens, strict=True)]
    )
    req = np.repeat([0, 1], q_lens)
    # Per data-parallel rank, distinct block ids for the three groups (they
    # share pages: one free list), DP-local ids.
    tables, slots = [], []
    for _ in range(d):
        ids = rng.permutation(np.arange(1, blocks))[:18].astype(np.int32)
        full, swa, state = ids[:8].reshape(2, 4), ids[8:16].reshape(2, 4), ids[16:18]
        tables.append([full, swa, state.reshape(2, 1)])
        slots.append(
            [
                (tb[req, pos // bs] * bs + pos % bs).astype(np.int32)
                for tb in (full, swa)
            ]
            + [np.full(n_tok, -1, np.int32)]
        )
    k = rng.standard_normal((d, n_tok, kv_heads, head)).astype(np.float32)
    v = rng.standard_normal((d, n_tok, kv_heads, head)).astype(np.float32)
    q = rng.standard_normal((d, n_tok, heads, head)).astype(np.float32)
    m_shapes = [s.shape[1:] for s in glob.views[mamba].states]  # type: ignore[union-attr]
    states = [rng.standard_normal((d, 2, *s)).astype(np.float32) for s in m_shapes]
    builder = jaxkv.StepMetadataBuilder(sp)
    rows = rank_steps(
        builder,
        query_start_loc=qsl,
        seq_lens=np.array(seqs),
        positions=pos,
        tables=tables,
        slots=slots,
    )
    mstate_axes = glob.runner_config.layer(mamba).spec.shard_axes  # type: ignore[union-attr]

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    m_specs = tuple(
        P("data", None, *["tensor" if a == ax else None for a in range(len(s))])
        for s, ax in zip(m_shapes, mstate_axes, strict=True)
    )

    # A plain-jit step (no shard_map) over the data-sharded packed steps, one
    # row per rank under vmap: the metadata equals each rank's own.
    def rank_meta(row):
        m = builder.metadata(row)
        return m[attn[1]].slot_mapping, m[mamba].block_table_tensor

    got_slots, got_tables = jax.jit(jax.vmap(rank_meta))(rows)
    for di in range(d):
        np.testing.assert_array_equal(np.asarray(got_slots)[di, :n_tok], slots[di][1])
        np.testing.assert_array_equal(np.asarray(got_tables)[di, :2, :1], tables[di][2])

    def step(pools, rows, k, v, q, *mstates):
        local = sp.local_pools(pools)
        meta = builder.metadata(rows.local())
        # Writes first, then reads: with K/V given (not computed from the
        # previous layer's output) XLA may otherwise order a later layer's
        # write before an earlier layer's read and copy the pool to keep both.
        for name in attn:
            m = meta[name]
            local = jaxkv.write_kv(
                local, sp.local.views[name], k[0], v[0], m.slot_mapping[:n_tok]
            )
        ids = meta[mamba].block_table_tensor[:2, 0]
        local = jaxkv.write_mamba_state(
            local, sp.local.views[mamba], ids, [s[0] for s in mstates]
        )
        outs = []
        for name in attn:
            view = sp.local.views[name]
            m = meta[name]
            out = jaxkv.paged_attention(
                q[0],
                local,
                view,
                m,
                scale=0.25,
                sliding_window=24 if name.endswith("1.self_attn") else None,
                pages_per_chunk=2,
            )
            outs.append(out[None])
        return sp.global_pools(local), tuple(outs)

    qkv_spec = P("data", None, "tensor", None)
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(
                sp.pool_spec,
                P("data"),
                qkv_spec,
                qkv_spec,
                qkv_spec,
                *m_specs,
            ),
            out_specs=(sp.pool_spec, (qkv_spec, qkv_spec)),
        ),
        donate_argnums=0,
    )
    args = (
        rows,
        put(k, *qkv_spec),
        put(v, *qkv_spec),
        put(q, *qkv_spec),
        *(put(s, *spec) for s, spec in zip(states, m_specs, strict=True)),
    )
    compiled = fn.lower(pools, *args).compile()
    text = compiled.as_text() or ""
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert op not in text, f"{op} in the compiled sharded step"
    smallest_pool = min(p.size_bytes for p in sp.local.pools)
    analysis: Any = compiled.memory_analysis()
    temp = analysis.temp_size_in_bytes
    assert temp <= 0.1 * smallest_pool, (temp, smallest_pool)
    pools, outs = compiled(pools, *args)

    # Zeroing through views, in its own program: request 0's first page of the
    # full-attention layer and its Mamba state, per data-parallel rank.
    zero_ids = np.stack([[tb[0][0, 0], tb[2][0, 0]] for tb in tables]).astype(np.int32)
    zero_views = (sp.local.views[attn[0]], sp.local.views[mamba])

    def zero(pools, ids):
        local = jaxkv.zero_blocks(sp.local_pools(pools), zero_views, ids[0])
        return sp.global_pools(local)

    zero_fn = jax.jit(
        jax.shard_map(
            zero,
            mesh=mesh,
            in_specs=(sp.pool_spec, P("data", None)),
            out_specs=sp.pool_spec,
        ),
        donate_argnums=0,
    )
    pools = zero_fn(pools, put(zero_ids, "data", None))

    # Single-device references.
    hl = kv_heads // t  # by hand (kv_heads divides by every T here)
    for di in range(d):
        gpools = glob.allocate()
        for g, (name, window) in enumerate(zip(attn, (None, 24), strict=True)):
            gview = glob.views[name]
            gpools = jaxkv.write_kv(gpools, gview, k[di], v[di], slots[di][g])
            meta = jaxkv.vllm.build_attn_metadata(
                glob.attn_groups,
                2,
                n_tok,
                qsl,
                None,
                3,
                np.array(seqs),
                9,
                tables[di],
                slots[di],
                glob.kv_cache_config,
            )[name]
            want = jaxkv.paged_attention(
                jnp.asarray(q[di]),
                gpools,
                gview,
                meta,
                scale=0.25,
                sliding_window=window,
                pages_per_chunk=2,
            )
            got = np.asarray(outs[attn.index(name)])[di]
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
        for ti in range(t):
            rpools = ref_local.allocate()
            hs = slice(ti * hl, (ti + 1) * hl)
            for g, name in enumerate(attn):
                rpools = jaxkv.write_kv(
                    rpools,
                    ref_local.views[name],
                    k[di][:, hs],
                    v[di][:, hs],
                    slots[di][g],
                )
            local_states = []
            for s, ax in zip(states, mstate_axes, strict=True):
                x = s[di]
                if ax is not None:
                    n = x.shape[1 + ax] // t
                    x = np.take(x, np.arange(ti * n, (ti + 1) * n), axis=1 + ax)
                local_states.append(x)
            rpools = jaxkv.write_mamba_state(
                rpools,
                ref_local.views[mamba],
                jnp.asarray(tables[di][2][:, 0]),
                local_states,
            )
            rpools = jaxkv.zero_blocks(
                rpools,
                (ref_local.views[attn[0]], ref_local.views[mamba]),
                jnp.asarray(zero_ids[di]),
            )
            for pool, ref in zip(pools, rpools, strict=True):
                got = sp.rank_pool(pool, data=di, tensor=ti)
                np.testing.assert_array_equal(
                    got.view(np.uint8), np.asarray(ref).view(np.uint8)
                )


if __name__ == "__main__":
    # Cases as "DxT:axis_type:layout" (one process, one JAX start for all).
    check_device_map_edges()
    for case in sys.argv[1:]:
        mesh_shape, axis_type, layout = case.split(":")
        d, t = (int(x) for x in mesh_shape.split("x"))
        main(d, t, axis_type, layout == "packed")
        print(f"{case} OK", flush=True)
    print("OK")
