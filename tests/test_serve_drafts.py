"""Speculative decoding inside ServingLoop: drafts proposed before each step,
verified inside the jitted step, the accepted tokens applied through
advance/resolve. Tokens equal the loop without drafts (greedy and sampled:
the target's token at each position is drawn with the same key), the sampled
distribution is the model's (a chi-square test), acceptance is counted as
vLLM counts it, and a bad drafter changes nothing.
"""  # noqa: D205

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.serve import NgramDrafter, accept_drafts, ngram_drafts

VOCAB = 16


# --- vLLM's n-gram proposer (tests/v1/spec_decode/test_ngram.py numbers) ------


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "want"),
    [
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
        ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the first match
        ([1, 2, 3, 4, 5], 2, 2, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
        ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
        ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # not [5, 1]
        ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # not [5, 2]
        ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
        ([7], 1, 3, 2, []),
        ([7, 7], 1, 3, 4, [7]),  # what follows the match, up to the end
    ],
)
def test_ngram_drafts_equal_vllms_proposer(tokens, min_n, max_n, k, want):
    assert ngram_drafts(tokens, min_n=min_n, max_n=max_n, k=k) == want


def test_ngram_drafter_refuses_bad_counts_by_name():
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int"):
        NgramDrafter(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(prompt_lookup_min=3, prompt_lookup_max=2)


# --- verification inside the step ---------------------------------------------


def _accept_reference(tokens, drafts):
    out, rejected = [], False
    for t, d in zip(tokens, drafts, strict=True):
        out.append(-1 if rejected else t)
        rejected = d >= 0 and (rejected or t != d)
    return out


def test_accept_drafts_keeps_each_request_up_to_its_first_rejection():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        tokens = rng.integers(0, 3, n)
        drafts = np.where(rng.random(n) < 0.6, rng.integers(0, 3, n), -1)
        drafts[-1] = -1  # the last row ends its request
        got = jax.jit(accept_drafts)(jnp.asarray(tokens), jnp.asarray(drafts))
        assert got.tolist() == _accept_reference(tokens.tolist(), drafts.tolist())


# --- a bigram model: exact distributions ---------------------------------------


def _bigram(num_blocks=128, max_num_seqs=8):
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_size=8,
        block_size=4,
        max_model_len=64,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=num_blocks)
    layer = plan.attention_layer("layers.0.self_attn")

    def forward(table, pools, meta, tokens, sample):
        x = jnp.ones((tokens.shape[0], 1, 8), jnp.float32)
        m = meta[layer.name]
        pools = jaxkv.write_kv(pools, layer, x, x, m)
        out = jaxkv.paged_attention(x, pools, layer, m, scale=1.0)
        # The cache is read (and written), the logits are the bigram table's.
        return pools, table[tokens[sample]] + 0.0 * out[sample, 0, :1]

    table = jax.random.normal(jax.random.key(1), (VOCAB, VOCAB)) * 1.5
    return plan, forward, table


def _oracle_drafter(table, *, k, wrong_at=None):
    """A draft model: the bigram's greedy continuation (one position wrong)."""
    t = np.asarray(table)

    def drafter(requests):
        out = []
        for r in requests:
            last, draft = (r.prompt + r.output)[-1], []
            for i in range(k):
                last = int(np.argmax(t[last]))
                draft.append((last + 1) % VOCAB if i == wrong_at else last)
            out.append(draft)
        return out

    return drafter


K = 3
GREEDY = jaxkv.SamplingParams()
SAMPLED = jaxkv.SamplingParams(temperature=1.0, seed=3)


class _Switch:
    """The loop's drafter: whichever the test sets (one compiled loop for all)."""

    def __init__(self):
        self.drafter = lambda reqs: [[] for _ in reqs]

    def __call__(self, reqs):
        return self.drafter(reqs)


@pytest.fixture(scope="module")
def loops():
    """Per sampling: a loop without drafts and a warmed-up one with drafts."""
    plan, forward, table = _bigram()
    out: dict = {"table": table}
    for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        switch = _Switch()
        spec = jaxkv.ServingLoop(
            plan,
            forward,
            table,
            vocab_size=VOCAB,
            sampling=sampling,
            execution=jaxkv.ExecutionOptions(
                drafter=switch, num_speculative_tokens=K, record_logits=True
            ),
        )
        spec.warm_up()
        base = jaxkv.ServingLoop(
            plan, forward, table, vocab_size=VOCAB, sampling=sampling
        )
        out[name] = (base, spec, switch)
    return out


