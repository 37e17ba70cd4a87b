"""serve: a loop over the scheduler, the step builder and your step.

serve: a loop over the scheduler, the step builder and a step function of
yours, with sampling, stop tokens, streaming, warm-up and fault resumption.
"""

from jaxkv.serve._device_step import Forward
from jaxkv.serve._loop import ServingLoop
from jaxkv.serve._options import ExecutionOptions, SchedulingOptions
from jaxkv.serve._sampling import (
    SamplingParams,
    request_seed,
    sample_tokens,
    sample_tokens_per_row,
)
from jaxkv.serve._sizing import size_loop_kv_cache

__all__ = [
    "ExecutionOptions",
    "Forward",
    "SamplingParams",
    "SchedulingOptions",
    "ServingLoop",
    "request_seed",
    "sample_tokens",
    "sample_tokens_per_row",
    "size_loop_kv_cache",
]
