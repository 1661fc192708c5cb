"""Elastic training against hostile input and surroundings: files the supervisor reads while others
write or damage them, launchers' tools answering nonsense, signals at awkward moments. Each case
either works or ends with one line, and no saved step is lost."""

from __future__ import annotations

import json
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

from MaxText.platform import loopback_launch
from MaxText import elastic, multihost_runner
from MaxText.platform import run_progress
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
  assert run_progress.logged_step(tmp_path) == 3
  metrics.write_text('{"step": 3}\n[1]\n"text"\nnot json\n{"step": null}\n{"step": "9"}\n{"step": true}\n'
                     '{"step": 8.5}\n{}\n\n')
  assert run_progress.logged_step(tmp_path) == 3
  metrics.write_bytes(b'{"step": 5}\n\xff\xfe{"step": 6}\n')  # bytes that are not UTF-8
  assert run_progress.logged_step(tmp_path) == 5


def _counting_reads(monkeypatch) -> list[int]:
  """The bytes each GrowingFile read fetched, appended as they are read."""
  counts: list[int] = []
  read = run_progress.GrowingFile._read

  def counted(self, start):
    identity, data = read(self, start)
    counts.append(len(data or b""))
    return identity, data

  monkeypatch.setattr(run_progress.GrowingFile, "_read", counted)
  return counts


@pytest.fixture(params=["local", "gs"])
def run_root(request, tmp_path) -> str:
  if request.param == "local":
    return str(tmp_path / "run")
  return request.getfixturevalue("gcs_bucket") + "/run"


def test_the_supervisors_metrics_reads_fetch_only_what_was_appended(run_root, monkeypatch):
  """The supervisor read the whole of metrics.jsonl at every look (each 0.5 s, on gs:// a download) for
  the run's whole life, so a long run's looks cost tens of MB each. Now each look fetches what was appended
  (and the last line again, to see it is still there), and says what a whole read says: across appends, a
  line being written and completed later, a file cut shorter, and a new run's file written anew."""
  from MaxText.paths import storage

  storage.makedirs(run_root)
  path = storage.join(run_root, "metrics.jsonl")
  counts = _counting_reads(monkeypatch)
  reader = run_progress.MetricsReader(run_root)
  text = ""

  def write(new_text: str) -> None:  # a new run's file: locally a new file (LineLog renames it into place)
    nonlocal text
    text = new_text
    storage.write_text(path, text)

  def append(more: str) -> None:  # as LineLog appends: locally in place, on gs:// the whole object again
    nonlocal text
    text += more
    if storage.is_remote(path):
      storage.write_text(path, text)
    else:
      with open(path, "a") as f:
        f.write(more)

  def agree(stale_text: str | None = None, stale: str | None = None) -> int:
    step = reader.step(stale)
    assert step == run_progress.logged_step(run_root, stale_text)
    return step

  assert agree() == 0 and counts == [0]
  line = '{{"step": {}, "loss": 1.25, "step_time_seconds": 0.5, "tokens_per_second": 123456.0}}\n'
  write("".join(line.format(step) for step in range(1, 2001)))  # about 170 kB
  assert agree() == 2000
  counts.clear()
  append(line.format(2001))
  assert agree() == 2001
  assert counts == [len(line.format(2000)) + len(line.format(2001))]  # the last line again, and what was appended
  append('{"step": 2002, "lo')  # being written
  assert agree() == 2001
  assert reader.file.tail == b'{"step": 2002, "lo'
  append('ss": 1.0}\n')  # and completed
  assert agree() == 2002
  assert sum(counts) < 1000
  # A relaunched run writes the file anew with the lines up to its checkpoint: shorter, then longer again.
  stale_text, stale = text, reader.snapshot()
  assert agree(stale_text, stale) == 0
  write("".join(line.format(step) for step in range(1, 1501)))
  assert agree(stale_text, stale) == 1500
  append("".join(line.format(step).replace("1.25", "9.75") for step in range(1501, 2200)))
  assert agree(stale_text, stale) == 2199
  # Rewritten longer than what was read before the supervisor saw it shorter (on gs:// an upload it missed;
  # locally in place, the same file): the last line read is not there any more, so it is read anew.
  stale_text, stale = text, reader.snapshot()
  text = "".join(line.format(step).replace("1.25", "3.5") for step in range(1, 2300)) + '{"step": 50}\n'
  if storage.is_remote(path):
    storage.write_text(path, text)
  else:
    with open(path, "r+") as f:
      f.write(text)
  assert agree(stale_text, stale) == 2299
  # The same text again (a run resumed from its last logged step) still reads as the stale one.
  stale_text, stale = text, reader.snapshot()
  write(text)
  assert agree(stale_text, stale) == 0
  storage.remove_tree(path)
  assert agree() == 0
  write('{"step": 4}\n')
  assert agree() == 4


