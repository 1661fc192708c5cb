"""Kill a real training process (SIGKILL, SIGTERM) and rerun the same command: the resumed run
continues bit for bit like one that was never interrupted (same data, same RNG, same state)."""

from __future__ import annotations

import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env

STEPS = 20
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", f"steps={STEPS}"]


def _env() -> dict:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
          "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}


def _command(out: Path, run_name: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={run_name}",
          f"base_output_directory={out}", *MODEL, *extra]


def _losses(run_dir: Path) -> dict[int, float]:
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if "loss" in r]
  assert len(steps) == len(set(steps)), f"metrics.jsonl repeats steps: {steps}"
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def _committed_steps(run_dir: Path) -> list[int]:
  directory = run_dir / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _run(command: list[str]) -> subprocess.CompletedProcess:
  proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _start_and_signal(command: list[str], after_step: int, ready, sig: int | None,
                      env: dict | None = None) -> subprocess.Popen:
  """Starts training and sends `sig` (None: nothing) once step `after_step` is logged and `ready()` holds."""
  proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env or _env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  for line in proc.stdout:
    if line.startswith("step ") and int(line.split()[1]) >= after_step:
      break
    assert time.time() < deadline, "training did not reach the step in time"
  while not ready() and time.time() < deadline:
    time.sleep(0.05)
  if sig:
    proc.send_signal(sig)
  return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
  out = tmp_path_factory.mktemp("reference")
  _run(_command(out, "ref", "checkpoint_period=5"))
  losses = _losses(out / "ref")
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses


def test_sigkill_then_rerun_resumes_from_the_last_checkpoint_exactly(tmp_path, uninterrupted):
  command = _command(tmp_path, "killed", "checkpoint_period=5")
  run_dir = tmp_path / "killed"
  proc = _start_and_signal(command, 12, lambda: 10 in _committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  latest = _committed_steps(run_dir)[-1]
  assert latest in (10, 15, 20), _committed_steps(run_dir)  # 10 unless the run outpaced the kill

  rerun = _run(command)
  assert f"state: resumed from step {latest}" in rerun.stdout
  assert "its process no longer exists on this host" in rerun.stdout  # the killed run's lease, taken over at once
  # CPU execution is deterministic for the same compiled program, so the match is bitwise.
  assert _losses(run_dir) == uninterrupted


def test_sigterm_saves_at_the_next_step_and_the_rerun_continues(tmp_path, uninterrupted):
  command = _command(tmp_path, "preempted", "checkpoint_period=1000")
  run_dir = tmp_path / "preempted"
  proc = _start_and_signal(command, 7, lambda: True, signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  saved = _committed_steps(run_dir)
  assert len(saved) == 1 and 7 <= saved[0] < STEPS, saved
  assert f"stopped: SIGTERM: saved step {saved[0]}" in out and "Traceback" not in err

  rerun = _run(command)
  assert f"state: resumed from step {saved[0]}" in rerun.stdout
  assert _losses(run_dir) == uninterrupted


@pytest.mark.slow
def test_finished_run_rerun_does_nothing(tmp_path):
  command = _command(tmp_path, "done", "steps=3")
  _run(command)
  rerun = _run(command)
  assert "already at step 3 of steps=3" in rerun.stdout


@pytest.mark.slow
def test_checkpointing_disabled_writes_nothing(tmp_path):
  _run(_command(tmp_path, "off", "steps=2", "enable_checkpointing=False"))
  assert not (tmp_path / "off" / "checkpoints").exists()


def test_checkpointing_disabled_in_a_run_with_checkpoints_is_refused(tmp_path, tiny_overrides):
  """It started the run over from step 0 and rewrote its metrics.jsonl (the checkpoints stayed)."""
  from MaxText import train
  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  config = Config.for_testing(**tiny_overrides, base_output_directory=str(tmp_path), run_name="r",
                              enable_checkpointing=False)
  train.check_resume(config, None)  # no checkpoints: nothing to lose
  (tmp_path / "r" / "checkpoints" / "4" / "state").mkdir(parents=True)
  with pytest.raises(ConfigError, match=r"^enable_checkpointing=False would start run .*/r over from step 0 and "
                                        r"rewrite its metrics.jsonl, but it holds checkpoints \(newest step 4\)"):
    train.check_resume(config, None)
  loading = Config.for_testing(**tiny_overrides, base_output_directory=str(tmp_path), run_name="r",
                               enable_checkpointing=False, load_full_state_path=str(tmp_path / "r" / "checkpoints"))
  train.check_resume(loading, None)  # continues from that state: nothing starts over


def test_a_failed_save_exits_with_its_line_instead_of_waiting_for_orbax_threads(tmp_path):
  """checkpoints/ a file: the save failed and printed its line, then the exit waited for ever on
  Orbax's save threads (not daemons), which waited for signals the failed save never sent. The start
  now refuses such a directory at once, so the run here skips that check to reach the failed save."""
  (tmp_path / "stuck").mkdir()
  (tmp_path / "stuck" / "checkpoints").write_text("not a folder")
  command = _command(tmp_path, "stuck", "steps=4", "checkpoint_period=2")
  unchecked = ("import sys; from MaxText.run_dir import checkpointing; checkpointing._check_writable = lambda d: None; "
               "from MaxText import train; from MaxText.errors import run_cli; run_cli(train.main, sys.argv)")
  proc = subprocess.run([sys.executable, "-c", unchecked, *command[3:]], cwd=REPO_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=180)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 3 and len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith(f"error: saving checkpoint of step 2 to {tmp_path / 'stuck' / 'checkpoints'} failed: ")
  assert "ERROR:absl" not in proc.stderr, proc.stderr[-3000:]  # was: Orbax's three lines about it first
  assert not (tmp_path / "stuck" / "lease.json").exists()  # released before the exit


# ---------------------------------------------------------------- non-finite losses

# This model's loss goes non-finite at 100 under plain SGD without clipping (AdamW's default weight decay at 100 is
# refused at config time: learning_rate x adam_weight_decay >= 1).
DIVERGING = [*MODEL[:-1], "steps=12", "learning_rate_schedule_steps=12", "checkpoint_period=1",
             "max_consecutive_skipped_steps=3", "opt_type=sgd", "gradient_clipping_threshold=0", "learning_rate=100"]


@pytest.mark.slow
def test_a_diverged_run_saves_no_non_finite_state_and_its_printed_command_resumes_and_trains(tmp_path):
  """A real divergence (learning rate far too high). The state after a non-finite step is never
  saved; the stop names the last checkpoint whose parameters still gave a finite loss and prints
  a command (lower learning rate, resume_from_step) that, run as printed, trains to the end."""
  run_dir = tmp_path / "diverged"
  proc = subprocess.run(_command(tmp_path, "diverged", *DIVERGING[len(MODEL) - 1:]), cwd=REPO_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 3, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  first_bad = min(int(line.split()[2]) for line in proc.stderr.splitlines()
                  if line.startswith("warning: step ") and "was non-finite" in line)
  saved = _committed_steps(run_dir)
  assert saved and max(saved) < first_bad, (saved, first_bad)  # no state after a non-finite step
  good = first_bad - 2  # step s's parameters gave a finite loss at step s+1
  assert f"resume from step {good}, the last one known good, with a lower learning rate" in errors[0], errors[0]
  printed = errors[0].split(": python3 ", 1)[1].split(" (or ", 1)[0]
  command = [sys.executable, *shlex.split(printed)]
  assert command[-2:] == [f"resume_from_step={good}", "learning_rate=10"] and "learning_rate=100" not in command

  rerun = _run(command)
  assert f"state: resumed from step {good}" in rerun.stdout, rerun.stdout[-2000:]
  suspect = [s for s in saved if s > good]
  assert f"resume_from_step={good}: moved checkpoint step(s) {', '.join(map(str, reversed(suspect)))} aside" \
      in rerun.stdout, rerun.stdout[-2000:]
  set_aside = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if ".before-resume_from_step_" in p.name)
  assert [int(name.split(".")[0]) for name in set_aside] == suspect  # moved, not deleted
  losses = _losses(run_dir)
  assert sorted(losses) == list(range(1, 13)) and all(math.isfinite(losses[s]) for s in range(good + 1, 13))
  assert _committed_steps(run_dir)[-1] == 12

  # The same command again (a scheduler's restart) continues; it does not go back a second time.
  again = _run(command)
  assert "already at step 12" in again.stdout and "moved checkpoint" not in again.stdout


class _Data:
  def __next__(self):
    return 0

  def get_state(self):
    return {}


class _NoPreemption:
  def reached(self, step):
    return False

  def close(self):
    pass


class _RecordingCheckpoints:
  directory = "checkpoints"

  def __init__(self, steps=()):
    self.saved, self.steps, self.last_saved_step = [], list(steps), None

  def local_due(self, step):
    return False

  def save(self, step, state, data_state, meta):
    self.saved.append(step)
    self.last_saved_step = step

  def all_steps(self):
    return sorted(set(self.steps + self.saved))

  def wait(self, step=None):
    pass

  def close(self):
    pass


class _NonFiniteAt:
  def __init__(self, bad, skip=True):
    self.calls, self.bad, self.skip = 0, bad, skip

  def __call__(self, state, batch, rng):
    self.calls += 1
    bad = self.calls in self.bad
    return state, {"loss": jnp.asarray(float("nan") if bad else 1.0), "grad_norm": jnp.asarray(1.0),
                   "num_tokens": jnp.asarray(8.0), "skipped": jnp.asarray(float(bad and self.skip))}


def _trainer(tiny_overrides, bad, steps=9, **overrides):
  from MaxText.training import metrics
  from MaxText.configuration.config import Config
  from MaxText.training.trainer import Trainer

  config = Config.for_testing(**tiny_overrides, steps=steps, **overrides)
  return config, Trainer(config, _NonFiniteAt(bad, config.run.skip_nonfinite_steps), _Data(), jax.random.key(0),
                         metrics.training_tflops_per_step(config.model, 8, 32), 1.0)


def test_a_non_finite_step_is_never_saved_and_a_due_save_waits_for_the_next_finite_step(tiny_overrides, capsys):
  from MaxText.training.trainer import CheckpointHook

  _, trainer = _trainer(tiny_overrides, bad={4, 9})
  checkpoints = _RecordingCheckpoints()
  trainer.add_hook(CheckpointHook(checkpoints, 2, 9, _NoPreemption(), jax.random.key(0)), every=0, needs_state=True)
  trainer.run(state="state")
  assert checkpoints.saved == [2, 5, 6, 8]  # not 4 (due, non-finite: made at 5) nor 9 (the last step)
  err = capsys.readouterr().err
  assert "warning: step 4 is not saved: it was non-finite, its parameters give NaN/inf (the newest checkpoint is " \
         "step 2); the save waits for the next finite step" in err
  assert "warning: step 9 is not saved" in err and "the run ends without saving it" in err


def test_the_stop_names_the_last_good_step_and_a_command_with_a_lower_learning_rate(tiny_overrides):
  from MaxText.training import run_start
  from MaxText.errors import TrainingError

  argv = ["MaxText/train.py", "configs/base.yml", "run_name=r", "learning_rate=0.5"]
  config, trainer = _trainer(tiny_overrides, bad={6, 7, 8}, max_consecutive_skipped_steps=3, learning_rate=0.5)
  trainer.advise_nonfinite = run_start.nonfinite_advice(config, _RecordingCheckpoints([2, 4, 5]), argv)
  with pytest.raises(TrainingError, match=r"3 steps in a row were non-finite, up to step 8 .*: resume from step 4, "
                                          r"the last one known good, with a lower learning rate \(later checkpoints "
                                          r"are moved aside, not deleted\): python3 -m MaxText.train configs/base.yml "
                                          r"run_name=r resume_from_step=4 learning_rate=0.05 \(or "):
    trainer.run(state="state")
  # Already resumed from step 4 (and saved after it): the same value would not go back, an older step does.
  config, _ = _trainer(tiny_overrides, bad=set(), resume_from_step=4)
  advise = run_start.nonfinite_advice(config, _RecordingCheckpoints([2, 4, 5]), argv)
  assert "resume_from_step=2 " in advise(6) and "resume_from_step=5 " in advise(7)
  assert "from the beginning" in advise(2) and "resume_from_step=0 " in advise(2)
  # Clipping is on by default: the advice said to enable it all the same.
  assert advise(6).endswith("(or check the data)") and "gradient_clipping_threshold" not in advise(6)
  config, _ = _trainer(tiny_overrides, bad=set(), gradient_clipping_threshold=0.0)
  assert run_start.nonfinite_advice(config, None, argv)(6).endswith(", or enable gradient_clipping_threshold, or "
                                                                     "check the data")
  # Without checkpoints there is nothing to go back to: lower the learning rate.
  config, trainer = _trainer(tiny_overrides, bad={3}, skip_nonfinite_steps=False)
  trainer.advise_nonfinite = run_start.nonfinite_advice(config, None, argv)
  with pytest.raises(TrainingError, match=r"loss became nan at step 3 .*lower learning_rate \(e.g. learning_rate="):
    trainer.run(state="state")


def test_resume_from_step_sets_later_steps_aside_in_both_tiers_once(tmp_path):
  """RunCheckpoints with a local tier, in process: the rewind moves the later persistent and
  local steps aside (renamed), a rerun under the same value keeps the steps saved since, and a
  step that was never saved is refused by name."""
  from MaxText.training import run_start
  from MaxText.run_dir.checkpointing import REWIND_KEY, RunCheckpoints
  from MaxText.errors import UserError
  from MaxText.run_dir.local_checkpoints import LocalTier

  state = {"w": jnp.arange(8.0)}
  open_run = lambda: RunCheckpoints(str(tmp_path / "checkpoints"),  # noqa: E731
                                    local=LocalTier(str(tmp_path / "local"), 1, 10))
  checkpoints = open_run()
  for step in (2, 4, 6):
    checkpoints.save(step, state, {}, {"step": step})
  checkpoints.save_local(5, state, {}, {"step": 5})
  checkpoints.save_local(7, state, {}, {"step": 7})
  checkpoints.close()

  checkpoints = open_run()
  with pytest.raises(UserError, match=r"resume_from_step=3: .* holds no checkpoint of step 3 \(saved steps: 2, 4, 6\)"):
    checkpoints.rewind_plan(3)
  assert checkpoints.rewind_plan(2) == [6, 4]
  run_start.rewind(checkpoints, 2)
  assert checkpoints.all_steps() == [2] and checkpoints.newest_step() == 2
  names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  assert [n.split(".")[0] for n in names if ".before-resume_from_step_2-" in n] == ["4", "6"]
  assert sorted(p.name.split(".")[0] for p in (tmp_path / "local" / "process_0").iterdir()) == ["5", "7"]
  assert checkpoints.local.steps() == []  # both local steps were after 2: aside, not deleted
  checkpoints.save(4, state, {}, {"step": 4, REWIND_KEY: 2})  # trained on under resume_from_step=2
  checkpoints.close()

  checkpoints = open_run()
  assert checkpoints.rewind_plan(2) == []  # the same command again continues from step 4
  run_start.rewind(checkpoints, 2)
  assert checkpoints.all_steps() == [2, 4]
  checkpoints.close()
