"""Hypothesis strategies: random hybrid KV-cache configurations."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import strategies as st

import jaxkv

LAYOUTS = ("nhd", "hnd", "kv_first", "fused", "mla")

# Errors a random configuration may legitimately hit (checked by dedicated tests).
EXPECTED_ERRORS = (
    "needs dense, unpadded pages",
    "onto K/V-first storage",
    "is not a multiple of that",
)


def backend_for(layout: str, kernel: int | None) -> jaxkv.AttentionBackend:
    sizes = (kernel,) if kernel else (jaxkv.vllm.MultipleOf(1),)
    kinds = {
        "nhd": (jaxkv.KVCacheLayout.BLOCKS_FIRST, None),
        "hnd": (jaxkv.KVCacheLayout.BLOCKS_FIRST, (0, 1, 3, 2, 4)),
        "kv_first": (jaxkv.KVCacheLayout.KV_FIRST, None),
        "fused": (jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED, None),
        "mla": (jaxkv.KVCacheLayout.MLA, None),
    }
    layout_enum, order = kinds[layout]
    return jaxkv.AttentionBackend(
        name=f"{layout}_{kernel or 'any'}",
        layout=layout_enum,
        stride_order=order,
        supported_kernel_block_sizes=sizes,
    )


@dataclasses.dataclass
class Case:
    cfg: jaxkv.RunnerConfig
    kv: jaxkv.vllm.KVCacheConfig
    description: str


@st.composite
def hybrid_cases(draw) -> Case:
    block = draw(st.sampled_from([4, 8, 16]))
    heads = draw(st.sampled_from([1, 2]))
    head = draw(st.sampled_from([2, 3, 4, 8]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "int8"]))
    num_blocks = draw(st.integers(2, 5))
    packed = draw(st.booleans())
    with_mamba = draw(st.booleans())
    pad = draw(st.sampled_from([0, 0, 8, 64]))
    per_group = draw(st.integers(1, 2))
    if draw(st.integers(0, 3)) == 0:
        # Encoder-decoder style: a K/V-first group and another layout in one pool.
        layouts = ["kv_first", draw(st.sampled_from(["nhd", "hnd", "fused", "mla"]))]
    else:
        layouts = [
            draw(st.sampled_from(LAYOUTS)) for _ in range(draw(st.integers(1, 2)))
        ]
    n_groups = len(layouts)
    splits = [draw(st.booleans()) for _ in range(n_groups)]
    yoco = draw(st.booleans())
    unpadded = (
        2
        * block
        * heads
        * head
        * np.dtype(
            jaxkv.FullAttentionSpec(
                block_size=1, num_kv_heads=1, head_size=1, dtype=dtype
            ).dtype
        ).itemsize
    )
    padded = unpadded + pad if pad else None
    layers = []
    for g, (layout, split) in enumerate(zip(layouts, splits, strict=True)):
        kernel = block // 2 if split else None
        backend = backend_for(layout, kernel)
        common: dict[str, Any] = dict(
            block_size=block, dtype=dtype, page_size_padded=padded
        )
        if layout == "mla":
            spec = jaxkv.MLAAttentionSpec(
                num_kv_heads=1, head_size=2 * heads * head, **common
            )
        elif layout == "fused":
            spec = jaxkv.FullAttentionSpec(num_kv_heads=heads, head_size=head, **common)
        else:
            kind = [jaxkv.FullAttentionSpec, jaxkv.CrossAttentionSpec][g % 2]
            spec = kind(num_kv_heads=heads, head_size=head, **common)
        attn_type = (
            "encoder_decoder"
            if isinstance(spec, jaxkv.CrossAttentionSpec)
            else "decoder"
        )
        for i in range(per_group):
            layers.append(
                jaxkv.LayerConfig(
                    name=f"g{g}.l{i}", spec=spec, backend=backend, attn_type=attn_type
                )
            )
    if with_mamba:
        mamba = jaxkv.MambaSpec(
            block_size=block,
            shapes=((1, 2), (1,)),
            dtypes=("bfloat16", "float32"),
            page_size_padded=padded or unpadded,
        )
        for i in range(per_group):
            layers.append(
                jaxkv.LayerConfig(
                    name=f"m.l{i}", spec=mamba, backend=jaxkv.get_backend("MAMBA2")
                )
            )
    if yoco and layouts[0] != "mla":
        first = layers[0]
        layers.append(
            dataclasses.replace(first, name="yoco", kv_sharing_target=first.name)
        )
    cfg = jaxkv.RunnerConfig(layers=layers)
    kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=num_blocks, packed=packed)
    desc = (
        f"B={block} H={heads} D={head} {dtype} N={num_blocks} packed={packed} "
        f"mamba={with_mamba} pad={pad} layouts={layouts} splits={splits} yoco={yoco}"
    )
    return Case(cfg=cfg, kv=kv, description=desc)


def plan(case: Case, **plan_kw):
    """(groups, sizes, pools, views, bound) with every split group slot-mapped;
    `plan_kw` go to ``planned_pools``."""
    groups, _, sizes = jaxkv.vllm.init_attn_backend(
        case.kv, case.cfg, maps_slot_mapping=True
    )
    pool_specs, views = jaxkv.plan.planned_pools(
        case.kv, case.cfg, sizes, groups, **plan_kw
    )
    names = [layer.name for layer in case.cfg.layers]
    bound = jaxkv.vllm.bind_kv_caches(views, names, case.kv, case.cfg, groups)
    return groups, sizes, pool_specs, views, bound
