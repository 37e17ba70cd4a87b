"""Compiling jaxkv's kernels for a TPU on a CPU host, and the steps compiled.

libtpu (the ``tpu-compile`` extra) brings the Mosaic and XLA:TPU compilers:
``get_topology_desc`` gives TPU devices of a chip that is not here, abstract
arguments placed on one of them make ``jax.jit(f).lower(...).compile()``
run the real device compilers (Mosaic's layout and DMA checks included),
and ``memory_analysis()`` reads the compiled program's bytes. Shared by
``tests/test_tpu_compile.py`` and ``benchmarks/kernel_report.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

# libtpu takes a machine-wide lock file unless told several processes may
# load it (pytest-xdist's workers each compile; none holds a TPU).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
"""The chips compiled for, and the topology each is described by."""

KERNELS = ("jaxkv_paged_attention_tpu", "jaxkv_kv_write_tpu")


def libtpu_missing() -> str | None:
    """Why TPU programs cannot be compiled here (``None``: they can)."""
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install -e '.[tpu-compile]')"
    return None


@functools.cache
def tpu_sharding(chip: str) -> NamedSharding:
    """One device of `chip`'s topology, as a sharding to place arguments on."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name=CHIPS[chip], platform="tpu")
    return NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())


def on_tpu(tree: Any, chip: str) -> Any:
    """Abstract arrays of `tree` placed on one device of `chip`."""
    sharding = tpu_sharding(chip)

    def place(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

    return jax.tree.map(place, tree)


def compile_for_tpu(fn: Any, args: tuple[Any, ...], chip: str, donate=()) -> Any:
    """`fn` compiled for `chip` with abstract `args` (nothing is allocated).

    Outside the persistent compilation cache: an executable for a device
    this host lacks cannot be read back from it.
    """
    from jax.experimental.compilation_cache import compilation_cache

    lowered = jax.jit(fn, donate_argnums=donate).lower(*on_tpu(args, chip))
    # A persistent cache set up earlier in the process (ejkernel's import
    # sets one) is decided once: reset it around this compile.
    was = getattr(jax.config, "jax_enable_compilation_cache")  # noqa: B009
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def interpreted_ops(text: str) -> list[str]:
    """Ops of a compiled program that come from inside a jaxkv kernel's body.

    A kernel compiled for its device is one custom call; in interpret mode
    its body becomes ordinary ops named under the kernel's name.
    """
    names = re.findall(r'op_name="([^"]*)"', text)
    inside = [n.split(f"{k}/", 1)[1] for n in names for k in KERNELS if f"{k}/" in n]
    return [n for n in inside if n != "pallas_call"]  # the kernel's own call


def pool_sized_ops(text: str, pool_shape: tuple[int, ...]) -> list[str]:
    """Ops of a compiled program that make a new pool-sized array (a relayout).

    A reshape that only relabels the pool compiles to a ``bitcast``; one that
    changes its tiled layout (a TPU tiles the last two dims) to a ``reshape``,
    ``copy`` or fusion that moves every byte: listed here.
    """
    size = int(np.prod(pool_shape))
    keep = {"parameter", "custom-call", "bitcast", "tuple", "get-tuple-element"}
    keep |= {"while", "call", "conditional", "opt-barrier"}
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%[\w.-]+ = \w+\[([\d,]*)\][^ ]* ([\w-]+)\(", line)
        if not m or not m.group(1):
            continue
        dims = [int(d) for d in m.group(1).split(",")]
        if int(np.prod(dims)) >= size and m.group(2) not in keep:
            found.append(f"{m.group(2)} {dims}")
    return found


def kernel_calls(text: str) -> list[str]:
    """The jaxkv TPU kernels a compiled program calls, in order."""
    return re.findall(rf"%({'|'.join(KERNELS)})[.\d]* = ", text)


@dataclasses.dataclass(frozen=True)
class Step:
    """One attention step's shape: decode rows and prefill chunks over a context."""

    name: str
    decode: int = 256  # decode requests (one token each)
    prefill: int = 0  # requests prefilling one chunk each
    chunk: int = 512  # tokens per prefill chunk
    context: int = 4096  # tokens of context each request reads
    block: int = 16
    q_heads: int = 32
    kv_heads: int = 8
    head: int = 128
    dtype: str = "bfloat16"
    # "fused": (N, H, K|V) pages (jaxkv's default, vLLM's NHD); "kv": K and
    # V halves of (N, H, D); "hnd": K and V halves of (H, N, D) (vLLM's HND)
    layout: str = "fused"
    # "fp8_per_tensor": float8_e4m3fn pages with static scales (issue 58)
    quant: str = "none"

    @property
    def page_dtype(self) -> str:
        return "float8_e4m3fn" if self.quant == "fp8_per_tensor" else self.dtype

    @property
    def reqs(self) -> int:
        return self.decode + self.prefill

    @property
    def tokens(self) -> int:
        return self.decode + self.prefill * self.chunk

    @property
    def tile(self) -> int:
        return 16 if self.prefill else 1

    @property
    def cols(self) -> int:
        return -(-self.context // self.block)

    def kv_bytes(self) -> int:
        """K/V bytes the step must read once (every request's context)."""
        itemsize = jnp.dtype(self.page_dtype).itemsize
        per_token = 2 * self.kv_heads * self.head * itemsize
        return self.reqs * self.context * per_token


def plan_of(step: Step, *, num_layers: int = 1) -> tuple[Any, list[str]]:
    """A stacked typed plan holding every request's context, and its layers."""
    layout, order = {
        "fused": (jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED, None),
        "kv": (jaxkv.KVCacheLayout.BLOCKS_FIRST, None),
        "hnd": (jaxkv.KVCacheLayout.BLOCKS_FIRST, (0, 1, 3, 2, 4)),
    }[step.layout]
    backend = jaxkv.AttentionBackend(
        name=f"compile_{step.layout}", layout=layout, stride_order=order
    )
    spec = jaxkv.FullAttentionSpec(
        block_size=step.block,
        num_kv_heads=step.kv_heads,
        head_size=step.head,
        dtype=step.page_dtype,
        kv_quant_mode=step.quant,
    )
    names = [f"layers.{i}" for i in range(num_layers)]
    cfg = jaxkv.RunnerConfig(
        layers=[jaxkv.LayerConfig(name=n, spec=spec, backend=backend) for n in names]
    )
    blocks = step.reqs * step.cols + 1
    plan = jaxkv.make_plan(
        cfg, num_blocks=blocks, storage="stacked", pool_dtype="element"
    )
    return plan, names


def attention_step(
    step: Step, *, implementation: str | None, write: str | None = "skip"
) -> tuple[Any, tuple[Any, ...]]:
    """``(fn, abstract args)``: one layer's write (unless "skip") and attention."""
    plan, names = plan_of(step)
    layer = plan.attention_layer(names[0])
    meta = jaxkv.CommonAttentionMetadata.empty(
        max_reqs=step.reqs, max_tokens=step.tokens, max_blocks=step.cols
    )
    dt = jnp.dtype(step.dtype)
    quant = step.quant != "none"
    k_scale, v_scale = (0.5, 2.0) if quant else (None, None)

    def fn(pools, q, k, slots, meta):
        if write != "skip":
            pools = jaxkv.write_kv(pools, layer.view, k, k, slots, implementation=write)
        out = jaxkv.paged_attention(
            q,
            pools,
            layer,
            meta,
            scale=step.head**-0.5,
            query_tile=step.tile,
            implementation=implementation,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return pools, out

    args = (
        jax.eval_shape(plan.allocate),
        jax.ShapeDtypeStruct((step.tokens, step.q_heads, step.head), dt),
        jax.ShapeDtypeStruct((step.tokens, step.kv_heads, step.head), dt),
        jax.ShapeDtypeStruct((step.tokens,), jnp.int32),
        meta,
    )
    return fn, args


def stacked_plan(
    *, pool_dtype: str = "element", head_size: int = 64, layers: int = 4
) -> tuple[Any, Any]:
    """``(plan, stack)``: a bf16 GQA decoder (4 / 2 heads) in one stacked pool."""
    cfg = jaxkv.llama_like_config(
        num_layers=layers,
        num_kv_heads=2,
        head_size=head_size,
        dtype="bfloat16",
        block_size=16,
    )
    plan = jaxkv.make_plan(cfg, num_blocks=64, storage="stacked", pool_dtype=pool_dtype)
    return plan, plan.layer_stack([layer.name for layer in cfg.layers])


def scan_step(
    plan: Any,
    stack: Any,
    *,
    write: str | None = None,
    attend: str | None = None,
    tokens: int = 8,
    reqs: int = 4,
) -> tuple[Any, tuple[Any, ...]]:
    """``(jitted fn, args)``: write and attend per layer of the stack, layer traced.

    The pools (argument 0) are donated.
    """
    view = stack.layer.view
    head = view.head_size

    def fn(pools, q, k, slots, meta, layer_ids):
        def body(pools, layer):
            pools = jaxkv.write_kv(
                pools, view, k, k, slots, layer=layer, implementation=write
            )
            out = jaxkv.paged_attention(
                q,
                pools,
                stack.layer,
                meta,
                scale=0.1,
                layer=layer,
                implementation=attend,
            )
            return pools, out

        return jax.lax.scan(body, pools, layer_ids)

    meta = jaxkv.CommonAttentionMetadata.empty(
        max_reqs=reqs, max_tokens=tokens, max_blocks=4
    )
    args = (
        jax.eval_shape(plan.allocate),
        jax.ShapeDtypeStruct((tokens, 4, head), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, 2, head), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
        meta,
        jax.ShapeDtypeStruct((len(stack.slots),), jnp.int32),
    )
    return jax.jit(fn, donate_argnums=0), args
