"""Token and learned position tables, rotary position embedding (RoPE) and sinusoidal positions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.configuration.model_config import RopeConfig


class Embed(nnx.Module):
  """Token table [V, D]; `attend` reuses it as the output projection (tied embeddings).

  `stddev`: the initial rows' scale. A tied table is also the output projection, where rows of
  norm ~sqrt(D) against the final norm's unit-RMS activations would start the logits at std
  sqrt(D) and the loss in the hundreds; the model passes 1/sqrt(D) for it.

  Also the learned position table [max_position_embeddings, D] (GPT-3), with `names`
  (None, "embed") since its rows are positions, not vocabulary.
  """

  def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs,
               names: tuple[str | None, str] = ("vocab", "embed"), stddev: float = 1.0, one_hot: bool = False):
    table = nnx.initializers.normal(stddev=stddev)(rngs.params(), (vocab_size, dim), weight_dtype)
    self.embedding = nnx.Param(table, out_sharding=names)
    self.dtype = dtype
    self.one_hot = one_hot

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    """The tokens' rows; `one_hot` (use_iota_embed): as a matmul of one-hot rows with the table, which
    the partitioner shards like any matmul over a vocabulary-sharded table, where a gather from it is
    often partitioned by gathering the table first. Each output sums one row times 1 and zeros, so both
    give the same values;
    the table's gradient comes out of the transposed matmul in the activation dtype (in bfloat16 rounded
    once, where the gather's adds up in the table's float32)."""
    if not self.one_hot:
      return jnp.take(self.embedding[...], tokens_BL, axis=0).astype(self.dtype)
    table_VD = self.embedding[...].astype(self.dtype)
    vocab_V = jax.lax.iota(tokens_BL.dtype, table_VD.shape[0])
    one_hot_BLV = (tokens_BL[..., None] == vocab_V[None, None, :]).astype(self.dtype)
    return jnp.einsum("blv,vd->bld", one_hot_BLV, table_VD, precision=jax.lax.Precision.HIGHEST)

  def attend(self, x_BLD: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.einsum("bld,vd->blv", x_BLD.astype(dtype), self.embedding[...].astype(dtype))


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int, local: bool = False) -> np.ndarray:
  """[H/2] float32 angular frequency of each rotated pair: 1 / (min * (max/min)**(2i/H)).

  `local`: for a local (sliding-window) layer, which with rope_local_max_timescale > 0 uses that
  base and no scaling (Gemma 3). rope_type=linear divides every frequency by `factor`;
  rope_type=proportional (Gemma 4) keeps the first rope_proportional_rotated_fraction of the pairs' frequencies and
  sets the rest to 0 (unrotated), then divides by `factor`.

  With rope_type=llama3 (Llama 3.1) the long wavelengths are stretched for longer contexts:
  wavelengths above original_max / low_freq_factor are divided by `factor` in frequency,
  those below original_max / high_freq_factor are kept, and those between are blended
  linearly in original_max / wavelength.

  `head_dim`: the rotated width (MLA rotates qk_rope_head_dim features).
  """
  local = local and rope.rope_local_max_timescale > 0
  max_timescale = rope.rope_local_max_timescale if local else rope.rope_max_timescale
  fraction = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  timescale = np.float32(rope.rope_min_timescale) * (np.float32(max_timescale / rope.rope_min_timescale) ** fraction)
  inv_freq = (np.float32(1.0) / timescale).astype(np.float32)
  if local or rope.rope_type == "default":
    return inv_freq
  if rope.rope_type == "linear":
    return (inv_freq / np.float32(rope.rope_scaling_factor)).astype(np.float32)
  if rope.rope_type == "proportional":  # Gemma 4: the first pairs turn, the rest stay put (frequency 0)
    rotated = int(rope.rope_proportional_rotated_fraction * head_dim // 2)
    kept = np.where(np.arange(head_dim // 2) < rotated, inv_freq, np.float32(0.0))
    return (kept / np.float32(rope.rope_scaling_factor)).astype(np.float32)
  if rope.rope_type == "yarn":
    return _yarn_frequencies(rope, inv_freq, max_timescale, head_dim)
  factor, low, high = rope.rope_scaling_factor, rope.rope_low_freq_factor, rope.rope_high_freq_factor
  original = rope.rope_original_max_position
  wavelength = 2 * np.pi / inv_freq
  blend = (original / wavelength - low) / (high - low)
  blended = (1 - blend) * inv_freq / factor + blend * inv_freq
  scaled = np.where(wavelength > original / low, inv_freq / factor, np.where(
      wavelength < original / high, inv_freq, blended))
  return scaled.astype(np.float32)


def _yarn_frequencies(rope: RopeConfig, inv_freq: np.ndarray, base: float, head_dim: int) -> np.ndarray:
  """YaRN (Peng et al. 2023): dimension d makes original_max / wavelength_d turns over the
  pre-training context. Dimensions making more than beta_fast turns keep their frequency, those
  making fewer than beta_slow are divided by `factor`, and a linear ramp over the dimension index
  blends the two in between (its bounds rounded outwards unless rope_yarn_truncate is False)."""
  original = rope.rope_original_max_position

  def dimension_at(turns: float) -> float:  # the (fractional) dimension making `turns` turns
    return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

  low, high = dimension_at(rope.rope_yarn_beta_fast), dimension_at(rope.rope_yarn_beta_slow)
  if rope.rope_yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # a one-point ramp
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate (divide by factor)
  return (inv_freq / np.float32(rope.rope_scaling_factor) * (1 - keep) + inv_freq * keep).astype(np.float32)


def rope_attention_scale(rope: RopeConfig, local: bool = False) -> float:
  """What the rotated queries and keys are multiplied by: YaRN's attention factor (given, or
  0.1 ln(factor) + 1), 1 otherwise and on local layers with their own RoPE."""
  if rope.rope_type != "yarn" or (local and rope.rope_local_max_timescale > 0):
    return 1.0
  if rope.rope_attention_factor > 0:
    return rope.rope_attention_factor
  return 0.1 * math.log(rope.rope_scaling_factor) + 1.0 if rope.rope_scaling_factor > 1 else 1.0


def rope_softmax_scale(rope: RopeConfig) -> float:
  """DeepSeek's YaRN correction of the softmax scale: (0.1 · rope_yarn_mscale_all_dim · ln(factor) + 1)²
  (1 when the key is 0 or the factor <= 1)."""
  if rope.rope_type != "yarn" or rope.rope_yarn_mscale_all_dim <= 0 or rope.rope_scaling_factor <= 1:
    return 1.0
  return (0.1 * rope.rope_yarn_mscale_all_dim * math.log(rope.rope_scaling_factor) + 1.0) ** 2


def apply_rope(x_BLNH: jax.Array, positions_BL: jax.Array, inv_freq_h: np.ndarray | jax.Array,
               interleaved: bool = False, scale: float | jax.Array = 1.0) -> jax.Array:
  """Rotates pairs of each head's features by position × frequency, in float32.

  Pair i is (x[i], x[i + H/2]) (the halves layout of Hugging Face checkpoints) or,
  with `interleaved`, (x[2i], x[2i+1]) (Meta's original layout). The two differ only by a
  fixed permutation of the q/k projection outputs, which the converters apply. `scale` multiplies
  the result (YaRN's attention factor).
  """
  angles_BLh = positions_BL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h)[None, None, :]
  sin, cos = jnp.sin(angles_BLh)[:, :, None, :], jnp.cos(angles_BLh)[:, :, None, :]
  x = x_BLNH.astype(jnp.float32)
  if interleaved:
    first, second = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1).reshape(x.shape)
  else:
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  if not (isinstance(scale, float) and scale == 1.0):
    rotated = rotated * jnp.asarray(scale, jnp.float32)
  return rotated.astype(x_BLNH.dtype)


def sinusoidal_positions(positions_BL: jax.Array, dim: int, max_timescale: float = 10000.0) -> jax.Array:
  """[B, L, D] fixed position signal: sin of D/2 geometric frequencies, then their cos."""
  inv_freq = max_timescale ** (-jnp.arange(dim // 2, dtype=jnp.float32) / (dim // 2))
  angles_BLh = positions_BL[..., None].astype(jnp.float32) * inv_freq[None, None, :]
  return jnp.concatenate([jnp.sin(angles_BLh), jnp.cos(angles_BLh)], axis=-1)
