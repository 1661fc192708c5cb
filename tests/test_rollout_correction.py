"""Off-policy correction (rl_importance_sampling) against TRL's GRPOTrainer for vLLM rollouts: TRL's
own code computes the importance weights and the sampling metrics from the same trainer and sampler
log-probs, and its `_compute_loss` applies them; ours must give the same weights, metrics, loss and
gradient, for every mode, in fp32."""

from __future__ import annotations

import collections
import inspect
import math
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.errors import ConfigError
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from MaxText.input_pipeline.batch_spec import SAMPLER_LOGPS
from MaxText.platform import sharding
from MaxText.rl import rewards, rollouts
from MaxText.training import run_assembly
from MaxText.training.objectives import grpo_loss, rollout_correction
from tests.test_grpo_loss import MAX_COMPLETION, ROWS, TOKENS, _case, trl_compute_loss

MODES = [m for m in rollout_correction.MODES if m != "off"]


CONDITION = "if self.use_vllm and self.vllm_importance_sampling_correction:"


def _trl_blocks(method) -> list[str]:
  """Every `if <CONDITION>` statement of a GRPOTrainer method (the line and its indented body), dedented."""
  source = textwrap.dedent(inspect.getsource(method)).splitlines()
  blocks = []
  for start, line in enumerate(source):
    if line.strip() != CONDITION:
      continue
    indent = len(line) - len(line.lstrip())
    body = [line]
    for later in source[start + 1:]:
      if later.strip() and len(later) - len(later.lstrip()) <= indent:
        break
      body.append(later)
    blocks.append(textwrap.dedent("\n".join(body)))
  return blocks


def _sampler_case(seed: int) -> dict[str, np.ndarray]:
  case = _case(seed)
  rng = np.random.default_rng(seed + 100)
  # the trainer's π_old = case["old"]; the engine's μ differs by small numerical noise and a few
  # large gaps both ways, so the cap, the floor, truncation and rejection all bite
  sampler = case["old"] + rng.normal(0, 0.05, case["old"].shape)
  sampler[0, 1] -= 2.0
  sampler[3, 2] += 1.5
  case["sampler"] = sampler
  return case


def _trl_weights_and_metrics(case: dict[str, np.ndarray], mode: str, cap: float, floor: float | None):
  """TRL's importance weights and sampling metrics (its _generate_and_score_completions code)."""
  torch = pytest.importorskip("torch", reason="the TRL comparison needs torch (requirements-hf.txt)")
  trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs trl (requirements-test.txt)")
  blocks = _trl_blocks(trl_grpo.GRPOTrainer._generate_and_score_completions)
  weights_code = next(b for b in blocks if "vllm_importance_sampling_ratio = torch.exp" in b)
  metrics_code = next(b for b in blocks if "sampling_logp_difference" in b)
  metrics: dict[str, list[float]] = collections.defaultdict(list)
  identity = lambda x: x  # noqa: E731  (one process)
  trainer = types.SimpleNamespace(
      use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
      vllm_importance_sampling_clip_max=cap, vllm_importance_sampling_clip_min=floor,
      accelerator=types.SimpleNamespace(gather=identity), _metrics={"train": metrics})
  scope = {"self": trainer, "torch": torch, "math": math, "tool_mask": None, "mode": "train", "device": "cpu",
           "nanmin": trl_grpo.nanmin, "nanmax": trl_grpo.nanmax,
           "completion_mask": torch.tensor(case["mask"], dtype=torch.float32),
           "old_per_token_logps": torch.tensor(case["old"], dtype=torch.float32),
           "sampling_per_token_logps": torch.tensor(case["sampler"], dtype=torch.float32)}
  exec(weights_code, scope)  # noqa: S102  (TRL's own lines, read from the installed package)
  exec(metrics_code, scope)  # noqa: S102
  return scope["vllm_importance_sampling_ratio"].numpy(), {name: values[-1] for name, values in metrics.items()}


