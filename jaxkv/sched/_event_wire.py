"""KV-cache events on vLLM's wire: msgpack batches on a ZMQ PUB socket.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends each
``KVEventBatch`` as three frames: the topic, an 8-byte big-endian sequence
number, and the batch as msgspec encodes it: an array ``[ts, events,
data_parallel_rank]`` (``nil`` on a single rank), each event a map tagged by
its class name under ``"type"``, its fields in vLLM's declaration order,
fields left at their defaults omitted (required ones always sent). A router
that subscribes to vLLM (llm-d, Dynamo) decodes jaxkv's the same way.

Needs the ``events`` extra (``pip install "jaxkv[events]"``: msgspec and
pyzmq), imported only when used.
"""

from __future__ import annotations

import itertools
from typing import Any

from jaxkv.sched._events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

# vLLM's fields after the tag, in declaration order: (name, has a default).
_STORED = (
    ("block_hashes", False),
    ("parent_block_hash", False),
    ("token_ids", False),
    ("block_size", False),
    ("lora_id", False),
    ("medium", False),
    ("lora_name", False),
    ("group_idx", True),
    ("kv_cache_spec_kind", True),
    ("kv_cache_spec_sliding_window", True),
)
_REMOVED = (("block_hashes", False), ("medium", False), ("group_idx", True))


def _fields(event: KVCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        names = _STORED
    elif isinstance(event, BlockRemoved):
        names = _REMOVED
    elif isinstance(event, AllBlocksCleared):
        names = ()
    else:
        raise TypeError(f"Not a KV-cache event: {type(event).__name__}.")
    out: dict[str, Any] = {"type": type(event).__name__}
    for name, optional in names:
        value = getattr(event, name)
        if optional and value is None:  # msgspec's omit_defaults
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def encode_kv_event_batch(batch: KVEventBatch) -> bytes:
    """`batch` as vLLM's publisher encodes a ``KVEventBatch`` (msgpack bytes).

    Example:
      >>> from jaxkv.sched import AllBlocksCleared, KVEventBatch
      >>> from jaxkv.sched._event_wire import encode_kv_event_batch
      >>> p = encode_kv_event_batch(KVEventBatch(ts=0.0, events=(AllBlocksCleared(),)))
      >>> p[0] == 0x93, p[-17:-1].decode(), p[-1] == 0xC0  # [ts, events, nil]
      (True, 'AllBlocksCleared', True)
    """
    import msgspec

    rank = batch.data_parallel_rank
    events = [_fields(e) for e in batch.events]
    # An array-like struct keeps every field, its defaults too (msgspec).
    body = [float(batch.ts), events, None if rank is None else int(rank)]
    return msgspec.msgpack.encode(body)


class ZmqEventPublisher:
    """A ``kv_event_sink`` that publishes batches on a ZMQ PUB socket, as vLLM.

    Frames ``(topic, sequence number, payload)``: vLLM's
    ``ZmqEventPublisher`` wire (no replay socket). Give it to
    ``SchedulingOptions(kv_event_sink=ZmqEventPublisher("tcp://*:5557"))``.

    Args:
      endpoint: Where the PUB socket binds (``"tcp://*:5557"``, vLLM's
        default; ``"tcp://127.0.0.1:*"`` picks a free port: see
        :attr:`endpoint`).
      topic: The first frame of every message (vLLM's default ``""``).

    Raises:
      ImportError: Without the ``events`` extra, naming it.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", *, topic: str = "") -> None:
        """Binds the PUB socket."""
        try:
            import zmq
        except ImportError as err:  # pragma: no cover - the extra is in CI
            raise ImportError(
                "ZmqEventPublisher needs pyzmq and msgspec: pip install "
                '"jaxkv[events]".'
            ) from err
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.bind(endpoint)
        #: The endpoint bound (a wildcard port resolved).
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode("utf-8")
        self._seq = itertools.count()

    def __call__(self, batch: KVEventBatch) -> None:
        """Sends `batch` as the next message."""
        seq = next(self._seq).to_bytes(8, "big")
        self._socket.send_multipart((self._topic, seq, encode_kv_event_batch(batch)))

    def close(self) -> None:
        """Closes the socket (messages not yet sent are dropped)."""
        self._socket.close(linger=0)
