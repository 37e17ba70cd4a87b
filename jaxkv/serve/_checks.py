"""What ServingLoop refuses: bad arguments and a bad `forward` result.

What ServingLoop refuses: arguments of the wrong kind, and a `forward` that
returns something other than the pools it was given and one logits row per
sampled token (checked while tracing, so a mistake is named before it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxkv._util import host_int_array
from jaxkv.config import MambaSpec
from jaxkv.kv import Pools
from jaxkv.plan import KVCachePlan, ShardedPlan
from jaxkv.sched import Request
from jaxkv.serve._sampling import SamplingParams

_T = TypeVar("_T")


def check_forward_result(
    out: Any, pools: Pools, sample: jax.Array, *, vocab_size: int | None = None
) -> tuple[Any, Any]:
    """Trace-time check of what `forward` returned.

    ``(pools, logits)`` with the pools' shapes and dtypes (and not the very arrays it
    was given: its writes would be lost), one logits row per sampled token, and exactly
    `vocab_size` columns (a wider row could sample an id the scheduler refuses; a
    narrower one never samples the last ids).
    """
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(
            "ServingLoop: forward must return (pools, logits), got "
            f"{type(out).__name__}."
        )
    new_pools, logits = out
    given = jax.tree.leaves(pools)
    returned = jax.tree.leaves(new_pools)
    if (
        given
        and len(returned) == len(given)
        and all(a is b for a, b in zip(returned, given, strict=True))
    ):
        raise ValueError(
            "ServingLoop: forward returned the very pools it was given, so "
            "nothing it wrote would be kept (every step would read stale K/V). "
            "Return the pools write_kv / write_mamba_state gave back, not the "
            "argument (a discarded write_kv result, or a holder read before "
            "the model ran)."
        )
    want = [(tuple(p.shape), p.dtype) for p in jax.tree.leaves(pools)]
    got = [
        (tuple(jnp.shape(p)), jnp.result_type(p)) for p in jax.tree.leaves(new_pools)
    ]
    if jax.tree.structure(new_pools) != jax.tree.structure(pools) or got != want:
        raise ValueError(
            "ServingLoop: forward returned pools that are not the ones it was "
            f"given (shapes and dtypes {got[:4]}, expected {want[:4]}): return "
            "the pools write_kv / write_mamba_state gave back."
        )
    shape = jnp.shape(logits)
    if len(shape) != 2 or shape[0] != sample.shape[0]:
        raise ValueError(
            "ServingLoop: forward must return logits of shape (num_samples, "
            f"vocab) = ({sample.shape[0]}, vocab), one row per index of "
            f"sample_idx; got {shape}."
        )
    if vocab_size is not None and shape[1] > vocab_size:
        raise ValueError(
            f"ServingLoop: forward returned logits of {shape[1]} columns, but "
            f"vocab_size is {vocab_size}: ids in [{vocab_size}, {shape[1]}) could "
            "be sampled and would be refused. Return logits[:, :vocab_size] (a "
            "padded vocabulary) or pass the logits' width as vocab_size."
        )
    if vocab_size is not None and shape[1] < vocab_size:
        raise ValueError(
            f"ServingLoop: forward returned logits of {shape[1]} columns, but "
            f"vocab_size is {vocab_size}: ids in [{shape[1]}, {vocab_size}) could "
            "never be sampled. Return one column per token id, or pass the "
            "logits' width as vocab_size."
        )
    return new_pools, logits


def check_loop_arguments(
    plan: object, forward: object, sampling: object, param_specs: object
) -> None:
    """Refuses ServingLoop arguments of the wrong kind, naming each."""
    if not callable(forward):
        raise TypeError(
            f"ServingLoop: forward must be callable, got {type(forward).__name__}."
        )
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(
            "ServingLoop: sampling must be a SamplingParams, got "
            f"{type(sampling).__name__}."
        )
    if not isinstance(plan, KVCachePlan | ShardedPlan):
        raise TypeError(
            "ServingLoop: plan must be a KVCachePlan (make_plan) or a "
            f"ShardedPlan (shard_plan), got {type(plan).__name__}."
        )
    if not isinstance(plan, ShardedPlan) and param_specs is not None:
        raise ValueError(
            "ServingLoop: param_specs shard the parameters over a mesh; give "
            "a ShardedPlan (shard_plan) or leave them out."
        )


def check_same_model(old: KVCachePlan, new: object) -> None:
    """`new` is `old`'s model planned the same way, but for ``num_blocks``."""
    if not isinstance(new, KVCachePlan):
        raise TypeError(
            "ServingLoop.resize: plan must be a KVCachePlan (make_plan), got "
            f"{type(new).__name__}."
        )
    differs = [
        name
        for name, get in (
            ("runner_config", lambda p: p.runner_config),
            ("KV-cache groups", lambda p: p.kv_cache_config.kv_cache_groups),
            ("kernel_block_sizes", lambda p: p.kernel_block_sizes),
            ("storage", lambda p: (p.storage, p.pool_dtype)),
            ("pools", lambda p: [(x.word, x.typed_dtype, x.layers) for x in p.pools]),
            ("layers", lambda p: sorted(p.views)),
        )
        if get(old) != get(new)
    ]
    if differs:
        raise ValueError(
            "ServingLoop.resize: plan must be the loop's model planned with the "
            "same options and another num_blocks; its "
            f"{', '.join(differs)} differ from the loop's plan (make it with "
            "make_plan(loop.plan.runner_config, num_blocks=..., <the same "
            "options>))."
        )


