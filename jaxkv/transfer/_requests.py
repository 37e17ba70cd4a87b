"""A request's KV cache, moved between plans through views.

:func:`export_request` reads a request's blocks through every layer's view
into a layout-neutral :class:`RequestKV`: per attention layer its keys and
values token by token (``(num_tokens, kv_heads, head_size)``, what
:func:`write_kv` takes), per Mamba layer its state after the last token.
:func:`import_request` writes one into another plan's pools through that
plan's views, at the blocks it allocated for the request. Because the form is
per token, the two plans may differ in layout (blocks-first, fused,
K/V-first), block size, kernel block size and storage (carrier words, typed,
layer-stacked); what they must share is each layer's name and the shape and
dtype of its keys, values and states, and anything else is refused naming the
layer and what differs. Tokens whose block the source no longer holds (a
sliding window's blocks behind the window, block 0) are carried as absent and
written nowhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._util import cdiv, is_int
from jaxkv.groups import AttentionGroup
from jaxkv.kv import (
    PER_TOKEN_HEAD,
    Pools,
    dequantize,
    gather_kv_pages,
    read_mamba_state,
    scale_view,
    write_kv,
    write_mamba_state,
)
from jaxkv.plan import KVCachePlan, KVCacheView, MambaView


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerKV:
    """One attention layer's cache of a request, token by token.

    Attributes:
      keys: ``(num_tokens, num_kv_heads, head_size)`` (MLA: ``(num_tokens,
        latent)``).
      values: ``(num_tokens, num_kv_heads, head_size_v)``, or ``None`` (MLA).
      present: ``(num_tokens,)`` bools: tokens whose block the source held
        (the others are zeros here and are written nowhere).
    """

    keys: jax.Array | np.ndarray
    values: jax.Array | np.ndarray | None
    present: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestKV:
    """A request's KV cache in a layout-neutral form (:func:`export_request`).

    Attributes:
      num_tokens: Tokens computed (the cache holds their K/V and the Mamba
        states after the last of them).
      attention: Per attention layer (owning a cache), its :class:`LayerKV`.
      states: Per Mamba layer, its state arrays, each ``(1, *shape)``.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> kv = jaxkv.transfer.export_request(plan, plan.allocate(),
      ...                           block_ids=[[1], [2], [3]], num_tokens=5)
      >>> kv.num_tokens, kv.attention["layers.0.self_attn"].keys.shape
      (5, (5, 2, 32))
      >>> sorted(kv.states), len(kv.states["layers.2.mixer"])
      (['layers.2.mixer', 'layers.5.mixer'], 2)
    """

    num_tokens: int
    attention: Mapping[str, LayerKV]
    states: Mapping[str, tuple[jax.Array | np.ndarray, ...]]


def _checked_ids(
    plan: KVCachePlan, block_ids: Sequence[Sequence[int]], num_tokens: object, fn: str
) -> tuple[list[np.ndarray], int]:
    if not is_int(num_tokens) or int(num_tokens) < 1:
        raise ValueError(
            f"{fn}: num_tokens must be a positive int, got {num_tokens!r}."
        )
    n = int(num_tokens)
    groups = len(plan.block_sizes)
    if len(block_ids) != groups:
        raise ValueError(
            f"{fn}: block_ids has {len(block_ids)} tables, the plan has {groups} "
            "KV-cache groups (one table each, as KVCacheManager.blocks_of gives)."
        )
    out = []
    for g, (ids, bs) in enumerate(zip(block_ids, plan.block_sizes, strict=True)):
        arr = np.asarray(ids)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{fn}: block_ids[{g}] must be a 1-D list of int ids.")
        need = cdiv(n, bs)
        if arr.size < need:
            raise ValueError(
                f"{fn}: block_ids[{g}] has {arr.size} blocks; {n} tokens of block "
                f"size {bs} need {need}."
            )
        bad = np.flatnonzero((arr < 0) | (arr >= plan.num_blocks))
        if bad.size:
            raise ValueError(
                f"{fn}: block_ids[{g}][{int(bad[0])}] = {int(arr[bad[0]])} is not a "
                f"block of this plan ([0, {plan.num_blocks}))."
            )
        out.append(arr[:need].astype(np.int32))
    return out, n


def _check_distinct(
    plan: KVCachePlan,
    layers: list[tuple[int, str, AttentionGroup | None]],
    tables: list[np.ndarray],
) -> None:
    """No block listed twice in a table, nor in two tables sharing a pool.

    No block listed twice in a table, nor in two tables whose groups'
    layers share a pool (block ``b`` of each is then the same page bytes).
    """
    for g, ids in enumerate(tables):
        real = ids[ids != 0]
        values, counts = np.unique(real, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"import_request: block_ids[{g}] lists block "
                f"{int(values[counts > 1][0])} twice; each block holds one block "
                "of tokens (0, the null block, may repeat)."
            )
    pools_of: dict[int, set[int]] = {}
    for g, name, _ in layers:
        pools_of.setdefault(g, set()).add(plan.views[name].pool)
    groups = sorted(pools_of)
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            if not pools_of[a] & pools_of[b]:
                continue
            shared = np.intersect1d(tables[a][tables[a] != 0], tables[b])
            if shared.size:
                raise ValueError(
                    f"import_request: block {int(shared[0])} is in the tables of "
                    f"groups {a} and {b}, whose layers share a pool: one group's "
                    "pages would overwrite the other's. Give each group its own "
                    "blocks (as KVCacheManager.allocate does)."
                )


@runtime_checkable
class BlockOwner(Protocol):
    """What :func:`import_request` asks of a block manager.

    :class:`jaxkv.KVCacheManager` is one.
    """

    def holds_blocks(self, req: Any) -> bool:  # noqa: D102
        ...

    def blocks_of(self, req: Any) -> list[list[int]]:  # noqa: D102
        ...


def _check_owned(
    tables: list[np.ndarray], manager: BlockOwner | None, request: Any
) -> None:
    """Every block of `tables` is one `manager` gave `request`.

    Every block of `tables` (but the null block) is one `manager` gave
    `request` in that group.
    """
    if manager is None and request is None:
        return
    if manager is None or request is None:
        raise ValueError(
            "import_request: pass manager= and request= together (the blocks are "
            "checked against the manager's allocation for the request)."
        )
    req_id = getattr(request, "req_id", None)
    if not isinstance(req_id, str):
        raise TypeError(
            "import_request: request must be the Request the blocks were "
            f"allocated for, got {type(request).__name__}."
        )
    if not manager.holds_blocks(request):
        raise ValueError(
            f"import_request: request {req_id!r} holds no blocks in the given "
            "manager; allocate its tokens there first (KVCacheManager.allocate)."
        )
    owned = manager.blocks_of(request)
    for g, ids in enumerate(tables):
        foreign = np.setdiff1d(ids[ids != 0], np.asarray(owned[g], np.int64))
        if foreign.size:
            raise ValueError(
                f"import_request: block_ids[{g}] has block {int(foreign[0])}, which "
                f"the manager did not allocate to request {req_id!r} in group {g} "
                f"(it holds {[b for b in owned[g] if b][:8]}); writing it would "
                "overwrite another request's cache."
            )


def _state_block(ids: np.ndarray, n: int, bs: int, name: str, fn: str) -> jax.Array:
    """The block holding the Mamba state after `n` tokens.

    Its table's column ``(n - 1) // bs``. As a ``(1,)`` id array.
    """
    block = int(ids[(n - 1) // bs])
    if block == 0:
        raise ValueError(
            f"{fn}_request: Mamba layer {name!r} has no block for its state after "
            f"{n} tokens (column {(n - 1) // bs} is the null block)."
        )
    return jnp.asarray([block], jnp.int32)


def _kernel_table(group: AttentionGroup, ids: np.ndarray) -> Any:
    """The request's kernel block ids.

    A packed pool's strided kernel view: a manager block's pieces ``b * stride + j``.
    """
    return group.map_to_kernel_block_table(ids[None, :])


def export_request(
    plan: KVCachePlan,
    pools: Pools,
    *,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
) -> RequestKV:
    """Reads a request's KV cache out of `pools` through `plan`'s views.

    Args:
      plan: The plan the pools belong to.
      pools: Its pools (not donated: they stay valid).
      block_ids: Per KV-cache group the request's block ids, one per block of
        its tokens (:meth:`KVCacheManager.blocks_of`; 0 where a block was given
        back).
      num_tokens: Tokens computed.

    Returns:
      The request's :class:`RequestKV`: K/V as the pages store them, but
      per-token-head quantized pages dequantized to float32 (the importing
      plan quantizes them again as it writes; fp8 per-tensor pages travel as
      their fp8 bytes).

    Raises:
      ValueError: Naming the group or layer: a table of the wrong count or too
        short, an id outside the plan.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> m = jaxkv.KVCacheManager(plan)
      >>> r = jaxkv.Request("r", prompt=[1] * 40, max_new_tokens=1)
      >>> m.allocate(r, 40), m.blocks_of(r)
      (True, [[1, 2], [3, 4], [0, 5]])
      >>> kv = jaxkv.transfer.export_request(plan, plan.allocate(),
      ...     block_ids=m.blocks_of(r), num_tokens=40)
      >>> kv.attention["layers.1.self_attn"].present.all()  # a window of 64
      np.True_
    """
    tables, n = _checked_ids(plan, block_ids, num_tokens, "export_request")
    attention: dict[str, LayerKV] = {}
    states: dict[str, tuple[jax.Array, ...]] = {}
    for g, name, group in plan.owning_layers():
        view = plan.views[name]
        ids, bs = tables[g], plan.block_sizes[g]
        if isinstance(view, MambaView):
            states[name] = tuple(
                read_mamba_state(pools, view, _state_block(ids, n, bs, name, "export"))
            )
            continue
        if group is None or not isinstance(view, KVCacheView):  # pragma: no cover
            raise TypeError(f"export_request: layer {name!r} has no attention view.")
        table = _kernel_table(group, ids)
        k_pages, v_pages = gather_kv_pages(pools, view, jnp.asarray(table))
        if view.kv_quant_mode in PER_TOKEN_HEAD:  # values, not scale-less bytes
            k_s, v_s = gather_kv_pages(pools, scale_view(view), jnp.asarray(table))
            k_pages, v_pages = dequantize(k_pages, k_s), dequantize(v_pages, v_s)
        present = ids[np.arange(n) // bs] != 0
        keep = jnp.asarray(present)
        flat = k_pages.reshape(-1, *k_pages.shape[3:])[:n]
        keys = jnp.where(keep.reshape(-1, *[1] * (flat.ndim - 1)), flat, 0)
        values = None
        if v_pages is not None:
            flat_v = v_pages.reshape(-1, *v_pages.shape[3:])[:n]
            values = jnp.where(keep.reshape(-1, 1, 1), flat_v, 0)
        attention[name] = LayerKV(keys=keys, values=values, present=present)
    return RequestKV(num_tokens=n, attention=attention, states=states)


def _check_layer(
    name: str, want: Any, got: jax.Array | np.ndarray | None, what: str
) -> None:
    """`want`: the target's abstract pages ``(1, 1, page, *per_token)``."""
    per = None if want is None else (tuple(want.shape[3:]), np.dtype(want.dtype))
    have = None if got is None else (tuple(got.shape[1:]), np.dtype(got.dtype))
    if per != have:

        def desc(x: Any) -> str:
            return "none" if x is None else f"{x[1]}{list(x[0])} per token"

        raise ValueError(
            f"import_request: layer {name!r}: the target's {what} are {desc(per)}, "
            f"the request's {desc(have)}."
        )


