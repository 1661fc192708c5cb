"""Low-precision training matmuls: int8 (AQT-style), fp8 and mxfp8 (mxfp8.py), selected by `quantization`.

`quantized_dot_general(mode, lhs, rhs, dimension_numbers)` is a drop-in for
`jax.lax.dot_general` with lhs = activations and rhs = weights. `DenseGeneral` and the
MoE expert matmuls call it when a mode is active; `Transformer` activates the configured
mode around the decoder stack with `use_quantization(...)` (a context variable read at
trace time, so attention/MLP constructors need no extra argument). The output projection
(logits) stays in float: it is small next to the stack and the loss is most sensitive there.

int8: symmetric absmax scales, one per token (every lhs element outside the contracting
dims) and one per output channel (every rhs element outside them); the forward is an
int8 x int8 -> int32 `dot_general`, rescaled by the outer product of the two scales.
The backward is straight-through: quantisation counts as identity, so gradients are the
float dot_general's gradients in the activation dtype (AQT's "int8 forward, bf16
backward" setting). Numerics: each operand's rounding error is at most half a step,
scale/2 = amax/254, i.e. a relative error of ~0.4% of each row's largest entry.

fp8: per-tensor current scaling (the scale comes from this step's amax, no history).
Forward: both operands cast to float8_e4m3fn (max 448) and multiplied by a `dot_general`
on fp8 inputs with a float32 result. Backward: the incoming gradient is cast to
float8_e5m2 (max 57344, wider range for gradients), and each operand's gradient is a
`dot_general` of it with the other fp8 operand saved by the forward (e5m2 x e4m3); on GPU
each of the three becomes an fp8 cuBLASLt GEMM. e4m3 keeps 3 mantissa bits: a relative
rounding error up to 2**-4.

Why not qwix (0.1.8, installable next to jax 0.10 / flax 0.12 without upgrades): its
public NNX entry point, `qwix.quantize_model`, subclasses the model at run time and
intercepts every `dot_general` inside the call (attention's activation x activation
einsums included) with rules matched by module path, found by stack-frame inspection. Our
layers are merged from a graphdef inside `jax.lax.scan` / `jax.checkpoint`, and the
per-op function (`dot_general_qt`) lives in qwix's private `_src` package. A ~100-line
custom_vjp we test against float is the smaller risk.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp

from MaxText.configuration.model_checks import QUANTIZATION_MODES
from MaxText.errors import choices
from MaxText.layers.mxfp8 import mxfp8_dot_general, same_varying

DotDims = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]

_INT8_MAX = 127.0
_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
_E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)  # 57344
_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # float32's smallest normal number

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("maxtext_quantization", default="")


@contextlib.contextmanager
def use_quantization(mode: str) -> Iterator[None]:
  """Matmuls traced inside this block (DenseGeneral, MoE experts) run in `mode` ("" = float)."""
  if mode not in QUANTIZATION_MODES:
    raise ValueError(f"quantization must be one of {choices(QUANTIZATION_MODES, 'float')}; got {mode!r}")
  token = _MODE.set(mode)
  try:
    yield
  finally:
    _MODE.reset(token)


def current_quantization() -> str:
  return _MODE.get()


def _normalise(dims: DotDims) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]:
  (lc, rc), (lb, rb) = dims
  return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _float_dot(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  return jax.lax.dot_general(lhs, rhs, dims)


def amax_scale(amax: jax.Array, qmax: float) -> jax.Array:
  """amax / qmax, at least float32's smallest normal: for a block of tiny values (or of zeros) amax / qmax is
  subnormal or 0, which XLA flushes to 0, and the block's zeros became 0 / 0 = NaN (in the forward, in the
  backward from a tiny gradient, and in stored weights)."""
  return jnp.maximum(amax / qmax, _F32_TINY)


# ---------------------------------------------------------------------------------- int8
def quantize_int8(x: jax.Array, contract_axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """Symmetric absmax int8 over `contract_axes`: q in [-127, 127], scale (float32, keepdims)."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=tuple(contract_axes), keepdims=True)
  scale = amax_scale(amax, _INT8_MAX)
  q = jnp.clip(jnp.round(x32 / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return q, scale


def _int8_forward(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  (lc, rc), _ = dims
  lhs_q, lhs_scale = quantize_int8(lhs, lc)
  rhs_q, rhs_scale = quantize_int8(rhs, rc)
  acc = jax.lax.dot_general(lhs_q, rhs_q, dims, preferred_element_type=jnp.int32)
  # The scales keep size-1 contracting dims, so the same dot_general lays their outer
  # product out exactly like `acc` (batch dims, lhs free dims, rhs free dims).
  scale = jax.lax.dot_general(lhs_scale, rhs_scale, dims, precision=jax.lax.Precision.HIGHEST)
  return (acc.astype(jnp.float32) * scale).astype(lhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_dot_general(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  """int8 x int8 -> int32 dot_general with per-token lhs and per-channel rhs scales."""
  return _int8_forward(lhs, rhs, dims)


def _int8_fwd(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  return _int8_forward(lhs, rhs, dims), (lhs, rhs)


def _int8_bwd(dims: DotDims, residuals: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
  lhs, rhs = residuals  # straight-through: the float matmul's gradients
  _, vjp = jax.vjp(functools.partial(_float_dot, dims=dims), lhs, rhs)
  return vjp(g.astype(lhs.dtype))


int8_dot_general.defvjp(_int8_fwd, _int8_bwd)


# ----------------------------------------------------------------------------------- fp8
def quantize_fp8(x: jax.Array, dtype: jnp.dtype, fp8_max: float) -> tuple[jax.Array, jax.Array]:
  """Per-tensor current scaling: x / scale with scale = amax / fp8_max, saturated, cast to fp8."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32))
  scale = amax_scale(amax, fp8_max)
  return jnp.clip(x32 / scale, -fp8_max, fp8_max).astype(dtype), scale


def _fp8_forward(lhs: jax.Array, rhs: jax.Array, dims: DotDims
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
  lhs_8, lhs_scale = quantize_fp8(lhs, jnp.float8_e4m3fn, _E4M3_MAX)
  rhs_8, rhs_scale = quantize_fp8(rhs, jnp.float8_e4m3fn, _E4M3_MAX)
  out = _scaled_fp8_dot(lhs_8, rhs_8, dims, lhs_scale * rhs_scale, lhs.dtype)
  return out, (lhs_8, lhs_scale, rhs_8, rhs_scale)


def _scaled_fp8_dot(lhs_8: jax.Array, rhs_8: jax.Array, dims: DotDims, scale: jax.Array, out_dtype: jnp.dtype
                    ) -> jax.Array:
  """dot_general of fp8 values (float32 accumulation inside the GEMM) times the scales, in out_dtype.
  The GEMM writes out_dtype itself: a float32 result that a later fusion scales and narrows costs
  three times the bytes of a bfloat16 one, for every projection of every layer (getting_started/GPU.md)."""
  # Except float16: the unscaled sum of products of values up to 448 (e4m3) or 57344 (e5m2) is past its
  # 65504, inf before the scale brings it back (bfloat16 has float32's range).
  acc_dtype = jnp.float32 if out_dtype == jnp.float16 else out_dtype
  acc = jax.lax.dot_general(lhs_8, rhs_8, dims, preferred_element_type=acc_dtype)
  return (acc.astype(jnp.float32) * scale).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  """e4m3 x e4m3 dot_general (float32 accumulation) with per-tensor current scaling."""
  return _fp8_forward(lhs, rhs, dims)[0]


def _fp8_fwd(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  out, saved = _fp8_forward(lhs, rhs, dims)
  # dtypes travel as zero-size arrays: residuals must be JAX types.
  return out, (*saved, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _fp8_bwd(dims: DotDims, residuals: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array, jax.Array]:
  lhs_8, lhs_scale, rhs_8, rhs_scale, lhs_like, rhs_like = residuals
  g_8, g_scale = quantize_fp8(g, jnp.float8_e5m2, _E5M2_MAX)
  # Both gradients are dots on the fp8 values themselves (e5m2 x e4m3, float32 accumulation), as the
  # forward is. Dequantize-then-dot leaves the GEMM to a pattern match, and XLA's GPU pipeline may
  # first fold the quantize/dequantize round trip of the gradient away (excess precision is allowed
  # by default), which left every backward GEMM in bfloat16 (getting_started/GPU.md).
  d_lhs = _fp8_operand_gradient(g_8, rhs_8, g_scale * rhs_scale, dims, lhs_8.ndim, lhs_like.dtype, of_lhs=True)
  d_rhs = _fp8_operand_gradient(g_8, lhs_8, g_scale * lhs_scale, dims, rhs_8.ndim, rhs_like.dtype, of_lhs=False)
  return d_lhs, d_rhs


def _fp8_operand_gradient(g_8: jax.Array, other_8: jax.Array, scale: jax.Array, dims: DotDims, ndim: int,
                          out_dtype: jnp.dtype, of_lhs: bool) -> jax.Array:
  """The gradient of one operand of dot_general(lhs, rhs, dims) for the output gradient g: a dot of g
  with the other operand over the other operand's free axes, then a transpose into the operand's
  own axis order. g's axes are (batch, lhs free, rhs free), as dot_general lays out its result."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
  other_ndim = other_8.ndim
  lhs_ndim, rhs_ndim = (ndim, other_ndim) if of_lhs else (other_ndim, ndim)
  lhs_free = [i for i in range(lhs_ndim) if i not in lhs_contract and i not in lhs_batch]
  rhs_free = [i for i in range(rhs_ndim) if i not in rhs_contract and i not in rhs_batch]
  nb = len(lhs_batch)
  if of_lhs:
    mine_contract, other_contract, mine_batch, other_batch = lhs_contract, rhs_contract, lhs_batch, rhs_batch
    mine_free, other_free, g_other_free = lhs_free, rhs_free, range(nb + len(lhs_free), nb + len(lhs_free) + len(rhs_free))
  else:
    mine_contract, other_contract, mine_batch, other_batch = rhs_contract, lhs_contract, rhs_batch, lhs_batch
    mine_free, other_free, g_other_free = rhs_free, lhs_free, range(nb, nb + len(lhs_free))
  grad_dims = ((tuple(g_other_free), tuple(other_free)), (tuple(range(nb)), tuple(other_batch)))
  out = _scaled_fp8_dot(g_8, other_8, grad_dims, scale, out_dtype)
  # out's axes: batch, this operand's free axes (in g's order), then the other operand's contracted
  # axes in their own ascending order, each standing for the contracted axis of this operand it pairs with.
  paired = [mine_contract[list(other_contract).index(d)] for d in sorted(other_contract)]
  axes_of_out = [*mine_batch, *mine_free, *paired]
  return jnp.transpose(out, [axes_of_out.index(axis) for axis in range(ndim)])


fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)


# ------------------------------------------------------------------------------ dispatch
def quantized_dot_general(mode: str, lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  """`jax.lax.dot_general(lhs, rhs, dims)` in `mode`; lhs = activations, rhs = weights."""
  dims = _normalise(dims)
  if mode == "":
    return jax.lax.dot_general(lhs, rhs, dims)
  if mode == "int8":
    return int8_dot_general(lhs, rhs, dims)
  if mode == "fp8":  # its backward's dots give each gradient as varying as both operands (mxfp8.same_varying)
    return fp8_dot_general(*same_varying(lhs, rhs), dims)
  if mode == "mxfp8":
    return mxfp8_dot_general(lhs, rhs, dims)
  raise ValueError(f"quantization must be one of {choices(QUANTIZATION_MODES, 'float')}; got {mode!r}")


def dot_general(lhs: jax.Array, rhs: jax.Array, dims: DotDims) -> jax.Array:
  """dot_general in the mode active at trace time (see `use_quantization`)."""
  return quantized_dot_general(current_quantization(), lhs, rhs, dims)
