"""ServingLoop on meshes of 8 simulated CPU devices serves what one device
serves: a tensor-parallel GQA model (its own psum) with data-parallel ranks
prepared by the loop, nothing per-rank in this script.

Requests also move between meshes: prefilled on 1x4, decoded on 2x2
(:func:`check_moved`).

Run by ``tests/test_shard.py`` in its own process:
``python tests/serve_mesh_check.py 2x4 4x2-auto`` prints OK.
"""  # noqa: D205

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxkv

VOCAB, D, H, KV, HD = 64, 64, 8, 4, 16
CFG = jaxkv.pattern_config(
    "GL",
    num_layers=2,
    num_heads=H,
    num_kv_heads=KV,
    head_size=HD,
    block_size=8,
    sliding_window=12,
    max_model_len=96,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(4, 32),
)


def params():
    keys = iter(jax.random.split(jax.random.key(0), 10))

    def n(*shape, s=0.25):
        return jax.random.normal(next(keys), shape, jnp.float32) * s

    return {
        "embed": n(VOCAB, D, s=1.0),
        "layers": [
            {
                "wq": n(D, H, HD),
                "wk": n(D, KV, HD),
                "wv": n(D, KV, HD),
                "wo": n(H, HD, D),
            }
            for _ in range(2)
        ],
        "unembed": n(D, VOCAB),
    }


SPECS = {
    "embed": P(),
    "layers": [
        {
            "wq": P(None, "tensor", None),
            "wk": P(None, "tensor", None),
            "wv": P(None, "tensor", None),
            "wo": P("tensor", None, None),
        }
    ]
    * 2,
    "unembed": P(),
}


def make_forward(plan, tensor_axis):
    """The model's step on its (local) heads; a psum joins the heads' outputs."""
    layers = [plan.attention_layer(layer.name) for layer in CFG.layers]

    def forward(params, pools, meta, tokens, sample):
        x = params["embed"][tokens]
        for layer, w in zip(layers, params["layers"], strict=True):
            q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in ("wq", "wk", "wv"))
            m = meta[layer.name]
            pools = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
            out = jaxkv.paged_attention(q, pools, layer, m, scale=HD**-0.5)
            y = jnp.einsum("thk,hkd->td", out, w["wo"])
            x = x + (y if tensor_axis is None else jax.lax.psum(y, tensor_axis))
        return pools, x[sample] @ params["unembed"]

    return forward


def requests(tag=""):
    rng = np.random.default_rng(1)
    shared = rng.integers(0, VOCAB, 16).tolist()
    return [
        jaxkv.Request(
            f"{tag}r{i}",
            prompt=shared + rng.integers(0, VOCAB, int(rng.integers(2, 20))).tolist(),
            max_new_tokens=int(rng.integers(3, 9)),
            stop_token_ids=(5,),
        )
        for i in range(7)
    ]


HOT = jaxkv.SamplingParams(temperature=30.0, top_k=16, seed=3)  # logits are ~50


def reference(sampling=None):
    plan = jaxkv.make_plan(CFG, num_blocks=64)
    loop = jaxkv.ServingLoop(
        plan,
        make_forward(plan, None),
        params(),
        vocab_size=VOCAB,
        sampling=sampling,
        execution=jaxkv.ExecutionOptions(record_logits=True),
    )
    reqs = loop.run(requests())
    return {r.req_id: r.output for r in reqs}, dict(loop.logits)


def _mesh_loop(arg, *, sampling=None, **execution):
    """A loop of the model on a ``DxT`` mesh (Explicit axes)."""
    d, t = (int(x) for x in arg.split("x"))
    mesh = jax.make_mesh((d, t), ("data", "tensor"))
    sp = jaxkv.shard_plan(CFG, mesh=mesh, num_blocks=64)
    return jaxkv.ServingLoop(
        sp,
        make_forward(sp.local, "tensor"),
        params(),
        vocab_size=VOCAB,
        sampling=sampling,
        execution=jaxkv.ExecutionOptions(param_specs=SPECS, **execution),
    )


def check_sampled(arg, want):
    """Seeded sampling on a mesh draws what one device draws (seeds per rank)."""
    loop = _mesh_loop(arg, sampling=HOT)
    got = {r.req_id: r.output for r in loop.run(requests())}
    assert got == want, (arg, got, want)
    # The same draws with the parameters given per request (per-row arrays
    # sharded over the data ranks).
    mixed = _mesh_loop(arg, per_request_sampling=True)
    reqs = requests()
    mixed.run(reqs, sampling={r.req_id: HOT for r in reqs})
    assert {r.req_id: r.output for r in reqs} == want, arg


def check_drafts(arg, want, sampling=None):
    """Speculative decoding on a mesh (n-gram drafts verified in each rank's
    step) serves the tokens one device serves without drafts.
    """  # noqa: D205
    loop = _mesh_loop(arg, sampling=sampling, drafter=jaxkv.serve.NgramDrafter())
    got = {r.req_id: r.output for r in loop.run(requests())}
    assert got == want, (arg, got, want)
    drafts = [s.make_stats().spec_decoding_stats for s in loop.schedulers]
    assert sum(x.num_drafts for x in drafts) > 0, (arg, drafts)
    print(arg, "drafts:", [(x.num_draft_tokens, x.num_accepted_tokens) for x in drafts])


