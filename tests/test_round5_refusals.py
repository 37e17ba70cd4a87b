"""Round 5 (issue 56): options above the config refused when the loop is built
or reset, and a refused reset leaves the loop serving; options of the wrong
kind (``"no"`` for a bool) named; the scheduler's own budgets bounded by the
config the step buffers are sized to.
"""  # noqa: D205

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.test_serve_refusals import CFG, _forward, _request

# Two global-attention layers (the forward-write checks' model).
TWO_LAYERS = jaxkv.pattern_config(
    "GG",
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_size=8,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    token_buckets=(4, 16),
)


def _loop(**kw):
    plan = jaxkv.make_plan(CFG, num_blocks=8)
    layer = plan.attention_layer("layers.0.self_attn")
    return jaxkv.ServingLoop(plan, _forward(layer), jnp.eye(8), vocab_size=8, **kw)


@pytest.mark.parametrize(
    ("option", "value", "limit"),
    [("max_num_seqs", 100, 2), ("max_num_batched_tokens", 10**6, 16)],
)
def test_a_budget_above_the_config_is_refused_when_the_loop_is_built(
    option, value, limit
):
    opts = jaxkv.SchedulingOptions(**{option: value})
    with pytest.raises(ValueError, match=rf"{option}={value} is above.*{limit}"):
        _loop(scheduling=opts)
    plan = jaxkv.make_plan(CFG, num_blocks=8)
    with pytest.raises(ValueError, match=rf"{option}={value} is above"):
        jaxkv.Scheduler(plan, **{option: value})


def test_a_refused_reset_leaves_the_loop_serving():
    loop = _loop()
    want = loop.run([_request("a")])[0].output
    with pytest.raises(ValueError, match="max_num_seqs=100 is above"):
        loop.reset(scheduling=jaxkv.SchedulingOptions(max_num_seqs=100))
    assert loop.scheduling == jaxkv.SchedulingOptions()
    loop.reset()  # a valid reset still works
    assert loop.run([_request("b")])[0].output == want
    # A budget at or below the config's is taken.
    loop.reset(scheduling=jaxkv.SchedulingOptions(max_num_seqs=1))
    assert loop.scheduler.max_num_seqs == 1
    assert loop.run([_request("c")])[0].output == want


@pytest.mark.parametrize(
    ("record", "kw", "name"),
    [
        (jaxkv.ExecutionOptions, {"overlap": "no"}, "overlap"),
        (jaxkv.ExecutionOptions, {"record_logits": 1}, "record_logits"),
        (jaxkv.SchedulingOptions, {"enable_prefix_caching": "yes"}, "prefix"),
        (jaxkv.SchedulingOptions, {"scheduler_reserve_full_isl": None}, "isl"),
        (jaxkv.SchedulingOptions, {"max_num_seqs": 2.5}, "max_num_seqs"),
        (jaxkv.SchedulingOptions, {"host_blocks": -1}, "host_blocks"),
        (jaxkv.SchedulingOptions, {"policy": "lifo"}, "policy"),
    ],
)
def test_an_option_of_the_wrong_kind_is_named(record, kw, name):
    with pytest.raises((TypeError, ValueError), match=name):
        record(**kw)


@pytest.mark.parametrize("value", ["yes", None, 1])
def test_set_overlap_takes_a_bool_only(value):
    loop = _loop()
    before = loop.execution.overlap
    # (under the suite, beartype names the argument first; alone, jaxkv does)
    with pytest.raises(TypeError, match="value"):
        loop.set_overlap(value)
    assert loop.execution.overlap == before


def _attention_case():
    from tests.attention_cases import CASES, build

    return build(next(c for c in CASES if c.name == "decode_fused_f32"))


