"""RMSNorm (plain or with a 1 + scale gain) and LayerNorm, computed in float32 whatever the activation dtype.

`make_norm(cfg)` picks the one `normalization_type` names, so a decoder layer never
switches on the family.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.configuration.model_config import ModelConfig


def _over_last_axis(v_D: jax.Array, ndim: int) -> jax.Array:
  """[D] -> [1, ..., 1, D] of rank `ndim`: explicit broadcasting (tests raise on rank promotion)."""
  return jnp.expand_dims(v_D, tuple(range(ndim - 1)))


class RMSNorm(nnx.Module):
  """x / rms(x) * gain, with gain = scale, or 1 + scale when `scale_offset` is 1.

  The offset form (Gemma) stores the gain's distance from 1, so a zero-initialised
  scale is the identity; keeping HF's parameterisation makes conversion a copy.
  """

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype,
               scale_offset: float = 0.0):
    init = jnp.zeros if scale_offset else jnp.ones
    self.scale = nnx.Param(init((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype, self.scale_offset = epsilon, dtype, scale_offset

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
    gain_D = self.scale[...].astype(jnp.float32) + self.scale_offset
    return (normed * _over_last_axis(gain_D, x.ndim)).astype(self.dtype)


class LayerNorm(nnx.Module):
  """(x - mean) / std * scale + bias (GPT-3)."""

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
    self.bias = nnx.Param(jnp.zeros((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.epsilon)
    scale, bias = (_over_last_axis(p[...].astype(jnp.float32), x.ndim) for p in (self.scale, self.bias))
    return (normed * scale + bias).astype(self.dtype)


def make_norm(cfg: ModelConfig) -> nnx.Module:
  """The normalization `cfg.normalization_type` names, over emb_dim."""
  common: dict[str, Any] = dict(epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
                weight_dtype=jnp.dtype(cfg.weight_dtype))
  if cfg.normalization_type == "layer":
    return LayerNorm(cfg.emb_dim, **common)
  return RMSNorm(cfg.emb_dim, scale_offset=1.0 if cfg.normalization_type == "rms_plus_one" else 0.0, **common)