def _ours(case: dict[str, np.ndarray], mode: str, cap: float, floor: float):
  old, sampler, mask = (jnp.asarray(case[k], jnp.float32) for k in ("old", "sampler", "mask"))
  weights, ratio = rollout_correction.weights(old, sampler, mask, mode, cap, floor)
  metrics = rollout_correction.metrics(old, sampler, mask, weights, ratio)
  return np.asarray(weights), np.asarray(ratio), {k: float(v) for k, v in metrics.items()}


CAPS = [(3.0, None), (2.0, 0.5), (1.2, 0.9)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap,floor", CAPS)
def test_weights_and_metrics_equal_trl(mode, cap, floor):
  case = _sampler_case(seed=7)
  trl_weights, trl_metrics = _trl_weights_and_metrics(case, mode, cap, floor)
  weights, ratio, metrics = _ours(case, mode, cap, 0.0 if floor is None else floor)
  np.testing.assert_allclose(weights, trl_weights, rtol=1e-6, atol=1e-7)
  assert trl_metrics and set(trl_metrics) <= set(metrics)
  for name, value in trl_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
  if (cap, floor) == (1.2, 0.9):  # the case does correct: the comparison covers the truncated / rejected branch
    assert metrics["sampling/importance_sampling_corrected"] > 0
    assert np.any(weights != ratio)


def test_nan_sampler_log_probs_weigh_one_and_are_left_out_of_the_metrics():
  """A token the engine could not score (NaN) gets weight 1, as in TRL, and no part in the mismatch."""
  case = _sampler_case(seed=8)
  case["sampler"][1, 0] = np.nan
  trl_weights, trl_metrics = _trl_weights_and_metrics(case, "token_truncate", 3.0, None)
  weights, _, metrics = _ours(case, "token_truncate", 3.0, 0.0)
  np.testing.assert_allclose(weights, trl_weights, rtol=1e-6, atol=1e-7)
  assert weights[1, 0] == 1.0
  for name, value in trl_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _trl_loss(case, weights, loss_type: str, beta: float):
  loss, grad, _ = trl_compute_loss({k: v for k, v in case.items() if k != "entropy"}, loss_type, 0.2, 0.28, beta,
                                   dtype="float32", importance_weights=weights)
  return loss, grad


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.0)])
def test_weighted_loss_and_gradient_equal_trl(mode, loss_type, beta):
  case = _sampler_case(seed=9)
  weights, _, _ = _ours(case, mode, 1.5, 0.5)
  trl_loss, trl_grad = _trl_loss(case, weights, loss_type, beta)

  def loss(logps):
    sums = grpo_loss.loss_sums(logps, jnp.asarray(case["old"], jnp.float32), jnp.asarray(case["ref"], jnp.float32),
                               jnp.asarray(case["advantages"], jnp.float32), jnp.asarray(case["mask"], jnp.float32),
                               None, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta,
                               max_completion_length=MAX_COMPLETION,
                               importance_weights_BL=jnp.broadcast_to(jnp.asarray(weights), (ROWS, TOKENS)))
    return sums["loss_sum"] / grpo_loss.divisor(sums, loss_type)

  value, grad = jax.value_and_grad(loss)(jnp.asarray(case["logps"], jnp.float32))
  np.testing.assert_allclose(float(value), trl_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), trl_grad, rtol=1e-5, atol=1e-7)


# ---- the step on the 8-device mesh ---------------------------------------------------------------

def _grpo_config(tiny_overrides, **extra):
  from tests.test_grpo import _config  # noqa: PLC0415  (the GRPO test config, shared)
  return _config(tiny_overrides, **{**dict(per_device_batch_size=1, learning_rate=1e-2, warmup_steps_fraction=0.0,
                                           dtype="float32"), **extra})