@pytest.mark.parametrize("implementation", [None, "xla", "native", "pallas"])
def test_attention_refuses_a_q_shorter_than_the_metadata_or_not_float(
    implementation,
):
    built = _attention_case()
    kw = {**built.kw, "layer": built.layer, "implementation": implementation}
    n = built.q.shape[0]
    with pytest.raises(ValueError, match=f"q has {n - 1} tokens, but meta is for {n}"):
        jaxkv.paged_attention(
            built.q[: n - 1], built.pools, built.view, built.meta, **kw
        )
    with pytest.raises(TypeError, match="q has dtype int32"):
        jaxkv.paged_attention(
            built.q.astype(jnp.int32), built.pools, built.view, built.meta, **kw
        )
    with pytest.raises(ValueError, match=r"q must be \(num_tokens, num_heads"):
        jaxkv.paged_attention(built.q[:, 0], built.pools, built.view, built.meta, **kw)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("query_tile", 0),
        ("query_tile", -1),
        ("query_tile", 2.5),
        ("query_tile", True),
        ("pages_per_chunk", 0),
        ("pages_per_chunk", -2),
        ("pages_per_chunk", True),
    ],
)
def test_attention_refuses_a_tile_or_chunk_that_is_not_a_positive_int(option, value):
    built = _attention_case()
    kw = {**built.kw, "layer": built.layer, option: value}
    with pytest.raises((ValueError, TypeError), match=option):
        jaxkv.paged_attention(built.q, built.pools, built.view, built.meta, **kw)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("sliding_window", 0),
        ("sliding_window", True),
        ("attention_chunk_size", -8),
        ("logits_soft_cap", 0.0),
        ("logits_soft_cap", "30"),
        ("cross_attention", "yes"),
        ("use_mm_prefix", None),
        ("scale", "0.1"),
        ("scale", True),
    ],
)
def test_attention_names_a_mask_option_or_scale_of_the_wrong_kind(option, value):
    built = _attention_case()
    kw = {**built.kw, "layer": built.layer, option: value}
    with pytest.raises((ValueError, TypeError), match=option):
        jaxkv.paged_attention(built.q, built.pools, built.view, built.meta, **kw)
    with pytest.raises(TypeError, match="meta must be the layer's"):
        jaxkv.paged_attention(built.q, built.pools, built.view, {}, **built.kw)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("stops", [(8,), (3, 100), (-1,)])
def test_stop_token_ids_outside_the_vocabulary_are_refused(stops):
    plan = jaxkv.make_plan(CFG, num_blocks=8)
    scheduler = jaxkv.Scheduler(plan, vocab_size=8)
    req = jaxkv.Request("a", prompt=[1, 2], max_new_tokens=2, stop_token_ids=stops)
    assert not scheduler.add_request(req)
    assert "stop_token_ids must be in [0, 8)" in str(req.reject_reason)
    ok = jaxkv.Request("b", prompt=[1, 2], max_new_tokens=2, stop_token_ids=(7,))
    assert scheduler.add_request(ok)


@pytest.mark.parametrize("bad", [1.5, True, "1"])
def test_a_block_id_that_is_not_an_int_is_named_and_changes_nothing(bad):
    from jaxkv.sched import BlockAllocator

    blocks = BlockAllocator(8)
    held = blocks.allocate(2)
    queue = blocks.free_queue()
    for call in (blocks.free, blocks.touch):
        with pytest.raises(TypeError, match="is not an int"):
            call([held[0], bad])
        assert blocks.free_queue() == queue
    blocks.free(held)  # each still held once


def test_vllm_namespace_has_build_slot_mappings_by_layer():
    import jaxkv.vllm

    assert jaxkv.vllm.build_slot_mappings_by_layer is (
        jaxkv.plan.build_slot_mappings_by_layer
    )
    assert "build_slot_mappings_by_layer" in jaxkv.vllm.__all__


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"num_layers": -1}, "num_layers must be positive"),
        ({"num_heads": 3}, "num_heads=3 is not a multiple of num_kv_heads=2"),
        ({"num_kv_heads": 0}, "num_kv_heads must be positive"),
    ],
)
def test_pattern_config_names_a_layer_or_head_count_it_cannot_build(kw, match):
    args = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_size": 8, **kw}
    with pytest.raises(ValueError, match=match):
        jaxkv.pattern_config("G", **args)


def test_an_empty_block_copy_is_a_no_op():
    plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2), num_blocks=8)
    pools = plan.allocate()
    out = jaxkv.copy_blocks(pools, plan, src=[], dst=[])
    assert all(a is b for a, b in zip(out, pools, strict=True))


