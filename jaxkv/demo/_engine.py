"""A small serving loop: continuous batching on the built-in model through jaxkv.

The Engine is one use of :class:`~jaxkv.ServingLoop`: the built-in Flax NNX
model as the step function (its weights split over heads on a mesh), greedy
sampling, and what a demo adds (arrivals at given steps, progress, logits on
each request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxkv.sched as jaxkv_sched
from jaxkv import RunnerConfig
from jaxkv.demo._model import TinyHybridModel, forward_paged
from jaxkv.demo._tensor_parallel import tensor_parallel_state
from jaxkv.plan import KVCacheView, local_runner_config, make_plan, shard_plan
from jaxkv.sched import BlockAllocator
from jaxkv.serve import Drafter, ExecutionOptions, SchedulingOptions, ServingLoop
from jaxkv.step import BucketDispatcher


@dataclasses.dataclass(eq=False)
class EngineRequest(jaxkv_sched.Request):
    """A :class:`jaxkv.Request` with what the demo Engine adds.

    Attributes:
      arrival_step: Step at which the request arrives.
      logits: The logits each generated token was sampled from, when the
        Engine records them (``record_logits=True``).
      rank: The data-parallel rank serving the request (0 without a mesh).
    """

    arrival_step: int = 0
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    rank: int = 0


class Engine(ServingLoop):
    """Continuous batching on the built-in model through jaxkv.

    A :class:`~jaxkv.ServingLoop` whose step is the built-in model
    (:func:`~jaxkv.demo.forward_paged`), with greedy sampling: the loop's
    scheduler(s) admit (rejecting what can never be served), pick requests and
    tokens, preempt and reuse cached prefixes; its builder packs the step and
    arms fast prefill; one compiled program per bucket runs the step with the
    pools donated. The Engine adds arrivals (:attr:`EngineRequest.arrival_step`),
    progress, and logits recorded on each request.

    With a `mesh`, the model is served tensor-parallel over heads on
    `tensor_axis` and data-parallel over requests on `data_axis`: pools from
    :func:`shard_plan`, the model's weights split by
    :func:`~jaxkv.demo._tensor_parallel.tensor_parallel_state`, the loop's
    ``shard_map`` per step (check_vma on), one scheduler per data rank, every
    rank's step prepared at once by the builder (fast prefill staged on each
    rank's row).

    Args:
      config: The runner configuration (layers, limits, buckets).
      model: The model.
      num_blocks: Blocks per pool (per data-parallel rank).
      token_buckets: Token buckets (default: the config's).
      request_buckets: Request buckets (default: the config's, or
        ``(max_num_seqs,)``).
      pages_per_chunk: Pages per step of the attention's online softmax;
        default (``None``): :func:`jaxkv.paged_attention`'s, 4 on CPU and 64
        on accelerators.
      record_logits: Keep each sampled token's logits on its request (a
        device-to-host copy per step; for tests and debugging).
      mesh: Serve over this device mesh (``None``: one device).
      data_axis: The mesh's data-parallel axis.
      tensor_axis: The mesh's tensor-parallel axis.
      enable_prefix_caching: Reuse cached prefixes (see :class:`Scheduler`).
      overlap: Schedule step N+1 while step N runs (the loop's async
        scheduling); off by default, so a fault lands in ``update()``.
      implementation: The kernels of the model's writes and attention
        (:func:`jaxkv.paged_attention`; ``"native"``: jaxkv's C++ kernels on
        CPU where they apply).
      drafter: Speculative decoding (``ExecutionOptions(drafter=...)``, e.g.
        :class:`jaxkv.serve.NgramDrafter`): a config of attention layers only.
    """

    def __init__(
        self,
        config: RunnerConfig,
        model: TinyHybridModel,
        *,
        num_blocks: int,
        token_buckets: Sequence[int] | None = None,
        request_buckets: Sequence[int] | None = None,
        pages_per_chunk: int | None = None,
        record_logits: bool = False,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        tensor_axis: str = "tensor",
        enable_prefix_caching: bool = False,
        overlap: bool = False,
        implementation: str | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """Plans and allocates the pools, splits the model, builds the loop."""
        self.config = config
        self.mesh = mesh
        vocab = model.lm_head.out_features
        plan, graphdef, state, split, specs = _plan_and_state(
            config,
            model,
            num_blocks=num_blocks,
            mesh=mesh,
            data_axis=data_axis,
            tensor_axis=tensor_axis,
        )
        local = plan if mesh is None else plan.local
        self.pages_per_chunk = pages_per_chunk
        # What the model's layers read: attention layers with their spec's
        # window, Mamba layers their state view.
        layers = {
            name: local.attention_layer(name) if isinstance(view, KVCacheView) else view
            for name, view in local.views.items()
        }
        axis = None if mesh is None else tensor_axis

        def forward(state: Any, pools: Any, meta: Any, tokens: Any, sample: Any) -> Any:
            if split is not None:  # this device's block of the split weights
                state = jax.tree.map(lambda x, s: x[0] if s else x, state, split)
            armed = any(m.fast_prefill for m in meta.values())
            return forward_paged(
                nnx.merge(graphdef, state),
                pools,
                layers,
                meta,
                tokens,
                sample,
                armed,
                pages_per_chunk,
                tensor_axis=axis,
                implementation=implementation,
            )

        buckets = tuple(
            token_buckets if token_buckets is not None else config.token_buckets
        )
        reqs = tuple(
            request_buckets if request_buckets is not None else config.request_buckets
        )
        dispatcher = BucketDispatcher(
            token_buckets=buckets,
            max_num_tokens=config.max_num_batched_tokens,
            max_num_reqs=config.max_num_seqs,
            request_buckets=reqs or (config.max_num_seqs,),
            cg_support=local.cg_support.min_cg_support,
        )
        super().__init__(
            plan,
            forward,
            state,
            vocab_size=vocab,
            scheduling=SchedulingOptions(enable_prefix_caching=enable_prefix_caching),
            execution=ExecutionOptions(
                param_specs=specs,
                record_logits=record_logits,
                overlap=overlap,
                dispatcher=dispatcher,
                drafter=drafter,
            ),
        )
        self._run: dict[str, Any] | None = None

    @property
    def state(self) -> Any:
        """The model's weights as the step takes them (split on a mesh)."""
        return self.params

    @property
    def allocator(self) -> BlockAllocator:
        """Rank 0's block allocator (the only one without a mesh)."""
        return self.schedulers[0].manager.allocator

    def _deliver(self, filled: Any, logits: Any) -> None:
        super()._deliver(filled, logits)
        if logits is not None:
            for k, req, _ in filled:
                if isinstance(req, EngineRequest):
                    req.logits.append(logits[k])

    def resume(self) -> str | None:
        """The loop's :meth:`~jaxkv.ServingLoop.resume`, keeping arrival steps.

        The loop's :meth:`~jaxkv.ServingLoop.resume`; a step it finished
        counts, so arrivals keep their step. :meth:`run` calls it first, so
        ``engine.run([])`` after an exception finishes every request (those
        not yet arrived included).
        """
        done = super().resume()
        if done is not None and self._run is not None:
            self._run["steps"] += 1
        return done

    def run(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        requests: Sequence[EngineRequest],
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[int, int]:
        """Serves `requests` to completion; returns (steps, generated tokens).

        Requests that can never be served are rejected (``status`` REJECTED,
        ``reject_reason`` says why) while the others are served; when blocks
        run out, the most recently admitted request of a rank is preempted and
        recomputed later. Steps with nothing to run are skipped to the next
        arrival.

        After an exception (a fault in the model, the device, the host, an
        interrupt), call ``run([])`` (or ``run(more_requests)``): it resumes
        the step in flight (:meth:`resume`), then serves every request of the
        interrupted run, the ones not arrived yet included, with the outputs
        and logits a run without the fault gives.
        """
        if self._run is None:
            self._run = {"pending": [], "requests": [], "steps": 0, "total": 0}
        run = self._run
        # Requests of the interrupted run passed again are not added twice.
        seen = {id(r) for r in run["requests"]}
        requests = [r for r in requests if id(r) not in seen]
        run["requests"] += requests
        run["pending"] = sorted(
            [*run["pending"], *requests], key=lambda r: r.arrival_step
        )
        run["total"] += sum(max(0, r.max_new_tokens) for r in requests)
        self.resume()
        pending = run["pending"]
        while pending or self.has_unfinished:
            if pending and not self.has_unfinished:
                # Nothing to run: skip to the next arrival.
                run["steps"] = max(run["steps"], pending[0].arrival_step)
            while pending and pending[0].arrival_step <= run["steps"]:
                # A new request goes to the data-parallel rank with fewest.
                req = pending[0]
                req.rank = min(
                    range(self.num_ranks),
                    key=lambda r: (
                        len(self.schedulers[r].running)
                        + len(self.schedulers[r].waiting)
                    ),
                )
                self.schedulers[req.rank].add_request(req)
                pending.pop(0)
            self.step()
            run["steps"] += 1
            if progress:
                generated = sum(len(r.output) - r.num_pending for r in run["requests"])
                progress(generated, run["total"])
        self._run = None
        return run["steps"], sum(len(r.output) for r in run["requests"])

    @property
    def stats(self) -> dict[str, int]:
        """The schedulers' counters summed over ranks (preemptions, prefix hits)."""
        out: dict[str, int] = {}
        for s in self.schedulers:
            for k, v in s.stats.items():
                out[k] = out.get(k, 0) + v
        return out


def _plan_and_state(
    config: RunnerConfig,
    model: TinyHybridModel,
    *,
    num_blocks: int,
    mesh: Mesh | None,
    data_axis: str,
    tensor_axis: str,
) -> tuple[Any, Any, Any, Any, Any]:
    """The model's plan and its weights (split over a mesh's tensor axis).

    ``(plan, graphdef, state, split, param_specs)``: the model's plan (a
    :class:`ShardedPlan` on a mesh) and its weights, on a mesh split over the
    tensor axis (`split` marks the split leaves; ``None`` on one device).
    """
    if mesh is None:
        plan = make_plan(config, num_blocks=num_blocks, maps_slot_mapping=True)
        graphdef, state = nnx.split(model)
        return plan, graphdef, state, None, None
    plan = shard_plan(
        config,
        mesh=mesh,
        data_axis=data_axis,
        tensor_axis=tensor_axis,
        num_blocks=num_blocks,
        maps_slot_mapping=True,
    )
    tp = plan.tensor_parallel
    graphdef, state, split = tensor_parallel_state(
        model,
        local_runner_config(config, tensor_parallel=tp),
        tensor_parallel=tp,
        vocab_size=model.lm_head.out_features,
    )
    specs = jax.tree.map(lambda s: P(tensor_axis) if s else P(), split)
    return plan, graphdef, state, split, specs
