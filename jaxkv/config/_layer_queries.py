"""Configuration-time queries over the model's layers (spec §2.4-§2.6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from jaxkv.config._config import RunnerConfig
from jaxkv.config._specs import KVCacheSpec


def get_kv_cache_spec(vllm_config: RunnerConfig) -> dict[str, KVCacheSpec]:
    """Specs of the layers that own a cache, in registration order.

    Layers with a KV-sharing target and layers without a spec are skipped; a
    draft layer's spec is marked ``is_draft=True`` (which does not change its
    equality).

    Args:
      vllm_config: The runner configuration.

    Returns:
      ``layer name -> spec``.

    Example:
      >>> import jaxkv
      >>> fa = jaxkv.get_backend("FLASH_ATTN")
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name="attn0", spec=spec, backend=fa),
      ...     jaxkv.LayerConfig(name="attn1", spec=spec, backend=fa,
      ...                       kv_sharing_target="attn0"),
      ...     jaxkv.LayerConfig(name="enc", spec=None, backend=fa,
      ...                       attn_type="encoder_only"),
      ...     jaxkv.LayerConfig(name="draft.attn0", spec=spec, backend=fa,
      ...                       is_draft=True)])
      >>> specs = jaxkv.vllm.get_kv_cache_spec(cfg)
      >>> list(specs), specs["draft.attn0"].is_draft
      (['attn0', 'draft.attn0'], True)
    """
    specs: dict[str, KVCacheSpec] = {}
    for layer in vllm_config.layers:
        if layer.kv_sharing_target is not None or layer.spec is None:
            continue
        spec = layer.spec
        if layer.is_draft:
            spec = dataclasses.replace(spec, is_draft=True)  # pyright: ignore[reportArgumentType]
        specs[layer.name] = spec
    return specs


def get_shared_kv_cache_layers(vllm_config: RunnerConfig) -> dict[str, str]:
    """Plain attention layers that read another layer's cache: ``layer -> target``.

    Only ``layer_type == "attention"`` counts (spec §2.5, §5.8): an MLA layer
    with a target is not reported here.

    Example:
      >>> import jaxkv
      >>> fa, mla = jaxkv.get_backend("FLASH_ATTN"), jaxkv.get_backend("FLASHMLA")
      >>> s = jaxkv.FullAttentionSpec(block_size=64, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> m = jaxkv.MLAAttentionSpec(block_size=64, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name="L0", spec=s, backend=fa),
      ...     jaxkv.LayerConfig(name="L1", spec=m, backend=mla),
      ...     jaxkv.LayerConfig(name="L2", spec=s, backend=fa, kv_sharing_target="L0"),
      ...     jaxkv.LayerConfig(name="L3", spec=s, backend=fa, kv_sharing_target=""),
      ...     jaxkv.LayerConfig(name="M", spec=m, backend=mla, kv_sharing_target="L1")])
      >>> jaxkv.vllm.get_shared_kv_cache_layers(cfg)
      {'L2': 'L0'}
    """
    return {
        layer.name: layer.kv_sharing_target
        for layer in vllm_config.layers
        if layer.layer_type == "attention" and layer.kv_sharing_target is not None
    }


def get_kv_sharing_fast_prefill_eligible_layers(
    vllm_config: RunnerConfig,
    draft_layer_names: Collection[str] | None = None,
) -> set[str]:
    """Trailing run of KV-sharing layers, eligible for fast prefill.

    In You Only Cache Once (https://arxiv.org/abs/2405.05254) and similar KV
    sharing setups, only the layers that generate KV caches take part in the
    prefill, so prefill can exit early. Layers are registered in execution
    order, so the eligible layers are the contiguous suffix of KV-sharing
    layers. Draft layers register after the target model's layers (and may
    share KV themselves), so they are skipped in the walk.

    Args:
      vllm_config: The runner configuration (fast prefill must be switched on).
      draft_layer_names: Layers to skip (not stop at) in the reverse walk.

    Returns:
      The eligible layer names.

    Example:
      >>> import jaxkv
      >>> fa = jaxkv.get_backend("FLASH_ATTN")
      >>> s = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> share = {"L3": "L1", "L4": "L2", "L5": "L1"}
      >>> cfg = jaxkv.RunnerConfig(kv_sharing_fast_prefill=True, layers=[
      ...     jaxkv.LayerConfig(name=f"L{i}", spec=s, backend=fa,
      ...                       kv_sharing_target=share.get(f"L{i}"))
      ...     for i in range(6)])
      >>> sorted(jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(cfg, {"L4"}))
      ['L3', 'L5']
      >>> sorted(jaxkv.vllm.get_kv_sharing_fast_prefill_eligible_layers(cfg))
      ['L3', 'L4', 'L5']
    """
    if not vllm_config.kv_sharing_fast_prefill:
        return set()
    shared = get_shared_kv_cache_layers(vllm_config)
    if not shared:
        return set()
    drafts = set(draft_layer_names) if draft_layer_names is not None else set()
    eligible: set[str] = set()
    for layer in reversed(vllm_config.layers):
        if layer.layer_type != "attention":
            continue
        if layer.name in drafts:
            continue
        if layer.name not in shared:
            break
        eligible.add(layer.name)
    return eligible