def test_the_default_picks_the_kernels_only_for_views_they_can_run():
    # Head 96 is not a power of two: both kernels pad it (issue 55); a word
    # pool neither kernel can address stays on XLA's path everywhere.
    from jaxkv.attention._call import Call
    from jaxkv.attention._rows import Mask

    cfg = jaxkv.llama_like_config(num_layers=1, head_size=96)
    call = Call(Mask(True, None, None, False, False), 1.0, None, None, 1, "auto")
    picks = {}
    for storage in ("stacked", "words"):
        plan = jaxkv.make_plan(cfg, num_blocks=4, storage=storage)
        view = plan.attention_layer("layers.0.self_attn").view
        choice = jaxkv.attention.choose_implementation(None, view, call, (4, 4, 96))
        picks[storage] = [choice.on(p) for p in ("cuda", "tpu", "cpu")]
    assert picks == {
        "stacked": ["pallas_gpu", "pallas_tpu", "xla"],
        "words": ["xla", "xla", "xla"],
    }


@pytest.mark.parametrize(
    ("pattern", "full", "sliding"),
    [
        # 2 full + 3 sliding: groups of the smaller count (3 is not < 2 x 1.5)
        ("GGLLL", [2], [2, 1]),
        # 4 + 6: the same rule at the boundary (6 is not < 4 x 1.5)
        ("GGGGLLLLLL", [4], [3, 3]),
        # 2 + 2 and 4 + 5: within 1.5x, groups of the larger count
        ("GGLL", [2], [2]),
        ("GGGGLLLLL", [4], [5]),
    ],
)
def test_hybrid_layers_group_as_vllm_groups_them(pattern, full, sliding):
    cfg = jaxkv.pattern_config(
        pattern,
        num_layers=len(pattern),
        num_heads=2,
        num_kv_heads=1,
        head_size=8,
        sliding_window=16,
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
    sizes = {"FullAttentionSpec": [], "SlidingWindowSpec": []}
    for g in kv.kv_cache_groups:
        sizes[type(g.kv_cache_spec).__name__].append(len(g.layer_names))
    assert sizes == {"FullAttentionSpec": full, "SlidingWindowSpec": sliding}


def test_a_windowed_and_a_chunked_full_spec_do_not_merge():
    kw = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": "float32"}
    windowed = jaxkv.FullAttentionSpec(sliding_window=32, **kw)
    chunked = jaxkv.FullAttentionSpec(attention_chunk_size=32, **kw)
    assert jaxkv.vllm.merge_specs([windowed, chunked]) is None
    assert jaxkv.vllm.merge_specs([windowed, jaxkv.FullAttentionSpec(**kw)]) == windowed


def test_lookahead_slots_stop_at_max_model_len():
    # max_model_len 64, block 16: a request never holds more than 4 blocks,
    # however many lookahead slots are asked for near its end.
    plan = jaxkv.make_plan(CFG, num_blocks=16)
    scheduler = jaxkv.Scheduler(plan, num_lookahead_tokens=3)
    req = jaxkv.Request("a", prompt=list(range(1, 61)), max_new_tokens=4)
    assert scheduler.add_request(req)
    builder = jaxkv.StepMetadataBuilder(plan)
    for _ in range(20):
        step = scheduler.schedule()
        if not step.batch:
            break
        builder.prepare(step)
        for table in scheduler.manager.blocks_of(req):
            assert len(table) <= 4, table
        scheduler.update(step, [1] * len(step.sampled))
        if req.finished:
            break
    assert req.finished


def test_a_request_live_at_reset_is_finished_not_left_running():
    loop = _loop()
    running = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=8)
    waiting = jaxkv.Request("b", prompt=[1, 2], max_new_tokens=8)
    third = jaxkv.Request("c", prompt=[3], max_new_tokens=8)
    for r in (running, waiting, third):
        assert loop.submit(r)
    loop.step()
    loop.step()
    assert running.status is jaxkv.RequestStatus.RUNNING
    loop.reset()
    for r in (running, waiting, third):
        assert r.status is jaxkv.RequestStatus.FINISHED, r
    assert loop.run([_request("d")])[0].output


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kernel_block_size": 0}, "kernel_block_size must be positive"),
        ({"kernel_block_size": -64}, "kernel_block_size must be positive"),
        ({"num_blocks": 0}, "num_blocks must be positive"),
        ({"num_blocks": -3}, "num_blocks must be positive"),
        ({"offset": -68}, "offset must be >= 0"),
        ({"pool": -1}, "pool must be >= 0"),
        ({"block_stride": 0}, "block_stride must be positive"),
        ({"block_stride": 1020}, "shorter than a page of 1088 bytes"),
    ],
)
def test_packed_view_names_a_count_offset_or_stride_it_cannot_lay_out(kw, match):
    spec = jaxkv.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=68,
        dtype="uint8",
        state_content_bytes=68,
        tokens_per_state=4,
    )
    args = {
        "pool": 0,
        "num_blocks": 3,
        "block_stride": spec.page_size_bytes,
        "offset": 0,
        "kernel_block_size": 64,
        **kw,
    }
    with pytest.raises(ValueError, match=match):
        jaxkv.plan.packed_view("idx", spec, **args)


