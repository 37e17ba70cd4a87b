"""Host offload: prefix-cache blocks the device evicts are copied to a host
tier and copied back on a hit instead of recomputed. Bytes checked against
the views' strides alone (tests/test_transfer.py's oracle), in float32, bf16
and fp8; a served workload whose prefixes fit the host but not the device
recomputes fewer prompt tokens with the same outputs.
"""  # noqa: D205

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.helpers import reset_loop
from tests.test_serve_loop import VOCAB, _griffin, _model, _params
from tests.test_transfer import _group_of, _oracle_kv, _oracle_state, _owning

PLANS = {
    "hybrid f32, Mamba": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(sliding_window=48), num_blocks=16
    ),
    "bf16 fused typed": lambda: jaxkv.make_plan(
        jaxkv.llama_like_config(
            num_layers=2, dtype="bfloat16", sliding_window=32, window_every=2
        ),
        num_blocks=16,
        storage="typed",
    ),
    "packed, strided kernel blocks": lambda: jaxkv.make_plan(
        jaxkv.tiny_hybrid_config(attention_backend="FLASHINFER", block_size=128),
        num_blocks=16,
        packed=True,
        maps_slot_mapping=True,
    ),
    "fp8 kv-first words": lambda: jaxkv.make_plan(
        jaxkv.llama_like_config(
            num_layers=2,
            dtype="bfloat16",
            cache_dtype="fp8",
            attention_backend="JAX_PAGED_KV_FIRST",
        ),
        num_blocks=16,
        storage="words",
    ),
}


def _random_pools(plan, seed):
    """Every byte of every pool random (NaN and inf patterns included)."""
    pools = []
    for i, p in enumerate(plan.allocate()):
        bits = jax.random.bits(
            jax.random.key(seed + i), p.shape, jnp.dtype(f"uint{p.dtype.itemsize * 8}")
        )
        pools.append(jax.lax.bitcast_convert_type(bits, p.dtype))
    return type(plan.allocate())(pools)


def _block_bytes(plan, pools, name, view, group, block):
    """The bytes of one block of one layer, read through the strides."""
    if isinstance(view, jaxkv.MambaView):
        return [s.view(np.uint8) for s in _oracle_state(pools, view, block)]
    bs = plan.block_sizes[group]
    k, v, _ = _oracle_kv(plan, pools, name, view, [block], bs, bs)
    return [k.view(np.uint8), v.view(np.uint8)]


@pytest.mark.parametrize("case", PLANS)
def test_blocks_round_trip_through_host_memory_byte_for_byte(case):
    plan = PLANS[case]()
    before = _random_pools(plan, seed=3)
    pools = jax.tree.map(jnp.copy, before)
    host = jaxkv.sched.HostKVCache(plan, num_blocks=8)
    groups = range(len(plan.block_sizes))
    for g in groups:
        host.record_offload(group=g, block=3 + g, key=(g, b"p"))
    pools = host.flush(pools)
    assert host.num_pending == 0
    for g in groups:
        entry = host._entries[(g, b"p")]
        for a in jax.tree.leaves(entry.arrays):
            assert a.sharding.memory_kind == "pinned_host"
    for g in groups:
        host.record_restore(key=(g, b"p"), block=10 + g)
    pools = host.flush(pools)
    group_of = _group_of(plan)
    for name, view in _owning(plan).items():
        g = group_of[name]
        got = _block_bytes(plan, pools, name, view, g, 10 + g)
        want = _block_bytes(plan, before, name, view, g, 3 + g)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{case}: {name}")
        # Nothing else written: the source and a neighbour keep their bytes.
        # (block ids are shared by the groups; the last one is where a
        # padding id -1 would land if it wrapped)
        for other in (3 + g, 14, plan.num_blocks - 1):
            for a, b in zip(
                _block_bytes(plan, pools, name, view, g, other),
                _block_bytes(plan, before, name, view, g, other),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} block {other}")
    assert (
        host.stats["offloaded_blocks"] == host.stats["restored_blocks"] == len(groups)
    )
    assert host.stats["bytes_to_host"] == host.stats["bytes_to_device"] == host.nbytes
    assert host.nbytes > 0


