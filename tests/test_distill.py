"""Distillation (objective=distill): the loss and its gradient against a float64 NumPy reference and
TRL's GKD loss, a short run from a tiny random teacher, the teacher's FLOPs, bad input, and (slow) a
killed run rerun bitwise."""

from __future__ import annotations

import dataclasses
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import models
from MaxText.aot import memory_report
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.platform import accelerators
from MaxText.training import metrics, params_io
from MaxText.training.objectives import distill_loss
from MaxText.training.objectives.distill import DistillState
from MaxText.training.run_assembly import build_run

# ---- the loss and its gradient against float64 references ----------------------------------------

V = 13


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _reference(student: np.ndarray, teacher: np.ndarray, labels: np.ndarray, weights: np.ndarray, kind: str,
               alpha: float, temperature: float, top_k: int) -> tuple[float, np.ndarray]:
  """(Σ_tokens w·(α τ² KL + (1 - α) CE), its gradient in the student's logits), in float64, the KL
  over the teacher's top k renormalised on both sides (k = 0: the full vocabulary)."""
  student, teacher = student.astype(np.float64), teacher.astype(np.float64)
  s, log_p_full = student / temperature, _log_softmax(teacher / temperature)
  total, grad = 0.0, np.zeros_like(student)
  for index in np.ndindex(*student.shape[:-1]):
    keep = np.argsort(-teacher[index])[:top_k] if top_k else np.arange(student.shape[-1])
    log_p = log_p_full[index][keep] - np.log(np.exp(log_p_full[index][keep]).sum())
    log_q = _log_softmax(s[index][keep])
    p, q = np.exp(log_p), np.exp(log_q)
    if kind == "forward_kl":
      kl, d_s = float(np.sum(p * (log_p - log_q))), q - p
    else:
      kl = float(np.sum(q * (log_q - log_p)))
      d_s = q * (log_q - log_p - kl)
    log_softmax = _log_softmax(student[index])
    xent = -log_softmax[labels[index]]
    d_xent = np.exp(log_softmax)
    d_xent[labels[index]] -= 1.0
    total += weights[index] * (alpha * temperature ** 2 * kl + (1 - alpha) * xent)
    grad[index] += weights[index] * (1 - alpha) * d_xent
    grad[index][keep] += weights[index] * alpha * temperature * d_s  # τ² · (1/τ) from s = z / τ
  return total, grad


def _fixed_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  rng = np.random.RandomState(0)
  student = (2.0 * rng.randn(2, 3, V)).astype(np.float32)
  teacher = (3.0 * rng.randn(2, 3, V)).astype(np.float32)
  labels = rng.randint(0, V, size=(2, 3)).astype(np.int32)
  weights = np.array([[1, 1, 1], [1, 1, 0]], np.float32)  # one padded target
  return student, teacher, labels, weights


def _loss(student: jax.Array, teacher: jax.Array, labels: jax.Array, weights: jax.Array, kind: str, alpha: float,
          temperature: float, top_k: int) -> jax.Array:
  """What Distill.loss_sums computes from the two models' logits."""
  targets = distill_loss.teacher_targets(teacher, temperature, top_k)
  kl = jnp.sum(distill_loss.token_kl(student, targets, kind, temperature) * weights)
  xent = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(student, labels) * weights)
  return distill_loss.mixed(kl, xent, alpha, temperature)


def test_the_reference_gradient_is_the_reference_losss_derivative():
  """The float64 reference's analytic gradient against central differences of its own loss."""
  student, teacher, labels, weights = _fixed_inputs()
  for kind, top_k in (("forward_kl", 0), ("reverse_kl", 4)):
    _, grad = _reference(student, teacher, labels, weights, kind, 0.7, 1.7, top_k)
    numeric = np.zeros_like(grad)
    for index in np.ndindex(*student.shape):
      up, down = student.astype(np.float64), student.astype(np.float64)
      up[index] += 1e-6
      down[index] -= 1e-6
      numeric[index] = (_reference(up, teacher, labels, weights, kind, 0.7, 1.7, top_k)[0]
                        - _reference(down, teacher, labels, weights, kind, 0.7, 1.7, top_k)[0]) / 2e-6
    np.testing.assert_allclose(grad, numeric, atol=1e-6)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("alpha, temperature, top_k", [(1.0, 1.0, 0), (1.0, 2.5, 0), (1.0, 1.0, 4), (1.0, 0.7, 4),
                                                       (0.3, 2.0, 0), (0.3, 2.0, 5), (0.0, 1.0, 0)])
