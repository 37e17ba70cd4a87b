"""Speculative decoding through the scheduler and the step: drafts verified in
one step (``1 + k`` logits per request), accepted tokens applied, rejected
drafts' slots given back, outputs equal to plain greedy decoding.
"""  # noqa: D205

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

VOCAB, D = 50, 64


def _setup(window=None):
    kw: dict[str, Any] = dict(
        block_size=4, num_kv_heads=2, head_size=16, dtype="float32"
    )
    specs: list[jaxkv.AttentionSpec] = [jaxkv.FullAttentionSpec(**kw)]
    if window:
        specs.append(jaxkv.SlidingWindowSpec(sliding_window=window, **kw))
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name=f"l{i}",
                spec=s,
                backend=jaxkv.get_backend("JAX_PAGED"),
                num_heads=4,
            )
            for i, s in enumerate(specs)
        ],
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=40)
    builder = jaxkv.StepMetadataBuilder(plan, model_inputs=True)
    layers = [plan.attention_layer(f"l{i}") for i in range(len(specs))]
    keys = iter(jax.random.split(jax.random.key(1), 16))
    params = {
        "embed": jax.random.normal(next(keys), (VOCAB, D)),
        "layers": [
            {
                n: jax.random.normal(next(keys), (D, h, 16)) / 5
                for n, h in zip("qkv", (4, 2, 2), strict=True)
            }
            for _ in layers
        ],
        "unembed": jax.random.normal(next(keys), (D, VOCAB)),
    }

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pools, inputs):
        meta = builder.metadata(inputs)
        tokens, sample = builder.model_inputs_of(inputs)
        x = params["embed"][tokens]
        for layer, w in zip(layers, params["layers"], strict=True):
            q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in "qkv")
            m = meta[layer.name]
            pools = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
            out = jaxkv.paged_attention(q, pools, layer, m, scale=16**-0.5)
            x = x + out.reshape(x.shape)
        return pools, jnp.argmax(x[sample] @ params["unembed"], axis=-1)

    return plan, builder, step


def _prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, 8).tolist()  # a prefix the cache can share
    return [
        shared + rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist()
        for _ in range(4)
    ]


def _requests(s):
    """The prompts as requests of 12 new tokens, added to scheduler `s`."""
    reqs = [
        jaxkv.Request(f"r{i}", prompt=p, max_new_tokens=12)
        for i, p in enumerate(_prompts())
    ]
    for r in reqs:
        s.add_request(r)
    return reqs


def _plain(plan, builder, step):
    s = jaxkv.Scheduler(plan)
    reqs = _requests(s)
    pools = plan.allocate()
    while s.has_unfinished:
        sched = s.schedule()
        pools, tokens = step(pools, builder.prepare(sched))
        s.update(sched, np.asarray(tokens)[: len(sched.sampled)].tolist())
    return [r.output for r in reqs]


@pytest.mark.parametrize(
    ("window", "squeezed"), [(None, False), (6, False), (None, True), (6, True)]
)
def test_draft_and_verify_equals_plain_greedy_decoding(window, squeezed):
    """Squeezed: prefix caching on, few blocks and first-chunk admission, so
    requests share cached prefixes and are preempted and recomputed while
    verifying drafts.
    """  # noqa: D205
    plan, builder, step = _setup(window)
    reference = _plain(plan, builder, step)
    rng = np.random.default_rng(1)
    s = jaxkv.Scheduler(
        plan,
        enable_prefix_caching=squeezed,
        num_blocks=(22 if window else 14) if squeezed else None,
        scheduler_reserve_full_isl=not squeezed,
    )
    reqs = _requests(s)
    pools = plan.allocate()
    verified = accepted_drafts = 0
    while s.has_unfinished:
        # A deterministic oracle draft: the reference's next tokens, each
        # wrong with probability 0.3, 0-4 of them.
        for r, ref in zip(reqs, reference, strict=True):
            if r in s.running and r.num_computed == r.num_tokens - 1:
                ahead = ref[len(r.output) : len(r.output) + int(rng.integers(0, 5))]
                r.spec_token_ids = [
                    (t + 1) % VOCAB if rng.random() < 0.3 else t for t in ahead
                ]
        sched = s.schedule()
        pools, tokens = step(pools, builder.prepare(sched))
        num = 0 if sched.logits_indices is None else len(sched.logits_indices)
        sampled = np.asarray(tokens)[:num].tolist()
        rows, at = [], 0
        for r in sched.sampled:  # greedy verification
            drafts = sched.spec_token_ids.get(r.req_id, [])
            target = sampled[at : at + len(drafts) + 1]
            at += len(drafts) + 1
            m = next((i for i, d in enumerate(drafts) if d != target[i]), len(drafts))
            rows.append(target[: m + 1])
            verified += len(drafts)
            accepted_drafts += m
        assert at == len(sampled)
        s.update(sched, rows)
        for r in s.running:  # rejected drafts' blocks went back
            held = [sum(1 for b in t if b) for t in s.manager.blocks_of(r)]
            assert -(-r.num_computed // 4) <= held[0] <= -(-(r.num_computed + 1) // 4)
    assert not s.rejected
    assert [r.output for r in reqs] == reference
    assert 0 < accepted_drafts < verified  # some kept, some rejected
    if squeezed:
        assert s.stats["preemptions"] > 0
        assert s.stats["cached_tokens"] > 0
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def _running(num_lookahead_tokens=0, budget=16):
    plan = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=1, block_size=4), num_blocks=16
    )
    s = jaxkv.Scheduler(
        plan,
        num_lookahead_tokens=num_lookahead_tokens,
        vocab_size=50,
        max_num_batched_tokens=budget,
    )
    r = jaxkv.Request("a", prompt=list(range(6)), max_new_tokens=10)
    s.add_request(r)
    while not r.output:
        step = s.schedule()
        s.update(step, [9] * len(step.sampled))
    return s, r


