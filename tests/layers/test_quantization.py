"""int8 / fp8 training matmuls (MaxText/layers/quantization.py) against NumPy references and float."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import quantization
from MaxText.layers.linears import DenseGeneral
from train_utils import Run

DIMS_2D = (((1,), (0,)), ((), ()))


def _inputs(seed: int = 0, m: int = 16, k: int = 64, n: int = 24) -> tuple[jax.Array, jax.Array]:
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.linspace(0.1, 3.0, m)[:, None]  # rows of varied scale
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  return x, w


def _hlo(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compiler_ir("hlo").as_hlo_text()


# ------------------------------------------------------------------------------ int8
def _numpy_int8(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
  scale = np.abs(x).max(axis=axis, keepdims=True) / 127.0
  return np.clip(np.rint(x / scale), -127, 127).astype(np.int64), scale


def test_int8_matches_numpy_reference_and_error_bound():
  x, w = _inputs()
  y = np.asarray(quantization.quantized_dot_general("int8", x, w, DIMS_2D))
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  xq, sx = _numpy_int8(xn, axis=1)  # one scale per row (token)
  wq, sw = _numpy_int8(wn, axis=0)  # one scale per output channel
  reference = (xq @ wq) * sx * sw
  np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-6)
  # Rounding moves each operand by at most half a step (scale / 2), hence this elementwise bound.
  bound = (np.abs(xn) + sx / 2) @ (np.abs(wn) + sw / 2) - np.abs(xn) @ np.abs(wn)
  assert np.all(np.abs(y - xn @ wn) <= bound + 1e-6)
  assert np.linalg.norm(y - xn @ wn) / np.linalg.norm(xn @ wn) < 0.01


def test_int8_dense_general_close_to_float_with_straight_through_gradients():
  with nnx.use_eager_sharding(False):  # no mesh here
    layer = DenseGeneral((32,), (4, 8), ("embed", "heads", "kv"), dtype=jnp.float32, weight_dtype=jnp.float32,
                         rngs=nnx.Rngs(params=0))
  x_BLD = jax.random.normal(jax.random.key(1), (2, 8, 32))

  def loss(layer: DenseGeneral, x: jax.Array, mode: str) -> jax.Array:
    with quantization.use_quantization(mode):
      return jnp.sum(jnp.sin(layer(x)))

  y_float, y_int8 = layer(x_BLD), None
  with quantization.use_quantization("int8"):
    y_int8 = layer(x_BLD)
  assert y_int8.shape == (2, 8, 4, 8)
  # 32-term dot products of unit normals; per-operand rounding <= amax/254 => ~1% relative error.
  assert float(jnp.linalg.norm(y_int8 - y_float) / jnp.linalg.norm(y_float)) < 0.01
  g_float = nnx.grad(loss)(layer, x_BLD, "")
  g_int8 = nnx.grad(loss)(layer, x_BLD, "int8")
  k_float, k_int8 = g_float.kernel[...], g_int8.kernel[...]
  assert bool(jnp.all(jnp.isfinite(k_int8)))
  # Straight-through: same formula as float, evaluated at the quantized forward's output (sin').
  assert float(jnp.linalg.norm(k_int8 - k_float) / jnp.linalg.norm(k_float)) < 0.02


def test_int8_dot_appears_in_hlo():
  x, w = _inputs()
  text = _hlo(lambda a, b: quantization.quantized_dot_general("int8", a, b, DIMS_2D), x, w)
  assert "s8[16,64]" in text and "s8[64,24]" in text and "s32[16,24]" in text
  assert "s8[" not in _hlo(lambda a, b: quantization.quantized_dot_general("", a, b, DIMS_2D), x, w)


def test_int8_batched_expert_dims_match_einsum():
  """The MoE expert layout: expert dim batched, one scale per (expert, slot) and per (expert, channel)."""
  kx, kw = jax.random.split(jax.random.key(3))
  x_EBCD = jax.random.normal(kx, (3, 2, 4, 16))
  w_EDF = jax.random.normal(kw, (3, 16, 8))
  y = quantization.quantized_dot_general("int8", x_EBCD, w_EDF, (((3,), (1,)), ((0,), (0,))))
  reference = jnp.einsum("ebcd,edf->ebcf", x_EBCD, w_EDF)
  assert y.shape == reference.shape
  assert float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference)) < 0.01


# ------------------------------------------------------------------------------- fp8
def _numpy_fp8(x: np.ndarray, dtype, fp8_max: float) -> tuple[np.ndarray, float]:
  scale = float(np.abs(x).max()) / fp8_max
  return np.clip(x / scale, -fp8_max, fp8_max).astype(dtype).astype(np.float64), scale


def test_fp8_forward_and_backward_match_numpy_reference():
  x, w = _inputs(seed=5)
  g = jax.random.normal(jax.random.key(7), (16, 24))
  f = lambda a, b: quantization.quantized_dot_general("fp8", a, b, DIMS_2D)
  y, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(g)
  xn, wn, gn = (np.asarray(a, np.float64) for a in (x, w, g))
  xq, sx = _numpy_fp8(xn, ml_dtypes.float8_e4m3fn, 448.0)
  wq, sw = _numpy_fp8(wn, ml_dtypes.float8_e4m3fn, 448.0)
  gq, sg = _numpy_fp8(gn, ml_dtypes.float8_e5m2, 57344.0)
  np.testing.assert_allclose(y, (xq @ wq) * sx * sw, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx, (gq * sg) @ (wq * sw).T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, (xq * sx).T @ (gq * sg), rtol=1e-5, atol=1e-6)
  # Against float: e4m3 rounds normals to within 2**-4 relative and subnormals (below
  # 2**-6 of the fp8 range) to within 2**-10 * scale absolute; elementwise bound from that.
  ex = 2.0**-4 * np.abs(xn) + 2.0**-10 * sx
  ew = 2.0**-4 * np.abs(wn) + 2.0**-10 * sw
  bound = (np.abs(xn) + ex) @ (np.abs(wn) + ew) - np.abs(xn) @ np.abs(wn)
  assert np.all(np.abs(np.asarray(y) - xn @ wn) <= bound + 1e-6)
  # Gradients: e5m2 keeps 2 mantissa bits (rounding <= 2**-3 relative, ~6% rms on random
  # data) on top of e4m3's 2**-4: 12% relative Frobenius error is about twice the expected.
  for got, want in ((dx, gn @ wn.T), (dw, xn.T @ gn)):
    assert np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want) < 0.12


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("tiny", [1e-36, 1e-37])
def test_tiny_operands_and_gradients_stay_finite(mode, tiny):
  """A tensor (or a row) whose largest value is tiny but not 0: fp8's amax / 448 (57344 for the gradient) was
  subnormal, flushed to 0 by XLA, and its zeros became 0 / 0 = NaN, so a NaN loss and NaN gradients came out
  of finite inputs. int8's scale (amax / 127) was 0 too; its NaNs happened to cast to 0 on CPU."""
  x = jnp.array([[tiny, 0.0, 0.0, tiny], [0.0, tiny, 0.0, 0.0]], jnp.float32)
  w = jnp.array([[1.0, 0.0], [0.0, -1.0], [0.5, 0.5], [0.0, 2.0]], jnp.float32)
  f = jax.jit(lambda a, b: quantization.quantized_dot_general(mode, a, b, DIMS_2D))
  y, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(jnp.full((2, 2), tiny, jnp.float32))
  for got in (y, dx, dw):
    assert np.isfinite(np.asarray(got)).all(), got
  # Products of two scales this small are below float32's normals, flushed to 0 as the device flushes them:
  # the values come out 0 (or close), never large.
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), atol=3 * tiny)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [
    ((2, 6, 8), (8, 5), (((2,), (0,)), ((), ()))),            # a projection: [batch, seq, embed] x [embed, out]
    ((2, 6, 4, 3), (4, 3, 5), (((2, 3), (0, 1)), ((), ()))),   # heads and head_dim contracted (an output projection)
    ((3, 6, 8), (3, 5, 8), (((2,), (2,)), ((0,), (0,)))),      # a batch axis on both sides
    ((8, 2, 6), (5, 8), (((0,), (1,)), ((), ()))),             # contracted axes not leading or trailing
    ((2, 4, 6, 3), (3, 5, 4), (((3, 1), (0, 2)), ((), ()))),   # contracted axes paired out of order
])
def test_fp8_gradients_are_exact_dots_of_the_quantized_values(lhs_shape, rhs_shape, dims):
  """The backward's fp8 dots (with their axis bookkeeping) equal float64 einsums of the same
  quantized operands, for any dot_general layout the layers may use."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], lhs_shape)
  w = jax.random.normal(keys[1], rhs_shape)
  f = lambda a, b: quantization.quantized_dot_general("fp8", a, b, dims)
  y, vjp = jax.vjp(f, x, w)
  g = jax.random.normal(keys[2], y.shape)
  dx, dw = vjp(g)
  xq, sx = _numpy_fp8(np.asarray(x, np.float64), ml_dtypes.float8_e4m3fn, 448.0)
  wq, sw = _numpy_fp8(np.asarray(w, np.float64), ml_dtypes.float8_e4m3fn, 448.0)
  gq, sg = _numpy_fp8(np.asarray(g, np.float64), ml_dtypes.float8_e5m2, 57344.0)
  _, want_dx = jax.vjp(lambda a: jax.lax.dot_general(a, jnp.asarray(wq * sw), dims), jnp.asarray(xq * sx))
  _, want_dw = jax.vjp(lambda b: jax.lax.dot_general(jnp.asarray(xq * sx), b, dims), jnp.asarray(wq * sw))
  np.testing.assert_allclose(dx, want_dx(jnp.asarray(gq * sg, jnp.float32))[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw(jnp.asarray(gq * sg, jnp.float32))[0], rtol=1e-5, atol=1e-5)


def test_fp8_backward_dots_take_fp8_operands():
  """All three matmuls of a step are dots on fp8 values: the backward does not dequantize first,
  which on GPU let XLA fold the gradient's quantization away and run bfloat16 GEMMs."""
  x, w = _inputs()
  loss = lambda a, b: jnp.sum(quantization.quantized_dot_general("fp8", a, b, DIMS_2D) ** 2)
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 3
  assert all(line.count("xf8E") == 2 for line in dots), dots
  assert sum("xf8E5M2>" in line for line in dots) == 2  # the gradient, in both backward dots