def test_the_loss_and_its_gradient_equal_a_float64_reference(kind, alpha, temperature, top_k):
  student, teacher, labels, weights = _fixed_inputs()
  expected, expected_grad = _reference(student, teacher, labels, weights, kind, alpha, temperature, top_k)
  loss, grad = jax.value_and_grad(_loss)(jnp.asarray(student), jnp.asarray(teacher), labels, weights, kind, alpha,
                                         temperature, top_k)
  assert float(loss) == pytest.approx(expected, rel=2e-6, abs=2e-6)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=2e-6)


def test_top_k_keeps_indices_and_log_probs_and_equals_the_full_kl_when_k_is_the_vocabulary():
  student, teacher, _, _ = _fixed_inputs()
  targets = distill_loss.teacher_targets(jnp.asarray(teacher), 1.0, 4)
  assert targets.indices is not None and targets.indices.shape == (2, 3, 4) and targets.indices.dtype == jnp.int32
  assert targets.logps.shape == (2, 3, 4)
  np.testing.assert_array_equal(np.asarray(targets.indices), np.argsort(-teacher, axis=-1)[..., :4])
  for kind in ("forward_kl", "reverse_kl"):
    full = distill_loss.token_kl(jnp.asarray(student), distill_loss.teacher_targets(jnp.asarray(teacher), 2.0, 0),
                                 kind, 2.0)
    every = distill_loss.token_kl(jnp.asarray(student), distill_loss.teacher_targets(jnp.asarray(teacher), 2.0, V),
                                  kind, 2.0)
    np.testing.assert_allclose(np.asarray(every), np.asarray(full), rtol=1e-5, atol=1e-6)
  # A student equal to the teacher has no divergence, full or top-k.
  same = distill_loss.token_kl(jnp.asarray(teacher), targets, "forward_kl", 1.0)
  np.testing.assert_allclose(np.asarray(same), 0.0, atol=1e-6)


def test_forward_and_reverse_kl_equal_trls_generalized_jsd_at_beta_0_and_1():
  """TRL's GKD loss: beta=0 is F.kl_div(student, teacher) = KL(teacher || student) (our forward_kl),
  beta=1 is F.kl_div(teacher, student) = KL(student || teacher) (reverse_kl); TRL has no τ² factor,
  and averages over the unmasked tokens (labels != -100)."""
  torch = pytest.importorskip("torch")
  gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
  student, teacher, labels, weights = _fixed_inputs()
  masked_labels = torch.tensor(np.where(weights > 0, labels, -100), dtype=torch.long)
  for beta, kind in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
    for temperature in (1.0, 2.0):
      student_t = torch.tensor(student, requires_grad=True)
      theirs = gkd.GKDTrainer.generalized_jsd_loss(student_t, torch.tensor(teacher), labels=masked_labels, beta=beta,
                                                   temperature=temperature)
      theirs.backward()

      def ours(logits: jax.Array) -> jax.Array:
        kl = distill_loss.token_kl(logits, distill_loss.teacher_targets(jnp.asarray(teacher), temperature, 0), kind,
                                   temperature)
        return jnp.sum(kl * weights) / jnp.sum(weights)

      value, grad = jax.value_and_grad(ours)(jnp.asarray(student))
      assert float(value) == pytest.approx(float(theirs), rel=1e-5)
      np.testing.assert_allclose(np.asarray(grad), student_t.grad.numpy(), rtol=1e-4, atol=1e-6)


# ---- the objective in a run -------------------------------------------------------------------------

TEACHER_MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                     base_num_decoder_layers=4, vocab_size=128)


def _teacher_overrides(**changes: object) -> str:
  return ",".join(f"{k}={v}" for k, v in {**TEACHER_MODEL, **changes}.items())


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
  """A random 4-layer teacher of the tiny models' vocabulary, saved as a parameters-only checkpoint."""
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  config = Config.for_testing(one_device, **TEACHER_MODEL, max_target_length=32, print_config=False)
  path = str(tmp_path_factory.mktemp("teacher") / "params")
  params_io.save_params(path, jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(7)))
  return path


def _distill_config(tiny_overrides: dict, teacher: str, **overrides: object) -> Config:
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  values = dict(tiny_overrides, objective="distill", distill_teacher_path=teacher, distill_teacher_model_name="default",
                distill_teacher_overrides=_teacher_overrides(), learning_rate=1e-2, warmup_steps_fraction=0.0)
  return Config.for_testing(one_device, **{**values, **overrides})


