"""Requests that move between loops: a running request's KV cache read out
(:meth:`~RequestMoves.export_request`) and a request continued from a KV cache
computed elsewhere (:meth:`~RequestMoves.adopt`, prefill/decode
disaggregation), on one device or a mesh of any tensor-parallel degree.
"""  # noqa: D205

from __future__ import annotations

from jaxkv.sched import Request, RequestStatus, Scheduler
from jaxkv.serve._pipeline import StepPipeline
from jaxkv.transfer import (
    RequestKV,
    export_rank_request,
    export_request,
    import_rank_request,
    import_request,
)


class RequestMoves(StepPipeline):
    """The :class:`ServingLoop` methods that move a request's KV cache (over
    the pipeline, whose :meth:`resume` they call first).
    """  # noqa: D205

    def export_request(self, req: Request) -> RequestKV:
        """The KV cache of running request `req`: its computed tokens, after
        every step in flight is applied (:meth:`resume`); see
        :func:`export_request`. On a mesh, read from the request's
        data-parallel rank with every tensor rank's heads joined
        (:func:`export_rank_request`): the global model's cache, which a loop
        of any tensor-parallel degree adopts.

        Raises:
          ValueError: If `req` is not running.
        """  # noqa: D205
        self.resume()
        rank = next(
            (d for d, s in enumerate(self.schedulers) if req in s.running), None
        )
        if rank is None:
            raise ValueError(
                f"export_request: request {req.req_id!r} is not running (status "
                f"{req.status.value})."
            )
        manager = self.schedulers[rank].manager
        ids, n = manager.blocks_of(req), req.num_computed
        if self.sharded is None:
            return export_request(self.plan, self.pools, block_ids=ids, num_tokens=n)
        return export_rank_request(
            self.sharded, self.pools, data=rank, block_ids=ids, num_tokens=n
        )

    def adopt(self, req: Request, kv: RequestKV) -> bool:
        """Continues `req` from a KV cache computed elsewhere (another loop's
        :meth:`export_request`, on any plan of the same layers: prefill/decode
        disaggregation): :meth:`Scheduler.adopt` holds its blocks,
        :func:`import_request` writes the cache into them. Returns ``False``
        (nothing changed) when too few blocks are free now.

        On a mesh the request goes to the data-parallel rank with the fewest
        live requests (as :meth:`submit`), and :func:`import_rank_request`
        splits the heads over this loop's tensor ranks, whatever degree the
        exporting loop had.

        All or nothing: a cache the plan refuses (another layer set, shapes or
        dtypes, heads that do not split: named) leaves the schedulers and the
        pools as they were.

        Raises:
          ValueError: As :meth:`Scheduler.adopt` and :func:`import_request`.
        """  # noqa: D205
        self.resume()
        rank, sched = min(
            enumerate(self.schedulers),
            key=lambda rs: len(rs[1].running) + len(rs[1].waiting),
        )
        ids = sched.adopt(req, num_computed=kv.num_tokens)
        if ids is None:
            return False
        try:
            if self.sharded is None:
                self.pools = import_request(self.plan, self.pools, kv, block_ids=ids)
            else:
                self.pools = import_rank_request(
                    self.sharded, self.pools, kv, data=rank, block_ids=ids
                )
        except BaseException:
            _unadopt(sched, req)
            raise
        return True


def _unadopt(sched: Scheduler, req: Request) -> None:
    """Gives back what :meth:`Scheduler.adopt` held: `req` as it came."""
    sched.finish(req)
    req.status, req.num_computed = RequestStatus.WAITING, 0
