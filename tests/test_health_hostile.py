"""Run health against what a hurried or hostile user or environment hands it: a goodput record edited
by hand or replaced by a directory, a hook whose end fails before the last save is waited for, fractional
and infinite thresholds, and a straggler report over a start that resumed mid-period."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration import config as config_lib, config_fields, config_groups
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.training import metrics
from MaxText.training.health import GoodputHook, StragglerHook
from MaxText.training.trainer import StepRecord, Trainer

_GOOD = {"started": 1.0, "wall_s": 50.0, "startup_s": 5.0, "compile_s": 2.0, "data_wait_s": 0.0, "first_step": 1,
         "last_step": 10, "median_step_s": 4.0}


@pytest.mark.parametrize("field, value", [("wall_s", "50"), ("started", None), ("median_step_s", float("nan")),
                                          ("data_wait_s", float("inf")), ("first_step", 1.5), ("last_step", True)])
def test_a_goodput_record_with_a_wrongly_typed_field_is_one_warning_at_the_start(tmp_path, capsys, field, value):
  """A hand-edited "50" or null was taken: the summary's sums failed only at the end of the run, after
  training (a traceback whose exit lost the last checkpoint in flight); NaN or Infinity spread through it."""
  (tmp_path / "goodput.json").write_text(json.dumps({"starts": [{**_GOOD, field: value}]}))
  hook = GoodputHook(str(tmp_path), process_started=0.0, start_step=10, writer=None)
  assert hook.earlier == []
  assert f"is unreadable (TypeError: {field} is {value!r}, not a" in capsys.readouterr().out
  hook.on_step(None, StepRecord(11, 0.5, {"input_wait_s": 0.0}), None)  # type: ignore[arg-type]
  hook.on_end(None, None)  # type: ignore[arg-type]
  assert [s["first_step"] for s in json.loads((tmp_path / "goodput.json").read_text())["starts"]] == [11]


def test_a_well_formed_goodput_record_is_kept(tmp_path):
  (tmp_path / "goodput.json").write_text(json.dumps({"starts": [_GOOD, {**_GOOD, "resize_detected": 3.0}]}))
  assert len(GoodputHook(str(tmp_path), process_started=0.0, start_step=10, writer=None).earlier) == 2


def test_a_directory_in_the_goodput_records_place_is_one_line_before_training(tmp_path):
  """It was an IsADirectoryError traceback."""
  (tmp_path / "goodput.json").mkdir()
  with pytest.raises(UserError, match=r"goodput.json is a directory, not the run's goodput record: move it aside"):
    GoodputHook(str(tmp_path), process_started=0.0, start_step=0, writer=None)


class _FiniteStep:
  def __call__(self, state, batch, rng):
    return state, {"loss": jnp.asarray(1.0), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0)}


class _FailingEnd:
  def on_step(self, trainer, record, state) -> None:
    pass

  def on_end(self, trainer, state) -> None:
    raise RuntimeError("the goodput record could not be written")


class _LastSave:
  """Stands in for the checkpoint hook, whose end waits for the last save."""

  def __init__(self):
    self.ended = False

  def on_step(self, trainer, record, state) -> None:
    pass

  def on_end(self, trainer, state) -> None:
    self.ended = True


def test_a_hook_whose_end_fails_does_not_skip_the_ends_of_the_hooks_after_it(tiny_overrides):
  """The first failing on_end was raised at once: the checkpoint hook's end never waited for the last
  (async) save, and the run's final checkpoint was left as an unfinished temporary directory."""
  config = Config.for_testing(**tiny_overrides, steps=3)
  trainer = Trainer(config, _FiniteStep(), iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  last_save = _LastSave()
  trainer.add_hook(_FailingEnd(), every=1)
  trainer.add_hook(last_save, every=1)
  with pytest.raises(RuntimeError, match="could not be written"):
    trainer.run(state=None)
  assert last_save.ended


def test_every_fractional_run_key_takes_a_fraction():
  """loss_spike_threshold=2.5 and step_timeout_seconds=30.5 were refused ("must be a whole number like its
  default 0"): base.yml's defaults were written as whole numbers, which set the keys' type."""
  schema = config_lib.read_yaml(config_lib.BASE_CONFIG_PATH)
  floats = [f.name for f in config_fields.key_fields(config_groups.RunConfig) if f.type in ("float", float)]
  assert {"loss_spike_threshold", "step_timeout_seconds", "straggler_threshold"} <= set(floats)
  assert [name for name in floats if not isinstance(schema[name], float)] == []
  run = Config.for_testing(loss_spike_threshold=2.5, step_timeout_seconds=30.5).run
  assert (run.loss_spike_threshold, run.step_timeout_seconds) == (2.5, 30.5)


def test_an_infinite_spike_threshold_is_a_config_error():
  """It was taken: over a window of equal losses (standard deviation 0) the limit was inf * 0 = NaN, and
  every step read as a spike until the run stopped."""
  from MaxText.training.trainer import LossSpikeLimit

  limit = LossSpikeLimit(float("inf"), 2)
  limit.add(1.0), limit.add(1.0)
  with np.errstate(invalid="ignore"):
    assert np.isnan(limit.limit())  # what the step would have compared every loss with
  with pytest.raises(ConfigError, match=r"loss_spike_threshold must be a finite number >= 0 \(0 = off\) and "
                                         r"loss_spike_window >= 2, got inf and"):
    Config.for_testing(loss_spike_threshold="inf")


def test_the_first_straggler_report_after_a_resume_names_the_steps_it_measured(capsys):
  """A start resumed at step 14 with straggler_report_period=4 reports at step 16 over steps 15 and 16; the
  line said 13..16."""
  hook = StragglerHook(4, 0.2, None, True, gather=lambda mine: np.asarray([mine, (1.0, 0.9)]))
  for step in (15, 16, 17, 18, 19, 20):
    hook.on_step(None, StepRecord(step, 1.0, {"input_wait_s": 0.01}), None)  # type: ignore[arg-type]
  err = capsys.readouterr().err
  assert "stragglers over steps 15..16: process 1" in err and "stragglers over steps 17..20: process 1" in err


class _TrainerInAHook:
  activity = "the train step"


@pytest.mark.parametrize("activity", ["the checkpoint save at step 1", "reading the batch of step 2"])
def test_a_hang_outside_the_step_is_named_as_such(capsys, activity):
  """The watchdog said the step "did not finish" while the loop hung in the checkpoint save after it, or
  in reading the next batch (only the stacks showed where)."""
  import time

  from MaxText.training.health import StepWatchdog

  exits: list[int] = []
  watchdog = StepWatchdog(0.3, exit=exits.append)
  watchdog.trainer = trainer = _TrainerInAHook()  # type: ignore[assignment]
  watchdog.due(1)
  watchdog.on_step(trainer, StepRecord(1, 0.1, {}), None)  # type: ignore[arg-type]
  trainer.activity = activity  # as the Trainer names what it runs beside the step
  deadline = time.time() + 10
  while not exits and time.time() < deadline:
    time.sleep(0.05)
  assert exits == [StepWatchdog.EXIT_CODE]
  err = capsys.readouterr().err
  assert f"after step 1 on this process; every process started step 1; this process is in {activity}; Python " \
         "stacks above" in err, err[-600:]


def test_the_trainer_names_the_batch_it_reads(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, steps=3)
  trainer = Trainer(config, _FiniteStep(), None, jax.random.key(0),  # type: ignore[arg-type]
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  seen = []

  class _Batches:
    def __next__(self):
      seen.append(trainer.activity)
      return 0

  trainer.data = _Batches()  # type: ignore[assignment]
  trainer.run(state=None)
  assert seen == ["reading the batch of step 1", "reading the batch of step 2", "reading the batch of step 3"]
  assert trainer.activity == "the train step"


class _SkippedSteps:
  """Non-finite steps at `nan_at`, loss spikes at `spike_at` (both skipped), finite steps otherwise."""

  def __init__(self, nan_at: set[int], spike_at: set[int]):
    self.calls, self.nan_at, self.spike_at = 0, nan_at, spike_at

  def __call__(self, state, batch, rng, loss_limit):
    self.calls += 1
    loss = float("nan") if self.calls in self.nan_at else 50.0 if self.calls in self.spike_at else 1.0
    skipped = float(self.calls in self.nan_at | self.spike_at)
    return state, {"loss": jnp.asarray(loss), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0),
                   "skipped": jnp.asarray(skipped), "loss_limit": jnp.asarray(2.0)}


@pytest.mark.parametrize("nan_at, spike_at, were", [
    ({3, 4}, {5}, "skipped (2 non-finite, 1 spikes)"), ({5}, {3, 4}, "skipped (1 non-finite, 2 spikes)"),
    ({3, 4, 5}, set(), "non-finite"), (set(), {3, 4, 5}, "spikes")])
def test_a_streak_of_non_finite_steps_and_spikes_is_named_as_such_and_gets_the_divergence_advice(
    tiny_overrides, nan_at, spike_at, were):
  """Spikes and non-finite steps in one streak were named after its last step: two NaN steps then a spike
  read "3 steps in a row were spikes ... raise loss_spike_threshold", hiding the divergence and the command
  to go back to the last good checkpoint with a lower learning rate."""
  from MaxText.errors import TrainingError

  config = Config.for_testing(**tiny_overrides, steps=9, max_consecutive_skipped_steps=3, loss_spike_threshold=3.0)
  trainer = Trainer(config, _SkippedSteps(nan_at, spike_at), iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  trainer.advise_nonfinite = lambda first: f"resume from before step {first}"
  with pytest.raises(TrainingError) as stop:
    trainer.run(state=None)
  assert f"3 steps in a row were {were}, up to step 5 (" in str(stop.value)
  advice = f"resume from before step {min(nan_at)}" if nan_at else \
      "if the loss moved for good, raise loss_spike_threshold"
  assert f"is broken: {advice}" in str(stop.value), str(stop.value)


def test_the_spike_limit_while_its_window_fills_is_no_nan_or_inf_warning_in_the_log(tmp_path, caplog):
  """loss_limit is inf until the window is full (metrics.jsonl says "inf"); TensorBoard was handed it and
  tensorboardX logged "NaN or Inf found in input tensor" at every logged step of a healthy run."""
  import logging

  writer = metrics.MetricWriter(str(tmp_path), enable_jsonl=True, enable_tensorboard=True)
  with caplog.at_level(logging.WARNING):
    writer.write(1, {"loss": 2.0, "loss_limit": float("inf"), "skipped": 0.0})
    writer.close()
  assert "NaN or Inf" not in caplog.text
  assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss_limit"] == "inf"


def test_a_start_too_short_to_fill_the_spike_window_says_it_checks_nothing(capsys):
  """loss_spike_threshold=3 on a 50-step run (or a resume 20 steps before the end) with the default window of
  100 checked no step, silently."""
  from MaxText.training.health import warn_if_spikes_never_checked

  def run(start_step: int, **keys) -> str:
    warn_if_spikes_never_checked(Config.for_testing(**{"steps": 50, **keys}).run, start_step)
    return capsys.readouterr().err

  assert run(0, loss_spike_threshold=3.0) == (
      "warning: loss_spike_threshold=3 checks nothing in this start: its 50 step(s) are too few to fill "
      "loss_spike_window=100 first (the first step it checks is this start's step 102); set loss_spike_window to at "
      "most 48\n")
  assert "its 20 step(s) are too few" in run(30, loss_spike_threshold=3.0, loss_spike_window=20)
  assert run(0, loss_spike_threshold=3.0, loss_spike_window=48) == ""  # step 50 is checked
  assert run(0, loss_spike_window=100) == ""  # off


class _Batches:
  def __next__(self):
    return 0

  def get_state(self):
    return {"position": 0}


class _NoPreemption:
  def reached(self, step: int) -> bool:
    return False

  def close(self) -> None:
    pass


class _LastSaveHangs:
  """RunCheckpoints on a disk that stops answering during the last (async) save: closing waits for it,
  here until the watchdog's exit ends the wait (as os._exit would) or 10 s pass."""

  directory, local = "/the/checkpoints", None

  def __init__(self):
    self.last_saved_step: int | None = None
    self.unfinished_step: int | None = None
    self.exited = __import__("threading").Event()

  def local_due(self, step: int) -> bool:
    return False

  def save(self, step, state, data_state, meta) -> None:
    self.last_saved_step = self.unfinished_step = step  # async: on disk once waited for

  def close(self) -> None:
    self.exited.wait(10)


def test_a_hang_in_the_last_checkpoint_save_is_watched(tiny_overrides, capsys):
  """The watchdog's end ran before the checkpoint hook's, which waits for the last async save: a save to a
  local disk or NFS mount that stopped answering hung the process for good, with no stacks and no exit 4."""
  from MaxText.training.health import StepWatchdog, add_health_hooks
  from MaxText.training.trainer import CheckpointHook

  config = Config.for_testing(**tiny_overrides, steps=3, step_timeout_seconds=0.5)
  trainer = Trainer(config, _FiniteStep(), _Batches(), jax.random.key(0),  # type: ignore[arg-type]
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  checkpoints, exits = _LastSaveHangs(), []

  def exit(code: int) -> None:
    exits.append(code)
    checkpoints.exited.set()

  add_health_hooks(trainer, config.run, None, False, 1, 0.0, 0, StepWatchdog(0.5, exit=exit))
  trainer.add_hook(CheckpointHook(checkpoints, 2, 3, _NoPreemption(), jax.random.key(0)),  # type: ignore[arg-type]
                   every=0, needs_state=True)
  trainer.run(state={"params": 0})  # type: ignore[arg-type]
  assert exits == [StepWatchdog.EXIT_CODE]
  err = capsys.readouterr().err
  assert "error: the final checkpoint save at step 3 did not finish in step_timeout_seconds=0.5; Python stacks " \
         "above. Exiting with status 4" in err, err[-600:]
  assert "in close" in err  # the main thread's stack shows the wait
  assert trainer.activity == "the train step"  # restored: an error raised after the ends names what failed


class _CompilesSlowly:
  """An eval step whose first call (its compilation) takes 1.5 s and whose call at the second evaluation
  never returns (released by the watchdog's exit, or after 10 s)."""

  def __init__(self):
    self.calls = 0
    self.exited = __import__("threading").Event()

  def __call__(self, state, batch):
    import time

    self.calls += 1
    if self.calls == 1:
      time.sleep(1.5)
    elif self.calls == 3:  # the second evaluation's first batch
      self.exited.wait(10)
    return {"loss_sum": 1.0, "weight_sum": 1.0}


class _EvalBatches:
  def reset(self):
    return iter(range(2))


def test_the_first_evaluations_compilation_is_not_a_hang_but_a_later_evaluation_is(tiny_overrides, capsys):
  """The first train step's compilation is outside the timeout, the first evaluation's was inside it: a tight
  step_timeout_seconds on a big model killed the run at its first evaluation, at every restart."""
  from MaxText.training.health import StepWatchdog, add_health_hooks
  from MaxText.training.trainer import EvalHook

  config = Config.for_testing(**tiny_overrides, steps=4, step_timeout_seconds=0.6)
  trainer = Trainer(config, _FiniteStep(), iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  eval_step, exits = _CompilesSlowly(), []

  def exit(code: int) -> None:
    exits.append(code)
    eval_step.exited.set()

  add_health_hooks(trainer, config.run, None, False, 1, 0.0, 0, StepWatchdog(0.6, exit=exit))
  trainer.add_hook(EvalHook(eval_step, _EvalBatches(), 2, None, False, lambda totals: ({}, "")), every=2,
                   needs_state=True)
  trainer.run(state={"params": 0})  # type: ignore[arg-type]
  assert exits == [StepWatchdog.EXIT_CODE]  # once: at the evaluation of step 4, not in the compilation at step 2
  err = capsys.readouterr().err
  assert "error: no step finished in step_timeout_seconds=0.6 after step 4 on this process; every process started " \
         "step 4; this process is in the evaluation at step 4; Python stacks above" in err, err[-600:]


def test_the_eval_tasks_scorer_compiles_each_pass_inside_the_watchdogs_compiling():
  """The eval_tasks scoring's first calls of its two jitted passes compile them, as the evaluation's first call
  does: outside the watchdog's timeout (TaskEvalHook hands the scorer Trainer.compiling)."""
  import contextlib

  from MaxText.training.task_eval import Scorer

  scorer = Scorer.__new__(Scorer)  # its bookkeeping of first calls only: no model
  scorer._compiled = set()
  inside: list[tuple[str, bool]] = []
  compiling = [False]

  @contextlib.contextmanager
  def watched_compile():
    compiling[0] = True
    yield
    compiling[0] = False

  scorer.compiling = watched_compile
  for name in ("logprobs", "logprobs", "next", "next", "logprobs"):
    scorer._run(name, lambda name=name: inside.append((name, compiling[0])))
  assert inside == [("logprobs", True), ("logprobs", False), ("next", True), ("next", False), ("logprobs", False)]


def _armed_watchdog(timeout_s: float) -> tuple["StepWatchdog", list[int]]:
  from MaxText.training.health import StepWatchdog

  exits: list[int] = []
  watchdog = StepWatchdog(timeout_s, exit=exits.append)
  assert watchdog.due(1)  # the first step dispatched: armed from here on
  return watchdog, exits


def _wait_for(exits: list[int]) -> None:
  import time

  for _ in range(200):  # the exit comes about one timeout later; a loaded machine may be slower
    if exits:
      return
    time.sleep(0.05)


def test_a_compilation_the_deadline_finds_in_progress_is_no_hang(capsys):
  """XLA compiling a function for a new shape after the first step (a GRPO rollout's environment turn, a
  longer prompt's prefill) ran inside the timeout: a tight step_timeout_seconds killed a healthy run with
  exit 4 at every restart. The deadline passes inside the compilation (the note says so); no exit."""
  import time

  from MaxText.training.health import StepWatchdog

  salt = float(time.time_ns() % 997)  # a program the session's compilation cache has not seen

  def chain(x):
    for i in range(60):
      x = jnp.tanh(x @ x) + (salt + i)
    return x

  # Lowered before the deadline is armed: under load the Python between tracing, lowering and compiling (JAX's
  # glue, no compiler frame) outlasted a tight timeout (tracing's own detection: the test below).
  lowered = jax.jit(chain).lower(jnp.ones((16, 16)))
  watchdog, exits = _armed_watchdog(0.3)
  lowered.compile()
  assert not exits
  err = capsys.readouterr().err
  assert "note: step_timeout_seconds=0.3 passed while thread MainThread compiles a JAX function" in err, \
      "the compilation ended before the deadline: the test proves nothing"
  _wait_for(exits)  # and after it, no step: the whole timeout again, then the exit
  assert exits == [StepWatchdog.EXIT_CODE]
  watchdog.on_end(None, None)  # type: ignore[arg-type]


def test_tracing_a_function_is_compiling_and_a_hang_beside_it_still_fires(capsys):
  """Tracing (the Python of a big model, a reward function's jit) is compilation too; a sleep outside
  any JAX call is a hang as before."""
  import time

  from MaxText.training.health import StepWatchdog, compiling_thread

  watchdog, exits = _armed_watchdog(0.2)
  seen: list[str | None] = []

  def slow_to_trace(x):
    seen.append(compiling_thread())
    time.sleep(0.7)
    return x + 1

  jax.jit(slow_to_trace).trace(jnp.ones(2))
  assert seen == ["MainThread"] and not exits
  assert compiling_thread() is None
  _wait_for(exits)
  assert exits == [StepWatchdog.EXIT_CODE]
  assert "error: no step finished in step_timeout_seconds=0.2 after step 0" in capsys.readouterr().err
