"""GRPO's loss, gradients, metrics and advantages against TRL's GRPOTrainer on the same per-token
log-probabilities, rewards and masks, for each loss aggregation, clip setting and KL weight."""

from __future__ import annotations

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.rl import rewards
from MaxText.training.objectives import grpo_loss

ROWS, TOKENS, MAX_COMPLETION = 6, 5, 7


def _case(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  logps = rng.uniform(-3.0, -0.1, (ROWS, TOKENS))
  mask = np.zeros((ROWS, TOKENS))
  for row, length in enumerate([5, 3, 1, 4, 2, 5]):
    mask[row, :length] = 1
  return {"logps": logps,
          "old": logps + rng.normal(0, 0.4, logps.shape),  # ratios far enough from 1 to clip, both ways
          "ref": logps + rng.normal(0, 0.5, logps.shape),
          "entropy": rng.uniform(0.5, 3.0, logps.shape),
          "advantages": rng.normal(0, 1, ROWS),
          "mask": mask}


def trl_compute_loss(case: dict[str, np.ndarray], loss_type: str, epsilon_low: float, epsilon_high: float,
                     beta: float, dtype: str = "float64", importance_weights: np.ndarray | None = None):
  """GRPOTrainer._compute_loss with the model's log-probs and entropies given (and, with
  `importance_weights`, vLLM's importance-sampling correction): (loss, d loss / d logps, metrics)."""
  torch = pytest.importorskip("torch", reason="the TRL comparison needs torch (requirements-hf.txt)")
  trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs trl (requirements-test.txt)")
  as_tensor = lambda a: torch.tensor(a, dtype=getattr(torch, dtype))  # noqa: E731
  logps = torch.tensor(case["logps"], dtype=getattr(torch, dtype), requires_grad=True)
  entropy = as_tensor(case["entropy"]) if "entropy" in case else torch.ones_like(logps)
  mask = as_tensor(case["mask"])
  identity = lambda x, **_: x  # noqa: E731  (one process: gather and reduce change nothing)
  corrected = importance_weights is not None
  trainer = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
      aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
      importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=epsilon_low,
      epsilon_high=epsilon_high, use_vllm=corrected, vllm_importance_sampling_correction=corrected,
      model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
      max_completion_length=MAX_COMPLETION, _entropy_bonus_enabled=False,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
      accelerator=types.SimpleNamespace(num_processes=1, gather=identity, gather_for_metrics=identity,
                                        reduce=identity),
      _metrics={"train": collections.defaultdict(list)})
  inputs = {"prompt_ids": torch.zeros((ROWS, 1), dtype=torch.long), "prompt_mask": torch.ones((ROWS, 1)),
            "completion_ids": torch.zeros((ROWS, TOKENS), dtype=torch.long), "completion_mask": mask,
            "advantages": as_tensor(case["advantages"]), "old_per_token_logps": as_tensor(case["old"]),
            "ref_per_token_logps": as_tensor(case["ref"]), "num_items_in_batch": mask.sum()}
  if corrected:
    inputs["importance_sampling_ratio"] = as_tensor(importance_weights)
  loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
  return float(loss), logps.grad.numpy(), metrics


def _trl(case: dict[str, np.ndarray], loss_type: str, epsilon_low: float, epsilon_high: float, beta: float):
  return trl_compute_loss(case, loss_type, epsilon_low, epsilon_high, beta)


def _ours(case: dict[str, np.ndarray], loss_type: str, epsilon_low: float, epsilon_high: float, beta: float):
  def loss_and_sums(logps):
    sums = grpo_loss.loss_sums(logps, jnp.asarray(case["old"]), jnp.asarray(case["ref"]),
                               jnp.asarray(case["advantages"]), jnp.asarray(case["mask"]),
                               jnp.asarray(case["entropy"]), loss_type=loss_type, epsilon_low=epsilon_low,
                               epsilon_high=epsilon_high, beta=beta, max_completion_length=MAX_COMPLETION)
    return sums["loss_sum"] / grpo_loss.divisor(sums, loss_type), sums

  with jax.enable_x64(True):
    (loss, sums), grad = jax.value_and_grad(loss_and_sums, has_aux=True)(jnp.asarray(case["logps"]))
    metrics = {k: float(v) for k, v in grpo_loss.metrics(sums, loss_type).items()}
  return float(loss), np.asarray(grad), metrics


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("epsilon_low,epsilon_high,beta", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.1, 0.3, 0.04)])
def test_loss_gradient_and_metrics_equal_trl(loss_type, epsilon_low, epsilon_high, beta):
  case = _case(seed=3)
  trl_loss, trl_grad, trl_metrics = _trl(case, loss_type, epsilon_low, epsilon_high, beta)
  loss, grad, metrics = _ours(case, loss_type, epsilon_low, epsilon_high, beta)
  np.testing.assert_allclose(loss, trl_loss, rtol=1e-6)
  np.testing.assert_allclose(grad, trl_grad, rtol=1e-6, atol=1e-9)
  names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
  for name in names:
    np.testing.assert_allclose(metrics[name], trl_metrics[name], rtol=1e-6, atol=1e-9, err_msg=name)
  assert metrics["clip_ratio/region_mean"] > 0  # the case does clip: the comparison covers the clipped branch


def test_with_one_update_the_ratio_is_one_and_only_its_gradient_counts():
  """grpo_num_iterations=1: the old log-probs are the current ones without gradient, as TRL does."""
  case = _case(seed=5)
  case["old"] = case["logps"]
  trl_loss, trl_grad, _ = _trl(case, "dapo", 0.2, 0.2, 0.0)
  loss, grad, metrics = _ours(case, "dapo", 0.2, 0.2, 0.0)
  np.testing.assert_allclose([loss, *grad.ravel()], [trl_loss, *trl_grad.ravel()], rtol=1e-6, atol=1e-9)
  assert metrics["clip_ratio/region_mean"] == 0 and metrics["policy_ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_advantages_equal_trl(scaling):
  """TRL: reward minus the group mean, divided by (the group's or batch's nanstd + 1e-4) unless none."""
  torch = pytest.importorskip("torch", reason="the TRL comparison needs torch (requirements-hf.txt)")
  trl_utils = pytest.importorskip("trl.trainer.utils", reason="needs trl (requirements-test.txt)")
  group = 4
  scores = np.random.default_rng(0).integers(0, 3, 12).astype(np.float64)
  scores[:group] = 1.0  # one group whose rewards are all equal: advantage 0, counted in frac_reward_zero_std
  ours, group_std = rewards.advantages(scores, group, scaling)
  torch_rewards = torch.tensor(scores)
  mean = torch_rewards.view(-1, group).mean(dim=1).repeat_interleave(group)
  if scaling == "batch":
    std = trl_utils.nanstd(torch_rewards).expand_as(torch_rewards)
  else:
    std = trl_utils.nanstd(torch_rewards.view(-1, group), dim=1).repeat_interleave(group)
  theirs = torch_rewards - mean
  if scaling != "none":
    theirs = theirs / (std + 1e-4)
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  assert np.all(ours[:group] == 0) and group_std[0] == 0
