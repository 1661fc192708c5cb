"""A batch split into gradient-accumulation micro-batches and back: micro-batch m holds rows m, m + n,
m + 2n, ... (every n-th row), so under batch sharding each device keeps its own rows and nothing moves."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def split(batch: Any, num_micro: int) -> Any:
  """Each leaf [B, ...] → [num_micro, B / num_micro, ...]."""
  def one(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:]), 0, 1)
  return jax.tree.map(one, batch)


def join(micro: Any) -> Any:
  """`split`'s inverse: each leaf [num_micro, B / num_micro, ...] → [B, ...] in the batch's row order."""
  def one(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
  return jax.tree.map(one, micro)


def map_rows(fn: Any, batch: Any, num_micro: int) -> Any:
  """fn(batch) for a fn whose outputs are per row ([B, ...]), run one micro-batch at a time (a forward
  pass that must fit where the step's micro-batches do), its outputs in the batch's row order."""
  if num_micro == 1:
    return fn(batch)
  _, out = jax.lax.scan(lambda carry, micro: (carry, fn(micro)), None, split(batch, num_micro))
  return join(out)
