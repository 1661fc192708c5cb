"""Elastic training: its configuration checks, the resize arithmetic, and the proof that a run that
continues on fewer slices with more gradient accumulation trains like one that never lost a slice."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import multihost_runner
from MaxText.platform import loopback_launch
from MaxText import elastic
from MaxText.platform import run_progress
from MaxText.platform.generations import Exit
from MaxText.configuration import elastic_config
from MaxText.configuration.config import Config
from MaxText.configuration.elastic_config import SliceLayout
from MaxText.errors import ConfigError
from MaxText.platform.accelerators import DeviceTarget
from MaxText.run_dir.checkpointing import RunCheckpoints
from MaxText.training import metrics as metrics_lib
from MaxText.training.run_assembly import build_run


# ----------------------------------------------------------------------------------- configuration
def test_a_minimum_above_the_starting_slice_count_is_one_line():
  with pytest.raises(ConfigError, match=r"^elastic_min_slices=3 is above the run's 2 slice\(s\) \(num_slices\); "
                                        r"set it to at most 2$"):
    Config.for_testing(num_slices=2, elastic_min_slices=3)


def test_a_minimum_whose_accumulation_cannot_keep_the_global_batch_is_one_line():
  # 4 slices of 2 devices, 1 row per device: global batch 8; on 3 slices a micro-batch takes 6 rows.
  with pytest.raises(ConfigError) as error:
    Config.for_testing(num_slices=4, elastic_min_slices=3, per_device_batch_size=1)
  assert str(error.value) == ("elastic_min_slices=3 cannot keep the global batch with gradient accumulation: the "
                              "global batch 8 is not divisible by 3 slice(s) x 2 batch shards x 1 row(s) per "
                              "micro-batch; slice counts that keep it: 1, 2, 4")


def test_an_elastic_run_with_rows_repeated_over_tensor_counts_the_devices_that_split_rows():
  # 4 slices of 2 devices, tensor=2: 4 sequences, one per slice, each repeated on its slice's 2 devices.
  config = Config.for_testing(num_slices=4, elastic_min_slices=1, per_device_batch_size=0.5, ici_tensor_parallelism=2)
  layout = elastic_config.layout_of(config.mesh, 8, 4, 1, 1, config.data.batch_axes)
  assert (layout.batch_shards_per_slice, layout.micro_rows) == (1, 1)
  assert elastic_config.resize(layout, 2).overrides() == ["num_slices=2", "dcn_data_parallelism=2",
                                                          "per_device_batch_size=1", "gradient_accumulation_steps=2"]
  with pytest.raises(ConfigError) as error:
    Config.for_testing(num_slices=4, elastic_min_slices=3, per_device_batch_size=0.5, ici_tensor_parallelism=2)
  assert str(error.value) == ("elastic_min_slices=3 cannot keep the global batch with gradient accumulation: the "
                              "global batch 4 is not divisible by 3 slice(s) x 1 batch shards x 1 row(s) per "
                              "micro-batch; slice counts that keep it: 1, 2, 4")


def test_an_elastic_run_spreads_only_data_parallelism_across_slices():
  with pytest.raises(ConfigError, match="set dcn_fsdp_parallelism=2 to 1 or elastic_min_slices=0"):
    Config.for_testing(num_slices=2, elastic_min_slices=1, dcn_fsdp_parallelism=2, dcn_data_parallelism=1)


def test_an_elastic_run_reads_only_data_whose_position_survives_a_resize():
  mesh = Config.for_testing(num_slices=2).mesh
  base = {"elastic_min_slices": 1, "dataset_type": "hf", "gradient_accumulation_steps": 1}
  for kind in ("synthetic", "tfds", "hf", "grain", "stream"):  # virtual data shards (input_pipeline/pipeline.py)
    elastic_config.check({**base, "dataset_type": kind}, mesh, num_devices=8, global_batch_size=64,
                         batch_axes=mesh.data_sharding)
  elastic_config.check({**base, "data_mixture": [{"name": "a"}]}, mesh, num_devices=8, global_batch_size=64,
                       batch_axes=mesh.data_sharding)
  for extra, culprit in [({"distill_top_k_path": "/top_k"}, "distill_top_k_path=/top_k"),
                         ({"objective": "grpo"}, r"objective=grpo \(its prompts\)")]:
    with pytest.raises(ConfigError, match=rf"^elastic_min_slices=1: {culprit} keeps its data position per process, "
                                          r".* an elastic run reads dataset_type tfds, hf, grain or stream \(or a "
                                          r"data_mixture of them, or synthetic\); set elastic_min_slices=0$"):
      elastic_config.check({**base, **extra}, mesh, num_devices=8, global_batch_size=64,
                           batch_axes=mesh.data_sharding)


def test_a_valid_elastic_config_and_the_default_are_accepted():
  assert Config.for_testing(num_slices=2, elastic_min_slices=1).mesh.elastic_min_slices == 1
  assert Config.for_testing().mesh.elastic_min_slices == 0
  with pytest.raises(ConfigError, match="elastic_min_slices must be a whole number >= 0"):
    Config.for_testing(elastic_min_slices=-1)


# ------------------------------------------------------------------------------------- arithmetic
def _layout(slices: int = 4, accumulation: int = 1, min_slices: int = 1) -> SliceLayout:
  # 4 devices per slice, the batch split over all of them, 2 rows per device per micro-batch.
  return SliceLayout(num_slices=slices, devices_per_slice=4, batch_shards_per_slice=4,
                     global_batch_size=2 * 4 * slices * accumulation, gradient_accumulation_steps=accumulation,
                     min_slices=min_slices)


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_a_resize_keeps_the_global_batch_and_the_micro_batch(slices, accumulation):
  layout = _layout(accumulation=accumulation)
  resized = elastic_config.resize(layout, slices)
  devices = slices * layout.devices_per_slice
  assert resized.per_device_batch_size * devices == layout.global_batch_size
  assert Fraction(layout.global_batch_size, devices * resized.gradient_accumulation_steps) == layout.micro_rows == 2
  assert resized.gradient_accumulation_steps == accumulation * 4 // slices
  assert resized.overrides() == [f"num_slices={slices}", f"dcn_data_parallelism={slices}",
                                 f"per_device_batch_size={resized.per_device_batch_size}",
                                 f"gradient_accumulation_steps={resized.gradient_accumulation_steps}"]


def test_a_resize_that_cannot_keep_the_global_batch_says_which_counts_can():
  with pytest.raises(ConfigError, match=r"^elastic resize to 3 slice\(s\) cannot keep the global batch: the global "
                                        r"batch 32 is not divisible by 3 slice\(s\) x 4 batch shards x 2 row\(s\) per "
                                        r"micro-batch; slice counts that keep it: 1, 2, 4$"):
    elastic_config.resize(_layout(), 3)
  # With 3 micro-batches per step, 3 slices of 4 can take the 96 rows as 4 micro-batches each.
  assert elastic_config.resize(_layout(accumulation=3), 3).gradient_accumulation_steps == 4


def test_the_survivors_continue_on_the_most_slices_that_keep_the_batch():
  assert elastic_config.usable_slices(_layout(), 3) == 2
  assert elastic_config.usable_slices(_layout(), 4) == 4
  assert elastic_config.usable_slices(_layout(min_slices=2), 1) is None
  assert elastic_config.usable_slices(_layout(min_slices=3), 3) is None  # 3 cannot keep it, 2 is below the minimum


def test_a_fractional_per_device_batch_is_written_so_the_config_parses_it():
  layout = SliceLayout(num_slices=2, devices_per_slice=4, batch_shards_per_slice=4, global_batch_size=4,
                       gradient_accumulation_steps=1, min_slices=1)
  assert layout.micro_rows == Fraction(1, 2)
  assert "per_device_batch_size=0.5" in elastic_config.resize(layout, 2).overrides()
  assert "per_device_batch_size=1" in elastic_config.resize(layout, 1).overrides()


# ------------------------------------------------------------------------------ same training, CPU
class _Part:
  """One phase of a run on `devices` with the batch settings of `resized`."""

  def __init__(self, settings: dict, devices: list, data_parallel: int, resized: elastic_config.Resize):
    target = DeviceTarget(platform="cpu", device_kind=devices[0].device_kind, num_devices=len(devices))
    # One process holds every device, so the slices are stood in for by the ici data axis: the
    # batch's rows and the replicas are split over it exactly as dcn_data_parallelism splits them.
    self.config = Config.for_testing(target=target, **settings, ici_data_parallelism=data_parallel,
                                     ici_fsdp_parallelism=-1, per_device_batch_size=str(resized.per_device_batch_size),
                                     gradient_accumulation_steps=resized.gradient_accumulation_steps)
    self.run = build_run(self.config, devices=devices)
    self.data = self.run.data_iterator()

  def train(self, state, steps: int) -> tuple[object, list[dict[str, float]]]:
    rng = jax.random.key(self.config.run.init_weights_seed)
    history = []
    for _ in range(steps):
      state, metrics = self.run.train_step(state, next(self.data), rng)
      history.append(metrics_lib.host_scalars(jax.device_get(metrics)))
    return state, history


@pytest.mark.slow  # two programs compile: about a minute on a loaded 2-core machine
def test_training_continued_on_fewer_slices_with_more_accumulation_matches_an_uninterrupted_run(tmp_path,
                                                                                               tiny_overrides):
  """2 slices of 4 devices for 2 steps -> checkpoint -> 1 slice (doubled accumulation) for 2 steps
  -> checkpoint -> both slices again for 2 steps, against 6 uninterrupted steps on 2 slices."""
  settings = {k: v for k, v in tiny_overrides.items() if k != "per_device_batch_size"}
  settings.update(dataset_type="synthetic", enable_checkpointing=False, steps=6, base_num_decoder_layers=1)
  layout = SliceLayout(num_slices=2, devices_per_slice=4, batch_shards_per_slice=4, global_batch_size=8,
                       gradient_accumulation_steps=1, min_slices=1)
  devices = jax.devices()
  both, one = elastic_config.resize(layout, 2), elastic_config.resize(layout, 1)
  assert (one.per_device_batch_size, one.gradient_accumulation_steps) == (2, 2)

  checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"))
  whole = _Part(settings, devices, 2, both)
  state, reference = whole.train(whole.run.init_state(), 2)
  checkpoints.save(2, state, whole.data.get_state(), {})
  _, rest = whole.train(state, 4)  # the uninterrupted run goes on from the saved state
  reference += rest

  shrunk = _Part(settings, devices[:4], 1, one)  # the surviving slice's devices only
  restored = checkpoints.restore_latest(shrunk.run.setup.abstract_state, shrunk.run.setup.state_shardings)
  assert restored is not None and restored.step == 2 and restored.data_state == {"step": 2}
  shrunk.data.set_state(restored.data_state)
  state, history = shrunk.train(restored.state, 2)
  checkpoints.save(4, state, shrunk.data.get_state(), {})

  grown = whole.run  # the slice is back: the original program, mesh and batch settings
  restored = checkpoints.restore_latest(grown.setup.abstract_state, grown.setup.state_shardings)
  assert restored is not None and restored.step == 4 and restored.data_state == {"step": 4}
  whole.data = grown.data_iterator()
  whole.data.set_state(restored.data_state)
  _, more = whole.train(restored.state, 2)
  history = reference[:2] + history + more
  checkpoints.close()

  # The same examples reach the same update; what differs is the order of the float32 sums (the
  # micro-batches' gradients are added one after the other instead of in one all-reduce), so the
  # losses agree to float32 rounding, as for any other change of mesh (tests/test_multiprocess.py).
  for key in ("loss", "grad_norm", "num_tokens"):
    np.testing.assert_allclose([h[key] for h in history], [h[key] for h in reference], rtol=2e-5, err_msg=key)


# ------------------------------------------------------------------------------- the supervisor
class _FakeGeneration:
  """Processes that follow a script: codes[i] is None while process i runs."""

  def __init__(self, slices: list[int], processes_per_slice: int = 1):
    self.owner = [s for s in slices for _ in range(processes_per_slice)]
    self.codes: list[int | None] = [None] * len(self.owner)
    self.signals: list[int] = []

  def exits(self) -> list[Exit]:
    return [Exit(s, i, c) for i, (s, c) in enumerate(zip(self.owner, self.codes)) if c is not None]

  def running(self) -> int:
    return sum(c is None for c in self.codes)

  def resumed_from(self):
    return None  # the run did not say: the supervisor keeps the persistent tier's newest step

  def signal_all(self, signum: int) -> None:
    self.signals.append(signum)
    # SIGTERM: every process saves at the step boundary and exits 143; SIGKILL ends the rest.
    self.codes = [c if c is not None else (143 if signum == signal.SIGTERM else -signum) for c in self.codes]


class _FakeLauncher:
  def __init__(self, num_slices: int, script):
    self.up = set(range(num_slices))
    self.starts: list[tuple[list[int], list[str]]] = []
    self.envs: list[dict[str, str]] = []
    self.generations: list[_FakeGeneration] = []
    self.script = script  # (launcher, generation index) -> None, called once per poll

  def start(self, slices, overrides, env):
    self.starts.append((list(slices), list(overrides)))
    self.envs.append(dict(env))
    self.generations.append(_FakeGeneration(list(slices)))
    return _Polled(self, len(self.generations) - 1)

  def available(self):
    return set(self.up)

  def mark_lost(self, slice_id):
    self.up.discard(slice_id)


class _Polled:
  """Runs the test's script before each look at the generation."""

  def __init__(self, launcher: _FakeLauncher, index: int):
    self.launcher, self.index = launcher, index
    self.generation = launcher.generations[index]

  def exits(self):
    self.launcher.script(self.launcher, self.index)
    return self.generation.exits()

  def running(self):
    return self.generation.running()

  def signal_all(self, signum):
    self.generation.signal_all(signum)

  def resumed_from(self):
    return self.generation.resumed_from()


