"""step: from a scheduled batch to every layer's metadata inside your jit.

Host side: ``_buckets`` (the step's bucket) -> ``_validate`` -> ``_packing``
(every field of every group in one int32 buffer) -> ``_step_builder``
(:class:`StepMetadataBuilder`, :class:`StepInputs`). Device side:
``_attn_metadata`` unpacks the buffer into ``_common_metadata``'s record per
group; ``_fast_prefill`` stages the KV-sharing fast-prefill indices;
``_programs`` keeps one compiled executable per step program.
"""  # noqa: D205

from jaxkv.step._attn_metadata import build_attn_metadata, build_attn_metadata_from_step
from jaxkv.step._buckets import (
    BatchDescriptor,
    BucketDispatcher,
    CompileMode,
    shape_struct,
    smallest_bucket,
)
from jaxkv.step._common_metadata import CommonAttentionMetadata
from jaxkv.step._fast_prefill import (
    FastPrefillBatchMetadata,
    FastPrefillHelper,
    make_kv_sharing_fast_prefill_common_attn_metadata,
    stage_logits_indices,
    validate_logits_indices,
    validate_query_start_loc,
)
from jaxkv.step._packing import StepFields, StepLayout, pack_step, unpack_step
from jaxkv.step._programs import Programs
from jaxkv.step._step_builder import PreparedStep, StepInputs, StepMetadataBuilder
from jaxkv.step._validate import validate_step

__all__ = [
    "BatchDescriptor",
    "BucketDispatcher",
    "CommonAttentionMetadata",
    "CompileMode",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "PreparedStep",
    "Programs",
    "StepFields",
    "StepInputs",
    "StepLayout",
    "StepMetadataBuilder",
    "build_attn_metadata",
    "build_attn_metadata_from_step",
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