def test_a_short_run_from_a_tiny_teacher_lowers_the_loss_and_leaves_the_teacher_bitwise(tiny_overrides, teacher_path):
  config = _distill_config(tiny_overrides, teacher_path, distill_alpha=0.8, distill_top_k=16, distill_temperature=2.0)
  run = build_run(config, devices=jax.devices()[:1])
  assert isinstance(run.setup.abstract_state, DistillState)
  state = run.init_state()
  assert isinstance(state, DistillState) and state.teacher is not None
  saved = params_io.load_params(teacher_path, run.objective.teacher.abstract_params,  # type: ignore[attr-defined]
                                jax.tree.map(lambda x: x.sharding, state.teacher))
  teacher = jax.tree.map(np.asarray, state.teacher)
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(teacher), jax.tree.leaves(saved)))
  batch = next(run.data_iterator())
  history = []
  for _ in range(6):
    state, step_metrics = run.train_step(state, batch, jax.random.key(0))
    history.append({k: float(v) for k, v in step_metrics.items() if k in ("loss", "distill_kl", "xent")})
  assert history[-1]["loss"] < history[0]["loss"] and history[-1]["distill_kl"] < history[0]["distill_kl"], history
  assert history[0]["loss"] == pytest.approx(0.8 * 4.0 * history[0]["distill_kl"] + 0.2 * history[0]["xent"], rel=1e-5)
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(teacher), jax.tree.leaves(state.teacher)))
  scalars, line = run.objective.eval_metrics(jax.device_get(run.eval_step(state, batch)))
  assert set(scalars) == {"eval_loss", "eval_distill_kl", "eval_xent", "eval_perplexity"} and "| kl " in line


def test_on_eight_devices_the_teacher_is_sharded_by_the_students_rules(tiny_overrides, teacher_path):
  """The teacher's parameters take the shardings the run's logical rules give its own tree on the
  student's mesh (FSDP over the 8 simulated devices here), and a step runs."""
  values = dict(tiny_overrides, objective="distill", distill_teacher_path=teacher_path,
                distill_teacher_model_name="default", distill_teacher_overrides=_teacher_overrides(), distill_top_k=4)
  config = Config.for_testing(**values)
  run = build_run(config)
  assert run.mesh.devices.size == 8
  expected = models.shard_params_like(run.objective.teacher, run.mesh, config.mesh.logical_axis_rules)  # type: ignore[attr-defined]
  state = run.init_state()
  assert isinstance(state, DistillState)
  specs = [x.sharding.spec for x in jax.tree.leaves(state.teacher)]
  assert specs == [s.spec for s in jax.tree.leaves(expected)]
  assert any(any(axis is not None for axis in spec) for spec in specs)  # sharded, not replicated
  state, step_metrics = run.train_step(state, next(run.data_iterator()), jax.random.key(0))
  assert np.isfinite(float(step_metrics["loss"])) and float(step_metrics["distill_kl"]) > 0


def test_micro_batches_give_the_loss_and_gradients_of_the_whole_batch(tiny_overrides, teacher_path):
  """With gradient accumulation the teacher runs inside each micro-batch's loss: the step's metrics
  equal those of the whole batch at once."""
  first = {}
  for micro in (1, 2):
    config = _distill_config(tiny_overrides, teacher_path, per_device_batch_size=2, gradient_accumulation_steps=micro,
                             distill_top_k=8, distill_alpha=0.5)
    run = build_run(config, devices=jax.devices()[:1])
    _, step_metrics = run.train_step(run.init_state(), next(run.data_iterator()), jax.random.key(0))
    first[micro] = {k: float(step_metrics[k]) for k in ("loss", "distill_kl", "xent", "grad_norm")}
  for name, value in first[1].items():
    assert first[2][name] == pytest.approx(value, rel=1e-5), name


def test_the_teacher_forward_counts_in_the_step_flops(tiny_overrides, teacher_path):
  config = _distill_config(tiny_overrides, teacher_path)
  run = build_run(config, devices=jax.devices()[:1])
  teacher_cfg = run.objective.forward_only_models[0]
  assert teacher_cfg.num_decoder_layers == 4 and run.objective.passes_per_row == 3
  batch, length = config.data.global_batch_size, config.data.max_target_length
  alone = metrics.training_tflops_per_step(config.model, batch, length)
  both = metrics.training_tflops_per_step(config.model, batch, length, forward_only=run.objective.forward_only_models)
  weights, attention = metrics.forward_flops_per_sequence(teacher_cfg, length)
  assert both.weight_tflops == pytest.approx(alone.weight_tflops + batch * weights / 1e12)
  assert both.attention_tflops == pytest.approx(alone.attention_tflops + batch * attention / 1e12)
  # The weight part of one forward is 2 FLOPs per teacher matmul parameter (every kernel: the layers'
  # and the output head's) per token.
  kernels = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(
      models.build_model_spec(teacher_cfg).abstract_params)[0] if "kernel" in jax.tree_util.keystr(path))
  assert weights == 2 * kernels * length


