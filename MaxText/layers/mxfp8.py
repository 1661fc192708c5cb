"""MXFP8 training matmuls: block-scaled 8-bit operands after the OCP Microscaling (MX) spec v1.0.

Every block of 32 contiguous elements along a matmul's contraction dimension shares one
power-of-two scale stored as E8M0 (an 8-bit biased exponent, 2**-127 .. 2**127); the elements
are FP8 E4M3 (max 448). For a block with largest magnitude `amax` the spec's scale is

  X = 2 ** (floor(log2(amax)) - emax_elem),   emax_elem = 8 for E4M3 (448 = 1.75 * 2**8)

and each element is x / X rounded to nearest even in E4M3, saturated at +-448 (a block's top
values can reach up to 511.x before saturation, since amax / X lies in [256, 512)). An all-zero
block gets the smallest scale, 2**-127, and zero elements.

Forward and backward are all MX matmuls (`mx_matmul_bmk`, a custom_vjp): the forward quantizes
lhs and rhs along their contraction dim; the backward re-quantizes from the saved
high-precision operands along the contraction dim of each gradient product, d_lhs = g . rhs^T
(blocks along rhs's output features and g's columns) and d_rhs = g^T . lhs (blocks along the
tokens), because blocks along one dimension do not carry over to another. Gradients are E4M3
too: the per-block scale gives the range that E5M2 gives per-tensor scaling.

The product runs through `jax.lax.scaled_dot` (FP8 operands + E8M0 scales, float32 result):
XLA keeps it as a block-scaled dot where the backend has one and otherwise inlines its
decomposition (each operand times its scales in bfloat16, exact for E4M3 x 2**k, then a dot
with float32 accumulation), which is the simulation on CPU.

Why not `jax.nn.scaled_dot_general` with `get_scaled_dot_general_config("mxfp8")`: its
quantizer rounds the scale up (2**ceil(log2(amax / 448))), not the spec's floor rule above, and
its `scaled_matmul` primitive lowers only for CUDA and ROCm, so it cannot compile for CPU or a
TPU topology. The quantizer here is ~30 lines tested against a float64 NumPy reference.

Shapes: B batch dims (merged), M lhs free dims (merged), N rhs free dims (merged), K the
contraction dims (merged, then padded with zeros to a multiple of the block).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MX_BLOCK = 32
_E4M3_EMAX = 8
_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
_E8M0_BIAS, _E8M0_MIN_EXP = 127, -127

DotDims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
_BMK_DIMS = (((2,), (2,)), ((0,), (0,)))


def pad_to_block(x: jax.Array) -> jax.Array:
  """Zeros on the last axis up to a multiple of MX_BLOCK: a zero adds nothing to a dot product
  and changes no block's amax."""
  pad = -x.shape[-1] % MX_BLOCK
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def quantize_mx(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., K] (K a multiple of MX_BLOCK) -> (E4M3 elements [..., K], E8M0 scales [..., K/32])."""
  x32 = x.astype(jnp.float32)
  blocks = x32.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  _, exponent = jnp.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1): floor(log2 amax) = exponent - 1
  shared = jnp.where(amax > 0, exponent - 1 - _E4M3_EMAX, _E8M0_MIN_EXP)
  shared = jnp.clip(shared, _E8M0_MIN_EXP, -_E8M0_MIN_EXP)
  # ldexp by the negated exponent, never a division by 2**shared: 2**-127 is subnormal in
  # float32, which XLA may flush to zero.
  elements = jnp.clip(jnp.ldexp(blocks, -shared), -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
  scales = jax.lax.bitcast_convert_type((shared[..., 0] + _E8M0_BIAS).astype(jnp.uint8), jnp.float8_e8m0fnu)
  return elements.reshape(x.shape), scales


def dequantize_mx(elements: jax.Array, scales: jax.Array) -> jax.Array:
  """The float32 values the MX pair stands for (the inverse of `quantize_mx` up to rounding)."""
  shared = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32) - _E8M0_BIAS
  blocks = elements.astype(jnp.float32).reshape(*scales.shape, MX_BLOCK)
  return jnp.ldexp(blocks, shared[..., None]).reshape(elements.shape)


def _varying(x: jax.Array) -> frozenset[str]:
  """The shard_map mesh axes x varies over (none outside one)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10's name; `vma` is the older one
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_over(x: jax.Array, axes: frozenset[str]) -> jax.Array:
  """x typed as varying over `axes` too (a no-op on its values)."""
  missing = tuple(sorted(axes - _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def same_varying(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Both operands typed as varying over the axes either varies over. A custom_vjp's backward must return
  each operand's gradient varying as the operand does: a weight replicated over `data` inside a shard_map
  gets a gradient that varies over it until summed, and that sum is autodiff's to insert, at this cast."""
  axes = _varying(lhs) | _varying(rhs)
  return vary_over(lhs, axes), vary_over(rhs, axes)


def _scaled_bmk(a_BMK: jax.Array, b_BNK: jax.Array) -> jax.Array:
  """[B, M, K] x [B, N, K] -> [B, M, N] float32, both operands MX-quantized along K."""
  a_q, a_scales = quantize_mx(pad_to_block(a_BMK))
  b_q, b_scales = quantize_mx(pad_to_block(b_BNK))
  out = jax.lax.scaled_dot(a_q, b_q, lhs_scale=a_scales, rhs_scale=b_scales, dimension_numbers=_BMK_DIMS,
                           preferred_element_type=jnp.float32)
  # scaled_dot's result is typed as varying over no shard_map axis whatever its operands vary over.
  return vary_over(out, _varying(a_BMK) | _varying(b_BNK))


@jax.custom_vjp
def mx_matmul_bmk(a_BMK: jax.Array, b_BNK: jax.Array) -> jax.Array:
  """MXFP8 [B, M, K] x [B, N, K] -> [B, M, N] (float32) with MXFP8 gradients."""
  return _scaled_bmk(a_BMK, b_BNK)


def _fwd(a_BMK: jax.Array, b_BNK: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  return _scaled_bmk(a_BMK, b_BNK), (a_BMK, b_BNK)


def _bwd(saved: tuple[jax.Array, jax.Array], g_BMN: jax.Array) -> tuple[jax.Array, jax.Array]:
  a_BMK, b_BNK = saved
  d_a = _scaled_bmk(g_BMN, b_BNK.swapaxes(1, 2))  # contract N
  d_b = _scaled_bmk(g_BMN.swapaxes(1, 2), a_BMK.swapaxes(1, 2))  # contract M
  return d_a.astype(a_BMK.dtype), d_b.astype(b_BNK.dtype)


mx_matmul_bmk.defvjp(_fwd, _bwd)


def _to_bmk(x: jax.Array, batch: tuple[int, ...], contract: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
  """x with its dims ordered (batch, free, contract) and merged into three; also the free dims' sizes."""
  free = tuple(i for i in range(x.ndim) if i not in batch and i not in contract)
  sizes = [math.prod(x.shape[i] for i in group) for group in (batch, free, contract)]
  return x.transpose(batch + free + contract).reshape(sizes), tuple(x.shape[i] for i in free)


def mxfp8_dot_general(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  """`jax.lax.dot_general(lhs, rhs, dims)` with MXFP8 operands forward and backward, in lhs.dtype.
  The reshapes around the core are linear, so autodiff carries the gradients through them."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
  lhs, rhs = same_varying(lhs, rhs)
  lhs_BMK, lhs_free = _to_bmk(lhs, lhs_batch, lhs_contract)
  rhs_BNK, rhs_free = _to_bmk(rhs, rhs_batch, rhs_contract)
  out_BMN = mx_matmul_bmk(lhs_BMK, rhs_BNK)
  batch_shape = tuple(lhs.shape[i] for i in lhs_batch)
  return out_BMN.reshape(batch_shape + lhs_free + rhs_free).astype(lhs.dtype)
