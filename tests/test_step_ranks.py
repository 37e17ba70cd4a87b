"""Data-parallel ranks in the step builder: one ``prepare_ranks`` call packs
every rank's step on one bucket and stages fast prefill per rank with the
same kernel as one device (the 8-device meshes are in the slow mesh checks;
here a 1x1 mesh and hand-checked rows).
"""  # noqa: D205

import jax
import numpy as np
import pytest

import jaxkv

CFG = jaxkv.tiny_hybrid_config(
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    token_buckets=(4, 8, 16),
    request_buckets=(2, 4),
)


@pytest.fixture(scope="module")
def sharded():
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    return jaxkv.shard_plan(CFG, mesh=mesh, num_blocks=16)


def _steps(plan, ranks):
    """One scheduled step per rank, from each rank's prompts."""
    out = []
    for i, prompts in enumerate(ranks):
        s = jaxkv.Scheduler(plan)
        for j, prompt in enumerate(prompts):
            s.add_request(jaxkv.Request(f"r{i}.{j}", prompt=prompt, max_new_tokens=2))
        out.append(s.schedule())
    return out


def test_one_rank_packs_what_one_device_packs_and_stages_the_same_indices(sharded):
    (step,) = _steps(sharded.local, [[[3, 1, 4, 1, 5], [9, 2]]])
    one = jaxkv.StepMetadataBuilder(sharded.local, model_inputs=True)
    ranks = jaxkv.StepMetadataBuilder(sharded, model_inputs=True)
    assert ranks.num_ranks == 1
    assert ranks.plan == sharded.local
    a = one.prepare(step)
    b = ranks.prepare_ranks([step])
    assert b.packed.shape == (1, a.capacity.size)
    assert b.capacity == a.capacity
    np.testing.assert_array_equal(np.asarray(b.packed)[0], np.asarray(a.packed))
    # The prompt's last token is sampled; fast prefill armed on both paths.
    assert a.fast_prefill is not None
    assert b.fast_prefill is not None
    np.testing.assert_array_equal(
        np.asarray(b.fast_prefill.logits_indices_padded)[0],
        np.asarray(a.fast_prefill.logits_indices_padded),
    )
    assert np.asarray(b.fast_prefill.num_logits_indices).tolist() == [2]
    # Inside shard_map the rank's own step builds the same metadata.
    local = jax.tree.map(np.asarray, b).local()
    got = one.metadata(local)
    want = one.metadata(jax.tree.map(np.asarray, a))
    for name in want:
        np.testing.assert_array_equal(got[name].slot_mapping, want[name].slot_mapping)
        np.testing.assert_array_equal(
            got[name].query_start_loc, want[name].query_start_loc
        )


def test_rank_rows_stage_each_rank_s_indices_and_an_idle_rank_stages_zeros():
    d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=8, max_num_reqs=4)
    d.mark_ready()
    mesh = jax.make_mesh((1,), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    helper = jaxkv.vllm.FastPrefillHelper(d, 8, rows=rows)
    desc = jaxkv.vllm.BatchDescriptor(
        num_tokens=8, num_reqs=2, cg_mode=jaxkv.vllm.CompileMode.PIECEWISE
    )
    m = helper.prepare_ranks(
        [np.array([2, 6])],
        [np.array([0, 1, 2])],
        num_reqs=[2],
        has_prefill=True,
        batch_desc=desc,
        padding=4,
    )
    assert m is not None
    assert np.asarray(m.logits_indices_padded).tolist() == [[2, 6, 6, 6]]
    assert np.asarray(m.max_logits_per_req).tolist() == [1]
    idle = helper.prepare_ranks(
        [None], [None], num_reqs=[0], has_prefill=True, batch_desc=desc, padding=4
    )
    assert idle is not None
    # n = 0: every entry a valid token index (0), never a negative sentinel.
    assert np.asarray(idle.logits_indices_padded).tolist() == [[0, 0, 0, 0]]
    assert np.asarray(idle.num_logits_indices).tolist() == [0]
    with pytest.raises(ValueError, match="rank 0 has 3 logits indices, more than"):
        helper.prepare_ranks(
            [np.array([1, 2, 3])],
            [None],
            num_reqs=[3],
            has_prefill=True,
            batch_desc=desc,
            padding=2,
        )
    with pytest.raises(ValueError, match="2 rank\\(s\\) given to a helper staging"):
        helper.prepare_ranks(
            [None, None],
            [None, None],
            num_reqs=[0, 0],
            has_prefill=True,
            batch_desc=desc,
            padding=4,
        )
    with pytest.raises(ValueError, match="use prepare_ranks"):
        helper.prepare(np.array([1]), 1, np.array([0, 1]), True, desc)


def test_misuse_names_the_rank_and_the_call(sharded):
    ranks = jaxkv.StepMetadataBuilder(sharded)
    (step,) = _steps(sharded.local, [[[1, 2, 3]]])
    with pytest.raises(ValueError, match="prepare_ranks\\(steps\\) takes one step"):
        ranks.prepare(step)
    with pytest.raises(ValueError, match="2 step\\(s\\) for 1 data-parallel rank"):
        ranks.prepare_ranks([step, step])
    bad = jaxkv.StepArrays(
        query_start_loc=np.array([0, 3]),
        seq_lens=np.array([2]),  # shorter than its query
        positions=np.arange(3),
        block_tables=step.block_tables,
        slot_mappings=step.slot_mappings,
    )
    with pytest.raises(ValueError, match="^rank 0: seq_lens\\[0\\]=2 is shorter"):
        ranks.prepare_ranks([bad])
    with pytest.raises(TypeError, match="steps\\[0\\] must be a StepArrays"):
        ranks.prepare_ranks([{"query_start_loc": np.array([0])}])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="build runs one device's step"):
        ranks.build(ranks.prepare_ranks([step]))
    one = jaxkv.StepMetadataBuilder(sharded.local)
    with pytest.raises(TypeError, match="arrays must be a StepArrays"):
        one.prepare({"query_start_loc": np.array([0])})  # pyright: ignore[reportArgumentType]


