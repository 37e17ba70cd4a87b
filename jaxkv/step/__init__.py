"""step: from a scheduled batch to every layer's metadata inside your jit.

A step passes through three records: :class:`StepArrays` (host arrays, what
a scheduler produces) -> :class:`StepInputs` (the packed buffer and staged
indices, what your jitted step takes) -> :class:`StepFields` (the buffer
unpacked by name, inside jit) -> every layer's
:class:`CommonAttentionMetadata`.

Host side: ``_buckets`` (the step's bucket) -> ``_validate`` -> ``_packing``
(every field of every group in one int32 buffer) -> ``_step_builder``
(:class:`StepMetadataBuilder`, one device or every data-parallel rank);
``_fast_prefill`` stages the KV-sharing fast-prefill indices (a jitted
kernel, per rank on a mesh). Device side: ``_attn_metadata`` unpacks the
buffer into ``_common_metadata``'s record per group (``_reduced_metadata``
for fast-prefill layers); ``_programs`` keeps one compiled executable per
step program (``_monitoring`` counts traces and compilations: a step loop
must not recompile); ``_mm`` computes the multimodal PrefixLM ranges.
"""

from jaxkv.step._attn_metadata import build_attn_metadata, build_attn_metadata_from_step
from jaxkv.step._buckets import (
    BatchDescriptor,
    BucketDispatcher,
    CompileMode,
    shape_struct,
    smallest_bucket,
)
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._decode_steps import decode_step_inputs
from jaxkv.step._fast_prefill import (
    FastPrefillBatchMetadata,
    FastPrefillHelper,
    stage_logits_indices,
)
from jaxkv.step._mm import (
    MultiModalFeatureSpec,
    PlaceholderRange,
    compute_mm_prefix_ranges,
)
from jaxkv.step._monitoring import count_compilations
from jaxkv.step._packing import StepCapacity, StepFields, pack_step, unpack_step
from jaxkv.step._programs import Programs
from jaxkv.step._reduced_metadata import (
    make_kv_sharing_fast_prefill_common_attn_metadata,
)
from jaxkv.step._step_builder import StepMetadataBuilder
from jaxkv.step._step_inputs import StepArrays, StepInputs
from jaxkv.step._validate import (
    validate_logits_indices,
    validate_query_start_loc,
    validate_step,
)

__all__ = [
    "BatchDescriptor",
    "BucketDispatcher",
    "CommonAttentionMetadata",
    "CompileMode",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "Programs",
    "StepArrays",
    "StepCapacity",
    "StepFields",
    "StepInputs",
    "StepMetadataBuilder",
    "build_attn_metadata",
    "build_attn_metadata_from_step",
    "compute_mm_prefix_ranges",
    "count_compilations",
    "decode_step_inputs",
    "make_kv_sharing_fast_prefill_common_attn_metadata",
    "pack_step",
    "shape_struct",
    "smallest_bucket",
    "stage_logits_indices",
    "unpack_step",
    "validate_logits_indices",
    "validate_query_start_loc",
    "validate_step",
]
