"""Batches made ahead on a rollout mesh (rl_max_staleness > 0) were sampled by an older policy:
with grpo_old_logps resolving to the sampler, the ratio's π_old is the engine's recorded log-prob
of each token, so PPO's clip bounds the update against the policy that made the batch, instead of
training the stale batch as if the current policy had sampled it (ratio 1, nothing clipped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration import rl_config
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline.batch_spec import ADVANTAGES, SAMPLER_LOGPS
from MaxText.training.objectives import grpo, grpo_loss
from tests.test_grpo import GRPO

ASYNC = dict(rl_rollout_devices=4, rl_max_staleness=1, rl_weight_sync_interval=2)


def _rl(tiny_overrides, **extra) -> rl_config.RLConfig:
  return Config.for_testing(**{**tiny_overrides, **GRPO, **extra}).rl


@pytest.mark.parametrize("extra, from_sampler", [
    ({}, False),  # synchronous: the trainer's π_old, as before
    (dict(rl_rollout_devices=4), False),
    (ASYNC, True),  # batches made ahead: the policy that sampled them
    ({**ASYNC, "rl_weight_sync_interval": 1}, True),
    ({**ASYNC, "rl_importance_sampling": "token_truncate"}, False),  # importance weights correct them instead
    ({**ASYNC, "grpo_old_logps": "trainer"}, False),
    (dict(grpo_old_logps="sampler"), True),
])
def test_auto_takes_the_samplers_log_probs_for_batches_made_ahead(tiny_overrides, extra, from_sampler):
  assert rl_config.old_logps_from_sampler(_rl(tiny_overrides, **extra)) is from_sampler


@pytest.mark.parametrize("overrides, message", [
    (dict(grpo_old_logps="behaviour"), "grpo_old_logps must be one of auto, trainer, sampler; got 'behaviour'"),
    (dict(grpo_old_logps="sampler", rl_importance_sampling="token_mask"),
     "grpo_old_logps=sampler makes the engine's log-probs the ratio's old policy, which "
     "rl_importance_sampling=token_mask would weigh"),
])
def test_configuration_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    _rl(tiny_overrides, **overrides)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_a_stale_batch_is_clipped_against_the_policy_that_sampled_it(tiny_overrides, monkeypatch):
  """The loss's gradient per token, the trainer's log-probs standing in for the parameters: against
  the sampler, a token the policy already moved past the clip since the batch was sampled (up for
  A > 0, down for A < 0) gets none, the others r·A (r = π/μ); a token without a sampler log-prob
  (NaN) keeps ratio 1. Against the trainer (the old rule) every token gets A."""
  logps = np.log(np.asarray([[0.5, 0.5, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]], np.float32))
  # π/μ per token: 1.5 (past 1 + 0.28), 1.1 (inside), unknown, 1 (the prompt's target: not trained)
  sampler = np.log(np.asarray([[1 / 3, 0.5 / 1.1, np.nan, 0.5], [0.4, 0.2 / 0.9, 0.2, 0.2]], np.float32))
  sampler[:, 3] = 0.0
  mask = np.asarray([[1, 1, 1, 0], [1, 1, 1, 0]], np.int32)
  advantages = np.asarray([1.0, -1.0], np.float32)
  batch = {"targets_segmentation": jnp.asarray(mask), SAMPLER_LOGPS: jnp.asarray(sampler),
           ADVANTAGES: jnp.asarray(advantages)}
  monkeypatch.setattr(grpo_loss, "token_logps", lambda model, params, batch, rng, with_entropy=True:
                      (params, jnp.zeros_like(params), {}))

  def gradient(**extra) -> np.ndarray:
    rl = _rl(tiny_overrides, grpo_epsilon_high=0.28, **{**ASYNC, **extra})
    objective = grpo.Grpo(None, None, rl)  # type: ignore[arg-type]  # the model is the patched token_logps
    return np.asarray(jax.grad(lambda p: objective.loss_sums(p, None, batch, None)[0])(jnp.asarray(logps)))

  # -r·A per token: row 0 (A = 1) clipped above at 1.5 -> 0; row 1 (A = -1) clipped below at 0.5 -> 0
  expected = -np.asarray([[0.0, 1.1, 1.0, 0.0], [0.0, -0.9, -1.0, 0.0]])  # of the loss's sum (dapo)
  np.testing.assert_allclose(gradient(), expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(gradient(grpo_old_logps="trainer"), -advantages[:, None] * mask, rtol=1e-6)