def test_a_verify_step_samples_every_draft_and_applies_what_is_accepted():
    s, r = _running()
    r.spec_token_ids = [1, 2, 3]
    step = s.schedule()
    assert [(q.req_id, n) for q, n in step.batch] == [("a", 4)]
    assert step.spec_token_ids == {"a": [1, 2, 3]}
    assert np.asarray(step.token_ids).tolist() == [9, 1, 2, 3]
    assert step.positions.tolist() == [6, 7, 8, 9]
    assert step.logits_indices is not None
    assert step.logits_indices.tolist() == [0, 1, 2, 3]
    assert r.spec_token_ids == []  # consumed
    assert [len([b for b in t if b]) for t in s.manager.blocks_of(r)] == [3]
    s.update(step, [[1, 7]])  # draft 1 kept, 7 sampled instead of 2
    assert r.output == [9, 1, 7]
    assert r.num_computed == 8  # 9 and 1 are in the cache; 7 is next
    assert [len([b for b in t if b]) for t in s.manager.blocks_of(r)] == [3]
    # All drafts rejected: the third block (positions 8-11) is kept for the
    # next token, nothing past it.
    r.spec_token_ids = [4, 4, 4, 4, 4]
    step = s.schedule()
    assert step.spec_token_ids == {"a": [4, 4, 4, 4, 4]}
    s.update(step, [5])
    assert (r.output, r.num_computed) == ([9, 1, 7, 5], 9)
    assert [len([b for b in t if b]) for t in s.manager.blocks_of(r)] == [3]


def test_a_stop_token_among_the_accepted_ends_the_request_there():
    s, r = _running()
    r.stop_token_ids = (2,)
    r.spec_token_ids = [1, 2, 3]
    step = s.schedule()
    assert s.update(step, [[1, 2, 3, 4]]) == [r]  # 2 is a stop token
    assert r.output == [9, 1, 2]
    assert r.status is jaxkv.RequestStatus.FINISHED
    assert s.manager.num_free_blocks == s.manager.num_usable_blocks


def test_drafts_are_cut_to_the_budget_and_max_new_tokens():
    s, r = _running(budget=3)
    r.spec_token_ids = [1, 2, 3, 4]
    assert s.schedule().spec_token_ids == {"a": [1, 2]}  # 3 tokens of budget
    s2, r2 = _running()
    r2.output += [0] * 7  # 2 tokens left to generate: 1 draft + 1 sampled
    r2.num_computed += 7
    r2.spec_token_ids = [1, 2, 3]
    assert s2.schedule().spec_token_ids == {"a": [1]}


def test_lookahead_slots_are_held_with_the_step():
    s, r = _running(num_lookahead_tokens=5)
    step = s.schedule()  # position 6, then 5 lookahead slots: positions up to 11
    assert [(q.req_id, n) for q, n in step.batch] == [("a", 1)]
    assert [len([b for b in t if b]) for t in s.manager.blocks_of(r)] == [3]