def test_copies_compile_once_at_warm_up_and_runs_share_a_program():
    plan = PLANS["hybrid f32, Mamba"]()
    host = jaxkv.sched.HostKVCache(plan, num_blocks=40)
    pools = plan.allocate()
    host.warm_up(jax.eval_shape(plan.allocate))
    ids = list(range(1, 15))
    keys = [(0, bytes([b])) for b in ids]
    with jaxkv.count_compilations() as compiles:
        for block, key in zip(ids, keys, strict=True):
            host.record_offload(group=0, block=block, key=key)
        pools = host.flush(pools)  # one run of 14: bucket 16
        for block, key in zip(ids[:5], keys[:5], strict=True):
            host.record_restore(key=key, block=block)
        pools = host.flush(pools)  # 5: bucket 16 again, padded
    assert compiles == []
    assert host.stats["offloaded_blocks"] == 14
    assert host.stats["restored_blocks"] == 5


def test_the_host_keeps_its_most_recent_blocks_and_refuses_what_it_cannot_do():
    plan = PLANS["hybrid f32, Mamba"]()
    host = jaxkv.sched.HostKVCache(plan, num_blocks=2)
    for b in (1, 2, 3):
        host.record_offload(group=0, block=b, key=b)
    host.touch(2)
    host.record_offload(group=0, block=9, key=2)  # held: no second copy
    assert host.num_pending == 3
    host.record_offload(group=0, block=4, key=4)
    assert sorted(k for k in (1, 2, 3, 4) if k in host) == [2, 4]
    assert host.stats["dropped_blocks"] == 2
    with pytest.raises(KeyError, match="no host block under 1"):
        host.record_restore(key=1, block=5)
    with pytest.raises(ValueError, match="block=0 is not a block id"):
        host.record_offload(group=0, block=0, key=9)
    with pytest.raises(ValueError, match="group=7 is not a KV-cache group"):
        host.record_offload(group=7, block=1, key=9)
    with pytest.raises(ValueError, match="memory_kind='hbm' is not a memory"):
        jaxkv.sched.HostKVCache(plan, num_blocks=2, memory_kind="hbm")
    with pytest.raises(ValueError, match="num_blocks"):
        jaxkv.sched.HostKVCache(plan, num_blocks=0)
    # Offloads never run are forgotten with the pools they would read.
    host.discard_pending()
    assert len(host) == 0
    assert host.num_pending == 0


def test_a_flush_on_deleted_pools_raises_and_keeps_its_copies():
    plan = PLANS["hybrid f32, Mamba"]()
    host = jaxkv.sched.HostKVCache(plan, num_blocks=4)
    pools = plan.allocate()
    host.record_offload(group=0, block=1, key="a")
    jax.tree.map(lambda p: p.delete(), pools)
    with pytest.raises(ValueError, match="deleted"):
        host.flush(pools)
    assert host.num_pending == 1
    host.flush(plan.allocate())
    assert host.num_pending == 0
    assert host.stats["offloaded_blocks"] == 1


def test_the_manager_offloads_what_it_evicts_and_restores_hits_from_the_host():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=10)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True, host_blocks=16)
    assert m.host is not None
    a = jaxkv.Request("a", prompt=list(range(70)), max_new_tokens=1)
    for n in (64, 6):  # chunks end where blocks end (the Scheduler's align mode)
        assert m.allocate(a, n)
        a.num_computed += n
        m.commit(a)
    m.free(a)
    cached = m.allocator.num_cached
    assert cached > 0
    assert m.host.num_pending == 0
    b = jaxkv.Request("b", prompt=[99] * 128, max_new_tokens=1)
    assert m.allocate(b, 128)  # takes every block: a's prefix is evicted
    assert m.allocator.num_free == 0
    assert m.allocator.lookup((0, m._block_hashes(a, 32)[0])) is None
    assert m.host.num_pending == len(m.host) == cached
    m.free(b)
    again = jaxkv.Request("a2", prompt=list(range(70)), max_new_tokens=1)
    hit = m.find_cache_hit(again)
    assert hit == 64  # from the host alone (the Mamba state at 64 too)
    pending = m.host.num_pending
    assert m.allocate(again, 70 - hit, num_cached=hit)
    restores = [mv for mv in m.host._pending[pending:] if mv.kind == "restore"]
    assert restores
    assert again.num_computed == hit
    for mv in restores:  # each restored block is cached under its key again
        assert m.allocator.key_of(mv.block) is not None
    with pytest.raises(ValueError, match="host_blocks needs enable_prefix_caching"):
        jaxkv.KVCacheManager(plan, host_blocks=4)
    with pytest.raises(ValueError, match="host_blocks must be an int >= 0"):
        jaxkv.KVCacheManager(plan, enable_prefix_caching=True, host_blocks=-1)


