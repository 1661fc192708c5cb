"""Train-step behaviour: gradient accumulation, FLOPs formula, learnability, NaN handling, the CLI."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.training import metrics
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import TrainingError
from MaxText.training.objectives import LanguageModel
from MaxText.training.trainer import EvalHook, StepRecord, Trainer
from tests.compile_settings import cpu_xla_flags, jax_cache_env
from train_utils import Run, assert_accumulation_equals_one_big_batch

REPO = Path(__file__).resolve().parent.parent


def test_gradient_accumulation_equals_one_big_batch(tiny_overrides):
  base = dict(tiny_overrides, per_device_batch_size=4, ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
  assert_accumulation_equals_one_big_batch(base, 4)


def test_flops_formula_matches_xla_cost_analysis():
  # Unrolled layers (XLA's cost analysis counts a scan body once) and float32.
  config = Config.for_testing(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=2, head_dim=64,
                              base_mlp_dim=1024, base_num_decoder_layers=2, vocab_size=512, max_target_length=128,
                              scan_layers=False, ici_data_parallelism=8, ici_fsdp_parallelism=1, print_config=False)
  spec = models.build_model_spec(config.model)
  batch, length = 2, config.data.max_target_length
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  compiled = jax.jit(sharding.unsharded()(spec.apply)).lower(spec.abstract_params, tokens, tokens, tokens).compile()
  cost = compiled.cost_analysis()
  xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  weights, attention = metrics.forward_flops_per_sequence(config.model, length, causal=False)
  ours = batch * (weights + attention)
  # XLA also counts softmax, norms, RoPE and the masking (a few elementwise ops per
  # activation): for this shape they add ~2-3% on top of the matmuls; anything beyond
  # 6% would mean a matmul is missing or double-counted.
  assert ours <= xla_flops <= 1.06 * ours, (ours, xla_flops)
  # The training figure is 3x forward with causal attention halved.
  step = metrics.training_tflops_per_step(config.model, batch, length)
  weights_c, attention_c = metrics.forward_flops_per_sequence(config.model, length)
  assert attention_c == attention / 2
  assert math.isclose(step.total_tflops, 3 * batch * (weights_c + attention_c) / 1e12)


def test_synthetic_data_is_learnable(tiny_overrides):
  config = Config.for_testing(**dict(tiny_overrides, vocab_size=64, max_target_length=32, steps=100,
                                     learning_rate=3e-3, ici_data_parallelism=8, ici_fsdp_parallelism=1))
  run = Run(config)
  _, history = run.train(run.init(), 100)
  start = np.mean([h["loss"] for h in history[:3]])
  end = np.mean([h["loss"] for h in history[-10:]])
  # A bigram model stalls at ln(8) ≈ 2.08 nats; learning the stride from context goes far below it.
  assert start > 3.5 and end < 1.0, (start, end)


class _NanStep:
  def __init__(self, nan_at: int):
    self.calls, self.nan_at = 0, nan_at

  def __call__(self, state, batch, rng):
    self.calls += 1
    loss = float("nan") if self.calls == self.nan_at else 1.0
    return state, {"loss": jnp.asarray(loss), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0)}


def test_nan_loss_stops_the_run_naming_the_step(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, steps=10)
  trainer = Trainer(config, _NanStep(nan_at=4), iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  with pytest.raises(TrainingError, match="loss became nan at step 4"):
    trainer.run(state=None)


def _poisoned(tiny_overrides, token: int, value: float = float("nan"), **overrides):
  """A run whose embedding row `token` is `value` (a corrupted row): any batch holding that token gives
  a non-finite (NaN) or a huge (large value) loss, while batches without it train normally."""
  run = Run(Config.for_testing(**tiny_overrides, dataset_type="synthetic", enable_checkpointing=False, **overrides))
  state = run.init()
  table = state.params["token_embedder"]["embedding"]
  params = {**state.params, "token_embedder": {"embedding": table.at[token].set(value)}}
  return run, run.init(params)


def test_a_poisoned_batch_is_skipped_and_the_run_equals_one_that_never_saw_it(tiny_overrides):
  token = tiny_overrides["vocab_size"] - 1
  run, state = _poisoned(tiny_overrides, token)
  clean = [jax.tree.map(lambda x: jnp.where(x == token, 0, x), next(run.data)) for _ in range(4)]
  poison = jax.tree.map(lambda x: x.at[:, 5].set(token), clean[1])
  skipping, reference = state, jax.tree.map(jnp.copy, state)
  skipped = []
  for batch in clean[:2] + [poison] + clean[2:]:
    skipping, metrics_ = run.step_fn(skipping, batch, run.rng)
    skipped.append(float(metrics_["skipped"]))
  for batch in clean:
    reference, _ = run.step_fn(reference, batch, run.rng)
  assert skipped == [0, 0, 1, 0, 0]
  assert int(skipping.step) == 5 and int(reference.step) == 4  # the step counts every batch
  jax.tree.map(np.testing.assert_array_equal, (skipping.params, skipping.opt_state),
               (reference.params, reference.opt_state))


def test_a_loss_spike_is_skipped_and_the_run_equals_one_that_never_saw_its_batch(tiny_overrides, capsys):
  """The trainer's spike limit (mean + k std of the last applied losses) with the real step. The
  model learns one batch by heart, so a batch of random tokens is a finite spike: it is not
  applied, and the run ends exactly where a run whose data never held that batch ends."""
  settings = dict(tiny_overrides, dataset_type="synthetic", enable_checkpointing=False, learning_rate=1e-2,
                  learning_rate_schedule_steps=12, loss_spike_threshold=3.0, loss_spike_window=4)
  config = Config.for_testing(**settings, steps=12)
  run = Run(config)
  state = run.init()
  learnt = next(run.data)
  random_tokens = jax.random.randint(jax.random.key(7), learnt["inputs"].shape, 0, tiny_overrides["vocab_size"])
  spike = dict(learnt, inputs=random_tokens.astype(learnt["inputs"].dtype),
               targets=jnp.roll(random_tokens, 1, axis=0).astype(learnt["targets"].dtype))
  flops = metrics.training_tflops_per_step(config.model, 8, 32)

  def train(batches):
    trainer = Trainer(Config.for_testing(**settings, steps=len(batches)), run.step_fn, iter(batches), run.rng,
                      flops, 1.0)
    return trainer, trainer.run(jax.tree.map(jnp.copy, state)).state

  spiking, spiked = train([learnt] * 9 + [spike] + [learnt] * 2)
  reference, expected = train([learnt] * 11)
  assert spiking.skipped_steps == [10] and reference.skipped_steps == []
  err = capsys.readouterr().err
  assert "warning: step 10 was a loss spike (loss " in err and ", the mean + 3 standard deviations of the last 4 " \
         "applied steps): its update was not applied and its batch is skipped (1 in a row, 1 in this run)" in err
  jax.tree.map(np.testing.assert_array_equal, (spiked.params, spiked.opt_state),
               (expected.params, expected.opt_state))
  assert int(spiked.step) == 12 and int(expected.step) == 11  # the step counts every batch


class _LimitRecordingStep:
  """A fake step with a given loss per call that records the limit the trainer passed."""

  def __init__(self, losses: list[float]):
    self.losses, self.limits = losses, []

  def __call__(self, state, batch, rng, loss_limit):
    loss = self.losses[len(self.limits)]
    self.limits.append(float(loss_limit))
    return state, {"loss": jnp.asarray(loss), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0),
                   "skipped": jnp.asarray(float(loss > loss_limit)), "loss_limit": jnp.asarray(loss_limit)}


def test_the_spike_limit_is_mean_plus_k_std_of_the_applied_window_and_spikes_in_a_row_stop_the_run(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, steps=9, loss_spike_threshold=2.0, loss_spike_window=3,
                              max_consecutive_skipped_steps=2)
  flops = metrics.training_tflops_per_step(config.model, 8, 32)
  step = _LimitRecordingStep([3.0, 2.0, 1.0, 1.5, 9.0, 1.2, 1.1, 1.0, 1.0])
  trainer = Trainer(config, step, iter(range(100)), jax.random.key(0), flops, 1.0)
  trainer.run(state=None)
  # Step t's limit knows the losses up to step t-2 (t-1 is still on the device when t is dispatched).
  window = lambda *xs: float(np.float32(np.mean(xs) + 2.0 * np.std(xs)))  # noqa: E731
  assert step.limits[:4] == [math.inf] * 4
  assert step.limits[4] == window(3.0, 2.0, 1.0)
  assert step.limits[5] == window(2.0, 1.0, 1.5)
  assert step.limits[6] == window(2.0, 1.0, 1.5)  # the spike (9.0) never enters the window
  assert trainer.skipped_steps == [5]
  step = _LimitRecordingStep([3.0, 2.0, 1.0, 1.0, 9.0, 9.0, 9.0])
  trainer = Trainer(config, step, iter(range(100)), jax.random.key(0), flops, 1.0)
  with pytest.raises(TrainingError, match="2 steps in a row were spikes, up to step 6 .*raise loss_spike_threshold"):
    trainer.run(state=None)


class _TokenlessStep(_LimitRecordingStep):
  """A fake step whose batch at the calls in `empty` has no target tokens (its loss reported as 0)."""

  def __init__(self, losses: list[float], empty: set[int]):
    super().__init__(losses)
    self.empty = empty

  def __call__(self, state, batch, rng, loss_limit):
    state, metrics = super().__call__(state, batch, rng, loss_limit)
    tokens = 0.0 if len(self.limits) in self.empty else 8.0
    return state, dict(metrics, num_tokens=jnp.asarray(tokens))


def test_a_step_without_target_tokens_is_one_warning_and_stays_out_of_the_spike_window(tiny_overrides, capsys):
  """Its loss 0 (a mean over no tokens) entered the window and loosened the limit (a stable loss of 2 and a 0:
  mean + 1 std = 2.28), so the spike after it was applied; and nothing said the 0 was no measurement."""
  config = Config.for_testing(**tiny_overrides, steps=6, loss_spike_threshold=1, loss_spike_window=3)
  flops = metrics.training_tflops_per_step(config.model, 8, 32)
  step = _TokenlessStep([2.0, 2.0, 0.0, 2.0, 2.0, 2.2], empty={3})
  trainer = Trainer(config, step, iter(range(100)), jax.random.key(0), flops, 1.0)
  trainer.run(state=None)
  assert step.limits[5] == 2.0  # the window is 2, 2, 2: the tokenless step's 0 is left out
  assert trainer.skipped_steps == [6]
  err = capsys.readouterr().err
  assert "warning: step 3's batch has no target tokens (every target weight is 0" in err
  assert err.count("no target tokens") == 1 and "step 6 was a loss spike" in err


class _SkippingStep:
  def __init__(self, bad: set[int]):
    self.calls, self.bad = 0, bad

  def __call__(self, state, batch, rng):
    self.calls += 1
    bad = self.calls in self.bad
    return state, {"loss": jnp.asarray(float("nan") if bad else 1.0), "grad_norm": jnp.asarray(1.0),
                   "num_tokens": jnp.asarray(8.0), "skipped": jnp.asarray(float(bad))}


def test_skipped_steps_are_reported_and_too_many_in_a_row_stop_the_run(tiny_overrides, capsys):
  config = Config.for_testing(**tiny_overrides, steps=12, max_consecutive_skipped_steps=3)
  flops = metrics.training_tflops_per_step(config.model, 8, 32)
  trainer = Trainer(config, _SkippingStep({3, 6, 7}), iter(range(100)), jax.random.key(0), flops, 1.0)
  trainer.run(state=None)
  assert trainer.skipped_steps == [3, 6, 7]
  err = capsys.readouterr().err
  assert "warning: step 3 was non-finite (loss nan, grad_norm 1): its update was not applied and its batch is " \
         "skipped (1 in a row, 1 in this run)" in err and "(2 in a row, 3 in this run)" in err
  trainer = Trainer(config, _SkippingStep({4, 5, 6}), iter(range(100)), jax.random.key(0), flops, 1.0)
  with pytest.raises(TrainingError, match="3 steps in a row were non-finite, up to step 6"):
    trainer.run(state=None)


class _Recorder:
  def __init__(self, due_at: tuple[int, ...] = ()):
    self.due_at, self.asked, self.seen = due_at, [], []

  def due(self, step: int) -> bool:
    self.asked.append(step)
    return step in self.due_at

  def on_step(self, trainer, record, state) -> None:
    self.seen.append((record.step, state is not None))

  def on_end(self, trainer, state) -> None:
    self.seen.append(("end", state is not None))


def test_the_trainer_owns_each_hooks_cadence(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, steps=7)
  trainer = Trainer(config, _NanStep(nan_at=-1), iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  periodic, scheduled = _Recorder(), _Recorder(due_at=(2, 5))
  trainer.add_hook(periodic, every=3)
  trainer.add_hook(scheduled, every=0, needs_state=True)
  with pytest.raises(TypeError, match="has no due"):
    trainer.add_hook(object(), every=0)
  loop = trainer.run(state="state", start_step=1)
  assert periodic.seen == [(3, False), (6, False), ("end", True)]
  assert scheduled.seen == [(2, True), (5, True), ("end", True)]
  assert scheduled.asked == [2, 3, 4, 5, 6, 7]  # once per step, as the preemption sync point needs
  assert (loop.first.step, loop.last.step) == (2, 7)


def _cli_env() -> dict:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
          "HOME": str(Path.home()), **jax_cache_env()}


def test_the_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
  """torch's import is most of a training process's start-up; tensorboardX would pull it in."""
  pytest.importorskip("torch")
  code = ("import sys\n"
          "from MaxText.training.metrics import MetricWriter\n"
          f"w = MetricWriter({str(tmp_path)!r}, True, True)\n"
          "w.write(1, {'loss': 1.5})\nw.close()\n"
          "print('torch' in sys.modules)\n"
          "import torch\nprint(torch.zeros(1).shape)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_cli_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split("\n")[:2] == ["False", "torch.Size([1])"]
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("entry", [pytest.param(["-m", "MaxText.train"], marks=pytest.mark.slow), ["MaxText/train.py"]],
                         ids=["module", "script"])
def test_train_cli_end_to_end(tmp_path, entry):
  args = ["configs/base.yml", "run_name=e2e", f"base_output_directory={tmp_path}", "steps=3", "base_emb_dim=64",
          "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32", "eval_interval=3",
          "print_config=False", "cpu_peak_tflops=0.1"]
  proc = subprocess.run([sys.executable, *entry, *args], cwd=REPO, env=_cli_env(), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
  assert len(step_lines) == 3
  for field in ("loss", " s |", "tokens/s", "TFLOP/s/device", "MFU"):
    assert field in step_lines[-1]
  assert "eval        3 | loss" in proc.stdout
  run_dir = tmp_path / "e2e"
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
  assert all(0 < r["mfu"] for r in records if "mfu" in r)
  assert any("eval_loss" in r for r in records)
  assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
  assert "base_emb_dim: 64" in (run_dir / "config.yml").read_text()


def test_ctrl_c_stops_cleanly(tmp_path):
  import signal
  import time

  args = ["configs/base.yml", "run_name=int", f"base_output_directory={tmp_path}", "steps=100000", "base_emb_dim=64",
          "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32", "print_config=False",
          "cpu_peak_tflops=0.1"]
  # Started with SIGINT ignored, as a non-interactive shell starts background jobs: Ctrl-C must still work.
  proc = subprocess.Popen([sys.executable, "-m", "MaxText.train", *args], cwd=REPO, env=_cli_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
  deadline = time.time() + 300
  for line in proc.stdout:
    if line.startswith("step ") or time.time() > deadline:
      break
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert "stopped by Ctrl-C after step" in out and "Traceback" not in err
  assert (tmp_path / "int" / "metrics.jsonl").read_text().strip()  # what was logged is kept



class _Writer:
  def __init__(self):
    self.lines = []

  def write(self, step, scalars):
    self.lines.append((step, scalars))


class _Batches:
  def reset(self):
    return iter(range(100))


def test_an_evaluation_without_target_tokens_reports_nothing_and_says_so(tiny_overrides, capsys):
  """Over no target tokens the mean loss read 0 and the perplexity 1, a perfect score written as a result."""
  config = Config.for_testing(**tiny_overrides)
  objective = LanguageModel(models.build_model_spec(config.model), 0.0)

  def sums(tokens):
    return lambda state, batch: {"xent_sum": np.float32(3.0 * tokens), "z_loss_sum": np.float32(0.0),
                                 "moe_lb_loss_sum": np.float32(0.0), "weight_sum": np.float32(tokens)}

  writer = _Writer()
  EvalHook(sums(0.0), _Batches(), 2, writer, True, objective.eval_metrics).on_step(None, StepRecord(5, 1.0, {}), {})
  assert writer.lines == []
  assert "warning: the evaluation at step 5 had no target tokens in its 2 batches" in capsys.readouterr().err
  EvalHook(sums(4.0), _Batches(), 2, writer, True, objective.eval_metrics).on_step(None, StepRecord(6, 1.0, {}), {})
  assert writer.lines[0][0] == 6 and writer.lines[0][1]["eval_loss"] == 3.0


def test_the_logged_learning_rate_is_the_one_the_update_used_after_a_skipped_step(tiny_overrides):
  """A skipped step keeps the optimizer's count, which drives the schedule; the metric read the schedule at the
  step counter, one ahead after each skip: the logged rate was not the one applied."""
  from MaxText.training import optimizers

  config = Config.for_testing(**tiny_overrides, steps=4, warmup_steps_fraction=0.0, loss_spike_threshold=1)
  run = Run(config)
  schedule = optimizers.learning_rate_schedule(config.optim)
  state, batch = run.init(), next(run.data)
  state, skipped = run.step_fn(state, batch, run.rng, np.float32(0.0))  # every loss is above 0: not applied
  state, applied = run.step_fn(state, batch, run.rng, np.float32(np.inf))
  assert float(skipped["skipped"]) == 1.0 and float(applied["skipped"]) == 0.0
  assert float(skipped["learning_rate"]) == float(applied["learning_rate"]) == float(schedule(0))
  state, third = run.step_fn(state, batch, run.rng, np.float32(np.inf))
  assert float(third["learning_rate"]) == float(schedule(1)) != float(schedule(0))



@pytest.mark.parametrize("micro_batches", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_float16_weights_take_the_per_token_gradient_of_a_large_batch(tiny_overrides, micro_batches):
  """weight_dtype=float16 differentiated the loss summed over the batch's tokens and divided by their count after:
  over 32768 tokens of one repeated token the output head's gradient passed float16's 65504, so the step's
  gradients were inf (with accumulation, where each micro-batch's stayed finite, at the sum's cast back to
  float16) where float32 weights gave finite ones. Each micro-batch's loss is now divided by its tokens first."""
  import dataclasses

  from MaxText.platform import accelerators
  from MaxText.training.run_assembly import build_run

  def run(dtype: str):
    overrides = {**tiny_overrides, "base_num_decoder_layers": 1, "per_device_batch_size": 512, "max_target_length": 64}
    config = Config.for_testing(dataclasses.replace(accelerators.local_target(), num_devices=1), weight_dtype=dtype,
                                adam_eps=1e-4, gradient_accumulation_steps=micro_batches, dataset_type="synthetic",
                                enable_checkpointing=False, **overrides)
    return build_run(config, devices=jax.devices()[:1], compiled_step=False)

  half, full = run("float16"), run("float32")
  half_state = half.init_state()
  batch = next(half.data_iterator())
  batch = {**batch, "inputs": jnp.full_like(batch["inputs"], 5), "targets": jnp.full_like(batch["targets"], 5)}
  assert int(jnp.sum(batch["targets_segmentation"] > 0)) == 32768
  # The same weights in float32: the reference's state needs no init of its own.
  full_params = jax.tree.map(lambda p: p.astype(jnp.float32), half_state.params)
  full_state = jax.tree.map(jnp.copy, half_state).replace(  # copies: each step donates its state
      params=full_params, opt_state=jax.jit(full.setup.optimizer.init)(full_params))
  half_state, half_metrics = half.train_step(half_state, batch, jax.random.key(0))
  _, full_metrics = full.train_step(full_state, batch, jax.random.key(0))
  assert np.isfinite(float(full_metrics["grad_norm"]))
  assert float(half_metrics["grad_norm"]) == pytest.approx(float(full_metrics["grad_norm"]), rel=1e-2)
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(half_state.params))
