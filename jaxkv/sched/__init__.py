"""sched: requests, the block manager with prefix caching, the scheduler.

``_request`` (a request's tokens and state) -> ``_blocks`` (the block
allocator: free queue, reference counts, cached blocks) -> ``_prefix``
(block hashes, the longest cached prefix; ``_host_tier``: evicted prefix
blocks kept in host memory and copied back on a hit) -> ``_table_rows``
(block tables as arrays, a batch's slots) -> ``_manager`` (blocks per group
and prefix hits, vLLM's ``KVCacheManager`` semantics) -> ``_scheduled`` (a
scheduled step, its host arrays) -> ``_scheduler`` (admission, chunked
prefill, preemption, and applying a step: update, async scheduling's
advance/resolve, recompute); ``_events`` (vLLM's KV-cache events, which the
manager emits) and ``_metrics`` (the scheduler's stats under vLLM's metric
names, a Prometheus collector).
"""

from jaxkv.sched._apply import StepApplier
from jaxkv.sched._blocks import BlockAllocator
from jaxkv.sched._event_wire import ZmqEventPublisher, encode_kv_event_batch
from jaxkv.sched._events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    external_block_hash,
    spec_kind,
)
from jaxkv.sched._host_tier import HostKVCache
from jaxkv.sched._ledger import StepLedger
from jaxkv.sched._manager import KVCacheManager
from jaxkv.sched._metrics import (
    PrefixCacheStats,
    PrometheusCollector,
    SchedulerStats,
    SpecDecodingCounter,
    SpecDecodingStats,
)
from jaxkv.sched._planner import StepPlanner
from jaxkv.sched._prefix import (
    hash_token_blocks,
    longest_cache_hit,
    prefix_caching_unsupported,
)
from jaxkv.sched._request import Request, RequestStatus
from jaxkv.sched._scheduled import ScheduledStep, sampled_token_indices
from jaxkv.sched._scheduler import Scheduler
from jaxkv.sched._table_rows import StepBlocks

__all__ = [
    "AllBlocksCleared",
    "BlockAllocator",
    "BlockRemoved",
    "BlockStored",
    "HostKVCache",
    "KVCacheEvent",
    "KVCacheManager",
    "KVEventBatch",
    "MEDIUM_GPU",
    "PrefixCacheStats",
    "PrometheusCollector",
    "Request",
    "RequestStatus",
    "ScheduledStep",
    "Scheduler",
    "SchedulerStats",
    "SpecDecodingCounter",
    "SpecDecodingStats",
    "StepApplier",
    "StepBlocks",
    "StepLedger",
    "StepPlanner",
    "ZmqEventPublisher",
    "encode_kv_event_batch",
    "external_block_hash",
    "hash_token_blocks",
    "longest_cache_hit",
    "prefix_caching_unsupported",
    "sampled_token_indices",
    "spec_kind",
]
