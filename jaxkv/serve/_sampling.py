"""Token sampling inside the step, seeded per request and position.

Token sampling inside the step: greedy, or temperature with top-k / top-p,
seeded per request and position so a request samples the same tokens however
it is batched, preempted or resumed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxkv._util import checks_own_arguments, is_int


def _real(x: object) -> bool:
    """A real number by value (NumPy scalars included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


@checks_own_arguments  # by value: NumPy scalars are numbers, named errors
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from the logits (static: part of the program).

    Attributes:
      temperature: ``0`` for greedy (argmax); otherwise logits are divided by
        it before sampling.
      top_k: Keep the `top_k` most likely tokens (``0``: all).
      top_p: Keep the smallest set of most likely tokens whose probability
        reaches `top_p` (``1.0``: all).
      seed: The run's seed; each sampled token's key folds in its request's
        seed (:func:`request_seed`) and its position.

    Example:
      >>> import jaxkv
      >>> jaxkv.SamplingParams(temperature=0.7, top_k=40).greedy
      False
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Checked by value, not by Python type: a NumPy scalar is a number,
        # infinity and NaN are not temperatures.
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _real(t) or not (math.isfinite(t) and t >= 0):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0, got {t!r}."
            )
        if not is_int(k) or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0, got {k!r}.")
        if not _real(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}.")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))
        if not is_int(self.seed) or not 0 <= self.seed < 2**31:
            raise ValueError(
                f"SamplingParams.seed must be an int in [0, 2**31), got {self.seed!r}."
            )
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0)."""
        return self.temperature == 0


def request_seed(req_id: str) -> int:
    """A request's sampling seed: a stable hash of its id (CRC-32, 31 bits).

    Example:
      >>> import jaxkv
      >>> jaxkv.serve.request_seed("r0") == jaxkv.serve.request_seed("r0")
      True
    """
    return zlib.crc32(str(req_id).encode()) & 0x7FFFFFFF


def sample_tokens(
    logits: Float[Array, "n vocab"],
    *,
    params: SamplingParams,
    request_seeds: Int[Array, " n"],
    positions: Int[Array, " n"],
) -> Int[Array, " n"]:
    """One token per row of `logits` (jittable).

    Row ``i``'s key is ``fold_in(fold_in(key(seed), request_seeds[i]),
    positions[i])``: the same request at the same position draws the same
    token in any batch.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
      >>> jaxkv.sample_tokens(logits, params=jaxkv.SamplingParams(),
      ...     request_seeds=jnp.array([1, 2]), positions=jnp.array([7, 3])).tolist()
      [1, 0]
    """
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / jnp.float32(params.temperature)
    vocab = x.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = jax.lax.top_k(x, params.top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if params.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
        # A token stays if the probability of the tokens ranked before it is
        # below top_p (the most likely token always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < jnp.float32(params.top_p)
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(x.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        x = jnp.where(keep, x, -jnp.inf)
    base = jax.random.key(params.seed)

    def draw(row: Array, rseed: Array, pos: Array) -> Array:
        key = jax.random.fold_in(jax.random.fold_in(base, rseed), pos)
        return jax.random.categorical(key, row)

    return jax.vmap(draw)(x, request_seeds, positions).astype(jnp.int32)


def sample_tokens_per_row(
    logits: Float[Array, "n vocab"],
    *,
    temperature: Float[Array, " n"],
    top_k: Int[Array, " n"],
    top_p: Float[Array, " n"],
    seed: Int[Array, " n"],
    request_seeds: Int[Array, " n"],
    positions: Int[Array, " n"],
) -> Int[Array, " n"]:
    """:func:`sample_tokens` with each row's own parameters.

    As traced arrays (one compiled program serves any mix): row ``i`` draws as
    ``sample_tokens`` with ``SamplingParams(temperature[i], top_k[i], top_p[i],
    seed[i])`` would, the same token (checked in the tests).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
      >>> jaxkv.sample_tokens_per_row(logits, temperature=jnp.array([0.0, 1.0]),
      ...     top_k=jnp.array([0, 1]), top_p=jnp.array([1.0, 1.0]),
      ...     seed=jnp.array([0, 0]), request_seeds=jnp.array([1, 2]),
      ...     positions=jnp.array([7, 3])).tolist()  # greedy; top-1
      [1, 0]
    """
    x = logits.astype(jnp.float32)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    vocab = x.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    x = x / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # top-k: the k-th largest value of each row (k = 0 or >= vocab: none).
    k = jnp.asarray(top_k, jnp.int32)
    sorted_x = -jnp.sort(-x, axis=-1)
    kth = jnp.take_along_axis(sorted_x, jnp.clip(k - 1, 0, vocab - 1)[:, None], -1)
    x = jnp.where((k[:, None] > 0) & (k[:, None] < vocab) & (x < kth), -jnp.inf, x)
    # top-p over the top-k survivors, ranked as sample_tokens ranks them.
    p = jnp.asarray(top_p, jnp.float32)[:, None]
    order = jnp.argsort(-x, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (before < p) | (p >= 1.0)
    keep = (
        jnp.zeros_like(keep_sorted)
        .at[jnp.arange(x.shape[0])[:, None], order]
        .set(keep_sorted)
    )
    x = jnp.where(keep, x, -jnp.inf)

    def draw(row: Array, s: Array, rseed: Array, pos: Array) -> Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), rseed), pos)
        return jax.random.categorical(key, row)

    drawn = jax.vmap(draw)(x, jnp.asarray(seed), request_seeds, positions)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def sampling_rows(
    sampled: list[list[str]],
    num_samples: int,
    *,
    per_request: bool,
    default: SamplingParams,
    overrides: Mapping[str, SamplingParams],
) -> Any:
    """A step's sampling inputs, ``(ranks, num_samples)`` per field.

    Args:
      sampled: Per rank, the request id of each sampled row, in row order.
      num_samples: Rows per rank (the bucket's; padding rows are greedy).
      per_request: Whether each request samples with its own parameters.
      default: The parameters of requests without their own.
      overrides: Per request id, its own parameters.

    Returns:
      The rows' request seeds (int32), or with `per_request` a dict of
      ``request``, ``seed``, ``top_k`` (int32), ``temperature``, ``top_p``
      (float32) for :func:`sample_rows`.

    Example:
      >>> import jaxkv
      >>> from jaxkv.serve._sampling import sampling_rows
      >>> rows = sampling_rows([["a"]], 2, per_request=True,
      ...     default=jaxkv.SamplingParams(),
      ...     overrides={"a": jaxkv.SamplingParams(temperature=0.5, seed=7)})
      >>> rows["seed"].tolist(), rows["temperature"].tolist()
      ([[7, 0]], [[0.5, 0.0]])
    """
    shape = (len(sampled), num_samples)
    seeds = np.zeros(shape, np.int32)
    for rank, ids in enumerate(sampled):
        seeds[rank, : len(ids)] = [request_seed(i) for i in ids]
    if not per_request:
        return seeds
    out = {
        "request": seeds,
        "seed": np.zeros(shape, np.int32),
        "top_k": np.zeros(shape, np.int32),
        "temperature": np.zeros(shape, np.float32),
        "top_p": np.ones(shape, np.float32),
    }
    for rank, ids in enumerate(sampled):
        for k, req_id in enumerate(ids):
            p = overrides.get(req_id, default)
            out["seed"][rank, k] = p.seed
            out["top_k"][rank, k] = p.top_k
            out["temperature"][rank, k] = p.temperature
            out["top_p"][rank, k] = p.top_p
    return out


def abstract_sampling_rows(
    shape: tuple[int, ...], sharding: Any, *, per_request: bool
) -> Any:
    """The shapes and dtypes of :func:`sampling_rows`, for warm-up."""
    ints = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    if not per_request:
        return ints
    floats = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
    return {
        "request": ints,
        "seed": ints,
        "top_k": ints,
        "temperature": floats,
        "top_p": floats,
    }


def sample_rows(
    logits: jax.Array,
    rows: Any,
    *,
    per_request: bool,
    default: SamplingParams,
    positions: jax.Array,
) -> jax.Array:
    """One token per logits row, from one rank's :func:`sampling_rows`."""
    if per_request:
        return sample_tokens_per_row(
            logits,
            temperature=rows["temperature"],
            top_k=rows["top_k"],
            top_p=rows["top_p"],
            seed=rows["seed"],
            request_seeds=rows["request"],
            positions=positions,
        )
    return sample_tokens(
        logits, params=default, request_seeds=rows, positions=positions
    )
