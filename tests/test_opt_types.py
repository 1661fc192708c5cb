"""Upstream MaxText's opt_type=sgd and opt_type=adam_pax (training/optimizers.py): a few updates of each equal a
NumPy reference of its formulas under the run's learning-rate schedule; an unknown opt_type, and an optimizer number
that would train on NaN or with the wrong sign, is one error line."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.training import optimizers

STEPS = 10  # the cosine schedule's length; no warmup


def _cfg(opt_type: str, **kw: object) -> object:
  return Config.for_testing(opt_type=opt_type, steps=STEPS, learning_rate=0.1, warmup_steps_fraction=0.0,
                            gradient_clipping_threshold=0.0, print_config=False, **kw).optim


def _lr(t: int, peak: float = 0.1, final: float = 0.1) -> float:
  """The schedule at update t (0-based): cosine from the peak to `final` of it over STEPS."""
  return peak * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t / STEPS)))


def _run(opt_type: str, steps: int, **kw: object) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]],
                                                        dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(steps)]
  optimizer = optimizers.create_optimizer(_cfg(opt_type, **kw))
  state, current = optimizer.init(params), dict(params)
  for g in grads:
    updates, state = optimizer.update(g, state, current)
    current = {k: np.asarray(current[k] + updates[k]) for k in current}
  return params, grads, current


def test_sgd_is_plain_gradient_descent_under_the_schedule():
  """No momentum and no weight decay, whatever adam_weight_decay says (as upstream's optax.sgd)."""
  params, grads, got = _run("sgd", 3, adam_weight_decay=0.1)
  for k in params:
    expected = params[k].astype(np.float64) - sum(_lr(t) * g[k] for t, g in enumerate(grads))
    np.testing.assert_allclose(got[k], expected, rtol=1e-6, atol=1e-6, err_msg=k)


def test_adam_pax_equals_bias_corrected_adam_with_decay_added_before_the_learning_rate():
  """Adam's m̂ / (sqrt(v̂ + eps_root) + eps), plus weight decay times the parameter, times the learning rate;
  eps and eps_root are large here so that where each goes shows."""
  b1, b2, eps, eps_root, wd = 0.9, 0.95, 1e-2, 1e-3, 0.1
  params, grads, got = _run("adam_pax", 4, adam_b1=b1, adam_b2=b2, adam_eps=eps, adam_eps_root=eps_root,
                            adam_weight_decay=wd)
  for k in params:
    p, m, v = params[k].astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
      m = b1 * m + (1 - b1) * g[k]
      v = b2 * v + (1 - b2) * g[k] ** 2
      direction = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t) + eps_root) + eps)
      p = p - _lr(t - 1) * (direction + wd * p)
    np.testing.assert_allclose(got[k], p, rtol=1e-5, atol=1e-6, err_msg=k)


def test_adam_pax_keeps_its_moments_bias_corrected():
  """Its state after one update is the gradient itself (m̂ = g, v̂ = g²), where AdamW's raw moments are (1 - b) g."""
  g = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32)}
  optimizer = optimizers.create_optimizer(_cfg("adam_pax"))
  _, state = optimizer.update(g, optimizer.init(g), g)
  np.testing.assert_allclose(state[0].mu["w"], g["w"], rtol=1e-6)
  np.testing.assert_allclose(state[0].nu["w"], g["w"] ** 2, rtol=1e-5)


def test_an_unknown_opt_type_is_one_line():
  with pytest.raises(ConfigError, match=r"opt_type must be one of adamw, muon, sgd, adam_pax, got 'lion'"):
    Config.for_testing(opt_type="lion")


@pytest.mark.parametrize("key, value, message", [
    ("learning_rate", math.inf, "learning_rate must be a finite float32 number > 0, got inf"),
    ("adam_eps", -1e-8, "adam_eps must be a finite float32 number >= 0, got -1e-08"),
    ("adam_eps_root", math.nan, "adam_eps_root must be a finite float32 number >= 0, got nan"),
    ("adam_weight_decay", -0.1, "adam_weight_decay must be a finite float32 number >= 0, got -0.1"),
    ("z_loss_multiplier", math.inf, "z_loss_multiplier must be a finite float32 number >= 0, got inf"),
    # Past float32's range: math.isfinite passed them, and on the device they were inf (eps: nothing trained).
    ("learning_rate", 1e39, "learning_rate must be a finite float32 number > 0, got 1e\\+39"),
    ("adam_eps", 1e39, "adam_eps must be a finite float32 number >= 0, got 1e\\+39"),
    ("cosine_learning_rate_final_fraction", -1.0, r"cosine_learning_rate_final_fraction \(the schedule's last "
     r"learning rate over its peak\) must be in \[0, 1\], got -1.0"),
])
def test_an_optimizer_number_that_would_train_on_nan_or_backwards_is_one_line(key, value, message):
  """Each was accepted and trained: NaN parameters, or a decay, epsilon, z-loss or final learning rate of the
  wrong sign (a silently different optimizer)."""
  with pytest.raises(ConfigError, match=f"^{message}$"):
    Config.for_testing(opt_type="adam_pax", **{key: value})


