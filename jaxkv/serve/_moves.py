"""Requests that move between loops: a running request's KV cache read out
(:meth:`~RequestMoves.export_request`) and a request continued from a KV cache
computed elsewhere (:meth:`~RequestMoves.adopt`, prefill/decode
disaggregation).
"""  # noqa: D205

from __future__ import annotations

from jaxkv.sched import Request, RequestStatus, Scheduler
from jaxkv.serve._pipeline import StepPipeline
from jaxkv.transfer import RequestKV, export_request, import_request


class RequestMoves(StepPipeline):
    """The :class:`ServingLoop` methods that move a request's KV cache (over
    the pipeline, whose :meth:`resume` they call first).
    """  # noqa: D205

    def export_request(self, req: Request) -> RequestKV:
        """The KV cache of running request `req`: its computed tokens, after
        every step in flight is applied (:meth:`resume`); see
        :func:`export_request`.

        Raises:
          ValueError: On a mesh (not supported yet), or if `req` is not running.
        """  # noqa: D205
        sched = self._one_scheduler("export_request")
        self.resume()
        if req not in sched.running:
            raise ValueError(
                f"export_request: request {req.req_id!r} is not running (status "
                f"{req.status.value})."
            )
        return export_request(
            self.plan,
            self.pools,
            block_ids=sched.manager.blocks_of(req),
            num_tokens=req.num_computed,
        )

    def adopt(self, req: Request, kv: RequestKV) -> bool:
        """Continues `req` from a KV cache computed elsewhere (another loop's
        :meth:`export_request`, on any plan of the same layers: prefill/decode
        disaggregation): :meth:`Scheduler.adopt` holds its blocks,
        :func:`import_request` writes the cache into them. Returns ``False``
        (nothing changed) when too few blocks are free now.

        All or nothing: a cache the plan refuses (another layer set, shapes or
        dtypes: named) leaves the scheduler and the pools as they were.

        Raises:
          ValueError: As :meth:`Scheduler.adopt` and :func:`import_request`,
            or on a mesh (not supported yet).
        """  # noqa: D205
        sched = self._one_scheduler("adopt")
        self.resume()
        ids = sched.adopt(req, num_computed=kv.num_tokens)
        if ids is None:
            return False
        try:
            self.pools = import_request(self.plan, self.pools, kv, block_ids=ids)
        except BaseException:
            sched.finish(req)
            req.status, req.num_computed = RequestStatus.WAITING, 0
            raise
        return True

    def _one_scheduler(self, fn: str) -> Scheduler:
        if self.num_ranks != 1 or self.sharded is not None:
            raise ValueError(
                f"ServingLoop.{fn}: moving a request's KV cache on a mesh is not "
                "supported yet (one device only)."
            )
        return self.schedulers[0]
