"""A seeded fault campaign over elastic training: each trial runs a 2-slice job under the elastic
supervisor (MaxText/elastic.py, CPU loopback: one process of one device per slice) and kills one
of its processes at a random moment of one kind:

  - kill_in_step: after a random step, while the job trains;
  - kill_in_save: while a persistent-tier checkpoint is being written (Orbax's temporary step
    directory is there);
  - kill_in_resize: the job starts on one slice, the other returns after a random step, and a
    process of the grown job is killed before its first new step (while it starts, restores and
    compiles).

    python3 -m tests.chaos.elastic_campaign --seed 0 --trials 3

Per trial it checks that the job finishes without a person (the supervisor shrinks to the
surviving slice), that its losses equal an uninterrupted run's (to float32 rounding: a resize
changes the order of the gradient sums, see getting_started/Fault_tolerance.md), that each step is
logged once, that no checkpoint was lost (every resize after the kill resumed from at least the
newest step committed before it), and that every resize said how long it took.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.platform import loopback_launch
from MaxText import elastic
from MaxText.platform import run_progress
from MaxText.configuration.elastic_config import SliceLayout
from tests.chaos.training_campaign import REPO_ROOT, committed_steps, losses, saving_in_progress
from tests.compile_settings import FAST_COMPILE_FLAG, jax_cache_env

FAULTS = ("kill_in_step", "kill_in_save", "kill_in_resize")
STEPS = 12  # room after a return at step 4: the stopped job may log a few more steps first
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", f"steps={STEPS}", f"learning_rate_schedule_steps={STEPS}",
         "async_checkpointing=False", "distributed_heartbeat_timeout_seconds=10",
         "distributed_init_timeout_seconds=180", "per_device_batch_size=2", "log_period=1", "dataset_type=synthetic"]
# 2 slices of 1 device, 2 rows each: a batch of 4, taken as 2 micro-batches of 2 on one slice.
LAYOUT = SliceLayout(num_slices=2, devices_per_slice=1, batch_shards_per_slice=1, global_batch_size=4,
                     gradient_accumulation_steps=1, min_slices=1)
RTOL = 2e-5  # the float32 rounding of a changed summation order (tests/test_elastic.py)
TRIAL_SECONDS = 900


@dataclasses.dataclass(frozen=True)
class Trial:
  index: int
  fault: str
  victim: int  # kill_in_step/save: the slice whose process dies; kill_in_resize: the grown job's process
  after_step: int  # the fault comes after this step (kill_in_resize: the slice returns after it)
  delay: float  # after that: kill_in_resize, seconds; the others, half-steps (this machine's step time)
  checkpoint_period: int  # the persistent tier's; the local tier saves every step


def plan(seed: int, count: int, faults: tuple[str, ...] = FAULTS) -> list[Trial]:
  """`count` trials; every fault comes up before any repeats."""
  rng = random.Random(seed)
  trials: list[Trial] = []
  while len(trials) < count:
    kinds = list(faults)
    rng.shuffle(kinds)
    for fault in kinds[:count - len(trials)]:
      trials.append(Trial(len(trials), fault, victim=rng.randrange(2), after_step=rng.randint(2, 4),
                          delay=rng.uniform(0.0, 2.0), checkpoint_period=rng.choice((2, 3))))
  return trials


def _env() -> dict[str, str]:
  return loopback_launch.loopback_env({"PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": FAST_COMPILE_FLAG, **jax_cache_env()})


def _command(out: Path, run_name: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={out}",
          f"run_name={run_name}", *MODEL]


def _wait(condition: Any, timeout: float, poll_s: float = 0.02) -> bool:
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      return False
    time.sleep(poll_s)
  return True


@dataclasses.dataclass
class Outcome:
  trial: Trial
  problems: list[str]
  landed: bool = True  # the kill hit what it aimed at (a save in flight, a job still starting)
  saved_before: int = 0  # the newest persistent step committed before the kill
  resizes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  equal: bool = False


class Campaign:
  def __init__(self, seed: int, workdir: Path):
    self.seed, self.workdir, self.env = seed, workdir, _env()
    self._reference: dict[int, float] | None = None

  def reference(self) -> dict[int, float]:
    """The uninterrupted run: one process holding both slices' devices."""
    if self._reference is None:
      launcher = loopback_launch.LoopbackLauncher(_command(self.workdir, "reference"), 1, 1, 2, self.workdir / "ref_state",
                                          self.env, self.workdir / "ref_logs")
      ((_, proc),) = launcher.start([0], []).procs
      if proc.wait(timeout=900) != 0:
        raise RuntimeError(f"the uninterrupted run failed; its log: {self.workdir / 'ref_logs'}")
      self._reference = losses(str(self.workdir / "reference"))
    return self._reference

  def run(self, trial: Trial) -> Outcome:
    expected = self.reference()
    outcome = Outcome(trial, [])
    name = f"trial-{self.seed}-{trial.index}"
    run_dir, logs = self.workdir / name, self.workdir / f"{name}_logs"
    tiers = [f"checkpoint_period={trial.checkpoint_period}", "enable_emergency_checkpoint=True",
             f"local_checkpoint_directory={self.workdir / (name + '_local')}", "local_checkpoint_period=1",
             "elastic_min_slices=1"]
    launcher = loopback_launch.LoopbackLauncher([*_command(self.workdir, name), *tiers], 2, 1, 1, logs, self.env, logs)
    if trial.fault == "kill_in_resize":
      launcher.mark_lost(1)  # the job starts on slice 0; slice 1 returns later
    supervisor = elastic.Supervisor(LAYOUT, launcher, run_dir, poll_s=0.2, stop_grace_s=60,
                                    log=lambda line: (logs / "supervisor.log").open("a").write(line + "\n"))
    ended: list[object] = []
    thread = threading.Thread(target=lambda: ended.append(_outcome(supervisor)), daemon=True)
    thread.start()
    try:
      self._inject(trial, launcher, supervisor, run_dir, outcome)
    except TimeoutError as e:
      outcome.problems.append(str(e))
    thread.join(timeout=TRIAL_SECONDS)
    if thread.is_alive():
      outcome.problems.append(f"the job did not finish within {TRIAL_SECONDS} s")
      supervisor.interrupt()
      return outcome
    if ended != [0]:
      outcome.problems.append(f"the supervisor ended with {ended}; logs in {logs}")
      return outcome
    outcome.resizes = [dataclasses.asdict(r) for r in supervisor.resizes]
    self._check(outcome, run_dir, expected)
    return outcome

  def _inject(self, trial: Trial, launcher: loopback_launch.LoopbackLauncher, supervisor: elastic.Supervisor, run_dir: Path,
              outcome: Outcome) -> None:
    def reached(step: int) -> bool:
      return run_progress.logged_step(run_dir) >= step

    if not _wait(lambda: reached(trial.after_step - 1), 600):
      raise TimeoutError(f"step {trial.after_step - 1} never came")
    before = time.monotonic()
    if not _wait(lambda: reached(trial.after_step), 600):
      raise TimeoutError(f"step {trial.after_step} never came")
    step_s = time.monotonic() - before
    if trial.fault == "kill_in_resize":
      launcher.marker(1).unlink()  # the slice returns: the supervisor stops the job and grows it back
      if not _wait(lambda: launcher.generations == 2, 300):
        raise TimeoutError("the grow-back never started")
      time.sleep(trial.delay)
      outcome.saved_before = max(committed_steps(str(run_dir)), default=0)
      # Still before the grown job's first new step (the supervisor has not seen one): it restores and compiles first.
      outcome.landed = supervisor.resizes[-1].seconds_to_resume is None
      _kill(launcher, trial.victim)
      return
    # A moment within the next step or two, whatever this machine's step time: a fixed delay let a
    # fast machine finish the job before the kill.
    time.sleep(trial.delay / 2 * step_s)
    if trial.fault == "kill_in_save":
      _wait(lambda: saving_in_progress(str(run_dir)) or run_progress.logged_step(run_dir) >= STEPS, 600, poll_s=0.002)
      outcome.landed = saving_in_progress(str(run_dir))
    outcome.saved_before = max(committed_steps(str(run_dir)), default=0)
    if not _kill(launcher, trial.victim):
      outcome.problems.append(f"the job ended before the kill (step {run_progress.logged_step(run_dir)} of {STEPS} "
                              f"logged); the kill came {trial.delay / 2 * step_s:.2f} s after step {trial.after_step}")

  def _check(self, outcome: Outcome, run_dir: Path, expected: dict[int, float]) -> None:
    try:
      got = losses(str(run_dir))  # raises on a step logged twice
    except AssertionError as e:
      outcome.problems.append(str(e))
      return
    if sorted(got) != sorted(expected):
      outcome.problems.append(f"steps logged {sorted(got)}, expected {sorted(expected)}")
    elif not np.allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(expected)], rtol=RTOL, atol=0):
      outcome.problems.append(f"losses differ from the uninterrupted run beyond rtol={RTOL}: {got} vs {expected}")
    else:
      outcome.equal = True
    lost = [r for r in outcome.resizes if r["cause"].startswith("process ")]
    if not lost:
      outcome.problems.append("no resize followed the kill")
    for r in lost:
      if r["resumed_from"] < outcome.saved_before:
        outcome.problems.append(f"step {outcome.saved_before} was committed before the kill but the job resumed "
                                f"from step {r['resumed_from']}")
    for r, after in zip(outcome.resizes, outcome.resizes[1:] + [None]):
      # Only a resize that another cut short (a kill while the resized job starts) has no first new step.
      if r["seconds_to_resume"] is None and (after is None or not after["cause"].startswith("process ")):
        outcome.problems.append(f"the resize '{r['cause']}' never logged a new step")
    if max(committed_steps(str(run_dir)), default=0) != STEPS:
      outcome.problems.append(f"the last step {STEPS} was not saved")