def test_fp8_gemms_write_the_operand_dtype():
  """Each fp8 dot asks for its result in the dtype it returns (bfloat16 activations: bfloat16), not a
  float32 result that a later fusion narrows; the weight gradient stays in the weights' float32."""
  x, w = _inputs()
  x = x.astype(jnp.bfloat16)
  loss = lambda a, b: jnp.sum(quantization.quantized_dot_general("fp8", a, b, DIMS_2D).astype(jnp.float32) ** 2)
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  results = sorted(line.rsplit("->", 1)[1].strip() for line in dots)
  assert results == ["tensor<16x24xbf16>", "tensor<16x64xbf16>", "tensor<24x64xf32>"], dots


def test_fp8_types_appear_in_hlo():
  x, w = _inputs()
  loss = lambda a, b: jnp.sum(quantization.quantized_dot_general("fp8", a, b, DIMS_2D) ** 2)
  forward = _hlo(lambda a, b: quantization.quantized_dot_general("fp8", a, b, DIMS_2D), x, w)
  assert "f8e4m3fn[16,64]" in forward and "f8e4m3fn[64,24]" in forward
  assert "f8e5m2[16,24]" in _hlo(jax.grad(loss, argnums=(0, 1)), x, w)


# ------------------------------------------------------------------------ config, model
def test_quantization_key_is_validated(tiny_overrides):
  assert Config.for_testing(**tiny_overrides, quantization="int8").model.quantization == "int8"
  with pytest.raises(ConfigError, match="quantization must be one of"):
    Config.for_testing(**tiny_overrides, quantization="int4")
  with pytest.raises(ConfigError, match="sparse_matmul"):
    Config.for_testing(**tiny_overrides, quantization="int8", num_experts=4, num_experts_per_tok=2,
                       sparse_matmul=True)


