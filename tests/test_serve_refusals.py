"""What ServingLoop refuses, round 4: a forward that keeps none of its writes,
logits not exactly as wide as the vocabulary, sampling parameters checked by
value, a read-only ``decode_steps`` with a bound, ``reset()`` and unknown
request ids in ``run(sampling=...)``; each refusal leaves the loop serving.
"""  # noqa: D205

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

CFG = jaxkv.pattern_config(
    "G",
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_size=8,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    token_buckets=(4, 16),
)


def _forward(layer, *, keep_writes=True, width=8):
    def forward(params, pools, meta, tokens, sample):
        x = params[tokens]
        m = meta[layer.name]
        k = v = x[:, None, :]
        written = jaxkv.write_kv(pools, layer.view, k, v, m.slot_mapping)
        if keep_writes:
            pools = written
        q = jnp.repeat(x[:, None, :], 2, axis=1)
        out = jaxkv.paged_attention(q, pools, layer, m, scale=1.0)
        logits = out[sample, 0] @ params.T
        return pools, jnp.pad(logits, ((0, 0), (0, max(0, width - 8))))[:, :width]

    return forward


def _loop(**kw):
    plan = jaxkv.make_plan(CFG, num_blocks=8)
    layer = plan.attention_layer("layers.0.self_attn")
    forward = _forward(layer, **kw)
    return jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)


def _request(name="a"):
    return jaxkv.Request(name, prompt=[1, 2, 3], max_new_tokens=2)


def test_a_forward_that_returns_the_pools_it_was_given_is_refused():
    loop = _loop(keep_writes=False)
    with pytest.raises(ValueError, match="the very pools it was given"):
        loop.run([_request()])


@pytest.mark.parametrize("width", [7, 9])
def test_logits_must_be_exactly_as_wide_as_the_vocabulary(width):
    loop = _loop(width=width)
    with pytest.raises(ValueError, match=f"logits of {width} columns.*vocab_size is 8"):
        loop.run([_request()])


def test_sampling_parameters_are_checked_by_value():
    p = jaxkv.SamplingParams(
        temperature=np.float32(0.7),  # pyright: ignore[reportArgumentType]
        top_p=np.float64(0.9),
    )
    assert p.temperature == pytest.approx(0.7)
    assert type(p.temperature) is float
    assert type(p.top_p) is float
    numpy_ints = jaxkv.SamplingParams(
        top_k=np.int64(5),  # pyright: ignore[reportArgumentType]
        seed=np.int32(3),  # pyright: ignore[reportArgumentType]
    )
    assert numpy_ints.top_k == 5
    for bad in (float("inf"), float("nan"), -1.0, True, "0.7", np.bool_(True)):
        with pytest.raises(ValueError, match="temperature must be a finite"):
            jaxkv.SamplingParams(temperature=bad)  # pyright: ignore[reportArgumentType]
    for bad in (float("nan"), 0.0, 1.5, np.float32(2.0)):
        with pytest.raises(ValueError, match="top_p"):
            jaxkv.SamplingParams(temperature=1.0, top_p=bad)  # pyright: ignore[reportArgumentType]


def test_decode_steps_is_bounded_and_read_only():
    plan = jaxkv.make_plan(CFG, num_blocks=8)
    layer = plan.attention_layer("layers.0.self_attn")
    for bad in (0, -2, 10**6, 65, 2.0):
        with pytest.raises(ValueError, match=r"decode_steps must be an int in \[1, "):
            jaxkv.ServingLoop(
                plan,
                _forward(layer),
                jnp.eye(8),
                vocab_size=8,
                execution=jaxkv.ExecutionOptions(
                    decode_steps=bad  # pyright: ignore[reportArgumentType]
                ),
            )
    loop = jaxkv.ServingLoop(
        plan,
        _forward(layer),
        jnp.eye(8),
        vocab_size=8,
        execution=jaxkv.ExecutionOptions(decode_steps=64),
    )
    with pytest.raises(AttributeError):
        loop.decode_steps = 0
    assert loop.decode_steps == 64


def test_reset_inside_on_token_is_refused_and_the_run_completes():
    loop = _loop()
    errors = []

    def on_token(req, token):
        try:
            loop.reset()
        except RuntimeError as err:
            errors.append(str(err))

    (done,) = loop.run([_request()], on_token=on_token)
    assert errors
    assert "cannot reset inside run()" in errors[0]
    assert done.status == jaxkv.RequestStatus.FINISHED
    assert len(done.output) == 2


def test_sampling_for_an_unknown_request_id_is_refused_before_anything_runs():
    loop = _loop()
    with pytest.raises(ValueError, match=r"sampling names request ids \['b'\]"):
        loop.run([_request("a")], sampling={"b": jaxkv.SamplingParams()})
    assert not loop.has_unfinished
    assert loop.run([_request("a")])[0].output == [3, 3]


def test_warm_up_compiles_the_decode_of_max_num_seqs_requests_at_once():
    cfg = dataclasses.replace(CFG, request_buckets=(1, 2))  # one program each
    plan = jaxkv.make_plan(cfg, num_blocks=16)
    layer = plan.attention_layer("layers.0.self_attn")
    loop = jaxkv.ServingLoop(
        plan,
        _forward(layer),
        jnp.eye(8),
        vocab_size=8,
        execution=jaxkv.ExecutionOptions(decode_steps=4),
    )
    loop.warm_up()
    reqs = [
        jaxkv.Request(f"r{i}", prompt=[1, 2, 3], max_new_tokens=9) for i in range(2)
    ]
    with jaxkv.count_compilations() as compiles:
        done = loop.run(reqs)  # both decode together: max_num_seqs = 2
    assert [len(r.output) for r in done] == [9, 9]
    assert loop.counters["decode_iterations"] > 0
    assert compiles == []


def test_partial_prefills_count_the_steps_that_leave_a_prompt_unfinished():
    loop = _loop()
    loop.run([jaxkv.Request("short", prompt=[1, 2, 3], max_new_tokens=2)])
    assert loop.counters["partial_prefills"] == 0  # done in one chunk
    # 20 prompt tokens in chunks of at most 16: one partial step, then the rest.
    loop.run([jaxkv.Request("long", prompt=[1] * 20, max_new_tokens=2)])
    assert loop.counters["partial_prefills"] == 1
