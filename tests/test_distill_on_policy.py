"""On-policy distillation (objective=grpo with rl_teacher_kl_weight > 0): the per-token advantage, the
loss and its gradient against a float64 NumPy reference and TRL's GRPOTrainer (which takes per-token
advantages) on fixed log-probs; a step with a teacher in the state; bad input in one line each."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.platform import accelerators, sharding
from MaxText.rl import rollouts
from MaxText.training import params_io
from MaxText.training.objectives import grpo_loss, teacher_advantage
from MaxText.training.objectives.grpo import TeacherRLState
from MaxText.training.run_assembly import build_run
from tests.test_grpo_loss import MAX_COMPLETION, ROWS, TOKENS, trl_compute_loss

# ---- the per-token advantage, the loss and its gradient --------------------------------------------


def _case(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  logps = rng.uniform(-3.0, -0.1, (ROWS, TOKENS))
  mask = np.zeros((ROWS, TOKENS))
  for row, length in enumerate([5, 3, 1, 4, 2, 5]):
    mask[row, :length] = 1
  return {"logps": logps, "old": logps + rng.normal(0, 0.4, logps.shape),  # ratios that clip both ways
          "teacher": rng.uniform(-4.0, -0.05, (ROWS, TOKENS)), "reward_advantages": rng.normal(0, 1, ROWS),
          "entropy": rng.uniform(0.5, 3.0, (ROWS, TOKENS)), "mask": mask}


def _reference(case: dict[str, np.ndarray], loss_type: str, eps_low: float, eps_high: float, reward_weight: float,
               kl_weight: float) -> tuple[float, np.ndarray, float]:
  """float64 NumPy: (the loss, d loss / d logps, the teacher_kl metric), written out by hand."""
  logps, old, teacher, mask = case["logps"], case["old"], case["teacher"], case["mask"]
  advantages = reward_weight * case["reward_advantages"][:, None] + kl_weight * (teacher - old) * mask
  ratio = np.exp(logps - old)
  clipped = np.clip(ratio, 1 - eps_low, 1 + eps_high)
  per_token = -np.minimum(ratio * advantages, clipped * advantages)
  # d/d logp of -min(r A, clip(r) A): -r A where the unclipped term is the smaller one (or the clip is inactive).
  inside = (ratio >= 1 - eps_low) & (ratio <= 1 + eps_high)
  d_per_token = np.where(inside | (ratio * advantages <= clipped * advantages), -ratio * advantages, 0.0)
  tokens = mask.sum(axis=1)
  if loss_type == "grpo":
    loss = np.sum((per_token * mask).sum(axis=1) / tokens) / ROWS
    grad = d_per_token * mask / tokens[:, None] / ROWS
  elif loss_type == "dapo":
    loss, grad = np.sum(per_token * mask) / mask.sum(), d_per_token * mask / mask.sum()
  else:
    loss = np.sum(per_token * mask) / MAX_COMPLETION / ROWS
    grad = d_per_token * mask / MAX_COMPLETION / ROWS
  return float(loss), grad, float(np.sum((old - teacher) * mask) / mask.sum())


def _ours(case: dict[str, np.ndarray], loss_type: str, eps_low: float, eps_high: float, reward_weight: float,
          kl_weight: float) -> tuple[float, np.ndarray, float]:
  def loss(logps: jax.Array) -> tuple[jax.Array, jax.Array]:
    mask, old, teacher = (jnp.asarray(case[k]) for k in ("mask", "old", "teacher"))
    advantages = teacher_advantage.token_advantages(jnp.asarray(case["reward_advantages"]), old, teacher, mask,
                                                    reward_weight, kl_weight)
    sums = grpo_loss.loss_sums(logps, old, None, advantages, mask, None, loss_type=loss_type, epsilon_low=eps_low,
                               epsilon_high=eps_high, beta=0.0, max_completion_length=MAX_COMPLETION)
    kl = teacher_advantage.reverse_kl_sum(old, teacher, mask) / sums["weight_sum"]
    return sums["loss_sum"] / grpo_loss.divisor(sums, loss_type), kl

  with jax.enable_x64(True):
    (value, kl), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(case["logps"]))
  return float(value), np.asarray(grad), float(kl)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("reward_weight, kl_weight", [(0.0, 1.0), (1.0, 0.5), (0.3, 2.0)])
def test_the_per_token_loss_and_gradient_equal_a_float64_reference(loss_type, reward_weight, kl_weight):
  case = _case(seed=11)
  expected = _reference(case, loss_type, 0.2, 0.28, reward_weight, kl_weight)
  loss, grad, kl = _ours(case, loss_type, 0.2, 0.28, reward_weight, kl_weight)
  np.testing.assert_allclose(loss, expected[0], rtol=1e-12)
  np.testing.assert_allclose(grad, expected[1], rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(kl, expected[2], rtol=1e-12)


def test_with_one_update_the_gradient_is_the_per_token_reverse_kl_policy_gradient():
  """Distillation alone, one update (π_old = π): the loss's gradient at each sampled token is
  (log π - log p_teacher) / tokens, the reverse KL's score-function gradient with a discount of 0."""
  case = _case(seed=12)
  case["old"] = case["logps"]
  _, grad, kl = _ours(case, "dapo", 0.2, 0.2, 0.0, 1.0)
  mask = case["mask"]
  np.testing.assert_allclose(grad, (case["logps"] - case["teacher"]) * mask / mask.sum(), rtol=1e-12, atol=1e-15)
  assert kl == pytest.approx(np.sum((case["logps"] - case["teacher"]) * mask) / mask.sum(), rel=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_per_token_loss_equals_trls_with_per_token_advantages(loss_type):
  """TRL's GRPOTrainer._compute_loss takes a [B, T] advantage as it is: the same loss and gradient."""
  case = _case(seed=13)
  advantages = 0.5 * case["reward_advantages"][:, None] + (case["teacher"] - case["old"]) * case["mask"]
  trl_loss, trl_grad, _ = trl_compute_loss({**case, "advantages": advantages, "ref": case["logps"]}, loss_type,
                                           0.2, 0.28, 0.0)
  loss, grad, _ = _ours(case, loss_type, 0.2, 0.28, 0.5, 1.0)
  np.testing.assert_allclose(loss, trl_loss, rtol=1e-6)
  np.testing.assert_allclose(grad, trl_grad, rtol=1e-6, atol=1e-9)


# ---- a step with the teacher in the state -----------------------------------------------------------

GRPO = dict(objective="grpo", dataset_type="hf", hf_data_files="prompts.jsonl", tokenizer_type="huggingface",
            tokenizer_path="tokenizer", eval_interval=-1, reward_functions="exact_match", num_generations=4,
            max_prefill_predict_length=8, max_completion_length=6, max_target_length=16)
TEACHER_MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                     base_num_decoder_layers=3, vocab_size=128)