def check(arg, want, want_logits):
    """`arg`: ``DxT`` (Explicit axes, make_mesh's default) or ``DxT-auto``."""
    dims, _, kind = arg.partition("-")
    d, t = shape = tuple(int(x) for x in dims.split("x"))
    types = (
        jax.sharding.AxisType.Auto
        if kind == "auto"
        else jax.sharding.AxisType.Explicit,
    ) * 2
    mesh = jax.make_mesh((d, t), ("data", "tensor"), axis_types=types)
    sp = jaxkv.shard_plan(CFG, mesh=mesh, num_blocks=64)
    loop = jaxkv.ServingLoop(
        sp,
        make_forward(sp.local, "tensor"),
        params(),
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(param_specs=SPECS, record_logits=True),
    )
    loop.warm_up()
    for overlap in (True, False):
        resets: list[tuple[int | None, jaxkv.SchedulingOptions]] = [
            (None, jaxkv.SchedulingOptions()),
            # First-chunk admission, so the small pool preempts.
            (13, jaxkv.SchedulingOptions(scheduler_reserve_full_isl=False)),
            (None, jaxkv.SchedulingOptions(enable_prefix_caching=True)),
        ]
        for num_blocks, scheduling in resets:
            loop.set_overlap(overlap)
            loop.reset(scheduling=scheduling, num_blocks=num_blocks)
            with jaxkv.count_compilations() as compiles:
                reqs = loop.run(requests())
            assert all(r.status is jaxkv.RequestStatus.FINISHED for r in reqs)
            got = {r.req_id: r.output for r in reqs}
            assert got == want, (shape, overlap, num_blocks, got, want)
            for rid, logits in want_logits.items():
                np.testing.assert_allclose(
                    np.stack(loop.logits[rid]), np.stack(logits), rtol=1e-4, atol=2e-3
                )
            assert compiles == [], (shape, compiles)
            served = [s.stats["steps"] for s in loop.schedulers]
            busy = sum(n > 0 for n in served)  # requests go to the least loaded
            assert busy == min(d, len(want)), ("ranks left idle", served)
            for s in loop.schedulers:
                assert s.manager.num_free_blocks == s.manager.num_usable_blocks
            if num_blocks is not None and d <= 2:  # several requests per rank
                assert sum(s.stats["preemptions"] for s in loop.schedulers) > 0
            if scheduling.enable_prefix_caching and d <= 4:
                assert sum(s.stats["cached_tokens"] for s in loop.schedulers) > 0
    # The step moves no pool between devices: the only collectives are the
    # model's own all-reduces.
    for exe in loop.programs.executables():
        hlo = exe.as_text()
        for op in ("all-gather", "all-to-all", "collective-permute"):
            assert op not in hlo, (shape, op)
    print(arg, "served", len(want), "requests on", d, "data ranks")


def check_moved(src=(1, 4), dst=(2, 2)):
    """Prefill on a `src` (data x tensor) mesh (devices 0-3, Explicit axes),
    decode on a `dst` mesh (devices 4-7, Auto axes): each request's KV cache
    moves with ``export_request`` -> ``adopt`` (heads re-split from one
    tensor-parallel degree to the other, read from and written to the rank
    that holds the request); tokens and logits equal one device's, never
    moved.
    """  # noqa: D205
    fresh = [
        (r.req_id, r.prompt, r.max_new_tokens) for r in requests("m")
    ]  # no stop tokens: every request has tokens left to decode
    plan = jaxkv.make_plan(CFG, num_blocks=64)
    ref = jaxkv.ServingLoop(
        plan,
        make_forward(plan, None),
        params(),
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(record_logits=True),
    )
    want = {
        r.req_id: r.output
        for r in ref.run(
            [jaxkv.Request(i, prompt=p, max_new_tokens=n) for i, p, n in fresh]
        )
    }
    devices = np.array(jax.devices())
    explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto

    def loop_on(shape, devs, kind):
        mesh = jax.make_mesh(
            shape, ("data", "tensor"), axis_types=(kind,) * 2, devices=devs
        )
        sp = jaxkv.shard_plan(CFG, mesh=mesh, num_blocks=64)
        return jaxkv.ServingLoop(
            sp,
            make_forward(sp.local, "tensor"),
            params(),
            vocab_size=VOCAB,
            execution=jaxkv.ExecutionOptions(
                param_specs=SPECS, record_logits=True, overlap=False
            ),
        )

    prefill = loop_on(src, devices[:4], explicit)
    decode = loop_on(dst, devices[4:], auto)
    reqs = [jaxkv.Request(i, prompt=p, max_new_tokens=n) for i, p, n in fresh]
    for r in reqs:
        assert prefill.submit(r)
    moved: dict[str, tuple[list[int], jaxkv.Request]] = {}
    while reqs:
        prefill.step()
        for r in [r for r in reqs if r.output]:
            reqs.remove(r)
            kv = prefill.export_request(r)
            assert kv.num_tokens == len(r.prompt) + len(r.output) - 1
            rank = next(s for s in prefill.schedulers if r in s.running)
            rank.finish(r)  # it continues elsewhere
            first = list(r.output)
            cont = jaxkv.Request(
                r.req_id,
                prompt=r.prompt + first,
                max_new_tokens=r.max_new_tokens - len(first),
            )
            assert decode.adopt(cont, kv)
            moved[r.req_id] = (first, cont)
    while decode.has_unfinished:
        decode.step()
    assert len(moved) == len(fresh)
    steps = [s.stats["steps"] for s in decode.schedulers]
    assert all(n > 0 for n in steps), ("a data rank left idle", steps)
    for rid, (first, cont) in moved.items():
        assert first + cont.output == want[rid], (rid, first, cont.output, want[rid])
        np.testing.assert_allclose(
            np.stack(decode.logits[rid]),
            np.stack(ref.logits[rid][len(first) :]),
            rtol=1e-4,
            atol=2e-3,
        )
    busy = [s.stats["steps"] for s in prefill.schedulers]
    assert all(n > 0 for n in busy), ("a prefill rank left idle", busy)
    print("moved", len(moved), "requests from a", src, "prefill mesh to", dst)


