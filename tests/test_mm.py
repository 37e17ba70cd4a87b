import pytest

import jaxkv

P, F = jaxkv.vllm.PlaceholderRange, jaxkv.vllm.MultiModalFeatureSpec


def _features():
    return {
        "a": [
            F(modality="image", mm_position=P(offset=2, length=5)),
            F(
                modality="video",
                mm_position=P(offset=10, length=4, is_embed=(False, True, True, False)),
            ),
            F(modality="audio", mm_position=P(offset=20, length=3)),
        ],
        "c": [
            F(modality="image", mm_position=P(offset=0, length=300)),
            F(modality="image", mm_position=P(offset=400, length=256)),
        ],
    }


def test_worked_example():
    got = jaxkv.vllm.compute_mm_prefix_ranges(
        ["a", "b", "c"], _features(), sliding_window=256
    )
    assert got == {0: [(2, 6), (11, 12)], 1: [], 2: [(400, 655)]}
    got = jaxkv.vllm.compute_mm_prefix_ranges(["a", "b", "c"], _features())
    assert got[2] == [(0, 299), (400, 655)]


def test_equal_length_kept_and_keys_are_positions():
    feats = {"x": [F(modality="image", mm_position=P(offset=5, length=8))]}
    assert jaxkv.vllm.compute_mm_prefix_ranges(["y", "x"], feats, 8) == {
        0: [],
        1: [(5, 12)],
    }
    assert jaxkv.vllm.compute_mm_prefix_ranges(["x"], feats, 7) == {0: []}


def test_is_embed_runs():
    pos = P(offset=100, length=6, is_embed=(True, True, False, True, False, True))
    assert pos.extract_embeds_range() == [(100, 101), (103, 103), (105, 105)]
    with pytest.raises(ValueError, match="is_embed has 2 entries, expected length=3"):
        P(offset=0, length=3, is_embed=(True, False))


def test_extensions():
    feats = {"c": [F(modality="image", mm_position=P(offset=0, length=300))]}
    assert jaxkv.vllm.compute_mm_prefix_ranges(
        ["c"], feats, 256, clamp_sliding_window=True
    ) == {0: [(0, 299)]}
    feats = {"c": [F(modality="image", mm_position=P(offset=37, length=10))]}
    assert jaxkv.vllm.compute_mm_prefix_ranges(["c"], feats, span_pad=16) == {
        0: [(47, 46)]
    }
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        jaxkv.vllm.compute_mm_prefix_ranges(["c"], feats, 0)