@pytest.mark.parametrize("mode,dtype", [("int8", "s8["), ("fp8", "f8e4m3fn[")])
def test_train_step_hlo_has_quantized_dots(tiny_overrides, mode, dtype):
  run = Run(Config.for_testing(**tiny_overrides, quantization=mode))
  batch = next(run.data)
  hlo = run.step_fn.lower(run.init(), batch, run.rng).compiler_ir("hlo").as_hlo_text()
  assert dtype in hlo


def _losses(tiny_overrides: dict, mode: str, num_steps: int) -> tuple[float, float]:
  """(mean of the first 3, mean of the last 10) losses of a bf16 run on the learnable synthetic data,
  stopped after `num_steps` of the 100-step learning-rate schedule."""
  config = Config.for_testing(**dict(tiny_overrides, vocab_size=64, max_target_length=32, steps=100,
                                     learning_rate=3e-3, ici_data_parallelism=8, ici_fsdp_parallelism=1,
                                     dtype="bfloat16", quantization=mode))
  run = Run(config)
  _, history = run.train(run.init(), num_steps)
  return np.mean([h["loss"] for h in history[:3]]), np.mean([h["loss"] for h in history[-10:]])


def test_int8_training_converges_like_bf16_fast(tiny_overrides):
  """30 steps (same data, init and settings as test_synthetic_data_is_learnable): int8 tracks bf16."""
  start_bf16, end_bf16 = _losses(tiny_overrides, "", 30)
  start_int8, end_int8 = _losses(tiny_overrides, "int8", 30)
  assert abs(start_int8 - start_bf16) < 0.05, (start_int8, start_bf16)  # same init, ~1% matmul noise
  # Measured: bf16 4.74 -> 2.324 (mean of steps 21-30), int8 2.325; margin 0.1 nats.
  # The slow test below runs to 100 steps, past the bigram plateau ln(8) ≈ 2.08.
  assert end_bf16 < 2.5 and end_int8 < end_bf16 + 0.1, (end_bf16, end_int8)


