"""Run by tests/test_shard.py in a subprocess with 8 simulated CPU devices.

Layer-stacked typed pools on meshes ``D x T`` given as ``DxT:axis_type``: a
4-layer attention model whose K/V live in one stacked pool per rank. Inside
``shard_map`` (check_vma on) each step scans over the layers with the layer
index traced, writing K/V and attending; checks that every device holds
1/(D*T) of the pool, that each rank's bytes equal a single-device run of the
rank-local plan, that attention equals the global model's head for head, and
that the compiled step has no collective and no pool-sized temp.

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
LAYERS = [f"layers.{i}.self_attn" for i in range(4)]


def main(d: int, t: int, axis_type: str) -> None:
    types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,) * 2
    mesh = jax.make_mesh((d, t), ("data", "tensor"), axis_types=types)
    heads, kv_heads, head, blocks = 8, 8, 16, 512
    cfg = jaxkv.llama_like_config(
        num_layers=4,
        num_kv_heads=kv_heads,
        num_heads=heads,
        head_size=head,
        max_model_len=64,
    )
    sp = jaxkv.shard_plan(cfg, mesh=mesh, num_blocks=blocks, storage="stacked")
    glob = jaxkv.make_plan(cfg, num_blocks=blocks, storage="stacked")
    ref_local = jaxkv.make_plan(
        jaxkv.plan.local_runner_config(cfg, tensor_parallel=t),
        num_blocks=blocks,
        storage="stacked",
    )
    (spec,) = sp.local.pools
    assert spec.typed, spec
    assert spec.shape[0] == 4, spec
    pools = sp.allocate()
    assert pools[0].shape == (d, t, *spec.shape)
    for s in pools[0].addressable_shards:
        assert s.data.nbytes * d * t == pools[0].nbytes

    rng = np.random.default_rng(d * 10 + t)
    q_lens, seqs = [3, 1], [5, 9]
    qsl = np.array([0, 3, 4], np.int32)
    pos = np.concatenate(
        [np.arange(s - q, s) for s, q in zip(seqs, q_lens, strict=True)]
    )
    req = np.repeat([0, 1], q_lens)
    tables, slots = [], []
    for _ in range(d):
        table = rng.permutation(np.arange(1, blocks))[:2].astype(np.int32).reshape(2, 1)
        tables.append([table])
        slots.append([(table[req, pos // 16] * 16 + pos % 16).astype(np.int32)])
    k = rng.standard_normal((d, 4, 4, kv_heads, head)).astype(np.float32)
    v = rng.standard_normal((d, 4, 4, kv_heads, head)).astype(np.float32)
    q = rng.standard_normal((d, 4, 4, heads, head)).astype(np.float32)
    builder = jaxkv.StepMetadataBuilder(sp)
    rows = rank_steps(
        builder,
        query_start_loc=qsl,
        seq_lens=np.array(seqs),
        positions=pos,
        tables=tables,
        slots=slots,
    )
    stack = sp.local.layer_stack(LAYERS)

    def step(pools, rows, k, v, q):
        local = sp.local_pools(pools)
        meta = builder.metadata(rows.local())[LAYERS[0]]

        def body(local, xs):
            kl, vl, ql, slot = xs
            local = jaxkv.write_kv(
                local, stack.layer.view, kl, vl, meta.slot_mapping[:4], layer=slot
            )
            out = jaxkv.paged_attention(
                ql, local, stack.layer, meta, scale=0.25, layer=slot
            )
            return local, out

        local, outs = jax.lax.scan(
            body, local, (k[0], v[0], q[0], jnp.asarray(stack.slots))
        )
        return sp.global_pools(local), outs[None]

    spec5 = P("data", None, None, "tensor", None)
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(sp.pool_spec, P("data"), spec5, spec5, spec5),
            out_specs=(sp.pool_spec, spec5),
        ),
        donate_argnums=0,
    )

    def put(x, *s):
        return jax.device_put(x, NamedSharding(mesh, P(*s)))

    args = (rows, put(k, *spec5), put(v, *spec5), put(q, *spec5))
    compiled = fn.lower(pools, *args).compile()
    text = compiled.as_text() or ""
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert op not in text, f"{op} in the compiled sharded step"
    analysis: Any = compiled.memory_analysis()
    assert analysis.temp_size_in_bytes <= 0.1 * spec.size_bytes, (
        analysis.temp_size_in_bytes,
        spec.size_bytes,
    )
    pools, outs = compiled(pools, *args)

    hl = jaxkv.plan.local_kv_heads(kv_heads, t)
    for di in range(d):
        meta = jaxkv.vllm.build_attn_metadata(
            glob.attn_groups,
            2,
            4,
            qsl,
            None,
            3,
            np.array(seqs),
            9,
            tables[di],
            slots[di],
            glob.kv_cache_config,
        )[LAYERS[0]]
        gpools = glob.allocate()
        for i, name in enumerate(LAYERS):
            gpools = jaxkv.write_kv(
                gpools, glob.views[name], k[di, i], v[di, i], slots[di][0]
            )
            want = jaxkv.paged_attention(
                jnp.asarray(q[di, i]),
                gpools,
                glob.attention_layer(name),
                meta,
                scale=0.25,
            )
            np.testing.assert_allclose(
                np.asarray(outs)[di, i], np.asarray(want), rtol=1e-5, atol=1e-5
            )
        for ti in range(t):
            rpools = ref_local.allocate()
            hs = slice(ti * hl, (ti + 1) * hl)
            for i, name in enumerate(LAYERS):
                rpools = jaxkv.write_kv(
                    rpools,
                    ref_local.views[name],
                    k[di, i][:, hs],
                    v[di, i][:, hs],
                    slots[di][0],
                )
            np.testing.assert_array_equal(
                sp.rank_pool(pools[0], data=di, tensor=ti), np.asarray(rpools[0])
            )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        shape, axis_type = arg.split(":")
        dd, tt = (int(x) for x in shape.split("x"))
        main(dd, tt, axis_type)
    print("OK")
