"""Elastic training against hostile input and surroundings: files the supervisor reads while others
write or damage them, launchers' tools answering nonsense, signals at awkward moments. Each case
either works or ends with one line, and no saved step is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import elastic, multihost_runner
from MaxText.configuration import elastic_config
from MaxText.configuration.elastic_config import SliceLayout
from MaxText.errors import ConfigError, UserError
from MaxText.platform.generations import SIGTERM_EXIT, Exit
from MaxText.platform.gke_launch import Kubectl
from MaxText.platform.queued_slices import QueuedSlices
from MaxText.platform.tpu_launch import Gcloud
from MaxText.run_dir.local_checkpoints import LocalTier
from tests.conftest import REPO_ROOT
from tests.fake_gcloud import FakeCloud

_LAYOUT = SliceLayout(num_slices=2, devices_per_slice=1, batch_shards_per_slice=1, global_batch_size=2,
                      gradient_accumulation_steps=1, min_slices=1)


class _Generation:
  """Processes that run until `end` gives each its status; records the signals it is sent."""

  def __init__(self, slices: list[int]):
    self.slices = slices
    self.codes: list[int | None] = [None] * len(slices)
    self.signals: list[int] = []
    self.on_signal = lambda signum: None

  def exits(self) -> list[Exit]:
    return [Exit(s, i, c) for i, (s, c) in enumerate(zip(self.slices, self.codes)) if c is not None]

  def running(self) -> int:
    return sum(c is None for c in self.codes)

  def signal_all(self, signum: int) -> None:
    self.signals.append(signum)
    self.on_signal(signum)
    self.codes = [c if c is not None else (SIGTERM_EXIT if signum == signal.SIGTERM else -signum) for c in self.codes]

  def resumed_from(self):
    return None


class _Launcher:
  def __init__(self, script):
    self.up = {0, 1}
    self.generations: list[_Generation] = []
    self.script = script  # (launcher) -> None, run at each look at the slices

  def start(self, slices, overrides, env):
    self.generations.append(_Generation(list(slices)))
    return self.generations[-1]

  def available(self):
    return set(self.up)

  def mark_lost(self, slice_id):
    self.up.discard(slice_id)


class _Scripted(_Launcher):
  """Runs the test's script before each look at the current generation's processes."""

  def start(self, slices, overrides, env):
    generation = super().start(slices, overrides, env)
    exits = generation.exits
    generation.exits = lambda: (self.script(self), exits())[1]  # type: ignore[method-assign]
    return generation


def _supervisor(launcher, run_dir) -> elastic.Supervisor:
  return elastic.Supervisor(_LAYOUT, launcher, run_dir, poll_s=0, stop_grace_s=0.5, log=lambda m: None)


# ------------------------------------------------------------------------- files the supervisor reads
def test_metrics_lines_being_written_or_damaged_are_not_steps(tmp_path):
  """metrics.jsonl is appended by the run while the supervisor reads it, and a killed process leaves
  its last line cut short (was: JSONDecodeError, or None/str steps failing the comparisons, and the
  supervisor ended with its processes still running)."""
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text('{"step": 3, "loss": 1.0}\n{"step": 4, "lo')
  assert elastic.logged_step(tmp_path) == 3
  metrics.write_text('{"step": 3}\n[1]\n"text"\nnot json\n{"step": null}\n{"step": "9"}\n{"step": true}\n'
                     '{"step": 8.5}\n{}\n\n')
  assert elastic.logged_step(tmp_path) == 3
  metrics.write_bytes(b'{"step": 5}\n\xff\xfe{"step": 6}\n')  # bytes that are not UTF-8
  assert elastic.logged_step(tmp_path) == 5


def test_a_checkpoint_folder_named_with_other_digits_is_not_a_step(tmp_path):
  (tmp_path / "checkpoints" / "\u00b2").mkdir(parents=True)  # "²".isdigit() is True, int("²") fails
  (tmp_path / "checkpoints" / "4").mkdir()
  assert elastic.checkpoint_step(tmp_path) == 4


def test_a_log_dir_that_cannot_hold_the_logs_is_one_line(tmp_path):
  (tmp_path / "file").write_text("")
  for log_dir, why in [(tmp_path / "file", "File exists"), (tmp_path / "file" / "sub", "Not a directory")]:
    with pytest.raises(UserError, match=rf"^log_dir={log_dir} cannot hold the processes' logs \({why}\): give "
                                        "log_dir= a folder this machine can write$"):
      elastic.main(["elastic", "configs/base.yml", "run_name=el", "num_slices=2", "elastic_min_slices=1",
                    "per_device_batch_size=1", "dataset_type=synthetic", f"base_output_directory={tmp_path}",
                    f"log_dir={log_dir}"])


@pytest.mark.parametrize("extra,message", [
    # Was a ValueError traceback from shlex.
    (["tpu_prefix=p", "tpu_type=v5litepod-8", "version=v", "cqr_extra_args=--spot '"],
     r"^cqr_extra_args=\"--spot '\" cannot be split into flags \(No closing quotation\): check its quotes$"),
    # Were accepted, and a real run saw slices that never came up (gcloud and kubectl refuse such names).
    (["tpu_prefix=My_pod", "tpu_type=v5litepod-8"], r"^tpu_prefix='My_pod' must be lower-case letters, digits and '-'"),
    (["cluster=my cluster", "tpu_type=v5litepod-8", "docker_image=i"], r"^cluster='my cluster' must be lower-case "),
    (["tpu_prefix=p", "tpu_type=v5litepod-8", "megascale_port=0"], r"^megascale_port=0 is not a port: give one in "
                                                                    r"1..65535 \(default 8080\)$"),
    (["cluster=c", "tpu_type=v5litepod-8", "docker_image=i", "megascale_port=70000"], r"^megascale_port=70000 is not"),
])
def test_launcher_names_ports_and_flags_that_cannot_work_are_one_line(extra, message):
  with pytest.raises(UserError, match=message):
    elastic.main(["elastic", "configs/base.yml", "run_name=el", "num_slices=2", "elastic_min_slices=1",
                  "dataset_type=synthetic", *extra, "dry_run=true"])


def test_a_slice_marker_that_is_a_folder_still_marks_the_slice_down(tmp_path):
  launcher = elastic.LoopbackLauncher(["true"], 2, 1, 1, tmp_path, {}, tmp_path)
  (tmp_path / "slice_1.down").mkdir()
  assert launcher.available() == {0}
  launcher.mark_lost(1)  # was: IsADirectoryError, ending the supervisor with its processes stopped
  launcher.mark_lost(0)
  assert launcher.available() == set() and (tmp_path / "slice_0.down").read_text() == "lost\n"


# ------------------------------------------------------------------------------ the supervisor
def test_a_loopback_rerun_with_its_slices_still_marked_down_names_the_markers(tmp_path):
  """A rerun of the same command finds the down markers the last run wrote (they outlive it): the
  line said to relaunch "when the slices are back", which on loopback never happens by itself."""
  launcher = elastic.LoopbackLauncher(["true"], 2, 1, 1, tmp_path, {}, tmp_path)
  launcher.mark_lost(0)
  launcher.mark_lost(1)
  with pytest.raises(UserError, match=rf"^elastic: 0 slice\(s\) up at the start, fewer than elastic_min_slices=1 .*"
                                      rf"delete {tmp_path}/slice_0.down, {tmp_path}/slice_1.down to bring the "
                                      r"slices back, then relaunch\)$"):
    _supervisor(launcher, tmp_path).run()


def test_a_supervisor_that_cannot_go_on_stops_its_processes_before_it_ends(tmp_path):
  """A launcher's failed look (here a bug) must not leave the job training unsupervised: the running
  generation is stopped at a step boundary (it saves), then the error is shown (was: left running)."""
  def script(launcher):
    raise RuntimeError("the launcher broke")

  launcher = _Scripted(script)
  with pytest.raises(RuntimeError, match="the launcher broke"):
    _supervisor(launcher, tmp_path).run()
  assert launcher.generations[0].signals == [signal.SIGTERM]


def test_a_preemptions_sigterm_to_the_processes_continues_the_job_on_the_slices_up(tmp_path):
  """A preemption's SIGTERM: every process saves at the same step (JAX's preemption sync) and exits
  143. The job goes on on the slices still up (was: the job ended with status 143)."""
  def script(launcher):
    generations = launcher.generations
    if len(generations) == 1:
      launcher.up.discard(1)  # the preempted slice is no longer up ...
      generations[0].codes = [SIGTERM_EXIT, SIGTERM_EXIT]  # ... and its SIGTERM stopped every process
    else:
      generations[-1].codes = [0]

  launcher = _Scripted(script)
  supervisor = _supervisor(launcher, tmp_path)
  assert supervisor.run() == 0
  assert [g.slices for g in launcher.generations] == [[0, 1], [0]]
  (resize,) = supervisor.resizes
  assert (resize.cause, resize.from_slices, resize.to_slices) == \
      ("the processes saved and stopped at a SIGTERM (a preemption)", 2, 1)
  assert launcher.generations[0].signals == []  # they had stopped by themselves


def test_a_second_interrupt_while_the_generation_saves_is_answered_not_obeyed(tmp_path):
  """Ctrl-C, then another (or a scheduler's SIGTERM twice): the supervisor still waits for the save
  at the step boundary (was: the second KeyboardInterrupt left the processes saving unsupervised)."""
  lines: list[str] = []
  launcher = _Launcher(lambda launcher: None)
  supervisor = elastic.Supervisor(_LAYOUT, launcher, tmp_path, poll_s=0, stop_grace_s=30, log=lines.append)
  generation = supervisor.current = launcher.start([0, 1], [], {})
  saving = []

  def on_signal(signum):  # the second SIGTERM arrives while the processes save
    os.kill(os.getpid(), signal.SIGTERM)
    saving.append(signum)

  generation.on_signal = on_signal
  with multihost_runner.sigterm_as_interrupt():
    supervisor.interrupt()
  assert saving == [signal.SIGTERM] and generation.running() == 0
  assert lines == ["elastic: already stopping: the running generation saves at its step boundary (SIGKILL after "
                   "30 s at most)"]


# --------------------------------------------------------------------------- the launchers' tools
def _tool(path: Path, script: str) -> str:
  path.write_text("#!/bin/sh\n" + script)
  path.chmod(0o755)
  return str(path)


def test_a_failed_replacement_request_is_asked_again_and_an_existing_one_is_taken(tmp_path):
  """A replacement queued resource refused (no quota now) is asked for again at the next look while
  the job goes on (was: the UserError ended the supervisor); one that exists already (an earlier
  run of the command, a request whose answer was lost) is taken as it is."""
  answer = tmp_path / "create_answer"
  answer.write_text("ERROR: (gcloud) RESOURCE_EXHAUSTED: quota exceeded\n")
  gcloud = _tool(tmp_path / "gcloud", f"""case "$*" in
  *"queued-resources create"*) cat {answer} >&2; exit 1 ;;
  *"describe job-0 "*) echo '{{"state": "READY"}}' ;;
  *"describe job-1 "*) echo '{{"state": "PREEMPTED"}}' ;;
  *) echo '{{"state": "CREATING"}}' ;;
