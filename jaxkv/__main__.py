"""``python -m jaxkv``: the built-in hybrid model's attention groups."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxkv._init_backend import init_attn_backend, with_kv_sharing_layers
from jaxkv._planner import make_kv_cache_config, tiny_hybrid_config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m jaxkv", description=__doc__)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--packed", action="store_true", help="pack pools block-outermost"
    )
    parser.add_argument("--no-fast-prefill", action="store_true")
    args = parser.parse_args(argv)

    cfg = tiny_hybrid_config(
        block_size=args.block_size, kv_sharing_fast_prefill=not args.no_fast_prefill
    )
    kv = make_kv_cache_config(cfg, args.num_blocks, packed=args.packed)
    groups, info, kernel_sizes = init_attn_backend(kv, cfg)
    kv = with_kv_sharing_layers(kv, cfg)
    print(f"model: {len(cfg.layers)} layers, {args.num_blocks} blocks per pool")
    for tid, tensor in enumerate(kv.kv_cache_tensors):
        print(
            f"pool {tid}: {tensor.size / 2**20:.2f} MiB "
            f"shared by {list(tensor.shared_by)}"
            + (
                f" (offset {tensor.offset}, block_stride {tensor.block_stride})"
                if tensor.is_packed
                else ""
            )
        )
    for gid, attn_groups in enumerate(groups):
        spec = kv.kv_cache_groups[gid].kv_cache_spec
        print(
            f"KV-cache group {gid}: {type(spec).__name__}, block {spec.block_size}, "
            f"kernel block {kernel_sizes[gid] if gid < len(kernel_sizes) else '-'}"
        )
        for g in attn_groups:
            print(f"  {g.backend.class_name}: {list(g.layer_names)}")
    print(
        f"compile support: {info.min_cg_support.name} "
        f"(set by {info.min_cg_attn_backend or '-'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