def _checked_layer(
    plan: KVCachePlan,
    pools: Pools,
    kv: RequestKV,
    name: str,
    group: AttentionGroup | None,
) -> Any:
    """Refuses a layer of `kv` that does not fit `plan`'s.

    Named. Returns the view to write through.
    """
    view = plan.views[name]
    if isinstance(view, MambaView):
        got = kv.states.get(name)
        if got is None:
            raise ValueError(
                f"import_request: layer {name!r} is a Mamba layer in the target, "
                "an attention layer in the request."
            )
        if len(got) != len(view.states):
            raise ValueError(
                f"import_request: layer {name!r}: the target has "
                f"{len(view.states)} state arrays, the request {len(got)}."
            )
        for i, (s, x) in enumerate(zip(view.states, got, strict=True)):
            if tuple(x.shape[1:]) != tuple(s.shape[1:]) or x.dtype != s.dtype:
                raise ValueError(
                    f"import_request: layer {name!r} state {i}: the target's is "
                    f"{np.dtype(s.dtype)}{list(s.shape[1:])}, the request's "
                    f"{x.dtype}{list(x.shape[1:])}."
                )
        return view
    if group is None or not isinstance(view, KVCacheView):  # pragma: no cover
        raise TypeError(f"import_request: layer {name!r} has no attention view.")
    layer = kv.attention.get(name)
    if layer is None:
        raise ValueError(
            f"import_request: layer {name!r} is an attention layer in the "
            "target, a Mamba layer in the request."
        )
    want_k, want_v = jax.eval_shape(
        lambda p, v=view: gather_kv_pages(p, v, jnp.zeros((1, 1), jnp.int32)),
        pools,
    )
    if view.kv_quant_mode in PER_TOKEN_HEAD:  # exported dequantized, requantized
        want_k, want_v = (
            None if w is None else jax.ShapeDtypeStruct(w.shape, jnp.float32)
            for w in (want_k, want_v)
        )
    _check_layer(name, want_k, layer.keys, "keys")
    _check_layer(name, want_v, layer.values, "values")
    return view


