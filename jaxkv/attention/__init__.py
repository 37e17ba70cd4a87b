"""Paged attention over a layer's view of the pools: one contract, four kernels.

:func:`paged_attention` is the entry point; ``implementation=`` picks the
kernel per platform from :data:`ATTENTION_KERNELS` (``_kernels``: each
kernel, the platforms it compiles for, when it fits, its tuned constants;
``write_kv`` picks from a table of the same class). The
implementations, one module each, meet one contract (``_call``: the call's
static options, the query rows and the key range each query sees, where a
kernel finds a page in its pool) and are tested over one case matrix
(``tests/attention_cases.py``):

- ``_xla``: the pure-JAX path, the reference (every platform, every mask);
- ``_pallas_gpu``: a Triton-lowered Pallas kernel (CUDA and ROCm GPUs);
- ``_pallas_tpu``: a Mosaic TPU Pallas kernel;
- ``_native``: jaxkv's C++ decode kernel on XLA:CPU (``jaxkv/_native``).

``_rows`` holds the row arithmetic they share (which request and position
each query token has, rows of a request's tokens, the visible key ranges).
"""

from jaxkv.attention._call import pallas_unfit
from jaxkv.attention._kernels import ATTENTION_KERNELS
from jaxkv.attention._paged import (
    IMPLEMENTATIONS,
    choose_implementation,
    paged_attention,
)
from jaxkv.attention._rows import request_token_rows, token_requests_and_positions
from jaxkv.attention._xla import (
    CONTRACTIONS,
    XLA_TUNING,
    auto_pages_per_chunk,
    resolve_contraction,
)

__all__ = [
    "ATTENTION_KERNELS",
    "CONTRACTIONS",
    "IMPLEMENTATIONS",
    "XLA_TUNING",
    "auto_pages_per_chunk",
    "choose_implementation",
    "paged_attention",
    "pallas_unfit",
    "request_token_rows",
    "resolve_contraction",
    "token_requests_and_positions",
]
