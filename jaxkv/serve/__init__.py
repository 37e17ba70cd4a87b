"""serve: a loop over the scheduler, the step builder and your step.

Sampling, stop tokens, streaming, warm-up and fault resumption around a step
function of yours: :class:`ServingLoop` over its schedulers, a
:class:`StepPipeline` of the steps in flight and a :class:`StepRunner` on
the device.
"""

from jaxkv.serve._device_step import Forward
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
    "ExecutionOptions",
    "Forward",
    "SamplingParams",
    "SchedulingOptions",
    "ServingLoop",
    "StepPipeline",
    "StepRunner",
    "request_seed",
    "sample_tokens",
    "sample_tokens_per_row",
    "size_loop_kv_cache",
]