def test_an_idle_rank_beside_a_busy_one_shares_its_bucket():
    # Two ranks on a 2x1 mesh need two devices: run it in a subprocess.
    import subprocess
    import sys

    code = """
import dataclasses, jax, numpy as np, jaxkv
from tests.test_step_ranks import CFG, _steps
sp = jaxkv.shard_plan(CFG, mesh=jax.make_mesh((2, 1), ("data", "tensor")),
                      num_blocks=16)
b = jaxkv.StepMetadataBuilder(sp, model_inputs=True)
steps = _steps(sp.local, [[[1, 2, 3, 4, 5, 6], [7, 8]], []])
inputs = b.prepare_ranks(steps)
# Rank 0 prefills, rank 1 only decodes: armed for both (one program).
s1 = jaxkv.Scheduler(sp.local)
s1.add_request(jaxkv.Request("d", prompt=[5, 6], max_new_tokens=4))
s1.update(s1.schedule(), [9])
decode = s1.schedule()
assert [n for _, n in decode.batch] == [1]
mixed = b.prepare_ranks([steps[0], decode])
assert mixed.fast_prefill is not None
assert np.asarray(mixed.fast_prefill.num_logits_indices).tolist() == [2, 1]
one = jaxkv.StepMetadataBuilder(sp.local, model_inputs=True)
alone = one.prepare(steps[0])
assert inputs.capacity == alone.capacity, (inputs.capacity, alone.capacity)
packed = np.asarray(inputs.packed)
assert (packed[0] == np.asarray(alone.packed)).all()
f = inputs.fast_prefill
assert np.asarray(f.num_logits_indices).tolist() == [2, 0]
assert (np.asarray(f.logits_indices_padded)[1] == 0).all()
# Rank 0 samples 1 token, rank 1 samples 3: sized by the busiest rank, and
# the program keyed by the staged indices' width, not the rank count.
# Token buckets start at 2 so that one sample and three pad differently.
fine = jaxkv.shard_plan(dataclasses.replace(CFG, token_buckets=(2, 4, 8, 16)),
                        mesh=sp.mesh, num_blocks=16)
b = jaxkv.StepMetadataBuilder(fine, model_inputs=True)
fewer = b.prepare_ranks(_steps(fine.local, [[[1, 2]], [[3, 4], [5, 6, 7], [8]]]))
assert fewer.capacity.num_samples == 4, fewer.capacity
width = np.asarray(fewer.fast_prefill.logits_indices_padded).shape
assert width[0] == 2 and width[1] > 2, width
assert fewer.program[1] == width[1], (fewer.program, width)
print("ok", inputs.packed.sharding.spec)
"""
    env = {
        **__import__("os").environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",  # two CPU devices, also where a GPU is the default
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(__import__("pathlib").Path(__file__).parent.parent),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok P('data',)", out.stdout


def test_a_staging_buffer_consumed_by_a_failed_call_is_replaced():
    # A staging call that consumed its donated buffer and then failed leaves
    # it deleted; the next call stages into a fresh one, with the same result.
    d = jaxkv.BucketDispatcher(token_buckets=(4, 8), max_num_tokens=8, max_num_reqs=4)
    d.mark_ready()
    helper = jaxkv.vllm.FastPrefillHelper(d, 8)
    desc = jaxkv.vllm.BatchDescriptor(
        num_tokens=8, num_reqs=2, cg_mode=jaxkv.vllm.CompileMode.PIECEWISE
    )
    args = (np.array([2, 6]), 2, np.array([0, 1, 2]), True, desc)
    first = helper.prepare(*args)
    assert first is not None
    want = np.asarray(first.logits_indices_padded).tolist()
    helper.buffer.delete()
    again = helper.prepare(*args)
    assert again is not None
    assert np.asarray(again.logits_indices_padded).tolist() == want == [2, 6, 6, 6]