esac
""")
  lines: list[str] = []
  queued = QueuedSlices(Gcloud(None, None, False, gcloud), "job", 2, "v5litepod-8", "v", [], lambda name: None,
                        log=lines.append)
  assert queued.available() == {0} and not queued.replacing
  assert "RESOURCE_EXHAUSTED" in lines[-1] and lines[-1].endswith("; asking again at the next look")
  answer.write_text("ERROR: (gcloud) ALREADY_EXISTS: Resource 'job-1-r1' already exists\n")
  assert queued.available() == {0}
  assert queued.replacing == {1: "job-1-r1"} and queued.requested == ["job", "job-1-r1"]
  assert lines[-2] == "elastic: queued resource job-1-r1 exists already; using it"


def test_gcloud_and_kubectl_printing_json_of_another_shape_is_a_slice_down_or_one_line(tmp_path):
  """Valid JSON that is not an object (a proxy's, a broken tool's) was an AttributeError traceback."""
  gcloud = Gcloud(None, None, False, _tool(tmp_path / "gcloud", "echo '[]'\n"))
  queued = QueuedSlices(gcloud, "job", 1, "v5litepod-8", "v", [], lambda name: None, log=lambda m: None)
  assert queued.state("job-0") == "UNKNOWN"
  with pytest.raises(UserError, match=r"^could not read the description of TPU 'job-0': gcloud printed list, not "):
    multihost_runner.describe_slice(gcloud, "job-0", 0)
  odd = Gcloud(None, None, False,
               _tool(tmp_path / "gcloud2", """echo '{"state": "READY", "networkEndpoints": [1]}'\n"""))
  with pytest.raises(UserError, match=r"networkEndpoints is not a list of objects$"):
    multihost_runner.describe_slice(odd, "job-0", 0)
  assert elastic.TpuVmLauncher(gcloud, ["job-0"], "true", "run", tmp_path / "logs").available() == set()
  kubectl = Kubectl(_tool(tmp_path / "kubectl", "echo '[1, 2]'\n"), retry_s=0)
  with pytest.raises(UserError, match=r"^listing nodes: kubectl's output is list, not a JSON object$"):
    kubectl.json(["get", "nodes"], "listing nodes")
  # Output cut short once (an API server restarting) is read again.
  flaky = _tool(tmp_path / "kubectl2", f'if [ -e {tmp_path}/once ]; then echo \'{{"items": []}}\'; exit 0; fi\n'
                                       f'touch {tmp_path}/once; echo \'{{"items": [\'\n')
  assert Kubectl(flaky, retry_s=0).json(["get", "nodes"], "listing nodes") == {"items": []}


# ----------------------------------------------------------------------------- the local tier
@pytest.mark.parametrize("damage", [b"[]", b"null", b"{}", b'{"leaves": 5}', b'{"leaves": [7]}', b"\xff\xfe{",
                                    b'{"leaves": [{"name": "[\'w\']", "shape": [16], "dtype": "float32", '
                                    b'"shards": [1]}]}'])
def test_a_damaged_manifest_makes_its_step_not_held(tmp_path, damage):
  """Every process lists the local steps it holds before a restore or a handover (a collective): a
  manifest damaged in any way must make its step not held, as a cut one does (was: TypeError,
  KeyError or UnicodeDecodeError on that process while the others waited for it)."""
  sharding = NamedSharding(Mesh(np.asarray(jax.devices()[:4]), ("fsdp",)), PartitionSpec("fsdp"))
  abstract = {"w": jax.ShapeDtypeStruct((16,), np.float32)}
  tier = LocalTier(str(tmp_path), period=1, max_to_keep=3)
  for step in (3, 4):
    tier.save(step, {"w": jax.device_put(np.arange(16, dtype=np.float32), sharding)}, {"step": step}, {})
    tier.wait()
  (tmp_path / "process_0" / "4" / "manifest.json").write_bytes(damage)
  tier = LocalTier(str(tmp_path), period=1, max_to_keep=3)
  assert tier.held_steps({"w": sharding}, abstract) == [3]
  assert tier.meta(4) in (None, {})


# ------------------------------------------------------------------------------------- goodput
@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "soon"])
def test_a_resize_time_that_is_no_unix_time_is_one_line(text):
  """nan and inf were taken, and spread into goodput.json's sums as NaN and Infinity."""
  with pytest.raises(ConfigError, match=rf"^MAXTEXT_ELASTIC_RESIZE_DETECTED='{text}' is not a unix time; it is set "
                                        r"by MaxText/elastic.py, unset it$"):
    elastic_config.resize_detected({elastic_config.RESIZE_ENV: text})
  assert elastic_config.resize_detected({elastic_config.RESIZE_ENV: "1700000000.5"}) == 1700000000.5
  assert elastic_config.resize_detected({}) is None


