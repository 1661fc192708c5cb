"""Next-token selection from logits: greedy, weighted (temperature), nucleus (top-p) and top-k.

Shape legend: B batch (decode slots), V vocabulary.

Every strategy is a pure function of (logits, key), so a fixed seed gives the same tokens, and
`sample` is jit-friendly with the strategy static and the knobs traced or static alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  strategy: str = "greedy"  # one of STRATEGIES
  temperature: float = 1.0  # logits are divided by this before weighted / nucleus / top-k sampling
  nucleus_p: float = 0.9  # nucleus: smallest set of tokens whose probability mass reaches this
  top_k: int = 40  # topk: sample among the k most probable tokens


def greedy(logits_BV: jax.Array) -> jax.Array:
  return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def weighted(logits_BV: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
  return jax.random.categorical(key, logits_BV.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def nucleus(logits_BV: jax.Array, key: jax.Array, nucleus_p: float, temperature: float) -> jax.Array:
  """Samples among the most probable tokens whose cumulative probability first reaches `nucleus_p`
  (the token that crosses the threshold is kept, so at least one token always survives)."""
  scaled_BV = logits_BV.astype(jnp.float32) / temperature
  sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
  cumulative_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
  # Mass strictly before each sorted token; a token is kept while that mass is below p.
  before_BV = cumulative_BV - jax.nn.softmax(sorted_BV, axis=-1)
  num_kept_B = jnp.sum(before_BV < nucleus_p, axis=-1)
  threshold_B1 = jnp.take_along_axis(sorted_BV, (num_kept_B - 1)[:, None], axis=-1)
  masked_BV = jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)
  return jax.random.categorical(key, masked_BV, axis=-1).astype(jnp.int32)


def top_k(logits_BV: jax.Array, key: jax.Array, k: int, temperature: float) -> jax.Array:
  """Samples among the k highest logits (k static)."""
  values_Bk, indices_Bk = jax.lax.top_k(logits_BV.astype(jnp.float32) / temperature, k)
  choice_B = jax.random.categorical(key, values_Bk, axis=-1)
  return jnp.take_along_axis(indices_Bk, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits_BV: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Next token ids [B] int32 under `params` (a hashable dataclass: pass it as a static argument)."""
  if params.strategy == "greedy":
    return greedy(logits_BV)
  if params.strategy == "weighted":
    return weighted(logits_BV, key, params.temperature)
  if params.strategy == "nucleus":
    return nucleus(logits_BV, key, params.nucleus_p, params.temperature)
  if params.strategy == "topk":
    return top_k(logits_BV, key, params.top_k, params.temperature)
  raise ValueError(f"unknown sampling strategy {params.strategy!r}; expected one of {', '.join(STRATEGIES)}")