def test_bad_drafts_and_bad_acceptances_are_refused_and_change_nothing():
    s, r = _running()
    r.spec_token_ids = [1, 99]
    with pytest.raises(
        ValueError, match=r"request 'a' spec_token_ids must be token ids in \[0, 50\)"
    ):
        s.schedule()
    r.spec_token_ids = [1, 2]
    step = s.schedule()
    before = (list(r.output), r.num_computed, s.manager.blocks_of(r))
    for bad, match in (
        ([[1, 2, 3, 4]], "accepts 1 to 3 tokens"),
        ([[]], "accepts 1 to 3 tokens"),
        (
            [[2, 5]],
            r"accepts \[2\] before its sampled token, but the step computed "
            r"drafts \[1, 2\]",
        ),
        ([[1, 2, 50]], r"must be in \[0, 50\)"),
        ([1, 2], "1 requests sample"),
    ):
        with pytest.raises(ValueError, match=match):
            s.update(step, bad)
        assert (list(r.output), r.num_computed, s.manager.blocks_of(r)) == before
    s.advance(step)  # a step with drafts advances nothing: resolve decides
    assert (list(r.output), r.num_computed, s.manager.blocks_of(r)) == before
    with pytest.raises(RuntimeError, match="verifying draft tokens"):
        s.schedule()
    s.resolve(step, [[1, 2, 3]])
    assert r.output == [9, 1, 2, 3]
    hybrid = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16))
    q = jaxkv.Request("m", prompt=[1, 2, 3], max_new_tokens=4)
    hybrid.add_request(q)
    hybrid.update(hybrid.schedule(), [4])
    q.spec_token_ids = [5]
    with pytest.raises(ValueError, match="Mamba groups"):
        hybrid.schedule()


@pytest.mark.parametrize(
    ("prompt", "budget", "blocks"),
    [
        (6, 16, [3]),  # vLLM 0.32: ceil((6 + 3) / 4) = 3 (jaxkv held 2)
        (16, 16, [5]),  # ceil((16 + 3) / 4) = 5 (jaxkv held 4)
        (16, 8, [3, 5]),  # chunks of 8: ceil(11 / 4), then ceil(19 / 4)
    ],
)
def test_lookahead_slots_are_held_for_prefills_as_vllm_holds_them(
    prompt, budget, blocks
):
    # vLLM's Scheduler passes num_lookahead_tokens to allocate_slots for every
    # request it schedules, at admission and for running prefill chunks
    # (min(computed + new + lookahead, max_model_len) slots); the blocks hold
    # no more than the chunk's tokens in the prefix cache.
    plan = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=1, block_size=4), num_blocks=32
    )
    s = jaxkv.Scheduler(
        plan, num_lookahead_tokens=3, max_num_batched_tokens=budget, vocab_size=50
    )
    r = jaxkv.Request("a", prompt=list(range(prompt)), max_new_tokens=4)
    s.add_request(r)
    held = []
    for _ in blocks:
        step = s.schedule()
        held.append(len([b for b in s.manager.blocks_of(r)[0] if b]))
        s.update(step, [9] * len(step.sampled))
    assert held == blocks


def test_lookahead_slots_are_not_cached_as_computed_tokens():
    # A prefill chunk's lookahead blocks hold slots, not K/V: another request
    # with the same prompt hits only the chunk's full blocks.
    plan = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=1, block_size=4), num_blocks=32
    )
    s = jaxkv.Scheduler(
        plan,
        num_lookahead_tokens=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        vocab_size=50,
    )
    a = jaxkv.Request("a", prompt=list(range(16)), max_new_tokens=4)
    s.add_request(a)
    s.schedule()  # tokens 0-7, slots to 11: three blocks held, two computed
    assert len([b for b in s.manager.blocks_of(a)[0] if b]) == 3
    b = jaxkv.Request("b", prompt=list(range(16)), max_new_tokens=4)
    assert s.manager.find_cache_hit(b) == 8


def test_lookahead_after_a_prefix_hit_stops_at_max_model_len():
    # Admitted with 8 tokens from the prefix cache and 6 to compute: the
    # lookahead counts from token 14, so 2 slots (max_model_len 16), not 3.
    cfg = jaxkv.llama_like_config(num_layers=1, block_size=4, max_model_len=16)
    plan = jaxkv.make_plan(cfg, num_blocks=32)
    s = jaxkv.Scheduler(
        plan, num_lookahead_tokens=3, enable_prefix_caching=True, vocab_size=50
    )
    first = jaxkv.Request("first", prompt=list(range(8)) + [40], max_new_tokens=1)
    s.add_request(first)
    s.update(s.schedule(), [1])  # finished: its two full blocks stay cached
    r = jaxkv.Request("r", prompt=list(range(14)), max_new_tokens=2)
    s.add_request(r)
    s.schedule()
    assert r.num_cached_tokens == 8
    assert len([b for b in s.manager.blocks_of(r)[0] if b]) == 4  # 16 slots