def check_param_specs(params: Any, param_specs: Any) -> None:
    """`param_specs` has one ``PartitionSpec`` per leaf of `params`."""
    specs, tree = jax.tree.flatten(param_specs, is_leaf=lambda x: isinstance(x, P))
    if tree != jax.tree.structure(params) or not all(isinstance(x, P) for x in specs):
        raise ValueError(
            "ServingLoop: param_specs must hold one PartitionSpec per leaf of "
            f"params (params: {jax.tree.structure(params)}; param_specs: {tree})."
        )


def check_host_blocks(
    plan: KVCachePlan | ShardedPlan, host_blocks: Any, enable_prefix_caching: bool
) -> None:
    """`host_blocks` is an int >= 0, with prefix caching."""
    if isinstance(host_blocks, bool) or not isinstance(host_blocks, int):
        raise TypeError(
            "ServingLoop: host_blocks must be an int, got "
            f"{type(host_blocks).__name__}."
        )
    if host_blocks < 0:
        raise ValueError(f"ServingLoop: host_blocks must be >= 0, got {host_blocks}.")
    if host_blocks and not enable_prefix_caching:
        raise ValueError(
            f"ServingLoop: host_blocks={host_blocks} needs enable_prefix_caching=True "
            "(the host tier holds evicted prefix-cache blocks)."
        )


def check_decode_steps(plan: KVCachePlan | ShardedPlan, decode_steps: object) -> int:
    """`decode_steps` is an int in ``[1, max_model_len]``, and 1 on a mesh."""
    cfg = plan.runner_config
    limit = cfg.max_model_len if cfg is not None else 2**31 - 1
    if (
        not isinstance(decode_steps, int)
        or isinstance(decode_steps, bool)
        or not 1 <= decode_steps <= limit
    ):
        raise ValueError(
            f"ServingLoop: decode_steps must be an int in [1, max_model_len="
            f"{limit}] (no request decodes more tokens than that), got "
            f"{decode_steps!r}."
        )
    if decode_steps > 1 and isinstance(plan, ShardedPlan):
        raise ValueError(
            f"ServingLoop: decode_steps={decode_steps} (multi-step decoding) runs "
            "on one device only for now; on a mesh leave it at 1."
        )
    return decode_steps


def check_drafter(plan: KVCachePlan | ShardedPlan, decode_steps: int) -> None:
    """A loop with a drafter: attention layers only, one step per dispatch."""
    local = plan.local if isinstance(plan, ShardedPlan) else plan
    mamba = [
        g.layer_names[0]
        for g in local.kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    if mamba:
        raise ValueError(
            f"ServingLoop: a drafter needs a model of attention layers only; "
            f"layer {mamba[0]!r} keeps Mamba state, which cannot be rolled back "
            "past rejected drafts."
        )
    if decode_steps > 1:
        raise ValueError(
            f"ServingLoop: a drafter verifies drafts one step per dispatch; "
            f"decode_steps={decode_steps} (multi-step decoding) cannot take "
            "them: leave decode_steps at 1."
        )


def check_drafts(
    drafts: object, reqs: Sequence[Request], *, vocab_size: int | None
) -> list[list[int]]:
    """The drafter's answer: one list of token ids per request, in the vocabulary.

    Raises:
      TypeError: If it is not one sequence of integers per request.
      ValueError: If the count is wrong or a token is outside the vocabulary
        (naming the request).
    """
    if isinstance(drafts, str | bytes) or not isinstance(drafts, Sequence):
        raise TypeError(
            "ServingLoop: the drafter must return one sequence of draft tokens "
            f"per request, got {type(drafts).__name__}."
        )
    if len(drafts) != len(reqs):
        raise ValueError(
            f"ServingLoop: the drafter was asked for {len(reqs)} requests' drafts "
            f"({[r.req_id for r in reqs][:8]}) and returned {len(drafts)}."
        )
    top = 2**31 - 1 if vocab_size is None else vocab_size
    out = []
    for req, draft in zip(reqs, drafts, strict=True):
        what = f"ServingLoop: the drafter's drafts for request {req.req_id!r}"
        if isinstance(draft, str | bytes) or not isinstance(
            draft, Sequence | np.ndarray
        ):
            raise TypeError(
                f"{what} must be a sequence of token ids, got {type(draft).__name__}."
            )
        ids = (
            host_int_array(draft, what).reshape(-1)
            if len(draft)
            else np.zeros(0, np.int64)
        )
        if ((ids < 0) | (ids >= top)).any():
            raise ValueError(
                f"{what} must be token ids in [0, {top}), got {ids.tolist()[:8]}."
            )
        out.append(ids.tolist())
    return out


def check_options(value: object, kind: type[_T], name: str) -> _T:
    """`value` (``None``: ``kind()``), refused unless it is a `kind` record."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(
            f"ServingLoop: {name} must be a jaxkv.{kind.__name__} (or None), got "
            f"{type(value).__name__}; pass its options as "
            f"{name}=jaxkv.{kind.__name__}(...)."
        )
    return value


def check_sampling_keys(requests: list[Any], sampling: Any) -> dict[str, Any]:
    """``run``'s per-request `sampling`, keyed by ids of `requests` only."""
    own = dict(sampling or {})
    unknown = sorted(set(own) - {r.req_id for r in requests})
    if unknown:
        raise ValueError(
            f"run: sampling names request ids {unknown[:5]} that are not among "
            "the requests given; each key must be the req_id of one of them."
        )
    return own