def test_the_teacher_is_a_part_of_the_state_the_memory_report_names(tiny_overrides, teacher_path):
  """train_compile prints (and its "does not fit" line names) the state's parts per chip: the
  student's parameters and optimizer state, and the teacher beside them."""
  run = build_run(_distill_config(tiny_overrides, teacher_path), devices=jax.devices()[:1])
  parts = dict(memory_report.state_bytes_per_chip(run.abstract_inputs().state))
  assert set(parts) == {"parameters", "optimizer state", "teacher"}
  teacher_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.objective.teacher.abstract_params))  # type: ignore[attr-defined]
  student_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.setup.abstract_state.params))
  assert parts["teacher"] == teacher_bytes > parts["parameters"] == student_bytes
  assert memory_report.describe_state(list(parts.items())).startswith("train state per chip: parameters ")


def test_bad_input_is_one_line(tiny_overrides, teacher_path, tmp_path):
  with pytest.raises(ConfigError, match="objective=distill needs a teacher: set distill_teacher_path"):
    _distill_config(tiny_overrides, "")
  with pytest.raises(ConfigError, match=r"distill_top_k=129 must be in \[0, vocab_size=128\]"):
    _distill_config(tiny_overrides, teacher_path, distill_top_k=129)
  with pytest.raises(ConfigError, match="distill_loss must be one of forward_kl, reverse_kl, got 'jsd'"):
    _distill_config(tiny_overrides, teacher_path, distill_loss="jsd")
  with pytest.raises(ConfigError, match=r"distill_alpha .* must be in \[0, 1\]"):
    _distill_config(tiny_overrides, teacher_path, distill_alpha=1.5)
  with pytest.raises(UserError, match="distill_teacher_path .*nowhere does not exist"):
    build_run(_distill_config(tiny_overrides, str(tmp_path / "nowhere")), devices=jax.devices()[:1])
  with pytest.raises(UserError, match="the teacher .* has vocab_size=256, the student 128: .* same tokenizer"):
    build_run(_distill_config(tiny_overrides, teacher_path, distill_teacher_overrides=_teacher_overrides(vocab_size=256)),
              devices=jax.devices()[:1])
  with pytest.raises(ConfigError, match="objective=distill: no model_config.yml or run config.yml is saved with "
                     "distill_teacher_path=.*; set distill_teacher_model_name="):
    build_run(_distill_config(tiny_overrides, teacher_path, distill_teacher_model_name=""), devices=jax.devices()[:1])
  with pytest.raises(UserError, match="objective=distill trains the next-token head only; set mtp_num_layers=0"):
    build_run(_distill_config(tiny_overrides, teacher_path, mtp_num_layers=1), devices=jax.devices()[:1])
  # A teacher run trained with another tokenizer.
  run_dir = tmp_path / "teacher_run"
  teacher_run = Config.for_testing(**TEACHER_MODEL, tokenizer_path="other_tokenizer", print_config=False)
  run_record.record_start(teacher_run, str(run_dir))
  with pytest.raises(UserError, match="was trained with tokenizer other_tokenizer .* the student reads"):
    build_run(_distill_config(tiny_overrides, str(run_dir), distill_teacher_model_name=""), devices=jax.devices()[:1])


def test_loss_keys_a_run_cannot_use_are_one_line(tiny_overrides, teacher_path):
  """Was: distill_temperature=inf or 1e30 passed "> 0" and every step's loss was NaN (skipped as
  non-finite, exit 0); 1e3 and up trains on rounding noise; a near-miss loss name had no suggestion."""
  for temperature in (float("inf"), 1e30, 1e3):
    with pytest.raises(ConfigError, match=r"distill_temperature must be > 0 and <= 100 .*got "):
      _distill_config(tiny_overrides, teacher_path, distill_temperature=temperature)
  assert _distill_config(tiny_overrides, teacher_path, distill_temperature=100.0).distill.distill_temperature == 100.0
  for given, meant in (("forward", "forward_kl"), ("reverse-kl", "reverse_kl"), ("FORWARD_KL", "forward_kl")):
    with pytest.raises(ConfigError, match=rf"got '{given}' \(did you mean '{meant}'\?\)$"):
      _distill_config(tiny_overrides, teacher_path, distill_loss=given)