def _requests(n=4, new=12, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jaxkv.Request(
            f"r{i}",
            prompt=rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist(),
            max_new_tokens=new,
        )
        for i in range(n)
    ]


def _run(loops, kind, drafter, requests, num_blocks=None, **run):
    """``(requests served with drafts, their tokens without, the loop)``.

    `num_blocks`: the blocks the loop with drafts may use (fewer preempt).
    """
    base, spec, switch = loops[kind]
    base.reset()
    want = [r.output for r in base.run(copy_requests(requests))]
    spec.reset(
        num_blocks=num_blocks,
        scheduling=jaxkv.SchedulingOptions(scheduler_reserve_full_isl=False),
    )
    switch.drafter = drafter
    with jaxkv.count_compilations() as compiles:
        spec.run(requests, **run)
    assert compiles == []  # warmed up: steps verifying drafts compile nothing
    return requests, want, spec


def copy_requests(requests):
    return [
        jaxkv.Request(r.req_id, prompt=list(r.prompt), max_new_tokens=r.max_new_tokens)
        for r in requests
    ]


@pytest.mark.parametrize("wrong_at", [None, 0, 1])
def test_drafts_of_a_draft_model_give_the_tokens_of_greedy_decoding(loops, wrong_at):
    # Drafts of 2K tokens: the loop verifies K per step (its programs' rows).
    drafter = _oracle_drafter(loops["table"], k=2 * K, wrong_at=wrong_at)
    reqs, want, loop = _run(loops, "greedy", drafter, _requests())
    assert [r.output for r in reqs] == want
    stats = loop.scheduler.make_stats().spec_decoding_stats
    assert stats.num_drafts > 0
    assert len(stats.num_draft_tokens_per_pos) == K
    if wrong_at is None:  # every draft token the target agrees with
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:  # the draft is right up to `wrong_at`, never past it
        per_pos = stats.num_accepted_tokens_per_pos
        assert per_pos[wrong_at] == 0
        assert per_pos[:wrong_at] == stats.num_draft_tokens_per_pos[:wrong_at]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_preempted_requests_verify_drafts_to_the_same_tokens(loops, kind):
    """A pool of 12 blocks for 8 requests: preemption (recomputation) between
    steps verifying drafts; tokens as without drafts, every block back.
    """  # noqa: D205
    drafter = _oracle_drafter(loops["table"], k=K, wrong_at=1)
    requests = _requests(n=8, new=16, seed=2)
    reqs, want, loop = _run(loops, kind, drafter, requests, num_blocks=12)
    assert [r.output for r in reqs] == want
    sched = loop.scheduler
    assert sched.stats["preemptions"] > 0
    assert sched.make_stats().spec_decoding_stats.num_accepted_tokens > 0
    assert sched.manager.num_free_blocks == sched.manager.num_usable_blocks


def test_sampled_tokens_equal_the_loop_without_drafts(loops):
    """Temperature 1: the target's token at each position has the same key."""
    drafter = _oracle_drafter(loops["table"], k=K)
    reqs, want, loop = _run(loops, "sampled", drafter, _requests())
    assert [r.output for r in reqs] == want
    stats = loop.scheduler.make_stats().spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def _chi2_pvalue(counts, probs):
    """Pearson's test of `counts` against `probs` (cells merged to >= 5 expected)."""
    n = counts.sum()
    order = np.argsort(probs)
    obs, exp, stat, cells = 0.0, 0.0, 0.0, 0
    for i in order:
        obs, exp = obs + counts[i], exp + n * probs[i]
        if exp >= 5:
            stat, cells, obs, exp = stat + (obs - exp) ** 2 / exp, cells + 1, 0.0, 0.0
    if exp:
        stat, cells = stat + (obs - exp) ** 2 / max(exp, 1e-12), cells + 1
    df = cells - 1
    return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


