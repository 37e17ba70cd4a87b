"""A request's KV cache sent to another process (``jax.experimental.transfer``).

A request's KV cache sent to another process with JAX's own transfer
library (``jax.experimental.transfer``): prefill/decode disaggregation.

The sender offers two pulls: a one-entry int32 header (the token count), then
the cache's arrays in a fixed order; the receiver builds the arrays' shapes
from its own plan (the layers, per-token shapes and dtypes must match the
sender's, as :func:`import_request` requires) and the header, and pulls them
onto its device. No transport of jaxkv's own: the bytes move through the
transfer server's connection.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv import gather_kv_pages
from jaxkv.plan import KVCachePlan, KVCacheView, MambaView
from jaxkv.transfer._requests import LayerKV, RequestKV


def _payload(kv: RequestKV) -> list[Any]:
    """The cache's arrays in the order :func:`receive_request` rebuilds them."""
    out: list[Any] = []
    for name in sorted(kv.attention):
        layer = kv.attention[name]
        out.append(jnp.asarray(layer.keys))
        if layer.values is not None:
            out.append(jnp.asarray(layer.values))
        out.append(jnp.asarray(layer.present, jnp.int8))
    for name in sorted(kv.states):
        out.extend(jnp.asarray(x) for x in kv.states[name])
    return out


def _deadline(timeout: Any) -> datetime.datetime | None:
    """`timeout` (a ``datetime``, seconds from now, or ``None``) as a deadline."""
    if timeout is None or isinstance(timeout, datetime.datetime):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            "receive_request: timeout must be a datetime.datetime or seconds, got "
            f"{type(timeout).__name__}."
        )
    return datetime.datetime.now() + datetime.timedelta(seconds=float(timeout))


def _pull(
    connection: Any, uuid: int, specs: list[Any], deadline: datetime.datetime | None
) -> Any:
    """``connection.pull`` that returns or raises by `deadline`.

    Whatever the peer does: the call itself runs on a worker thread (a transport may
    block in it: the thread is abandoned at the deadline), and the arrays it hands back,
    still arriving with JAX's transfer library, are polled (``is_ready``) until they all
    are or the deadline passes. Never a wait inside native code the deadline cannot end.
    """
    if deadline is None:
        return connection.pull(uuid, specs)
    done: dict[str, Any] = {}

    def work() -> None:
        try:
            done["value"] = connection.pull(uuid, specs, timeout=deadline)
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller
            done["error"] = err

    def late() -> TimeoutError:
        return TimeoutError(
            f"receive_request: nothing arrived for uuid {uuid} by the deadline "
            f"{deadline.isoformat(timespec='milliseconds')} (is the sender there, "
            "and has it called send_request with this uuid?)."
        )

    worker = threading.Thread(target=work, name=f"jaxkv-pull-{uuid}", daemon=True)
    worker.start()
    worker.join(max((deadline - datetime.datetime.now()).total_seconds(), 0.0))
    if worker.is_alive():
        raise late()
    if "error" in done:
        raise done["error"]
    arrays = done["value"]
    pause = 1e-4
    while not all(a.is_ready() for a in jax.tree.leaves(arrays)):
        if datetime.datetime.now() >= deadline:
            raise late()
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return arrays


def send_request(server: Any, kv: RequestKV, *, uuid: int) -> None:
    """Offers `kv` to one :func:`receive_request` of the same `uuid`.

    And ``uuid + 1`` through `server` (``jax.experimental.transfer.
    start_transfer_server``); returns once the pulls are scheduled (the server serves
    them while it lives).

    Raises:
      ValueError: If `uuid` is not a non-negative int.

    Example:
      >>> import jax
      >>> from jax.experimental import transfer
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> kv = jaxkv.transfer.export_request(plan, plan.allocate(),
      ...     block_ids=[[1], [2], [3]], num_tokens=5)
      >>> client = jax.devices()[0].client
      >>> sender = transfer.start_transfer_server(client, "127.0.0.1:0",
      ...                                         ["127.0.0.1:0"])
      >>> jaxkv.transfer.send_request(sender, kv, uuid=1)
      >>> receiver = transfer.start_transfer_server(client, "127.0.0.1:0",
      ...                                           ["127.0.0.1:0"])
      >>> got = jaxkv.transfer.receive_request(
      ...     receiver.connect(sender.address()), plan, uuid=1)
      >>> got.num_tokens, got.attention["layers.0.self_attn"].keys.shape
      (5, (5, 2, 32))
    """
    if isinstance(uuid, bool) or not isinstance(uuid, int) or uuid < 0:
        raise ValueError(
            f"send_request: uuid must be a non-negative int, got {uuid!r}."
        )
    server.await_pull(uuid, [jnp.asarray([kv.num_tokens], jnp.int32)])
    server.await_pull(uuid + 1, _payload(kv))