def _check_request_kv(kv: object) -> None:
    """Refuses a :class:`RequestKV` whose parts disagree with its token count.

    Refuses a :class:`RequestKV` whose parts disagree with its own token
    count (built by hand or changed after :func:`export_request`), naming
    the layer and the part, before the blocks are looked at.
    """
    if not isinstance(kv, RequestKV):
        raise TypeError(
            f"import_request: kv must be a RequestKV (export_request's), got "
            f"{type(kv).__name__}."
        )
    n = kv.num_tokens
    if not is_int(n) or int(n) < 1:
        raise ValueError(
            f"import_request: kv.num_tokens must be a positive int, got {n!r}."
        )
    for name, layer in kv.attention.items():
        parts = {"keys": layer.keys, "values": layer.values, "present": layer.present}
        for part, x in parts.items():
            if x is None and part == "values":
                continue
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) < 1 or shape[0] != n:
                raise ValueError(
                    f"import_request: layer {name!r}: kv's {part} have shape "
                    f"{None if shape is None else tuple(shape)}; kv.num_tokens={n} "
                    "needs one row per token."
                )
        present = np.asarray(layer.present)
        if present.ndim != 1 or present.dtype != np.bool_:
            raise ValueError(
                f"import_request: layer {name!r}: kv's present must be ({n},) "
                f"bools, got {present.dtype}{list(present.shape)}."
            )
    for name, states in kv.states.items():
        for i, x in enumerate(states):
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) < 1 or shape[0] != 1:
                raise ValueError(
                    f"import_request: Mamba layer {name!r} state {i} has shape "
                    f"{None if shape is None else tuple(shape)}; expected (1, ...): "
                    "the state after the request's last token."
                )


