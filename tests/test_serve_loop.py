"""The library's serving loop on a plain-JAX Gemma-3-like model (sliding-window
and global layers, GQA, QK-norm, rotary positions): tokens and logits equal a
dense model without a cache; batched, preempted and prefix-cached runs give
the same results; sampling is seeded per request and position; tokens stream;
nothing compiles after warm-up; a fault resumes.
"""  # noqa: D205

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxkv
from tests.helpers import reset_loop

VOCAB, D, H, KV, HD, WINDOW = 64, 32, 4, 2, 16, 8
SHAPE: dict[str, Any] = dict(
    num_heads=H,
    num_kv_heads=KV,
    head_size=HD,
    block_size=8,
    sliding_window=WINDOW,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(8, 32),
)


def _rms(x, scale=None):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return y if scale is None else y * (1 + scale)[None, None, :]


def _rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = pos[:, None].astype(jnp.float32) * freq[None]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _params(num_layers, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 8 * num_layers + 2))

    def n(*shape, s=0.3):
        return jax.random.normal(next(keys), shape, jnp.float32) * s

    return {
        "embed": n(VOCAB, D, s=1.0),
        "layers": [
            {
                "wq": n(D, H, HD),
                "wk": n(D, KV, HD),
                "wv": n(D, KV, HD),
                "wo": n(H * HD, D),
                "q_norm": n(HD, s=0.1),
                "k_norm": n(HD, s=0.1),
            }
            for _ in range(num_layers)
        ],
        "unembed": n(D, VOCAB),
    }


def _qkv(w, x, pos):
    h = _rms(x)
    q = _rope(_rms(jnp.einsum("td,dhk->thk", h, w["wq"]), w["q_norm"]), pos)
    k = _rope(_rms(jnp.einsum("td,dhk->thk", h, w["wk"]), w["k_norm"]), pos)
    v = jnp.einsum("td,dhk->thk", h, w["wv"])
    return q, k, v


def _model(pattern="LG", num_layers=2):
    cfg = jaxkv.pattern_config(pattern, num_layers=num_layers, **SHAPE)
    plan = jaxkv.make_plan(cfg, num_blocks=64)
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]
    windows = [layer.sliding_window for layer in layers]

    def forward(params, pools, meta, tokens, sample):
        x = params["embed"][tokens]
        for layer, w in zip(layers, params["layers"], strict=True):
            m = meta[layer.name]
            q, k, v = _qkv(w, x, m.positions)
            pools = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
            out = jaxkv.paged_attention(q, pools, layer, m, scale=HD**-0.5)
            x = x + out.reshape(x.shape[0], -1) @ w["wo"]
        return pools, _rms(x[sample]) @ params["unembed"]

    return plan, forward, windows


def _np_rms(x, scale=None):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return y if scale is None else y * (1 + scale)


