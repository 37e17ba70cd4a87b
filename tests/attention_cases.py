"""One case matrix for every attention implementation.

Each case plans a 2-layer model on a typed pool (layouts, dtypes, storage
as elements or bits, kernel blocks smaller than manager blocks), fills every
page of both layer slots with NaN, writes each request's keys and values,
and builds one ragged step (decode rows, prefill chunks, empty requests,
padding tokens whose queries are NaN). ``run(case, implementation)`` gives
``paged_attention``'s output; the tests compare each implementation with the
XLA path, and the XLA path with a dense NumPy oracle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

_LAYOUTS = {
    "fused": (jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED, None),
    "kv": (jaxkv.KVCacheLayout.BLOCKS_FIRST, None),
    "kv_first": (jaxkv.KVCacheLayout.KV_FIRST, None),
    # (blocks, 2, heads, tokens, dim): heads outside tokens (vLLM's HND)
    "hnd": (jaxkv.KVCacheLayout.BLOCKS_FIRST, (0, 1, 3, 2, 4)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: the cache's shape and the step's requests."""

    name: str
    layout: str = "fused"
    dtype: str = "float32"
    pool_dtype: str = "element"  # "bits": the pool holds the floats' bits
    kv_heads: int = 2
    q_heads: int = 4
    head: int = 16
    block: int = 8
    kernel_block: int | None = None  # a kernel block smaller than `block`
    reqs: tuple[tuple[int, int], ...] = ((1, 9), (1, 17), (1, 3))  # (q_len, seq_len)
    tile: int = 1
    window: int | None = None
    chunk: int | None = None
    cap: float | None = None
    cross: bool = False
    non_causal: tuple[int, ...] = ()  # requests that see their whole context
    layer: int = 1  # the layer slot read, passed traced as `layer=`
    cols: int = 5  # block table columns per request
    max_reqs: int = 4
    pad_tokens: int = 3
    pages: int | None = None  # pages_per_chunk (the TPU kernel's DMA wave)
    quant: str = "none"  # kv_quant_mode: 8-bit pages in a word pool (issue 58)
    # fp8_per_tensor's static scales: a float, or a tuple of one per KV head.
    k_scale: float | tuple[float, ...] | None = None
    v_scale: float | tuple[float, ...] | None = None
    typed: bool = False  # 8-bit pages in a stacked typed pool (fp8 per tensor)
    cache_dtype: str | None = None  # the 8-bit dtype, if not the mode's usual one


