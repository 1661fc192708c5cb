"""multihost_runner against a fake `gcloud` (tests/fake_gcloud.py) that runs each worker's
command for real in a folder of its own: discovery, copies, one ssh per worker, multislice
variables, logs, exit codes, dry runs and the clean stop on Ctrl-C / SIGTERM."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from MaxText.platform import tpu_launch
from tests.fake_gcloud import FakeCloud

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def project(tmp_path: Path) -> Path:
  """A small folder to ship instead of the whole repository."""
  src = tmp_path / "src"
  (src / "pkg" / "__pycache__").mkdir(parents=True)
  (src / "pkg" / "code.py").write_text("print('hi')\n")
  (src / "pkg" / "__pycache__" / "code.cpython-311.pyc").write_bytes(b"stale")
  (src / ".git").mkdir()
  (src / ".git" / "HEAD").write_text("ref: main\n")
  return src


def runner_argv(src: Path, tmp_path: Path, *extra: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.multihost_runner", f"script_dir={src}", "run_name=job1",
          f"log_dir={tmp_path / 'logs'}", *extra]


def run(cloud: FakeCloud, src: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
  return subprocess.run(runner_argv(src, tmp_path, *extra), env=cloud.env, cwd=REPO, capture_output=True,
                        text=True, timeout=60)


def ssh_calls(cloud: FakeCloud) -> list[list[str]]:
  return [c for c in cloud.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]


def test_runs_once_per_worker_streams_host_zero_and_logs_every_host(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e": 4})
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "zone=us-west4-a", "project=proj",
               "command=echo out-$FAKE_WORKER; cat pkg/code.py; ls -a pkg")
  assert result.returncode == 0, result.stderr
  describe = [c for c in cloud.calls() if "describe" in c]
  assert describe == [["compute", "tpus", "tpu-vm", "describe", "v5e", "--format=json", "--zone=us-west4-a",
                       "--project=proj"]]
  scp = [c for c in cloud.calls() if "scp" in c]
  assert len(scp) == 1 and "--worker=all" in scp[0] and scp[0][5] == "v5e:job1.tar.gz"
  assert sorted(c[5] for c in ssh_calls(cloud)) == [f"--worker={w}" for w in range(4)]
  # Only host 0 on the console; every host in its own log; caches and .git were not shipped.
  assert "out-0" in result.stdout and "out-1" not in result.stdout
  assert "all 4 worker(s) succeeded" in result.stdout
  for w in range(4):
    log = (tmp_path / "logs" / f"slice-0-worker-{w}.log").read_text()
    assert f"out-{w}" in log and "print('hi')" in log and "__pycache__" not in log
    assert not (cloud.home("v5e", w) / "job1" / ".git").exists()
  assert not any("MEGASCALE" in " ".join(c) for c in ssh_calls(cloud))


def test_multislice_sets_megascale_variables_from_slice_zero_worker_zero(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"pod-0": 2, "pod-1": 2, "other": 1})
  result = run(cloud, project, tmp_path, "tpu_prefix=pod", "num_slices=2",
               "command=env | grep ^MEGASCALE_ | sort > megascale.txt")
  assert result.returncode == 0, result.stderr
  assert len(ssh_calls(cloud)) == 4 and len([c for c in cloud.calls() if "scp" in c]) == 2
  for slice_id in range(2):
    for w in range(2):
      env = dict(line.split("=", 1) for line in
                 (cloud.home(f"pod-{slice_id}", w) / "job1" / "megascale.txt").read_text().split())
      assert env == {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.1.2:8080", "MEGASCALE_NUM_SLICES": "2",
                     "MEGASCALE_PORT": "8080", "MEGASCALE_SLICE_ID": str(slice_id)}
  # The fake numbers slices alphabetically: "other" is 0, so pod-0's worker 0 has 10.0.1.2.


def test_any_failed_worker_fails_the_run_and_is_named(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e": 3})
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e",
               "command=if [ $FAKE_WORKER = 2 ]; then echo boom; exit 3; fi; echo fine")
  assert result.returncode == 3
  assert "1 of 3 worker(s) failed: slice-0-worker-2 (exit 3)" in result.stderr
  assert "boom" in (tmp_path / "logs" / "slice-0-worker-2.log").read_text()

  cloud.configure(ssh_exit={"v5e:1": 255})  # ssh itself cannot reach a worker
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "command=true")
  assert result.returncode == 255 and "slice-0-worker-1 (exit 255)" in result.stderr


def test_unknown_or_unready_tpu_is_a_one_line_error(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e-a": 1, "v5e-b": 1})
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "command=true")
  assert result.returncode == 2
  assert result.stderr.strip() == "error: no TPU VM named v5e in this project/zone; TPUs with that prefix: v5e-a, v5e-b"
  cloud.configure(tpus={"v5e": {"workers": 2, "state": "CREATING"}})
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "command=true")
  assert result.returncode == 2 and "TPU 'v5e' is CREATING, not READY" in result.stderr
  assert not ssh_calls(cloud)


def test_dry_run_prints_every_command_and_calls_nothing(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {})
  result = run(cloud, project, tmp_path, "tpu_prefix=pod", "num_slices=2", "num_workers=2", "dry_run=true",
               "zone=z", "command=python3 -m MaxText.train configs/base.yml run_name=x")
  assert result.returncode == 0, result.stderr
  assert cloud.calls() == [] and not (tmp_path / "logs").exists()
  commands = [shlex.split(line) for line in result.stdout.splitlines() if line.startswith("gcloud ")]
  scp = [c for c in commands if c[4] == "scp"]
  ssh = [c for c in commands if c[4] == "ssh"]
  assert [c[6] for c in scp] == ["pod-0:job1.tar.gz", "pod-1:job1.tar.gz"]
  runs = [c for c in ssh if "--worker=all" not in c]
  kills = [c for c in ssh if "--worker=all" in c]
  assert [(c[5], c[6]) for c in runs] == [("pod-0", "--worker=0"), ("pod-0", "--worker=1"),
                                           ("pod-1", "--worker=0"), ("pod-1", "--worker=1")]
  assert all("--zone=z" in c for c in commands) and len(kills) == 2
  command_of = {c[5] + c[6]: next(w for w in c if w.startswith("--command=")) for c in runs}
  assert "MEGASCALE_SLICE_ID=1" in command_of["pod-1--worker=0"]
  assert "MaxText.train configs/base.yml run_name=x" in command_of["pod-0--worker=0"]


def test_existing_folder_is_reused_without_a_copy(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e": 2})
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "use_existing_folder=true", "command=true")
  assert result.returncode == 2 and "has no folder ~/job1" in (tmp_path / "logs" / "slice-0-worker-1.log").read_text()
  for w in range(2):
    (cloud.home("v5e", w) / "job1").mkdir(parents=True)
    (cloud.home("v5e", w) / "job1" / "marker").write_text(f"kept-{w}")
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "use_existing_folder=true", "command=cat marker")
  assert result.returncode == 0 and "kept-0" in result.stdout
  assert not any("scp" in c for c in cloud.calls())


def test_package_directory_leaves_out_caches(tmp_path, project):
  with tarfile.open(tpu_launch.package_directory(project, tmp_path / "out" / "code.tar.gz")) as tar:
    assert sorted(tar.getnames()) == ["pkg", "pkg/code.py"]


def wait_for_pid_files(cloud: FakeCloud, name: str, num_workers: int) -> list[int]:
  files = [cloud.home(name, w) / "job1" / ".multihost_runner.pid" for w in range(num_workers)]
  deadline = time.monotonic() + 30
  while not all(f.exists() and f.read_text().strip() for f in files):
    assert time.monotonic() < deadline, "the workers never started"
    time.sleep(0.05)
  return [int(f.read_text()) for f in files]


def alive(process_group: int) -> bool:
  try:
    os.killpg(process_group, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_every_remote_command(tmp_path, project, sig):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e": 2})
  command = "trap 'echo got-term; exit 143' TERM; echo started; sleep 120 & wait"
  runner = subprocess.Popen(runner_argv(project, tmp_path, "tpu_prefix=v5e", f"command={command}"),
                            env=cloud.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  groups = []
  try:
    groups = wait_for_pid_files(cloud, "v5e", 2)
    assert all(alive(g) for g in groups)
    runner.send_signal(sig)
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 130, err
    assert "interrupted; every worker's command was stopped" in err
    assert not any(alive(g) for g in groups)
    kills = [c for c in ssh_calls(cloud) if "--worker=all" in c]
    assert len(kills) == 1 and ".multihost_runner.pid" in kills[0][-1]
    for w in range(2):
      assert "got-term" in (tmp_path / "logs" / f"slice-0-worker-{w}.log").read_text()
  finally:
    runner.kill()
    runner.wait()
    for g in groups:
      if alive(g):
        os.killpg(g, signal.SIGKILL)


def test_fail_fast_stops_the_others(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {"v5e": 2})
  command = "if [ $FAKE_WORKER = 1 ]; then sleep 0.5; exit 4; fi; sleep 120"
  started = time.monotonic()
  result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "fail_fast=true", f"command={command}")
  assert result.returncode == 1 and time.monotonic() - started < 30
  assert "slice-0-worker-1 exited with code 4" in result.stderr
  assert "stopped every worker after the first failure" in result.stderr


def test_bad_arguments_are_one_line_errors(tmp_path, project):
  cloud = FakeCloud(tmp_path / "cloud", {})
  for extra, message in [(["run_name=Bad_Name"], "run_name 'Bad_Name' must be"),
                         (["num_slices=0"], "num_slices must be at least 1"),
                         # '' and ' v5e' went on to `gcloud compute tpus tpu-vm ssh ''`
                         (["tpu_prefix="], "tpu_prefix '' must be a TPU VM's name"),
                         (["tpu_prefix= v5e"], "tpu_prefix ' v5e' must be a TPU VM's name")]:
    result = run(cloud, project, tmp_path, "tpu_prefix=v5e", "command=true", *extra)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr
  result = subprocess.run([sys.executable, "-m", "MaxText.multihost_runner", "tpu_prefix=v5e", "command=true",
                           "use_existing_folder=true"], env=cloud.env, cwd=REPO, capture_output=True, text=True)
  assert result.returncode == 2 and "use_existing_folder=true needs run_name=NAME" in result.stderr
