"""Multimodal PrefixLM ranges (spec §2.18)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt.

    Args:
      offset: First prompt position of the placeholder.
      length: Number of placeholder tokens.
      is_embed: Optional per-token mask of the positions that carry embeddings.

    Example:
      >>> import jaxkv
      >>> jaxkv.vllm.PlaceholderRange(offset=10, length=4,
      ...     is_embed=(False, True, True, False)).extract_embeds_range()
      [(11, 12)]
    """

    offset: int
    length: int
    is_embed: Sequence[bool] | None = None

    def __post_init__(self) -> None:
        if self.is_embed is not None:
            object.__setattr__(self, "is_embed", tuple(bool(x) for x in self.is_embed))
            if len(self.is_embed) != self.length:
                raise ValueError(
                    f"PlaceholderRange.is_embed has {len(self.is_embed)} entries, "
                    f"expected length={self.length}."
                )

    def extract_embeds_range(self) -> list[tuple[int, int]]:
        """Inclusive ``(start, end)`` prompt ranges of the embedding tokens."""
        if self.is_embed is None:
            return [(self.offset, self.offset + self.length - 1)]
        ranges: list[tuple[int, int]] = []
        start = None
        for i, flag in enumerate((*self.is_embed, False)):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                ranges.append((self.offset + start, self.offset + i - 1))
                start = None
        return ranges


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request: its modality and placeholder.

    Example:
      >>> import jaxkv
      >>> jaxkv.vllm.MultiModalFeatureSpec(modality="image",
      ...     mm_position=jaxkv.vllm.PlaceholderRange(offset=2, length=5)).modality
      'image'
    """

    modality: str
    mm_position: PlaceholderRange


def compute_mm_prefix_ranges(
    req_ids: Sequence[str],
    mm_features: Mapping[str, Sequence[MultiModalFeatureSpec]],
    sliding_window: int | None = None,
    *,
    clamp_sliding_window: bool = False,
    span_pad: int = 0,
) -> dict[int, list[tuple[int, int]]]:
    """Compute PrefixLM bidirectional ranges for multimodal tokens.

    Ranges longer than `sliding_window` are skipped so early tokens never attend
    across a whole image span they could not see. Keys are request positions in
    `req_ids`; every request gets a key.

    Args:
      req_ids: Request ids in batch order.
      mm_features: ``req_id -> features``; missing ids have none.
      sliding_window: Window of the layer, if any.
      clamp_sliding_window: vLLM 0.33 extension: keep long ranges anyway.
      span_pad: vLLM 0.33 extension: if positive, a feature's ranges become the
        single range ``(floor(offset/span_pad)*span_pad + span_pad - 1,
        offset + length - 1)``.

    Returns:
      ``request position -> inclusive (start, end) ranges``, in feature order.

    Example:
      >>> import jaxkv
      >>> P, F = jaxkv.vllm.PlaceholderRange, jaxkv.vllm.MultiModalFeatureSpec
      >>> feats = {
      ...     "a": [F(modality="image", mm_position=P(offset=2, length=5)),
      ...           F(modality="video", mm_position=P(offset=10, length=4,
      ...             is_embed=(False, True, True, False))),
      ...           F(modality="audio", mm_position=P(offset=20, length=3))],
      ...     "c": [F(modality="image", mm_position=P(offset=0, length=300)),
      ...           F(modality="image", mm_position=P(offset=400, length=256))]}
      >>> from jaxkv.vllm import compute_mm_prefix_ranges
      >>> compute_mm_prefix_ranges(["a", "b", "c"], feats, sliding_window=256)
      {0: [(2, 6), (11, 12)], 1: [], 2: [(400, 655)]}
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(
            f"sliding_window must be positive or None, got {sliding_window}."
        )
    if span_pad < 0:
        raise ValueError(f"span_pad must be >= 0, got {span_pad}.")
    out: dict[int, list[tuple[int, int]]] = {}
    for req_idx, req_id in enumerate(req_ids):
        ranges: list[tuple[int, int]] = []
        for feature in mm_features.get(req_id, ()):
            if feature.modality not in ("image", "video"):
                continue
            pos = feature.mm_position
            if span_pad > 0:
                start = (pos.offset // span_pad) * span_pad + span_pad - 1
                feature_ranges = [(start, pos.offset + pos.length - 1)]
            else:
                feature_ranges = pos.extract_embeds_range()
            for r in feature_ranges:
                too_long = (
                    sliding_window is not None and r[1] - r[0] + 1 > sliding_window
                )
                if too_long and not clamp_sliding_window:
                    continue
                ranges.append(r)
        out[req_idx] = ranges
    return out
