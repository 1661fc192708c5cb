"""A dense layer whose kernel carries logical axis names, and functional dropout."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import quantization


class DenseGeneral(nnx.Module):
  """y = x · W (+ b) over the trailing `in_shape` dims of x, producing `out_shape` dims.

  The kernel has shape in_shape + out_shape and logical names `kernel_names`; the
  optional bias (`use_bias`, GPT-3) has shape out_shape and the output dims' names.
  `tag` names the output for remat policies (jax.ad_checkpoint.checkpoint_name).
  The matmul runs in the quantization mode active at trace time (layers/quantization.py)
  unless `quantize=False` (e.g. the MoE router).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], kernel_names: Sequence[str | None], *,
               dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs, tag: str | None = None,
               use_bias: bool = False, quantize: bool = True):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    num_in = len(self.in_shape)
    init = nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal",
        in_axis=tuple(range(num_in)), out_axis=tuple(range(num_in, num_in + len(self.out_shape))))
    self.kernel = nnx.Param(init(rngs.params(), self.in_shape + self.out_shape, weight_dtype),
                            out_sharding=tuple(kernel_names))
    if use_bias:
      self.bias = nnx.Param(jnp.zeros(self.out_shape, weight_dtype), out_sharding=tuple(kernel_names)[num_in:])
    self.dtype, self.tag, self.use_bias, self.quantize = dtype, tag, use_bias, quantize

  def __call__(self, x: jax.Array) -> jax.Array:
    num_in = len(self.in_shape)
    contract = (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in)))
    mode = quantization.current_quantization() if self.quantize else ""
    y = quantization.quantized_dot_general(mode, x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                                           (contract, ((), ())))
    if self.use_bias:
      bias = self.bias[...].astype(self.dtype)
      y = y + jnp.expand_dims(bias, tuple(range(y.ndim - bias.ndim)))  # explicit: no implicit rank promotion
    return checkpoint_name(y, self.tag) if self.tag else y


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; identity when rate is 0 or no rng is given (evaluation)."""
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))