def _shapes(plan: KVCachePlan, n: int, sharding: Any) -> list[tuple[str, Any]]:
    """``(what, ShapeDtypeStruct)`` of the payload of `n` tokens for `plan`."""
    pools = jax.eval_shape(plan.allocate)
    out: list[tuple[str, Any]] = []
    layers = plan.owning_layers()
    for name in sorted(nm for _, nm, g in layers if g is not None):
        view = plan.views[name]
        if not isinstance(view, KVCacheView):  # pragma: no cover
            continue
        k, v = jax.eval_shape(
            lambda p, vw=view: gather_kv_pages(p, vw, jnp.zeros((1, 1), jnp.int32)),
            pools,
        )
        out.append(
            (
                f"{name} keys",
                jax.ShapeDtypeStruct((n, *k.shape[3:]), k.dtype, sharding=sharding),
            )
        )
        if v is not None:
            out.append(
                (
                    f"{name} values",
                    jax.ShapeDtypeStruct((n, *v.shape[3:]), v.dtype, sharding=sharding),
                )
            )
        out.append(
            (f"{name} present", jax.ShapeDtypeStruct((n,), jnp.int8, sharding=sharding))
        )
    for name in sorted(nm for _, nm, g in layers if g is None):
        view = plan.views[name]
        if not isinstance(view, MambaView):  # pragma: no cover
            continue
        for i, s in enumerate(view.states):
            out.append(
                (
                    f"{name} state {i}",
                    jax.ShapeDtypeStruct((1, *s.shape[1:]), s.dtype, sharding=sharding),
                )
            )
    return out


def receive_request(
    connection: Any, plan: KVCachePlan, *, uuid: int, timeout: Any = None
) -> RequestKV:
    """Pulls a request's cache that a :func:`send_request` of `uuid` offers.

    Shaped for `plan` (onto its first device), ready for :func:`import_request` or
    :meth:`ServingLoop.adopt`.

    Args:
      connection: ``server.connect(sender_address)``.
      plan: The receiving plan (its layers decide the arrays pulled).
      uuid: The sender's `uuid`.
      timeout: A deadline for the whole receive: an absolute
        ``datetime.datetime``, or seconds from now. It holds even when the
        transport does not return (a peer that is not there): each pull runs
        on a worker thread that is abandoned at the deadline.

    Raises:
      ValueError: If the header is not a positive token count.
      TimeoutError: If the request's cache has not arrived by the deadline
        (naming the uuid).

    Example:
      See :func:`send_request`.
    """
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    deadline = _deadline(timeout)
    (header,) = _pull(
        connection,
        uuid,
        [jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sharding)],
        deadline,
    )
    n = int(np.asarray(header)[0])
    if n < 1:
        raise ValueError(f"receive_request: the sender offers {n} tokens.")
    shapes = _shapes(plan, n, sharding)
    arrays = _pull(connection, uuid + 1, [s for _, s in shapes], deadline)
    got = dict(zip((w for w, _ in shapes), arrays, strict=True))
    attention = {}
    states: dict[str, list[jax.Array]] = {}
    for what, _ in shapes:
        name, kind = (
            what.rsplit(" ", 1)
            if " state " not in what
            else (what.split(" state ")[0], "state")
        )
        if kind == "present":
            attention[name] = LayerKV(
                keys=got[f"{name} keys"],
                values=got.get(f"{name} values"),
                present=np.asarray(got[what]).astype(bool),
            )
        elif kind == "state":
            states.setdefault(name, []).append(got[what])
    return RequestKV(
        num_tokens=n,
        attention=attention,
        states={k: tuple(v) for k, v in states.items()},
    )
