"""groups: attention groups, kernel block sizes, compile support.

groups: attention groups, kernel block sizes, compile (CUDA-graph) support.

``_init_backend`` groups the layers by backend and spec (vLLM's
``init_attn_backend``, KV-sharing layers in their target's group);
``_kernel_blocks`` chooses each group's kernel block size and maps block
tables and slot mappings to it; ``_cg_support`` answers which step shapes a
group's backends can replay.
"""

from jaxkv.groups._attn_group import AttentionGroup, flat_groups
from jaxkv.groups._cg_support import (
    AttentionCGSupportInfo,
    get_attn_cg_support,
    get_query_lens_mismatch_unsupported_backend,
    get_varlen_cudagraph_unsupported_backend,
)
from jaxkv.groups._init_backend import (
    AttnBackendInit,
    check_kernel_block_sizes,
    init_attn_backend,
    prepare_kernel_block_sizes,
    with_kv_sharing_layers,
)
from jaxkv.groups._kernel_blocks import (
    expand_block_table,
    kernel_block_sizes_by_group,
    map_slot_mapping_to_kernel,
    select_common_block_size,
)

__all__ = [
    "AttentionCGSupportInfo",
    "AttentionGroup",
    "AttnBackendInit",
    "check_kernel_block_sizes",
    "expand_block_table",
    "flat_groups",
    "get_attn_cg_support",
    "get_query_lens_mismatch_unsupported_backend",
    "get_varlen_cudagraph_unsupported_backend",
    "init_attn_backend",
    "kernel_block_sizes_by_group",
    "map_slot_mapping_to_kernel",
    "prepare_kernel_block_sizes",
    "select_common_block_size",
    "with_kv_sharing_layers",
]