def check_host_tier(arg="2x4"):
    """Each data rank keeps its evicted prefix blocks in its own host tier
    (its shards only) and restores them on a hit: fewer prompt tokens than
    the device cache alone, the tokens of one device, 0 compilations.
    """  # noqa: D205
    d, t = (int(x) for x in arg.split("x"))
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(0, VOCAB, 24).tolist() for _ in range(2 * d * 2)]
    rounds = []
    for rnd in range(2):
        for k in range(0, len(prefixes), d):  # one request per rank at a time
            rounds.append(
                [
                    (f"h{j}.{rnd}", p + rng.integers(0, VOCAB, 4).tolist())
                    for j, p in enumerate(prefixes[k : k + d], start=k)
                ]
            )
    plan = jaxkv.make_plan(CFG, num_blocks=64)
    ref = jaxkv.ServingLoop(plan, make_forward(plan, None), params(), vocab_size=VOCAB)
    want = {}
    for batch in rounds:
        reqs = [jaxkv.Request(i, prompt=p, max_new_tokens=4) for i, p in batch]
        want.update({r.req_id: r.output for r in ref.run(reqs)})
    mesh = jax.make_mesh((d, t), ("data", "tensor"))
    sp = jaxkv.shard_plan(CFG, mesh=mesh, num_blocks=64)
    loop = jaxkv.ServingLoop(
        sp,
        make_forward(sp.local, "tensor"),
        params(),
        vocab_size=VOCAB,
        scheduling=jaxkv.SchedulingOptions(enable_prefix_caching=True, host_blocks=64),
        execution=jaxkv.ExecutionOptions(param_specs=SPECS),
    )
    loop.warm_up()
    stats = {}
    for host_blocks in (0, 64):
        loop.reset(
            scheduling=jaxkv.SchedulingOptions(
                enable_prefix_caching=True, host_blocks=host_blocks
            ),
            num_blocks=12,
        )
        got = {}
        with jaxkv.count_compilations() as compiles:
            for batch in rounds:
                reqs = [jaxkv.Request(i, prompt=p, max_new_tokens=4) for i, p in batch]
                got.update({r.req_id: r.output for r in loop.run(reqs)})
        assert got == want, (host_blocks, got, want)
        assert compiles == [], compiles
        stats[host_blocks] = sum(s.stats["prefill_tokens"] for s in loop.schedulers)
        if host_blocks:
            for rank, sched in enumerate(loop.schedulers):
                host = sched.manager.host
                assert host is not None
                assert host.rank == rank
                assert host.stats["restored_blocks"] > 0, (rank, host.stats)
                # Only this rank's shards are kept: one tensor rank's heads each.
                entry = next(e for e in host._entries.values() if e.arrays)
                assert all(len(leaf) == t for leaf in entry.arrays)
    assert stats[64] < stats[0], stats
    # The copies move no pool between devices: no collective at all.
    host = loop.schedulers[0].manager.host
    assert host is not None
    for exe in host._programs.values():
        hlo = exe.as_text()
        for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
            assert op not in hlo, (arg, op)
    print(arg, "host tier: prompt tokens", stats[64], "vs", stats[0], "device only")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    check_host_tier("2x4")
    check_host_tier("4x2")
    check_moved((1, 4), (2, 2))
    check_moved((2, 2), (1, 4))
    want, want_logits = reference()
    for arg in sys.argv[1:] or ["2x4"]:
        check(arg, want, want_logits)
    hot, _ = reference(HOT)
    assert hot != want  # the draws are not greedy
    check_sampled("2x4", hot)
    check_drafts("2x4", hot, HOT)  # sampled: greedy drafts run on one device
    print("OK")
