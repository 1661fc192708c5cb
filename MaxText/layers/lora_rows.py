"""Per-row LoRA adapters: each batch row adds its own adapter's x · A[i] · B[i] to a projection.

Serving many adapters beside one base model (inference/lora_adapters.py) stores, in each adapted
`DenseGeneral`, a table of adapters instead of one: lora_a [N, in dims..., r] and lora_b
[N, r, out dims...] (the adapter's scale already folded into lora_b, row 0 all zeros: no adapter).
`use_rows(adapter_B)` around a model call (a context variable read at trace time, like
quantization.use_quantization) names each batch row's table row; the layer calls `delta`. Outside
such a block a table adds nothing: the base model.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

_ROWS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("maxtext_lora_rows", default=None)


@contextlib.contextmanager
def use_rows(adapter_B: jax.Array | None) -> Iterator[None]:
  """Adapter tables traced inside this block add row b's adapter adapter_B[b] (int32 [B]; None: none)."""
  token = _ROWS.set(adapter_B)
  try:
    yield
  finally:
    _ROWS.reset(token)


def is_table(lora_a: jax.Array, num_in: int) -> bool:
  """Whether a layer's lora_a is a table of adapters (a leading adapter dim) rather than one adapter."""
  return lora_a.ndim == num_in + 2


def delta(x: jax.Array, lora_a_N: jax.Array, lora_b_N: jax.Array, num_in: int, dtype: jnp.dtype) -> jax.Array | None:
  """Each row's x · A[row's adapter] · B[row's adapter] ([B, ..., out dims]), or None outside `use_rows`.
  The rows' adapters are gathered first, so one pair of batched matmuls serves a mixed batch."""
  adapter_B = _ROWS.get()
  if adapter_B is None:
    return None
  if x.shape[0] != adapter_B.shape[0]:
    raise ValueError(f"per-row LoRA adapters: {adapter_B.shape[0]} adapter ids for a batch of {x.shape[0]} rows")
  a_B = jnp.take(lora_a_N, adapter_B, axis=0).astype(dtype)  # [B, in dims..., r]
  b_B = jnp.take(lora_b_N, adapter_B, axis=0).astype(dtype)  # [B, r, out dims...]
  x_contract = tuple(range(x.ndim - num_in, x.ndim))
  x_r = jax.lax.dot_general(x.astype(dtype), a_B, ((x_contract, tuple(range(1, num_in + 1))), ((0,), (0,))))
  return jax.lax.dot_general(x_r, b_B, (((x_r.ndim - 1,), (1,)), ((0,), (0,))))