def test_layer_stack_refuses_a_layer_given_twice():
    plan = jaxkv.make_plan(
        jaxkv.llama_like_config(num_layers=3), num_blocks=4, storage="stacked"
    )
    with pytest.raises(ValueError, match=r"'layers.1.self_attn'\] given more"):
        plan.layer_stack(["layers.0.self_attn", "layers.1.self_attn"] * 2)


def test_read_view_of_a_mamba_state_is_named():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    mamba = next(v for v in plan.views.values() if isinstance(v, jaxkv.MambaView))
    with pytest.raises(TypeError, match="read_view"):
        jaxkv.read_view(plan.allocate(), mamba)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"word": 3}, "word must be a pool carrier word"),
        ({"num_blocks": 0}, "positive"),
    ],
)
def test_allocate_layer_tensors_names_a_word_or_block_count_it_cannot_use(kw, match):
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    tensor = jaxkv.vllm.LayerTensor(
        size=2 * 4 * spec.page_size_bytes,
        layers=("a", "b"),
        layer_stride=4 * spec.page_size_bytes,
        block_stride=spec.page_size_bytes,
    )
    args = {"num_blocks": 4, "layout": jaxkv.vllm.TensorLayout.LBNHC, **kw}
    with pytest.raises(ValueError, match=match):
        jaxkv.vllm.allocate_layer_tensors([tensor], {"a": spec, "b": spec}, **args)


def test_the_native_library_key_changes_with_the_cpu_and_the_compiler(monkeypatch):
    import jaxkv._native as native

    key = native._library_key("g++")
    assert native._library_key("g++") == key  # stable
    assert native._library_key("clang++") != key
    monkeypatch.setattr(native, "_cpu_flags", lambda: "fpu sse2")  # another CPU
    assert native._library_key("g++") != key


def test_a_cached_library_without_a_matching_record_is_rebuilt_not_loaded(
    monkeypatch, tmp_path
):
    # Fast: the compiler is never run; reaching it means the bad entry was
    # refused (the slow test loads and runs a real rebuilt library).
    import subprocess

    import jaxkv._native as native

    class Rebuilt(Exception):
        pass

    def no_compile(*args, **kwargs):
        raise Rebuilt

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: "g++")
    monkeypatch.setattr(subprocess, "run", no_compile)
    lib = tmp_path / f"kernels-{native._library_key('g++')}.so"
    lib.write_bytes(b"\x7fELF truncated")  # no record beside it
    with pytest.warns(RuntimeWarning, match="rebuilding it"):
        with pytest.raises(Rebuilt):
            native.build()


def test_a_layer_stack_view_without_layer_is_refused_by_every_access():
    # The stack's layer stands for every layer: forgetting layer= in one
    # call (the write, say) would address the first layer while the
    # attention reads the traced one. Each access names the slot or refuses.
    cfg = jaxkv.llama_like_config(num_layers=2, num_kv_heads=2, head_size=16)
    plan = jaxkv.make_plan(cfg, num_blocks=4, storage="stacked")
    stack = plan.layer_stack(["layers.0.self_attn", "layers.1.self_attn"])
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=1, max_tokens=2, max_blocks=2)
    k = jnp.ones((2, 2, 16), jnp.float32)
    q = jnp.ones((2, 4, 16), jnp.float32)
    slots = jnp.array([16, 17], jnp.int32)
    calls = {
        "write_kv": lambda pools, **kw: jaxkv.write_kv(
            pools, stack.layer.view, k, k, slots, **kw
        ),
        "paged_attention": lambda pools, **kw: jaxkv.paged_attention(
            q, pools, stack.layer, meta, scale=1.0, **kw
        ),
        "gather_kv_pages": lambda pools, **kw: jaxkv.gather_kv_pages(
            pools, stack.layer.view, jnp.array([[1]], jnp.int32), **kw
        ),
    }
    for call in calls.values():
        pools = plan.allocate()
        with pytest.raises(ValueError, match="layer stack"):
            call(pools)
        call(plan.allocate(), layer=jnp.int32(1))  # named: fine
    # A layer's own view (not a stack's) keeps its slot without layer=.
    own = plan.attention_layer("layers.1.self_attn")
    pools = jaxkv.write_kv(plan.allocate(), own.view, k, k, slots)
    kp, _ = jaxkv.gather_kv_pages(pools, stack.layer.view, jnp.array([[1]]), layer=1)
    assert float(kp[0, 0, 0].sum()) == 32.0


