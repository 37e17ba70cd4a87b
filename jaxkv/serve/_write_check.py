"""ServingLoop's check that `forward` keeps every KV-owning layer's write.

A forward that drops one layer's write (a result discarded, a layer
skipped) serves on with stale K/V or state for that layer: wrong tokens,
no error. Once, before the first request is queued, the loop traces
`forward` from shapes with its writes recorded
(:func:`jaxkv.kv._write_log.recording_writes`) and follows each returned
pool back through the writes that produced it: the pool a write returned
is the pool the next write was given, down to the pool `forward` was
given. A write off that line was dropped (the value of what it wrote may
still flow into later layers' K/V through attention, but its pages are
not kept). Every KV-owning layer (a KV-sharing layer reads its target's
cache) must have a kept write through its view, as many as layers own the
view (layers of different KV-cache groups can share one view, each
group's block ids addressing its own pages); the first short of one is
named.

A forward that makes no recorded write (``write_kv``, ``write_mamba_state``,
``put_kernel_cache``) at all writes by means of its own: not checked.
Where a returned pool comes from something other than a write or the
given pool (a ``lax.scan`` over a layer stack, a ``cond``, a function of
yours under ``jax.jit``), its line cannot be followed at this level: that
pool's writes count as kept. The check may miss a write dropped there; it
never refuses a forward that keeps its writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxkv.kv import Write, recording_writes
from jaxkv.plan import KVCachePlan


def check_forward_writes(
    forward: Any, plan: KVCachePlan, args: tuple, check_result: Any
) -> None:
    """Raises naming the first KV-owning layer `forward` does not keep a write of.

    `args`: `forward`'s arguments ``(params, pools, meta, tokens, sample)``,
    arrays or tracers (only their shapes are used: `forward` is traced, not
    run). `check_result(out, pools, sample)` first checks what it returned
    (its own refusals come first: a result of the wrong kind is named as
    such).
    """
    kept: set[int] = set()
    log: list[Write] = []

    def traced(*a: Any) -> Any:
        nonlocal log
        with recording_writes() as log:
            out = forward(*a)
        new_pools, _ = check_result(out, a[1], a[4])
        kept.update(_kept(log, a[1], new_pools))
        return ()

    jax.make_jaxpr(traced)(*args)
    if not log:  # writes by other means than jaxkv's: nothing to follow
        return
    views = list(plan.views.values())
    for w in log:
        if not any(_covers(w, v) for v in views):
            theirs = getattr(_unstacked(w.view), "num_blocks", None)
            raise ValueError(
                f"ServingLoop: forward writes through a view that is not one of "
                f"the loop's plan (a view of {theirs} blocks; the plan's pools "
                f"hold {plan.num_blocks}): it addresses other pools' pages. Build "
                "forward from the loop's plan (plan.attention_layer(name)); after "
                "ServingLoop.resize(plan), pass forward= built from that plan."
            )
    for view, owners in _owners(plan).items():
        mine = [i for i, w in enumerate(log) if _covers(w, view)]
        any_slot = any(_traced(log[i].layer) for i in mine)
        held = [i for i in mine if i in kept]
        need = 1 if any_slot else len(owners)
        if len(mine) >= need and len(held) >= need:
            continue
        what = "KV" if "block" in getattr(view, "axes", ()) else "state"
        who = (
            f"layer {owners[0]!r}'s {what}"
            if len(owners) == 1
            else f"layers {owners}' {what} (they share one view through different "
            f"KV-cache groups: {len(owners)} writes a step, {len(held)} kept)"
        )
        if len(mine) < need:
            raise ValueError(
                f"ServingLoop: forward never writes {who} (no write_kv / "
                "write_mamba_state through its view): every later step would "
                "read stale values for it. Write each KV-owning layer once per "
                "step (through plan.attention_layer(name) or its view)."
            )
        raise ValueError(
            f"ServingLoop: forward writes {who} but the pools it returns do not "
            "keep that write (its result was discarded, or a later write was "
            "given the pools from before it): every later step would read stale "
            "values for the layer. Thread each write's returned pools into the "
            "next write and return the last."
        )


def _kept(log: list[Write], given: Any, returned: Any) -> set[int]:
    """The writes on the line of each returned pool (see the module)."""
    given_leaves = jax.tree.leaves(given)
    returned_leaves = jax.tree.leaves(returned)
    if len(given_leaves) != len(returned_leaves):
        return set(range(len(log)))  # check_forward_result names this
    kept: set[int] = set()
    for p, (start, pool) in enumerate(zip(given_leaves, returned_leaves, strict=True)):
        # A jitted write returns every pool anew: pool p's line passes
        # through writes of other pools too, keeping only those of pool p.
        by_result = {
            id(w.returned[p]): i
            for i, w in enumerate(log)
            if len(w.returned) > p and w.returned[p] is not w.given[p]
        }
        line: set[int] = set()
        while id(pool) in by_result and by_result[id(pool)] not in line:
            i = by_result[id(pool)]
            line.add(i)
            pool = log[i].given[p]
        mine = {i for i, w in enumerate(log) if w.view.pool == p}
        # From a scan, cond or jitted function of yours: not followed.
        kept |= (line & mine) if pool is start else mine
    return kept


def _owners(plan: KVCachePlan) -> dict[Any, list[str]]:
    """The layers that write what they read, by view.

    A KV-sharing layer reads its target's cache (no write of its own).
    """
    cfg = plan.runner_config
    out: dict[Any, list[str]] = {}
    for name, view in plan.views.items():
        if cfg.layer(name).kv_sharing_target is None:
            out.setdefault(view, []).append(name)
    return out


def _traced(layer: Any) -> bool:
    if layer is None:
        return False
    try:
        int(layer)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return True
    return False


def _modulo_slot(view: Any) -> Any:
    fields = {f.name for f in dataclasses.fields(view)}
    reset = {"layer": 0, "offset": 0, "stacked": False}
    return dataclasses.replace(view, **{k: v for k, v in reset.items() if k in fields})


def _unstacked(view: Any) -> Any:
    if hasattr(view, "stacked"):
        return dataclasses.replace(view, stacked=False)
    return view


def _covers(write: Write, view: Any) -> bool:
    """Whether `write` writes through `view` (its own slot, or a traced one)."""
    if write.layer is None:
        return _unstacked(write.view) == view
    if _modulo_slot(write.view) != _modulo_slot(view):
        return False
    return _traced(write.layer) or int(write.layer) == getattr(view, "layer", None)
