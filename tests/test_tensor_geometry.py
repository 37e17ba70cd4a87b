"""vLLM 0.33 layer tensors with impossible geometry are refused by
``allocate_layer_tensors`` (each case of the round-4 probes), and the
geometries vLLM makes pass.
"""  # noqa: D205

import dataclasses

import numpy as np
import pytest

import jaxkv

SPEC = jaxkv.FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
)
PAGE = SPEC.page_size_bytes  # one layer's block: 16 tokens x 2 heads x (8 + 8) x 4
NUM_BLOCKS = 8
LAYERS = ("l0", "l1")


def _tensor(**kw):
    base = jaxkv.vllm.LayerTensor(
        size=2 * NUM_BLOCKS * PAGE,
        layers=LAYERS,
        layer_stride=NUM_BLOCKS * PAGE,
        block_stride=PAGE,
    )
    return dataclasses.replace(base, **kw)


def _allocate(tensors, layout="LBNHC", num_blocks=NUM_BLOCKS, specs=None):
    return jaxkv.vllm.allocate_layer_tensors(
        tensors,
        specs or dict.fromkeys(LAYERS, SPEC),
        num_blocks=num_blocks,
        layout=jaxkv.vllm.TensorLayout[layout],
    )


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BHLNC", "BLNHC"])
def test_the_geometries_vllm_makes_are_accepted(layout):
    # Dense in the layout's order, as vLLM 0.33's allocate_kv_cache makes them.
    L = jaxkv.vllm.TensorLayout[layout]
    shape, strides = jaxkv.vllm.layout_strides(
        SPEC, num_blocks=NUM_BLOCKS, num_layers=2, layout=L
    )
    tensor = _tensor(layer_stride=strides[0], block_stride=strides[1])
    _, views = _allocate([tensor], layout=layout)
    assert set(views) == set(LAYERS)
    # Every byte of the backing belongs to exactly one element.
    both = np.concatenate(
        [views[n].block_byte_set(b) for n in LAYERS for b in range(NUM_BLOCKS)]
    )
    assert np.unique(both).size == both.size == 2 * NUM_BLOCKS * PAGE


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_stride": PAGE // 2}, "block stride of .* smaller"),
        ({"block_stride": PAGE - 4}, "block stride of .* smaller"),  # one element
        ({"block_stride": -PAGE}, "must be >= 0"),
        ({"layer_stride": 0}, "layer stride of 0 bytes is smaller"),
        ({"layer_stride": PAGE}, "layer stride of .* smaller"),
        ({"offset": 2 * NUM_BLOCKS * PAGE}, "past the backing"),
        ({"offset": -4}, "must be >= 0"),
    ],
)
def test_impossible_geometry_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _allocate([_tensor(**kw)])


def test_more_blocks_than_the_tensor_holds_and_a_layer_the_plan_lacks():
    with pytest.raises(ValueError, match="(past the backing|smaller than)"):
        _allocate([_tensor()], num_blocks=NUM_BLOCKS + 1)
    with pytest.raises(ValueError, match="past the backing"):
        _allocate([_tensor(size=2 * NUM_BLOCKS * PAGE - 4)])
    with pytest.raises(ValueError, match="no spec for layers"):
        _allocate([_tensor()], specs={"l0": SPEC})


def test_a_refused_write_would_have_shown_up_in_another_page():
    # What the check prevents: with half a page per block, block 7 of layer 1
    # shares bytes with block 8 of it, and a write to one lands in the other.
    views = jaxkv.vllm.tensor_views(
        _tensor(block_stride=PAGE // 2),
        SPEC,
        num_blocks=NUM_BLOCKS,
        layout=jaxkv.vllm.TensorLayout.LBNHC,
    )
    a = views["l1"].block_byte_set(6)
    b = views["l1"].block_byte_set(7)
    assert np.intersect1d(a, b).size > 0
