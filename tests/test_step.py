from typing import Any

import jax
import numpy as np
import pytest

import jaxkv
from tests.helpers import count_compiles

BUCKETS = (8, 16, 32, 64)


def _builder():
    cfg = jaxkv.tiny_hybrid_config(
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=BUCKETS,
        request_buckets=(4, 8),
    )
    return jaxkv.StepMetadataBuilder(jaxkv.make_plan(cfg, num_blocks=64))


def _random_step(rng, block_size=32, widths=8) -> dict[str, Any]:
    """A step of a replayed trace: decodes and prefill chunks, some finishing."""
    num_reqs = int(rng.integers(1, 9))
    q_lens, logits = [], []
    for _ in range(num_reqs):
        if rng.random() < 0.6:
            q_lens.append(1)
            logits.append(1)
        else:
            q_lens.append(int(rng.integers(2, 8)))
            logits.append(int(rng.random() < 0.5))  # chunk finishes the prompt?
    if rng.random() < 0.3:  # a pure decode step
        q_lens, logits = [1] * num_reqs, [1] * num_reqs
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([q + int(rng.integers(0, 150)) for q in q_lens], np.int32)
    positions = np.concatenate(
        [np.arange(s - q, s) for s, q in zip(seq_lens, q_lens, strict=True)]
    )
    tables = rng.integers(1, 64, (num_reqs, widths)).astype(np.int32)
    token_req = np.repeat(np.arange(num_reqs), q_lens)
    slots = (
        tables[token_req, positions // block_size] * block_size + positions % block_size
    )
    logits_indices = np.array(
        [qsl[r + 1] - 1 for r in range(num_reqs) if logits[r]], np.int32
    )
    cu = np.concatenate([[0], np.cumsum(logits)]).astype(np.int32)
    return dict(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        positions=positions,
        block_tables=[tables, tables, tables],  # Mamba: a column per block too
        slot_mappings=[slots.astype(np.int32)] * 3,
        logits_indices=logits_indices if logits_indices.size else None,
        cu_num_logits=cu,
    )


@pytest.mark.slow  # 22 s; the default pass keeps test_serve's 0-compile check
def test_200_step_replayed_trace_compiles_nothing_after_warm_up():
    builder = _builder()
    builder.warm_up()
    rng = np.random.default_rng(0)
    steps = [_random_step(rng) for _ in range(200)]
    seen = {"armed": 0, "unarmed": 0, "FULL": 0, "PIECEWISE": 0}
    with count_compiles() as compiles:
        for inputs in steps:
            step = builder.prepare(jaxkv.StepArrays(**inputs))
            meta = builder.build(step)
            jax.block_until_ready(meta)
            seen["armed" if step.fast_prefill is not None else "unarmed"] += 1
            assert step.desc is not None
            seen[step.desc.cg_mode.name] += 1
    assert compiles == [], f"{len(compiles)} traces/compiles after warm-up"
    assert min(seen.values()) > 10, seen


def test_step_metadata_matches_inputs():
    builder = _builder()
    # Bucket padding on, programs compiled as steps need them (warm_up's
    # compile-everything is the replay test's, in the slow pass).
    builder.warm_up_host()
    rng = np.random.default_rng(1)
    for _ in range(20):
        inputs = _random_step(rng)
        step = builder.prepare(jaxkv.StepArrays(**inputs))
        meta = builder.build(step)
        qsl = inputs["query_start_loc"]
        n, r = int(qsl[-1]), qsl.size - 1
        full = meta["layers.0.self_attn"]
        np.testing.assert_array_equal(full.query_start_loc[: r + 1], qsl)
        assert (np.asarray(full.query_start_loc[r + 1 :]) == n).all()
        np.testing.assert_array_equal(full.slot_mapping[:n], inputs["slot_mappings"][0])
        assert (np.asarray(full.slot_mapping[n:]) == -1).all()
        np.testing.assert_array_equal(full.seq_lens[:r], inputs["seq_lens"])
        np.testing.assert_array_equal(full.positions[:n], inputs["positions"])
        assert int(full.num_reqs) == r
        assert int(full.num_actual_tokens) == n
        np.testing.assert_array_equal(full.query_start_loc_cpu, qsl)
        yoco = meta["layers.6.self_attn"]
        if step.fast_prefill is not None:
            cu = inputs["cu_num_logits"]
            np.testing.assert_array_equal(yoco.query_start_loc[: r + 1], cu)
            np.testing.assert_array_equal(yoco.query_start_loc_cpu, cu)
            assert int(yoco.num_actual_tokens) == cu[-1]
            idx = inputs["logits_indices"]
            staged = np.asarray(yoco.logits_indices_padded)
            np.testing.assert_array_equal(staged[: idx.size], idx)
            assert (staged[idx.size :] == idx[-1]).all()
        else:
            np.testing.assert_array_equal(yoco.query_start_loc, full.query_start_loc)


def test_builder_rejects_a_block_table_per_group_missing():
    builder = _builder()
    inputs = _random_step(np.random.default_rng(2))
    inputs["block_tables"] = inputs["block_tables"][:2]
    with pytest.raises(ValueError, match="one per KV-cache group"):
        builder.prepare(jaxkv.StepArrays(**inputs))


def test_full_and_piecewise_buckets_share_one_program():
    builder = _builder()
    descs = builder.dispatcher.executables()
    modes = {d.cg_mode for d in descs}
    assert modes == {jaxkv.vllm.CompileMode.FULL, jaxkv.vllm.CompileMode.PIECEWISE}
    programs = builder.abstract_inputs()
    keys = [p.program for p in programs]
    assert len(keys) == len(set(keys))
    # One unarmed program per (token bucket, request bucket) whatever the mode,
    # plus the armed ones (fast prefill pads to token buckets <= the step's).
    shapes = {(d.num_tokens, d.num_reqs) for d in descs}
    unarmed = [k for k in keys if k[1] is None]
    assert len(unarmed) == len(shapes)
    armed = [k for k in keys if k[1] is not None]
    expected = sum(1 for t, _ in shapes for b in BUCKETS if b <= t)
    assert len(armed) == expected


def test_metadata_inside_the_callers_jit_equals_build():
    builder = _builder()
    # Bucket padding on, programs compiled as steps need them (warm_up's
    # compile-everything is the replay test's, in the slow pass).
    builder.warm_up_host()
    step = builder.prepare(jaxkv.StepArrays(**_random_step(np.random.default_rng(3))))
    built = builder.build(step)

    @jax.jit
    def user_step(inputs):
        meta = builder.metadata(inputs)
        return {name: m.slot_mapping for name, m in meta.items()}, {
            name: m.query_start_loc for name, m in meta.items()
        }

    slots, qsl = user_step(step)
    assert set(slots) == set(built)
    for name, m in built.items():
        np.testing.assert_array_equal(slots[name], m.slot_mapping)
        np.testing.assert_array_equal(qsl[name], m.query_start_loc)
    # Tracing twice gives the same program: nothing in the builder changed.
    assert builder.metadata(step).keys() == built.keys()
