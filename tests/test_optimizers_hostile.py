"""Optimizer and low-precision keys as a hurried or hostile user sets them: each either trains on the numbers the
docs give, or is one error line at config time that names the key and what to set instead."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import quantization
from MaxText.training import optimizers


def test_zero_gradient_accumulation_steps_is_one_line():
  """Was a ZeroDivisionError traceback from the batch split, before the optimizer's own check ran."""
  with pytest.raises(ConfigError, match=r"^gradient_accumulation_steps must be > 0, got 0$"):
    Config.for_testing(gradient_accumulation_steps=0)


@pytest.mark.parametrize("fraction, steps, warmup", [(0.29, 100, 29), (0.57, 100, 57), (0.57, 10000, 5700)])
def test_the_warmup_is_the_fraction_as_written(fraction, steps, warmup):
  """0.29 of 100 updates warmed up over 28 (int(0.29 * 100) is 28): the peak came one update early."""
  optim = Config.for_testing(steps=steps, learning_rate=1e-3, warmup_steps_fraction=fraction,
                             print_config=False).optim
  assert optim.warmup_steps == warmup
  schedule = optimizers.learning_rate_schedule(optim)
  # Linear from 0 over the warmup, the peak at its end (Optimizers.md).
  assert float(schedule(warmup - 1)) == pytest.approx(1e-3 * (warmup - 1) / warmup, rel=1e-5)
  assert float(schedule(warmup)) == pytest.approx(1e-3, rel=1e-6)


@pytest.mark.parametrize("opt_type", ["adamw", "adam_pax", "muon"])
@pytest.mark.parametrize("learning_rate, weight_decay", [(0.5, 10.0), (1e-3, 1000.0), (1.0, 1.0)])
def test_a_weight_decay_that_flips_the_weights_is_one_line(opt_type, learning_rate, weight_decay):
  """learning_rate x adam_weight_decay >= 1 was accepted: each update multiplied every weight by 1 - lr x wd, and
  at lr=0.5, wd=10 the loss went from 5.3 to 2e5 in six steps."""
  with pytest.raises(ConfigError, match=rf"^learning_rate={learning_rate} x adam_weight_decay={weight_decay} = "
                                        r".* zeroes it or flips its sign; set adam_weight_decay below 1 / learning_rate"):
    Config.for_testing(opt_type=opt_type, learning_rate=learning_rate, adam_weight_decay=weight_decay)
  Config.for_testing(opt_type=opt_type, learning_rate=learning_rate, adam_weight_decay=0.99 / learning_rate)
  Config.for_testing(opt_type="sgd", learning_rate=learning_rate, adam_weight_decay=weight_decay)  # sgd: no decay


def test_float16_optimizer_state_without_a_float16_epsilon_is_one_line():
  """weight_dtype=float16 with the default adam_eps=1e-8 was accepted: Optax computes the update in the moments'
  dtype, where 1e-8 is 0, so a zero gradient's update was 0/0 = NaN and a 1e-3 one's -inf (its square underflows)."""
  with pytest.raises(ConfigError, match=r"^adam_eps=1e-08 and adam_eps_root=0.0 are 0 in float16, the dtype the "
                                        r"optimizer keeps its moments in \(weight_dtype=float16\): .*; set adam_eps "
                                        r">= 6.1e-05 or weight_dtype=float32$"):
    Config.for_testing(weight_dtype="float16")
  optim = Config.for_testing(weight_dtype="float16", adam_eps=1e-4, learning_rate=1e-3,
                             gradient_clipping_threshold=0.0).optim
  optimizer = optimizers.create_optimizer(optim)
  params = {"w": jnp.ones(3, jnp.float16)}
  grads = {"w": jnp.asarray([0.0, 1e-3, 1.0], jnp.float16)}
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  assert np.all(np.isfinite(np.asarray(updates["w"], np.float32)))
  Config.for_testing(weight_dtype="float16", opt_type="sgd")  # sgd keeps no moments


@pytest.mark.parametrize("key, value, message", [
    ("learning_rate", 1e-50, r"^learning_rate=1e-50 is 0 in float32 \(below 1.18e-38\): the run would train nothing"),
    ("gradient_clipping_threshold", 1e-50, r"^gradient_clipping_threshold must be 0 \(off\) or a float32 number "
     r">= 1.18e-38 \(a smaller one is 0 on the device and clips every gradient to 0\), got 1e-50$"),
    ("gradient_clipping_threshold", -1.0, r"^gradient_clipping_threshold must be 0 \(off\) .*, got -1.0$"),
    ("muon_consistent_rms", 1e-50, r"^muon_consistent_rms=1e-50 is 0 in float32 \(below 1.18e-38\) and would zero "
     r"every matrix update; set 0"),
])
def test_a_number_that_is_0_on_the_device_is_one_line(key, value, message):
  """Each passed `> 0` and was 0 in float32: every update (or every clipped gradient) 0, a run that trained nothing."""
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(opt_type="muon", **{key: value})


@pytest.mark.parametrize("value", ["inf", "1e39"])
def test_an_infinite_clipping_threshold_is_one_line(value):
  """inf (1e39 is inf in float32) passed `>= tiny` and clipped nothing, as 0 does, while a run stopped by a
  non-finite step was told clipping was already on."""
  with pytest.raises(ConfigError, match=rf"^gradient_clipping_threshold={re.escape(str(float(value)))} is not a finite float32 "
                                        r"number and would clip nothing; set 0 to turn clipping off"):
    Config.for_testing(gradient_clipping_threshold=value)


@pytest.mark.parametrize("k", [64, 1024])
def test_fp8_in_float16_stays_finite_and_close_to_float32(k):
  """quantization=fp8 with dtype=float16 trained on NaN from the first step: the GEMM wrote its unscaled sum of
  products of e4m3 values up to 448 in float16, past its 65504, before the scale brought it back."""
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (16, k), jnp.float32)
  w = jax.random.normal(kw, (k, 24), jnp.float32) / np.sqrt(k)
  g = jax.random.normal(kg, (16, 24), jnp.float32)
  dims = (((1,), (0,)), ((), ()))

  def loss(x: jax.Array, w: jax.Array) -> jax.Array:
    y = quantization.quantized_dot_general("fp8", x, w, dims)
    return jnp.sum(y.astype(jnp.float32) * g)

  y = quantization.quantized_dot_general("fp8", x.astype(jnp.float16), w.astype(jnp.float16), dims)
  assert y.dtype == jnp.float16
  reference = np.asarray(x @ w)
  assert np.linalg.norm(np.asarray(y, np.float32) - reference) / np.linalg.norm(reference) < 0.06
  dx, dw = jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float16), w.astype(jnp.float16))
  dx32, dw32 = jax.grad(lambda x, w: jnp.sum((x @ w) * g), argnums=(0, 1))(x, w)
  for got, want in ((dx, dx32), (dw, dw32)):
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want) < 0.1
  assert math.isfinite(float(loss(x.astype(jnp.float16), w.astype(jnp.float16))))
