"""Run by tests/test_transfer.py in a subprocess: a request's KV cache moved
between tensor-parallel degrees 1 -> 4 -> 2 -> 1 on simulated CPU devices.

A hybrid request (full and sliding-window attention, Mamba) is written on one
device, imported into data rank 1 of a 2x2 mesh and then into data rank 0 of
a 1x4 mesh: each tensor rank's local pool holds exactly its heads (vLLM's
split) and its Mamba state slice, read back through the rank-local plan; then
it goes to a 1x2 mesh and back to one device, where every byte equals the
original. No other rank's shard changes. Prints ``OK``.
"""  # noqa: D205

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402

N = 70


KV_HEADS = [4]


def _config():
    return jaxkv.tiny_hybrid_config(
        num_heads=4, num_kv_heads=KV_HEADS[0], head_size=16, sliding_window=48
    )


def _mesh(d, t):
    return jax.make_mesh((d, t), ("data", "tensor"), devices=jax.devices()[: d * t])


def _blocks(plan, n):
    m = jaxkv.KVCacheManager(plan)
    req = jaxkv.Request("r", prompt=list(range(n)), max_new_tokens=1)
    assert m.allocate(req, n)
    blocks = m.step_blocks([(req, n)])
    req.num_computed = n
    m.commit(req)
    return m.blocks_of(req), blocks


def _source():
    plan = jaxkv.make_plan(_config(), num_blocks=16)
    ids, blocks = _blocks(plan, N)
    rng = np.random.default_rng(0)
    pools = plan.allocate()
    seen = set()
    groups = {
        n: g
        for g, grp in enumerate(plan.kv_cache_config.kv_cache_groups)
        for n in grp.layer_names
    }
    for name, view in plan.views.items():
        if id(view) in seen:
            continue
        seen.add(id(view))
        g = groups[name]
        if isinstance(view, jaxkv.MambaView):
            states = [
                rng.standard_normal((1, *s.shape[1:])).astype(s.dtype)
                for s in view.states
            ]
            block = blocks.block_tables[g][0, (N - 1) // plan.block_sizes[g]]
            pools = jaxkv.write_mamba_state(pools, view, np.array([block]), states)
        else:
            k = rng.standard_normal((N, KV_HEADS[0], 16)).astype(np.float32)
            pools = jaxkv.write_kv(pools, view, k, -k, blocks.slot_mappings[g])
    kv = jaxkv.transfer.export_request(plan, pools, block_ids=ids, num_tokens=N)
    return kv


def _same(a, b):
    assert set(a.attention) == set(b.attention)
    assert set(a.states) == set(b.states)
    for name, layer in a.attention.items():
        other = b.attention[name]
        both = layer.present & other.present
        np.testing.assert_array_equal(
            np.asarray(layer.keys)[both], np.asarray(other.keys)[both], err_msg=name
        )
        np.testing.assert_array_equal(
            np.asarray(layer.values)[both], np.asarray(other.values)[both]
        )
    for name, states in a.states.items():
        for x, y in zip(states, b.states[name], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def _move_to_mesh(kv, d, t, data):
    sp = jaxkv.shard_plan(_config(), mesh=_mesh(d, t), num_blocks=16)
    ids, _ = _blocks(sp.local, N)
    pools = sp.allocate()
    before = [
        [
            [np.asarray(sp.rank_pool(p, data=i, tensor=j)) for j in range(t)]
            for i in range(d)
        ]
        for p in pools
    ]
    pools = jaxkv.transfer.import_rank_request(sp, pools, kv, data=data, block_ids=ids)
    # Each tensor rank holds exactly its heads and state slices.
    for j in range(t):
        local_pools = tuple(
            jax.device_put(sp.rank_pool(p, data=data, tensor=j)) for p in pools
        )
        part = jaxkv.transfer.export_request(
            sp.local, local_pools, block_ids=ids, num_tokens=N
        )
        h = KV_HEADS[0]  # vLLM's split: a block of heads, or one replicated
        heads = (
            np.arange(j * (h // t), (j + 1) * (h // t))
            if h % t == 0
            else np.array([j // (t // h)])
        )
        for name, layer in part.attention.items():
            got, want = np.asarray(layer.keys), np.asarray(kv.attention[name].keys)
            both = layer.present & kv.attention[name].present
            np.testing.assert_array_equal(got[both], want[both][:, heads], err_msg=name)
        for name, states in part.states.items():
            spec = _config().layer(name).spec
            assert isinstance(spec, jaxkv.MambaSpec)
            for i, (x, w) in enumerate(zip(states, kv.states[name], strict=True)):
                axis = spec.shard_axes[i] if spec.shard_axes else None
                w = np.asarray(w)
                if axis is not None:
                    per = w.shape[axis + 1] // t
                    w = np.take(w, np.arange(j * per, (j + 1) * per), axis=axis + 1)
                np.testing.assert_array_equal(np.asarray(x), w, err_msg=name)
    # The other data rank's shards did not change.
    for i in range(d):
        if i == data:
            continue
        for p, b in zip(pools, before, strict=True):
            for j in range(t):
                np.testing.assert_array_equal(
                    sp.rank_pool(p, data=i, tensor=j), b[i][j]
                )
    back = jaxkv.transfer.export_rank_request(
        sp, pools, data=data, block_ids=ids, num_tokens=N
    )
    _same(kv, back)
    return back


def main() -> None:
    for kv_heads in (4, 2):  # 2 KV heads over 4 ranks: replicated
        KV_HEADS[0] = kv_heads
        _round_trip()
        print(f"{kv_heads} KV heads OK")
    print("OK")


def _round_trip() -> None:
    kv = _source()
    at4 = _move_to_mesh(kv, 2, 2, data=1)
    at4 = _move_to_mesh(at4, 1, 4, data=0)
    at2 = _move_to_mesh(at4, 1, 2, data=0)
    plan = jaxkv.make_plan(_config(), num_blocks=16)
    ids, _ = _blocks(plan, N)
    pools = jaxkv.transfer.import_request(plan, plan.allocate(), at2, block_ids=ids)
    _same(kv, jaxkv.transfer.export_request(plan, pools, block_ids=ids, num_tokens=N))


if __name__ == "__main__":
    main()