def test_an_interrupt_while_waiting_for_queued_capacity_still_names_what_to_delete(tmp_path):
  """The wait for a queued resource's capacity can take hours; a SIGTERM or Ctrl-C then ended the
  supervisor without the line naming the queued resource to delete (it stays billed)."""
  cloud = FakeCloud(tmp_path / "cloud", {}, qr_workers=1, qr_state="WAITING_FOR_RESOURCES")
  out = tmp_path / "out"
  command = [sys.executable, "-m", "MaxText.elastic", "configs/base.yml", "run_name=qr", "num_slices=2",
             "elastic_min_slices=1", "dataset_type=synthetic", f"base_output_directory={tmp_path / 'runs'}",
             "tpu_prefix=qr", "tpu_type=v5litepod-8", "version=v2-alpha-tpuv5-lite", f"log_dir={tmp_path / 'logs'}",
             "zone=z"]
  with out.open("w") as f:
    supervisor = subprocess.Popen(command, cwd=REPO_ROOT, env=cloud.env, stdout=f, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 120
    while "elastic: waiting for qr-0" not in out.read_text():
      assert time.monotonic() < deadline and supervisor.poll() is None, out.read_text()
      time.sleep(0.2)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == 130
  finally:
    if supervisor.poll() is None:
      supervisor.kill()
  assert out.read_text().splitlines()[-2:] == [
      "elastic: the queued resources are billed until deleted: gcloud alpha compute tpus queued-resources delete qr "
      "--force --async --zone=z", "interrupted"]