@pytest.mark.slow  # builds two runs and compiles the engine and two steps
def test_the_engine_records_the_trainers_log_probs_and_equal_ones_leave_the_step_unchanged(tiny_overrides):
  """The engine's log-prob of each sampled token lands on that token's target (float32: equal to
  the trainer's to float tolerance); with the sampler's log-probs set to the trainer's, a step with
  the correction on is the step with it off (weights 1, nothing truncated or masked)."""
  runs = {mode: run_assembly.build_run(_grpo_config(tiny_overrides, rl_importance_sampling=mode, grpo_beta=0.05))
          for mode in ("off", "token_mask")}
  run = runs["off"]
  state = run.init_state()
  engine = Engine(run.config, num_slots=8, mesh=run.mesh)
  prompts = [[1, 2, 3, (i % 4) + 4] for i in range(2) for _ in range(4)]
  row_params = [RowParams(1.0, 1.0, 0, seed) for seed in range(8)]
  completions, logps = rollouts.generate_scored(engine, state.params, prompts, row_params, max_new_tokens=6,
                                                eos_id=None)
  assert completions == rollouts.generate(engine, state.params, prompts, row_params, max_new_tokens=6, eos_id=None)
  rows = rollouts.training_rows(prompts, completions, run.config.data.max_target_length, logps)
  scores = np.asarray([np.mean(np.asarray(c) < 64) for c in completions])
  rows["advantages"] = rewards.advantages(scores, 4, "group")[0].astype(np.float32)
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  with sharding.unsharded():
    trainer_BL = np.asarray(grpo_loss.token_logps(models.build_model_spec(run.config.model), state.params, batch,
                                                  None, with_entropy=False)[0])
  mask = rows["targets_segmentation"] > 0
  np.testing.assert_allclose(rows[SAMPLER_LOGPS][mask], trainer_BL[mask], atol=2e-4)
  assert np.all(rows[SAMPLER_LOGPS][~mask] == 0)

  batch[SAMPLER_LOGPS] = jnp.asarray(np.where(mask, trainer_BL, 0.0).astype(np.float32))
  results = {mode: r.train_step(r.init_state(), batch, jax.random.key(0)) for mode, r in runs.items()}
  (off_state, off), (on_state, on) = results["off"], results["token_mask"]
  for name in ("loss", "grad_norm", "kl", "entropy"):
    np.testing.assert_allclose(float(on[name]), float(off[name]), rtol=1e-5, atol=1e-6, err_msg=name)
  # The weights are 1 to float rounding (two compiled forwards). Adam (lr 1e-2) steps each parameter by
  # about lr whatever its gradient's size, so a gradient that nearly cancels, with a relative rounding of
  # 1e-3, moves by 1e-5 (1.2e-5 seen): 1e-4 is 1% of a step; a weight that is not 1 moves whole steps.
  for a, b in zip(jax.tree.leaves(on_state.params), jax.tree.leaves(off_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
  assert float(on["sampling/importance_sampling_corrected"]) == 0
  assert float(on["sampling/importance_sampling_ratio/max"]) == pytest.approx(1.0, abs=1e-5)
  assert float(on["sampling/kl"]) == pytest.approx(0.0, abs=1e-6)
  assert "sampling/kl" not in off


@pytest.mark.slow  # builds two runs and compiles two steps
def test_the_metrics_and_weights_do_not_depend_on_micro_batches(tiny_overrides):
  """Weights and metrics come from the whole rollout batch: with gradient accumulation (and two
  updates per batch) the step logs the same mismatch and trains like one without."""
  base = dict(rl_importance_sampling="sequence_truncate", rl_importance_sampling_cap=1.5, grpo_num_iterations=2)
  runs = [run_assembly.build_run(_grpo_config(tiny_overrides, per_device_batch_size=2,
                                              gradient_accumulation_steps=micro, **base)) for micro in (1, 2)]
  rng = np.random.default_rng(0)
  prompts = [[1, 2, 3, (i % 4) + 4] for i in range(4) for _ in range(4)]
  completions = [[int(t) for t in rng.integers(5, 200, 6)] for _ in range(16)]
  logps = [[float(p) for p in rng.uniform(-10.0, -7.0, 6)] for _ in range(16)]  # below the model's: weights clip
  rows = rollouts.training_rows(prompts, completions, runs[0].config.data.max_target_length, logps)
  rows["advantages"] = rng.normal(0, 1, 16).astype(np.float32)
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  (_, one), (_, two) = (r.train_step(r.init_state(), batch, jax.random.key(0)) for r in runs)
  for name in rollout_correction.METRICS + ("loss",):
    np.testing.assert_allclose(float(two[name]), float(one[name]), rtol=1e-5, atol=1e-6, err_msg=name)
  assert 0 < float(one["sampling/importance_sampling_corrected"]) and float(one["sampling/kl"]) > 0


@pytest.mark.parametrize("overrides, message", [
    (dict(rl_importance_sampling="tis"), "rl_importance_sampling must be one of off, token_truncate, token_mask, "
     "sequence_truncate, sequence_mask; got 'tis'"),
    (dict(rl_importance_sampling="token_truncate", rl_importance_sampling_cap=0.0),
     "rl_importance_sampling_cap must be a finite number >= 1"),
    (dict(rl_importance_sampling="sequence_mask", rl_importance_sampling_cap=0.8),
     "rl_importance_sampling_cap must be a finite number >= 1"),
    (dict(rl_importance_sampling="token_mask", rl_importance_sampling_floor=1.5),
     "rl_importance_sampling_floor must be in [0, 1]"),
    (dict(rl_importance_sampling="token_mask", rl_importance_sampling_floor=-0.1),
     "rl_importance_sampling_floor must be in [0, 1]"),
    (dict(rl_importance_sampling="token_truncate", rl_sampling_temperature=0.7),
     "but the rollouts sample with rl_sampling_temperature=0.7"),
    (dict(rl_importance_sampling="token_truncate", rl_sampling_top_p=0.9), "rl_sampling_top_p=0.9"),
])
def test_configuration_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    _grpo_config(tiny_overrides, **overrides)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_off_accepts_any_cap_and_sampling(tiny_overrides):
  config = _grpo_config(tiny_overrides, rl_importance_sampling_cap=0.0, rl_sampling_temperature=0.7)
  assert config.rl.rl_importance_sampling == "off"


def test_the_mode_parses_from_the_command_line():
  from MaxText.configuration import config as config_lib  # noqa: PLC0415
  overrides = config_lib.parse_overrides(["train.py", "rl_importance_sampling=off"])
  assert overrides.argv_values["rl_importance_sampling"] == "off"  # the string, not YAML's boolean


@pytest.mark.slow  # a train.py process that compiles the rollout engine and the step
def test_a_run_with_the_correction_logs_the_mismatch_every_step(tmp_path_factory, tmp_path):
  """train.py end to end: the sampler's log-probs travel with the batch through the real rollout
  and every step logs the mismatch metrics, finite and consistent."""
  from tests import test_grpo_run  # noqa: PLC0415  (its prompts, tokenizer, starting weights and command)
  workdir = tmp_path_factory.mktemp("grpo_correction")
  test_grpo_run.prepare(workdir)
  (workdir / "task_rewards.py").write_text(test_grpo_run.REWARDS)
  proc = test_grpo_run._train(workdir, tmp_path, "steps=3", "rl_importance_sampling=token_truncate",
                              "rl_importance_sampling_cap=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = test_grpo_run._metrics(tmp_path)
  assert len(records) == 3
  for record in records:
    for name in rollout_correction.METRICS:
      assert math.isfinite(record[name]), (name, record)
    assert record["sampling/kl"] >= 0 and 0 <= record["sampling/importance_sampling_corrected"] <= 1
    assert record["sampling/importance_sampling_ratio/max"] <= 2.0 + 1e-6
    assert record["sampling/sampling_logp_difference/max"] >= record["sampling/sampling_logp_difference/mean"]
