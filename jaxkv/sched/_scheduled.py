"""What one schedule produces: a :class:`ScheduledStep`.

The step's requests and token counts, and its host arrays (it is the :class:`StepArrays`
that :meth:`StepMetadataBuilder.prepare` takes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxkv.sched._request import Request
from jaxkv.sched._table_rows import StepBlocks
from jaxkv.step import StepArrays


@dataclasses.dataclass(kw_only=True, eq=False)
class ScheduledStep(StepArrays):
    """One step's work: its requests and its host arrays, ready for ``builder.prepare``.

    A :class:`StepArrays` (zero requests for an empty batch) with the requests
    it was scheduled from.

    Attributes:
      batch: ``(request, tokens this step)`` in batch order (decodes first);
        each request computes its tokens from ``num_computed`` on.
      preempted: Requests preempted while scheduling this step.
      spec_token_ids: Per request id, the draft tokens this step verifies
        (vLLM's ``scheduled_spec_decode_tokens``): the request computes its
        last token and these, and samples at each of them (``1 + k`` logits,
        ``cu_num_logits`` marks them).

    Example:
      >>> import jaxkv
      >>> s = jaxkv.Scheduler(jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8))
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[7, 8, 9], max_new_tokens=2))
      >>> step = s.schedule()
      >>> [r.req_id for r in step.sampled], s.update(step, [42]), s.running[0].output
      (['a'], [], [42])
    """

    batch: list[tuple[Request, int]]
    preempted: list[Request]
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: Each request's ``(num_computed, len(output))`` when the step was
    #: scheduled, in batch order: the step is applied from them, so applying
    #: it again after an exception midway changes nothing twice.
    scheduled_counts: list[tuple[int, int]] = dataclasses.field(
        default_factory=list, repr=False
    )
    #: ``(k, request, token)`` for each token :meth:`Scheduler.resolve` took
    #: (``k``: its logits row, which is its rank in :attr:`sampled` unless
    #: the step verifies drafts: then each request has ``1 + drafts`` rows,
    #: and every token it accepted is in it); tokens of requests that ended
    #: before are not in it.
    filled: list[tuple[int, Request, int]] = dataclasses.field(
        default_factory=list, repr=False
    )
    #: With ``num_steps > 1``: per iteration, ``(k, request, token)`` for each
    #: token :meth:`Scheduler.update` or :meth:`Scheduler.resolve`
    #: took (``k``: the request's place in :attr:`batch`), in the order they
    #: were sampled.
    filled_by_iteration: list[list[tuple[int, Request, int]]] = dataclasses.field(
        default_factory=list, repr=False
    )
    #: Decode iterations the step runs on the device (``1``: an ordinary step;
    #: more: :meth:`Scheduler.schedule_decode`).
    num_steps: int = 1
    #: With ``num_steps > 1``: per KV-cache group, ``(num_steps, num_reqs)``
    #: slots of each iteration's token (``-1`` once a request has had its
    #: tokens).
    step_slots: list[np.ndarray] | None = dataclasses.field(default=None, repr=False)
    #: With ``num_steps > 1``: ``(num_reqs,)`` tokens each request samples
    #: (at most ``num_steps``, fewer near its ``max_new_tokens``).
    steps_per_request: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.scheduled_counts:
            self.scheduled_counts = [
                (r.num_computed, len(r.output)) for r, _ in self.batch
            ]

    @property
    def sampled(self) -> list[Request]:
        """Requests whose last token this step reaches, in batch order.

        Requests whose last token this step reaches: one sampled token each
        (``1 + k`` with ``k`` draft tokens), in batch order.
        """
        spec = self.spec_token_ids
        return [
            r
            for (r, n), (c, o) in zip(self.batch, self.scheduled_counts, strict=True)
            if c + n - len(spec.get(r.req_id, ())) == len(r.prompt) + o
        ]


def sampled_token_indices(
    batch: Sequence[tuple[Request, int]],
    spec_token_ids: Mapping[str, Sequence[int]] | None = None,
) -> list[int]:
    """Step-token indices whose logits are sampled.

    The last token of each request whose chunk reaches the end of its tokens, and every
    token of a request verifying draft tokens (`spec_token_ids`).

    Example:
      >>> import jaxkv
      >>> a = jaxkv.Request("a", prompt=[1, 2, 3], max_new_tokens=1)
      >>> b = jaxkv.Request("b", prompt=[1, 2, 3, 4], max_new_tokens=1)
      >>> jaxkv.sched.sampled_token_indices([(a, 3), (b, 2)])  # b's chunk is partial
      [2]
    """
    out, end = [], 0
    for req, n in batch:
        end += n
        k = len(spec_token_ids.get(req.req_id, ())) if spec_token_ids else 0
        if req.num_computed + n - k == req.num_tokens:
            out.extend(range(end - 1 - k, end))
    return out


def scheduled_step(
    batch: list[tuple[Request, int]],
    preempted: list[Request],
    blocks: StepBlocks,
    spec_token_ids: dict[str, list[int]] | None = None,
) -> ScheduledStep:
    """The step of `batch` and its host arrays.

    The step of `batch` (each request from its ``num_computed`` on) and its
    host arrays, with the batch's `blocks` (:meth:`KVCacheManager.step_blocks`)
    and the draft tokens verified (`spec_token_ids`, per request id: their
    tokens follow the request's last one).
    """
    spec = spec_token_ids or {}
    q_lens = np.fromiter((n for _, n in batch), np.int32, len(batch))
    starts = np.fromiter((r.num_computed for r, _ in batch), np.int32, len(batch))
    qsl = np.zeros(len(batch) + 1, np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    samples = sampled_token_indices(batch, spec)
    token_ids: list[int] = []
    for r, n in batch:
        if n == 1:  # a decode: one token, no list
            p, c = len(r.prompt), r.num_computed
            token_ids.append(r.prompt[c] if c < p else r.output[c - p])
        else:
            drafts = spec.get(r.req_id, ())
            token_ids += r.token_range(r.num_computed, r.num_computed + n - len(drafts))
            token_ids += drafts
    return ScheduledStep(
        batch=batch,
        preempted=preempted,
        spec_token_ids=dict(spec),
        query_start_loc=qsl,
        seq_lens=starts + q_lens,
        # Each token's position: its request's start plus its rank in it.
        positions=(
            np.arange(num_tokens, dtype=np.int32) + np.repeat(starts - qsl[:-1], q_lens)
        ).astype(np.int32),
        block_tables=blocks.block_tables,
        slot_mappings=blocks.slot_mappings,
        logits_indices=np.asarray(samples, np.int32) if samples else None,
        # Sampled tokens before each request's end.
        cu_num_logits=np.concatenate([[0], np.searchsorted(samples, qsl[1:])]).astype(
            np.int32
        ),
        token_ids=np.asarray(token_ids, np.int32),
        is_prefilling=starts
        < np.fromiter((len(r.prompt) for r, _ in batch), np.int32, len(batch)),
    )