def test_the_supervisor_reads_its_runs_metrics_a_piece_at_a_time(tmp_path, monkeypatch):
  """While a relaunched generation has not logged a step past its checkpoint, each of the supervisor's looks
  read the whole of metrics.jsonl; now it fetches what was appended since the last look."""
  metrics = tmp_path / "metrics.jsonl"
  line = '{"step": %d, "loss": 1.0, "padding": "' + "x" * 200 + '"}\n'
  metrics.write_text("".join(line % step for step in range(1, 5001)))  # about 1 MB
  size = metrics.stat().st_size
  (tmp_path / "checkpoints" / "6000").mkdir(parents=True)  # the relaunch resumes there: it is looked for all along
  counts = _counting_reads(monkeypatch)
  looks = 0

  def script(launcher):
    nonlocal looks
    if len(launcher.generations) == 1:  # slice 1 is lost: the relaunched generation's looks read the metrics
      launcher.generations[0].codes = [None, -9]
      return
    looks += 1
    with metrics.open("a") as f:
      f.write(line % (5000 + looks))
    if looks == 20:
      launcher.generations[-1].codes = [0]

  supervisor = _supervisor(_Scripted(script), tmp_path)
  assert supervisor.run() == 0 and looks == 20
  assert supervisor.metrics.step() == 5020 and supervisor.resizes[0].resumed_from == 6000
  assert len(counts) > 20 and counts[0] == size  # the whole file once, at the first generation's start
  assert max(counts[1:]) <= 2 * len(line % 5020)  # then at each look the last line read and what was appended


def test_process_0s_log_is_read_a_piece_at_a_time_and_says_what_a_whole_read_says(tmp_path, monkeypatch):
  """The supervisor read process 0's whole log at every look while a relaunched generation ran."""
  log = tmp_path / "process_0.log"
  reader = run_progress.ResumedLine(log)
  counts = _counting_reads(monkeypatch)
  assert reader.read() is None
  log.write_text("compiling\n" * 10000)
  assert reader.read() is None
  counts.clear()
  with log.open("a") as f:
    f.write("state: resumed from step 12 of /run/check")  # being written
  assert reader.read() == (12, "/run/check")  # as a whole read says (the next look reads the rest)
  with log.open("a") as f:
    f.write("points\nstep 13\n")
  assert reader.read() == (12, "/run/checkpoints")
  assert sum(counts) < 200
  with log.open("a") as f:
    f.write("state: resumed from step 99 of elsewhere\n")
  assert reader.read() == (12, "/run/checkpoints")  # the first one, as before
  log.write_text("state: initialised from seed\n")  # a new file
  assert reader.read() == (0, "a fresh start")


def test_a_checkpoint_folder_named_with_other_digits_is_not_a_step(tmp_path):
  (tmp_path / "checkpoints" / "\u00b2").mkdir(parents=True)  # "²".isdigit() is True, int("²") fails
  (tmp_path / "checkpoints" / "4").mkdir()
  assert run_progress.checkpoint_step(tmp_path) == 4


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
  launcher = loopback_launch.LoopbackLauncher(["true"], 2, 1, 1, tmp_path, {}, tmp_path)
  (tmp_path / "slice_1.down").mkdir()
  assert launcher.available() == {0}
  launcher.mark_lost(1)  # was: IsADirectoryError, ending the supervisor with its processes stopped
  launcher.mark_lost(0)
  assert launcher.available() == set() and (tmp_path / "slice_0.down").read_text() == "lost\n"