def _teacher_overrides(**changes: object) -> str:
  return ",".join(f"{k}={v}" for k, v in {**TEACHER_MODEL, **changes}.items())


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
  """A random 3-layer teacher of the tiny models' vocabulary, saved as a parameters-only checkpoint."""
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  config = Config.for_testing(one_device, **TEACHER_MODEL, max_target_length=16, print_config=False)
  path = str(tmp_path_factory.mktemp("teacher") / "params")
  params_io.save_params(path, jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(7)))
  return path


def _config(tiny_overrides: dict, teacher: str, **overrides: object) -> Config:
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  values = dict(tiny_overrides, **GRPO, per_device_batch_size=8, distill_teacher_path=teacher,
                distill_teacher_model_name="default", distill_teacher_overrides=_teacher_overrides(),
                rl_teacher_kl_weight=1.0, rl_reward_advantage_weight=0.0, dtype="float32", learning_rate=1e-2,
                warmup_steps_fraction=0.0)
  return Config.for_testing(one_device, **{**values, **overrides})


def _logps(model: models.ModelSpec, params: object, batch: dict[str, jax.Array]) -> np.ndarray:
  with sharding.unsharded():
    return np.asarray(grpo_loss.token_logps(model, params, batch, None, with_entropy=False)[0])


def test_a_step_scores_the_completions_with_the_teacher_and_logs_the_kl(tiny_overrides, teacher_path):
  config = _config(tiny_overrides, teacher_path)
  run = build_run(config, devices=jax.devices()[:1])
  state = run.init_state()
  assert isinstance(state, TeacherRLState) and state.reference is None
  teacher = run.objective.teacher  # type: ignore[attr-defined]
  saved = params_io.load_params(teacher_path, teacher.model.abstract_params,
                                jax.tree.map(lambda x: x.sharding, state.teacher))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.teacher), jax.tree.leaves(saved)))
  assert run.objective.forward_only_models == (teacher.model.cfg,)
  prompts = [[1, 2, 3, (i % 4) + 4] for i in range(2) for _ in range(4)]
  completions = [[(7 * i + 3 * t) % 120 + 5 for t in range(1 + i % 5)] for i in range(8)]
  rows = rollouts.training_rows(prompts, completions, config.data.max_target_length)
  rows["advantages"] = np.linspace(-1, 1, 8, dtype=np.float32)  # weighed 0 here
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  mask = rows["targets_segmentation"].astype(np.float64)
  expected = np.sum((_logps(run.objective.model, state.params, batch) - _logps(teacher.model, state.teacher, batch)) * mask)
  before = jax.tree.map(np.asarray, state.teacher)
  state, step_metrics = run.train_step(state, batch, jax.random.key(0))
  assert float(step_metrics["teacher_kl"]) == pytest.approx(expected / mask.sum(), rel=1e-5)
  assert float(step_metrics["grad_norm"]) > 0
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.teacher)))


