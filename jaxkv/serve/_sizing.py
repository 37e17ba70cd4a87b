"""A serving loop's KV cache sized from memory, its compiled programs deciding.

:func:`size_loop_kv_cache` is :func:`jaxkv.size_kv_cache` with the loop's own
programs as the step: at each probe size it builds your loop for that plan,
warms it up (every bucket compiled, and every multi-step decode program) and
takes the largest program's bytes per device, so the largest bucket decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxkv.config import RunnerConfig
from jaxkv.plan import KVCachePlan, KVCacheSizing, size_kv_cache, step_bytes
from jaxkv.serve._loop import ServingLoop


def size_loop_kv_cache(
    runner_config: RunnerConfig,
    make_loop: Callable[[KVCachePlan], ServingLoop],
    **sizing: Any,
) -> KVCacheSizing:
    """The largest ``num_blocks`` whose serving loop fits a memory budget.

    Args:
      runner_config: The model's runner config.
      make_loop: ``make_loop(plan)`` builds your :class:`ServingLoop` for
        `plan` (its forward reads that plan's layers); it is built and warmed
        up at each probe size, then dropped.
      sizing: As :func:`jaxkv.size_kv_cache` takes them (``memory_bytes=``,
        ``memory_fraction=``, ``probe_blocks=``, make_plan's options).

    Returns:
      The :class:`KVCacheSizing`; build the serving loop with
      ``make_loop(make_plan(runner_config, num_blocks=sizing.num_blocks))``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.pattern_config("G", num_layers=1, num_heads=1,
      ...     num_kv_heads=1, head_size=8, max_model_len=64, max_num_seqs=2,
      ...     max_num_batched_tokens=16, token_buckets=(16,))
      >>> def make_loop(plan):
      ...     layer = plan.attention_layer("layers.0.self_attn")
      ...     def forward(params, pools, meta, tokens, sample):
      ...         x, m = params[tokens], meta[layer.name]
      ...         pools = jaxkv.write_kv(pools, layer, x[:, None], x[:, None], m)
      ...         out = jaxkv.paged_attention(x[:, None], pools, layer, m, scale=1.0)
      ...         return pools, out[sample, 0] @ params.T
      ...     return jaxkv.ServingLoop(plan, forward, jnp.eye(8), vocab_size=8)
      >>> s = jaxkv.serve.size_loop_kv_cache(cfg, make_loop, memory_bytes=2**20)
      >>> s.num_blocks > 100, s.step_bytes <= 2**20
      (True, True)
    """

    def compile_step(plan: KVCachePlan) -> int:
        loop = make_loop(plan)
        loop.warm_up()
        programs = [*loop.programs.executables(), *loop.decode_programs.executables()]
        return max(step_bytes(exe) for exe in programs)

    return size_kv_cache(runner_config, compile_step, **sizing)