def import_request(
    plan: KVCachePlan,
    pools: Pools,
    kv: RequestKV,
    *,
    block_ids: Sequence[Sequence[int]],
    manager: BlockOwner | None = None,
    request: Any = None,
) -> Pools:
    """Writes a request's KV cache into `pools` through `plan`'s views.

    Args:
      plan: The target plan.
      pools: Its pools (donated).
      kv: From :func:`export_request` on any plan of the same layers.
      block_ids: Per KV-cache group of the target, the blocks allocated for
        the request (``KVCacheManager.allocate`` of ``kv.num_tokens`` tokens,
        then ``blocks_of``); tokens in block 0 are not written.
      manager: The target's block manager; with `request`, every block of
        `block_ids` must be one it allocated to that request, in that group
        (checked before anything is written).
      request: The :class:`Request` the blocks were allocated for.

    Returns:
      The pools.

    Raises:
      ValueError: If the layers differ (a layer missing on either side, or a
        key, value or state of another shape or dtype: named), or
        `block_ids` does not fit as in :func:`export_request`, lists a block
        twice, gives one block to two groups whose layers share a pool
        (their pages would overwrite each other's), or (with `manager`) holds
        a block the manager did not allocate to `request`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> src = jaxkv.make_plan(jaxkv.tiny_hybrid_config(block_size=32), num_blocks=8)
      >>> dst = jaxkv.make_plan(jaxkv.tiny_hybrid_config(block_size=16,
      ...     attention_backend="JAX_PAGED_KV_FIRST"), num_blocks=8)
      >>> name = "layers.0.self_attn"
      >>> k = jnp.arange(5 * 2 * 32, dtype=jnp.float32).reshape(5, 2, 32)
      >>> pools = jaxkv.write_kv(src.allocate(), src.views[name], k, k,
      ...                        jnp.array([32, 33, 34, 35, 36]))
      >>> move = jaxkv.transfer
      >>> kv = move.export_request(src, pools, block_ids=[[1]] * 3, num_tokens=5)
      >>> ids = [[3], [4], [5]]  # one block per group: the groups share a pool
      >>> out = move.import_request(dst, dst.allocate(), kv, block_ids=ids)
      >>> back = move.export_request(dst, out, block_ids=ids, num_tokens=5)
      >>> bool((back.attention[name].keys == k).all())
      True
    """
    _check_request_kv(kv)
    tables, n = _checked_ids(plan, block_ids, kv.num_tokens, "import_request")
    layers = plan.owning_layers()
    mine = {name for _, name, _ in layers}
    theirs = set(kv.attention) | set(kv.states)
    if mine != theirs:
        raise ValueError(
            "import_request: the target plan's cached layers differ from the "
            f"request's: only in the target {sorted(mine - theirs)}, only in the "
            f"request {sorted(theirs - mine)}."
        )
    _check_distinct(plan, layers, tables)
    _check_owned(tables, manager, request)
    # Everything is checked before anything is written: a refused import
    # leaves the pools as they were.
    writes = [_checked_layer(plan, pools, kv, name, group) for _, name, group in layers]
    for g, name, _ in layers:
        if isinstance(plan.views[name], MambaView):
            _state_block(tables[g], n, plan.block_sizes[g], name, "import")
    for (g, name, group), write in zip(layers, writes, strict=True):
        view = plan.views[name]
        ids, bs = tables[g], plan.block_sizes[g]
        if isinstance(view, MambaView):
            last = _state_block(ids, n, bs, name, "import")
            pools = write_mamba_state(pools, view, last, list(kv.states[name]))
            continue
        layer = kv.attention[name]
        pos = np.arange(n)
        block = ids[pos // bs]
        slots = np.where(layer.present & (block != 0), block * bs + pos % bs, -1)
        if group is not None:  # manager slots -> the view's kernel slots
            slots = np.asarray(group.map_to_kernel_slot_mapping(slots))
        pools = write_kv(pools, write, layer.keys, layer.values, slots.astype(np.int32))
    return pools
