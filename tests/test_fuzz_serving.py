"""Random serving sequences never touch a byte they do not address.

Each case is a random sequence of operations on a live hybrid cache (requests
growing by random chunks with K/V and Mamba states written, prefix-cache hits,
blocks zeroed when handed out, requests finished or preempted), continuing
from the previous case. After every case the pools equal, byte for byte, a
NumPy oracle that applied the same writes, and the block manager's books
balance (every hold accounted for, no block in two groups at once).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.oracle import Oracle

CASES_PER_CONFIG = 400  # three configs: 1200 cases per run
N = 16  # tokens per write, padded with -1


def _config(dtype: str = "float32") -> Any:
    return jaxkv.tiny_hybrid_config(
        block_size=16,
        head_size=8,
        num_heads=2,
        num_kv_heads=1,
        sliding_window=32,
        dtype=dtype,
        max_model_len=256,
    )


def _configs() -> dict[str, tuple[Any, dict[str, Any]]]:
    return {
        "hybrid": (_config(), {}),
        "hybrid-packed": (_config(), {"packed": True}),
        "hybrid-bf16": (_config("bfloat16"), {}),  # attention blocks of 48
    }


class Harness:
    def __init__(self, cfg: Any, plan_kw: dict[str, Any], seed: int):
        self.plan = jaxkv.make_plan(cfg, num_blocks=48, **plan_kw)
        self.manager = jaxkv.KVCacheManager(self.plan, enable_prefix_caching=True)
        self.pools = self.plan.allocate()
        self.oracle = Oracle(
            self.plan.kv_cache_config,
            cfg,
            self.plan.kernel_block_sizes,
            self.plan.attn_groups,
        )
        self.rng = np.random.default_rng(seed)
        groups = self.plan.kv_cache_config.kv_cache_groups
        shared = {
            layer.name for layer in cfg.layers if layer.kv_sharing_target is not None
        }
        # Layers that write: one per view (KV-sharing readers write nothing).
        self.writers = [
            (name, g)
            for g, group in enumerate(groups)
            for name in group.layer_names
            if name not in shared and name in self.plan.views
        ]
        self.live: list[jaxkv.Request] = []
        self.prompts: list[list[int]] = []
        self.count = 0
        self.hits = 0  # tokens taken from the prefix cache
        self.finished_prompt: list[int] | None = None
        self.write = jax.jit(self._write_all, donate_argnums=0)
        self.zero = jax.jit(self._zero_all, donate_argnums=0)

    # One executable per config: every layer written at fixed shapes.
    def _write_all(self, pools, keys, slots, mamba_ids, states):
        for i, (name, g) in enumerate(self.writers):
            view = self.plan.views[name]
            if isinstance(view, jaxkv.MambaView):
                pools = jaxkv.write_mamba_state(pools, view, mamba_ids, states[i])
            else:
                pools = jaxkv.write_kv(pools, view, keys[i], keys[i] + 1, slots[g])
        return pools

    def _zero_all(self, pools, ids):
        views = [self.plan.views[n] for n, _ in self.writers]
        return jaxkv.zero_blocks(pools, views, ids)

    def _inputs(self, batch_blocks, n):
        keys, states = [], []
        for name, _ in self.writers:
            view = self.plan.views[name]
            if isinstance(view, jaxkv.MambaView):
                keys.append(jnp.zeros((N, 1, 8), view.states[0].dtype))
                states.append(
                    [
                        self.rng.integers(-8, 9, (1, *s.shape[1:])).astype(s.dtype)
                        for s in view.states
                    ]
                )
            else:
                heads = view.shape[view.dim("head")]
                dim = view.head_size or view.shape[-1]
                keys.append(
                    self.rng.integers(-8, 9, (N, heads, dim)).astype(view.dtype)
                )
                states.append(None)
        slots = []
        for s in batch_blocks.slot_mappings:
            padded = np.full(N, -1, np.int32)
            padded[:n] = s
            slots.append(padded)
        return keys, slots, states

    def _balance(self):
        held: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for req in self.live:
            for g, table in enumerate(self.manager.blocks_of(req)):
                for b in table:
                    if b:
                        held[b] = held.get(b, 0) + 1
                        assert group_of.setdefault(b, g) == g, (b, g, group_of[b])
        a = self.manager.allocator
        for b in range(1, a.num_blocks):
            assert a.ref_count(b) == held.get(b, 0), (b, a.ref_count(b), held.get(b))
        assert a.num_free + len(held) == a.num_blocks - 1

    def grow(self):
        fresh = not self.live or self.rng.random() < 0.35
        if fresh:
            if self.finished_prompt is not None:  # reuse a freed (cached) prefix
                base, self.finished_prompt = self.finished_prompt, None
                cut = int(self.rng.integers(1, len(base) + 1))
                prompt = base[:cut] + self.rng.integers(0, 50, 20).tolist()
            elif self.prompts and self.rng.random() < 0.7:  # share a prefix
                # A recent prompt: its blocks are more likely still cached.
                recent = self.prompts[-8:]
                base = recent[int(self.rng.integers(len(recent)))]
                cut = int(self.rng.integers(1, len(base) + 1))
                prompt = base[:cut] + self.rng.integers(0, 50, 20).tolist()
            else:
                prompt = self.rng.integers(
                    0, 50, int(self.rng.integers(10, 100))
                ).tolist()
            req = jaxkv.Request(f"r{self.count}", prompt=prompt, max_new_tokens=1)
            self.count += 1
            hit = self.manager.find_cache_hit(req)
            self.hits += hit
        else:
            req = self.live[int(self.rng.integers(len(self.live)))]
            hit = 0
        start = hit or req.num_computed
        left = len(req.tokens) - start
        if left == 0:
            return
        n = int(self.rng.integers(1, min(N, left) + 1))
        bs = math.lcm(*self.manager.block_sizes)
        if self.rng.random() < 0.5:  # end on a boundary of every group's blocks
            n = min(left, N, bs - start % bs)  # (as the scheduler's chunks do)
        before = set(self._held())
        while not self.manager.allocate(req, n, num_cached=hit):
            victims = [r for r in self.live if r is not req]
            if not victims:
                return
            self.finish(victims[-1])  # preempt the newest other request
            before = set(self._held())
        if fresh:
            self.live.append(req)
            self.prompts.append(req.prompt)
        new = sorted(set(self._held()) - before)
        # Zero blocks as they are handed out (not those a prefix hit reuses).
        if new and not hit and self.rng.random() < 0.7:
            ids = np.full(N, -1, np.int32)
            ids[: min(N, len(new))] = new[:N]
            self.pools = self.zero(self.pools, jnp.asarray(ids))
            self.oracle.zero_blocks([w for w, _ in self.writers], ids[ids >= 0])
        blocks = self.manager.step_blocks([(req, n)])
        keys, slots, states = self._inputs(blocks, n)
        g = self.manager.is_mamba.index(True)
        col = (req.num_computed + n - 1) // self.manager.block_sizes[g]
        mamba_id = int(blocks.block_tables[g][0, col])
        ids = np.array([mamba_id], np.int32)
        dummy = [s if s is not None else [] for s in states]
        self.pools = self.write(
            self.pools, [jnp.asarray(k) for k in keys], slots, jnp.asarray(ids), dummy
        )
        for i, (name, g) in enumerate(self.writers):
            if states[i] is not None:
                self.oracle.write_mamba(name, ids, states[i])
            else:
                self.oracle.write_kv(name, keys[i], keys[i] + 1, slots[g])
        req.num_computed += n
        self.manager.commit(req)

    def _held(self):
        return [b for r in self.live for t in self.manager.blocks_of(r) for b in t if b]

    def finish(self, req):
        self.manager.free(req)
        req.num_computed = 0
        self.live.remove(req)

    def case(self):
        for _ in range(int(self.rng.integers(2, 6))):
            if self.live and self.rng.random() < 0.1:
                req = self.live[int(self.rng.integers(len(self.live)))]
                self.finish(req)
                if self.rng.random() < 0.5:
                    self.finished_prompt = req.prompt
            else:
                self.grow()
        self._balance()


@pytest.mark.parametrize(("seed", "name"), list(enumerate(_configs())))
def test_random_serving_sequences_touch_only_addressed_bytes(seed, name):
    cfg, plan_kw = _configs()[name]
    h = Harness(cfg, plan_kw, seed=seed)
    for i in range(CASES_PER_CONFIG):
        h.case()
        for got, want in zip(h.pools, h.oracle.buffers, strict=True):
            got_bytes = np.asarray(got).view(np.uint8)
            assert np.array_equal(got_bytes, want), f"{name}: case {i}"
    assert h.count > 20  # requests came and went
    assert h.hits > 0, "the prefix cache was never hit"
