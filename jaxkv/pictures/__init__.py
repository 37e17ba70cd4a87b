"""Pictures of pools, views and steps (matplotlib).

Install with ``pip install jaxkv[pictures]``.

Not imported by ``import jaxkv``. Each ``plot_*`` function returns a matplotlib
``Figure``; the data it draws comes from a NumPy function you can check
(:func:`byte_map` for the pool pictures). ``_byte_map`` draws pools (one
device, and over a mesh), ``_step_picture`` a scheduled step and a scaling
benchmark's figures, ``_transfer_map`` a request's KV cache moved between
plans.
"""

from jaxkv.pictures._byte_map import (
    ByteMap,
    DeviceShare,
    byte_map,
    device_map,
    plot_byte_map,
    plot_device_map,
)
from jaxkv.pictures._step_picture import plot_scaling, plot_step
from jaxkv.pictures._transfer_map import TransferMap, plot_transfer, transfer_map

__all__ = [
    "ByteMap",
    "DeviceShare",
    "TransferMap",
    "byte_map",
    "device_map",
    "plot_byte_map",
    "plot_device_map",
    "plot_scaling",
    "plot_step",
    "plot_transfer",
    "transfer_map",
]
