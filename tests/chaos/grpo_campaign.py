"""A seeded fault campaign over GRPO runs whose reward function misbehaves: each trial starts
`MaxText.train` with a reward function that turns hostile at a random rollout (the first, run
before anything is written, or a later one) and checks how the run ends.

    python3 -m tests.chaos.grpo_campaign --seed 0 --trials 12 [--faults hang,exit,...]

Faults, and what each trial must end in:
  - hang (never returns), with step_timeout_seconds=HANG_TIMEOUT: exit 4 within the timeout plus
    HANG_SLACK_SECONDS, one `error:` line naming the function;
  - exit (sys.exit with a random status, 0 included), raise (a random exception type), nan/inf
    (one value at a random completion), wrong_length, wrong_type: exit 2, one `error:` line naming
    the function, no traceback;
  - mutate (clears and rewrites every argument in place on every call), slow (sleeps a random
    0.2-1.5 s on every call, below step_timeout_seconds): the run finishes and its losses, gradient
    norms, rewards and completion lengths are bitwise those of the clean run;
  - huge (every reward times a random factor up to 1.7e308): the run finishes, every step trains
    (finite loss and gradient norm) and the first step's advantages equal the clean run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
HANG_TIMEOUT = 8  # step_timeout_seconds of a hang trial: above a tiny model's step on a loaded machine
STEP_TIMEOUT = 60  # the other trials': the watchdog is on and must not fire
HANG_SLACK_SECONDS = 60  # start-up and the engine's compilation before the first rollout's rewards
HARD_TIMEOUT = 400
FAULTS = ("hang", "exit", "raise", "nan", "inf", "wrong_length", "wrong_type", "mutate", "slow", "huge")
FAILING = {"exit": 2, "raise": 2, "nan": 2, "inf": 2, "wrong_length": 2, "wrong_type": 2, "hang": 4}
COMPARED = ("loss", "grad_norm", "reward", "completions/mean_length")

# The clean reward (tests/test_grpo_run.py's) and the hostile wrapper a trial writes as its module.
HOSTILE = '''
import math, sys, time
_calls = [0]

def _clean(completion_ids):
  return [sum(t < 160 for t in c) / max(len(c), 1) for c in completion_ids]

def clean(completion_ids, **_):
  return _clean(completion_ids)

def hostile(prompts, completions, completion_ids, **columns):
  call = _calls[0]
  _calls[0] += 1
  values = _clean(completion_ids)
  kind, at, arg = {kind!r}, {at!r}, {arg!r}
  if kind == "mutate":
    for ids in completion_ids:
      ids.clear()
    completion_ids.append([0])
    completions.clear()
    prompts.reverse()
    for column in columns.values():
      column.clear()
    return values
  if kind == "slow":
    time.sleep(arg)
    return values
  if kind == "huge":
    return [v * arg for v in values]
  if call != at:
    return values
  if kind == "hang":
    while True:
      time.sleep(1)
  if kind == "exit":
    sys.exit(arg)
  if kind == "raise":
    raise {{"ValueError": ValueError, "KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError,
            "RecursionError": RecursionError}}[arg]("hostile")
  if kind in ("nan", "inf"):
    values[arg % len(values)] = math.nan if kind == "nan" else -math.inf
    return values
  if kind == "wrong_length":
    return values[:-1] if arg else values + [0.0]
  return {{"str": "1.0", "dict": {{"reward": 1.0}}, "None": None, "nested": [[v] for v in values]}}[arg]
'''


@dataclasses.dataclass(frozen=True)
class Trial:
  index: int
  fault: str
  at: int  # the reward call (0 = the first rollout, before anything is written) that turns hostile
  arg: Any  # the fault's parameter: exit status, exception type, completion, delay, factor, ...

  @property
  def module(self) -> str:
    return f"hostile_{self.index}"


def plan(seed: int, count: int, faults: tuple[str, ...] = FAULTS) -> list[Trial]:
  """`count` trials; every fault comes up before any repeats."""
  rng = random.Random(seed)
  trials: list[Trial] = []
  while len(trials) < count:
    kinds = list(faults)
    rng.shuffle(kinds)
    for fault in kinds[:count - len(trials)]:
      arg: Any = {"exit": rng.choice((0, 1, 3, "bye")), "raise": rng.choice(("ValueError", "KeyError",
                                                                           "ZeroDivisionError", "RecursionError")),
                  "nan": rng.randrange(16), "inf": rng.randrange(16), "wrong_length": rng.randrange(2),
                  "wrong_type": rng.choice(("str", "dict", "None", "nested")), "slow": round(rng.uniform(0.2, 1.5), 2),
                  "huge": rng.choice((1e200, 1e300, 1.7e308))}.get(fault)
      trials.append(Trial(len(trials), fault, at=rng.randrange(STEPS), arg=arg))
  return trials


# ---------------------------------------------------------------------------------------------- runs
def prepare(workdir: Path) -> None:
  """The tokenizer, prompts and starting parameters tests/test_grpo_run.py trains from."""
  from tests.test_grpo_run import prepare as prepare_grpo_run

  prepare_grpo_run(workdir)


@dataclasses.dataclass
class Run:
  code: int | None  # None: killed at HARD_TIMEOUT
  seconds: float
  stderr: str
  metrics: list[dict[str, Any]]


def run(workdir: Path, out: Path, module: str, function: str, timeout: int) -> Run:
  from tests.test_grpo_run import _command, _env

  command = _command(workdir, out, f"steps={STEPS}", f"step_timeout_seconds={timeout}",
                     f"reward_functions={module}:{function}", "enable_checkpointing=False")
  started = time.time()
  try:
    proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(workdir, 2), capture_output=True, text=True,
                          timeout=HARD_TIMEOUT)
    code, stderr = proc.returncode, proc.stderr
  except subprocess.TimeoutExpired as e:
    code, stderr = None, e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
  metrics_file = out / "grpo" / "metrics.jsonl"
  metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
  return Run(code, time.time() - started, stderr, metrics)


def _errors(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if re.match(r"error( \[[^]]*\])?:", line)]


def check(trial: Trial, got: Run, reference: list[dict[str, Any]]) -> list[str]:
  """What is wrong with how the trial's run ended (empty: it ended right)."""
  name = f"{trial.module}:hostile"
  if got.code is None:
    return [f"the run did not end within {HARD_TIMEOUT} s"]
  problems = []
  if trial.fault in FAILING:
    errors = _errors(got.stderr)
    if got.code != FAILING[trial.fault]:
      problems.append(f"exit {got.code}, expected {FAILING[trial.fault]}: {got.stderr[-600:]}")
    if len(errors) != 1 or f"reward function {name}" not in errors[0]:
      problems.append(f"expected one error line naming {name}, got {errors}")
    if trial.fault != "hang" and "Traceback" in got.stderr:
      problems.append("a traceback")
    if trial.fault == "hang" and got.seconds > HANG_TIMEOUT + HANG_SLACK_SECONDS + (trial.at * 30):
      problems.append(f"the hang ended the run only after {got.seconds:.0f} s")
    if trial.at == 0 and any(r.get("step") for r in got.metrics):
      problems.append("a step was written before the first rollout's rewards failed")
    return problems
  if got.code != 0:
    return [f"exit {got.code}: {_errors(got.stderr) or got.stderr[-600:]}"]
  steps = [r for r in got.metrics if "loss" in r]
  if len(steps) != STEPS:
    return [f"{len(steps)} steps written, expected {STEPS}"]
  if trial.fault in ("mutate", "slow"):
    ours = [[r[k] for k in COMPARED] for r in steps]
    theirs = [[r[k] for k in COMPARED] for r in reference if "loss" in r]
    if ours != theirs:
      problems.append(f"metrics differ from the clean run: {ours} vs {theirs}")
  else:  # huge
    import math

    if not all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in steps):
      problems.append(f"a step did not train: {[(r['loss'], r['grad_norm']) for r in steps]}")
    first, clean = steps[0], next(r for r in reference if "loss" in r)
    for key in ("advantage_std", "advantage_abs_max", "frac_reward_zero_std"):  # up to the + 1e-4 on the std
      if not math.isclose(first[key], clean[key], rel_tol=1e-2, abs_tol=1e-6):
        problems.append(f"step 1's {key} is {first[key]}, the clean run's {clean[key]}")
  return problems


