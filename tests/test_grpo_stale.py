"""Batches made ahead on a rollout mesh (rl_max_staleness > 0) were sampled by an older policy:
with grpo_old_logps resolving to the sampler, the ratio's π_old is the engine's recorded log-prob
of each token, so PPO's clip bounds the update against the policy that made the batch, instead of
training the stale batch as if the current policy had sampled it (ratio 1, nothing clipped)."""

from __future__ import annotations

import dataclasses
import json

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


@pytest.mark.slow  # builds a run and two rollout engines
def test_episodes_made_ahead_are_kept_by_a_checkpoint_and_trained_as_they_were(tiny_overrides, tmp_path, monkeypatch):
  """With an environment and rl_weight_sync_interval=2, step 1's episodes are made ahead from step 0's
  weight copy; the data state saved while they are in flight holds them (JSON), and a fresh
  RolloutBatches given that state hands step 1 the same batch instead of sampling new episodes."""
  from MaxText.rl import rollout_mesh, rollouts  # noqa: PLC0415
  from MaxText.training import run_assembly  # noqa: PLC0415 - heavy, this test only
  from tests.test_grpo_tools import TWO_TURNS, CHATML, without_markers, write_tokenizer  # noqa: PLC0415
  write_tokenizer(tmp_path / "tokenizer", without_markers(CHATML))
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n"
                                                  for w in ("the quick", "brown fox", "jumps over", "a lazy dog")))
  (tmp_path / "two_turns.py").write_text(TWO_TURNS)
  monkeypatch.syspath_prepend(str(tmp_path))
  config = Config.for_testing(**{
      **tiny_overrides, **GRPO, **ASYNC, "vocab_size": 256, "tokenizer_path": str(tmp_path / "tokenizer"),
      "hf_data_files": str(tmp_path / "prompts.jsonl"), "reward_functions": "[]", "rl_environment": "two_turns:TwoTurns",
      "max_prefill_predict_length": 64, "max_completion_length": 6, "max_target_length": 72, "steps": 4})
  run = run_assembly.build_run(config, devices=rollout_mesh.training_devices(config))
  state = run.init_state()
  data = rollouts.RolloutBatches(config, run.mesh, run.batch_sharding)
  data.next_for(state)  # step 0: the copy, and step 1's episodes queued from it
  saved = json.loads(json.dumps(data.get_state()))
  assert list(saved["queued"]) == ["1"] and len(saved["queued"]["1"]["episodes"]) == config.data.global_batch_size
  # Step 1's weights differ from the copy's: only episodes kept from that copy give step 1 its batch.
  moved = jax.tree.map(lambda x: x * 2.0, state.params)
  later = dataclasses.replace(state, step=jnp.asarray(1, jnp.int32), params=moved)
  ours, ours_scalars = data.next_for(later)
  again = rollouts.RolloutBatches(config, run.mesh, run.batch_sharding)
  again.set_state(saved)
  theirs, theirs_scalars = again.next_for(later)
  for name in ours:
    np.testing.assert_array_equal(np.asarray(theirs[name]), np.asarray(ours[name]), err_msg=name)
  assert theirs_scalars["policy_lag"] == ours_scalars["policy_lag"] == 1.0
  assert theirs_scalars["reward"] == ours_scalars["reward"]
  forgot = rollouts.RolloutBatches(config, run.mesh, run.batch_sharding)
  forgot.set_state({k: v for k, v in saved.items() if k != "queued"})  # what a checkpoint without them gave
  fresh, _ = forgot.next_for(later)  # sampled again, from step 1's weights
  assert not np.array_equal(np.asarray(fresh["targets"]), np.asarray(ours["targets"]))