# ------------------------------------------------------------------------------ the supervisor
def test_a_loopback_rerun_with_its_slices_still_marked_down_names_the_markers(tmp_path):
  """A rerun of the same command finds the down markers the last run wrote (they outlive it): the
  line said to relaunch "when the slices are back", which on loopback never happens by itself."""
  launcher = loopback_launch.LoopbackLauncher(["true"], 2, 1, 1, tmp_path, {}, tmp_path)
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


def _fake_gcloud(tmp_path, monkeypatch, **settings) -> tuple[FakeCloud, Gcloud]:
  cloud = FakeCloud(tmp_path / "cloud", {}, **settings)
  monkeypatch.setenv("FAKE_GCLOUD_DIR", str(cloud.root))
  monkeypatch.setenv("PATH", cloud.env["PATH"])  # the commands read as a user runs them
  return cloud, Gcloud("p", "z", False)


def _delete_queued(cloud: FakeCloud, name: str) -> None:
  settings = json.loads((cloud.root / "config.json").read_text())
  cloud.configure(queued_resources={k: v for k, v in settings.get("queued_resources", {}).items() if k != name})


@pytest.mark.parametrize("ended", ["FAILED", "deleted"])
def test_a_queued_resource_that_fails_while_its_slices_are_awaited_stops_the_wait_in_one_line(tmp_path, monkeypatch,
                                                                                               ended):
  """Only the nodes' states were read: a queued resource that FAILED (or was SUSPENDED) brings no node,
  and the supervisor waited for them for ever; so did it for one deleted by hand or by a cleanup script (its
  describe reads NOT_FOUND, and its nodes went with it)."""
  from MaxText.platform import queued_slices

  cloud, gcloud = _fake_gcloud(tmp_path, monkeypatch)  # no nodes: the capacity is not granted
  looks = []
  sleep = time.sleep

  def look(seconds: float) -> None:
    if seconds != 0.0123:  # another's sleep (subprocess waits so)
      sleep(seconds)
      return
    looks.append(seconds)
    if len(looks) == 2 and ended == "FAILED":
      cloud.set_queued_state("job", "FAILED", "The zone does not have enough resources available")
    elif len(looks) == 2:
      _delete_queued(cloud, "job")
    assert len(looks) < 8, f"still waiting for the nodes of a queued resource that is {ended}"
    sleep(0)

  monkeypatch.setattr(queued_slices.time, "sleep", look)
  queued = QueuedSlices(gcloud, "job", 2, "v5litepod-8", "v", [], lambda name: None, log=lambda m: None)
  with pytest.raises(queued_slices.QueuedResourceEnded) as raised:
    queued.request_all(poll_s=0.0123)
  if ended == "FAILED":
    assert str(raised.value) == (
        "queued resource job is FAILED (The zone does not have enough resources available), so its slices will not "
        "come; delete it with `gcloud alpha compute tpus queued-resources delete job --force --async --zone=z "
        "--project=p`, then run again")
    assert len(looks) == 2
  else:
    assert str(raised.value) == ("queued resource job is no longer listed (deleted), so its slices will not come; "
                                 "run again")
    assert len(looks) == 2 + queued_slices.UNLISTED_LOOKS - 1


def _replacing_slice_1(tmp_path, monkeypatch) -> tuple[FakeCloud, QueuedSlices, list[str]]:
  """Two slices up, then slice 1's node PREEMPTED: its replacement job-1-r1 asked for (ACCEPTED)."""
  cloud, gcloud = _fake_gcloud(tmp_path, monkeypatch, qr_workers=1)
  lines: list[str] = []
  queued = QueuedSlices(gcloud, "job", 2, "v5litepod-8", "v", [], lambda name: None, log=lines.append)
  queued.request_all(poll_s=0)
  cloud.configure(qr_state="CREATING", tpus={"job-0": {"workers": 1, "state": "READY"},
                                             "job-1": {"workers": 1, "state": "PREEMPTED"}})
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r1"}
  return cloud, queued, lines


