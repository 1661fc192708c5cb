"""A dense layer whose kernel carries logical axis names, and functional dropout."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import lora_rows, quantization, weight_quantization
from MaxText.layers.weight_quantization import QuantizedWeight


class DenseGeneral(nnx.Module):
  """y = x · W (+ b) over the trailing `in_shape` dims of x, producing `out_shape` dims.

  The kernel has shape in_shape + out_shape and logical names `kernel_names`; the
  optional bias (`use_bias`, GPT-3) has shape out_shape and the output dims' names.
  `tag` names the output for remat policies (jax.ad_checkpoint.checkpoint_name).
  The matmul runs in the quantization mode active at trace time (layers/quantization.py)
  unless `quantize=False` (e.g. the MoE router).

  `lora_rank > 0` adds a LoRA adapter (MaxText/training/lora.py): y += lora_scale · (x · lora_a) · lora_b,
  lora_a [in_shape..., r] named like the kernel's input dims and lora_b [r, out_shape...] like
  its output dims (the rank dim replicated), so the adapter is sharded like its base weight.
  lora_a starts as PEFT's default (kaiming-uniform with a = sqrt(5): U(±1/sqrt(fan_in))) and
  lora_b at zero, so a fresh adapter leaves the output unchanged. The adapter's matmuls stay in
  float (not quantized): they are small and they are what trains.
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], kernel_names: Sequence[str | None], *,
               dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs, tag: str | None = None,
               use_bias: bool = False, quantize: bool = True, lora_rank: int = 0, lora_scale: float = 0.0):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    num_in = len(self.in_shape)
    init = nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal",
        in_axis=tuple(range(num_in)), out_axis=tuple(range(num_in, num_in + len(self.out_shape))))
    self.kernel = nnx.Param(init(rngs.params(), self.in_shape + self.out_shape, weight_dtype),
                            out_sharding=tuple(kernel_names))
    if use_bias:
      self.bias = nnx.Param(jnp.zeros(self.out_shape, weight_dtype), out_sharding=tuple(kernel_names)[num_in:])
    if lora_rank > 0:
      names = tuple(kernel_names)
      bound = 1.0 / math.sqrt(math.prod(self.in_shape))
      self.lora_a = nnx.Param(jax.random.uniform(rngs.params(), self.in_shape + (lora_rank,), weight_dtype,
                                                 -bound, bound), out_sharding=names[:num_in] + (None,))
      self.lora_b = nnx.Param(jnp.zeros((lora_rank,) + self.out_shape, weight_dtype),
                              out_sharding=(None,) + names[num_in:])
    self.dtype, self.tag, self.use_bias, self.quantize = dtype, tag, use_bias, quantize
    self.lora_rank, self.lora_scale = lora_rank, lora_scale

  def merged_kernel(self) -> jax.Array:
    """The kernel with the adapter folded in (what the layer computes, for code that reads the weight itself)."""
    if self.lora_rank == 0:
      return self.kernel[...]
    return merged_kernel(self.kernel[...], self.lora_a[...], self.lora_b[...], self.lora_scale)

  def __call__(self, x: jax.Array) -> jax.Array:
    num_in = len(self.in_shape)
    contract = (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in)))
    mode = quantization.current_quantization() if self.quantize else ""
    stored = self.kernel.get_raw_value()
    if isinstance(stored, QuantizedWeight):  # quantize_weights: decoding from 8-bit storage
      y = weight_quantization.dense_dot(x, stored, num_in, self.dtype, mode)
    else:
      y = quantization.quantized_dot_general(mode, x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                                             (contract, ((), ())))
    if self.lora_rank > 0 and lora_rows.is_table(self.lora_a[...], num_in):  # serving many adapters
      rows_delta = lora_rows.delta(x, self.lora_a[...], self.lora_b[...], num_in, self.dtype)
      if rows_delta is not None:
        y = y + rows_delta.astype(y.dtype)
    elif self.lora_rank > 0:
      x_r = jax.lax.dot_general(x.astype(self.dtype), self.lora_a[...].astype(self.dtype), (contract, ((), ())))
      delta = jax.lax.dot_general(x_r, self.lora_b[...].astype(self.dtype), (((x_r.ndim - 1,), (0,)), ((), ())))
      y = y + (delta * jnp.asarray(self.lora_scale, delta.dtype)).astype(y.dtype)
    return self.finish(y)

  def finish(self, y: jax.Array, tagged: bool = True) -> jax.Array:
    """The bias and (when `tagged`) the remat name on the matmul's output `y`."""
    if self.use_bias:
      bias = self.bias[...].astype(self.dtype)
      y = y + jnp.expand_dims(bias, tuple(range(y.ndim - bias.ndim)))  # explicit: no implicit rank promotion
    return checkpoint_name(y, self.tag) if self.tag and tagged else y

  def fusable_with(self, other: "DenseGeneral") -> bool:
    """Whether one matmul over both kernels stacked computes both outputs: the same shapes and
    dtypes, no adapter, float storage, and no quantization mode at trace time."""
    plain = lambda d: d.lora_rank == 0 and not isinstance(d.kernel.get_raw_value(), QuantizedWeight)
    mode = quantization.current_quantization() if self.quantize or other.quantize else ""
    return (plain(self) and plain(other) and not mode and self.dtype == other.dtype
            and (self.in_shape, self.out_shape) == (other.in_shape, other.out_shape))


def fused_outputs(layers: Sequence[DenseGeneral], x: jax.Array, tag: str, part_tags: bool = True) -> list[jax.Array]:
  """Each layer's output on the same input, from one matmul over their kernels stacked on an axis after
  the input dims (fused_qkv, fused_mlp): the parameters stay apart, as a checkpoint holds them. Layers
  that cannot share one (DenseGeneral.fusable_with) each run their own. The stacked output is named
  `tag` for remat policies (upstream's qkv_proj, fused mlpwi); the parts keep their layers' names
  unless `part_tags` is False."""
  first = layers[0]
  if not all(first.fusable_with(layer) for layer in layers[1:]):
    return [layer(x) for layer in layers]
  num_in = len(first.in_shape)
  kernel = jnp.stack([layer.kernel[...].astype(first.dtype) for layer in layers], axis=num_in)
  contract = (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in)))
  y = checkpoint_name(quantization.quantized_dot_general("", x.astype(first.dtype), kernel, (contract, ((), ()))), tag)
  axis = x.ndim - num_in  # the stacked axis in the output
  return [layer.finish(jax.lax.index_in_dim(y, i, axis, keepdims=False), part_tags) for i, layer in enumerate(layers)]


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; identity when rate is 0 or no rng is given (evaluation)."""
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def merged_kernel(kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array, lora_scale: float) -> jax.Array:
  """kernel + lora_scale · lora_a · lora_b over the rank dim: lora_a is [..., in dims, r] and
  lora_b [..., r, out dims], with the same leading (layer) dims as the kernel."""
  num_lead = lora_a.ndim + lora_b.ndim - 2 - kernel.ndim  # layer dims counted twice
  batch = tuple(range(num_lead))
  delta = jax.lax.dot_general(lora_a.astype(jnp.float32), lora_b.astype(jnp.float32),
                              (((lora_a.ndim - 1,), (num_lead,)), (batch, batch)))
  return (kernel.astype(jnp.float32) + lora_scale * delta).astype(kernel.dtype)
