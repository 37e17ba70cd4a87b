"""Planning a KV-cache config for a model, and hybrid attention/Mamba page alignment."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jaxkv._util import cdiv, check_positive_int
from jaxkv.config import (
    AttentionBackend,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    RunnerConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec,
)


def make_kv_cache_config(
    runner_config: RunnerConfig,
    num_blocks: int,
    *,
    packed: bool = False,
    disable_hybrid_kv_cache_manager: bool = False,
) -> KVCacheConfig:
    """Plans groups and pools the way vLLM's hybrid allocator does (vLLM 0.32).

    - One spec (or specs that merge: full-attention layers differing only in
      ``sliding_window`` / ``attention_chunk_size``): one group, every layer
      its own pool.
    - One attention type whose pages differ (head sizes 128 and 64, say): one
      group of :class:`UniformTypeKVCacheSpecs`, every layer its own pool of
      its own page (``get_kv_cache_groups``' uniform-type case).
    - Several types with equal pages: the layers of each spec are dealt into
      groups of ``n`` layers, ``layers[i::num_groups]`` to group ``i`` (so
      pipeline stages pad evenly), ``n`` being the smallest layer count of any
      spec, or the largest when that is below 1.5 times the smallest (12
      sliding + 13 full layers pad to 13 + 13: 2 groups, not 3). Pool ``i`` is
      shared by the ``i``-th layer of every group, so a hybrid model has no
      memory per layer type, only per pool.

    Encoder-only layers get a group and no memory. A model without cache
    layers (attention-free) gets no pools and 1 block, as vLLM's.

    Args:
      runner_config: The runner configuration.
      num_blocks: Blocks per pool.
      packed: Pack the pools block-outermost into one backing (block ``b`` of
        pool ``i`` at ``b*block_stride + offset_i``) instead of one array per
        pool.
      disable_hybrid_kv_cache_manager: vLLM's option of that name: sliding and
        chunked layers beside full attention are allocated as full attention
        (one group; see :func:`unify_hybrid_kv_cache_specs`).

    Returns:
      The KV-cache configuration (without KV-sharing layers; see
      :func:`with_kv_sharing_layers`).

    Raises:
      ValueError: If several types have different page sizes (pad the smaller
        pages with ``page_size_padded``, plan with :func:`make_plan`, which
        unifies attention pages, or align a hybrid model with
        :func:`align_hybrid_block_size`).

    Example:
      >>> import jaxkv
      >>> kv = jaxkv.plan.make_kv_cache_config(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> [g.layer_names for g in kv.kv_cache_groups]
      [('layers.0.self_attn', 'layers.3.self_attn'), ('layers.1.self_attn', 'layers.4.self_attn'), ('layers.2.mixer', 'layers.5.mixer')]
      >>> [t.shared_by for t in kv.kv_cache_tensors]
      [('layers.0.self_attn', 'layers.1.self_attn', 'layers.2.mixer'), ('layers.3.self_attn', 'layers.4.self_attn', 'layers.5.mixer')]
    """  # noqa: E501
    check_positive_int("make_kv_cache_config", "num_blocks", num_blocks)
    specs, extra = split_encoder_only(get_kv_cache_spec(runner_config))
    if not specs:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=extra)
    groups = get_kv_cache_groups(
        specs, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=pool_tensors(groups, num_blocks=num_blocks, packed=packed),
        kv_cache_groups=(*groups, *extra),
    )


def pool_pages(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
) -> list[tuple[int, tuple[str, ...]]]:
    """Each pool's page in bytes and the layers sharing it, for `kv_cache_groups`.

    A :class:`UniformTypeKVCacheSpecs` group: one pool per layer, of the
    layer's own page. Otherwise every group's spec has one page and pool ``i``
    is shared by the ``i``-th layer of every group (a group with fewer layers,
    on a pipeline stage, say, leaves the pool to the others). Groups without
    layers (another worker's) and encoder-only groups take no pool.

    Raises:
      ValueError: If the groups' pages differ.
    """
    groups = [
        g
        for g in kv_cache_groups
        if g.layer_names and not isinstance(g.kv_cache_spec, EncoderOnlyAttentionSpec)
    ]
    if len(groups) == 1 and isinstance(
        groups[0].kv_cache_spec, UniformTypeKVCacheSpecs
    ):
        specs = groups[0].kv_cache_spec.kv_cache_specs
        return [(specs[n].page_size_bytes, (n,)) for n in groups[0].layer_names]
    pages_of = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages_of) > 1:
        detail = ", ".join(
            f"{g.layer_names[0]}: {g.kv_cache_spec.page_size_bytes}" for g in groups
        )
        raise ValueError(
            "make_kv_cache_config: hybrid layers must have equal page sizes, "
            f"got {detail}; plan with make_plan, which unifies attention pages "
            "(unify_page_sizes), set page_size_padded on the smaller pages, or "
            "plan with make_plan(..., align_hybrid=True) "
            "(align_hybrid_block_size)."
        )
    size = max((len(g.layer_names) for g in groups), default=0)
    return [
        (
            groups[0].kv_cache_spec.page_size_bytes,
            tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)),
        )
        for i in range(size)
    ]


def pool_tensors(
    kv_cache_groups: Sequence[KVCacheGroupSpec], *, num_blocks: int, packed: bool
) -> tuple[KVCacheTensor, ...]:
    """The pools of `kv_cache_groups` at `num_blocks` (see :func:`pool_pages`).

    ``packed``: one backing, block-outermost (block ``b`` of pool ``i`` at
    ``b*block_stride + offset_i``); otherwise one array per pool.
    """
    pages = pool_pages(kv_cache_groups)
    if packed:
        stride = sum(page for page, _ in pages)
        offsets = [sum(page for page, _ in pages[:i]) for i in range(len(pages))]
        return tuple(
            KVCacheTensor(
                size=num_blocks * stride,
                shared_by=names,
                offset=offset,
                block_stride=stride,
            )
            for offset, (_, names) in zip(offsets, pages, strict=True)
        )
    return tuple(
        KVCacheTensor(size=num_blocks * page, shared_by=names) for page, names in pages
    )


def split_encoder_only(
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> tuple[dict[str, KVCacheSpec], tuple[KVCacheGroupSpec, ...]]:
    """``(the layers that hold a cache, a group per encoder-only spec)``.

    Encoder-only layers get a group of their own and no memory.
    """
    specs: dict[str, KVCacheSpec] = {}
    encoder_only: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, EncoderOnlyAttentionSpec):
            encoder_only.setdefault(spec, []).append(name)
        else:
            specs[name] = spec
    extra = tuple(
        KVCacheGroupSpec(layer_names=tuple(n), kv_cache_spec=s)
        for s, n in encoder_only.items()
    )
    return specs, extra


def get_kv_cache_groups(
    kv_cache_spec: Mapping[str, KVCacheSpec],
    *,
    disable_hybrid_kv_cache_manager: bool = False,
) -> list[KVCacheGroupSpec]:
    """The groups of ``layer -> spec`` in vLLM 0.32's order.

    ``get_kv_cache_groups``, hybrid KV-cache manager on, no pages to unify.

    Args:
      kv_cache_spec: Every cache layer's spec, in model order (no encoder-only
        layer; empty for an attention-free model).
      disable_hybrid_kv_cache_manager: Allocate sliding and chunked layers
        beside full attention as full attention, in one group
        (:func:`unify_hybrid_kv_cache_specs`).

    Returns:
      One group per spec and layers: one merged spec; or one
      :class:`UniformTypeKVCacheSpecs` over layers of one type whose pages
      differ; or, for several types, each spec's layers dealt into groups of
      one size (see :func:`make_kv_cache_config`).

    Example (gpt-oss-20b with an EAGLE draft: 12 sliding, 13 full layers):
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16")
      >>> swa = jaxkv.SlidingWindowSpec(sliding_window=128, **kw)
      >>> full = jaxkv.FullAttentionSpec(**kw)
      >>> specs = {f"l{i}": swa if i % 2 == 0 and i < 24 else full for i in range(25)}
      >>> [len(g.layer_names) for g in jaxkv.vllm.get_kv_cache_groups(specs)]
      [12, 13]
    """
    if disable_hybrid_kv_cache_manager:
        kv_cache_spec = unify_hybrid_kv_cache_specs(kv_cache_spec)
    return [
        KVCacheGroupSpec(layer_names=tuple(names), kv_cache_spec=spec)
        for spec, names in _groups(kv_cache_spec)
    ]


def unify_hybrid_kv_cache_specs(
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Every layer as one type, for vLLM's ``disable_hybrid_kv_cache_manager``.

    When full attention is present, sliding-window and chunked layers become
    :class:`FullAttentionSpec` with their ``sliding_window`` /
    ``attention_chunk_size`` kept (the attention compute is unchanged; the
    cache keeps every token). The input is not changed.

    Returns:
      The new ``layer -> spec`` mapping, in the same order.

    Raises:
      ValueError: If the layers still do not share one type afterwards
        (Mamba beside attention, or MLA beside standard attention): vLLM
        refuses these too.

    Example (vLLM's worked case: one full and one sliding layer, one group):
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
      >>> specs = jaxkv.vllm.unify_hybrid_kv_cache_specs({
      ...     "layer_1": jaxkv.FullAttentionSpec(**kw),
      ...     "layer_2": jaxkv.SlidingWindowSpec(sliding_window=1, **kw)})
      >>> specs["layer_2"] == jaxkv.FullAttentionSpec(sliding_window=1, **kw)
      True
    """
    specs = dict(kv_cache_spec)
    if is_kv_cache_spec_uniform(specs):
        return specs
    if any(type(s) is FullAttentionSpec for s in specs.values()):
        for name, spec in specs.items():
            if not isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
                continue
            full = FullAttentionSpec(
                **{
                    f.name: getattr(spec, f.name)
                    for f in dataclasses.fields(AttentionSpec)
                }
            )
            if isinstance(spec, SlidingWindowSpec):
                full = dataclasses.replace(full, sliding_window=spec.sliding_window)
            else:
                full = dataclasses.replace(
                    full, attention_chunk_size=spec.attention_chunk_size
                )
            specs[name] = full
    if not (
        is_kv_cache_spec_uniform(specs)
        or UniformTypeKVCacheSpecs.from_specs(specs) is not None
    ):
        kinds = sorted({type(s).__name__ for s in specs.values()})
        raise ValueError(
            "disable_hybrid_kv_cache_manager: the layers' specs do not become one "
            f"type (got {', '.join(kinds)}); only sliding-window and chunked "
            "layers beside full attention are converted. Leave the hybrid "
            "manager on for this model."
        )
    return specs


def _groups(
    specs: Mapping[str, KVCacheSpec],
) -> list[tuple[KVCacheSpec, list[str]]]:
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    if not by_spec:
        return []
    merged = merge_specs(list(by_spec))
    if merged is not None:
        return [(merged, list(specs))]
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [(uniform, list(specs))]
    buckets: list[tuple[list[KVCacheSpec], list[str]]] = []
    for spec, names in by_spec.items():
        for bucket_specs, bucket_names in buckets:
            if merge_specs([*bucket_specs, spec]) is not None:
                bucket_specs.append(spec)
                bucket_names.extend(names)
                break
        else:
            buckets.append(([spec], list(names)))
    counts = [len(names) for _, names in buckets]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups: list[tuple[KVCacheSpec, list[str]]] = []
    for _, names in buckets:
        num_groups = cdiv(len(names), size)
        for i in range(num_groups):
            members = names[i::num_groups]
            spec = merge_specs([specs[n] for n in members])
            if spec is None:  # pragma: no cover - a bucket's specs merge
                raise AssertionError(members)
            groups.append((spec, members))
    return groups


def merge_specs(specs: Sequence[KVCacheSpec]) -> KVCacheSpec | None:
    """One spec for layers that can share a group (vLLM's ``type(spec).merge``).

    Equal specs merge to the first. Full-attention specs that differ only in
    ``sliding_window`` or ``attention_chunk_size`` (layers allocated as full
    attention) merge when each of the two has at most one value and not both
    are set. Anything else does not merge.

    Returns:
      The merged spec, or None.

    Example:
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
      >>> a = jaxkv.FullAttentionSpec(**kw)
      >>> b = jaxkv.FullAttentionSpec(sliding_window=64, **kw)
      >>> jaxkv.vllm.merge_specs([a, b]).sliding_window
      64
      >>> jaxkv.vllm.merge_specs([a, jaxkv.SlidingWindowSpec(sliding_window=64, **kw)])
    """
    first = specs[0]
    if all(spec == first for spec in specs[1:]):
        return first
    if not all(type(spec) is FullAttentionSpec for spec in specs):
        return None
    full = [s for s in specs if isinstance(s, FullAttentionSpec)]
    windows = {s.sliding_window for s in full} - {None}
    chunks = {s.attention_chunk_size for s in full} - {None}
    if len(windows) > 1 or len(chunks) > 1 or (windows and chunks):
        return None
    merged = dataclasses.replace(
        full[0],
        sliding_window=next(iter(windows), None),
        attention_chunk_size=next(iter(chunks), None),
    )
    plain = dataclasses.replace(merged, sliding_window=None, attention_chunk_size=None)
    if any(
        dataclasses.replace(s, sliding_window=None, attention_chunk_size=None) != plain
        for s in full
    ):
        return None
    return merged


def is_kv_cache_spec_uniform(kv_cache_spec: Mapping[str, KVCacheSpec]) -> bool:
    """Whether every layer's spec merges into one (vLLM's check for one group).

    Example:
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=32, head_size=64, dtype="float32")
      >>> jaxkv.vllm.is_kv_cache_spec_uniform({
      ...     "l1": jaxkv.FullAttentionSpec(**kw),
      ...     "l2": jaxkv.FullAttentionSpec(sliding_window=1, **kw)})
      True
    """
    return not kv_cache_spec or merge_specs(list(kv_cache_spec.values())) is not None


def unify_page_sizes(runner_config: RunnerConfig) -> RunnerConfig:
    """Gives every cache layer the largest attention page (vLLM 0.32).

    Gives every cache layer the largest attention page, as vLLM's
    ``unify_kv_cache_spec_page_size`` does (vLLM 0.32).

    With ``P`` the largest page of any attention layer, a layer with a smaller
    page gets ``block_size * P / page`` tokens per block when its page divides
    ``P`` (an attention layer with half the bytes per token holds twice the
    tokens), else its page padded to ``P`` (``page_size_padded``; non-MLA
    attention and Mamba layers). KV-sharing layers follow their target. A
    model whose largest page is a Mamba state is returned unchanged: align it
    with :func:`align_hybrid_block_size` first.

    Args:
      runner_config: The model's layers.

    Returns:
      The config with equal pages (the same object if they already were).

    Raises:
      ValueError: If an MLA layer's page neither divides nor may be padded to
        ``P``, naming the layers and the two ways out.

    Example (full layers of head size 8 beside sliding-window layers of 16):
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=1, dtype="float32")
      >>> full = jaxkv.FullAttentionSpec(head_size=8, **kw)
      >>> swa = jaxkv.SlidingWindowSpec(head_size=16, sliding_window=32, **kw)
      >>> be = jaxkv.get_backend("JAX_PAGED")
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name=f"l{i}", spec=s, backend=be)
      ...     for i, s in enumerate([full, swa])])
      >>> [l.spec.block_size for l in jaxkv.vllm.unify_page_sizes(cfg).layers]
      [32, 16]
    """
    specs = {
        layer.spec
        for layer in runner_config.layers
        if layer.spec is not None
        and not isinstance(layer.spec, EncoderOnlyAttentionSpec)
    }
    pages = {spec.page_size_bytes for spec in specs}
    if len(pages) <= 1:
        return runner_config
    by_layer = {
        layer.name: layer.spec
        for layer in runner_config.layers
        if layer.spec is not None
        and not isinstance(layer.spec, EncoderOnlyAttentionSpec)
    }
    one_group = UniformTypeKVCacheSpecs.from_specs(by_layer) is not None
    if one_group or merge_specs(list(specs)) is not None:
        return runner_config  # one group (vLLM tries these before unifying)
    attn_pages = [s.page_size_bytes for s in specs if isinstance(s, AttentionSpec)]
    top = max(pages)
    if not attn_pages or max(attn_pages) < top:
        return runner_config  # a Mamba page is the largest: align_hybrid's case
    new: dict[KVCacheSpec, KVCacheSpec] = {}
    for spec in specs:
        page = spec.page_size_bytes
        if page == top:
            continue
        if isinstance(spec, MambaSpec):
            new[spec] = dataclasses.replace(spec, page_size_padded=top)
        elif (
            isinstance(spec, AttentionSpec)
            and top % page == 0
            and spec.page_size_padded is None
        ):
            new[spec] = dataclasses.replace(
                spec, block_size=spec.block_size * (top // page)
            )
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new[spec] = dataclasses.replace(spec, page_size_padded=top)
        else:
            names = [layer.name for layer in runner_config.layers if layer.spec == spec]
            widest = [
                layer.name
                for layer in runner_config.layers
                if layer.spec is not None and layer.spec.page_size_bytes == top
            ]
            raise ValueError(
                f"make_plan: the pages of {names} ({page} bytes) cannot be unified "
                f"with the {top}-byte pages of {widest}: {top} is not a multiple of "
                f"{page} and MLA pages cannot be padded. Give those layers a block "
                "size whose page divides the largest, or give every layer the same "
                "bytes per token."
            )
    if not new:
        return runner_config
    layers = [
        dataclasses.replace(layer, spec=new[layer.spec]) if layer.spec in new else layer
        for layer in runner_config.layers
    ]
    return dataclasses.replace(runner_config, layers=layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridBlockAlignment:
    """The outcome of :func:`align_hybrid_block_size`.

    Attributes:
      runner_config: The config with every attention spec at ``block_size`` and
        every Mamba spec padded to ``page_size_bytes``.
      block_size: The attention block size.
      page_size_bytes: The common page of attention and Mamba layers.
      mamba_page_size_bytes: The largest unpadded Mamba page (``m``).
    """

    runner_config: RunnerConfig
    block_size: int
    page_size_bytes: int
    mamba_page_size_bytes: int


def _smallest_kernel_size(backend: AttentionBackend) -> int:
    return min(
        s.base if isinstance(s, MultipleOf) else s
        for s in backend.supported_kernel_block_sizes
    )


def align_hybrid_block_size(runner_config: RunnerConfig) -> HybridBlockAlignment:
    """Raises the attention block size until an attention page holds a Mamba state.

    vLLM's hybrid planning (spec §1.9): with ``a1`` the attention bytes per
    token and ``m`` the largest unpadded Mamba page, ``align = max(smallest
    kernel block size of the first attention backend, block_size)`` (at least
    128 with MLA), ``B = align * ceil(m / (align * a1))`` rounded up to a
    multiple of the lcm of every attention backend's smallest kernel size; the
    block size becomes ``B`` if it was smaller; the attention page is ``P =
    block_size * a1`` and every Mamba page is padded to ``P``. A config without
    both attention and Mamba layers is returned unchanged.

    Args:
      runner_config: The model's layers.

    Returns:
      The aligned config, block size and pages.

    Raises:
      ValueError: If attention layers differ in bytes per token or block size
        (their pages could not all equal a Mamba page).

    Example (spec §1.9: H=8, D=128, bf16, FlashAttention; Mamba states
    ``(3, 2304)`` bf16 and ``(8, 64, 128)`` fp32):
      >>> import jaxkv
      >>> attn = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...     head_size=128, dtype="bfloat16")
      >>> mamba = jaxkv.MambaSpec(block_size=16, shapes=((3, 2304), (8, 64, 128)),
      ...     dtypes=("bfloat16", "float32"))
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name="attn", spec=attn,
      ...                       backend=jaxkv.get_backend("FLASH_ATTN")),
      ...     jaxkv.LayerConfig(name="mamba", spec=mamba,
      ...                       backend=jaxkv.get_backend("MAMBA2"))])
      >>> a = jaxkv.plan.align_hybrid_block_size(cfg)
      >>> a.mamba_page_size_bytes, a.block_size, a.page_size_bytes
      (275968, 80, 327680)
      >>> a.runner_config.layer("mamba").spec.page_size_bytes
      327680
    """
    attn = [
        (layer, layer.spec)
        for layer in runner_config.layers
        if isinstance(layer.spec, AttentionSpec)
    ]
    mamba_pages = [
        layer.spec.real_page_size_bytes
        for layer in runner_config.layers
        if isinstance(layer.spec, MambaSpec)
    ]
    m = max(mamba_pages, default=0)
    if not attn or not mamba_pages:
        return HybridBlockAlignment(
            runner_config=runner_config,
            block_size=attn[0][1].block_size if attn else 0,
            page_size_bytes=attn[0][1].page_size_bytes if attn else m,
            mamba_page_size_bytes=m,
        )
    per_token = {spec.real_page_size_bytes // spec.block_size for _, spec in attn}
    block_sizes = {spec.block_size for _, spec in attn}
    if len(per_token) > 1 or len(block_sizes) > 1:
        detail = ", ".join(
            f"{layer.name}: {spec.real_page_size_bytes // spec.block_size} "
            f"bytes/token, block {spec.block_size}"
            for layer, spec in attn
        )
        raise ValueError(
            "align_hybrid_block_size: attention layers must share bytes per token "
            f"and block size to share pages with Mamba layers, got {detail}."
        )
    (a1,) = per_token
    (block_size,) = block_sizes
    align = max(_smallest_kernel_size(attn[0][0].backend), block_size)
    if any(isinstance(spec, MLAAttentionSpec) for _, spec in attn):
        align = max(align, 128)
    aligned = align * cdiv(m, align * a1)
    step = math.lcm(*(_smallest_kernel_size(layer.backend) for layer, _ in attn))
    aligned = cdiv(aligned, step) * step
    block_size = max(block_size, aligned)
    page = block_size * a1

    def aligned_spec(spec: KVCacheSpec) -> KVCacheSpec:
        if isinstance(spec, AttentionSpec):
            return dataclasses.replace(spec, block_size=block_size)
        if isinstance(spec, MambaSpec) and page > spec.real_page_size_bytes:
            return dataclasses.replace(spec, page_size_padded=page)
        return spec

    layers = [
        layer
        if layer.spec is None
        else dataclasses.replace(layer, spec=aligned_spec(layer.spec))
        for layer in runner_config.layers
    ]
    return HybridBlockAlignment(
        runner_config=dataclasses.replace(runner_config, layers=layers),
        block_size=block_size,
        page_size_bytes=page,
        mamba_page_size_bytes=m,
    )