def _np_rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (np.arange(half) / half))
    ang = pos[:, None] * freq[None]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _np_attention(w, x, window):
    """One attention layer's residual update over a whole sequence (NumPy)."""
    pos = np.arange(x.shape[0])
    i, j = pos[:, None], pos[None]
    h = _np_rms(x)
    q = _np_rope(_np_rms(np.einsum("td,dhk->thk", h, w["wq"]), w["q_norm"]), pos)
    k = _np_rope(_np_rms(np.einsum("td,dhk->thk", h, w["wk"]), w["k_norm"]), pos)
    v = np.einsum("td,dhk->thk", h, w["wv"])
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * HD**-0.5
    mask = (j <= i) & ((j > i - window) if window else True)
    s = np.where(mask[None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    a = e / e.sum(-1, keepdims=True)
    return x + np.einsum("hqk,khd->qhd", a, v).reshape(x.shape[0], -1) @ w["wo"]


def _as_f64(params):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def _dense_logits(params, windows, tokens):
    """The last token's logits, recomputed over the whole sequence without a
    cache, in NumPy float64 (an oracle independent of the JAX model code).
    """  # noqa: D205
    p = _as_f64(params)
    x = p["embed"][np.asarray(tokens)]
    for w, window in zip(p["layers"], windows, strict=True):
        x = _np_attention(w, x, window)
    return (_np_rms(x[-1:]) @ p["unembed"])[0]


def _requests(shared=0, n=4, seed=0, new=6):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, shared).tolist()
    return [
        jaxkv.Request(
            f"r{i}",
            prompt=prefix + rng.integers(0, VOCAB, int(rng.integers(3, 26))).tolist(),
            max_new_tokens=new,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def served():
    plan, forward, windows = _model()
    params = _params(len(windows))
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(record_logits=True),
    )
    warm = loop.warm_up()
    with jaxkv.count_compilations() as compiles:
        requests = loop.run(_requests())
    return {
        "loop": loop,
        "params": params,
        "windows": windows,
        "requests": requests,
        "logits": dict(loop.logits),
        "compiles": len(compiles),
        "warm": warm,
    }


def test_tokens_and_logits_equal_the_dense_model(served):
    params, windows = served["params"], served["windows"]
    for req in served["requests"]:
        tokens = list(req.prompt)
        for k, token in enumerate(req.output):
            want = _dense_logits(params, windows, tokens)
            got = served["logits"][req.req_id][k]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            assert token == int(np.argmax(want)), (req.req_id, k)
            tokens.append(token)
        assert len(req.output) == req.max_new_tokens
    assert served["compiles"] == 0  # warmed up: nothing compiles while serving


def test_single_preempted_and_prefix_cached_runs_equal_the_batch(served):
    loop = served["loop"]
    want = {
        r.req_id: (r.output, served["logits"][r.req_id]) for r in served["requests"]
    }

    def check(requests, tol):
        for r in requests:
            assert r.output == want[r.req_id][0], r.req_id
            np.testing.assert_allclose(
                np.stack(loop.logits[r.req_id]),
                np.stack(want[r.req_id][1]),
                rtol=tol,
                atol=tol,
            )

    for r in _requests():  # one at a time: batch of one
        reset_loop(loop)
        loop.run([r])
        check([r], 1e-5)
    reset_loop(loop, num_blocks=9)  # 8 usable blocks of 8 tokens: preemption
    squeezed = loop.run(_requests())
    assert loop.scheduler.stats["preemptions"] > 0
    check(squeezed, 1e-5)
    reset_loop(loop, enable_prefix_caching=True)
    shared = _requests(shared=24, seed=1)
    base = {r.req_id: r.output for r in loop.run(_requests(shared=24, seed=1))}
    assert loop.scheduler.stats["cached_tokens"] > 0
    assert {r.req_id: r.output for r in shared} != {}  # not served yet
    reset_loop(loop)
    plain = {r.req_id: r.output for r in loop.run(shared)}
    assert plain == base
    assert (
        loop.scheduler.manager.num_free_blocks
        == loop.scheduler.manager.num_usable_blocks
    )


def test_sampling_is_seeded_per_request_and_position(served):
    plan, forward, windows = _model()
    params = served["params"]
    hot = jaxkv.SamplingParams(temperature=1.5, top_k=8, top_p=0.9, seed=3)

    loops: dict[jaxkv.SamplingParams, jaxkv.ServingLoop] = {}

    def serve(sampling, one_by_one=False):
        if sampling not in loops:
            loops[sampling] = jaxkv.ServingLoop(
                plan, forward, params, sampling=sampling
            )
        loop = loops[sampling]
        reset_loop(loop)
        reqs = _requests(new=5)
        if one_by_one:
            for r in reqs:
                loop.run([r])
        else:
            loop.run(reqs)
        return [r.output for r in reqs]

    batched = serve(hot)
    assert batched == serve(hot, one_by_one=True)  # batch-invariant draws
    assert batched != serve(jaxkv.SamplingParams(temperature=1.5, top_k=8, seed=4))
    greedy = [r.output for r in served["requests"]]
    top1 = serve(jaxkv.SamplingParams(temperature=1.0, top_k=1))
    assert [o[:5] for o in greedy] == top1


def test_tokens_stream_as_they_are_sampled(served):
    loop = served["loop"]
    reset_loop(loop)
    seen: dict[str, list[int]] = {}
    requests = loop.run(
        _requests(), on_token=lambda r, t: seen.setdefault(r.req_id, []).append(t)
    )
    assert seen == {r.req_id: r.output for r in requests}


@pytest.mark.parametrize("overlap", [False, True])
def test_without_overlap_a_step_is_resolved_before_step_returns(served, overlap):
    # One pipeline for both modes: drained after each dispatch without
    # overlap (step() returns what that step finished), one step in flight
    # with it (what a step finished comes back from the next call).
    loop = served["loop"]
    loop.set_overlap(overlap)
    reset_loop(loop)
    try:
        for req in _requests():
            loop.submit(req)
        finished = []
        while loop.has_unfinished:
            done = loop.step()
            finished += done
            assert len(loop.pipeline) == (1 if overlap and loop.has_unfinished else 0)
            if not overlap:
                assert loop.scheduler.unresolved == ()
                assert all(r.status.value == "finished" for r in done)
                assert all(
                    min(r.output, default=0) >= 0 for r in loop.scheduler.running
                )
    finally:
        loop.set_overlap(True)
    want = {r.req_id: r.output for r in served["requests"]}
    assert {r.req_id: r.output for r in finished} == want


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fault_after_the_device_step_resumes_to_the_same_tokens(served, overlap):
    loop = served["loop"]
    loop.set_overlap(overlap)
    reset_loop(loop)
    # With overlap or without, resolve() fills a step's tokens.
    method = "resolve"
    real, calls = getattr(loop.scheduler, method), [0]

    def apply(step, tokens):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(step, tokens)

    setattr(loop.scheduler, method, apply)
    requests = _requests()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run(requests)
        setattr(loop.scheduler, method, real)
        assert loop.resume() == "applied"
        loop.run()
    finally:
        loop.set_overlap(True)
    assert [r.output for r in requests] == [r.output for r in served["requests"]]


@pytest.mark.parametrize("where", ["trace", "pools"])
def test_overlap_resumes_a_step_that_failed_to_run(served, where):
    """A step whose dispatch raised is rerun ("rerun", pools untouched) or,
    when its donated pools were consumed, everything in flight is recomputed;
    the tokens are those of an undisturbed run.
    """  # noqa: D205
    loop = served["loop"]
    reset_loop(loop)
    real, calls = loop.runner.dispatch, [0]

    def dispatch(scheduled, prev, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            if where == "pools":
                jax.tree.map(lambda a: a.delete(), loop.pools)
            raise RuntimeError("injected")
        return real(scheduled, prev, **kwargs)

    loop.runner.dispatch = dispatch
    requests = _requests()
    try:
        with pytest.raises(RuntimeError, match="injected"):
            loop.run(requests)
        assert loop.resume() == ("rerun" if where == "trace" else "recomputed")
        loop.run()
    finally:
        loop.runner.dispatch = real
    assert [r.output for r in requests] == [r.output for r in served["requests"]]
    assert loop.scheduler.manager.num_free_blocks == (
        loop.scheduler.manager.num_usable_blocks
    )


def test_overlap_equals_no_overlap_with_stop_tokens_preemption_and_prefixes(served):
    """Stop tokens found a step late (the extra step dropped), preemption and
    prefix caching give the outputs, logits and streams of the loop without
    overlap; every block comes back.
    """  # noqa: D205
    loop = served["loop"]
    stops = tuple({r.output[2] for r in served["requests"]})  # hit mid-run

    def serve(overlap, **reset):
        loop.set_overlap(overlap)
        reset_loop(loop, **reset)
        reqs = _requests(shared=16, seed=3, new=9)
        for r in reqs:
            r.stop_token_ids = stops
        seen: dict[str, list[int]] = {}
        loop.run(reqs, on_token=lambda r, t: seen.setdefault(r.req_id, []).append(t))
        m = loop.scheduler.manager
        assert m.num_free_blocks == m.num_usable_blocks, (overlap, reset)
        assert all(r.num_pending == 0 for r in reqs)
        assert seen == {r.req_id: r.output for r in reqs}
        assert all(r.status is jaxkv.RequestStatus.FINISHED for r in reqs)
        if "num_blocks" in reset:
            assert loop.scheduler.stats["preemptions"] > 0
        return [r.output for r in reqs], {k: list(v) for k, v in loop.logits.items()}

    try:
        for reset in (
            {},
            # First-chunk admission: a small pool preempts.
            {"num_blocks": 14, "scheduler_reserve_full_isl": False},
            {"enable_prefix_caching": True},
        ):
            (sync, sync_logits), (ahead, ahead_logits) = (
                serve(False, **reset),
                serve(True, **reset),
            )
            assert ahead == sync, reset
            assert any(o[-1] in stops and len(o) < 9 for o in sync)  # stops hit
            for k in sync_logits:
                np.testing.assert_allclose(
                    np.stack(ahead_logits[k]), np.stack(sync_logits[k]), atol=1e-5
                )
    finally:
        loop.set_overlap(True)
        reset_loop(loop, scheduler_reserve_full_isl=True)


def test_a_loop_reports_kv_cache_events_and_serves_by_priority():
    plan, forward, windows = _model()
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        _params(len(windows)),
        vocab_size=VOCAB,
        scheduling=jaxkv.SchedulingOptions(
            enable_prefix_caching=True,
            enable_kv_cache_events=True,
            policy="priority",
            max_num_seqs=1,
        ),
        execution=jaxkv.ExecutionOptions(overlap=False),
    )
    reqs = _requests(shared=16, seed=5, new=3)
    for i, r in enumerate(reqs):
        r.priority = -i  # the last submitted first
    order: list[str] = []
    loop.run(reqs, on_token=lambda r, t: order.append(r.req_id))
    first_tokens = list(dict.fromkeys(order))
    assert first_tokens == [r.req_id for r in reversed(reqs)]
    m = loop.scheduler.manager
    stored = {
        (e.group_idx, h)
        for e in m.take_events()
        if isinstance(e, jaxkv.sched.BlockStored)
        for h in e.block_hashes
    }
    assert stored == set(m.allocator._cached)  # nothing evicted: all still cached
    assert loop.scheduler.make_stats().prefix_cache_stats.hits > 0


def test_bad_arguments_are_named():
    plan, forward, _ = _model()
    with pytest.raises(TypeError, match="forward must be callable"):
        jaxkv.ServingLoop(plan, None, {})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        jaxkv.ServingLoop(plan, forward, {}, sampling={"temperature": 1})  # pyright: ignore[reportArgumentType]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"top_k": -2}, "top_k must be an int >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"seed": -1}, "seed must be an int"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            jaxkv.SamplingParams(**kwargs)


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_logits_wider_than_the_vocabulary_are_named_when_traced(decode_steps):
    """Logits of more columns than ``vocab_size`` could sample an id the
    scheduler refuses: named when the step is compiled (here by warm_up),
    before any request runs, in the one-step and the multi-step programs.
    """  # noqa: D205
    plan, _, _ = _model()

    # No model: the pools come back as new arrays (a forward that returns
    # the very arrays it was given is refused: its writes would be lost).
    def wide(params, pools, meta, tokens, sample):
        return jax.tree.map(jnp.copy, pools), jnp.zeros((sample.shape[0], VOCAB + 2))

    loop = jaxkv.ServingLoop(
        plan,
        wide,
        {},
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(decode_steps=decode_steps),
    )
    with pytest.raises(
        ValueError, match=f"logits of {VOCAB + 2} columns, but vocab_size is {VOCAB}"
    ):
        loop.warm_up()

    def exact(params, pools, meta, tokens, sample):
        return jax.tree.map(jnp.copy, pools), jnp.zeros((sample.shape[0], VOCAB))

    loop = jaxkv.ServingLoop(plan, exact, {}, vocab_size=VOCAB)
    r = jaxkv.Request("a", prompt=[1, 2], max_new_tokens=2)
    assert loop.run([r])[0].output == [0, 0]


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    # probabilities ~ [0.6, 0.25, 0.1, 0.05]: top_p=0.5 keeps token 0 only,
    # top_p=0.8 tokens 0-1, top_k=3 tokens 0-2; 400 draws each.
    logits = jnp.log(jnp.array([[0.6, 0.25, 0.1, 0.05]] * 400))
    seeds, pos = jnp.arange(400), jnp.zeros(400, jnp.int32)

    def drawn(**kw):
        out = jaxkv.sample_tokens(
            logits,
            params=jaxkv.SamplingParams(temperature=1.0, **kw),
            request_seeds=seeds,
            positions=pos,
        )
        return set(np.asarray(out).tolist())

    assert drawn(top_p=0.5) == {0}
    assert drawn(top_p=0.8) == {0, 1}
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn() == {0, 1, 2, 3}


# --- a Griffin-like model: recurrent layers with their state in Mamba pools --


def _griffin(num_layers=3, drop=None):
    cfg = jaxkv.pattern_config(
        "RRL", num_layers=num_layers, recurrent_state=(((D,),), ("float32",)), **SHAPE
    )
    plan = jaxkv.make_plan(cfg, num_blocks=64)
    kinds = [type(layer.spec) is jaxkv.MambaSpec for layer in cfg.layers]
    names = [layer.name for layer in cfg.layers]
    pairs = list(zip(names, kinds, strict=True))
    attention = {n: plan.attention_layer(n) for n, rec in pairs if not rec}
    states: dict[str, Any] = {n: plan.views[n] for n, rec in pairs if rec}

    def recurrent(w, pools, view, m, x):
        """h_t = a h_{t-1} + (1 - a) x_t per channel, scanned per request."""
        src, dst = m.mamba_state_blocks()
        (h0,) = jaxkv.read_mamba_state(pools, view, src)
        h0 = jnp.where((src >= 0)[:, None], h0, 0.0)
        rows = jaxkv.request_token_rows(m, x.shape[0])  # (reqs, tokens)
        xs = jnp.where((rows >= 0)[..., None], x[jnp.maximum(rows, 0)], 0.0)
        a = jax.nn.sigmoid(w["a"])[None, :]

        def cell(h, inputs):
            xt, ok = inputs
            h = jnp.where(ok[:, None], a * h + (1 - a) * xt, h)
            return h, h

        h_last, hs = jax.lax.scan(
            cell, h0, (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(rows >= 0, 0, 1))
        )
        pools = jaxkv.write_mamba_state(pools, view, dst, [h_last])
        idx = jnp.where(rows >= 0, rows, x.shape[0])  # padding: dropped
        y = jnp.zeros_like(x).at[idx].set(jnp.swapaxes(hs, 0, 1), mode="drop")
        return pools, y

    def forward(params, pools, meta, tokens, sample):
        x = params["embed"][tokens]
        for name, w in zip(names, params["layers"], strict=True):
            m = meta[name]
            if name in states:
                written, y = recurrent(w, pools, states[name], m, _rms(x))
                pools = pools if name == drop else written
                x = x + y @ w["wr"]
            else:
                layer = attention[name]
                q, k, v = _qkv(w, x, m.positions)
                written = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
                pools = pools if name == drop else written
                out = jaxkv.paged_attention(q, pools, layer, m, scale=HD**-0.5)
                x = x + out.reshape(x.shape[0], -1) @ w["wo"]
        return pools, _rms(x[sample]) @ params["unembed"]

    params = _params(num_layers, seed=5)
    keys = jax.random.split(jax.random.key(9), num_layers)
    for w, key, rec in zip(params["layers"], keys, kinds, strict=True):
        if rec:
            w["a"] = jax.random.normal(key, (D,), jnp.float32)
            w["wr"] = jax.random.normal(jax.random.fold_in(key, 1), (D, D), jnp.float32)
            w["wr"] = w["wr"] * 0.3
    return plan, forward, params, kinds


def _griffin_dense_logits(params, kinds, tokens):
    p = _as_f64(params)
    x = p["embed"][np.asarray(tokens)]
    for w, rec in zip(p["layers"], kinds, strict=True):
        if not rec:
            x = _np_attention(w, x, WINDOW)
            continue
        a = 1 / (1 + np.exp(-w["a"]))
        h, ys = np.zeros(D), []
        for xt in _np_rms(x):
            h = a * h + (1 - a) * xt
            ys.append(h)
        x = x + np.stack(ys) @ w["wr"]
    return (_np_rms(x[-1:]) @ p["unembed"])[0]


def test_a_griffin_like_model_keeps_its_state_in_mamba_pools():
    plan, forward, params, kinds = _griffin()
    loop = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        vocab_size=VOCAB,
        execution=jaxkv.ExecutionOptions(record_logits=True),
    )
    loop.warm_up()
    with jaxkv.count_compilations() as compiles:
        requests = loop.run(_requests(shared=20, seed=2))
    assert compiles == []
    for req in requests:
        tokens = list(req.prompt)
        for k, token in enumerate(req.output):
            want = _griffin_dense_logits(params, kinds, tokens)
            np.testing.assert_allclose(
                loop.logits[req.req_id][k], want, rtol=1e-4, atol=1e-4
            )
            assert token == int(np.argmax(want))
            tokens.append(token)
    want = {r.req_id: r.output for r in requests}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_blocks": 12}, "preemptions"),  # states recomputed
        ({"enable_prefix_caching": True}, "cached_tokens"),  # states reused
    ]
    for kwargs, stat in cases:
        reset_loop(loop, **kwargs)
        again = loop.run(_requests(shared=20, seed=2))
        assert {r.req_id: r.output for r in again} == want, kwargs
        assert loop.scheduler.stats[stat] > 0, (kwargs, loop.scheduler.stats)