def _two_layer_loop(*, drop=None, skip=None, stacked=False):
    cfg = TWO_LAYERS
    plan = jaxkv.make_plan(cfg, num_blocks=8, storage="stacked" if stacked else "words")
    names = list(plan.views)
    stack = plan.layer_stack(names) if stacked else None

    def attend(pools, layer, m, x, slot=None):
        k = v = x[:, None, :]
        kw = {} if slot is None else {"layer": slot}
        written = jaxkv.write_kv(pools, layer, k, v, m, **kw)
        q = jnp.repeat(x[:, None, :], 2, axis=1)
        out = jaxkv.paged_attention(q, written, layer, m, scale=1.0, **kw)
        return written, x + out[:, 0]

    def forward(params, pools, meta, tokens, sample):
        x = params[tokens]
        if stack is not None:  # one write in a scan covers every slot
            layer = stack.layer

            def body(carry, slot):
                pools, x = carry
                return attend(pools, layer, meta[names[0]], x, slot), None

            (pools, x), _ = jax.lax.scan(body, (pools, x), stack.slots)
            return pools, x[sample] @ params.T
        for name in names:
            if name == skip:
                continue
            written, x = attend(pools, plan.attention_layer(name), meta[name], x)
            pools = pools if name == drop else written
        return pools, x[sample] @ params.T

    return jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)


def test_a_forward_that_skips_or_drops_one_layers_write_is_refused_by_name():
    request = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="never writes layer 'layers.1.self_attn'"):
        _two_layer_loop(skip="layers.1.self_attn").submit(request)
    loop = _two_layer_loop(drop="layers.0.self_attn")
    with pytest.raises(ValueError, match="'layers.0.self_attn'.*do not keep"):
        loop.warm_up()
    with pytest.raises(ValueError, match="'layers.0.self_attn'.*do not keep"):
        loop.submit(request)
    assert not loop.has_unfinished  # refused before it was queued
    # Every write kept (one layer at a time, or one write per slot in a scan
    # over a layer stack): served.
    for loop in (_two_layer_loop(), _two_layer_loop(stacked=True)):
        [done] = loop.run([jaxkv.Request("b", prompt=[1, 2, 3], max_new_tokens=2)])
        assert len(done.output) == 2


def test_a_preempted_requests_lookups_count_in_the_totals_and_apart():
    # As vLLM's PrefixCacheStats: a re-admitted request's lookup counts in
    # the totals and in the preempted_* figures.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=10)
    s = jaxkv.Scheduler(
        plan, enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=4
    )
    reqs = [
        jaxkv.Request(f"r{i}", prompt=list(range(1, 30)), max_new_tokens=40)
        for i in range(3)
    ]
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished:
        step = s.schedule()
        s.update(step, [5] * len(step.sampled))
    st = s.make_stats().prefix_cache_stats
    readmitted = sum(r.num_preemptions for r in reqs)
    assert readmitted > 0
    assert st.preempted_requests == readmitted
    assert st.requests == len(reqs) + readmitted
    assert st.queries - st.preempted_queries == 3 * 29  # the fresh lookups
    assert st.preempted_queries >= readmitted * 29
    assert st.hits >= st.preempted_hits > 0


def test_generation_tokens_leave_out_placeholders_still_on_the_device():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    s = jaxkv.Scheduler(plan)
    r = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=10)
    s.add_request(r)
    first = s.schedule()
    s.advance(first)  # async: the token is a placeholder until resolve
    assert r.num_pending == 1
    assert s.make_stats().num_generation_tokens == 0
    s.resolve(first, [4])
    assert s.make_stats().num_generation_tokens == 1