def test_a_prefix_another_device_block_still_holds_is_not_copied_out():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=10)
    m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True, host_blocks=16)
    assert m.host is not None
    a = jaxkv.Request("a", prompt=list(range(70)), max_new_tokens=1)
    for n in (64, 6):
        assert m.allocate(a, n)
        a.num_computed += n
        m.commit(a)
    m.free(a)
    cached = m.allocator.num_cached
    key = (0, m._block_hashes(a, 32)[0])
    (copy,) = m.allocator.allocate(1)  # a second device copy of one prefix block
    m.allocator.cache(copy, key=key)
    m.allocator.free([copy])  # freed last: evicted last
    m.allocator.allocate(m.allocator.num_free - 1)  # evicts all of a's blocks
    m._take_evicted()
    assert m.allocator.lookup(key) == copy
    assert key not in m.host
    assert m.host.num_pending == len(m.host) == cached - 1


def _prefix_rounds(num_prefixes=4, prefix=32, seed=7):
    """Each of `num_prefixes` shared prefixes served twice, one request at a
    time (the second round after the others pushed it off the device)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, prefix).tolist() for _ in range(num_prefixes)]
    out = []
    for rnd in range(2):
        for i, p in enumerate(prefixes):
            tail = rng.integers(0, VOCAB, 5).tolist()
            out.append(jaxkv.Request(f"p{i}r{rnd}", prompt=p + tail, max_new_tokens=4))
    return out


def _serve_rounds(loop, **reset):
    reset_loop(loop, **reset)
    outputs = {}
    for req in _prefix_rounds():
        (done,) = loop.run([req])
        outputs[done.req_id] = done.output
    return outputs, dict(loop.scheduler.stats)


@pytest.mark.parametrize("model", ["sliding+global", "recurrent+local"])
def test_prefixes_that_fit_the_host_not_the_device_are_restored_not_recomputed(
    model,
):
    if model == "sliding+global":
        plan, forward, windows = _model()
        params = _params(len(windows))
    else:
        plan, forward, params, _ = _griffin()
    loop = jaxkv.ServingLoop(plan, forward, params, vocab_size=VOCAB)
    want, plain = _serve_rounds(loop)
    small = {"enable_prefix_caching": True, "num_blocks": 14}
    device_only, dev = _serve_rounds(loop, **small)
    reset_loop(loop, **small, host_blocks=64)
    loop.warm_up()
    with jaxkv.count_compilations() as compiles:
        offloaded, off = _serve_rounds(loop, **small, host_blocks=64)
    assert compiles == []  # the copies were compiled by warm_up
    assert offloaded == device_only == want
    host = loop.host
    assert host is not None
    assert host.stats["restored_blocks"] > 0
    assert off["prefill_tokens"] < dev["prefill_tokens"] <= plain["prefill_tokens"]
    assert off["cached_tokens"] > dev["cached_tokens"]


def test_the_loop_refuses_host_blocks_it_cannot_serve():
    plan, forward, windows = _model()
    params = _params(len(windows))
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        jaxkv.ServingLoop(
            plan, forward, params, scheduling=jaxkv.SchedulingOptions(host_blocks=8)
        )
    with pytest.raises(TypeError, match="host_blocks must be an int"):
        jaxkv.ServingLoop(
            plan,
            forward,
            params,
            scheduling=jaxkv.SchedulingOptions(
                enable_prefix_caching=True,
                host_blocks=2.0,  # pyright: ignore[reportArgumentType]
            ),
        )
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    sp = jaxkv.shard_plan(plan.runner_config, mesh=mesh, num_blocks=16)
    with pytest.raises(ValueError, match="plan must be sharded.local"):
        jaxkv.sched.HostKVCache(plan, num_blocks=4, sharded=sp)
    with pytest.raises(ValueError, match="rank=1 is outside the mesh's 1"):
        jaxkv.sched.HostKVCache(sp.local, num_blocks=4, sharded=sp, rank=1)
    with pytest.raises(ValueError, match="give host_blocks or host, not both"):
        jaxkv.KVCacheManager(
            sp.local,
            enable_prefix_caching=True,
            host_blocks=4,
            host=jaxkv.sched.HostKVCache(sp.local, num_blocks=4, sharded=sp),
        )


@pytest.mark.parametrize(
    ("host_blocks", "decode_steps"),
    # The smallest tier in both decode modes in the fast pass; more blocks slow.
    [
        (1, 1),
        (1, 4),
        pytest.param(2, 4, marks=pytest.mark.slow),
        pytest.param(16, 4, marks=pytest.mark.slow),
    ],
)
def test_a_tiny_host_tier_serves_what_a_loop_without_one_serves(
    host_blocks, decode_steps
):
    # A host tier smaller than what one allocation offloads: the blocks a hit
    # restores are claimed before the allocation's evictions can drop them
    # (before: KeyError in record_restore). With multi-step decoding the
    # offloads recorded while decoding run before the block is overwritten.
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_size=8,
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
        block_size=4,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=8)
    layer = plan.attention_layer("layers.0.self_attn")

    def forward(params, pools, meta, tokens, sample):
        x = params[tokens]
        m = meta[layer.name]
        k = v = x[:, None, :]
        pools = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
        q = jnp.repeat(x[:, None, :], 2, axis=1)
        out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
        return pools, out[sample, 0] @ params.T

    params = jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)), jnp.float32)
    ref = jaxkv.ServingLoop(plan, forward, params, vocab_size=8)
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=8,
        scheduling=jaxkv.SchedulingOptions(
            enable_prefix_caching=True, host_blocks=host_blocks
        ),
        execution=jaxkv.ExecutionOptions(decode_steps=decode_steps),
    )
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 8, 12).tolist() for _ in range(3)]
    for rnd in range(6):
        prompts = [prefixes[(i + rnd) % 3] + [i] for i in range(3)]
        got = loop.run(
            [
                jaxkv.Request(f"r{rnd}{i}", prompt=p, max_new_tokens=10)
                for i, p in enumerate(prompts)
            ]
        )
        want = ref.run(
            [
                jaxkv.Request(f"r{rnd}{i}", prompt=p, max_new_tokens=10)
                for i, p in enumerate(prompts)
            ]
        )
        assert [r.output for r in got] == [r.output for r in want], rnd
    assert loop.host is not None
    assert loop.host.stats["restored_blocks"] > 0
    assert loop.host.stats["dropped_blocks"] > 0


def test_touch_keeps_a_block_over_an_untouched_older_one():
    plan = PLANS["hybrid f32, Mamba"]()
    host = jaxkv.sched.HostKVCache(plan, num_blocks=2)
    host.record_offload(group=0, block=1, key="old")
    host.record_offload(group=0, block=2, key="new")
    host.touch("old")  # now the most recently used
    host.record_offload(group=0, block=3, key="third")  # drops the LRU: "new"
    assert "old" in host
    assert "new" not in host
    assert "third" in host


def test_reset_prefix_cache_forgets_offloads_that_never_ran():
    plan = PLANS["hybrid f32, Mamba"]()
    manager = jaxkv.KVCacheManager(plan, enable_prefix_caching=True, host_blocks=4)
    host = manager.host
    assert host is not None
    host.record_offload(group=0, block=1, key="gone")
    assert host.num_pending == 1
    assert manager.reset_prefix_cache()
    # The pools' contents are gone: the copy must not run, nor its key stay.
    assert host.num_pending == 0
    assert "gone" not in host


def test_a_step_applied_before_its_host_copies_ran_is_refused():
    # The tier copies a block's bytes when flush(pools) runs, so a step that
    # ran before it would have its own K/V offloaded under the old prefix's
    # key: applying such a step raises, and flushing first applies it.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=14)
    s = jaxkv.Scheduler(plan, enable_prefix_caching=True, host_blocks=16)
    host = s.manager.host
    assert host is not None
    pools = plan.allocate()
    s.add_request(jaxkv.Request("a", prompt=list(range(70)), max_new_tokens=1))
    while s.has_unfinished:
        step = s.schedule()
        pools = host.flush(pools)
        s.update(step, [1] * len(step.sampled))
    step = None
    for i in range(8):  # new prompts until one evicts a cached prefix
        s.add_request(jaxkv.Request(f"b{i}", prompt=[90 + i] * 64, max_new_tokens=1))
        step = s.schedule()
        if host.num_pending:
            break
        pools = host.flush(pools)
        s.update(step, [1] * len(step.sampled))
    assert step is not None
    assert host.num_pending > 0
    before = (host.num_pending, [r.num_computed for r, _ in step.batch])
    with pytest.raises(RuntimeError, match="ran before manager.host.flush"):
        s.update(step, [1] * len(step.sampled))
    assert (host.num_pending, [r.num_computed for r, _ in step.batch]) == before
    pools = host.flush(pools)
    s.update(step, [1] * len(step.sampled))
