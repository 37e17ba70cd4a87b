"""The demo: a small Flax NNX hybrid model served through jaxkv.

Not imported by ``import jaxkv``: the core needs jax and numpy only; this
subpackage brings flax. ``python -m jaxkv`` runs :func:`jaxkv.demo.cli.main`.
"""

from jaxkv.demo.engine import Engine, Request
from jaxkv.demo.model import TinyHybridModel, forward_dense, forward_paged
from jaxkv.demo.oracle import generate_dense

__all__ = [
    "Engine",
    "Request",
    "TinyHybridModel",
    "forward_dense",
    "forward_paged",
    "generate_dense",
]
