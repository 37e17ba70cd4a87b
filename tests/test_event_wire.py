"""KV-cache events on vLLM's wire (issue 60): the batches jaxkv publishes
decode with vLLM's own schema (``vllm/distributed/kv_events.py``: an
array-like ``KVEventBatch`` of events tagged by class name, defaults
omitted) into the same values, re-encode to the same bytes, and arrive over
ZMQ as vLLM's ``ZmqEventPublisher`` sends them.
"""  # noqa: D205

from typing import Any

import msgspec
import pytest
import zmq

from jaxkv.sched import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    encode_kv_event_batch,
)

# vLLM 0.32's schema, field for field (its classes need torch to import).


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _KVBatch(_Batch):
    events: list[_Stored | _Removed | _Cleared]


def _batch(rank):
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    return KVEventBatch(
        ts=1765000000.25,
        events=(
            BlockStored(
                block_hashes=(h1, h2),
                parent_block_hash=None,
                token_ids=tuple(range(32)),
                block_size=16,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=64,
            ),
            BlockRemoved(block_hashes=(h1,), group_idx=1),
            # Fields left at vLLM's defaults are not sent (omit_defaults).
            BlockRemoved(block_hashes=(h2,), group_idx=None),
            AllBlocksCleared(),
        ),
        data_parallel_rank=rank,
    )


@pytest.mark.parametrize("rank", [None, 3])
def test_a_batch_decodes_with_vllms_schema_and_reencodes_to_its_bytes(rank):
    batch = _batch(rank)
    payload = encode_kv_event_batch(batch)
    decoded = msgspec.msgpack.decode(payload, type=_KVBatch)
    assert decoded.ts == batch.ts
    assert decoded.data_parallel_rank == rank
    stored, removed, _, cleared = decoded.events
    assert isinstance(stored, _Stored)
    assert stored.block_hashes == [bytes(range(32)), bytes(range(1, 33))]
    assert stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, stored.group_idx) == (16, "GPU", 1)
    assert stored.kv_cache_spec_kind == "sliding_window"
    assert stored.kv_cache_spec_sliding_window == 64
    assert stored.lora_id is None
    assert stored.parent_block_hash is None
    assert isinstance(removed, _Removed)
    assert (removed.block_hashes, removed.group_idx) == ([bytes(range(32))], 1)
    assert isinstance(cleared, _Cleared)
    # vLLM's encoder writes the same bytes for the same values.
    assert msgspec.msgpack.encode(decoded) == payload


def test_batches_arrive_over_zmq_as_vllms_publisher_sends_them():
    # (topic, 8-byte big-endian sequence number, payload); a loop hands its
    # batches to the publisher as to any sink (tests/test_kv_event_sink.py).
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        # A subscriber joins a PUB socket asynchronously: send until it hears.
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        probe = KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))
        for _ in range(200):
            publisher(probe)
            if poller.poll(20):
                break
        while poller.poll(50):  # the probes
            sub.recv_multipart()
        for rank in (None, 1, 2):
            publisher(_batch(rank))
        frames = [sub.recv_multipart() for _ in range(3)]
    finally:
        sub.close(linger=0)
        publisher.close()
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    assert all(f[0] == b"kv" for f in frames)
    batches = [msgspec.msgpack.decode(f[2], type=_KVBatch) for f in frames]
    assert [b.data_parallel_rank for b in batches] == [None, 1, 2]
    assert all(isinstance(b.events[0], _Stored) for b in batches)
