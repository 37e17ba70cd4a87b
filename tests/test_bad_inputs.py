"""A catalogue of bad inputs across the public API: each raises the stated
exception with a message naming the argument (never an assert, a wrap or a
failure deep inside JAX)."""

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

B = jaxkv.get_backend("JAX_PAGED")
MAMBA2 = jaxkv.get_backend("MAMBA2")


def _full(**kw: Any) -> Any:
    d: dict[str, Any] = dict(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
    )
    d.update(kw)
    return jaxkv.FullAttentionSpec(**d)


def _swa(**kw: Any) -> Any:
    d: dict[str, Any] = dict(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float32", sliding_window=32
    )
    d.update(kw)
    return jaxkv.SlidingWindowSpec(**d)


def _mamba(**kw: Any) -> Any:
    d: dict[str, Any] = dict(block_size=16, shapes=((4,),), dtypes=("float32",))
    d.update(kw)
    return jaxkv.MambaSpec(**d)


def _layer(**kw: Any) -> Any:
    d: dict[str, Any] = dict(name="a", spec=_full(), backend=B)
    d.update(kw)
    return jaxkv.LayerConfig(**d)


def _cfg(**kw: Any) -> Any:
    d: dict[str, Any] = dict(layers=[_layer()])
    d.update(kw)
    return jaxkv.RunnerConfig(**d)


PLAN = jaxkv.make_plan(jaxkv.tiny_hybrid_config(max_model_len=256), num_blocks=4)
V: Any = PLAN.views["layers.0.self_attn"]
MV = PLAN.views["layers.2.mixer"]
K = jnp.ones((2, 2, 32))
BUILDER = jaxkv.StepMetadataBuilder(PLAN)
META = jaxkv.CommonAttentionMetadata.empty(max_reqs=1, max_tokens=2, max_blocks=1)


def _bad(value: Any) -> Any:
    """A deliberately ill-typed argument (hidden from the type checker)."""
    return value


KERNEL16 = jaxkv.AttentionBackend(
    name="K16",
    layout=jaxkv.KVCacheLayout.BLOCKS_FIRST,
    supported_kernel_block_sizes=(16,),
)
SPLIT = jaxkv.make_plan(
    jaxkv.tiny_hybrid_config(attention_backend=KERNEL16),
    num_blocks=4,
    maps_slot_mapping=True,
)

PACKED_SPLIT = jaxkv.make_plan(
    jaxkv.tiny_hybrid_config(attention_backend=KERNEL16),
    num_blocks=4,
    packed=True,
    maps_slot_mapping=True,
)
PV: Any = PACKED_SPLIT.views["layers.0.self_attn"]  # owns 2 of every 4 kernel ids
OTHER = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=64)


def _group_disagrees() -> Any:
    s8, s16 = _full(head_size=8), _full(head_size=16)
    cfg = _cfg(layers=[_layer(spec=s16)])
    kv = jaxkv.vllm.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            jaxkv.vllm.KVCacheTensor(size=4 * s8.page_size_bytes, shared_by=["a"])
        ],
        kv_cache_groups=[
            jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=s8)
        ],
    )
    return jaxkv.vllm.init_attn_backend(kv, cfg)


def _pools() -> Any:
    return PLAN.allocate()


def _donated() -> Any:
    pools = _pools()
    jax.jit(lambda p: p, donate_argnums=0)(pools)
    return pools


def _past_allocation() -> Any:
    m = jaxkv.KVCacheManager(PLAN)
    r = jaxkv.Request("a", prompt=[1] * 10, max_new_tokens=1)
    m.allocate(r, 3)
    return m.step_blocks([(r, 40)])


def _prepare(**kw: Any) -> Any:
    d: dict[str, Any] = dict(
        query_start_loc=np.array([0, 2]),
        seq_lens=np.array([2]),
        positions=np.array([0, 1]),
        block_tables=[np.array([[1]])] * 3,
        slot_mappings=[np.array([32, 33])] * 3,
    )
    d.update(kw)
    return BUILDER.prepare(jaxkv.StepArrays(**d))


def _sched(**kw: Any) -> Any:
    return jaxkv.Scheduler(PLAN, vocab_size=100, **kw)