def test_a_replacement_queued_resource_that_fails_is_asked_for_again_under_a_new_name(tmp_path, monkeypatch):
  """A replacement whose queued resource FAILED was waited for as long as the job ran: the slice never came
  back. Now it is one warning, and another replacement is asked for at the next look while the job goes on."""
  cloud, queued, lines = _replacing_slice_1(tmp_path, monkeypatch)
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r1"}  # ACCEPTED: waited for
  cloud.set_queued_state("job-1-r1", "SUSPENDED")
  assert queued.available() == {0} and not queued.replacing
  assert lines[-1] == ("warning: queued resource job-1-r1, slice 1's replacement, is SUSPENDED; asking for another at "
                       "the next look (delete it with `gcloud alpha compute tpus queued-resources delete job-1-r1 "
                       "--force --async --zone=z --project=p`)")
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r2"}
  assert queued.requested == ["job", "job-1-r1", "job-1-r2"]  # all of them named by the closing delete line
  cloud.configure(tpus={**json.loads((cloud.root / "config.json").read_text())["tpus"],
                        "job-1-r2": {"workers": 1, "state": "READY"}})
  assert queued.available() == {0, 1} and queued.names == ["job-0", "job-1-r2"]


def test_a_deleted_replacement_queued_resource_is_asked_for_again_and_one_missed_look_is_no_deletion(
    tmp_path, monkeypatch):
  """A replacement deleted while awaited was waited for as long as the job ran (NOT_FOUND was no end); one look
  that does not find it (a list that lags the create) is not yet a deletion."""
  from MaxText.platform import queued_slices

  cloud, queued, lines = _replacing_slice_1(tmp_path, monkeypatch)
  accepted = json.loads((cloud.root / "config.json").read_text())["queued_resources"]["job-1-r1"]
  _delete_queued(cloud, "job-1-r1")
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r1"}  # one look: not yet
  cloud.set_queued_state("job-1-r1", accepted["state"])  # listed again: the count starts over
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r1"}
  for _ in range(queued_slices.UNLISTED_LOOKS - 1):
    _delete_queued(cloud, "job-1-r1")
    assert queued.available() == {0} and queued.replacing == {1: "job-1-r1"}
  assert queued.available() == {0} and not queued.replacing
  assert lines[-1] == ("warning: queued resource job-1-r1, slice 1's replacement, is no longer listed (deleted); asking "
                       "for another at the next look")
  assert queued.available() == {0} and queued.replacing == {1: "job-1-r2"}


class _LostAtTheStart:
  """The TPU VM launcher, with `lose` set PREEMPTED between the supervisor's look and the first start."""

  def __init__(self, cloud: FakeCloud, inner: multihost_runner.TpuVmLauncher, lose: list[str]):
    self.cloud, self.inner, self.lose, self.starts = cloud, inner, lose, 0

  def available(self):
    return self.inner.available()

  def mark_lost(self, slice_id):
    self.inner.mark_lost(slice_id)

  def start(self, slices, overrides, env):
    self.starts += 1
    if self.starts == 1:
      tpus = json.loads((self.cloud.root / "config.json").read_text())["tpus"]
      self.cloud.configure(tpus={**tpus, **{name: {"workers": 1, "state": "PREEMPTED"} for name in self.lose}})
    return self.inner.start(slices, overrides, env)


