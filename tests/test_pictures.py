"""Pictures draw what the views own: byte maps against the independent NumPy
layout model, step pictures against the step's arrays, PNGs that render."""

import io
from typing import Any

import jax
import matplotlib
import numpy as np
import pytest
from matplotlib import image as mpl_image

import jaxkv
from jaxkv.pictures import byte_map, plot_byte_map, plot_scaling, plot_step
from tests.oracle import Oracle

matplotlib.use("Agg")

KERNEL16 = jaxkv.AttentionBackend(
    name="K16",
    layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
    supported_kernel_block_sizes=(16,),
)


def _plans() -> dict[str, Any]:
    hybrid = jaxkv.tiny_hybrid_config()
    return {
        "hybrid": jaxkv.make_plan(hybrid, num_blocks=4),
        "hybrid-packed": jaxkv.make_plan(hybrid, num_blocks=4, packed=True),
        "hybrid-bf16": jaxkv.make_plan(
            jaxkv.tiny_hybrid_config(dtype="bfloat16"), num_blocks=3
        ),
        "kernel-split-packed": jaxkv.make_plan(
            jaxkv.tiny_hybrid_config(attention_backend=KERNEL16),
            num_blocks=3,
            packed=True,
            maps_slot_mapping=True,
        ),
    }


@pytest.mark.parametrize("name", list(_plans()))
def test_byte_map_regions_are_the_bytes_each_view_owns(name):
    """Per group, each label's region is exactly its layer's bytes (from the
    independent NumPy layout model), and the rest is padding."""
    plan = _plans()[name]
    oracle = Oracle(
        plan.kv_cache_config,
        plan.runner_config,
        plan.kernel_block_sizes,
        plan.attn_groups,
    )
    checked = 0
    for pool in range(len(plan.pools)):
        for g, group in enumerate(plan.kv_cache_config.kv_cache_groups):
            m = byte_map(plan, pool=pool, group=g)
            flat = m.owners.ravel()
            covered: set[int] = set()
            for layer in group.layer_names:
                ids = [
                    i for i, lab in enumerate(m.labels) if lab.startswith(layer + " ")
                ]
                if not ids:
                    continue  # in another pool
                owned: set[int] = set()
                lay = oracle.layers[layer]
                stride, pieces = getattr(lay, "owned", None) or (1, 1)
                for b in range(plan.views[layer].num_blocks):
                    if b % stride < pieces:  # not another layer's packed page
                        owned |= oracle.block_bytes(layer, b)
                drawn = set(np.flatnonzero(np.isin(flat, ids)).tolist())
                assert drawn == owned, (name, pool, layer)
                covered |= owned
                checked += 1
            padding = set(np.flatnonzero(flat == -1).tolist())
            assert padding == set(range(flat.size)) - covered, (name, pool, g)
    assert checked >= 3


def test_hybrid_byte_map_shows_keys_values_and_states():
    plan = _plans()["hybrid"]
    labels = [byte_map(plan, pool=0, group=g).labels for g in range(3)]
    assert labels == [
        ["layers.0.self_attn K", "layers.0.self_attn V"],
        ["layers.1.self_attn K", "layers.1.self_attn V"],
        ["layers.2.mixer state 0", "layers.2.mixer state 1"],
    ]
    mamba = byte_map(plan, pool=0, group=2)
    spec = plan.runner_config.layer("layers.2.mixer").spec
    # The Mamba page: conv state, SSM state, then padding to the attention page.
    row = mamba.owners[1]
    assert (row[: spec.state_bytes[0]] == 0).all()
    assert (row[spec.state_bytes[0] : spec.real_page_size_bytes] == 1).all()
    assert (row[spec.real_page_size_bytes :] == -1).all()