def _rejected(req: Any, **kw: Any) -> None:
    """Scheduler rejections are not exceptions: re-raise the reason to test it."""
    s = _sched(**kw)
    if not s.add_request(req):
        raise ValueError(req.reject_reason)


def _served_twice() -> None:
    s = _sched()
    r = jaxkv.Request("r", prompt=[1, 2], max_new_tokens=1)
    s.add_request(r)
    step = s.schedule()
    s.update(step, [3])
    _rejected(r)


# (id, call, exception, pattern the message must contain)
CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # --- specs -------------------------------------------------------------
    ("spec block_size 0", lambda: _full(block_size=0), ValueError, "block_size"),
    ("spec block_size -16", lambda: _full(block_size=-16), ValueError, "block_size"),
    ("spec block_size float", lambda: _full(block_size=16.0), TypeError, "block_size"),
    ("spec block_size bool", lambda: _full(block_size=True), TypeError, "block_size"),
    ("spec block_size str", lambda: _full(block_size="16"), TypeError, "block_size"),
    ("spec num_kv_heads 0", lambda: _full(num_kv_heads=0), ValueError, "num_kv_heads"),
    ("spec head_size 0", lambda: _full(head_size=0), ValueError, "head_size"),
    ("spec head_size_v 0", lambda: _full(head_size_v=0), ValueError, "head_size_v"),
    ("spec head_size_v -1", lambda: _full(head_size_v=-1), ValueError, "head_size_v"),
    ("spec dtype int4", lambda: _full(dtype="int4"), TypeError, "dtype"),
    ("spec dtype bool", lambda: _full(dtype="bool"), TypeError, "dtype"),
    ("spec dtype complex", lambda: _full(dtype="complex64"), TypeError, "dtype"),
    ("spec dtype junk", lambda: _full(dtype="notadtype"), TypeError, "dtype"),
    ("spec dtype object", lambda: _full(dtype=object), TypeError, "dtype"),
    (
        "spec page_size_padded small",
        lambda: _full(page_size_padded=8),
        ValueError,
        "page_size_padded",
    ),
    (
        "spec kv_quant_mode",
        lambda: _full(kv_quant_mode="nvfp4"),
        NotImplementedError,
        "kv_quant_mode",
    ),
    ("swa window 0", lambda: _swa(sliding_window=0), ValueError, "sliding_window"),
    (
        "swa window float",
        lambda: _swa(sliding_window=32.0),
        TypeError,
        "sliding_window",
    ),
    (
        "chunked local 0",
        lambda: jaxkv.ChunkedLocalAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=8,
            dtype="float32",
            attention_chunk_size=0,
        ),
        ValueError,
        "attention_chunk_size",
    ),
    (
        "mla two heads",
        lambda: jaxkv.MLAAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype="float32"
        ),
        ValueError,
        "num_kv_heads",
    ),
    ("mamba flat shapes", lambda: _mamba(shapes=(4,)), TypeError, "shapes"),
    ("mamba fractional shape", lambda: _mamba(shapes=((4.5,),)), TypeError, "shapes"),
    ("mamba zero dim", lambda: _mamba(shapes=((0,),)), ValueError, "shapes"),
    ("mamba no states", lambda: _mamba(shapes=(), dtypes=()), ValueError, "shapes"),
    ("mamba dtypes count", lambda: _mamba(dtypes=()), ValueError, "dtypes"),
    ("mamba complex", lambda: _mamba(dtypes=("complex64",)), TypeError, "dtype"),
    ("mamba bool", lambda: _mamba(dtypes=("bool",)), TypeError, "dtype"),
    (
        "mamba padded small",
        lambda: _mamba(page_size_padded=8),
        ValueError,
        "page_size_padded",
    ),
    ("mamba shard_axes", lambda: _mamba(shard_axes=(3,)), ValueError, "shard_axes"),
    (
        "mamba cache mode",
        lambda: _mamba(mamba_cache_mode="all"),
        NotImplementedError,
        "mamba_cache_mode",
    ),
    ("mamba block_size 0", lambda: _mamba(block_size=0), ValueError, "block_size"),
    # --- layers and configs ------------------------------------------------
    ("layer empty name", lambda: _layer(name=""), TypeError, "name"),
    ("layer spec str", lambda: _layer(spec="x"), TypeError, "spec"),
    ("layer backend str", lambda: _layer(backend="JAX_PAGED"), TypeError, "backend"),
    ("layer num_heads -1", lambda: _layer(num_heads=-1), ValueError, "num_heads"),
    ("layer attn_type", lambda: _layer(attn_type="foo"), ValueError, "attn_type"),
    ("layer layer_type", lambda: _layer(layer_type="foo"), ValueError, "layer_type"),
    (
        "layer mamba spec, attention backend",
        lambda: _layer(spec=_mamba()),
        ValueError,
        "MambaSpec",
    ),
    (
        "layer soft cap negative",
        lambda: _layer(logits_soft_cap=-1.0),
        ValueError,
        "logits_soft_cap",
    ),
    (
        "layer soft cap str",
        lambda: _layer(logits_soft_cap="30"),
        ValueError,
        "logits_soft_cap",
    ),
    (
        "config max_model_len 0",
        lambda: _cfg(max_model_len=0),
        ValueError,
        "max_model_len",
    ),
    ("config max_num_seqs 0", lambda: _cfg(max_num_seqs=0), ValueError, "max_num_seqs"),
    (
        "config batched tokens -1",
        lambda: _cfg(max_num_batched_tokens=-1),
        ValueError,
        "max_num_batched_tokens",
    ),
    ("config bucket 0", lambda: _cfg(token_buckets=(0,)), ValueError, "token_buckets"),
    (
        "config buckets unsorted",
        lambda: _cfg(token_buckets=(8, 4)),
        ValueError,
        "token_buckets",
    ),
    (
        "config duplicate names",
        lambda: _cfg(layers=[_layer(), _layer()]),
        ValueError,
        "duplicate layer name",
    ),
    (
        "config layer not a LayerConfig",
        lambda: _cfg(layers=["a"]),
        TypeError,
        r"layers\[0\]",
    ),
    (
        "config share unknown",
        lambda: _cfg(layers=[_layer(kv_sharing_target="zz")]),
        ValueError,
        "zz",
    ),
    (
        "config share itself",
        lambda: _cfg(layers=[_layer(kv_sharing_target="a")]),
        ValueError,
        "itself",
    ),
    (
        "config share later layer",
        lambda: _cfg(layers=[_layer(kv_sharing_target="b"), _layer(name="b")]),
        ValueError,
        "registered later",
    ),
    (
        "config Mamba shares",
        lambda: _cfg(
            layers=[
                _layer(),
                _layer(name="m", spec=_mamba(), backend=MAMBA2, kv_sharing_target="a"),
            ]
        ),
        ValueError,
        "Mamba state cannot be shared",
    ),
    (
        "config attention shares Mamba",
        lambda: _cfg(
            layers=[
                _layer(name="m", spec=_mamba(), backend=MAMBA2),
                _layer(kv_sharing_target="m"),
            ]
        ),
        ValueError,
        "Mamba state cannot be shared",
    ),
    # --- plans ----------------------------------------------------------------
    (
        "plan no size",
        lambda: jaxkv.make_plan(_cfg()),
        ValueError,
        "num_blocks and memory_bytes",
    ),
    (
        "plan both sizes",
        lambda: jaxkv.make_plan(_cfg(), num_blocks=4, memory_bytes=10**6),
        ValueError,
        "num_blocks and memory_bytes",
    ),
    (
        "plan one block",
        lambda: jaxkv.make_plan(_cfg(), num_blocks=1),
        ValueError,
        "num_blocks",
    ),
    (
        "plan blocks str",
        lambda: jaxkv.make_plan(_cfg(), num_blocks=_bad("4")),
        TypeError,
        "num_blocks",
    ),
    (
        "plan blocks float",
        lambda: jaxkv.make_plan(_cfg(), num_blocks=_bad(4.0)),
        TypeError,
        "num_blocks",
    ),
    (
        "plan tiny budget",
        lambda: jaxkv.make_plan(_cfg(), memory_bytes=100),
        ValueError,
        "memory_bytes",
    ),
    (
        "budget 0",
        lambda: jaxkv.kv_cache_budget(_cfg(), memory_bytes=0),
        ValueError,
        "memory_bytes",
    ),
    (
        "budget float",
        lambda: jaxkv.kv_cache_budget(_cfg(), memory_bytes=_bad(1e6)),
        TypeError,
        "memory_bytes",
    ),
    (
        "init_attn_backend device",
        lambda: jaxkv.vllm.init_attn_backend(
            PLAN.kv_cache_config, PLAN.runner_config, "cpu"
        ),
        ValueError,
        "device",
    ),
    (
        "kernel_block_sizes empty",
        lambda: jaxkv.vllm.init_kv_cache(
            PLAN.kv_cache_config, PLAN.runner_config, [], PLAN.attn_groups
        ),
        ValueError,
        "kernel_block_sizes",
    ),
    (
        "kernel_block_sizes not a divisor",
        lambda: jaxkv.vllm.init_kv_cache(
            PLAN.kv_cache_config, PLAN.runner_config, [7, 7, 7], PLAN.attn_groups
        ),
        ValueError,
        r"kernel_block_sizes\[0\]",
    ),
    (
        "bind a bare string",
        lambda: jaxkv.vllm.bind_kv_caches(
            PLAN.views, "layers.0.self_attn", PLAN.kv_cache_config, PLAN.runner_config
        ),
        TypeError,
        "forward_context",
    ),
    (
        "attention_layer of Mamba",
        lambda: PLAN.attention_layer("layers.2.mixer"),
        TypeError,
        "layers.2.mixer",
    ),
    ("attention_layer unknown", lambda: PLAN.attention_layer("nope"), KeyError, "nope"),
    # --- reads and writes ---------------------------------------------------
    (
        "write float slots",
        lambda: jaxkv.write_kv(_pools(), V, K, K, np.array([1.0, 2.0])),
        TypeError,
        "slot_mapping",
    ),
    (
        "write NaN slots",
        lambda: jaxkv.write_kv(_pools(), V, K, K, np.array([np.nan, 2.0])),
        TypeError,
        "slot_mapping",
    ),
    (
        "write bool slots",
        lambda: jaxkv.write_kv(_pools(), V, K, K, np.array([True, False])),
        TypeError,
        "slot_mapping",
    ),
    (
        "write int64 slot past int32",
        lambda: jaxkv.write_kv(_pools(), V, K, K, np.array([2**32 + 33, 2], np.int64)),
        ValueError,
        "slot_mapping",
    ),
    (
        "write slots shape",
        lambda: jaxkv.write_kv(_pools(), V, K, K, np.array([1, 2, 3])),
        ValueError,
        "slot_mapping",
    ),
    (
        "write key shape",
        lambda: jaxkv.write_kv(_pools(), V, jnp.ones((2, 3, 32)), K, np.array([1, 2])),
        ValueError,
        "key.shape",
    ),
    (
        "write value shape",
        lambda: jaxkv.write_kv(_pools(), V, K, jnp.ones((2, 2, 31)), np.array([1, 2])),
        ValueError,
        "value.shape",
    ),
    (
        "write value missing",
        lambda: jaxkv.write_kv(_pools(), V, K, None, np.array([1, 2])),
        ValueError,
        "value",
    ),
    (
        "write complex key",
        lambda: jaxkv.write_kv(
            _pools(), V, K.astype(jnp.complex64), K, np.array([1, 2])
        ),
        TypeError,
        "key",
    ),
    (
        "write to a Mamba view",
        lambda: jaxkv.write_kv(_pools(), MV, K, K, np.array([1, 2])),
        TypeError,
        "MambaView",
    ),
    (
        "write to a string",
        lambda: jaxkv.write_kv(_pools(), "layers.0", K, K, np.array([1, 2])),
        TypeError,
        "KVCacheView",
    ),
    (
        "gather 1-D table",
        lambda: jaxkv.gather_kv_pages(_pools(), V, np.array([1, 2])),
        ValueError,
        "block_table",
    ),
    (
        "gather float table",
        lambda: jaxkv.gather_kv_pages(_pools(), V, np.array([[1.0]])),
        TypeError,
        "block_table",
    ),
    (
        "gather id past int32",
        lambda: jaxkv.gather_kv_pages(_pools(), V, np.array([[2**32 + 1]], np.int64)),
        ValueError,
        "block_table",
    ),
    (
        "gather from Mamba view",
        lambda: jaxkv.gather_kv_pages(_pools(), MV, np.array([[1]])),
        TypeError,
        "MambaView",
    ),
    (
        "mamba write state count",
        lambda: jaxkv.write_mamba_state(
            _pools(), MV, np.array([1]), [jnp.ones((1, 3, 128))]
        ),
        ValueError,
        "states",
    ),
    (
        "mamba write state shape",
        lambda: jaxkv.write_mamba_state(
            _pools(),
            MV,
            np.array([1]),
            [jnp.ones((1, 3, 12)), jnp.ones((1, 4, 32, 16))],
        ),
        ValueError,
        r"states\[0\]",
    ),
    (
        "mamba write float ids",
        lambda: jaxkv.write_mamba_state(
            _pools(),
            MV,
            np.array([1.0]),
            [jnp.ones((1, 3, 128)), jnp.ones((1, 4, 32, 16))],
        ),
        TypeError,
        "block_ids",
    ),
    (
        "mamba read float ids",
        lambda: jaxkv.read_mamba_state(_pools(), MV, np.array([1.5])),
        TypeError,
        "block_ids",
    ),
    (
        "mamba read id past int32",
        lambda: jaxkv.read_mamba_state(_pools(), MV, np.array([2**33], np.int64)),
        ValueError,
        "block_ids",
    ),
    (
        "mamba read from KV view",
        lambda: jaxkv.read_mamba_state(_pools(), V, np.array([1])),
        TypeError,
        "KVCacheView",
    ),
    (
        "zero float ids",
        lambda: jaxkv.zero_blocks(_pools(), [V], np.array([1.0])),
        TypeError,
        "block_ids",
    ),
    (
        "zero views of two block spaces",
        lambda: jaxkv.zero_blocks(
            SPLIT.allocate(),
            [SPLIT.views["layers.0.self_attn"], SPLIT.views["layers.2.mixer"]],
            np.array([1]),
        ),
        ValueError,
        "one block space",
    ),
    (
        "zero a single view",
        lambda: jaxkv.zero_blocks(_pools(), V, np.array([1])),
        TypeError,
        "views",
    ),
    (
        "validate NaN slots",
        lambda: jaxkv.validate_slot_mapping(np.array([np.nan]), V, "L"),
        TypeError,
        "slot_mapping",
    ),
    (
        "validate slot past int32",
        lambda: jaxkv.validate_slot_mapping(np.array([2**33], np.int64), V, "L"),
        ValueError,
        "slot_mapping",
    ),
    (
        "validate slot out of range",
        lambda: jaxkv.validate_slot_mapping(np.array([10**6]), V, "L"),
        ValueError,
        "layer 'L'",
    ),
    (
        "validate slot -2",
        lambda: jaxkv.validate_slot_mapping(np.array([-2]), V, "L"),
        ValueError,
        "slot_mapping",
    ),
    (
        "validate negative block",
        lambda: jaxkv.validate_block_ids(np.array([-2]), V, "L"),
        ValueError,
        "block ids for layer 'L'",
    ),
    (
        "validate float blocks",
        lambda: jaxkv.validate_block_ids(np.array([1.0]), V, "L"),
        TypeError,
        "block_ids",
    ),
    (
        "validate under jit",
        lambda: jax.jit(lambda s: jaxkv.validate_slot_mapping(s, V, "L"))(
            jnp.array([1])
        ),
        TypeError,
        "traced",
    ),
    (
        "validate another layer's kernel slot",
        lambda: jaxkv.validate_slot_mapping(np.array([2 * 16 + 3]), PV, "L"),
        ValueError,
        "another layer's page",
    ),
    (
        "validate another layer's kernel block",
        lambda: jaxkv.validate_block_ids(np.array([[0, 3]]), PV, "L"),
        ValueError,
        "another layer's page",
    ),
    (
        "write through another plan's view",
        lambda: jaxkv.write_kv(
            _pools(), OTHER.views["layers.0.self_attn"], K, K, np.array([1, 2])
        ),
        ValueError,
        "another plan",
    ),
    (
        "read through another plan's Mamba view",
        lambda: jaxkv.read_mamba_state(
            _pools(), OTHER.views["layers.2.mixer"], np.array([1])
        ),
        ValueError,
        "another plan",
    ),
    (
        "group spec disagrees with its layer",
        _group_disagrees,
        ValueError,
        "head_size=8",
    ),
    ("config cache_dtype", lambda: _cfg(cache_dtype="fp9"), ValueError, "cache_dtype"),
    # --- attention ------------------------------------------------------------
    (
        "attention q heads",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 3, 32)), _pools(), V, META, scale=1.0
        ),
        ValueError,
        "q has 3 heads",
    ),
    (
        "attention q head_dim",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 4, 16)), _pools(), V, META, scale=1.0
        ),
        ValueError,
        r"q.shape\[-1\]",
    ),
    (
        "attention Mamba view",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 4, 32)), _pools(), MV, META, scale=1.0
        ),
        TypeError,
        "MambaView",
    ),
    (
        "attention contradicts window",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 4, 32)),
            _pools(),
            PLAN.attention_layer("layers.1.self_attn"),
            META,
            scale=1.0,
            sliding_window=8,
        ),
        ValueError,
        "sliding_window=8 contradicts",
    ),
    (
        "attention bare view of a windowed layer",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 4, 32)),
            _pools(),
            PLAN.views["layers.1.self_attn"],
            META,
            scale=1.0,
        ),
        ValueError,
        "pass the layer's AttentionLayer",
    ),
    (
        "mamba state blocks contradicting the group",
        lambda: BUILDER.build(_prepare())["layers.2.mixer"].mamba_state_blocks(64),
        ValueError,
        "block_size=64 contradicts the group's block size 32",
    ),
    # --- step arrays ------------------------------------------------------------
    (
        "prepare unsorted qsl",
        lambda: _prepare(
            query_start_loc=np.array([0, 3, 2]),
            seq_lens=np.array([3, 1]),
            block_tables=[np.array([[1], [2]])] * 3,
        ),
        ValueError,
        "query_start_loc",
    ),
    (
        "prepare qsl not from 0",
        lambda: _prepare(query_start_loc=np.array([1, 2])),
        ValueError,
        "query_start_loc",
    ),
    (
        "prepare float qsl",
        lambda: _prepare(query_start_loc=np.array([0.0, 2.0])),
        TypeError,
        "query_start_loc",
    ),
    (
        "prepare seq shorter than query",
        lambda: _prepare(seq_lens=np.array([1])),
        ValueError,
        r"seq_lens\[0\]",
    ),
    (
        "prepare seq_lens count",
        lambda: _prepare(seq_lens=np.array([2, 2])),
        ValueError,
        "seq_lens",
    ),
    (
        "prepare table too short",
        lambda: _prepare(seq_lens=np.array([40]), positions=np.array([38, 39])),
        ValueError,
        r"block_tables\[0\]",
    ),
    (
        "prepare -1 in context",
        lambda: _prepare(block_tables=[np.array([[-1]])] * 3),
        ValueError,
        r"block_tables\[0\]\[0, 0\]",
    ),
    (
        "prepare id past the pool",
        lambda: _prepare(block_tables=[np.array([[99]])] * 3),
        ValueError,
        r"block_tables\[0\]",
    ),
    (
        "prepare table rows",
        lambda: _prepare(block_tables=[np.array([[1], [1]])] * 3),
        ValueError,
        "rows",
    ),
    (
        "prepare positions length",
        lambda: _prepare(positions=np.array([0])),
        ValueError,
        "positions",
    ),
    (
        "prepare slot length",
        lambda: _prepare(slot_mappings=[np.array([32])] * 3),
        ValueError,
        r"slot_mappings\[0\]",
    ),
    (
        "prepare float slots",
        lambda: _prepare(slot_mappings=[np.array([32.0, 33.5])] * 3),
        TypeError,
        r"slot_mappings\[0\]",
    ),
    (
        "prepare slot past int32",
        lambda: _prepare(slot_mappings=[np.array([2**33, 1], np.int64)] * 3),
        ValueError,
        r"slot_mappings\[0\]",
    ),
    (
        "prepare id == num_blocks",
        lambda: _prepare(block_tables=[np.array([[4]])] * 3),
        ValueError,
        r"block_tables\[0\]\[0, 0\] is 4, outside \[0, 4\)",
    ),
    (
        "prepare uint32 slot past int32",
        lambda: _prepare(slot_mappings=[np.array([2**31 + 33, 33], np.uint32)] * 3),
        ValueError,
        r"slot_mappings\[0\] holds values past the int32 range",
    ),
    (
        "prepare slot in another request's block",
        lambda: _prepare(slot_mappings=[np.array([32, 65])] + [np.array([-1, -1])] * 2),
        ValueError,
        r"slot_mappings\[0\]\[1\] is 65 \(block 2\); request 0's token at "
        r"position 1 belongs in block 1 \(slot 33\)",
    ),
    (
        "prepare slot at the wrong offset",
        lambda: _prepare(slot_mappings=[np.array([33, 32])] + [np.array([-1, -1])] * 2),
        ValueError,
        r"slot_mappings\[0\]\[0\] is 33 \(block 1\); request 0's token at "
        r"position 0 belongs in block 1 \(slot 32\)",
    ),
    (
        "prepare context on the null block",
        lambda: _prepare(
            seq_lens=np.array([34]),
            positions=np.array([32, 33]),
            block_tables=[np.array([[0, 2]])] * 3,
            slot_mappings=[np.array([64, 65])] + [np.array([-1, -1])] * 2,
        ),
        ValueError,
        r"block_tables\[0\]\[0, 0\] is the null block in request 0's context "
        r"\(group 0 keeps every block\)",
    ),
    (
        "prepare above max_num_batched_tokens",
        lambda: _prepare(query_start_loc=np.array([0, 8193])),
        ValueError,
        "a step of 8193 tokens exceeds max_num_batched_tokens=8192",
    ),
    (
        "prepare above max_num_seqs",
        lambda: _prepare(query_start_loc=np.arange(258)),
        ValueError,
        "a step of 257 requests exceeds max_num_seqs=256",
    ),
    (
        "prepare group count",
        lambda: _prepare(block_tables=[np.array([[1]])] * 2),
        ValueError,
        "block tables",
    ),
    (
        "prepare logits out of range",
        lambda: _prepare(logits_indices=np.array([5]), cu_num_logits=np.array([0, 1])),
        ValueError,
        "logits_indices",
    ),
    (
        "prepare logits unsorted",
        lambda: _prepare(
            logits_indices=np.array([1, 0]), cu_num_logits=np.array([0, 2])
        ),
        ValueError,
        "logits_indices",
    ),
    (
        "prepare logits repeated",
        lambda: _prepare(
            logits_indices=np.array([1, 1]), cu_num_logits=np.array([0, 2])
        ),
        ValueError,
        "strictly ascending",
    ),
    (
        "budget past int32 slots",
        lambda: jaxkv.kv_cache_budget(jaxkv.tiny_hybrid_config(), memory_bytes=10**18),
        ValueError,
        "memory_bytes=1000000000000000000 holds 30517578125000 blocks .* int32 slot",
    ),
    (
        "plan past int32 slots",
        lambda: jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=2**31),
        ValueError,
        "num_blocks=2147483648 gives .* slot ids are int32",
    ),
    (
        "write_kv on donated pools",
        lambda: jaxkv.write_kv(_donated(), V, K, K, np.array([33, 34])),
        ValueError,
        r"write_kv: pools\[0\] was donated to an earlier step",
    ),
    (
        "attention on donated pools",
        lambda: jaxkv.paged_attention(
            jnp.ones((2, 4, 32)), _donated(), V, META, scale=1.0
        ),
        ValueError,
        r"paged_attention: pools\[0\] was donated",
    ),
    (
        "step_blocks past the allocation",
        lambda: _past_allocation(),
        ValueError,
        "request 'a' holds blocks for 32 tokens in group 0; the step computes up to 40",
    ),
    # --- block manager and scheduler -------------------------------------------
    (
        "allocator 0 blocks",
        lambda: jaxkv.sched.BlockAllocator(0),
        ValueError,
        "num_blocks",
    ),
    (
        "allocator negative count",
        lambda: jaxkv.sched.BlockAllocator(3).allocate(-1),
        ValueError,
        "n must be >= 0, got -1",
    ),
    (
        "allocator float count",
        lambda: jaxkv.sched.BlockAllocator(3).allocate(1.0),  # pyright: ignore[reportArgumentType]
        TypeError,
        "n must be an int",
    ),
    (
        "allocator double free",
        lambda: jaxkv.sched.BlockAllocator(3).free([1]),
        ValueError,
        "not held",
    ),
    (
        "allocator null block",
        lambda: jaxkv.sched.BlockAllocator(3).touch([0]),
        ValueError,
        "Block id 0",
    ),
    (
        "manager more blocks than the plan",
        lambda: jaxkv.KVCacheManager(PLAN, num_blocks=99),
        ValueError,
        "num_blocks",
    ),
    (
        "request empty prompt",
        lambda: _rejected(jaxkv.Request("r", prompt=[], max_new_tokens=1)),
        ValueError,
        "empty prompt",
    ),
    (
        "request zero new tokens",
        lambda: _rejected(jaxkv.Request("r", prompt=[1], max_new_tokens=0)),
        ValueError,
        "max_new_tokens",
    ),
    (
        "request negative new tokens",
        lambda: _rejected(jaxkv.Request("r", prompt=[1], max_new_tokens=-3)),
        ValueError,
        "max_new_tokens",
    ),
    (
        "request over model length",
        lambda: _rejected(jaxkv.Request("r", prompt=[1] * 250, max_new_tokens=10)),
        ValueError,
        "max_model_len",
    ),
    (
        "request token past vocab",
        lambda: _rejected(jaxkv.Request("r", prompt=[1, 100], max_new_tokens=1)),
        ValueError,
        "prompt token ids",
    ),
    (
        "request negative token",
        lambda: _rejected(jaxkv.Request("r", prompt=[-1], max_new_tokens=1)),
        ValueError,
        "prompt token ids",
    ),
    (
        "request float tokens",
        lambda: _rejected(jaxkv.Request("r", prompt=_bad([1.5]), max_new_tokens=1)),
        ValueError,
        "prompt token ids",
    ),
    (
        "request never fits",
        lambda: _rejected(jaxkv.Request("r", prompt=[1] * 200, max_new_tokens=8)),
        ValueError,
        "KV-cache blocks",
    ),
    ("request served twice", _served_twice, ValueError, "already served"),
    (
        "request id twice",
        lambda: [
            _s := _sched(),
            _s.add_request(jaxkv.Request("r", prompt=[1], max_new_tokens=1)),
            _s.add_request(jaxkv.Request("r", prompt=[1], max_new_tokens=1)),
        ],
        ValueError,
        "'r' is already live",
    ),
    (
        "prefix caching with encoder caches",
        lambda: jaxkv.KVCacheManager(
            jaxkv.make_plan(
                _cfg(
                    layers=[
                        _layer(
                            spec=jaxkv.CrossAttentionSpec(
                                block_size=16,
                                num_kv_heads=1,
                                head_size=8,
                                dtype="float32",
                            ),
                            attn_type="encoder_decoder",
                        )
                    ]
                ),
                num_blocks=4,
            ),
            enable_prefix_caching=True,
        ),
        ValueError,
        "enable_prefix_caching",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [pytest.param(c, e, p, id=i) for i, c, e, p in CASES],
)
def test_bad_input_raises_a_clear_error(call, exc, pattern):
    with pytest.raises(exc) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)


def test_the_catalogue_is_large_and_covers_every_area():
    assert len(CASES) >= 80
    assert len({c[0] for c in CASES}) == len(CASES)
