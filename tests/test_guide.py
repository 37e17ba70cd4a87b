"""The integrator guide (docs/guide.md) runs as written and matches a dense model;
attention takes its window from the layer."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.helpers import reset_loop

README = pathlib.Path(__file__).parent.parent / "docs" / "guide.md"


@pytest.fixture(scope="module")
def guide():
    text = README.read_text()
    section = text.split("## Your own model and scheduler through jaxkv", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    glue = code.group(1).split("# --- the glue", 1)[1]
    assert len(glue.strip().splitlines()) <= 40  # the brief's bound on glue
    namespace: dict = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)  # noqa: S102
    return namespace


def _dense_generate(params, prompt, max_new_tokens, windows):
    """Greedy tokens of the guide's model without any cache (NumPy)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        x = np.asarray(params["embed"])[tokens]
        n = len(tokens)
        for w, window in zip(params["layers"], windows, strict=True):
            q, k, v = (np.einsum("td,dhk->thk", x, np.asarray(w[c])) for c in "qkv")
            k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) * 32**-0.5
            i, j = np.arange(n)[:, None], np.arange(n)[None]
            mask = (j <= i) & ((j > i - window) if window else True)
            s = np.where(mask[None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            x = x + np.einsum("hqk,khd->qhd", p, v).reshape(x.shape)
        tokens.append(int(np.argmax(x[-1] @ np.asarray(params["unembed"]))))
    return tokens[len(prompt) :]


def test_guide_matches_the_dense_model_and_reuses_the_prefix(guide):
    requests, params = guide["requests"], guide["params"]
    for req in requests:
        want = _dense_generate(params, req.prompt, req.max_new_tokens, (None, 32))
        assert req.output == want, req.req_id
    stats = guide["scheduler"].stats
    assert stats["cached_tokens"] > 0
    # One executable per bucket the guide meets (token buckets 4 and 64): the
    # builder pads from the first step, no warm-up call needed.
    assert guide["step"]._cache_size() == 2
    assert guide["scheduler"].manager.num_free_blocks == guide["budget"].num_blocks - 1


def test_attention_takes_the_window_from_the_layer(guide):
    plan, builder = guide["plan"], guide["builder"]
    layer = plan.attention_layer("l1")
    assert layer.sliding_window == 32
    assert plan.attention_layer("l0").sliding_window is None
    # One request of 100 tokens, random K/V in its blocks, a decode query.
    s = jaxkv.Scheduler(plan)
    s.add_request(jaxkv.Request("r", prompt=list(range(100)), max_new_tokens=1))
    step = s.schedule()
    while step.batch[0][0].num_computed + step.batch[0][1] < 100:
        s.update(step, [])
        step = s.schedule()
    inputs = builder.prepare(step)
    meta = builder.build(inputs)["l1"]
    rng = np.random.default_rng(0)
    pools = plan.allocate()
    slots = jnp.asarray(step.slot_mappings[1])
    kv = [jnp.asarray(rng.normal(size=(slots.size, 2, 32)), jnp.float32) for _ in "kv"]
    pools = jaxkv.write_kv(pools, layer.view, kv[0], kv[1], slots)
    q = jnp.asarray(rng.normal(size=(meta.slot_mapping.shape[0], 4, 32)), jnp.float32)

    def attend(view, **kw):
        return np.asarray(jaxkv.paged_attention(q, pools, view, meta, scale=0.2, **kw))

    from_layer = attend(layer)
    assert np.array_equal(from_layer, attend(layer.view, sliding_window=32))
    assert np.array_equal(from_layer, attend(layer, sliding_window=32))  # agrees
    # The bare view of a windowed layer without its window is refused (it
    # would read the blocks the manager already gave back as full attention).
    with pytest.raises(ValueError, match="pass the layer's AttentionLayer"):
        attend(layer.view)

    # A prefill bucket (64 tokens, 4 requests): query tiles of 16 by default.
    def program(**kw):
        return str(
            jax.make_jaxpr(
                lambda q, pools: jaxkv.paged_attention(
                    q, pools, layer, meta, scale=0.2, **kw
                )
            )(q, pools)
        )

    assert program() == program(query_tile=16) != program(query_tile=1)
    with pytest.raises(ValueError, match=r"sliding_window=16 contradicts layer 'l1'"):
        attend(layer, sliding_window=16)
    with pytest.raises(ValueError, match="logits_soft_cap=5.0 contradicts"):
        attend(layer, logits_soft_cap=5.0)


def test_soft_cap_and_cross_attention_come_from_the_layer():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="a",
                spec=spec,
                backend=jaxkv.get_backend("JAX_PAGED"),
                logits_soft_cap=30.0,
            )
        ]
    )
    layer = jaxkv.make_plan(cfg, num_blocks=4).attention_layer("a")
    assert (layer.logits_soft_cap, layer.cross_attention) == (30.0, False)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive"):
        jaxkv.LayerConfig(
            name="b",
            spec=spec,
            backend=jaxkv.get_backend("JAX_PAGED"),
            logits_soft_cap=-1.0,
        )


def test_a_mamba_view_is_refused_by_attention():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    with pytest.raises(TypeError, match="not an attention view"):
        plan.attention_layer("layers.2.mixer")
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=1, max_tokens=1, max_blocks=1)
    with pytest.raises(TypeError, match="MambaView"):
        jaxkv.paged_attention(
            jnp.zeros((1, 4, 32)),
            plan.allocate(),
            plan.views["layers.2.mixer"],
            meta,
            scale=1.0,
        )


@pytest.fixture(scope="module")
def served_guide():
    text = README.read_text()
    section = text.split("## Serve your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    glue = code.group(1).split("# --- the glue", 1)[1]
    assert len(glue.strip().splitlines()) <= 40  # the brief's bound, loop included
    namespace: dict = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)  # noqa: S102
    return namespace


def test_served_guide_matches_the_dense_model_and_compiles_once_per_bucket(
    served_guide,
):
    loop, params = served_guide["loop"], served_guide["params"]
    for req in served_guide["requests"]:
        want = _dense_generate(params, req.prompt, req.max_new_tokens, (None, 32))
        assert req.output == want, req.req_id
    assert loop.scheduler.stats["cached_tokens"] > 0
    assert len(served_guide["streamed"]) == 6 * 8
    # One executable per program of the buckets, compiled by warm_up; serving
    # more requests compiles nothing.
    assert len(loop.programs) == len(loop.builder.abstract_inputs())
    reset_loop(loop)
    with jaxkv.count_compilations() as compiles:
        loop.run([jaxkv.Request("x", prompt=[5] * 70, max_new_tokens=3)])
    assert compiles == []
