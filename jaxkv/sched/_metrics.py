"""What a monitoring stack reads from a scheduler.

vLLM's ``SchedulerStats`` and ``PrefixCacheStats`` as records, the same
figures under vLLM's Prometheus metric names, and an optional
``prometheus_client`` collector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the scheduler was made (vLLM's fields).

    One lookup per admission (a preempted request is looked up again when it
    is admitted again): ``queries`` counts the tokens looked up (the
    request's known tokens), ``hits`` the tokens taken from the cache; the
    ``preempted_*`` fields count those of previously preempted requests.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    """A snapshot of a scheduler (vLLM's ``SchedulerStats``, and counters).

    Attributes:
      num_running_reqs: Requests holding blocks.
      num_waiting_reqs: Requests queued (new and preempted).
      kv_cache_usage: Fraction of the usable blocks held by requests
        (vLLM's ``BlockPool.get_usage``: cached free blocks count as free).
      prefix_cache_stats: See :class:`PrefixCacheStats`.
      num_preemptions: Preemptions so far.
      num_generation_tokens: Output tokens sampled so far (those kept).
      num_cached_prompt_tokens: Prompt tokens taken from the prefix cache.
      num_rejected_reqs: Requests :meth:`Scheduler.add_request` rejected.
      num_steps: Steps scheduled.

    Example (:meth:`Scheduler.make_stats`):
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
      >>> s = jaxkv.Scheduler(plan, enable_prefix_caching=True)
      >>> for i in range(2):
      ...     _ = s.add_request(jaxkv.Request(f"r{i}", prompt=[1] * 70,
      ...                                     max_new_tokens=1))
      ...     while s.has_unfinished:
      ...         step = s.schedule(); _ = s.update(step, [0] * len(step.sampled))
      >>> stats = s.make_stats()
      >>> stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits
      (140, 64)
      >>> stats.metrics()["vllm:generation_tokens"]
      2.0
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: PrefixCacheStats
    num_preemptions: int
    num_generation_tokens: int
    num_cached_prompt_tokens: int
    num_rejected_reqs: int
    num_steps: int

    def metrics(self) -> dict[str, float]:
        """The figures under vLLM's Prometheus names.

        As ``vllm/v1/metrics/loggers.py`` names them: gauges
        ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
        ``vllm:kv_cache_usage_perc`` (a fraction, as vLLM's); counters
        ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
        ``vllm:num_preemptions``, ``vllm:generation_tokens``,
        ``vllm:prompt_tokens_cached``.
        """
        return {name: value for name, value, _, _ in _families(self)}


_GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
_COUNTERS = {
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of "
    "queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemptions.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local prefix cache).",
}


def _families(stats: SchedulerStats) -> Iterator[tuple[str, float, str, bool]]:
    """``(name, value, documentation, is_counter)`` of every metric."""
    values = {
        "vllm:num_requests_running": stats.num_running_reqs,
        "vllm:num_requests_waiting": stats.num_waiting_reqs,
        "vllm:kv_cache_usage_perc": stats.kv_cache_usage,
        "vllm:prefix_cache_queries": stats.prefix_cache_stats.queries,
        "vllm:prefix_cache_hits": stats.prefix_cache_stats.hits,
        "vllm:num_preemptions": stats.num_preemptions,
        "vllm:generation_tokens": stats.num_generation_tokens,
        "vllm:prompt_tokens_cached": stats.num_cached_prompt_tokens,
    }
    for name, doc in _GAUGES.items():
        yield name, float(values[name]), doc, False
    for name, doc in _COUNTERS.items():
        yield name, float(values[name]), doc, True


@runtime_checkable
class StatsSource(Protocol):
    """What :class:`PrometheusCollector` reads: a :class:`Scheduler` is one."""

    def make_stats(self) -> SchedulerStats:  # noqa: D102
        ...


class PrometheusCollector:
    """A ``prometheus_client`` collector over one or more schedulers.

    One per data-parallel rank, labelled ``engine``, read at each scrape:
    nothing is copied between scrapes, and a :meth:`ServingLoop.reset` is
    followed.

    Needs ``prometheus_client`` (``pip install "jaxkv[metrics]"``); jaxkv
    itself never imports it.

    Args:
      schedulers: A scheduler, or a callable returning the current ones
        (``lambda: loop.schedulers``).
      model_name: The ``model_name`` label (vLLM labels every metric with it).

    Example:
      >>> import prometheus_client, jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
      >>> s = jaxkv.Scheduler(plan)
      >>> registry = prometheus_client.CollectorRegistry()
      >>> registry.register(jaxkv.sched.PrometheusCollector(s, model_name="tiny"))
      >>> registry.get_sample_value("vllm:num_requests_waiting",
      ...     {"model_name": "tiny", "engine": "0"})
      0.0
    """

    def __init__(
        self,
        schedulers: StatsSource | Callable[[], Sequence[StatsSource]],
        *,
        model_name: str = "jaxkv",
    ) -> None:
        """Keeps the source; reads nothing yet."""
        self._source = schedulers
        self.model_name = str(model_name)

    def _schedulers(self) -> Sequence[StatsSource]:
        if isinstance(self._source, StatsSource):
            return [self._source]
        return list(self._source())

    def collect(self) -> Iterator[Any]:
        """One metric family per name, a sample per scheduler."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        per_rank = [s.make_stats() for s in self._schedulers()]
        if not per_rank:
            return
        labels = ["model_name", "engine"]
        rows = [list(_families(stats)) for stats in per_rank]
        for k, (name, _, doc, is_counter) in enumerate(rows[0]):
            family = (
                CounterMetricFamily(name, doc, labels=labels)
                if is_counter
                else GaugeMetricFamily(name, doc, labels=labels)
            )
            for rank, row in enumerate(rows):
                family.add_metric([self.model_name, str(rank)], row[k][1])
            yield family
