"""The demo: a small Flax NNX hybrid model served through jaxkv.

Not imported by ``import jaxkv``: the core needs jax and numpy only; this
subpackage brings flax. ``python -m jaxkv`` runs :func:`jaxkv.demo.main`.
"""

from jaxkv.demo._cli import main
from jaxkv.demo._engine import Engine, EngineRequest
from jaxkv.demo._model import TinyHybridModel, forward_dense, forward_paged
from jaxkv.demo._oracle import generate_dense

__all__ = [
    "Engine",
    "EngineRequest",
    "TinyHybridModel",
    "forward_dense",
    "forward_paged",
    "generate_dense",
    "main",
]
