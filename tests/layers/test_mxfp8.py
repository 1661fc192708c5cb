"""MXFP8 training matmuls (MaxText/layers/mxfp8.py) against a float64 NumPy reading of the OCP
Microscaling spec and against float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.layers import mxfp8, quantization
from train_utils import Run


# ---------------------------------------------------------------- the spec, in float64 NumPy
def _round_e4m3(v: np.ndarray) -> np.ndarray:
  """Round to nearest even on the E4M3 grid (3 mantissa bits; subnormal step 2**-9), saturating at 448."""
  mag = np.abs(v)
  exponent = np.floor(np.log2(np.maximum(mag, 2.0 ** -6)))  # below 2**-6 the grid is the subnormal one
  step = 2.0 ** (exponent - 3)
  return np.clip(np.sign(v) * np.round(mag / step) * step, -448.0, 448.0)


def _numpy_mx(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(elements as float64, scale exponents) per 32-element block of the last axis, the spec's rules:
  X = 2**(floor(log2(amax)) - 8), elements x / X in E4M3, zero blocks get the smallest scale."""
  blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 8, -127)
  exponent = np.clip(exponent, -127, 127)
  elements = _round_e4m3(np.clip(blocks / 2.0 ** exponent, -448, 448))
  return elements.reshape(x.shape), exponent[..., 0].astype(np.int64)


def _numpy_qdq(x: np.ndarray) -> np.ndarray:
  elements, exponent = _numpy_mx(x)
  return (elements.reshape(*exponent.shape, 32) * 2.0 ** exponent[..., None]).reshape(x.shape)


def _awkward_blocks() -> np.ndarray:
  """Blocks that exercise each rule: ordinary, saturating (amax/X up to 511), all zero, tiny, huge, mixed sign."""
  rng = np.random.default_rng(0)
  rows = [rng.normal(size=32),
          np.concatenate([[500.0, -511.0, 256.0], rng.uniform(-1, 1, 29)]),
          np.zeros(32),
          rng.normal(size=32) * 1e-30,
          rng.normal(size=32) * 1e30,
          np.concatenate([[1.0], np.full(31, 1e-4)])]
  return np.stack(rows).astype(np.float32)


def _jax_mx(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  elements, scales = mxfp8.quantize_mx(jnp.asarray(x))
  exponent = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)).astype(np.int64) - 127
  return np.asarray(elements.astype(jnp.float32), np.float64), exponent


def test_quantize_matches_the_spec_in_float64():
  rng = np.random.default_rng(1)
  data = np.concatenate([_awkward_blocks().reshape(-1),
                         (rng.normal(size=32 * 30) * np.repeat(2.0 ** rng.integers(-20, 20, 30), 32))])
  x = data.reshape(-1, 64).astype(np.float32)  # 36 blocks, two per row
  elements, exponent = _jax_mx(x)
  want_elements, want_exponent = _numpy_mx(x)
  np.testing.assert_array_equal(exponent, want_exponent)
  np.testing.assert_array_equal(elements, want_elements)
  assert elements.dtype == np.float64 and np.abs(elements).max() == 448.0  # the saturating block


def test_round_trip_error_is_within_half_an_e4m3_step():
  x = _awkward_blocks()
  elements, scales = mxfp8.quantize_mx(jnp.asarray(x))
  back = np.asarray(mxfp8.dequantize_mx(elements, scales), np.float64)
  np.testing.assert_array_equal(back, _numpy_qdq(x))
  np.testing.assert_array_equal(back[2], 0.0)  # a zero block stays zero
  normal = np.abs(x) > np.abs(x).max(axis=-1, keepdims=True) * 2.0 ** -6  # off E4M3's subnormal range
  with np.errstate(divide="ignore"):
    normal &= np.abs(x) <= 448 * 2.0 ** (np.floor(np.log2(np.abs(x).max(axis=-1, keepdims=True))) - 8)  # unsaturated
  rel = np.abs(back - x)[normal] / np.abs(x)[normal]
  assert rel.max() <= 2.0 ** -4  # half of E4M3's relative step 2**-3


def _inputs(seed: int = 0, m: int = 64, k: int = 256, n: int = 48):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.linspace(0.1, 3.0, m)[:, None]
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  return x, w


DIMS_2D = (((1,), (0,)), ((), ()))


def _rel(a, b) -> float:
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@jax.jit
def _mx_2d(x: jax.Array, w: jax.Array) -> jax.Array:
  return quantization.quantized_dot_general("mxfp8", x, w, DIMS_2D)


def test_forward_is_the_product_of_the_spec_operands_and_close_to_float32():
  x, w = _inputs()
  out = _mx_2d(x, w)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  spec = _numpy_qdq(x64) @ _numpy_qdq(w64.T).T  # both operands blocked along K
  np.testing.assert_allclose(np.asarray(out, np.float64), spec, rtol=1e-5, atol=1e-5)
  assert _rel(out, x64 @ w64) < 0.05


