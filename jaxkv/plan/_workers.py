"""KV-cache configs for several workers: pipeline stages and tensor-parallel ranks.

One scheduler drives every worker, so every worker's config has the same
groups (global, from the whole model) and the same block count (the smallest
any worker affords); each worker's pools hold only its own layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxkv._util import check_non_negative_int, check_positive_int
from jaxkv.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from jaxkv.plan._capacity import max_memory_usage_bytes
from jaxkv.plan._grouping import (
    get_kv_cache_groups,
    pool_pages,
    pool_tensors,
    split_encoder_only,
)


def get_kv_cache_config_from_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """One worker's config: as many blocks as `available_memory` holds.

    vLLM's function of the same name (the pre-0.33 tensors: one pool per
    ``shared_by`` list, see :func:`make_kv_cache_config`). A block costs one
    page in every pool; groups without layers (another pipeline stage's)
    cost nothing and stay in the config, so group ids agree across workers.

    Args:
      kv_cache_groups: The groups, projected onto this worker's layers.
      available_memory: Bytes for this worker's KV cache.

    Returns:
      The config; with no layer to hold, vLLM's 1 block and no pools.

    Raises:
      ValueError: If `available_memory` holds fewer than one block.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=2,
      ...     head_size=64, dtype="float32")
      >>> group = jaxkv.vllm.KVCacheGroupSpec(layer_names=("l0", "l1"),
      ...     kv_cache_spec=spec)
      >>> cfg = jaxkv.vllm.get_kv_cache_config_from_groups(
      ...     [group], 2 * spec.page_size_bytes * 10 + 5)
      >>> cfg.num_blocks, [t.shared_by for t in cfg.kv_cache_tensors]
      (10, [('l0',), ('l1',)])
    """
    check_non_negative_int(
        "get_kv_cache_config_from_groups", "available_memory", available_memory
    )
    pages = pool_pages(kv_cache_groups)
    if not pages:
        return KVCacheConfig(
            num_blocks=1, kv_cache_tensors=(), kv_cache_groups=tuple(kv_cache_groups)
        )
    bytes_per_block = sum(page for page, _ in pages)
    num_blocks = available_memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"get_kv_cache_config_from_groups: available_memory={available_memory} "
            f"bytes holds no block; one block costs {bytes_per_block} bytes over "
            f"{len(pages)} pools."
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=pool_tensors(
            kv_cache_groups, num_blocks=num_blocks, packed=False
        ),
        kv_cache_groups=tuple(kv_cache_groups),
    )


def get_kv_cache_configs(
    kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]],
    available_memory: Sequence[int],
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
) -> list[KVCacheConfig]:
    """Every worker's KV-cache config, consistent across workers.

    vLLM's ``get_kv_cache_configs``:

    1. The workers' specs are merged into the whole model's (a layer on two
       tensor-parallel ranks must have one spec).
    2. Groups come from the whole model (:func:`get_kv_cache_groups`), so
       pipeline stages get the same group ids and similar group sizes.
    3. Each worker gets the groups projected onto its layers, and the blocks
       its memory holds; then every worker is cut to the smallest block count,
       its pools shrunk to match (the scheduler's block ids must be valid on
       every worker).

    Args:
      kv_cache_specs: One ``layer -> spec`` mapping per worker.
      available_memory: Bytes for the KV cache on each worker.
      max_model_len: With `max_num_batched_tokens`, check that each worker
        holds one request of this many tokens (vLLM's
        ``check_enough_kv_cache_memory``).
      max_num_batched_tokens: The scheduler's token budget per step (sliding
        windows keep that many more tokens).
      disable_hybrid_kv_cache_manager: See :func:`get_kv_cache_groups`.

    Returns:
      One config per worker, in order.

    Raises:
      ValueError: If the lists differ in length, a layer has different specs
        on two workers, a worker's memory holds no block, or (with
        `max_model_len`) too little for one request.

    Example (vLLM's pipeline-parallel case: stage 0 holds ``layer1``, stage 1
    ``layer2`` and ``layer3``; each gets 10 blocks of its own pools):
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=2,
      ...     head_size=64, dtype="float32")
      >>> cfgs = jaxkv.vllm.get_kv_cache_configs(
      ...     [{"layer1": spec}, {"layer2": spec, "layer3": spec}],
      ...     [spec.page_size_bytes * 20] * 2)
      >>> [(c.num_blocks, [t.shared_by for t in c.kv_cache_tensors]) for c in cfgs]
      [(10, [('layer1',)]), (10, [('layer2',), ('layer3',)])]
    """
    if len(kv_cache_specs) != len(available_memory):
        raise ValueError(
            f"get_kv_cache_configs: {len(kv_cache_specs)} workers' kv_cache_specs "
            f"but {len(available_memory)} available_memory entries; give one of "
            "each per worker."
        )
    if not kv_cache_specs:
        raise ValueError("get_kv_cache_configs: no worker given (kv_cache_specs=[]).")
    if (max_model_len is None) != (max_num_batched_tokens is None):
        raise ValueError(
            "get_kv_cache_configs: give both max_model_len and "
            f"max_num_batched_tokens or neither, got max_model_len={max_model_len!r}"
            f", max_num_batched_tokens={max_num_batched_tokens!r}."
        )
    for rank, memory in enumerate(available_memory):
        check_non_negative_int(
            "get_kv_cache_configs", f"available_memory[{rank}]", memory
        )
    merged = _merged_specs(kv_cache_specs)
    cache, encoder_only = split_encoder_only(merged)
    groups = [
        *get_kv_cache_groups(
            cache, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager
        ),
        *encoder_only,
    ]
    per_worker = [_project(groups, specs) for specs in kv_cache_specs]
    if max_model_len is not None and max_num_batched_tokens is not None:
        check_positive_int("get_kv_cache_configs", "max_model_len", max_model_len)
        for rank, (specs, memory) in enumerate(
            zip(kv_cache_specs, available_memory, strict=True)
        ):
            _check_enough_memory(
                rank,
                specs,
                memory,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            )
    configs: list[KVCacheConfig] = []
    for rank, (worker_groups, memory) in enumerate(
        zip(per_worker, available_memory, strict=True)
    ):
        try:
            configs.append(get_kv_cache_config_from_groups(worker_groups, memory))
        except ValueError as err:
            raise ValueError(f"get_kv_cache_configs: worker {rank}: {err}") from None
    with_pools = [c.num_blocks for c in configs if c.kv_cache_tensors]
    if not with_pools:
        return configs
    num_blocks = min(with_pools)
    return [
        KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=pool_tensors(
                c.kv_cache_groups, num_blocks=num_blocks, packed=False
            ),
            kv_cache_groups=c.kv_cache_groups,
        )
        if c.kv_cache_tensors
        else c
        for c in configs
    ]


def _merged_specs(
    kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    merged: dict[str, KVCacheSpec] = {}
    where: dict[str, int] = {}
    for rank, specs in enumerate(kv_cache_specs):
        for name, spec in specs.items():
            if name in merged and merged[name] != spec:
                raise ValueError(
                    f"get_kv_cache_configs: layer {name!r} has different specs on "
                    f"worker {where[name]} ({merged[name]}) and worker {rank} "
                    f"({spec}); tensor-parallel ranks of one stage must agree."
                )
            merged.setdefault(name, spec)
            where.setdefault(name, rank)
    return merged


def _project(
    groups: Sequence[KVCacheGroupSpec], worker_spec: Mapping[str, KVCacheSpec]
) -> tuple[KVCacheGroupSpec, ...]:
    projected = []
    for group in groups:
        names = tuple(n for n in group.layer_names if n in worker_spec)
        spec = group.kv_cache_spec
        if (
            names
            and len(names) != len(group.layer_names)
            and isinstance(spec, UniformTypeKVCacheSpecs)
        ):
            spec = UniformTypeKVCacheSpecs(
                block_size=spec.block_size,
                kv_cache_specs={n: spec.kv_cache_specs[n] for n in names},
            )
        projected.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return tuple(projected)


def _check_enough_memory(
    rank: int,
    specs: Mapping[str, KVCacheSpec],
    memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> None:
    needed = sum(
        max_memory_usage_bytes(
            s,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        for s in specs.values()
    )
    if needed > memory:
        raise ValueError(
            f"get_kv_cache_configs: worker {rank} has {memory} bytes for the KV "
            f"cache, but one request of max_model_len={max_model_len} tokens needs "
            f"{needed} bytes over its {len(specs)} layers; give more memory or "
            "lower max_model_len."
        )
