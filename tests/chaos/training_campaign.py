"""A seeded fault campaign over real training runs: each trial starts `MaxText.train`, hits it
with one fault at a random moment, then reruns the same command until it finishes, and checks
that the run ends exactly like one that was never interrupted.

    python3 -m tests.chaos.training_campaign --seed 0 --trials 20 [--storage local,gcs] [--processes 1,2]

Faults: SIGKILL or SIGTERM at a random moment, SIGKILL while a checkpoint is being written,
SIGKILL while the lease heartbeat is being written (gs://: the proxy sees that request), and
storage faults on gs:// (503s, connection resets, stalls, a stopped endpoint), either for a
few seconds or until the run gives up. Per trial it checks:
  - the finished run's losses (metrics.jsonl) and final parameters are bitwise equal to an
    uninterrupted run of the same layout;
  - no step lost that was saved: the rerun resumes from at least the newest committed step
    seen before the fault and any step a SIGTERM stop reported;
  - every failure that was not a SIGKILL is announced: one `error` line and no traceback (or
    the SIGTERM stop line), and a storage fault that outlasts the run ends it within
    storage_retry_seconds + ANNOUNCE_SLACK_SECONDS;
  - nothing hangs: every process exits within HANG_SECONDS of the fault.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from tests.compile_settings import cpu_xla_flags, jax_cache_env

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 32
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", f"steps={STEPS}", f"learning_rate_schedule_steps={STEPS}",
         "run_lease_timeout_seconds=12", "distributed_heartbeat_timeout_seconds=10",
         "distributed_init_timeout_seconds=120"]
STORAGE_RETRY_SECONDS = 8
ANNOUNCE_SLACK_SECONDS = 20  # process exit, uploader and heartbeat threads, a loaded 2-core machine
HANG_SECONDS = 240
MAX_RERUNS = 4
PROCESS_FAULTS = ("sigkill", "sigterm", "sigkill_in_save")
GCS_FAULTS = ("sigkill_in_heartbeat", "5xx", "reset", "stall", "down")
STORAGE_FAULTS = ("5xx", "reset", "stall", "down")
# What JAX's distributed runtime prints before it aborts a process whose peer died. jaxlib 0.10
# offers no usable hook to replace that abort (its missed_heartbeat_callback cannot be called
# from Python: the status argument fails to convert), so a peer's abort is checked for this line.
PEER_ABORT_LINE = "Terminating process because the JAX distributed service detected fatal errors"


@dataclasses.dataclass(frozen=True)
class Layout:
  storage: str  # "local" | "gcs"
  processes: int

  def __str__(self) -> str:
    return f"{self.storage}/{self.processes}p"


@dataclasses.dataclass(frozen=True)
class Trial:
  index: int
  layout: Layout
  fault: str
  delay: float  # seconds after the first step line
  persistent: bool  # storage faults: until the run exits (else for `duration` seconds)
  duration: float
  checkpoint_period: int
  victim: int  # the process a SIGKILL hits


def plan(seed: int, count: int, layouts: list[Layout], faults: tuple[str, ...] | None = None) -> list[Trial]:
  """`count` trials; every (layout, fault) pair comes up before any repeats."""
  rng = random.Random(seed)
  pairs = [(layout, fault) for layout in layouts
           for fault in PROCESS_FAULTS + (GCS_FAULTS if layout.storage == "gcs" else ())
           if faults is None or fault in faults]
  trials: list[Trial] = []
  while len(trials) < count:
    rng.shuffle(pairs)
    for layout, fault in pairs[:count - len(trials)]:
      trials.append(Trial(len(trials), layout, fault, delay=rng.uniform(0.0, 1.5), persistent=rng.random() < 0.5,
                          duration=rng.uniform(1.0, 4.0), checkpoint_period=rng.choice((2, 3, 5)),
                          victim=rng.randrange(layout.processes)))
  return trials


# ---------------------------------------------------------------------------------------------- processes
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """One launch of a run: its processes and their output lines, read as they come."""

  def __init__(self, out: str, run_name: str, layout: Layout, env: dict[str, str], extra: list[str]):
    command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={run_name}",
               f"base_output_directory={out}", *MODEL, *extra]
    base = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
            "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": cpu_xla_flags(2 // layout.processes),
            **jax_cache_env(), **env}
    if layout.processes > 1:
      base.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_PROCESS_COUNT=str(layout.processes))
    self.lines: list[list[tuple[float, str, str]]] = [[] for _ in range(layout.processes)]
    self.first_step = threading.Event()
    self.procs = [subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**base, **({"JAX_PROCESS_ID": str(i)} if layout.processes > 1 else {})})
                  for i in range(layout.processes)]
    self.exited_at: list[float | None] = [None] * layout.processes
    self._readers = [threading.Thread(target=self._read, args=(i, name), daemon=True)
                     for i in range(layout.processes) for name in ("stdout", "stderr")]
    for reader in self._readers:
      reader.start()

  def _read(self, i: int, name: str) -> None:
    for line in getattr(self.procs[i], name):
      self.lines[i].append((time.time(), name, line.rstrip("\n")))
      if name == "stdout" and line.startswith("step "):
        self.first_step.set()

  def signal(self, sig: int, which: list[int]) -> None:
    for i in which:
      if self.procs[i].poll() is None:
        self.procs[i].send_signal(sig)

  def wait(self, timeout: float) -> bool:
    """True when every process exited within `timeout`; the rest are then killed."""
    deadline, ok = time.time() + timeout, True
    for i, proc in enumerate(self.procs):
      try:
        proc.wait(timeout=max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        ok = False
        proc.kill()
        proc.wait()
      self.exited_at[i] = self.exited_at[i] or time.time()
    for reader in self._readers:
      reader.join(timeout=10)
    return ok

  def watch_exits(self) -> None:
    """Records when each process exits (for the time-to-error bound)."""
    def watch(i: int) -> None:
      self.procs[i].wait()
      self.exited_at[i] = time.time()
    for i in range(len(self.procs)):
      threading.Thread(target=watch, args=(i,), daemon=True).start()

  def stdout(self, i: int) -> list[str]:
    return [text for _, name, text in self.lines[i] if name == "stdout"]

  def stderr(self, i: int) -> list[str]:
    return [text for _, name, text in self.lines[i] if name == "stderr"]

  @property
  def codes(self) -> list[int]:
    return [p.returncode for p in self.procs]


# ---------------------------------------------------------------------------------------------- run records
def losses(run_dir: str) -> dict[int, float]:
  from MaxText.paths import storage

  records = [json.loads(line) for line in storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()]
  steps = [r["step"] for r in records if "loss" in r]
  if len(steps) != len(set(steps)):
    raise AssertionError(f"metrics.jsonl repeats steps: {steps}")
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def committed_steps(run_dir: str) -> list[int]:
  """Steps whose checkpoint is complete. A gs:// run directory is listed through the GCS JSON
  API itself: gcsfs caches listings in this process, which would hide later saves."""
  if run_dir.startswith("gs://"):
    import urllib.request

    bucket, _, prefix = run_dir[len("gs://"):].partition("/")
    names, token = [], ""
    while True:
      query = f"prefix={urllib.parse.quote(prefix + '/checkpoints/')}" + (f"&pageToken={token}" if token else "")
      url = f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}/o?{query}"
      page = json.loads(urllib.request.urlopen(url, timeout=30).read())
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken", "")
      if not token:
        break
    done = {n.split("/")[-2] for n in names if n.endswith("/commit_success.txt") and n.count("/") == prefix.count("/") + 3}
    return sorted(int(n) for n in done if n.isdigit())
  directory = os.path.join(run_dir, "checkpoints")
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(directory, n, "commit_success.txt")))


def saving_in_progress(run_dir: str) -> bool:
  """A local checkpoint being written: Orbax writes a step into a temporary directory first."""
  directory = os.path.join(run_dir, "checkpoints")
  try:
    return any(not n.isdigit() and "tmp" in n for n in os.listdir(directory))
  except FileNotFoundError:
    return False


def final_params(run_dir: str) -> dict[str, Any]:
  """The newest committed step's parameters as host arrays, by path."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from MaxText.paths import storage

  step = committed_steps(run_dir)[-1]
  path = storage.as_path(storage.join(run_dir, "checkpoints", str(step), "state"))
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def params_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
  return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


