"""The options of a :class:`ServingLoop`, as two records.

How requests are scheduled, and how each step runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxkv._util import (
    check_bool,
    check_non_negative_int,
    check_positive_int,
    checks_own_arguments,
)
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.sched import HostKVCache, KVEventBatch, Scheduler
from jaxkv.serve._checks import check_host_blocks
from jaxkv.serve._drafts import Drafter
from jaxkv.step import BucketDispatcher


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks_own_arguments
class SchedulingOptions:
    """How each data-parallel rank's :class:`Scheduler` admits and batches.

    Args:
      enable_prefix_caching: Reuse cached prefixes.
      max_num_batched_tokens: Token budget per step (default: the config's).
      max_num_seqs: Requests per step (default: the config's).
      policy: ``"fcfs"`` or ``"priority"`` (``Request(priority=...)``).
      scheduler_reserve_full_isl: Admit a request only when its whole prompt
        fits the free blocks (vLLM's default, on).
      host_blocks: Keep up to this many evicted prefix-cache blocks in host
        memory (:class:`HostKVCache`, ``loop.host``; needs prefix caching; on a
        mesh, per data rank): a prefix hit on one copies it back instead of
        recomputing it, just before the step that needs it.
      enable_kv_cache_events: Each scheduler's manager keeps vLLM's KV-cache
        events for a KV-aware router (``loop.schedulers[rank].manager.
        take_events()`` after each step).
      kv_event_sink: Called after each ``ServingLoop.step()`` (and after a
        ``reset`` or ``resize``) with a :class:`jaxkv.sched.KVEventBatch` per
        data-parallel rank that has events, as vLLM's event publisher is
        (implies ``enable_kv_cache_events``; the loop takes the events). A
        batch whose call raises stays pending and goes first next time.

    Example:
      >>> import jaxkv
      >>> opts = jaxkv.SchedulingOptions(enable_prefix_caching=True)
      >>> opts.policy, opts.scheduler_reserve_full_isl
      ('fcfs', True)
    """

    enable_prefix_caching: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    host_blocks: int = 0
    enable_kv_cache_events: bool = False
    kv_event_sink: Callable[[KVEventBatch], None] | None = None

    def __post_init__(self) -> None:
        """Each option of the right kind (``"yes"`` is not a bool), named."""
        owner = "SchedulingOptions"
        for name in (
            "enable_prefix_caching",
            "scheduler_reserve_full_isl",
            "enable_kv_cache_events",
        ):
            check_bool(owner, name, getattr(self, name))
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) is not None:
                check_positive_int(owner, name, getattr(self, name))
        check_non_negative_int(owner, "host_blocks", self.host_blocks)
        if self.kv_event_sink is not None and not callable(self.kv_event_sink):
            raise TypeError(
                f"{owner}.kv_event_sink must be callable (it takes a KVEventBatch), "
                f"got {type(self.kv_event_sink).__name__}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"{owner}.policy must be 'fcfs' or 'priority', got {self.policy!r}."
            )

    def make(
        self,
        plan: KVCachePlan,
        *,
        sharded: ShardedPlan | None,
        num_blocks: int | None,
        vocab_size: int | None,
    ) -> list[Scheduler]:
        """The schedulers these options make: one per data-parallel rank.

        Each has its own host tier (on a mesh, the rank's copies of the pools).

        Raises:
          ValueError: If ``host_blocks`` is not an int >= 0 with prefix caching.
        """
        check_host_blocks(sharded or plan, self.host_blocks, self.enable_prefix_caching)

        def host(rank: int) -> HostKVCache | None:
            if not self.host_blocks:
                return None
            return HostKVCache(
                plan, num_blocks=self.host_blocks, sharded=sharded, rank=rank
            )

        return [
            Scheduler(
                plan,
                enable_prefix_caching=self.enable_prefix_caching,
                num_blocks=num_blocks,
                host_blocks=0,  # the tier is `host`
                host=host(rank),
                vocab_size=vocab_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                policy=self.policy,
                scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                enable_kv_cache_events=self.enable_kv_cache_events
                or self.kv_event_sink is not None,
            )
            for rank in range(1 if sharded is None else sharded.data_parallel)
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks_own_arguments
class ExecutionOptions:
    """How each step runs on the device.

    Args:
      overlap: Schedule the next step while one runs (vLLM's async
        scheduling; see :class:`ServingLoop`).
      decode_steps: Decode iterations per dispatch in steady decoding
        (multi-step decoding, as vLLM's ``num_scheduler_steps``; one device
        only; ``1`` runs every step on its own).
      dispatcher: The buckets (default: the config's, as
        :class:`StepMetadataBuilder` makes them).
      param_specs: On a mesh, a ``PartitionSpec`` per leaf of the parameters
        (default: replicated).
      per_request_sampling: Each request may bring its own
        :class:`SamplingParams` (``submit(req, sampling=...)``): the step
        samples from per-row arrays, one program for any mix (a sort of the
        vocabulary per sampled row, which a greedy-only loop does not pay).
      record_logits: Keep each sampled token's logits in ``loop.logits`` (a
        device-to-host copy per step).
      drafter: Speculative decoding: before each step the loop asks it for
        draft tokens of the requests that decode next (a :class:`Drafter`:
        :class:`NgramDrafter`, or your draft model); the step verifies them
        inside its program (:func:`accept_drafts`) and each request takes
        the drafts kept and the token sampled after them. Tokens equal those
        of the loop without a drafter; steps are resolved before the next is
        scheduled (the drafts need the tokens), so overlap has no effect.
        Attention-only models; one step per dispatch (``decode_steps=1``).
      num_speculative_tokens: The most draft tokens a request verifies per
        step (longer drafts are cut; default: the drafter's own
        ``num_speculative_tokens``). Sizes the sampled rows' buckets.

    Example:
      >>> import jaxkv
      >>> jaxkv.ExecutionOptions(overlap=False).decode_steps
      1
    """

    overlap: bool = True
    decode_steps: int = 1
    dispatcher: BucketDispatcher | None = None
    param_specs: Any = None
    per_request_sampling: bool = False
    record_logits: bool = False
    drafter: Drafter | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        """Each option of the right kind (``"no"`` is not a bool), named."""
        owner = "ExecutionOptions"
        for name in ("overlap", "per_request_sampling", "record_logits"):
            check_bool(owner, name, getattr(self, name))
        k = self.num_speculative_tokens
        if self.drafter is None:
            if k is not None:
                raise ValueError(
                    f"ExecutionOptions: num_speculative_tokens={k!r} without a "
                    "drafter; give drafter= too (e.g. jaxkv.serve.NgramDrafter())."
                )
        else:
            if not callable(self.drafter):
                raise TypeError(
                    "ExecutionOptions.drafter must be callable (a Drafter: "
                    "drafter(requests) -> drafts per request), got "
                    f"{type(self.drafter).__name__}."
                )
            if k is None:
                k = getattr(self.drafter, "num_speculative_tokens", None)
                if k is None:
                    raise ValueError(
                        "ExecutionOptions: the drafter has no num_speculative_tokens; "
                        "give num_speculative_tokens= (the most draft tokens a "
                        "request verifies per step)."
                    )
            k = check_positive_int(owner, "num_speculative_tokens", k)
            object.__setattr__(self, "num_speculative_tokens", k)
        # decode_steps is checked by the loop, against max_model_len.