CASES = (
    Case("decode_fused_f32"),
    Case("decode_fused_bf16_bits", dtype="bfloat16", pool_dtype="bits", q_heads=8),
    Case(
        "mixed_kv_window",
        layout="kv",
        reqs=((5, 12), (1, 20), (3, 3)),
        tile=4,
        window=5,
    ),
    Case(
        "mixed_kv_first_bf16_chunk",
        layout="kv_first",
        dtype="bfloat16",
        reqs=((6, 14), (1, 9)),
        tile=2,
        chunk=8,
    ),
    Case("decode_hnd_cap", layout="hnd", cap=2.0, kv_heads=1, q_heads=4),
    Case("mixed_cross", reqs=((4, 4), (1, 1)), tile=4, cross=True),
    Case(
        "mixed_kernel_blocks_window_cap",
        block=16,
        kernel_block=4,
        reqs=((7, 15), (1, 11), (2, 2)),
        tile=4,
        window=6,
        cap=3.0,
    ),
    Case("decode_mha_layer0", layout="kv", q_heads=2, layer=0),
    Case(
        "mixed_non_causal_request",
        reqs=((3, 10), (4, 4)),
        tile=4,
        non_causal=(1,),
    ),
    # seq_len runs past the table (cols * block = 16 keys): the rest is unseen.
    Case("decode_past_table", reqs=((1, 30), (1, 16)), cols=2),
    Case("mixed_empty_requests", reqs=((0, 5), (3, 7), (0, 0)), tile=2),
    Case("decode_gqa8", kv_heads=1, q_heads=8, head=32, window=4),
    # Waves of 2 pages: rows of 3, 1 and 3 waves, the last wave part-empty,
    # the next row's first wave started by the row before.
    Case("decode_waves_of_2", reqs=((1, 33), (1, 9), (1, 40)), pages=2),
    # seq_len past the table (5 pages of 8 = 40 keys) and a table width that
    # is not a multiple of the chunk (2 pages): the last chunk's second page
    # is past the table, its keys never seen.
    Case("decode_past_table_odd_chunks", reqs=((1, 50), (1, 44), (1, 7)), pages=2),
    # A window: rows start past their first page, mid-wave ends.
    Case(
        "mixed_kv_waves_window",
        layout="kv",
        dtype="bfloat16",
        reqs=((6, 37), (1, 12), (3, 25)),
        tile=4,
        window=11,
        pages=2,
    ),
    # Head dims, query heads per KV head and block sizes that are not powers
    # of two: the GPU kernel pads them by masked loads (issue 55).
    Case(
        "decode_head80_gqa5",
        dtype="bfloat16",
        kv_heads=2,
        q_heads=10,
        head=80,
        reqs=((1, 30), (1, 7), (1, 40)),
    ),
    Case(
        "mixed_kv_head96_block12_tile3",
        layout="kv",
        head=96,
        block=12,
        tile=3,
        reqs=((5, 20), (1, 31), (2, 2)),
        window=9,
    ),
    # float16 pages and prefill tiles of 16: 32 query rows per GPU program.
    Case(
        "mixed_f16_tile16",
        dtype="float16",
        block=16,
        tile=16,
        reqs=((21, 40), (1, 17), (16, 16)),
    ),
    # Blocks of 128: one page is two of the GPU kernel's 64-key steps.
    Case("decode_block128", block=128, cols=2, reqs=((1, 200), (1, 129), (1, 5))),
    # Head dims of 128 lanes: the TPU kernel picks each KV head's rows out of
    # token-major pages by strided loads of 32-bit words (two bf16 heads a
    # word; a fused page's K and V halves in buffers of their own), and waits
    # for a full wave at once.
    Case(
        "decode_fused_bf16_head128_strided",
        dtype="bfloat16",
        kv_heads=4,
        q_heads=8,
        head=128,
        reqs=((1, 20), (1, 9), (1, 3)),
        pages=2,
    ),
    Case(
        "mixed_kv_f32_bits_head128_strided",
        layout="kv",
        pool_dtype="bits",
        kv_heads=1,
        q_heads=2,
        head=128,
        reqs=((3, 10), (1, 17)),
        tile=2,
        pages=2,
    ),
    # One long request over a wide table: the GPU kernel splits its keys over
    # programs (split-KV) and merges their partial softmaxes.
    Case(
        "decode_one_long_request_split",
        block=64,
        cols=20,
        reqs=((1, 1250),),
        max_reqs=2,
        cap=4.0,
    ),
)


@dataclasses.dataclass
class Built:
    q: jax.Array
    pools: Any
    view: jaxkv.KVCacheView
    meta: Any
    kw: dict
    layer: jax.Array | None
    keys: list  # per request: (kv_len, kv_heads, head) float64, as stored
    values: list
    num_tokens: int