def _supervisor(launcher, run_dir, min_slices=1) -> elastic.Supervisor:
  layout = SliceLayout(num_slices=4, devices_per_slice=2, batch_shards_per_slice=2, global_batch_size=8,
                       gradient_accumulation_steps=1, min_slices=min_slices)
  return elastic.Supervisor(layout, launcher, run_dir, poll_s=0, stop_grace_s=0.5, log=lambda message: None)


def test_a_lost_slice_shrinks_the_run_and_its_return_grows_it_back(tmp_path):
  def script(launcher, index):
    generation = launcher.generations[index]
    if index == 0 and generation.running() == 4:  # slice 2's process is killed; JAX aborts one peer
      generation.codes[2], generation.codes[0] = -signal.SIGKILL, -signal.SIGABRT
      (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
      (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    elif index == 1 and "9" not in (tmp_path / "metrics.jsonl").read_text():
      (tmp_path / "metrics.jsonl").write_text('{"step": 9}\n')  # the shrunk run trains past step 5 ...
    elif index == 1 and generation.running() == 2:
      launcher.up.add(2)  # ... then the slice returns
    elif index == 2:
      generation.codes = [0] * 4

  launcher = _FakeLauncher(4, script)
  supervisor = _supervisor(launcher, tmp_path)
  assert supervisor.run() == 0
  # 3 slices up cannot keep the batch of 8 (3 x 2 devices), so the run continues on 2, then grows back to 4.
  assert [s for s, _ in launcher.starts] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
  assert launcher.starts[1][1] == ["num_slices=2", "dcn_data_parallelism=2", "per_device_batch_size=2",
                                   "gradient_accumulation_steps=2"]
  assert launcher.starts[2][1][-1] == "gradient_accumulation_steps=1"
  assert launcher.generations[1].signals == [signal.SIGTERM]  # grow-back stops at a step boundary
  # Each relaunch is told when its resize was detected (its goodput counts the seconds since as the resize's).
  assert [float(e[elastic_config.RESIZE_ENV]) for e in launcher.envs[1:]] == [r.detected for r in supervisor.resizes]
  assert elastic_config.RESIZE_ENV not in launcher.envs[0]
  lost, grown = supervisor.resizes
  assert (lost.cause, lost.from_slices, lost.to_slices, lost.step_reached, lost.resumed_from) == \
      ("process 2 (slice 2) was killed by signal 9", 4, 2, 7, 5)
  assert lost.seconds_to_resume is not None and lost.seconds_to_resume >= 0
  assert (grown.cause, grown.from_slices, grown.to_slices) == ("slice(s) 2 returned", 2, 4)
  records = [json.loads(line) for line in (tmp_path / elastic.EVENTS_FILE).read_text().splitlines()]
  assert [r["to_slices"] for r in records if "cause" in r] == [2, 4]
  generations = [r for r in records if "generation" in r]
  assert [(r["slices"], r["exit"]) for r in generations] == \
      [([0, 1, 2, 3], lost.cause), ([0, 1], "slice(s) 2 returned"), ([0, 1, 2, 3], 0)]
  assert all(r["ended"] >= r["launched"] for r in generations)
  assert supervisor.summary(3, 10.0).startswith("elastic: 3 generation(s), 2 resize(s) in 10 s; ")
  # 7 - 5 after the loss, 9 - 5 after the return (the fake saves nothing at the grow-back's SIGTERM).
  assert supervisor.summary(3, 10.0).endswith(" 6 step(s) redone")
  assert "elastic: process 2 (slice 2) was killed by signal 9: 4 -> 2 slice(s) at step 7, resumed from step 5 " \
         "(2 step(s) redone)" in lost.line()


def test_the_supervisor_follows_a_run_on_gs_through_other_processes_writes(gcs):
  """A gs:// run folder: the run's metrics and checkpoints, written by other processes, are seen
  (gcsfs's cached listings are dropped before each look), and elastic.jsonl is kept there."""
  import urllib.parse
  import urllib.request

  from MaxText.paths import storage

  bucket = gcs.create_bucket()
  run_dir = f"gs://{bucket}/el"

  def elsewhere(path: str, text: str) -> None:  # past this process's gcsfs, as the run's processes write
    name = urllib.parse.quote(f"el/{path}", safe="")
    request = urllib.request.Request(f"{gcs.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
                                     data=text.encode(), method="POST")
    urllib.request.urlopen(request, timeout=30).read()

  def script(launcher, index):
    generation = launcher.generations[index]
    if index == 0 and generation.running() == 4:
      elsewhere("metrics.jsonl", '{"step": 7}\n')
      elsewhere("checkpoints/6/commit_success.txt", "")
      generation.codes[1] = -signal.SIGKILL
    elif index == 1 and run_progress.logged_step(run_dir) < 8:
      elsewhere("metrics.jsonl", '{"step": 8}\n')
    elif index == 1:
      generation.codes = [0] * len(generation.codes)

  # gcsfs keeps the listings this process made: without dropping them, neither new step would be seen.
  assert run_progress.logged_step(run_dir) == 0
  elsewhere("metrics.jsonl", '{"step": 3}\n')
  assert run_progress.logged_step(run_dir) == 3
  elsewhere("checkpoints/2/commit_success.txt", "")
  assert run_progress.checkpoint_step(run_dir) == 2
  elsewhere("checkpoints/4/commit_success.txt", "")
  assert run_progress.checkpoint_step(run_dir) == 4
  supervisor = _supervisor(_FakeLauncher(4, script), run_dir)
  assert supervisor.run() == 0
  (lost,) = supervisor.resizes
  assert (lost.step_reached, lost.resumed_from, lost.to_slices) == (7, 6, 2) and lost.seconds_to_resume is not None
  records = [json.loads(line) for line in storage.read_text(f"{run_dir}/{elastic.EVENTS_FILE}").splitlines()]
  assert [r["exit"] for r in records if "generation" in r] == [lost.cause, 0]


def test_the_runs_own_error_stops_the_job_without_a_resize(tmp_path):
  def script(launcher, index):
    launcher.generations[index].codes[1] = 3  # too many non-finite steps: exit status 3

  launcher = _FakeLauncher(4, script)
  supervisor = _supervisor(launcher, tmp_path)
  assert supervisor.run() == 3
  assert len(launcher.starts) == 1 and not supervisor.resizes
  assert launcher.generations[0].signals == [signal.SIGTERM]


def test_below_the_minimum_the_run_stops_with_one_line(tmp_path):
  def script(launcher, index):
    launcher.generations[index].codes[3] = -signal.SIGKILL

  with pytest.raises(elastic.UserError, match=r"^elastic: 3 slice\(s\) up after process 3 \(slice 3\) was killed by "
                                              r"signal 9, fewer than elastic_min_slices=4 can carry the global batch "
                                              r"of 8; the run stops"):
    _supervisor(_FakeLauncher(4, script), tmp_path, min_slices=4).run()


# --------------------------------------------------------------- real processes on 127.0.0.1
# Enough steps that the shrunk job is still training, short of the last (a persistent) step, when the
# slice returns: CI ran a 12-step job to its end, and an 18-step one to its last step before the pause.
_LOOPBACK_STEPS = 40
_LOOPBACK_MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16",
                   "max_target_length=32", "print_config=False", "cpu_peak_tflops=0.1", f"learning_rate_schedule_steps={_LOOPBACK_STEPS}",
                   "checkpoint_period=2", "async_checkpointing=False", "distributed_heartbeat_timeout_seconds=10",
                   "distributed_init_timeout_seconds=180", "per_device_batch_size=1", "log_period=1", f"steps={_LOOPBACK_STEPS}",
                   "dataset_type=synthetic"]


def _logged(run_dir) -> dict[int, float]:
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return {}
  records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def _events(run_dir) -> list[str]:
  path = run_dir / elastic.EVENTS_FILE
  return path.read_text().splitlines() if path.exists() else []


def _wait_for(condition, what: str, timeout: float = 900, poll_s: float = 0.5) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(poll_s)


def _child_with(pid: int, variable: str) -> int:
  """The child process of `pid` whose environment holds `variable` (NAME=value)."""
  for task in Path(f"/proc/{pid}/task").iterdir():
    for child in (task / "children").read_text().split():
      if variable.encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
        return int(child)
  raise AssertionError(f"no child of {pid} has {variable}")


def _children(pid: int) -> list[int]:
  return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


def shrink_and_grow_back(command: list[str], tmp_path: Path, env: dict[str, str], victim: int):
  """Runs `command` (MaxText.train's) as `python3 -m MaxText.elastic` on 4 slices of 2 CPU devices
  (run folder tmp_path/elastic, logs in tmp_path/logs, the persistent tier at the last step only, the
  local tier every step, so every resize resumes from the local tier: a stop on a persistent step restores
  the persistent copy, as Checkpoints.md says); SIGKILLs process `victim` after step 4 and brings its slice back once the
  shrunk job has logged its first new step (the supervisor then records how long the shrink took
  to resume), pausing that job until the supervisor has seen the slice back, so both resizes meet
  a job that is training. Returns the supervisor's CompletedProcess."""
  import os
  import subprocess

  from tests.compile_settings import FAST_COMPILE_FLAG
  from tests.conftest import REPO_ROOT

  run_dir, logs = tmp_path / "elastic", tmp_path / "logs"
  tiers = [f"checkpoint_period={_LOOPBACK_STEPS}", "enable_emergency_checkpoint=True", f"local_checkpoint_directory={tmp_path / 'local'}",
           "local_checkpoint_period=1"]
  args = [sys.executable, "-m", "MaxText.elastic", *command[3:], "run_name=elastic", "num_slices=4", *tiers,
          "devices_per_process=2", f"log_dir={logs}"]
  if not any(a.startswith("elastic_min_slices=") for a in args):
    args.append("elastic_min_slices=1")
  cli = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**env, "XLA_FLAGS": f"{FAST_COMPILE_FLAG} --xla_force_host_platform_device_count=8"})
  try:
    _wait_for(lambda: max(_logged(run_dir), default=0) >= 4, "step 4 on 4 slices")
    os.kill(_child_with(cli.pid, f"JAX_PROCESS_ID={victim}"), signal.SIGKILL)
    _wait_for(lambda: any("seconds_to_resume" in line for line in _events(run_dir)), "a step on 2 slices", poll_s=0.02)
    # The shrunk job is paused until the supervisor has decided to grow back: on a loaded machine it
    # could otherwise finish its last steps first, and the grow-back would then meet a finished run.
    shrunk = _children(cli.pid)
    for pid in shrunk:
      os.kill(pid, signal.SIGSTOP)
    try:
      (logs / f"slice_{victim}.down").unlink()
      _wait_for(lambda: (run_dir / elastic.GROW_BACK_MARKER).exists(), "the supervisor's grow-back stop", timeout=120)
    finally:
      for pid in shrunk:
        os.kill(pid, signal.SIGCONT)
    out, _ = cli.communicate(timeout=1200)
  finally:
    if cli.poll() is None:
      cli.kill()
  return subprocess.CompletedProcess(args, cli.returncode, out)


