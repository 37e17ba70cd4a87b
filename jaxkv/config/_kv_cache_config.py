"""Pools and groups: KVCacheTensor, KVCacheGroupSpec, KVCacheConfig (spec §1.2-§1.4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax

from jaxkv._util import check_non_negative_int, check_positive_int
from jaxkv.config._specs import KVCacheSpec


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheTensor:
    """One pool: a byte allocation shared by several layers (seed model).

    ``block_stride == 0``: an unpacked tensor, its own allocation of ``size``
    bytes; block ``b`` of every layer in ``shared_by`` is at ``[b*P, (b+1)*P)``.
    ``block_stride > 0``: a slot of the single packed backing of ``size`` bytes;
    block ``b`` of its layers is at ``b*block_stride + offset``.

    Example:
      >>> import jaxkv
      >>> t = jaxkv.vllm.KVCacheTensor(size=524288, shared_by=("full.0", "sw.0"),
      ...     offset=8192, block_stride=16384)
      >>> t.is_packed
      True
    """

    size: int
    shared_by: Sequence[str]
    offset: int = 0
    block_stride: int = 0

    def __post_init__(self) -> None:
        check_positive_int("KVCacheTensor", "size", self.size)
        check_non_negative_int("KVCacheTensor", "offset", self.offset)
        check_non_negative_int("KVCacheTensor", "block_stride", self.block_stride)
        if isinstance(self.shared_by, str):
            raise TypeError(
                f"KVCacheTensor.shared_by must be a sequence of layer names, got "
                f"the string {self.shared_by!r}."
            )
        shared_by = tuple(self.shared_by)
        if not shared_by:
            raise ValueError("KVCacheTensor.shared_by must name at least one layer.")
        if len(set(shared_by)) != len(shared_by):
            raise ValueError(f"KVCacheTensor.shared_by repeats a layer: {shared_by}.")
        if self.block_stride == 0 and self.offset != 0:
            raise ValueError(
                f"KVCacheTensor.offset={self.offset} needs block_stride > 0 "
                "(only packed tensors have an offset)."
            )
        object.__setattr__(self, "shared_by", shared_by)

    @property
    def is_packed(self) -> bool:
        """Whether this tensor is a slot inside the shared packed backing."""
        return self.block_stride > 0


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheGroupSpec:
    """Layers that share one block table.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> group = jaxkv.vllm.KVCacheGroupSpec(
      ...     layer_names=["a", "b"], kv_cache_spec=spec)
      >>> group.layer_names
      ('a', 'b')
    """

    layer_names: Sequence[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if isinstance(self.layer_names, str):
            raise TypeError(
                "KVCacheGroupSpec.layer_names must be a sequence of names, got the "
                f"string {self.layer_names!r}."
            )
        names = tuple(self.layer_names)
        if len(set(names)) != len(names):
            raise ValueError(f"KVCacheGroupSpec.layer_names repeats a layer: {names}.")
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise TypeError(
                "KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, got "
                f"{type(self.kv_cache_spec).__name__}."
            )
        object.__setattr__(self, "layer_names", names)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Blocks, pools and groups of one model's KV cache.

    Group ids are list indices. KV-sharing layers are not in any group until
    :func:`add_kv_sharing_layers_to_kv_cache_groups` returns a config with them
    appended to their target's group (jaxkv never mutates a config).

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...     head_size=128, dtype="bfloat16")
      >>> cfg = jaxkv.vllm.KVCacheConfig(num_blocks=10,
      ...     kv_cache_tensors=[
      ...         jaxkv.vllm.KVCacheTensor(size=655360, shared_by=["l0"])
      ...     ],
      ...     kv_cache_groups=[jaxkv.vllm.KVCacheGroupSpec(layer_names=["l0"],
      ...                                             kv_cache_spec=spec)])
      >>> cfg.group_of("l0"), cfg.tensor_of("l0").size
      (0, 655360)
    """

    num_blocks: int
    kv_cache_tensors: Sequence[KVCacheTensor]
    kv_cache_groups: Sequence[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        check_positive_int("KVCacheConfig", "num_blocks", self.num_blocks)
        tensors = tuple(self.kv_cache_tensors)
        groups = tuple(self.kv_cache_groups)
        object.__setattr__(self, "kv_cache_tensors", tensors)
        object.__setattr__(self, "kv_cache_groups", groups)
        seen: dict[str, int] = {}
        for gid, group in enumerate(groups):
            for name in group.layer_names:
                if name in seen:
                    raise ValueError(
                        f"KVCacheConfig: layer {name!r} is in group {seen[name]} and "
                        f"group {gid}; a layer belongs to one group."
                    )
                seen[name] = gid
        owners: dict[str, int] = {}
        for tid, tensor in enumerate(tensors):
            for name in tensor.shared_by:
                if name in owners:
                    raise ValueError(
                        f"KVCacheConfig: layer {name!r} is in kv_cache_tensors "
                        f"{owners[name]} and {tid}; a layer has one pool."
                    )
                owners[name] = tid
        packed_sizes = {t.size for t in tensors if t.is_packed}
        if len(packed_sizes) > 1:
            raise ValueError(
                "KVCacheConfig: packed tensors share one backing and must carry the "
                f"same size, got {sorted(packed_sizes)}."
            )

    def group_of(self, layer_name: str) -> int:
        """Group id of `layer_name`.

        Raises:
          KeyError: If no group holds the layer.
        """
        for gid, group in enumerate(self.kv_cache_groups):
            if layer_name in group.layer_names:
                return gid
        raise KeyError(f"No KV-cache group holds layer {layer_name!r}.")

    def tensor_of(self, layer_name: str) -> KVCacheTensor:
        """The tensor (pool) whose ``shared_by`` lists `layer_name`.

        Raises:
          KeyError: If no tensor lists the layer.
        """
        for tensor in self.kv_cache_tensors:
            if layer_name in tensor.shared_by:
                return tensor
        raise KeyError(f"No KV-cache tensor lists layer {layer_name!r}.")

    def layer_names(self) -> Iterator[str]:
        """All group layers, group by group."""
        for group in self.kv_cache_groups:
            yield from group.layer_names


def add_kv_sharing_layers_to_kv_cache_groups(
    shared_kv_cache_layers: dict[str, str],
    kv_cache_config: KVCacheConfig,
    runner_only_attn_layers: set[str] | None = None,
) -> KVCacheConfig:
    """Returns a config with each KV-sharing layer appended to its target's group.

    Idempotent, unlike vLLM's in-place version (spec §2.19.1, §5.2): a layer
    already present is not appended again.

    Args:
      shared_kv_cache_layers: ``layer -> target`` (see
        :func:`get_shared_kv_cache_layers`).
      kv_cache_config: The config to extend; not modified.
      runner_only_attn_layers: If given, the sharing layers are added to it.

    Returns:
      The extended config.

    Raises:
      KeyError: If a target is in no group.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> cfg = jaxkv.vllm.KVCacheConfig(num_blocks=4,
      ...     kv_cache_tensors=[jaxkv.vllm.KVCacheTensor(size=1024, shared_by=["l0"])],
      ...     kv_cache_groups=[jaxkv.vllm.KVCacheGroupSpec(layer_names=["l0"],
      ...                                             kv_cache_spec=spec)])
      >>> cfg = jaxkv.vllm.add_kv_sharing_layers_to_kv_cache_groups({"l2": "l0"}, cfg)
      >>> jaxkv.vllm.add_kv_sharing_layers_to_kv_cache_groups({"l2": "l0"}, cfg
      ...     ).kv_cache_groups[0].layer_names
      ('l0', 'l2')
    """
    groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
    gid_of = {name: gid for gid, names in enumerate(groups) for name in names}
    for layer, target in shared_kv_cache_layers.items():
        if target not in gid_of:
            raise KeyError(
                f"KV-sharing layer {layer!r} targets {target!r}, which is in no "
                "KV-cache group."
            )
        if runner_only_attn_layers is not None:
            runner_only_attn_layers.add(layer)
        if layer in gid_of:
            continue
        groups[gid_of[target]].append(layer)
        gid_of[layer] = gid_of[target]
    new_groups = tuple(
        dataclasses.replace(g, layer_names=tuple(names))
        for g, names in zip(kv_cache_config.kv_cache_groups, groups, strict=True)
    )
    return dataclasses.replace(kv_cache_config, kv_cache_groups=new_groups)


def packed_tensor_of_layers(
    kv_cache_config: KVCacheConfig, layer_names: Sequence[str]
) -> KVCacheTensor | None:
    """The first packed tensor whose ``shared_by`` meets `layer_names`, if any."""
    names = set(layer_names)
    for tensor in kv_cache_config.kv_cache_tensors:
        if tensor.is_packed and not names.isdisjoint(tensor.shared_by):
            return tensor
    return None
