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
class SpecDecodingStats:
    """Draft tokens verified and accepted so far (vLLM's ``SpecDecodingStats``).

    One draft per request and step that verified draft tokens: ``k`` draft
    tokens, of which the first ``a`` were accepted (the token sampled after
    them is not counted). Per position ``i``: how many drafts had an
    ``i``-th token, and how many accepted it.

    Example:
      >>> import jaxkv
      >>> stats = jaxkv.sched.SpecDecodingStats(num_drafts=2, num_draft_tokens=6,
      ...     num_accepted_tokens=3, num_accepted_tokens_per_pos=(2, 1, 0),
      ...     num_draft_tokens_per_pos=(2, 2, 2))
      >>> stats.acceptance_rate, stats.mean_acceptance_length
      (0.5, 2.5)
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_draft_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a request: ``1 + accepted / drafts``."""
        if not self.num_drafts:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


class SpecDecodingCounter:
    """Counts drafts as a scheduler resolves them (see :class:`SpecDecodingStats`).

    Example:
      >>> from jaxkv.sched import SpecDecodingCounter
      >>> c = SpecDecodingCounter(); c.observe(num_draft_tokens=3, num_accepted=1)
      >>> c.stats().num_accepted_tokens_per_pos
      (1, 0, 0)
    """

    def __init__(self) -> None:
        """No draft yet."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_per_pos: list[int] = []
        self.drafted_per_pos: list[int] = []

    def observe(self, *, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's draft of `num_draft_tokens`, `num_accepted` of them kept."""
        if not num_draft_tokens:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted += num_accepted
        grow = num_draft_tokens - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(num_draft_tokens):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < num_accepted

    def stats(self) -> SpecDecodingStats:
        """The counts so far, as a record."""
        return SpecDecodingStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted,
            num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
            num_draft_tokens_per_pos=tuple(self.drafted_per_pos),
        )


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
      spec_decoding_stats: Draft tokens verified and accepted (speculative
        decoding; :class:`SpecDecodingStats`).

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
    spec_decoding_stats: SpecDecodingStats = SpecDecodingStats()

    def metrics(self) -> dict[str, float]:
        """The figures under vLLM's Prometheus names.

        As ``vllm/v1/metrics/loggers.py`` names them: gauges
        ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
        ``vllm:kv_cache_usage_perc`` (a fraction, as vLLM's); counters
        ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
        ``vllm:num_preemptions``, ``vllm:generation_tokens``,
        ``vllm:prompt_tokens_cached``; with drafts verified,
        ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``
        and ``vllm:spec_decode_num_accepted_tokens``.
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
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
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
    spec = stats.spec_decoding_stats
    if spec.num_drafts:
        counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for (name, doc), value in zip(_SPEC_COUNTERS.items(), counts, strict=True):
            yield name, float(value), doc, True


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