def build(case: Case, seed: int = 0) -> Built:
    rng = np.random.default_rng(seed)
    layout, order = _LAYOUTS[case.layout]
    backend = jaxkv.AttentionBackend(
        name=f"cases_{case.layout}_{case.kernel_block}",
        layout=layout,
        stride_order=order,
        supported_kernel_block_sizes=(case.kernel_block,)
        if case.kernel_block
        else (jaxkv.vllm.MultipleOf(1),),
    )
    quantized = case.quant != "none"
    words = quantized and not case.typed
    spec = jaxkv.FullAttentionSpec(
        block_size=case.block,
        num_kv_heads=case.kv_heads,
        head_size=case.head,
        dtype=case.cache_dtype or _QUANT_DTYPE.get(case.quant, case.dtype),
        kv_quant_mode=case.quant,
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(name=n, spec=spec, backend=backend) for n in ("a", "b")
        ]
    )
    plan = jaxkv.make_plan(
        cfg,
        num_blocks=24,
        storage="words" if words else "stacked",
        pool_dtype="auto" if quantized else case.pool_dtype,
    )
    view = plan.views["a"]
    scales = {"k_scale": case.k_scale, "v_scale": case.v_scale} if quantized else {}
    # Word pools hold one layer per view: no layer slot.
    slot_of = (lambda _: None) if words else jnp.int32
    assert isinstance(view, jaxkv.KVCacheView)
    kb = view.block_size
    pools = plan.allocate()
    dtype = jnp.dtype(case.dtype)
    heads, head = case.kv_heads, case.head
    n_slots = view.num_blocks * kb
    nan = jnp.full((n_slots, heads, head), jnp.nan, dtype)
    for slot in (0, 1):
        pools = jaxkv.write_kv(
            pools,
            view,
            nan,
            nan,
            jnp.arange(n_slots, dtype=jnp.int32),
            layer=slot_of(slot),
            **scales,
        )
    free = list(rng.permutation(np.arange(1, view.num_blocks)))
    tables = np.zeros((case.max_reqs, case.cols), np.int32)
    keys, values, enc_lens = [], [], []
    for r, (_, seq_len) in enumerate(case.reqs):
        tables[r] = [free.pop() for _ in range(case.cols)]
        enc = int(rng.integers(1, case.cols * kb)) if case.cross else 0
        enc_lens.append(enc)
        kv_len = enc if case.cross else min(seq_len, case.cols * kb)
        k = rng.standard_normal((kv_len, heads, head)).astype(dtype)
        v = rng.standard_normal((kv_len, heads, head)).astype(dtype)
        pos = np.arange(kv_len)
        slots = (tables[r][pos // kb] * kb + pos % kb).astype(np.int32)
        pools = jaxkv.write_kv(
            pools, view, k, v, slots, layer=slot_of(case.layer), **scales
        )
        keys.append(slots if quantized else np.asarray(k, np.float64))
        values.append(np.asarray(v, np.float64))
    if quantized:  # the oracle reads what was stored, dequantized
        every = stored(pools, view, case, layer=slot_of(case.layer))
        keys, values = [every[0][s] for s in keys], [every[1][s] for s in keys]
    q_lens = [q for q, _ in case.reqs]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    t_pad = num_tokens + case.pad_tokens
    q = rng.standard_normal((t_pad, case.q_heads, head)).astype(dtype)
    q[num_tokens:] = np.nan  # padding tokens' queries must not matter
    n = len(case.reqs)
    meta = jaxkv.CommonAttentionMetadata.empty(
        max_reqs=case.max_reqs, max_tokens=t_pad, max_blocks=case.cols
    )
    causal = np.ones(case.max_reqs, bool)
    causal[list(case.non_causal)] = False
    meta = dataclasses.replace(
        meta,
        query_start_loc=jnp.asarray(np.pad(qsl, (0, case.max_reqs - n), mode="edge")),
        seq_lens=jnp.asarray(
            np.pad([s for _, s in case.reqs], (0, case.max_reqs - n)).astype(np.int32)
        ),
        block_table_tensor=jnp.asarray(tables),
        num_reqs=jnp.int32(n),
        num_actual_tokens=jnp.int32(num_tokens),
        encoder_seq_lens=jnp.asarray(
            np.pad(enc_lens, (0, case.max_reqs - n)).astype(np.int32)
        ),
        request_causal=jnp.asarray(causal),
    )
    kw: dict[str, Any] = {"scale": 0.5, "query_tile": case.tile}
    kw.update({k: v for k, v in scales.items() if v is not None})
    if case.window is not None:
        kw["sliding_window"] = case.window
    if case.chunk is not None:
        kw["attention_chunk_size"] = case.chunk
    if case.cap is not None:
        kw["logits_soft_cap"] = case.cap
    if case.pages is not None:
        kw["pages_per_chunk"] = case.pages
    if case.cross:
        kw["cross_attention"] = True
    return Built(
        jnp.asarray(q),
        pools,
        view,
        meta,
        kw,
        slot_of(case.layer),
        keys,
        values,
        num_tokens,
    )


_QUANT_DTYPE = {
    "int8_per_token_head": "int8",
    "fp8_per_token_head": "float8_e4m3fn",
    "fp8_per_tensor": "float8_e4m3fn",
}


def stored(pools, view, case: Case, layer=None) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's K/V in a quantized view, dequantized (float64, by slot).

    `layer`: the layer slot of a stacked pool (``None``: the view's own).
    """
    from jaxkv.kv._quant import scale_view

    table = jnp.arange(view.num_blocks, dtype=jnp.int32)[None, :]

    def flat(x):
        x = np.asarray(x.astype(jnp.float32), np.float64)
        return x.reshape(view.num_blocks * view.block_size, *x.shape[3:])

    k, v = (flat(x) for x in jaxkv.gather_kv_pages(pools, view, table, layer=layer))
    if case.quant == "fp8_per_tensor":  # a scale per tensor, or per KV head

        def static(x):
            s = np.asarray(1.0 if x is None else x, np.float64)
            return s[:, None] if s.ndim else s

        return k * static(case.k_scale), v * static(case.v_scale)
    ks, vs = (flat(x) for x in jaxkv.gather_kv_pages(pools, scale_view(view), table))
    return k * ks, v * vs


#: fp8 pages with a static scale per KV head (vLLM's per-attention-head
#: scales): XLA's path reads them; the kernels refuse them by name.
PER_HEAD_CASE = Case(
    "mixed_fp8_per_head_scales_gqa",
    quant="fp8_per_tensor",
    typed=True,  # a pool the kernels read: they refuse the scales themselves
    kv_heads=2,
    q_heads=6,
    k_scale=(0.25, 2.0),
    v_scale=(4.0, 0.5),
    reqs=((5, 12), (1, 20), (3, 3)),
    tile=4,
)

QUANT_CASES = (
    Case("decode_int8_per_token_head", quant="int8_per_token_head", q_heads=8),
    Case(
        "mixed_fp8_per_token_head_kv_window",
        layout="kv",
        quant="fp8_per_token_head",
        reqs=((5, 12), (1, 20), (3, 3)),
        tile=4,
        window=5,
    ),
    Case(
        "decode_fp8_per_tensor_cap",
        quant="fp8_per_tensor",
        k_scale=0.5,
        v_scale=2.0,
        cap=3.0,
    ),
    Case(
        "mixed_fp8_per_tensor_typed_gqa_window",
        layout="kv",
        quant="fp8_per_tensor",
        typed=True,
        k_scale=0.25,
        v_scale=4.0,
        q_heads=8,
        reqs=((5, 12), (1, 20), (3, 3)),
        tile=4,
        window=5,
    ),
    Case(
        # Heads of 128 lanes, four a 32-bit word: the TPU kernel loads them
        # by stride and splits the bytes.
        "decode_fp8_per_tensor_typed_head128",
        quant="fp8_per_tensor",
        typed=True,
        k_scale=0.5,
        v_scale=2.0,
        kv_heads=4,
        q_heads=8,
        head=128,
    ),
    Case(
        # e5m2, 3 query heads a KV head and a head dim of 12: no vector path.
        "decode_fp8_e5m2_per_token_head_odd_dims",
        quant="fp8_per_token_head",
        cache_dtype="float8_e5m2",
        q_heads=6,
        head=12,
        block=4,
        cols=7,
        reqs=((1, 9), (1, 26), (1, 3)),
    ),
)
"""8-bit pages (issue 58): every kernel that reads them against the oracle of
what was stored."""


def run(built: Built, implementation: str | None) -> np.ndarray:
    @jax.jit
    def attend(q, pools, meta, layer):
        return jaxkv.paged_attention(
            q,
            pools,
            built.view,
            meta,
            layer=layer,
            implementation=implementation,
            **built.kw,
        )

    out = attend(built.q, built.pools, built.meta, built.layer)
    return np.asarray(out.astype(jnp.float32))


def dense(case: Case, built: Built) -> np.ndarray:
    """The dense NumPy oracle of the case (float64)."""
    q = np.asarray(built.q.astype(jnp.float32), np.float64)
    out = np.zeros((q.shape[0], case.q_heads, case.head))
    groups = case.q_heads // case.kv_heads
    qsl = np.concatenate([[0], np.cumsum([ql for ql, _ in case.reqs])])
    limit = case.cols * built.view.block_size
    for r, (q_len, seq_len) in enumerate(case.reqs):
        keys, values = built.keys[r], built.values[r]
        kv_len = keys.shape[0]
        for i in range(q_len):
            t = qsl[r] + i
            p = seq_len - q_len + i
            j = np.arange(kv_len)
            ok = j < limit
            if not case.cross:
                if r not in case.non_causal:
                    ok &= j <= p
                if case.window is not None:
                    ok &= j > p - case.window
                if case.chunk is not None:
                    ok &= j // case.chunk == p // case.chunk
            if not ok.any():
                continue
            for h in range(case.q_heads):
                s = keys[:, h // groups] @ q[t, h] * 0.5
                if case.cap is not None:
                    s = case.cap * np.tanh(s / case.cap)
                s = np.where(ok, s, -np.inf)
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ values[:, h // groups]
    return out