def test_speculative_sampling_keeps_the_models_distribution(loops):
    """Three tokens sampled after a fixed prompt, the second and third through
    a draft verified by a draft model that proposes the target's mode: the
    (second, third) pairs' frequencies pass a chi-square test against the
    bigram's exact distribution, and the draft is accepted as often as the
    target samples its mode.
    """  # noqa: D205
    table = loops["table"]
    n = 600
    reqs = [jaxkv.Request(f"q{i}", prompt=[5], max_new_tokens=3) for i in range(n)]
    _, spec, switch = loops["sampled"]
    spec.reset()
    switch.drafter = _oracle_drafter(table, k=K)
    spec.run(reqs)
    counts = np.zeros((VOCAB, VOCAB))
    for r in reqs:
        counts[r.output[1], r.output[2]] += 1
    p = np.asarray(jax.nn.softmax(table), np.float64)
    pairs = (p[5] @ p)[:, None] * p  # summed over the first token
    assert _chi2_pvalue(counts.ravel(), pairs.ravel() / pairs.sum()) > 1e-3
    stats = spec.scheduler.make_stats().spec_decoding_stats
    assert stats.num_drafts == n  # one draft token each (max_new_tokens)
    want = float(p[5] @ p.max(axis=1))  # P(the second token is the mode)
    rate = stats.acceptance_rate
    assert abs(rate - want) < 4 * np.sqrt(want * (1 - want) / n), (rate, want)


def test_ngram_drafts_are_accepted_and_counted(loops):
    # A bigram decoding greedily cycles: n-gram drafts find the cycle.
    reqs, want, loop = _run(loops, "greedy", NgramDrafter(), _requests(new=20))
    assert [r.output for r in reqs] == want
    stats = loop.scheduler.make_stats()
    spec = stats.spec_decoding_stats
    assert spec.num_accepted_tokens > 0
    assert stats.metrics()["vllm:spec_decode_num_accepted_tokens"] == (
        spec.num_accepted_tokens
    )
    assert spec.mean_acceptance_length > 1.0


def test_streams_and_recorded_logits_follow_every_accepted_token(loops):
    streamed = []
    drafter = _oracle_drafter(loops["table"], k=K, wrong_at=2)
    reqs, want, loop = _run(
        loops,
        "greedy",
        drafter,
        _requests(),
        on_token=lambda r, t: streamed.append((r.req_id, t)),
    )
    t = np.asarray(loops["table"])
    for r in reqs:
        assert [tok for i, tok in streamed if i == r.req_id] == r.output
        rows = loop.logits[r.req_id]
        assert len(rows) == len(r.output)
        prev = (r.prompt + r.output)[len(r.prompt) - 1 : -1]
        for row, last in zip(rows, prev, strict=True):
            np.testing.assert_allclose(row, t[last], rtol=1e-6)


# --- what a loop with a drafter refuses ----------------------------------------


def test_options_name_a_missing_or_stray_draft_count():
    with pytest.raises(ValueError, match="num_speculative_tokens=2 without a drafter"):
        jaxkv.ExecutionOptions(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="give num_speculative_tokens="):
        jaxkv.ExecutionOptions(drafter=lambda reqs: [[] for _ in reqs])
    with pytest.raises(TypeError, match="drafter must be callable"):
        jaxkv.ExecutionOptions(drafter=3, num_speculative_tokens=1)  # pyright: ignore[reportArgumentType]
    assert jaxkv.ExecutionOptions(drafter=NgramDrafter()).num_speculative_tokens == 3


def test_a_drafter_is_refused_on_mamba_and_multi_step_loops():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    opts = jaxkv.ExecutionOptions(drafter=NgramDrafter())
    with pytest.raises(ValueError, match="Mamba state"):
        jaxkv.ServingLoop(plan, lambda *a: None, None, execution=opts)  # pyright: ignore[reportArgumentType]
    plan, forward, table = _bigram()
    with pytest.raises(ValueError, match="decode_steps=4"):
        jaxkv.ServingLoop(
            plan,
            forward,
            table,
            execution=jaxkv.ExecutionOptions(drafter=NgramDrafter(), decode_steps=4),
        )


BAD_ANSWERS = [
    (lambda reqs: [[1]] * (len(reqs) + 1), ValueError, "returned"),
    (lambda reqs: [[VOCAB]] * len(reqs), ValueError, r"in \[0, 16\)"),
    (lambda reqs: [[-1]] * len(reqs), ValueError, r"in \[0, 16\)"),
    (lambda reqs: [1.5] * len(reqs), TypeError, "sequence of token ids"),
    (lambda reqs: [[0.5]] * len(reqs), TypeError, "integer ids"),
    (lambda reqs: "abc", TypeError, "one sequence of draft tokens"),
]


