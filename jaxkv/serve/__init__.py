"""serve: a loop over the scheduler, the step builder and your step.

Sampling, stop tokens, speculative decoding (:class:`NgramDrafter` or your
drafter), streaming, warm-up and fault resumption around a step
function of yours: :class:`ServingLoop` over its schedulers, a
:class:`StepPipeline` of the steps in flight and a :class:`StepRunner` on
the device.
"""

from jaxkv.serve._device_step import Forward
from jaxkv.serve._drafts import (
    Drafter,
    NgramDrafter,
    accept_drafts,
    accepted_rows,
    draft_rows,
    ngram_drafts,
)
from jaxkv.serve._loop import ServingLoop
from jaxkv.serve._options import ExecutionOptions, SchedulingOptions
from jaxkv.serve._pipeline import StepPipeline
from jaxkv.serve._runner import StepRunner
from jaxkv.serve._sampling import (
    SamplingParams,
    request_seed,
    sample_tokens,
    sample_tokens_per_row,
)
from jaxkv.serve._sizing import size_loop_kv_cache

__all__ = [
    "Drafter",
    "ExecutionOptions",
    "Forward",
    "NgramDrafter",
    "SamplingParams",
    "SchedulingOptions",
    "ServingLoop",
    "StepPipeline",
    "StepRunner",
    "accept_drafts",
    "accepted_rows",
    "draft_rows",
    "ngram_drafts",
    "request_seed",
    "sample_tokens",
    "sample_tokens_per_row",
    "size_loop_kv_cache",
]
