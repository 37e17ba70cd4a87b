"""Capability checks over attention groups (spec §2.1, §2.8-§2.10)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Sequence

from jaxkv.config import AttentionCGSupport, RunnerConfig
from jaxkv.groups._attn_group import AttentionGroup


@dataclasses.dataclass(frozen=True)
class AttentionCGSupportInfo:
    """Weakest compile/graph support seen and the backend that set it.

    Example:
      >>> import jaxkv
      >>> S = jaxkv.vllm.AttentionCGSupport
      >>> info = jaxkv.vllm.AttentionCGSupportInfo().narrow(S.UNIFORM_BATCH, "X")
      >>> info.narrow(S.UNIFORM_BATCH, "Y").min_cg_attn_backend
      'X'
      >>> info.narrow(S.NEVER, None)
      AttentionCGSupportInfo(min_cg_support=<AttentionCGSupport.NEVER: 0>, min_cg_attn_backend=None)
    """  # noqa: E501

    min_cg_support: AttentionCGSupport = AttentionCGSupport.ALWAYS
    min_cg_attn_backend: str | None = None

    def narrow(
        self, support: AttentionCGSupport, backend: str | None
    ) -> AttentionCGSupportInfo:
        """Return an info tightened by `support` if it is more restrictive.

        Lets attention groups built outside :func:`init_attn_backend` (e.g.
        encoder-only layers) contribute to the step's compile decision. Ties keep
        the existing backend name.
        """
        if int(support) < int(self.min_cg_support):
            return AttentionCGSupportInfo(AttentionCGSupport(support), backend)
        return self


def _check_config(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    runner_config: RunnerConfig | None,
    caller: str,
) -> None:
    """Every grouped layer must belong to `runner_config` (groups of another model)."""
    if runner_config is None:
        return
    for groups in attn_groups:
        for group in groups:
            for name in group.layer_names:
                if name not in runner_config:
                    raise ValueError(
                        f"{caller}: attention group layer {name!r} is not a layer of "
                        "runner_config; were the groups built for another model?"
                    )


def _checked_groups(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    checked_layer_names: Collection[str] | None,
) -> Iterator[AttentionGroup]:
    checked = None if checked_layer_names is None else set(checked_layer_names)
    for groups in attn_groups:
        for group in groups:
            if checked is not None and checked.isdisjoint(group.layer_names):
                continue
            yield group


def get_attn_cg_support(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    vllm_config: RunnerConfig | None = None,
    checked_layer_names: Collection[str] | None = None,
) -> AttentionCGSupportInfo:
    """Return the weakest compile/graph support among the checked layers.

    Args:
      attn_groups: Attention groups per KV-cache group.
      vllm_config: The runner configuration: every grouped layer must be one
        of its layers (``None``: not checked).
      checked_layer_names: Only groups with a layer in this set are visited.

    Returns:
      The minimum support and the first backend reaching it.

    Example:
      >>> import jaxkv
      >>> S = jaxkv.vllm.AttentionCGSupport
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> def g(name, support):
      ...     b = jaxkv.AttentionBackend(name=name,
      ...         layout=jaxkv.KVCacheLayout.BLOCKS_FIRST, cudagraph_support=support)
      ...     return jaxkv.vllm.AttentionGroup(backend=b, layer_names=(name.lower(),),
      ...         kv_cache_spec=spec, kv_cache_group_id=0)
      >>> jaxkv.vllm.get_attn_cg_support([[g("A", S.ALWAYS), g("B", S.UNIFORM_BATCH)],
      ...     [g("C", S.UNIFORM_SINGLE_TOKEN_DECODE),
      ...      g("D", S.UNIFORM_SINGLE_TOKEN_DECODE)]]).min_cg_attn_backend
      'C'
    """
    _check_config(attn_groups, vllm_config, "get_attn_cg_support")
    info = AttentionCGSupportInfo()
    for group in _checked_groups(attn_groups, checked_layer_names):
        info = info.narrow(group.backend.cudagraph_support, group.backend.class_name)
    return info


def get_query_lens_mismatch_unsupported_backend(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    checked_layer_names: Collection[str] | None = None,
) -> str | None:
    """Name the first backend needing the host query lengths to be exact, if any.

    The attention selector already excludes these when adaptive verification is
    enabled, but models that hard-wire their backend never consult it. See
    :meth:`AttentionBackend.supports_device_cpu_query_lens_mismatch`.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
      >>> g = jaxkv.vllm.AttentionGroup(backend=jaxkv.get_backend("MAMBA2"),
      ...     layer_names=("mamba",), kv_cache_spec=spec, kv_cache_group_id=0)
      >>> jaxkv.vllm.get_query_lens_mismatch_unsupported_backend([[g]])
      'Mamba2AttentionBackend'
      >>> from jaxkv.vllm import get_query_lens_mismatch_unsupported_backend
      >>> get_query_lens_mismatch_unsupported_backend([[g]], {"target"}) is None
      True
    """
    for group in _checked_groups(attn_groups, checked_layer_names):
        if not group.backend.supports_device_cpu_query_lens_mismatch():
            return group.backend.class_name
    return None


def get_varlen_cudagraph_unsupported_backend(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    vllm_config: RunnerConfig | None,
    max_query_len: int,
    checked_layer_names: Collection[str] | None = None,
) -> tuple[str, int | None] | None:
    """Name the first backend whose full compiled steps cannot replay varlen decodes.

    A fully-compiled step must replay decode batches of 1 to `max_query_len`
    tokens per request. ``ALWAYS`` backends replay any batch; the others need a
    bound of at least `max_query_len` (``NEVER`` has no bound).

    Args:
      attn_groups: Attention groups per KV-cache group.
      vllm_config: The runner configuration: every grouped layer must be one
        of its layers (``None``: not checked).
      max_query_len: Longest query per request a decode batch may have.
      checked_layer_names: Only groups with a layer in this set are visited.

    Returns:
      ``(backend name, bound)`` of the first failing group, else ``None``.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> b = jaxkv.AttentionBackend(name="_DraftBackend",
      ...     layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
      ...     cudagraph_support=jaxkv.vllm.AttentionCGSupport.UNIFORM_BATCH,
      ...     varlen_cudagraph_max_query_len=8)
      >>> g = jaxkv.vllm.AttentionGroup(backend=b, layer_names=("draft",),
      ...     kv_cache_spec=spec, kv_cache_group_id=0)
      >>> jaxkv.vllm.get_varlen_cudagraph_unsupported_backend([[g]], None, 8) is None
      True
      >>> jaxkv.vllm.get_varlen_cudagraph_unsupported_backend([[g]], None, 9)
      ('_DraftBackend', 8)
    """
    _check_config(attn_groups, vllm_config, "get_varlen_cudagraph_unsupported_backend")
    for group in _checked_groups(attn_groups, checked_layer_names):
        support = group.backend.cudagraph_support
        if support == AttentionCGSupport.ALWAYS:
            continue
        bound = (
            None
            if support == AttentionCGSupport.NEVER
            else group.backend.varlen_cudagraph_max_query_len
        )
        if bound is None or bound < max_query_len:
            return group.backend.class_name, bound
    return None