# ---------------------------------------------------------------------------------------------- the campaign
@dataclasses.dataclass
class Outcome:
  trial: Trial
  problems: list[str]
  resumed: bool = False
  bitwise_equal: bool = False
  reruns: int = 0
  announce_seconds: float | None = None  # fault start -> the last failing process's exit
  landed: bool = True  # a kill aimed at a save or a heartbeat write hit one in flight
  peer_aborts: int = 0  # processes JAX's runtime aborted because another process of the job died
  codes: list[int] = dataclasses.field(default_factory=list)


class Campaign:
  def __init__(self, seed: int, workdir: Path, gcs: Any = None, proxy: Any = None, bucket: str | None = None):
    self.seed, self.workdir, self.gcs, self.proxy, self.bucket = seed, workdir, gcs, proxy, bucket
    self.references: dict[Layout, tuple[dict[int, float], dict[str, Any]]] = {}
    self.extra = [f"storage_retry_seconds={STORAGE_RETRY_SECONDS}"] if _has_key("storage_retry_seconds") else []

  def _out(self, layout: Layout) -> str:
    return f"gs://{self.bucket}" if layout.storage == "gcs" else str(self.workdir)

  def _env(self, layout: Layout) -> dict[str, str]:
    return self.proxy.env() if layout.storage == "gcs" else {}

  def reference(self, layout: Layout) -> tuple[dict[int, float], dict[str, Any]]:
    if layout not in self.references:
      name = f"reference-{layout.storage}-{layout.processes}p"
      job = Job(self._out(layout), name, layout, self._env(layout), ["checkpoint_period=8", *self.extra])
      if not job.wait(600) or any(job.codes):
        raise RuntimeError(f"the uninterrupted {layout} run failed: {job.codes}\n" + "\n".join(job.stderr(0)[-30:]))
      run_dir = f"{self._out(layout)}/{name}"
      self.references[layout] = (losses(run_dir), final_params(run_dir))
    return self.references[layout]

  def run(self, trial: Trial) -> Outcome:
    expected_losses, expected_params = self.reference(trial.layout)
    outcome = Outcome(trial, [])
    name = f"trial-{self.seed}-{trial.index}"
    run_dir = f"{self._out(trial.layout)}/{name}"
    extra = [f"checkpoint_period={trial.checkpoint_period}", *self.extra]
    job = Job(self._out(trial.layout), name, trial.layout, self._env(trial.layout), extra)
    job.watch_exits()
    if not job.first_step.wait(300):
      job.wait(1)
      outcome.problems.append(f"no first step: {job.codes} {job.stderr(0)[-5:]}")
      return outcome
    fault_at, saved_before, directly_killed, outcome.landed = self._inject(trial, job, run_dir)
    hung = not job.wait(HANG_SECONDS)
    if self.proxy is not None:
      self.proxy.set_mode("pass")
      self.proxy.clear_hooks()
    outcome.codes = job.codes
    if hung:
      outcome.problems.append(f"a process did not exit within {HANG_SECONDS} s of the fault")
    reported = self._check_announcements(trial, job, fault_at, directly_killed, outcome)
    saved_before = max([*saved_before, *reported], default=0)

    done, first_resume = all(code == 0 for code in job.codes), None
    while not done and outcome.reruns < MAX_RERUNS:
      outcome.reruns += 1
      rerun = Job(self._out(trial.layout), name, trial.layout, self._env(trial.layout), extra)
      if not rerun.wait(600):
        outcome.problems.append("a rerun did not finish within 600 s")
        break
      done = all(code == 0 for code in rerun.codes)
      if first_resume is None:
        first_resume = _resumed_from(rerun.stdout(0))
      if not done:
        outcome.problems.append(f"rerun {outcome.reruns} failed {rerun.codes}: {_errors(rerun)[:2]}")
    if not done:
      outcome.problems.append("the run never finished")
      return outcome
    outcome.resumed = first_resume is not None
    if saved_before and (first_resume or 0) < saved_before:
      outcome.problems.append(f"step {saved_before} was saved before the fault but the rerun resumed from "
                              f"{first_resume}")
    got = losses(run_dir)
    if got != expected_losses:
      diff = [s for s in sorted(set(got) | set(expected_losses)) if got.get(s) != expected_losses.get(s)]
      outcome.problems.append(f"losses differ from the uninterrupted run at steps {diff[:8]}")
    elif not params_equal(final_params(run_dir), expected_params):
      outcome.problems.append("final parameters differ from the uninterrupted run")
    else:
      outcome.bitwise_equal = True
    return outcome

  def _inject(self, trial: Trial, job: Job, run_dir: str) -> tuple[float, list[int], set[int], bool]:
    """Applies the trial's fault; returns when it started, the steps committed before it, the
    processes a signal hit directly, and whether a kill aimed at a write hit one in flight."""
    victim, everyone = [trial.victim], list(range(trial.layout.processes))
    if trial.fault in ("sigkill_in_save", "sigkill_in_heartbeat") and trial.layout.storage == "gcs":
      target = "/checkpoints/" if trial.fault == "sigkill_in_save" else "lease.json"
      fired = threading.Event()

      def kill() -> None:
        job.signal(signal.SIGKILL, victim)
        fired.set()
      time.sleep(trial.delay)
      saved = committed_steps(run_dir)
      self.proxy.on_request(lambda method, path: method != "GET" and target in urllib.parse.unquote(path), kill)
      while not fired.is_set() and any(p.poll() is None for p in job.procs):
        time.sleep(0.01)
      return time.time(), saved, set(victim) if fired.is_set() else set(), fired.is_set()
    if trial.fault == "sigkill_in_save":  # local: poll for Orbax's temporary step directory
      time.sleep(trial.delay)
      while any(p.poll() is None for p in job.procs) and not saving_in_progress(run_dir):
        time.sleep(0.002)
      landed = saving_in_progress(run_dir)
      saved = committed_steps(run_dir)
      job.signal(signal.SIGKILL, victim)
      return time.time(), saved, set(victim), landed
    time.sleep(trial.delay)
    saved = committed_steps(run_dir)
    if trial.fault == "sigkill":
      job.signal(signal.SIGKILL, victim)
      return time.time(), saved, set(victim), True
    if trial.fault == "sigterm":  # a preemption notice reaches every host
      job.signal(signal.SIGTERM, everyone)
      return time.time(), saved, set(), True
    fault_at = time.time()
    self.proxy.set_mode(trial.fault, fraction=1.0 if trial.persistent else 0.5,
                        stall_seconds=STORAGE_RETRY_SECONDS * 3 if trial.persistent else 2.0)
    if not trial.persistent:
      time.sleep(trial.duration)
      self.proxy.set_mode("pass")
    return fault_at, saved, set(), True

  def _check_announcements(self, trial: Trial, job: Job, fault_at: float, directly_killed: set[int],
                           outcome: Outcome) -> list[int]:
    """Every process that stopped without being killed said why in one line; returns the steps a
    SIGTERM stop reported saved."""
    reported: list[int] = []
    for i, code in enumerate(job.codes):
      if i in directly_killed or code == 0:
        continue
      out, err = job.stdout(i), job.stderr(i)
      stop = next((line for line in out if line.startswith("stopped: SIGTERM: saved step ")), None)
      if trial.fault == "sigterm" and code == 128 + signal.SIGTERM and stop:
        reported.append(int(stop.split("saved step ")[1].split()[0]))
        continue
      if code == -signal.SIGABRT and directly_killed and any(PEER_ABORT_LINE in line for line in err):
        outcome.peer_aborts += 1
        continue
      errors = [line for line in err if re.match(r"error( \[[^]]*\])?:", line)]
      if len(errors) != 1:
        outcome.problems.append(f"process {i} exited {code} with {len(errors)} error lines: {errors[:3]}")
      if any("Traceback" in line for line in err):
        outcome.problems.append(f"process {i} printed a traceback")
      if code in (0, 128 + signal.SIGTERM, -signal.SIGTERM):
        outcome.problems.append(f"process {i} failed with exit code {code}, which reads as success or preemption")
      took = (job.exited_at[i] or time.time()) - fault_at
      outcome.announce_seconds = max(outcome.announce_seconds or 0.0, took)
      if trial.fault in STORAGE_FAULTS and took > STORAGE_RETRY_SECONDS + ANNOUNCE_SLACK_SECONDS:
        outcome.problems.append(f"process {i} announced the storage failure after {took:.0f} s (budget "
                                f"{STORAGE_RETRY_SECONDS} + {ANNOUNCE_SLACK_SECONDS} s)")
    return reported


