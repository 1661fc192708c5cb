"""Token embedding and rotary position embedding (RoPE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Module):
  """Token table [V, D]; `attend` reuses it as the output projection (tied embeddings)."""

  def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
    table = nnx.initializers.normal(stddev=1.0)(rngs.params(), (vocab_size, dim), weight_dtype)
    self.embedding = nnx.Param(table, out_sharding=("vocab", "embed"))
    self.dtype = dtype

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_BL, axis=0).astype(self.dtype)

  def attend(self, x_BLD: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.einsum("bld,vd->blv", x_BLD.astype(dtype), self.embedding[...].astype(dtype))


def apply_rope(x_BLNH: jax.Array, positions_BL: jax.Array, min_timescale: float, max_timescale: float) -> jax.Array:
  """Rotates the two halves of each head by position-dependent angles.

  Frequency i of H/2 has wavelength min * (max/min)**(2i/H); the halves-split
  layout is the one Hugging Face Llama checkpoints use.
  """
  head_dim = x_BLNH.shape[-1]
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  timescale = min_timescale * (max_timescale / min_timescale) ** fraction
  angles_BLh = positions_BL[..., None].astype(jnp.float32) / timescale
  sin, cos = jnp.sin(angles_BLh)[:, :, None, :], jnp.cos(angles_BLh)[:, :, None, :]
  first, second = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x_BLNH.dtype)