@pytest.mark.parametrize("opt_type", ["adamw", "adam_pax", "muon"])
def test_adam_without_any_epsilon_is_one_line(opt_type):
  """adam_eps=0 with adam_eps_root=0 was accepted: the first update of any parameter whose gradient is 0 (an
  embedding row no batch uses, a LoRA adapter at its start) was 0/0 and the run trained on NaN from step 2."""
  with pytest.raises(ConfigError, match=r"^adam_eps=0.0 and adam_eps_root=0.0: .* 0/0 = NaN .*; set adam_eps > 0"):
    Config.for_testing(opt_type=opt_type, adam_eps=0.0, adam_eps_root=0.0)
  Config.for_testing(opt_type="sgd", adam_eps=0.0)  # sgd reads neither


@pytest.mark.parametrize("opt_type", ["adamw", "adam_pax"])
def test_adam_with_only_the_inner_epsilon_keeps_zero_gradients_finite(opt_type):
  optimizer = optimizers.create_optimizer(_cfg(opt_type, adam_eps=0.0, adam_eps_root=1e-8))
  zeros = {"w": np.zeros((3, 5), np.float32)}
  updates, _ = optimizer.update(zeros, optimizer.init(zeros), zeros)
  assert np.all(np.asarray(updates["w"]) == 0.0)


def test_a_one_update_run_that_is_all_warmup_is_one_line():
  """steps=1 with warmup_steps_fraction=1: the only update ran at learning rate 0 and the run trained nothing."""
  with pytest.raises(ConfigError, match=r"^warmup_steps_fraction=1.0 of steps=1 \(1 optimizer update\) warms up "
                                        r"over that update, whose learning rate is then 0 .*; set warmup_steps"):
    Config.for_testing(steps=1, warmup_steps_fraction=1.0)
  assert Config.for_testing(steps=1, warmup_steps_fraction=0.5).optim.warmup_steps == 0  # starts at the peak
  assert Config.for_testing(steps=2, warmup_steps_fraction=1.0).optim.warmup_steps == 2
  # A longer schedule given outright is a run continued later: its first update is part of the warmup.
  continued = Config.for_testing(steps=1, warmup_steps_fraction=1.0, learning_rate_schedule_steps=10)
  assert continued.optim.warmup_steps == 10


@pytest.mark.parametrize("key", ["adam_b1", "adam_b2"])
def test_a_beta_that_is_1_in_float32_is_one_line(key):
  """0.99999999 < 1 passed, but it is 1.0 in float32: Adam's bias correction 1 - b^t is 0, so b1 gave inf updates
  (NaN weights) and b2 an update near 0 (nothing trained)."""
  with pytest.raises(ConfigError, match=rf"^{key} must be in \[0, 1\) and below 1 in float32 \(at most 0.99999994\), "
                                        r"got 0.99999999$"):
    Config.for_testing(**{key: 0.99999999})
  Config.for_testing(**{key: 0.9999999})  # 0.99999988 in float32


def test_a_decay_that_is_1_in_the_bfloat16_optimizer_state_is_one_line():
  """With weight_dtype=bfloat16 Optax keeps and decays the moments in bfloat16, where 0.999 (HF's adam_beta2) is
  1.0: the second moment only ever grew, a silently different optimizer."""
  with pytest.raises(ConfigError, match=r"^adam_b2=0.999 is 1.0 in bfloat16, the dtype the optimizer keeps its "
                                        r"moments in \(weight_dtype=bfloat16\): .*set adam_b2 <= 0.99609375 or "
                                        r"weight_dtype=float32$"):
    Config.for_testing(weight_dtype="bfloat16", adam_b2=0.999)
  with pytest.raises(ConfigError, match=r"^muon_beta=0.999 is 1.0 in bfloat16"):
    Config.for_testing(weight_dtype="bfloat16", opt_type="muon", muon_beta=0.999)
  Config.for_testing(weight_dtype="bfloat16", adam_b2=0.95)
  Config.for_testing(weight_dtype="float32", adam_b2=0.999)
  Config.for_testing(weight_dtype="bfloat16", opt_type="sgd", adam_b2=0.999)  # sgd keeps no moments


def test_bfloat16_moments_decay_as_the_check_assumes():
  """What the check guards against, in Optax itself: 300 zero gradients leave a bfloat16 second moment
  untouched at b2=0.999, where float32's decays by 0.999^300."""
  def second_moment(dtype: object) -> float:
    optimizer = optax.adamw(1e-3, b2=0.999)
    params = {"w": jnp.ones(2, dtype)}
    _, state = optimizer.update({"w": jnp.ones(2, dtype)}, optimizer.init(params), params)
    for _ in range(300):
      _, state = optimizer.update({"w": jnp.zeros(2, dtype)}, state, params)
    return float(state[0].nu["w"][0])

  assert second_moment(jnp.float32) == pytest.approx(0.001 * 0.999**300, rel=1e-3)
  assert second_moment(jnp.bfloat16) == pytest.approx(0.001, rel=1e-2)