def _resumed_from(lines: list[str]) -> int | None:
  for line in lines:
    m = re.match(r"state: resumed from step (\d+)", line)
    if m:
      return int(m.group(1))
  return None


def _errors(job: Job) -> list[str]:
  return [line for i in range(len(job.procs)) for line in job.stderr(i) if line.startswith("error")]


def _has_key(key: str) -> bool:
  return re.search(rf"^{key}:", (REPO_ROOT / "configs" / "base.yml").read_text(), re.M) is not None


def summarize(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
  faults = collections.Counter(o.trial.fault for o in outcomes)
  layouts = collections.Counter(str(o.trial.layout) for o in outcomes)
  announced = [o.announce_seconds for o in outcomes if o.announce_seconds is not None]
  return {"trials": len(outcomes), "faults": dict(sorted(faults.items())), "layouts": dict(sorted(layouts.items())),
          "resumed_from_a_checkpoint": sum(o.resumed for o in outcomes), "reruns": sum(o.reruns for o in outcomes),
          "bitwise_equal": sum(o.bitwise_equal for o in outcomes),
          "peer_aborts_by_jax": sum(o.peer_aborts for o in outcomes),
          "kills_inside_a_write": sum(o.landed for o in outcomes
                                      if o.trial.fault in ("sigkill_in_save", "sigkill_in_heartbeat")),
          "max_seconds_to_error_line": round(max(announced), 1) if announced else None,
          "trials_with_problems": sum(bool(o.problems) for o in outcomes), "wall_seconds": round(seconds)}


def run_campaign(seed: int, count: int, layouts: list[Layout], workdir: Path, gcs: Any = None,
                 log: Any = print, faults: tuple[str, ...] | None = None) -> tuple[list[Outcome], dict[str, Any]]:
  """Runs the trials; `gcs` (a tests.gcs_emulator.GcsServer, started) is needed for gcs layouts."""
  from tests.chaos.fault_proxy import FaultProxy

  proxy = bucket = None
  if any(layout.storage == "gcs" for layout in layouts):
    proxy = FaultProxy(gcs.url, seed)
    bucket = gcs.create_bucket()
  campaign = Campaign(seed, workdir, gcs, proxy, bucket)
  started, outcomes = time.time(), []
  try:
    for trial in plan(seed, count, layouts, faults):
      t0 = time.time()
      outcome = campaign.run(trial)
      outcomes.append(outcome)
      log(f"trial {trial.index:>3} {str(trial.layout):<9} {trial.fault:<20} "
          f"{'persistent' if trial.persistent and trial.fault in STORAGE_FAULTS else '':<10} "
          f"{'' if outcome.landed else '(missed the write) '}exit {outcome.codes} reruns {outcome.reruns} bitwise {outcome.bitwise_equal} "
          f"({time.time() - t0:.0f} s){'  PROBLEMS: ' + '; '.join(outcome.problems) if outcome.problems else ''}")
  finally:
    if proxy is not None:
      proxy.close()
  summary = summarize(outcomes, time.time() - started)
  if proxy is not None:
    summary["storage_requests"] = dict(proxy.counts)
  log("campaign: " + json.dumps(summary))
  return outcomes, summary


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trials", type=int, default=20)
  parser.add_argument("--storage", default="local,gcs")
  parser.add_argument("--processes", default="1,2")
  parser.add_argument("--faults", default="", help="only these kinds (comma-separated); default all")
  args = parser.parse_args()
  layouts = [Layout(s, int(p)) for s in args.storage.split(",") for p in args.processes.split(",")]
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import logging

  logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's metadata warnings on every read
  gcs = None
  with tempfile.TemporaryDirectory() as tmp:
    if any(layout.storage == "gcs" for layout in layouts):
      from MaxText.paths import cloud_env
      from tests.gcs_emulator import GcsServer

      gcs = GcsServer(Path(tmp) / "gcs")
      (Path(tmp) / "gcs").mkdir()
      gcs.start()
      os.environ.update(gcs.env())
      cloud_env.configure_cloud_env()
    try:
      outcomes, _ = run_campaign(args.seed, args.trials, layouts, Path(tmp), gcs,
                                 faults=tuple(args.faults.split(",")) if args.faults else None)
    finally:
      if gcs is not None:
        gcs.stop()
  return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
  sys.exit(main())