def test_the_student_as_its_own_teacher_has_kl_zero_and_nothing_to_learn(tiny_overrides, tmp_path):
  """A teacher equal to the student: every token's advantage is 0, so is the gradient."""
  config = _config(tiny_overrides, str(tmp_path / "same"), distill_teacher_overrides=_teacher_overrides(base_num_decoder_layers=2))
  student = models.build_model_spec(config.model)
  params = jax.jit(student.init_params)(jax.random.key(3))
  params_io.save_params(str(tmp_path / "same"), params)
  run = build_run(config, devices=jax.devices()[:1])
  state = dataclasses.replace(run.init_state(), params=params)
  rows = rollouts.training_rows([[1, 2, 3]] * 8, [[5 + i, 9, 11] for i in range(8)], config.data.max_target_length)
  rows["advantages"] = np.zeros(8, np.float32)
  _, step_metrics = run.train_step(state, {k: jnp.asarray(v) for k, v in rows.items()}, jax.random.key(0))
  assert float(step_metrics["teacher_kl"]) == 0.0 and float(step_metrics["grad_norm"]) == 0.0


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(distill_teacher_path=""), "rl_teacher_kl_weight=1.0 distils from a teacher on the rollouts: set "
     "distill_teacher_path"),
    (dict(rl_teacher_kl_weight=0.0), "but rl_teacher_kl_weight=0: the teacher would be loaded and never used"),
    (dict(rl_teacher_kl_weight=-1.0), "rl_teacher_kl_weight must be a finite number >= 0"),
    (dict(rl_reward_advantage_weight=float("nan")), "rl_reward_advantage_weight must be a finite number >= 0"),
])
def test_configuration_errors_are_one_line(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    _config(tiny_overrides, "teacher", **overrides)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_no_advantage_at_all_is_refused(tiny_overrides):
  with pytest.raises(ConfigError, match="rl_reward_advantage_weight=0 and rl_teacher_kl_weight=0 leave every "
                     "advantage 0"):
    _config(tiny_overrides, "", rl_teacher_kl_weight=0.0)


def test_a_teacher_shorter_than_the_students_context_is_one_line_naming_the_teacher(tiny_overrides, tmp_path):
  """The teacher runs on the student's rows (max_target_length 16): a learned position table of 8 rows cannot. The
  line named max_position_embeddings alone, which the student (rope) does not have."""
  short = _teacher_overrides(position_embedding="learned", max_position_embeddings=8)
  with pytest.raises(ConfigError) as error:
    build_run(_config(tiny_overrides, str(tmp_path), distill_teacher_overrides=short), devices=jax.devices()[:1])
  assert str(error.value).startswith(f"rl_teacher_kl_weight > 0: the teacher (distill_teacher_path={tmp_path}) with "
                                     "this run's other keys: max_target_length (16) exceeds max_position_embeddings (8)")


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_one_line(tiny_overrides, teacher_path, tmp_path):
  with pytest.raises(UserError, match="the teacher .* has vocab_size=256, the student 128: .* same tokenizer"):
    build_run(_config(tiny_overrides, teacher_path, distill_teacher_overrides=_teacher_overrides(vocab_size=256)),
              devices=jax.devices()[:1])
  with pytest.raises(UserError, match="distill_teacher_path .*nowhere does not exist"):
    build_run(_config(tiny_overrides, str(tmp_path / "nowhere")), devices=jax.devices()[:1])
  with pytest.raises(ConfigError, match="rl_teacher_kl_weight > 0: no model_config.yml or run config.yml is saved "
                     "with distill_teacher_path="):
    build_run(_config(tiny_overrides, teacher_path, distill_teacher_model_name=""), devices=jax.devices()[:1])
  run_dir = tmp_path / "teacher_run"
  run_record.record_start(Config.for_testing(**TEACHER_MODEL, tokenizer_path="other_tokenizer", print_config=False),
                          str(run_dir))
  with pytest.raises(UserError, match="was trained with tokenizer other_tokenizer .* the student reads tokenizer"):
    build_run(_config(tiny_overrides, str(run_dir), distill_teacher_model_name=""), devices=jax.devices()[:1])


# ---- resume -----------------------------------------------------------------------------------------

@pytest.mark.slow  # three training processes
def test_a_distillation_run_stopped_and_rerun_trains_bitwise_like_the_whole_run(tmp_path):
  """The teacher is saved with the run's checkpoints, the rollouts are seeded by the step: a run
  stopped at its checkpoint and rerun logs exactly the uninterrupted run's steps."""
  from tests.test_grpo_run import MODEL, REWARDS, _metrics, _train, prepare

  prepare(tmp_path)
  (tmp_path / "task_rewards.py").write_text(REWARDS)
  teacher_model = {**MODEL, "base_num_decoder_layers": 3}
  config = Config.for_testing(**teacher_model)
  params_io.save_params(str(tmp_path / "teacher"),
                        jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(5)))
  overrides = ",".join(f"{k}={v}" for k, v in teacher_model.items() if k != "max_target_length")
  extra = (f"distill_teacher_path={tmp_path / 'teacher'}", "distill_teacher_model_name=default",
           f"distill_teacher_overrides={overrides}", "rl_teacher_kl_weight=1", "rl_reward_advantage_weight=0.5",
           "checkpoint_period=3")
  whole = _train(tmp_path, tmp_path / "whole", "steps=6", *extra)
  assert whole.returncode == 0, whole.stderr[-3000:]
  first = _train(tmp_path, tmp_path / "halves", "steps=3", *extra)
  second = _train(tmp_path, tmp_path / "halves", "steps=6", *extra)
  assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
  assert "state: resumed from step 3" in second.stdout
  keys = ("reward", "loss", "grad_norm", "teacher_kl", "entropy")
  records, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "halves")
  assert all(r["teacher_kl"] > 0 for r in records)  # a random teacher: far from the student
  assert [[r[k] for k in keys] for r in resumed if r["step"] > 3] == [[r[k] for k in keys] for r in records[3:]]
