"""sched: requests, the block manager with prefix caching, the scheduler.

``_request`` (a request's tokens and state) -> ``_prefix`` (block hashes,
the longest cached prefix) -> ``_manager`` (blocks per group, vLLM's
``KVCacheManager`` semantics) -> ``_scheduler`` (admission, chunked
prefill, preemption, async scheduling's advance/resolve).
"""  # noqa: D205

from jaxkv.sched._manager import KVCacheManager, StepBlocks, prefix_caching_unsupported
from jaxkv.sched._prefix import hash_token_blocks, longest_cache_hit
from jaxkv.sched._request import Request, RequestStatus
from jaxkv.sched._scheduled import ScheduledStep, sampled_token_indices
from jaxkv.sched._scheduler import Scheduler

__all__ = [
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "ScheduledStep",
    "Scheduler",
    "StepBlocks",
    "hash_token_blocks",
    "longest_cache_hit",
    "prefix_caching_unsupported",
    "sampled_token_indices",
]