def test_a_forward_that_returns_the_wrong_things_is_named():
    plan, forward, _ = _model()
    params = _params(2)
    cases = [
        (lambda p, pools, m, t, s: forward(p, pools, m, t, s)[1], "must return"),
        (
            lambda p, pools, m, t, s: (
                tuple(x[: x.shape[0] // 2] for x in pools),
                forward(p, pools, m, t, s)[1],
            ),
            "not the ones it was given",
        ),
        (
            lambda p, pools, m, t, s: (
                forward(p, pools, m, t, s)[0],
                forward(p, pools, m, t, s)[1][:1],
            ),
            r"logits of shape \(num_samples, vocab\)",
        ),
        # The model's writes discarded: the argument returned as it came.
        (
            lambda p, pools, m, t, s: (pools, forward(p, pools, m, t, s)[1]),
            "the very pools it was given",
        ),
    ]
    for bad, match in cases:
        loop = jaxkv.ServingLoop(plan, bad, params)
        with pytest.raises((TypeError, ValueError), match=match):
            loop.run([jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)])


def test_param_specs_must_match_the_params_and_need_a_mesh():
    plan, forward, _ = _model()
    params = _params(2)
    with pytest.raises(ValueError, match="give a ShardedPlan"):
        jaxkv.ServingLoop(
            plan,
            forward,
            params,
            execution=jaxkv.ExecutionOptions(param_specs={"embed": P()}),
        )
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    sp = jaxkv.shard_plan(plan.runner_config, mesh=mesh, num_blocks=16)
    with pytest.raises(ValueError, match="one PartitionSpec per leaf of params"):
        jaxkv.ServingLoop(
            sp,
            forward,
            params,
            execution=jaxkv.ExecutionOptions(param_specs={"embed": P()}),
        )
    with pytest.raises(TypeError, match="plan must be a KVCachePlan"):
        jaxkv.ServingLoop(plan.runner_config, forward, params)  # pyright: ignore[reportArgumentType]
    loop = jaxkv.ServingLoop(sp, forward, params)
    loop.runner.num_ranks = 2  # as on a mesh of two data ranks
    with pytest.raises(ValueError, match="use loop.schedulers"):
        _ = loop.scheduler


@pytest.mark.parametrize(
    "params",
    [
        jaxkv.SamplingParams(),
        jaxkv.SamplingParams(temperature=1.5, seed=3),
        jaxkv.SamplingParams(temperature=0.7, top_k=5, seed=1),
        jaxkv.SamplingParams(temperature=1.0, top_p=0.6, seed=2),
        jaxkv.SamplingParams(temperature=2.0, top_k=9, top_p=0.8, seed=4),
    ],
)
def test_per_row_sampling_draws_what_sample_tokens_draws(params):
    logits = jax.random.normal(jax.random.key(0), (64, 40)) * 3
    seeds = jnp.arange(64, dtype=jnp.int32) * 7919
    pos = jnp.arange(64, dtype=jnp.int32) % 11

    def rows(value, dtype):
        return jnp.full(64, value, dtype)

    want = jaxkv.sample_tokens(
        logits, params=params, request_seeds=seeds, positions=pos
    )
    got = jaxkv.sample_tokens_per_row(
        logits,
        temperature=rows(params.temperature, jnp.float32),
        top_k=rows(params.top_k, jnp.int32),
        top_p=rows(params.top_p, jnp.float32),
        seed=rows(params.seed, jnp.int32),
        request_seeds=seeds,
        positions=pos,
    )
    assert got.tolist() == want.tolist()


def test_both_samplers_draw_with_the_documented_key_per_row():
    # An oracle of its own (not one sampler against the other): row i draws
    # categorical(fold_in(fold_in(key(seed), request_seeds[i]), positions[i]),
    # logits[i] / temperature). A key that forgot the position (or the
    # request's seed) in both samplers would still pass the comparison above.
    logits = jax.random.normal(jax.random.key(1), (48, 40)) * 3
    seeds = jnp.arange(48, dtype=jnp.int32) % 3 * 7919
    pos = jnp.arange(48, dtype=jnp.int32) // 3
    params = jaxkv.SamplingParams(temperature=0.8, seed=5)
    keys = jax.vmap(
        lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(5), s), p)
    )(seeds, pos)
    want = jax.vmap(jax.random.categorical)(keys, logits / 0.8).tolist()
    one = jaxkv.sample_tokens(logits, params=params, request_seeds=seeds, positions=pos)
    rows = jaxkv.sample_tokens_per_row(
        logits,
        temperature=jnp.full(48, 0.8, jnp.float32),
        top_k=jnp.zeros(48, jnp.int32),
        top_p=jnp.ones(48, jnp.float32),
        seed=jnp.full(48, 5, jnp.int32),
        request_seeds=seeds,
        positions=pos,
    )
    assert one.tolist() == want
    assert rows.tolist() == want


