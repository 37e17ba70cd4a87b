"""The model-side configuration that replaces vLLM's ``VllmConfig``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Literal

import jax

from jaxkv._util import check_non_negative_int, check_positive_int, checks_own_arguments
from jaxkv.config._backends import AttentionBackend, KVCacheLayout
from jaxkv.config._mamba_spec import MambaSpec
from jaxkv.config._specs import KVCacheSpec, MLAAttentionSpec

LayerType = Literal["attention", "mla", "mamba"]
AttnType = Literal["decoder", "encoder", "encoder_only", "encoder_decoder"]
_ATTN_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
@checks_own_arguments
class LayerConfig:
    """One attention-like layer, as registered in execution order.

    Args:
      name: Unique dotted name, e.g. ``"model.layers.3.self_attn"``.
      spec: The layer's KV-cache spec, or ``None`` for a layer that needs no
        cache (e.g. encoder-only attention).
      backend: The layer's backend capability record.
      kv_sharing_target: Name of an earlier layer whose cache this layer reads
        (YOCO), or ``None``/``""`` for no sharing.
      is_draft: Whether the layer belongs to a speculative draft model.
      num_heads: Query heads (0 if unknown); part of the grouping key.
      layer_type: ``"attention"`` (plain attention, the only type that may share
        KV), ``"mla"`` or ``"mamba"``; derived from `spec`/`backend` when omitted.
      attn_type: ``"decoder"``, ``"encoder"``, ``"encoder_only"`` or
        ``"encoder_decoder"`` (cross-attention). Sharing needs equal types.
      logits_soft_cap: ``cap * tanh(s / cap)`` on the attention scores
        (``None``: none); read by :class:`AttentionLayer`.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
      >>> jaxkv.LayerConfig(name="m0", spec=spec,
      ...     backend=jaxkv.get_backend("MAMBA2")).layer_type
      'mamba'
    """

    name: str
    spec: KVCacheSpec | None
    backend: AttentionBackend
    kv_sharing_target: str | None = None
    is_draft: bool = False
    num_heads: int = 0
    layer_type: LayerType | None = None
    attn_type: AttnType = "decoder"
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"LayerConfig.name must be a non-empty str, got {self.name!r}."
            )
        owner = f"LayerConfig({self.name!r})"
        if self.spec is not None and not isinstance(self.spec, KVCacheSpec):
            raise TypeError(
                f"{owner}.spec must be a KVCacheSpec or None, got "
                f"{type(self.spec).__name__}."
            )
        if not isinstance(self.backend, AttentionBackend):
            raise TypeError(
                f"{owner}.backend must be an AttentionBackend, got "
                f"{type(self.backend).__name__}."
            )
        check_non_negative_int(owner, "num_heads", self.num_heads)
        object.__setattr__(self, "num_heads", int(self.num_heads))
        cap = self.logits_soft_cap
        if cap is not None and (
            not isinstance(cap, int | float) or isinstance(cap, bool) or not cap > 0
        ):
            raise ValueError(
                f"{owner}.logits_soft_cap must be a positive number or None, "
                f"got {cap!r}."
            )
        if self.attn_type not in _ATTN_TYPES:
            raise ValueError(
                f"{owner}.attn_type must be one of {_ATTN_TYPES}, "
                f"got {self.attn_type!r}."
            )
        if self.kv_sharing_target == "":
            object.__setattr__(self, "kv_sharing_target", None)
        if self.layer_type is None:
            if isinstance(self.spec, MambaSpec) or self.backend.is_ssm():
                derived: LayerType = "mamba"
            elif isinstance(self.spec, MLAAttentionSpec) or (
                self.backend.layout is KVCacheLayout.MLA
            ):
                derived = "mla"
            else:
                derived = "attention"
            object.__setattr__(self, "layer_type", derived)
        elif self.layer_type not in ("attention", "mla", "mamba"):
            raise ValueError(
                f"{owner}.layer_type must be 'attention', 'mla' or 'mamba', got "
                f"{self.layer_type!r}."
            )
        if isinstance(self.spec, MambaSpec) != self.backend.is_ssm():
            raise ValueError(
                f"{owner}: a MambaSpec needs a Mamba backend and vice versa, got "
                f"{type(self.spec).__name__} with {self.backend.class_name}."
            )


_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
@checks_own_arguments
class RunnerConfig:
    """Everything jaxkv needs to know about a model and its serving limits.

    The jaxkv counterpart of ``VllmConfig``: frozen, hashable, validated on
    construction.

    Args:
      layers: Attention-like layers in execution (registration) order. Draft
        layers come after the target model's layers.
      kv_sharing_fast_prefill: The fast-prefill switch (YOCO early exit).
      cache_dtype: KV-cache dtype name passed to backends (``"auto"``, ``"fp8"``).
      max_model_len: Longest sequence, in tokens.
      max_num_seqs: Most requests in one step.
      max_num_batched_tokens: Most tokens in one step.
      token_buckets: Jit buckets for the token count (the counterpart of CUDA
        graph capture sizes), ascending. Empty: no padding.
      request_buckets: Jit buckets for the request count, ascending.
      batch_invariant: Require batch-invariant backends.

    Raises:
      ValueError: On duplicate names, bad KV-sharing targets (unknown, itself,
        later, another attention type, a chain), or non-positive sizes.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> fa = jaxkv.get_backend("FLASH_ATTN")
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name="l0", spec=spec, backend=fa),
      ...     jaxkv.LayerConfig(name="l1", spec=spec, backend=fa,
      ...                       kv_sharing_target="l0")])
      >>> cfg.layer("l1").kv_sharing_target
      'l0'
    """

    layers: Sequence[LayerConfig]
    kv_sharing_fast_prefill: bool = False
    cache_dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    token_buckets: Sequence[int] = ()
    request_buckets: Sequence[int] = ()
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        if self.cache_dtype not in _CACHE_DTYPES:
            raise ValueError(
                f"RunnerConfig.cache_dtype must be one of {_CACHE_DTYPES}, got "
                f"{self.cache_dtype!r}."
            )
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            check_positive_int("RunnerConfig", name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("token_buckets", "request_buckets"):
            buckets = tuple(getattr(self, name))
            for b in buckets:
                check_positive_int("RunnerConfig", name + "[i]", b)
            buckets = tuple(int(b) for b in buckets)
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(
                    f"RunnerConfig.{name} must be strictly ascending, got {buckets}."
                )
            object.__setattr__(self, name, buckets)
        index: dict[str, int] = {}
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerConfig):
                raise TypeError(
                    f"RunnerConfig.layers[{i}] must be a LayerConfig, got "
                    f"{type(layer).__name__}."
                )
            if layer.name in index:
                raise ValueError(
                    f"RunnerConfig.layers: duplicate layer name {layer.name!r} at "
                    f"positions {index[layer.name]} and {i}."
                )
            index[layer.name] = i
        for i, layer in enumerate(layers):
            target = layer.kv_sharing_target
            if target is None:
                continue
            where = f"RunnerConfig: layer {layer.name!r} shares KV with {target!r}"
            if target == layer.name:
                raise ValueError(f"{where}, itself.")
            if target not in index:
                raise ValueError(f"{where}, which is not a layer of the model.")
            if index[target] > i:
                raise ValueError(
                    f"{where}, which is registered later; the target must come first."
                )
            tl = layers[index[target]]
            if tl.attn_type != layer.attn_type:
                raise ValueError(
                    f"{where}, which has attn_type {tl.attn_type!r}; expected "
                    f"{layer.attn_type!r}."
                )
            if tl.kv_sharing_target is not None:
                raise ValueError(
                    f"{where}, which itself shares {tl.kv_sharing_target!r}; "
                    "KV-sharing chains are not supported."
                )
            if tl.spec is None:
                raise ValueError(f"{where}, which has no KV cache.")
            if layer.layer_type == "mamba" or tl.layer_type == "mamba":
                raise ValueError(
                    f"{where}: Mamba state cannot be shared (layer types "
                    f"{layer.layer_type!r} and {tl.layer_type!r}); only attention "
                    "layers share KV."
                )
        object.__setattr__(self, "_index", index)

    def layer(self, name: str) -> LayerConfig:
        """The layer called `name`.

        Raises:
          KeyError: If the model has no such layer.
        """
        index: dict[str, int] = self.__dict__["_index"]
        if name not in index:
            raise KeyError(f"The model has no attention-like layer {name!r}.")
        return self.layers[index[name]]

    def __contains__(self, name: object) -> bool:
        """Whether the model has a layer called `name`."""
        return name in self.__dict__["_index"]

    def __iter__(self) -> Iterator[LayerConfig]:
        """The layers in execution order."""
        return iter(self.layers)