def test_a_teacher_for_an_objective_that_reads_none_is_one_line(tiny_overrides, teacher_path):
  """Was: objective=lm with distill_teacher_path (objective=distill forgotten) trained on the labels
  alone, exit 0, the teacher silently unread; the same with distill_top_k_path."""
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  with pytest.raises(ConfigError, match=f"distill_teacher_path={teacher_path} names a teacher, but objective=lm reads "
                     "none: set objective=distill"):
    Config.for_testing(one_device, **tiny_overrides, distill_teacher_path=teacher_path)
  with pytest.raises(ConfigError, match="distill_top_k_path=/top_k holds a teacher's top k, but objective=lm reads "
                     "none"):
    Config.for_testing(one_device, **tiny_overrides, distill_top_k_path="/top_k")
  # The teacher's own configuration inherits the student's keys as objective=lm: not a forgotten objective.
  config = _distill_config(tiny_overrides, teacher_path)
  teacher = build_run(config, devices=jax.devices()[:1]).objective.teacher  # type: ignore[attr-defined]
  assert teacher.cfg.num_decoder_layers == 4


def test_a_teacher_checkpoint_of_another_shape_is_one_line_naming_the_teacher_keys(tiny_overrides, teacher_path):
  """Was: "cannot load parameters from ... check that the model config matches", with nothing saying
  that it was the teacher, nor which keys give its model config."""
  run = build_run(_distill_config(tiny_overrides, teacher_path, distill_teacher_overrides=_teacher_overrides(
      base_emb_dim=128)), devices=jax.devices()[:1])
  with pytest.raises(UserError) as raised:
    run.init_state()
  message = str(raised.value)
  assert message.startswith(f"distill_teacher_path: cannot load parameters from {teacher_path}") and "\n" not in message
  assert message.endswith("(the teacher's model keys: distill_teacher_model_name and distill_teacher_overrides, else "
                          "those saved with its checkpoint)")


def test_a_teacher_too_large_for_the_devices_is_one_line_naming_it(tiny_overrides, teacher_path, tmp_path,
                                                                   monkeypatch):
  """Was: XLA's RESOURCE_EXHAUSTED traceback from the state's init. The error is the one XLA raises
  when an allocation fails (here raised directly: no device of this machine is to be filled)."""
  from MaxText import train

  config = Config.for_testing(**tiny_overrides, objective="distill", distill_teacher_path=teacher_path,
                              distill_teacher_model_name="default", distill_teacher_overrides=_teacher_overrides(),
                              base_output_directory=str(tmp_path), run_name="big", steps=1)  # train's 8 devices

  def out_of_memory(*args: object, **kwargs: object) -> None:
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 68719476736 bytes.")

  monkeypatch.setattr(train.run_start, "initial_state", out_of_memory)
  with pytest.raises(UserError) as raised:
    train.train(config)
  message = str(raised.value)
  assert message.startswith("the train state does not fit in the devices' memory (train state per device: parameters ")
  assert ", teacher " in message and "XLA: RESOURCE_EXHAUSTED: Out of memory allocating 68719476736 bytes." in message
  assert "precompute its top k once (python3 -m MaxText.generate_teacher_top_k, then distill_top_k_path)" in message


# ---- resume -----------------------------------------------------------------------------------------

STEPS = 8


def _command(out: Path, teacher: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=distill", f"base_output_directory={out}",
          "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=128",
          "base_num_decoder_layers=2", "vocab_size=128", "max_target_length=32", "print_config=False",
          "cpu_peak_tflops=0.1", f"steps={STEPS}", "checkpoint_period=3", "objective=distill",
          f"distill_teacher_path={teacher}", "distill_teacher_model_name=default",
          f"distill_teacher_overrides={_teacher_overrides()}", "distill_top_k=8", "distill_temperature=2"]


@pytest.mark.slow
def test_a_killed_distillation_run_rerun_is_bitwise_equal(tmp_path, teacher_path):
  from tests.test_resume import _committed_steps, _losses, _run, _start_and_signal

  _run(_command(tmp_path / "whole", teacher_path))
  uninterrupted = _losses(tmp_path / "whole" / "distill")
  assert sorted(uninterrupted) == list(range(1, STEPS + 1))
  run_dir = tmp_path / "killed" / "distill"
  command = _command(tmp_path / "killed", teacher_path)
  proc = _start_and_signal(command, 4, lambda: 3 in _committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  latest = _committed_steps(run_dir)[-1]
  rerun = _run(command)
  assert f"state: resumed from step {latest}" in rerun.stdout
  assert _losses(run_dir) == uninterrupted  # CPU execution is deterministic: bitwise