@pytest.mark.slow
@pytest.mark.parametrize("mode,margin", [("int8", 0.05), ("fp8", 0.1)])
def test_low_precision_training_converges_like_bf16(tiny_overrides, mode, margin):
  """100 steps: measured bf16 0.687, int8 0.687, fp8 0.702 nats (mean of the last 10 steps)."""
  _, end_bf16 = _losses(tiny_overrides, "", 100)
  _, end_low = _losses(tiny_overrides, mode, 100)
  assert end_bf16 < 1.0 and end_low < end_bf16 + margin, (end_bf16, end_low)


def test_moe_block_int8_quantizes_expert_matmuls_not_the_router(tiny_overrides):
  from MaxText.layers import moe
  cfg = Config.for_testing(**tiny_overrides, num_experts=4, num_experts_per_tok=2, dtype="float32").model
  with nnx.use_eager_sharding(False):
    block = moe.MoeBlock(cfg, rngs=nnx.Rngs(params=1))
  x_BLD = jax.random.normal(jax.random.key(2), (2, 8, cfg.emb_dim))
  graphdef, state = nnx.split(block)
  apply = sharding.unsharded()(lambda state, x: nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(x)[0])
  y_float = apply(state, x_BLD)
  with quantization.use_quantization("int8"):
    y_int8 = apply(state, x_BLD)
    jaxpr = str(jax.make_jaxpr(apply)(state, x_BLD))
    gate_int8 = block.gate(x_BLD)
  np.testing.assert_array_equal(gate_int8, block.gate(x_BLD))  # the router stays in float
  # Expert matmuls batched over the expert dim, in int8 with int32 accumulation.
  assert "i8[4," in jaxpr and "preferred_element_type=int32" in jaxpr
  assert float(jnp.linalg.norm(y_int8 - y_float) / jnp.linalg.norm(y_float)) < 0.02


@pytest.mark.parametrize("mode", ["int8", "fp8", "mxfp8"])
def test_gradients_inside_shard_map_over_axes_a_weight_does_not_vary_on(mode):
  """Expert parallelism's MoE runs the expert matmuls inside a vma-checked shard_map, the tokens split over
  `data` and the experts' weights not. fp8's and mxfp8's custom backward returned the weight's gradient still
  varying over `data` (its psum is autodiff's to insert), and mxfp8's lax.scaled_dot dropped the axes its
  operands vary over: training with ici_expert_parallelism > 1 stopped with a custom_vjp type error."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(kx, (4, 8, 40)), NamedSharding(mesh, P("expert", "data")))
  w = jax.device_put(jax.random.normal(kw, (4, 40, 24)) / np.sqrt(40), NamedSharding(mesh, P("expert")))
  dims = (((2,), (1,)), ((0,), (0,)))  # per expert: [tokens, d] x [d, f]

  def loss(mode: str, x: jax.Array, w: jax.Array) -> jax.Array:
    def body(x: jax.Array, w: jax.Array) -> jax.Array:
      y = quantization.quantized_dot_general(mode, x, w, dims)
      return jax.lax.psum(jnp.sum(y * y), ("data", "expert"))
    return jax.shard_map(body, mesh=mesh, in_specs=(P("expert", "data"), P("expert")), out_specs=P())(x, w)

  want = jax.jit(jax.grad(functools.partial(loss, ""), argnums=(0, 1)))(x, w)
  got = jax.jit(jax.grad(functools.partial(loss, mode), argnums=(0, 1)))(x, w)
  for g, r in zip(got, want):
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 0.1