def _outcome(supervisor: elastic.Supervisor) -> object:
  try:
    return supervisor.run()
  except Exception as e:  # noqa: BLE001 - reported as the trial's problem
    return f"{type(e).__name__}: {e}"


def _kill(launcher: loopback_launch.LoopbackLauncher, index: int) -> bool:
  """False: the process had already ended."""
  generation = launcher.current
  assert generation is not None
  _, proc = generation.procs[min(index, len(generation.procs) - 1)]
  alive = proc.poll() is None
  proc.kill()
  return alive


def summarize(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
  resumes = [r["seconds_to_resume"] for o in outcomes for r in o.resizes if r["seconds_to_resume"] is not None]
  return {"trials": len(outcomes), "faults": dict(sorted(collections.Counter(o.trial.fault for o in outcomes).items())),
          "equal_to_uninterrupted": sum(o.equal for o in outcomes), "resizes": sum(len(o.resizes) for o in outcomes),
          "steps_redone": sum(max(0, r["step_reached"] - r["resumed_from"]) for o in outcomes for r in o.resizes),
          "kills_on_target": sum(o.landed for o in outcomes),
          "max_seconds_to_resume": round(max(resumes), 1) if resumes else None,
          "trials_with_problems": sum(bool(o.problems) for o in outcomes), "wall_seconds": round(seconds)}


def run_campaign(seed: int, count: int, workdir: Path, log: Any = print,
                 faults: tuple[str, ...] = FAULTS) -> tuple[list[Outcome], dict[str, Any]]:
  campaign = Campaign(seed, workdir)
  started, outcomes = time.time(), []
  for trial in plan(seed, count, faults):
    t0 = time.time()
    outcome = campaign.run(trial)
    outcomes.append(outcome)
    resizes = ", ".join(f"{r['from_slices']}->{r['to_slices']} from step {r['resumed_from']}" for r in outcome.resizes)
    log(f"trial {trial.index:>2} {trial.fault:<15} victim {trial.victim} after step {trial.after_step} "
        f"{'' if outcome.landed else '(missed its target) '}resizes [{resizes}] equal {outcome.equal} "
        f"({time.time() - t0:.0f} s){'  PROBLEMS: ' + '; '.join(outcome.problems) if outcome.problems else ''}")
  summary = summarize(outcomes, time.time() - started)
  log("elastic campaign: " + json.dumps(summary))
  return outcomes, summary


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--faults", default=",".join(FAULTS), help="only these kinds (comma-separated)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    outcomes, _ = run_campaign(args.seed, args.trials, Path(tmp), faults=tuple(args.faults.split(",")))
  return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
  sys.exit(main())
