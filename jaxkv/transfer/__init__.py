"""transfer: a request's KV cache moved between plans, meshes, processes.

transfer: a request's KV cache moved between plans, meshes and processes.

``_requests`` reads a request's blocks through every layer's view into a
layout-neutral :class:`RequestKV` (K/V token by token, Mamba states) and
writes one into another plan's pools (:func:`export_request`,
:func:`import_request`); ``_ranks`` joins and splits heads across
tensor-parallel degrees on a mesh; ``_remote`` sends a cache to another
process with ``jax.experimental.transfer``. A serving loop adopts a moved
request with :meth:`ServingLoop.adopt`; :func:`jaxkv.pictures.plot_transfer`
draws where the bytes land.
"""

from jaxkv.transfer._ranks import export_rank_request, import_rank_request
from jaxkv.transfer._remote import receive_request, send_request
from jaxkv.transfer._requests import (
    BlockOwner,
    LayerKV,
    RequestKV,
    export_request,
    import_request,
)

__all__ = [
    "BlockOwner",
    "LayerKV",
    "RequestKV",
    "export_rank_request",
    "export_request",
    "import_rank_request",
    "import_request",
    "receive_request",
    "send_request",
]