@pytest.mark.slow
def test_a_killed_process_shrinks_the_loopback_job_and_its_return_grows_it_back(tmp_path):
  """`python3 -m MaxText.elastic`: 4 processes as 4 slices of 2 CPU devices; slice 1's is SIGKILLed
  after step 4: the job goes on on slices 0 and 2 (3 cannot keep the batch of 8) with doubled
  accumulation, slice 2's process renumbered 1 and reading the local steps it saved as process 2,
  grows back to 4 when the slice's marker is removed (the stop's step handed from the local tier of
  slices 0 and 2 to slices 1 and 3), and its losses equal one process's uninterrupted run; the
  run's goodput counts both resizes."""
  from tests.compile_settings import FAST_COMPILE_FLAG, jax_cache_env
  from tests.conftest import REPO_ROOT

  env = loopback_launch.loopback_env({"PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": FAST_COMPILE_FLAG, **jax_cache_env()})
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={tmp_path}",
             *_LOOPBACK_MODEL]
  reference = loopback_launch.LoopbackLauncher([*command, "run_name=reference"], 1, 1, 8, tmp_path / "ref_state", env,
                                       tmp_path / "reference_logs")
  ((_, proc),) = reference.start([0], []).procs
  assert proc.wait(timeout=900) == 0
  want = _logged(tmp_path / "reference")

  run_dir, logs = tmp_path / "elastic", tmp_path / "logs"
  out = shrink_and_grow_back(command, tmp_path, env, victim=1)
  assert out.returncode == 0, f"the supervisor ended with {out.returncode}: {out.stdout[-3000:]}; logs in {logs}"

  records = [json.loads(line) for line in (run_dir / elastic.EVENTS_FILE).read_text().splitlines()]
  lost, grown = [r for r in records if "seconds_to_resume" in r]
  assert (lost["cause"], lost["from_slices"], lost["to_slices"]) == ("process 1 (slice 1) was killed by signal 9", 4, 2)
  # The survivors restored their own local steps (the persistent tier has none before the last), slice 2's from
  # the folder it wrote as process 2 (each simulated host has its own local folder), so at most
  # the step in flight was redone.
  assert lost["resumed_source"].startswith("the local tier") and lost["resumed_from"] >= 3, lost
  assert (grown["cause"], grown["from_slices"], grown["to_slices"]) == ("slice(s) 1 returned", 2, 4)
  # The grow-back stop saved its step to the local tier only. Slices 0 and 2 held it (slice 2 in the
  # folder it wrote as process 1 of the shrunk job) and handed it to slices 1 and 3: nothing redone.
  assert grown["resumed_source"] == (f"the local tier ({tmp_path / 'local' / 'slice_0_host_0' / 'elastic'}; handed "
                                     "over to process(es) 1, 3 by process(es) 0)"), grown
  assert grown["resumed_from"] == grown["step_reached"], grown
  # Each relaunch starts Python, joins the job, restores and compiles before its first new step.
  assert lost["seconds_to_resume"] > 1 and grown["seconds_to_resume"] > 1
  got = _logged(run_dir)
  assert sorted(got) == sorted(want) == list(range(1, _LOOPBACK_STEPS + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-5)
  # Both relaunched starts were told their resize's detection: the goodput line counts the resizes.
  summary = json.loads((run_dir / "goodput.json").read_text())["summary"]
  assert summary["resizes"] == 2 and summary["resize_s"] > 1, summary
  line = next(l for l in (logs / "generation_3_process_0.log").read_text().splitlines() if l.startswith("goodput:"))
  assert " elastic resizes " in line and " (2), " in line, line

  # Against a full restart of all 4 processes from the persistent tier (the last step), on the same machine.
  restart = loopback_launch.LoopbackLauncher([*command, "run_name=elastic", f"steps={_LOOPBACK_STEPS + 1}",
                                      "checkpoint_period=6"], 4, 1, 2,
                                     tmp_path / "restart_state", env, tmp_path / "restart_logs")
  layout = SliceLayout(num_slices=4, devices_per_slice=2, batch_shards_per_slice=2, global_batch_size=8,
                       gradient_accumulation_steps=1, min_slices=1)
  started = time.time()
  generation = restart.start([0, 1, 2, 3], elastic_config.resize(layout, 4).overrides())
  _wait_for(lambda: max(_logged(run_dir), default=0) > _LOOPBACK_STEPS, "a new step after a full restart")
  full_restart_s = time.time() - started
  assert [p.wait(timeout=300) for _, p in generation.procs] == [0] * 4
  assert generation.resumed_from() == (_LOOPBACK_STEPS, str(run_dir / "checkpoints"))
  print(f"loss of a process: {lost['seconds_to_resume']:.1f} s to the first new step; the slice's return: "
        f"{grown['seconds_to_resume']:.1f} s; full restart of 4 processes from the persistent tier: "
        f"{full_restart_s:.1f} s; goodput: {line}")


def test_the_local_tier_restores_for_fewer_processes_that_keep_their_regions(tmp_path):
  """A step saved while the job had 4 processes restores on a process whose regions are the saved
  ones (an elastic run's surviving slice); before, any other process count fell back to the
  persistent tier."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from MaxText.run_dir.local_checkpoints import MANIFEST, LocalTier

  mesh = Mesh(np.asarray(jax.devices()[:4]), ("fsdp",))
  sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
  state = {"w": jax.device_put(np.arange(16, dtype=np.float32), sharding)}
  tier = LocalTier(str(tmp_path), period=1, max_to_keep=2)
  tier.save(3, state, {"step": 3}, {})
  tier.wait()
  manifest_path = tmp_path / "process_0" / "3" / MANIFEST
  manifest = json.loads(manifest_path.read_text())
  manifest_path.write_text(json.dumps({**manifest, "process_count": 4}))
  abstract = {"w": jax.ShapeDtypeStruct((16,), np.float32)}
  assert tier.agreed_step({"w": sharding}, abstract) == 3
  restored, data, _ = tier.restore(3, abstract, {"w": sharding})
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16))
  assert data == {"step": 3}
  other = NamedSharding(Mesh(np.asarray(jax.devices()[:2]), ("fsdp",)), PartitionSpec("fsdp"))
  assert tier.agreed_step({"w": other}, abstract) is None  # other regions: the persistent tier's turn


_TPU_WORKER = (Path(__file__).parent / "fake_elastic_worker.py").read_text()  # tests/fake_elastic_worker.py


def test_the_tpu_vm_launcher_shrinks_to_the_ready_slices_and_grows_back(tmp_path, monkeypatch):
  """Two one-worker slices behind the fake gcloud: slice 1's worker is killed and its TPU is
  repairing -> the job goes on on slice 0 alone; the TPU is READY again -> SIGTERM, both slices."""
  from MaxText.platform.tpu_launch import Gcloud
  from tests.fake_gcloud import FakeCloud

  cloud = FakeCloud(tmp_path / "cloud", {"job-0": 1, "job-1": 1})
  monkeypatch.setenv("FAKE_GCLOUD_DIR", str(cloud.root))
  shared = tmp_path / "shared"
  shared.mkdir()
  for name in ("job-0", "job-1"):
    (cloud.home(name, 0) / "run").mkdir(parents=True)
    (cloud.home(name, 0) / "run" / "worker.py").write_text(_TPU_WORKER)
  gcloud = Gcloud(project="p", zone="z", dry_run=False, executable=str(cloud.root / "bin" / "gcloud"))
  launcher = multihost_runner.TpuVmLauncher(gcloud, ["job-0", "job-1"], f"{sys.executable} worker.py {shared}", "run",
                                   tmp_path / "logs")
  run_dir = tmp_path / "run_dir"
  run_dir.mkdir()
  layout = SliceLayout(num_slices=2, devices_per_slice=4, batch_shards_per_slice=4, global_batch_size=8,
                       gradient_accumulation_steps=1, min_slices=1)
  supervisor = elastic.Supervisor(layout, launcher, run_dir, poll_s=0.2, stop_grace_s=20, log=lambda message: None)
  outcome: list[object] = []
  thread = threading.Thread(target=lambda: outcome.append(supervisor.run()), daemon=True)
  thread.start()

  _wait_for(lambda: (shared / "args_job-0").exists() and (shared / "args_job-1").exists(), "both workers", timeout=120)
  (shared / "resumed").write_text("")
  cloud.configure(tpus={"job-0": {"workers": 1, "state": "READY"}, "job-1": {"workers": 1, "state": "REPAIRING"}})
  (shared / "kill_job-1").write_text("")
  _wait_for(lambda: len((shared / "args_job-0").read_text().splitlines()) == 2, "the relaunch on slice 0", timeout=120)
  assert (shared / "args_job-0").read_text().splitlines()[1] == \
      "num_slices=1 dcn_data_parallelism=1 per_device_batch_size=2 gradient_accumulation_steps=2"
  (run_dir / "metrics.jsonl").write_text('{"step": 4}\n')  # the shrunk run logs a step past 3
  _wait_for(lambda: supervisor.resizes[0].seconds_to_resume is not None, "the resume", timeout=60)
  cloud.configure(tpus={"job-0": {"workers": 1, "state": "READY"}, "job-1": {"workers": 1, "state": "READY"}})
  _wait_for(lambda: len((shared / "args_job-1").read_text().splitlines()) == 2, "the grow-back", timeout=120)
  (shared / "finish").write_text("")
  thread.join(timeout=120)
  assert outcome == [0]
  lost, grown = supervisor.resizes
  assert (lost.from_slices, lost.to_slices, lost.resumed_from, lost.resumed_source) == \
      (2, 1, 3, "the persistent tier")
  assert lost.cause.startswith("process 1 (slice 1) ")  # killed: a signal, whatever way ssh reports it
  assert (grown.cause, grown.from_slices, grown.to_slices) == ("slice(s) 1 returned", 1, 2)
  assert (shared / "args_job-1").read_text().splitlines()[1].endswith("gradient_accumulation_steps=1")
  multislice = [c for c in cloud.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "MEGASCALE" in str(c)]
  assert multislice and "MEGASCALE_NUM_SLICES=2" in str(multislice[-1])


def test_a_lone_process_stopped_at_a_sigterm_while_the_others_run_on_is_a_lost_slice(tmp_path):
  """Exit 143 is a preemption's step-boundary stop, which every process makes together; one process that
  stopped so alone (its host preempted by itself) was waited for as long as the others ran, which was until
  they hung in their next collective with it. After the stop grace it is its slice lost."""
  polls = []

  def script(launcher, index):
    generation = launcher.generations[index]
    polls.append(index)
    assert len(polls) < 200, "still waiting for the processes beside the stopped one"
    if index == 0 and generation.codes[1] is None:
      generation.codes[1] = 143
    elif index == 1:
      generation.codes = [0] * len(generation.codes)

  launcher = _FakeLauncher(4, script)
  lines: list[str] = []
  supervisor = elastic.Supervisor(SliceLayout(num_slices=4, devices_per_slice=2, batch_shards_per_slice=2,
                                              global_batch_size=8, gradient_accumulation_steps=1, min_slices=1),
                                  launcher, tmp_path, poll_s=0.05, stop_grace_s=0.3, log=lines.append)
  assert supervisor.run() == 0
  assert [s for s, _ in launcher.starts] == [[0, 1, 2, 3], [0, 2]]
  assert launcher.generations[0].signals == [signal.SIGTERM]  # the others stopped at their step boundary
  assert supervisor.resizes[0].cause == "process 1 (slice 1) exited with status 143 at a SIGTERM while the others " \
                                       "ran on"


def test_processes_that_stop_at_a_sigterm_one_after_another_are_one_preemption(tmp_path):
  """The stops of one preemption come a few polls apart: not a lost slice while the others follow in the grace."""
  def script(launcher, index):
    generation = launcher.generations[index]
    if index == 0:
      done = sum(c is not None for c in generation.codes)
      if done < 4:
        generation.codes[done] = 143  # one more each poll
    else:
      generation.codes = [0] * len(generation.codes)

  launcher = _FakeLauncher(4, script)
  supervisor = elastic.Supervisor(SliceLayout(num_slices=4, devices_per_slice=2, batch_shards_per_slice=2,
                                              global_batch_size=8, gradient_accumulation_steps=1, min_slices=1),
                                  launcher, tmp_path, poll_s=0.01, stop_grace_s=5, log=lambda line: None)
  assert supervisor.run() == 0
  assert [s for s, _ in launcher.starts] == [[0, 1, 2, 3], [0, 1, 2, 3]]
  assert launcher.generations[0].signals == [] and not supervisor.lost