def test_byte_map_picture_draws_the_map_and_renders():
    plan = _plans()["hybrid-packed"]
    fig = plot_byte_map(plan, pool=0, max_columns=512)
    labels = 0
    for g, ax in enumerate(fig.axes[:3]):
        m = byte_map(plan, pool=0, group=g)
        labels += len(m.labels)
        step = -(-m.bytes_per_block // 512)
        image = np.asarray(ax.images[0].get_array())
        np.testing.assert_array_equal(image, m.owners[:, ::step] + 1)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = mpl_image.imread(io.BytesIO(buf.getvalue()))
    colors = {tuple(px) for px in png.reshape(-1, png.shape[-1])[::37]}
    assert len(colors) > labels  # every owner gets its own color (and padding)


def test_step_picture_draws_the_step():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    s = jaxkv.Scheduler(plan, max_num_batched_tokens=64)
    for i, n in enumerate((40, 5, 70)):
        s.add_request(jaxkv.Request(f"r{i}", prompt=[1] * n, max_new_tokens=1))
    arrays = s.schedule()
    fig = plot_step(arrays, block_size=32)
    top, bottom = fig.axes[:2]
    widths = [round(p.get_width()) for p in top.patches]
    assert widths == np.diff(arrays.query_start_loc).tolist()
    sampled = top.collections[0].get_offsets()
    assert len(sampled) == (
        0 if arrays.logits_indices is None else len(arrays.logits_indices)
    )
    # Outlined cells: the (request, block) pairs this step writes.
    table, slots = arrays.block_tables[0], arrays.slot_mappings[0]
    qsl = arrays.query_start_loc
    written = {
        (r, int(np.flatnonzero(table[r] == slots[t] // 32)[0]))
        for r in range(len(qsl) - 1)
        for t in range(qsl[r], qsl[r + 1])
    }
    assert len(bottom.patches) == len(written)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert mpl_image.imread(io.BytesIO(buf.getvalue())).shape[0] > 100


def test_scaling_picture_plots_the_benchmark_rows():
    results = {
        "requests": [{"requests": 8, "ms": 1.0}, {"requests": 32, "ms": 3.0}],
        "context": [{"context": 128, "ms": 1.0}, {"context": 512, "ms": 2.5}],
        "pool": [
            {"pool_MiB": 64, "write_ms": 0.2, "attention_ms": 1.0},
            {"pool_MiB": 256, "write_ms": 0.21, "attention_ms": 1.1},
        ],
    }
    fig = plot_scaling(results)
    lines = [ax.get_lines() for ax in fig.axes]
    assert [len(x) for x in lines] == [1, 1, 2]
    assert list(lines[2][1].get_ydata()) == [1.0, 1.1]  # attention over pool sizes
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_step_picture_draws_the_staged_fast_prefill_buffer():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    s = jaxkv.Scheduler(plan, max_num_batched_tokens=64)
    for i, n in enumerate((20, 9)):
        s.add_request(jaxkv.Request(f"r{i}", prompt=[1] * n, max_new_tokens=1))
    arrays = s.schedule()
    inputs = jaxkv.StepMetadataBuilder(plan).prepare(arrays)
    fp = inputs.fast_prefill
    assert fp is not None  # the built-in model has fast-prefill layers
    staged = np.asarray(fp.logits_indices_padded)
    fig = plot_step(arrays, block_size=32, staged=staged)
    drawn = np.asarray(fig.axes[2].images[0].get_array())[0]
    np.testing.assert_array_equal(drawn, staged)
    sampled = np.asarray(arrays.logits_indices)
    assert drawn[: sampled.size].tolist() == sampled.tolist()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def _step_arrays():
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
    s = jaxkv.Scheduler(plan)
    s.add_request(jaxkv.Request("a", prompt=[1] * 40, max_new_tokens=1))
    return s.schedule()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda p, a: byte_map(p, pool=-1), ValueError, r"pool=-1 is not in \[0, 2\)"),
        (lambda p, a: byte_map(p, pool=2), ValueError, r"pool=2 is not in \[0, 2\)"),
        (
            lambda p, a: byte_map(p, pool=0.0),  # pyright: ignore[reportArgumentType]
            TypeError,
            "pool must be an int",
        ),
        (lambda p, a: byte_map(p, group=3), ValueError, r"group=3 is not in \[0, 3\)"),
        (lambda p, a: plot_byte_map(p, pool=-1), ValueError, "pool=-1"),
        (lambda p, a: plot_byte_map(p, max_columns=0), ValueError, "max_columns"),
        (lambda p, a: plot_step(a, block_size=-32), ValueError, "block_size"),
        (lambda p, a: plot_step(a, group=5), ValueError, r"group=5 is not in"),
        (lambda p, a: plot_scaling({"pool": []}), ValueError, "lack the"),
    ],
)
def test_pictures_name_a_bad_argument(call, error, match):
    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    with pytest.raises(error, match=match):
        call(plan, _step_arrays())


@pytest.mark.parametrize(
    ("src_backend", "dst_backend"),
    [("JAX_PAGED", "JAX_PAGED_KV_FIRST"), ("JAX_PAGED_KV_FIRST", "JAX_PAGED_FUSED")],
)
def test_the_transfer_picture_marks_exactly_the_bytes_a_move_writes(
    src_backend, dst_backend
):
    # One layer per plan: its pool's bytes are that layer's only. The bytes
    # the picture gives tokens are the bytes write_kv filled on the source and
    # import_request filled on the target (a zero pool, nonzero K/V).
    from jaxkv.pictures import transfer_map

    def plan(backend, block_size):
        cfg = jaxkv.llama_like_config(
            num_layers=1, attention_backend=backend, block_size=block_size
        )
        return jaxkv.make_plan(cfg, num_blocks=8)

    src, dst = plan(src_backend, 16), plan(dst_backend, 32)
    name = src.runner_config.layers[0].name
    n = 40
    rng = np.random.default_rng(0)
    k = rng.uniform(1, 2, (n, 2, 32)).astype(np.float32)
    s_ids, d_ids = [3, 1, 5], [6, 2]
    slots = np.array([s_ids[p // 16] * 16 + p % 16 for p in range(n)])
    pools = jaxkv.write_kv(src.allocate(), src.views[name], k, k + 1, slots)
    kv = jaxkv.transfer.export_request(src, pools, block_ids=[s_ids], num_tokens=n)
    out = jaxkv.transfer.import_request(dst, dst.allocate(), kv, block_ids=[d_ids])
    m = transfer_map(
        src, dst, layer=name, source_blocks=s_ids, target_blocks=d_ids, num_tokens=n
    )
    assert m.moved == n

    def written(pools):
        raw = np.asarray(jax.device_get(pools[0])).reshape(-1).view(np.uint8)
        # A float in [1, 3) has a nonzero high byte: no written byte reads 0
        # in every byte of its element.
        per_elem = raw.reshape(-1, 4).any(axis=1)
        return np.repeat(per_elem, 4)

    np.testing.assert_array_equal(written(pools), (m.source >= 0).reshape(-1))
    np.testing.assert_array_equal(written(out), (m.target >= 0).reshape(-1))
    # Each token holds the same bytes on both sides.
    np.testing.assert_array_equal(
        np.bincount(m.source[m.source >= 0], minlength=n),
        np.bincount(m.target[m.target >= 0], minlength=n),
    )
