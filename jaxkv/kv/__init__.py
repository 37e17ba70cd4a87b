"""kv: reads and writes of K/V and Mamba states through a plan's views, inside jit.

``_ops`` writes and gathers K/V (``_strided`` on word pools, ``_typed`` on
typed pools; ``_pallas_write`` and ``_native_write`` the kernels, with
``_page_layout`` and ``_raw_address`` describing a view to them),
``_state_ops`` Mamba states, zeroing and whole-view reads,
``_kernel_handoff`` a layer's cache as a kernel's array, ``_kernel_table``
the table each operation picks its kernel from per platform, ``_checks`` the
host-side id and pool checks they share, ``_write_log`` the record of the
writes a traced function makes (ServingLoop's check of `forward`), ``_quant``
quantized pages (8-bit values and their scales).
"""

from jaxkv.kv._checks import (
    Pools,
    any_deleted,
    check_fits,
    check_layer,
    check_pools_alive,
    layer_index,
    validate_block_ids,
    validate_slot_mapping,
)
from jaxkv.kv._copy import block_views, copy_blocks, copy_kv_cache_blocks
from jaxkv.kv._kernel_handoff import (
    kernel_cache,
    put_kernel_cache,
)
from jaxkv.kv._kernel_table import GPU_PLATFORMS, Kernel, KernelTable
from jaxkv.kv._ops import (
    WRITE_KERNELS,
    gather_kv_pages,
    write_kv,
)
from jaxkv.kv._page_layout import (
    PageLayout,
    page_layout,
    pallas_view_unfit,
)
from jaxkv.kv._pallas_write import mosaic_dtype_unfit
from jaxkv.kv._quant import (
    PER_TOKEN_HEAD,
    dequantize,
    quant_unfit,
    quantize,
    raw_views,
    scale_view,
)
from jaxkv.kv._raw_address import (
    raw_address,
    raw_unfit,
)
from jaxkv.kv._state_ops import (
    read_mamba_state,
    read_view,
    write_mamba_state,
    zero_blocks,
)
from jaxkv.kv._write_log import Write, recording_writes

__all__ = [
    "GPU_PLATFORMS",
    "Kernel",
    "KernelTable",
    "PER_TOKEN_HEAD",
    "PageLayout",
    "Pools",
    "WRITE_KERNELS",
    "Write",
    "any_deleted",
    "block_views",
    "check_fits",
    "check_layer",
    "check_pools_alive",
    "copy_blocks",
    "copy_kv_cache_blocks",
    "dequantize",
    "gather_kv_pages",
    "kernel_cache",
    "layer_index",
    "mosaic_dtype_unfit",
    "page_layout",
    "pallas_view_unfit",
    "put_kernel_cache",
    "quant_unfit",
    "quantize",
    "raw_address",
    "raw_unfit",
    "raw_views",
    "read_mamba_state",
    "read_view",
    "recording_writes",
    "scale_view",
    "validate_block_ids",
    "validate_slot_mapping",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]