def test_an_allocation_far_past_the_free_blocks_is_refused_without_listing_it():
    # 10**12 tokens: listing their 6 * 10**10 columns first would not end.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    manager = jaxkv.KVCacheManager(plan)
    r = jaxkv.Request("a", prompt=[1] * 10, max_new_tokens=5)
    free = manager.num_free_blocks
    assert manager.allocate(r, 10**12) is False
    assert manager.num_free_blocks == free
    assert manager.allocate(r, 10)  # the request is untouched: it still fits


def test_a_layer_written_by_a_kernel_of_your_own_counts_as_written():
    # put_kernel_cache (a write-fused kernel's cache put back) is a write:
    # layer 0 by write_kv, layer 1 by hand through its kernel cache; dropping
    # the latter is named as any other.
    cfg = TWO_LAYERS
    plan = jaxkv.make_plan(cfg, num_blocks=8, storage="typed")
    a, b = (plan.attention_layer(n) for n in plan.views)

    def make(keep_b):
        def forward(params, pools, meta, tokens, sample):
            x = params[tokens]
            pools = jaxkv.write_kv(pools, a, x[:, None], x[:, None], meta[a.name])
            cache = jaxkv.kernel_cache(pools, b.view)
            put = jaxkv.put_kernel_cache(pools, b.view, cache + 0)
            pools = put if keep_b else pools
            q = jnp.repeat(x[:, None, :], 2, axis=1)
            out = jaxkv.paged_attention(q, pools, a, meta[a.name], scale=1.0)
            return pools, out[sample, 0] @ params.T

        return jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)

    make(True).warm_up()
    with pytest.raises(ValueError, match="'layers.1.self_attn'.*do not keep"):
        make(False).warm_up()


def test_a_freed_request_or_one_computed_past_its_blocks_is_refused():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    manager = jaxkv.KVCacheManager(plan)
    # Allocated again after free: its K/V is gone; it starts again at 0.
    r = jaxkv.Request("a", prompt=[1] * 10, max_new_tokens=5)
    manager.allocate(r, 10)
    r.num_computed = 10
    manager.commit(r)
    manager.free(r)
    free = manager.num_free_blocks
    with pytest.raises(ValueError, match="'a' has 10 computed tokens but holds no"):
        manager.allocate(r, 1)
    assert manager.num_free_blocks == free
    r.num_computed = 0
    assert manager.allocate(r, 10)
    # Computed past what it holds (block 32: 4 tokens allocated, 40 counted).
    b = jaxkv.Request("b", prompt=[1] * 40, max_new_tokens=5)
    manager.allocate(b, 4)
    b.num_computed = 40
    free = manager.num_free_blocks
    with pytest.raises(ValueError, match="counts 40 computed tokens, but group 0"):
        manager.commit(b)
    assert manager.num_free_blocks == free


def test_layer_tensors_naming_a_layer_twice_no_layer_or_an_unknown_one_are_refused():
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    page = spec.page_size_bytes

    def tensors(*names):
        return [
            jaxkv.vllm.LayerTensor(
                size=2 * 4 * page, layers=n, layer_stride=4 * page, block_stride=page
            )
            for n in names
        ]

    specs = dict.fromkeys(["a", "b", "c"], spec)
    kw = {"num_blocks": 4, "layout": jaxkv.vllm.TensorLayout.LBNHC}
    for bad, match in (
        (tensors(("a", "b"), ("b", "c")), "'b' is in tensor 0 and again in tensor 1"),
        (tensors(("a", "a")), "'a' is in tensor 0 and again in tensor 0"),
        (tensors(()), "tensor 0 names no layer"),
        (tensors(("a", "zzz")), r"no spec for layers \['zzz'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            jaxkv.vllm.allocate_layer_tensors(bad, specs, **kw)
    _, views = jaxkv.vllm.allocate_layer_tensors(tensors(("a", "b")), specs, **kw)
    assert set(views) == {"a", "b"}


def test_a_word_view_on_a_pool_of_another_carrier_word_is_named():
    plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1), num_blocks=4)
    view = plan.views["layers.0.self_attn"]  # uint32 words
    as_bytes = tuple(jnp.zeros(p.nbytes, jnp.uint8) for p in plan.allocate())
    with pytest.raises(ValueError, match=r"4-byte carrier words \(uint32\).*uint8"):
        jaxkv.gather_kv_pages(as_bytes, view, jnp.array([[1]]))


