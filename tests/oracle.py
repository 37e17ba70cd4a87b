"""A byte-exact NumPy model of vLLM's memory semantics, sharing no code with jaxkv.

One uint8 buffer per pool; each layer is a NumPy ``as_strided`` view of it with
the shapes and byte strides written out from spec §1.7 (V1-V4, Mamba, padded
and packed pages, kernel-block splits). Writes go through those views in place,
exactly as PyTorch does in vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import jaxkv

LAYOUT_AXES = {
    "blocks_first": ("block", "kv", "token", "head", "dim"),
    "kv_first": ("kv", "block", "token", "head", "dim"),
    "blocks_first_fused": ("block", "token", "head", "dim"),
    "mla": ("block", "token", "dim"),
}


def _dense_byte_strides(shape, order, itemsize):
    strides = [0] * len(shape)
    acc = itemsize
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return strides


class OracleLayer:
    def __init__(
        self, pool, offset, shape, byte_strides, dtype, axes, head_size=0, owned=None
    ):
        # owned = (s, r): of every s kernel block ids only the first r are the
        # layer's pieces (spec §1.8); the others are other layers' pages.
        self.owned = owned
        self.pool, self.offset, self.shape = pool, offset, tuple(shape)
        self.byte_strides, self.dtype, self.axes = (
            tuple(byte_strides),
            np.dtype(dtype),
            axes,
        )
        self.head_size = head_size

    def array(self, buffers):
        buf = buffers[self.pool]
        n = (buf.size - self.offset) // self.dtype.itemsize
        base = buf[self.offset : self.offset + n * self.dtype.itemsize].view(self.dtype)
        return np.lib.stride_tricks.as_strided(
            base, self.shape, self.byte_strides, writeable=True
        )

    def block_bytes(self, block):
        """Byte addresses of one block id, computed from shape and byte strides."""
        bd = self.axes.index("block")
        ranges = [
            [block * self.byte_strides[d]]
            if d == bd
            else [i * self.byte_strides[d] for i in range(self.shape[d])]
            for d in range(len(self.shape))
        ]
        addrs = np.zeros(1, np.int64)
        for r in ranges:
            addrs = (addrs[:, None] + np.asarray(r, np.int64)[None, :]).ravel()
        addrs = self.offset + addrs
        return set((addrs[:, None] + np.arange(self.dtype.itemsize)).ravel().tolist())


class Oracle:
    """Pools as uint8 buffers and per-layer strided views (bound granularity)."""

    def __init__(self, kv, cfg, kernel_block_sizes, attn_groups):
        shared = {
            layer.name: layer.kv_sharing_target
            for layer in cfg.layers
            if layer.layer_type == "attention" and layer.kv_sharing_target
        }
        tensors = kv.kv_cache_tensors
        pool_of, sizes, packed_pool = {}, [], None
        for tid, t in enumerate(tensors):
            if t.block_stride > 0:
                if packed_pool is None:
                    packed_pool = len(sizes)
                    sizes.append(t.size)
                pool_of[tid] = packed_pool
            else:
                pool_of[tid] = len(sizes)
                sizes.append(t.size)
        self.buffers = [np.zeros(s, np.uint8) for s in sizes]
        tensor_of = {n: tid for tid, t in enumerate(tensors) for n in t.shared_by}
        flat = [g for gs in attn_groups for g in gs]
        mamba_layers = {
            n
            for g in flat
            if isinstance(g.kv_cache_spec, jaxkv.MambaSpec)
            for n in g.layer_names
        }
        ksize = dict(enumerate(kernel_block_sizes))

        def is_kv_first(g):
            return g.backend.layout.value == "kv_first"

        # V3: K/V-first layers whose tensor also holds a Mamba layer.
        page_aligned = {
            n
            for g in flat
            if is_kv_first(g) and g.kv_cache_group_id in ksize
            for n in g.layer_names
            if n not in shared
            and not mamba_layers.isdisjoint(tensors[tensor_of[n]].shared_by)
        }
        self.layers: dict[str, Any] = {}
        for g in flat:
            if g.kv_cache_group_id not in ksize:
                continue
            for name in g.layer_names:
                if name in shared:
                    continue
                t = tensors[tensor_of[name]]
                self.layers[name] = self._layer(
                    g,
                    ksize[g.kv_cache_group_id],
                    t,
                    pool_of[tensor_of[name]],
                    name in page_aligned,
                )
        # V4: blocks-first partners of dense K/V-first layers in unpacked tensors.
        for t in tensors:
            if t.block_stride > 0 or not page_aligned.isdisjoint(t.shared_by):
                continue
            attn = [
                self.layers[n]
                for n in t.shared_by
                if isinstance(self.layers.get(n), OracleLayer)
            ]
            kinds = {lay.axes[0] for lay in attn}
            if kinds != {"kv", "block"}:
                continue
            for n in t.shared_by:
                lay = self.layers.get(n)
                if not isinstance(lay, OracleLayer) or lay.axes[0] != "block":
                    continue
                nk, half = lay.shape[0], math.prod(lay.shape[2:]) * lay.dtype.itemsize
                lay.byte_strides = (half, nk * half, *lay.byte_strides[2:])
        for layer, target in shared.items():
            if target in self.layers:
                self.layers[layer] = self.layers[target]
        # Bound (kernel) views of packed groups re-viewed per spec §1.8.
        for g in flat:
            if g.kernel_block_size is None or g.kernel_block_stride == 0:
                continue
            for name in g.layer_names:
                lay = self.layers[name]
                spec = g.kv_cache_spec
                k, r = g.kernel_block_size, spec.block_size // g.kernel_block_size
                t = tensors[tensor_of[shared.get(name, name)]]
                kpage = spec.real_page_size_bytes // r
                bd, td = lay.axes.index("block"), lay.axes.index("token")
                shape = list(lay.shape)
                shape[bd] = (t.size // t.block_stride - 1) * g.kernel_block_stride + r
                shape[td] = k
                old_strides = lay.byte_strides
                inner_order = sorted(
                    (d for d in range(len(shape)) if d != bd),
                    key=lambda d: -old_strides[d],
                )
                strides = _dense_byte_strides(
                    shape, [bd, *inner_order], lay.dtype.itemsize
                )
                strides[bd] = kpage
                self.layers[name] = OracleLayer(
                    lay.pool,
                    lay.offset,
                    shape,
                    strides,
                    lay.dtype,
                    lay.axes,
                    lay.head_size,
                    owned=(g.kernel_block_stride, r),
                )

    @staticmethod
    def _layer(g, k, t, pool, page_aligned):
        spec = g.kv_cache_spec
        packed = t.block_stride > 0
        page = spec.page_size_bytes
        n = t.size // t.block_stride if packed else t.size // page
        blk = t.block_stride if packed else page
        base = t.offset if packed else 0
        if isinstance(spec, jaxkv.MambaSpec):
            return [
                OracleLayer(
                    pool,
                    base + off,
                    (n, *shape),
                    (
                        blk,
                        *_dense_byte_strides(
                            shape, range(len(shape)), np.dtype(dt).itemsize
                        ),
                    ),
                    dt,
                    ("block",) + ("state",) * len(shape),
                )
                for shape, dt, off in zip(
                    spec.shapes, spec.dtypes, spec.state_offsets, strict=True
                )
            ]
        e = np.dtype(spec.dtype).itemsize
        r = spec.block_size // k
        nk = n * r
        h, d = spec.num_kv_heads, spec.head_size
        dv = spec.head_size_v or d
        layout = g.backend.layout.value
        axes = LAYOUT_AXES[layout]
        dims = {
            "block": nk,
            "kv": 2,
            "token": k,
            "head": h,
            "dim": d + dv if layout == "blocks_first_fused" else d,
        }
        shape = [dims[a] for a in axes]
        order = list(g.backend.get_kv_cache_stride_order())
        if layout == "kv_first" and not page_aligned and not packed:
            return OracleLayer(
                pool,
                0,
                shape,
                _dense_byte_strides(shape, order, e),
                spec.dtype,
                axes,
                d,
            )
        bd = axes.index("block")
        strides = _dense_byte_strides(shape, [bd, *[x for x in order if x != bd]], e)
        strides[bd] = blk // r
        return OracleLayer(pool, base, shape, strides, spec.dtype, axes, d)

    # --- writes, in place through the strided views -------------------------

    def write_kv(self, name, key, value, slots):
        lay = self.layers[name]
        arr = lay.array(self.buffers)
        k = lay.shape[lay.axes.index("token")]
        nblocks = lay.shape[lay.axes.index("block")]
        for i, s in enumerate(np.asarray(slots)):
            if s < 0 or s // k >= nblocks:
                continue
            if lay.owned is not None and (s // k) % lay.owned[0] >= lay.owned[1]:
                continue  # another layer's page: jaxkv writes nothing
            idx = {"block": int(s // k), "token": int(s % k)}
            if "kv" in lay.axes:
                for kv, data in ((0, key[i]), (1, value[i])):
                    arr[
                        tuple({**idx, "kv": kv}.get(a, slice(None)) for a in lay.axes)
                    ] = data
            elif "head" in lay.axes:
                arr[tuple(idx.get(a, slice(None)) for a in lay.axes)] = np.concatenate(
                    [key[i], value[i]], axis=-1
                )
            else:
                arr[tuple(idx.get(a, slice(None)) for a in lay.axes)] = key[i]

    def write_mamba(self, name, block_ids, states):
        for lay, data in zip(self.layers[name], states, strict=True):
            arr = lay.array(self.buffers)
            for i, b in enumerate(np.asarray(block_ids)):
                if 0 <= b < lay.shape[0]:
                    arr[b] = data[i]

    def zero_blocks(self, names, block_ids):
        for name in names:
            lays = self.layers[name]
            for lay in lays if isinstance(lays, list) else [lays]:
                arr = lay.array(self.buffers)
                bd = lay.axes.index("block")
                for b in np.asarray(block_ids):
                    if 0 <= b < lay.shape[bd]:
                        arr[
                            tuple(
                                int(b) if d == bd else slice(None)
                                for d in range(len(lay.shape))
                            )
                        ] = 0

    def block_bytes(self, name, block):
        lays = self.layers[name]
        out = set()
        for lay in lays if isinstance(lays, list) else [lays]:
            out |= lay.block_bytes(block)
        return out
