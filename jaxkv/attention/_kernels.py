"""``paged_attention``'s kernel table: each kernel, where it compiles, when it fits.

=============  ===============  ===========================================
kernel         compiled for     picked by ``implementation=None`` when
=============  ===============  ===========================================
``xla``        every platform   nothing else fits (CPU always)
``pallas_gpu`` cuda, rocm       :func:`gpu_unfit` is ``None``
``pallas_tpu`` tpu              :func:`tpu_unfit` is ``None``
``native``     cpu              never (opt-in; a custom call the SPMD
                                partitioner cannot split)
=============  ===============  ===========================================

``"pallas"`` names the Pallas family: the platform's own kernel, the GPU
kernel interpreted on CPU. The table is :data:`ATTENTION_KERNELS` (a
:class:`~jaxkv.kv.KernelTable`, the same class ``write_kv`` picks from).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxkv._native import unavailable_reason
from jaxkv.attention._call import Call
from jaxkv.attention._native import native_attention, native_unfit
from jaxkv.attention._pallas_gpu import gpu_attention, gpu_unfit
from jaxkv.attention._pallas_tpu import TPU_TUNING, tpu_attention, tpu_unfit
from jaxkv.attention._xla import XLA_TUNING, tuning, xla_attention
from jaxkv.kv import GPU_PLATFORMS, Kernel, KernelTable, Pools
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata


def _xla(q, pools, view, meta, layer, call, *, interpret, platform):
    del interpret
    return xla_attention(q, pools, view, meta, layer, call, platform=platform)


def _native(q, pools, view, meta, layer, call, *, interpret, platform):
    del interpret, platform
    return native_attention(q, pools, view, meta, layer, call)


def _gpu(q, pools, view, meta, layer, call, *, interpret, platform):
    del platform
    return gpu_attention(q, pools, view, meta, layer, call, interpret=interpret)


def _tpu(q, pools, view, meta, layer, call, *, interpret, platform):
    del platform
    return tpu_attention(q, pools, view, meta, layer, call, interpret=interpret)


ATTENTION_KERNELS = KernelTable(
    "paged_attention", Kernel("xla", run=_xla, tuning=XLA_TUNING)
)
"""``paged_attention``'s kernels; ``register`` adds one (see :class:`KernelTable`).

Each kernel's ``unfit`` takes ``(view, call, q_shape)``."""
ATTENTION_KERNELS.register(
    Kernel(
        "pallas_gpu",
        run=_gpu,
        platforms=GPU_PLATFORMS,
        unfit=gpu_unfit,
        family="pallas",
        default=True,
        interpretable=True,
    )
)
ATTENTION_KERNELS.register(
    Kernel(
        "pallas_tpu",
        run=_tpu,
        platforms=("tpu",),
        unfit=tpu_unfit,
        family="pallas",
        default=True,
        interpretable=True,
        tuning={chip: t._asdict() for chip, t in TPU_TUNING.items()},
    )
)
ATTENTION_KERNELS.register(
    Kernel(
        "native",
        run=_native,
        platforms=("cpu",),
        unfit=lambda view, call, q_shape: (
            native_unfit(view, call) or unavailable_reason()
        ),
    )
)


@dataclasses.dataclass(frozen=True)
class Branch:
    """One platform's kernel, as a callable ``platform_dependent`` can merge.

    Branches equal by value are traced and lowered once: `platform` is kept
    only where it changes what the kernel does (XLA's tuning).
    """

    name: str
    interpret: bool
    platform: str
    view: KVCacheView
    call: Call

    def __call__(
        self,
        q: jax.Array,
        pools: Pools,
        meta: CommonAttentionMetadata,
        layer: jax.Array | None,
    ) -> jax.Array:
        """``(T, H, Dv)`` attention on this branch's kernel."""
        run = ATTENTION_KERNELS[self.name].run
        return run(
            q,
            pools,
            self.view,
            meta,
            layer,
            self.call,
            interpret=self.interpret,
            platform=self.platform,
        )


def branch(name: str, platform: str, view: KVCacheView, call: Call) -> Branch:
    """What `platform` runs for kernel `name` (interpreted where not its own)."""
    kernel = ATTENTION_KERNELS[name]
    interpret = kernel.interpretable and not kernel.runs_on(platform)
    tuned = "device"  # the kernels tune themselves (their table data)
    if name == ATTENTION_KERNELS.fallback.name:
        # XLA's path: one branch for every platform tuned alike.
        if tuning(call, platform="cpu") != tuning(call, platform="device"):
            tuned = "cpu" if platform == "cpu" else "device"
    return Branch(name, interpret, tuned, view, call)
