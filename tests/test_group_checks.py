"""Metadata knows its KV-cache group: a layer stack never spans groups, and
``paged_attention`` refuses another group's metadata, on a Gemma-like
"LLLLLG" model (local layers in several groups) and a two-group one.
"""  # noqa: D205

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv


def _plan(pattern, num_layers):
    cfg = jaxkv.pattern_config(
        pattern,
        num_layers=num_layers,
        sliding_window=8,
        num_heads=2,
        num_kv_heads=1,
        head_size=8,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        token_buckets=(16,),
    )
    return jaxkv.make_plan(cfg, num_blocks=16, storage="stacked")


def _metadata(plan):
    builder = jaxkv.StepMetadataBuilder(plan)
    sched = jaxkv.Scheduler(plan)
    sched.add_request(jaxkv.Request("a", prompt=[1, 2, 3, 4, 5], max_new_tokens=1))
    inputs = builder.prepare(sched.schedule())
    return jax.jit(builder.metadata)(inputs)


def test_a_stack_of_local_layers_from_several_groups_is_refused():
    plan = _plan("LLLLLG", 6)
    local = [f"layers.{i}.self_attn" for i in range(5)]
    groups = {plan.group_of(n) for n in local}
    assert len(groups) > 1  # the local layers sit in several groups
    with pytest.raises(ValueError, match=r"\(KV-cache group \d\).*read different"):
        plan.layer_stack(local)
    # Each group's layers stack on their own.
    for g in groups:
        names = [n for n in local if plan.group_of(n) == g]
        assert plan.layer_stack(names).layer.group == g


def test_another_groups_metadata_is_refused_by_paged_attention():
    plan = _plan("LLGG", 4)
    meta = _metadata(plan)
    local = plan.attention_layer("layers.0.self_attn")
    glob = plan.attention_layer("layers.2.self_attn")
    assert (local.group, glob.group) == (0, 1)
    assert meta[local.name].group == 0
    assert meta[glob.name].group == 1
    q = jnp.zeros((16, 2, 8), jnp.float32)
    pools = plan.allocate()
    out = jaxkv.paged_attention(q, pools, glob, meta[glob.name], scale=1.0)
    assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match=r"layers.2.self_attn.*group 1.*group 0"):
        jaxkv.paged_attention(q, pools, glob, meta[local.name], scale=1.0)
    # Inside a scan over one group's stack, the stack's layer carries it too.
    stack = plan.layer_stack(["layers.2.self_attn", "layers.3.self_attn"])
    with pytest.raises(ValueError, match="reads KV-cache group 1"):
        jaxkv.paged_attention(
            q, pools, stack.layer, meta[local.name], scale=1.0, layer=jnp.int32(1)
        )


def test_write_kv_takes_a_layer_and_its_metadata_and_refuses_another_groups():
    plan = _plan("LLGG", 4)
    meta = _metadata(plan)
    local = plan.attention_layer("layers.0.self_attn")
    glob = plan.attention_layer("layers.2.self_attn")
    k = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 1, 8)
    # The layer and its own group's metadata write what the bare view and
    # its slot mapping write.
    want = jaxkv.write_kv(
        plan.allocate(), glob.view, k, -k, meta[glob.name].slot_mapping
    )
    got = jaxkv.write_kv(plan.allocate(), glob, k, -k, meta[glob.name])
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"layers.2.self_attn.*group 1.*group 0"):
        jaxkv.write_kv(plan.allocate(), glob, k, -k, meta[local.name])
    stack = plan.layer_stack(["layers.2.self_attn", "layers.3.self_attn"])
    with pytest.raises(ValueError, match="writes KV-cache group 1"):
        jaxkv.write_kv(
            plan.allocate(), stack.layer, k, -k, meta[local.name], layer=jnp.int32(1)
        )


def test_a_bare_view_refuses_another_groups_metadata_record():
    # The bare view carries the groups bound to it (bind_kv_caches), so a
    # record of another group is refused there too (was served, off by 1.27).
    plan = _plan("LLGG", 4)
    meta = _metadata(plan)
    glob = plan.attention_layer("layers.2.self_attn")
    assert glob.view.groups == (1,)
    assert plan.attention_layer("layers.0.self_attn").view.groups == (0,)
    k = jnp.ones((16, 1, 8), jnp.float32)
    q = jnp.zeros((16, 2, 8), jnp.float32)
    pools = jaxkv.write_kv(plan.allocate(), glob.view, k, k, meta[glob.name])
    jaxkv.paged_attention(q, pools, glob.view, meta[glob.name], scale=1.0)
    other = meta["layers.0.self_attn"]
    with pytest.raises(ValueError, match=r"write_kv: the view .*\(s\) \[1\].*group 0"):
        jaxkv.write_kv(plan.allocate(), glob.view, k, k, other)
    with pytest.raises(ValueError, match=r"paged_attention: the view .*\[1\].*group 0"):
        jaxkv.paged_attention(q, pools, glob.view, other, scale=1.0)
    # A bare slot array has no group: vLLM's reshape_and_cache form, unchecked.
    jaxkv.write_kv(plan.allocate(), glob.view, k, k, other.slot_mapping)


def test_kv_sharing_layers_mark_their_targets_group_on_the_shared_view():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    for name, view in plan.views.items():
        if isinstance(view, jaxkv.KVCacheView):
            assert view.groups == (plan.group_of(name),), name
