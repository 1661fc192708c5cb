"""Quantized weight storage for decoding (`quantize_weights`): a kernel kept as int8 or float8_e4m3fn
values with float32 scales, and the matmul that reads it.

`QuantizedWeight` is a pytree (values, scale) that stands in for a kernel array inside the
parameter tree, so checkpoints, shardings and the layer stacks' scans see ordinary leaves; the
layer code needs no new attributes. Scales are symmetric absmax over the kernel's contracting
(input) axes: one per output channel (`block` 0), or one per `block` consecutive input rows of
each output channel, rows counted over the contracting axes flattened (`block_widths`; per-block, as
DeepSeek-V3 ships its fp8 weights).

`dense_dot` is DenseGeneral's matmul on such a kernel:
- weight-only, per-channel: x · values in the activation dtype (int8 and e4m3 values are exact in
  bfloat16), float32 accumulation, then the output channels times their scale, so the conversion
  and the scale are elementwise ops next to the dot that XLA fuses instead of a float kernel (the CPU
  backend fuses neither: there the kernel is converted a block of input rows at a time in a loop);
- weight and activation, when `quantization` (the training matmul mode, layers/quantization.py) is
  int8 or fp8 beside per-channel weights of the same kind: the activations are quantized as that
  mode does (int8: per token; fp8: per tensor) and the dot runs on the 8-bit values of both;
- otherwise (per-block scales, or a mode of another kind) the kernel is dequantized and the matmul
  runs as the active mode runs it on a float kernel.
Any other reader of a kernel (`param[...]`: the MoE experts, MLA's absorbed kv_b) gets the
dequantized float kernel, computed inside the jitted step.

Numerics: int8 rounds each weight to within half a step, scale/2 = amax/254 of its row (block);
e4m3 keeps 3 mantissa bits, a relative error up to 2**-4 of each weight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from MaxText.errors import choices
from MaxText.layers import quantization
from MaxText.platform.sharding import trace_platform

INT8_MAX = 127.0
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
STORAGE_DTYPES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
CPU_CHUNK_ELEMENTS = 2**18  # input rows converted at a time on CPU: about 1 MiB of float32 kernel


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A kernel as 8-bit `values` (the kernel's shape) times float32 `scale` (the kernel's shape with
  each contracting axis divided into its blocks: size 1 for one scale per output channel)."""

  values: Any  # jax.Array, or a ShapeDtypeStruct / sharding where the tree describes one
  scale: Any
  dtype: Any = dataclasses.field(metadata={"static": True})  # the float dtype of the kernel it stands for

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  def dequantize(self, dtype: Any = None) -> jax.Array:
    """The float kernel values · scale (each scale repeated over its block), in `dtype` (default: the kernel's)."""
    scale = self.scale
    for axis, (size, blocks) in enumerate(zip(self.values.shape, self.scale.shape)):
      if blocks not in (1, size):
        scale = jnp.repeat(scale, size // blocks, axis=axis)
    out = self.values.astype(jnp.float32) * scale
    return out.astype(dtype if dtype is not None else self.dtype)

  def __getitem__(self, index: Any) -> jax.Array:
    """What nnx's `param[...]` reads: the dequantized kernel."""
    return self.dequantize()[index]


def block_widths(shape: Sequence[int], contract_axes: Sequence[int], block: int) -> dict[int, int]:
  """Each contracting axis's width in one block of `block` consecutive input rows, the rows numbered
  row-major over the contracting axes (the kernel flattened to [in, out], as attention's out projection
  [heads, head_dim, embed] is [heads x head_dim, embed] in a checkpoint): the last axes whole, a divisor
  of the one before, 1 on the rest. Fewer input rows than `block` (or `block` 0): one block. Raises
  ValueError where a block would straddle an axis (a block neither divides it nor holds it whole)."""
  widths = {axis: shape[axis] for axis in contract_axes}
  if block <= 0 or math.prod(widths.values()) <= block:
    return widths
  # Blocking each axis by `block` separately made an out projection's block heads x head_dim rows (one
  # scale per output channel), not the `block` rows the key promises.
  axes = sorted(contract_axes)
  if len(axes) == 1:
    problem = f"does not divide the input axis of {shape[axes[0]]}"
  else:
    problem = (f"does not tile the input axes {' x '.join(str(shape[a]) for a in axes)} (a block is a divisor of the "
               "last, or whole rows of it that divide the axes before)")
  rows = block
  for axis in reversed(axes):
    size = shape[axis]
    if rows >= size and rows % size == 0:
      rows //= size
    elif rows < size and size % rows == 0:
      widths[axis], rows = rows, 1
    else:
      raise ValueError(problem)
  return widths


def quantize_weight(kernel: jax.Array, mode: str, contract_axes: Sequence[int], block: int = 0) -> QuantizedWeight:
  """`kernel` as `mode` ("int8" or "fp8") values with absmax scales over `contract_axes`, one per output
  channel (`block` 0) or per `block` consecutive input rows of each (`block_widths`)."""
  if mode not in STORAGE_DTYPES:
    raise ValueError(f"quantize_weights must be one of {choices(('',) + tuple(STORAGE_DTYPES))}; got {mode!r}")
  x32 = kernel.astype(jnp.float32)
  try:
    widths = block_widths(x32.shape, contract_axes, block)
  except ValueError as e:
    raise ValueError(f"quantize_weights_block={block} {e}") from None
  blocked_shape: list[int] = []
  reduce_axes: list[int] = []
  for axis, size in enumerate(x32.shape):
    if axis in contract_axes:
      width = widths[axis]
      blocked_shape += [size // width, width]
      reduce_axes.append(len(blocked_shape) - 1)
    else:
      blocked_shape.append(size)
  blocked = x32.reshape(blocked_shape)
  amax = jnp.max(jnp.abs(blocked), axis=tuple(reduce_axes), keepdims=True)
  limit = INT8_MAX if mode == "int8" else E4M3_MAX
  scale = quantization.amax_scale(amax, limit)
  # A NaN or inf weight makes its block's scale NaN, as the float matmul's result would be, never a finite
  # scale hiding it (int8 turned such a channel to zeros). Said explicitly: whether max keeps a NaN is
  # the backend's choice (XLA:CPU's fused reduction drops it).
  finite = jnp.all(jnp.isfinite(blocked), axis=tuple(reduce_axes), keepdims=True)
  scale = jnp.where(finite, scale, jnp.nan)
  scaled = jnp.clip(blocked / scale, -limit, limit)
  values = (jnp.round(scaled) if mode == "int8" else scaled).astype(STORAGE_DTYPES[mode]).reshape(x32.shape)
  scale_shape = [s for i, s in enumerate(blocked_shape) if i not in reduce_axes]  # 1 per axis without blocks
  return QuantizedWeight(values, scale.reshape(scale_shape).astype(jnp.float32), kernel.dtype)


def per_channel(weight: QuantizedWeight, contract_axes: Sequence[int]) -> bool:
  return all(weight.scale.shape[a] == 1 for a in contract_axes)


def dense_dot(x: jax.Array, weight: QuantizedWeight, num_in: int, dtype: Any, mode: str) -> jax.Array:
  """DenseGeneral's x · kernel over x's last `num_in` axes and the kernel's first `num_in`, in the
  activation `dtype`, with the kernel stored quantized; `mode`: the active `quantization` mode."""
  lhs_contract = tuple(range(x.ndim - num_in, x.ndim))
  rhs_contract = tuple(range(num_in))
  dims = ((lhs_contract, rhs_contract), ((), ()))
  storage = weight.values.dtype
  if not per_channel(weight, rhs_contract):
    return quantization.quantized_dot_general(mode, x.astype(dtype), weight.dequantize(dtype), dims)
  out_shape = weight.values.shape[num_in:]
  scale_out = weight.scale.reshape((1,) * (x.ndim - num_in) + out_shape)  # one per output channel
  if mode == "int8" and storage == jnp.int8:
    x_q, x_scale = quantization.quantize_int8(x, lhs_contract)
    acc = jax.lax.dot_general(x_q, weight.values, dims, preferred_element_type=jnp.int32)
    x_scale = x_scale.reshape(x_scale.shape[:x.ndim - num_in] + (1,) * len(out_shape))
    return (acc.astype(jnp.float32) * x_scale * scale_out).astype(dtype)
  if mode == "fp8" and storage == jnp.float8_e4m3fn:
    x_8, x_scale = quantization.quantize_fp8(x, jnp.float8_e4m3fn, E4M3_MAX)
    acc = jax.lax.dot_general(x_8, weight.values, dims, preferred_element_type=jnp.float32)
    return (acc * (x_scale * scale_out)).astype(dtype)
  if mode:  # a mode of another kind (mxfp8, or int8 beside fp8 weights): as it runs on the float kernel
    return quantization.quantized_dot_general(mode, x.astype(dtype), weight.dequantize(dtype), dims)
  if trace_platform() == "cpu":
    acc = _dot_by_row_blocks(x.astype(dtype), weight.values, num_in, dtype)
  else:
    acc = jax.lax.dot_general(x.astype(dtype), weight.values.astype(dtype), dims, preferred_element_type=jnp.float32)
  return (acc * scale_out).astype(dtype)


def _dot_by_row_blocks(x: jax.Array, values: jax.Array, num_in: int, dtype: Any) -> jax.Array:
  """x · values (float32) converting a block of the kernel's input rows at a time inside a loop. XLA's
  CPU backend does not fuse the conversion into its matmul: converted whole, every matmul of every
  step writes a fresh float copy of its kernel, which costs several times the matmul; a loop reuses
  one small buffer."""
  out_shape = values.shape[num_in:]
  k, n = math.prod(values.shape[:num_in]), math.prod(out_shape)
  rows = max(d for d in range(1, k + 1) if k % d == 0 and (d * n <= CPU_CHUNK_ELEMENTS or d == 1))
  lead = x.shape[:x.ndim - num_in]
  x_lk = x.reshape(lead + (k,))
  v_kn = values.reshape(k, n)
  if rows == k:
    acc = jax.lax.dot_general(x_lk, v_kn.astype(dtype), (((x_lk.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return acc.reshape(lead + out_shape)
  x_blocks = jnp.moveaxis(x_lk.reshape(lead + (k // rows, rows)), -2, 0)
  v_blocks = v_kn.reshape(k // rows, rows, n)

  def add_block(acc: jax.Array, block: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    x_block, v_block = block
    part = jax.lax.dot_general(x_block, v_block.astype(dtype), (((x_block.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return acc + part, None

  acc, _ = jax.lax.scan(add_block, jnp.zeros(lead + (n,), jnp.float32), (x_blocks, v_blocks))
  return acc.reshape(lead + out_shape)