def test_each_request_samples_with_its_own_parameters(served):
    """One loop, one program per bucket: greedy, hot and top-1 requests mixed
    in a batch draw what loops of one kind each draw; no compile after
    warm-up.
    """  # noqa: D205
    plan, forward, _ = _model()
    params = served["params"]
    hot = jaxkv.SamplingParams(temperature=1.5, top_k=8, top_p=0.9, seed=3)
    top1 = jaxkv.SamplingParams(temperature=1.0, top_k=1, seed=5)
    kinds = [None, hot, top1, hot]

    def alone(sampling):
        loop = jaxkv.ServingLoop(plan, forward, params, sampling=sampling)
        reqs = _requests(new=5)
        loop.run(reqs)
        return [r.output for r in reqs]

    ref = {k: alone(k or jaxkv.SamplingParams()) for k in (None, hot, top1)}
    mixed = jaxkv.ServingLoop(
        plan,
        forward,
        params,
        execution=jaxkv.ExecutionOptions(per_request_sampling=True),
    )
    mixed.warm_up()
    reqs = _requests(new=5)
    with jaxkv.count_compilations() as compiles:
        mixed.run(
            reqs,
            sampling={r.req_id: k for r, k in zip(reqs, kinds, strict=True) if k},
        )
    assert compiles == []
    for i, (r, k) in enumerate(zip(reqs, kinds, strict=True)):
        assert r.output == ref[k][i], (r.req_id, k)
    assert ref[hot] != ref[None]  # the kinds do differ
    assert mixed.runner.request_sampling == {}  # forgotten when finished
    with pytest.raises(ValueError, match="per_request_sampling=True"):
        served["loop"].submit(
            jaxkv.Request("x", prompt=[1], max_new_tokens=1), sampling=hot
        )
    bad: Any = {"temperature": 1.0}
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        mixed.submit(jaxkv.Request("y", prompt=[1], max_new_tokens=1), sampling=bad)


@pytest.mark.parametrize("dropped", [0, 2])  # recurrent layer 0, attention layer 2
def test_a_forward_that_drops_one_layers_write_is_refused_naming_it(dropped):
    # Issue 56: a Griffin with one layer's write discarded served on with
    # wrong tokens; the loop names the layer before the first step runs, and
    # the request is not left stuck.
    plan, _, _, _ = _griffin()
    name = list(plan.views)[dropped]
    plan, forward, params, _ = _griffin(drop=name)
    loop = jaxkv.ServingLoop(plan, forward, params, vocab_size=VOCAB)
    request = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)
    # Recurrent layers 0 and 1 share one view (two KV-cache groups' blocks of
    # one pool): both are named, with the count of writes kept.
    with pytest.raises(ValueError, match=f"{name!r}.*do not keep that write"):
        loop.run([request])
    assert request.status is not jaxkv.RequestStatus.RUNNING