def test_a_bad_drafter_is_named_and_the_loop_serves_on(loops):
    """Each bad answer raises, naming it, sets no draft; the loop serves on."""
    good = _oracle_drafter(loops["table"], k=K, wrong_at=0)  # one token a step
    calls = itertools.count()
    bad = iter(BAD_ANSWERS)
    current = []

    def drafter(reqs):  # wrong on every other call, right in between
        if next(calls) % 2 and (answer := next(bad, None)) is not None:
            current[:] = [answer]
            return answer[0](reqs)
        current.clear()
        return good(reqs)

    base, spec, switch = loops["greedy"]
    base.reset()
    reqs = _requests()
    want = [r.output for r in base.run(copy_requests(reqs))]
    spec.reset()
    switch.drafter = drafter
    for r in reqs:
        spec.submit(r)
    raised = []
    while spec.has_unfinished:
        try:
            spec.step()
        except (TypeError, ValueError) as e:
            # What came, what was expected, and whether a draft was set.
            raised.append((e, current[0], any(r.spec_token_ids for r in reqs)))
    assert len(raised) == len(BAD_ANSWERS)
    for e, (_, error, match), drafts_set in raised:
        assert isinstance(e, error)
        assert re.search(match, str(e)), (str(e), match)
        assert not drafts_set  # nothing was set
    assert [r.output for r in reqs] == want


def test_a_scheduler_refuses_to_schedule_past_an_unresolved_draft_step():
    plan, _, _ = _bigram()
    s = jaxkv.Scheduler(plan)
    s.add_request(jaxkv.Request("a", prompt=[1, 2], max_new_tokens=6))
    s.update(s.schedule(), [3])
    s.running[0].spec_token_ids = [4, 5]
    step = s.schedule()
    s.advance(step)  # changes nothing: the accepted tokens decide
    assert s.running[0].output == [3]
    assert s.running[0].num_computed == 2
    with pytest.raises(RuntimeError, match="resolve it first"):
        s.schedule()
    assert s.resolve(step, [[4, 7]]) == []
    assert s.running[0].output == [3, 4, 7]
    assert [(k, t) for k, _, t in step.filled] == [(0, 4), (1, 7)]
    assert np.asarray(s.schedule().token_ids).tolist() == [7]


@pytest.mark.slow  # the built-in model compiles ~20 programs (about 30 s)
def test_the_built_in_model_with_ngram_drafts_and_prefix_caching_decodes_greedily():
    """The demo Engine on an attention-only config (full, sliding window, GQA)
    with n-gram drafts and prefix caching: the dense oracle's greedy tokens,
    prefix hits on the shared prompt, and drafts accepted.
    """  # noqa: D205
    from flax import nnx

    import jaxkv.demo

    cfg = jaxkv.pattern_config(
        "GL",
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=8,
        sliding_window=16,
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(32,),  # one program
    )
    model = jaxkv.demo.TinyHybridModel(cfg, vocab_size=32, rngs=nnx.Rngs(0))
    engine = jaxkv.demo.Engine(
        cfg,
        model,
        num_blocks=48,
        enable_prefix_caching=True,
        drafter=NgramDrafter(num_speculative_tokens=4),
    )
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 32, 24).tolist()
    reqs = [
        jaxkv.demo.EngineRequest(
            f"e{i}",
            prompt=shared + rng.integers(1, 32, int(rng.integers(2, 9))).tolist(),
            max_new_tokens=12,
        )
        for i in range(4)
    ]
    engine.run(reqs)
    for r in reqs:
        assert r.output == jaxkv.demo.generate_dense(model, r.prompt, 12, 96), r.req_id
    stats = engine.scheduler.make_stats()
    assert stats.prefix_cache_stats.hits > 0
    assert stats.spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("bad", [0, -1, True])  # a float: the type hint
def test_a_builder_refuses_a_bad_samples_per_request(bad):
    plan, _, _ = _bigram()
    with pytest.raises(ValueError, match="samples_per_request must be an int >= 1"):
        jaxkv.StepMetadataBuilder(plan, model_inputs=True, samples_per_request=bad)
    builder = jaxkv.StepMetadataBuilder(plan, model_inputs=True, samples_per_request=4)
    assert builder.max_num_samples == 32  # 8 requests x 4 rows, within the budget