@dataclasses.dataclass
class Outcome:
  trial: Trial
  code: int | None
  seconds: float
  problems: list[str]


def run_campaign(seed: int, count: int, workdir: Path, faults: tuple[str, ...] = FAULTS,
                 log: Any = print) -> tuple[list[Outcome], dict[str, Any]]:
  prepare(workdir)
  trials = plan(seed, count, faults)
  for trial in trials:
    (workdir / f"{trial.module}.py").write_text(HOSTILE.format(kind=trial.fault, at=trial.at, arg=trial.arg))
  (workdir / "hostile_clean.py").write_text(HOSTILE.format(kind="none", at=-1, arg=None))
  reference = run(workdir, workdir / "reference", "hostile_clean", "clean", STEP_TIMEOUT)
  if reference.code != 0:
    raise RuntimeError(f"the clean run failed ({reference.code}): {reference.stderr[-2000:]}")
  started, outcomes = time.time(), []
  for trial in trials:
    got = run(workdir, workdir / f"trial-{trial.index}", trial.module, "hostile",
              HANG_TIMEOUT if trial.fault == "hang" else STEP_TIMEOUT)
    outcome = Outcome(trial, got.code, got.seconds, check(trial, got, reference.metrics))
    outcomes.append(outcome)
    said = next(iter(_errors(got.stderr)), "")
    log(f"trial {trial.index:>3} {trial.fault:<13} at rollout {trial.at} ({trial.arg!s:<10}) exit {got.code} "
        f"({got.seconds:.0f} s){'  PROBLEMS: ' + '; '.join(outcome.problems) if outcome.problems else ''}"
        f"{chr(10) + '      ' + said[:220] if said else ''}")
  summary = {"trials": len(outcomes), "faults": sorted({o.trial.fault for o in outcomes}),
             "ended_right": sum(not o.problems for o in outcomes), "wall_seconds": round(time.time() - started)}
  log("campaign: " + json.dumps(summary))
  return outcomes, summary


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trials", type=int, default=len(FAULTS))
  parser.add_argument("--faults", default="", help="only these kinds (comma-separated); default all")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    outcomes, _ = run_campaign(args.seed, args.trials, Path(tmp),
                               tuple(args.faults.split(",")) if args.faults else FAULTS)
  return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
  sys.exit(main())