def test_gradients_are_mx_products_along_each_gradient_contraction():
  x, w = _inputs(1, n=64)  # every contraction (K, then N, then M) a whole number of blocks
  g = jax.random.normal(jax.random.key(3), (x.shape[0], w.shape[1]), jnp.float32)
  dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(_mx_2d(x, w) * g), argnums=(0, 1)))(x, w)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  # d_x = g . w^T contracts N: blocks run along g's rows and w's rows; d_w = x^T . g contracts M.
  np.testing.assert_allclose(np.asarray(dx, np.float64), _numpy_qdq(g64) @ _numpy_qdq(w64).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw, np.float64), _numpy_qdq(x64.T) @ _numpy_qdq(g64.T).T, rtol=1e-5,
                             atol=1e-5)
  assert _rel(dx, g64 @ w64.T) < 0.05 and _rel(dw, x64.T @ g64) < 0.05


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", [
    ((2, 8, 48), (48, 4, 16), (((2,), (0,)), ((), ()))),  # K = 48: padded to 64 with zeros
    ((2, 8, 4, 16), (4, 16, 40), (((2, 3), (0, 1)), ((), ()))),  # two contraction dims (an output projection)
    ((3, 16, 64), (3, 64, 24), (((2,), (1,)), ((0,), (0,)))),  # batched over experts
])
def test_general_dot_dims_match_dot_general_with_gradients(lhs_shape, rhs_shape, dims):
  kl, kr = jax.random.split(jax.random.key(4))
  lhs, rhs = jax.random.normal(kl, lhs_shape), jax.random.normal(kr, rhs_shape)
  def with_vjp(dot):
    return jax.jit(lambda a, b, cotangent: (lambda out, vjp: (out, vjp(cotangent)))(*jax.vjp(dot, a, b)))

  ref_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs).shape
  cotangent = jax.random.normal(jax.random.key(5), ref_shape)
  out, grads = with_vjp(lambda a, b: mxfp8.mxfp8_dot_general(a, b, dims))(lhs, rhs, cotangent)
  ref, ref_grads = with_vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"))(lhs, rhs, cotangent)
  assert out.shape == ref.shape and _rel(out, np.asarray(ref, np.float64)) < 0.05
  for got, want in zip(grads, ref_grads):
    assert got.shape == want.shape and _rel(got, np.asarray(want, np.float64)) < 0.05


def test_bfloat16_operands_give_bfloat16_results_and_gradients():
  x, w = _inputs()
  x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  out = _mx_2d(x, w)
  dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(_mx_2d(x, w)), argnums=(0, 1)))(x, w)
  assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16


# ------------------------------------------------------------------------ config, model
@pytest.mark.slow  # compiles a whole train step
def test_train_step_hlo_has_block_scaled_operands(tiny_overrides):
  run = Run(Config.for_testing(**tiny_overrides, quantization="mxfp8"))
  hlo = run.step_fn.lower(run.init(), next(run.data), run.rng).compiler_ir("hlo").as_hlo_text()
  assert "f8e4m3fn[" in hlo and "f8e8m0fnu[" in hlo


def _losses(tiny_overrides: dict, mode: str, num_steps: int, dtype: str) -> list[float]:
  config = Config.for_testing(**dict(tiny_overrides, vocab_size=64, max_target_length=32, steps=100,
                                     learning_rate=3e-3, ici_data_parallelism=8, ici_fsdp_parallelism=1,
                                     dtype=dtype, quantization=mode))
  run = Run(config)
  _, history = run.train(run.init(), num_steps)
  return [h["loss"] for h in history]


@pytest.mark.slow  # two short training runs
def test_mxfp8_training_tracks_float32_over_a_few_steps(tiny_overrides):
  reference = _losses(tiny_overrides, "", 8, "float32")
  mx = _losses(tiny_overrides, "mxfp8", 8, "float32")
  assert reference[-1] < reference[0] - 0.3  # it learns
  np.testing.assert_allclose(mx, reference, atol=0.05)


@pytest.mark.slow
def test_mxfp8_training_converges_like_bf16(tiny_overrides):
  """100 steps in bfloat16, the same run as the int8/fp8 convergence test (Low_precision.md)."""
  end_bf16 = np.mean(_losses(tiny_overrides, "", 100, "bfloat16")[-10:])
  end_mx = np.mean(_losses(tiny_overrides, "mxfp8", 100, "bfloat16")[-10:])
  assert end_bf16 < 1.0 and end_mx < end_bf16 + 0.1, (end_bf16, end_mx)