@pytest.mark.parametrize("lose", [["job-1"], ["job-0", "job-1"]])
def test_a_slice_lost_between_the_look_and_the_start_is_a_lost_slice(tmp_path, monkeypatch, lose):
  """TpuVmLauncher.start raised "TPU job-1 is PREEMPTED, not READY" and the whole job stopped. Now nothing
  is started and the slice is lost like any other: the job goes on on the slices still up, or, with none
  left, stops with the usual line."""
  cloud, gcloud = _fake_gcloud(tmp_path, monkeypatch)
  cloud.configure(tpus={name: {"workers": 1, "state": "READY"} for name in ("job-0", "job-1")})
  for name in ("job-0", "job-1"):
    (cloud.home(name, 0) / "run").mkdir(parents=True)
  inner = multihost_runner.TpuVmLauncher(gcloud, ["job-0", "job-1"], "echo ran >> ../ran", "run", tmp_path / "logs")
  launcher = _LostAtTheStart(cloud, inner, lose)
  lines: list[str] = []
  supervisor = elastic.Supervisor(_LAYOUT, launcher, tmp_path / "run_dir", poll_s=0, stop_grace_s=5, log=lines.append)
  (tmp_path / "run_dir").mkdir()
  if len(lose) == 2:
    with pytest.raises(UserError, match=r"^elastic: 0 slice\(s\) up after process 0 \(slice 0\) could not be started: "
                                        r"TPU 'job-0' is PREEMPTED, not READY, fewer than elastic_min_slices=1 "):
      supervisor.run()
    assert launcher.starts == 1 and not any(cloud.home(n, 0).joinpath("ran").exists() for n in lose)
    return
  assert supervisor.run() == 0
  assert launcher.starts == 2 and [r.cause for r in supervisor.resizes] == [
      "process 1 (slice 1) could not be started: TPU 'job-1' is PREEMPTED, not READY"]
  ran = (cloud.home("job-0", 0) / "ran").read_text().splitlines()
  assert len(ran) == 1 and ran[0].startswith("ran num_slices=1 ")  # only the relaunch ran, on slice 0 alone
  assert not (cloud.home("job-1", 0) / "ran").exists()


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
  assert multihost_runner.TpuVmLauncher(gcloud, ["job-0"], "true", "run", tmp_path / "logs").available() == set()
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


def test_the_command_line_stops_in_one_line_when_its_queued_resource_fails(tmp_path):
  """The command line's form of the first request's failure: the error line names the queued resource, its
  state, the failure's message and the delete command, and nothing else repeats it."""
  cloud = FakeCloud(tmp_path / "cloud", {}, qr_resource_state="FAILED",
                    qr_resource_message="Insufficient capacity in zone z")
  command = [sys.executable, "-m", "MaxText.elastic", "configs/base.yml", "run_name=qr", "num_slices=2",
             "elastic_min_slices=1", "dataset_type=synthetic", f"base_output_directory={tmp_path / 'runs'}",
             "tpu_prefix=qr", "tpu_type=v5litepod-8", "version=v2-alpha-tpuv5-lite", f"log_dir={tmp_path / 'logs'}",
             "zone=z"]
  done = subprocess.run(command, cwd=REPO_ROOT, env=cloud.env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr
  assert done.stderr.splitlines()[-1] == (
      "error: queued resource qr is FAILED (Insufficient capacity in zone z), so its slices will not come; delete "
      "it with `gcloud alpha compute tpus queued-resources delete qr --force --async --zone=z`, then run again")
  assert "billed until deleted" not in done.stderr


def test_a_rerun_with_the_same_log_dir_keeps_the_last_runs_logs(tmp_path):
  """A second supervisor run with the same log_dir (after the supervisor itself was killed, say) numbered its
  generations from 1 again and wrote over the logs that said how the last run ended."""
  from MaxText.platform.generations import logged_generations

  logs = tmp_path / "logs"
  logs.mkdir()
  for name in ("generation_1_process_0.log", "generation_2_process_0.log", "generation_2_process_1.log",
               "supervisor.log", "generation_x.log"):
    (logs / name).write_text(f"the last run's {name}\n")
  launcher = loopback_launch.LoopbackLauncher([sys.executable, "-c", "print('new')"], 1, 1, 1, tmp_path / "state", {}, logs)
  generation = launcher.start([0], [])
  assert [p.wait(timeout=60) for _, p in generation.procs] == [0]
  assert (logs / "generation_3_process_0.log").read_text() == "new\n"
  assert (logs / "generation_1_process_0.log").read_text() == "the last run's generation_1_process_0.log\n"
  assert (logs / "generation_2_process_0.log").read_text() == "the last run's generation_2_process_0.log\n"
  (logs / "generation_7").mkdir()  # the TPU VM launcher's folder per generation
  assert logged_generations(logs) == 7
  assert multihost_runner.TpuVmLauncher(None, ["a"], "true", "r", logs).generations == 7  # type: ignore[arg-type]