@pytest.mark.parametrize(
    ("kernel", "given", "ok"),
    [(None, 8, False), (None, 4, False), (4, 8, True), (4, 2, False)],
)
def test_init_kv_cache_refuses_kernel_blocks_its_attention_groups_do_not_read(
    kernel, given, ok
):
    # Views at another kernel granularity than the attention groups' address
    # other pages (was accepted: [8] with groups reading blocks of 16).
    backend = jaxkv.AttentionBackend(
        name=f"K{kernel}",
        layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(kernel or jaxkv.vllm.MultipleOf(1),),
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32"
    )
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name="l", spec=spec, backend=backend)]
    )
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
    groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
    assert sizes == [16 if kernel is None else 4]
    jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
    if ok:
        jaxkv.vllm.init_kv_cache(kv, cfg, [given], groups)
    else:
        match = rf"kernel_block_sizes\[0\]={given} disagrees"
        with pytest.raises(ValueError, match=match):
            jaxkv.vllm.init_kv_cache(kv, cfg, [given], groups)


def _tampered(kv, how):
    name = "layers.0.self_attn"
    layer = kv.attention[name]

    def with_layer(**change):
        return {
            "attention": {**kv.attention, name: dataclasses.replace(layer, **change)}
        }

    mixer = "layers.2.mixer"
    return dataclasses.replace(
        kv,
        **{
            "more_tokens": lambda: {"num_tokens": 9},
            "no_tokens": lambda: {"num_tokens": 0},
            "short_values": lambda: with_layer(values=layer.values[:3]),
            "short_present": lambda: with_layer(present=np.ones(4, bool)),
            "int_present": lambda: with_layer(present=np.ones(5, np.int32)),
            "unbatched_state": lambda: {
                "states": {**kv.states, mixer: tuple(x[0] for x in kv.states[mixer])}
            },
        }[how](),
    )


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("more_tokens", r"layers.0.self_attn'.*keys.*\(5, 2, 32\).*num_tokens=9"),
        ("no_tokens", r"kv.num_tokens must be a positive int"),
        ("short_values", r"values.*\(3, 2, 32\)"),
        ("short_present", r"present.*\(4,\)"),
        ("int_present", r"present must be \(5,\) bools"),
        ("unbatched_state", r"layers.2.mixer'.*state 0.*\(1, \.\.\.\)"),
    ],
)
def test_a_tampered_request_kv_is_named_before_anything_is_written(how, match):
    # Was: write_kv's shape error, a numpy broadcast, or blame on the blocks.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
    ids = [[1], [2], [3]]
    pools = plan.allocate()
    kv = jaxkv.transfer.export_request(plan, pools, block_ids=ids, num_tokens=5)
    bad = _tampered(kv, how)
    pools = plan.allocate()
    with pytest.raises(ValueError, match=match):
        jaxkv.transfer.import_request(plan, pools, bad, block_ids=ids)
    assert all(not p.is_deleted() for p in pools)  # refused before the donation


def test_a_block_freed_twice_in_one_call_changes_nothing():
    a = jaxkv.sched.BlockAllocator(8)
    x, y = a.allocate(2)
    before = (a.num_free, a.ref_count(x), a.ref_count(y))
    with pytest.raises(ValueError, match=f"Block id {x} is freed 2 times but held 1"):
        a.free([y, x, x])
    assert (a.num_free, a.ref_count(x), a.ref_count(y)) == before


def test_pictures_name_a_config_given_for_a_plan():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    from jaxkv.pictures import byte_map

    with pytest.raises(TypeError, match="byte_map: plan must be a KVCachePlan.*Config"):
        byte_map(plan.kv_cache_config)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("implementation", [None, "xla", "pallas"])
def test_attention_on_an_empty_batch_is_empty(implementation):
    # Was a numpy reduction error from the chunk range.
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    layer = plan.attention_layer("layers.0.self_attn")
    meta = jaxkv.CommonAttentionMetadata.empty(max_reqs=2, max_tokens=0, max_blocks=2)
    out = jaxkv.paged_attention(
        jnp.zeros((0, 4, 32)),
        plan.allocate(),
        layer,
        meta,
        scale=1.0,
        implementation=implementation,
    )
    assert out.shape == (0, 4, 32)
    assert out.dtype == jnp.float32
