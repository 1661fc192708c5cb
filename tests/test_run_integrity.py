"""Run integrity with real training processes, on local disk and on gs:// (a GCS JSON API on
127.0.0.1): a resume with a changed shape stops before touching anything, a second run in a
busy run directory stops naming the first, a dead run's lease is taken over, allowed changes
resume, and the tools after a fine-tune take the model keys from the run they read."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time

import pytest

from MaxText import run_lease, storage
from tests.conftest import REPO_ROOT
from tests.test_gcs_run import committed_steps, command, env, losses, run, start_and_signal

STEPS = 30  # run_name and steps as in the second scenario


def _root(request, tmp_path) -> tuple[str, object]:
  """(base_output_directory, gcs server or None) for the `where` parameter."""
  if request.param == "local":
    return str(tmp_path), None
  return request.getfixturevalue("gcs_bucket") + "/runs", request.getfixturevalue("gcs")


@pytest.fixture(params=["local", pytest.param("gs", marks=pytest.mark.slow)])
def where(request, tmp_path):
  return _root(request, tmp_path)


def _files(root: str) -> dict[str, str]:
  """Every file under `root` (local or gs://) and the SHA-256 of its bytes."""
  found: dict[str, str] = {}

  def walk(directory: str) -> None:
    for name in storage.listdir(directory):
      path = storage.join(directory, name)
      if storage.is_dir(path):
        walk(path)
      else:
        found[path[len(root):]] = hashlib.sha256(storage.read_bytes(path)).hexdigest()

  walk(root)
  return found


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
  lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  text = proc.stdout + proc.stderr
  assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def lone_run(tmp_path_factory) -> dict[int, float]:
  out = tmp_path_factory.mktemp("lone")
  run(command(str(out), "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}"),
      env(None))
  return losses(str(out / "dup"))


def test_a_resume_with_a_changed_shape_exits_2_naming_the_key_and_changes_nothing(where):
  out, gcs = where
  cmd = command(out, "shape", "steps=6", "checkpoint_period=3")
  run(cmd, env(gcs))
  run_dir = storage.join(out, "shape")
  before = _files(run_dir)
  assert {"/checkpoints/3/commit_success.txt", "/checkpoints/6/commit_success.txt", "/config.yml"} <= set(before)

  proc = run(cmd + ["base_emb_dim=32"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "base_emb_dim: 64 -> 32" in line and "cannot resume checkpoint step 6" in line, line
  assert "load_parameters_path=" in line and "state:" not in proc.stdout
  assert _files(run_dir) == before  # nothing renamed, nothing written, not even the lease

  # A run directory without its config.yml (written before this check existed): the arrays'
  # stored shapes catch it, and the step is still not mistaken for damage.
  storage.as_path(storage.join(run_dir, "config.yml")).unlink()
  proc = run(cmd + ["base_emb_dim=32"], env(gcs), expect=2)
  line = _one_error_line(proc)
  assert "checkpoint step 6" in line and "written by another model config" in line and "params/" in line, line
  assert committed_steps(run_dir) == [3, 6] and not [n for n in storage.listdir(storage.join(run_dir, "checkpoints"))
                                                     if "corrupt" in n]


def test_a_second_run_in_a_busy_run_directory_exits_2_and_the_first_is_untouched(where, lone_run):
  out, gcs = where
  cmd = command(out, "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}")
  # SIGSTOP holds the first run mid-training (a tiny model would otherwise finish before the
  # second one has started); its lease stays live for the default 180 s.
  first = start_and_signal(cmd, env(gcs), 1, lambda: True, signal.SIGSTOP)
  try:
    second = run(cmd, env(gcs), expect=2)
  finally:
    first.send_signal(signal.SIGCONT)
  line = _one_error_line(second)
  assert "is in use by another run" in line and f"pid {first.pid}" in line, line
  stdout, stderr = first.communicate(timeout=600)
  assert first.returncode == 0, stderr[-3000:]
  run_dir = storage.join(out, "dup")
  assert len(storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()) == STEPS
  assert losses(run_dir) == lone_run  # bitwise: the second run wrote nothing
  assert not storage.exists(storage.join(run_dir, run_lease.LEASE_FILE))  # released at the end
  assert len(storage.listdir(storage.join(run_dir, "config_history"))) == 1


@pytest.mark.slow
def test_a_dead_runs_lease_is_taken_over_after_the_timeout_and_the_run_resumes(tmp_path, lone_run):
  out = str(tmp_path)
  cmd = command(out, "dup", f"steps={STEPS}", "checkpoint_period=5", f"learning_rate_schedule_steps={STEPS}",
                "run_lease_timeout_seconds=4")
  run_dir = storage.join(out, "dup")
  proc = start_and_signal(cmd, env(None), 12, lambda: 10 in committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  killed_at = time.time()
  assert storage.exists(storage.join(run_dir, run_lease.LEASE_FILE))  # SIGKILL: nobody released it

  # A reader with a long timeout still sees a live holder: exit 2, naming the dead process.
  busy = run(cmd + ["run_lease_timeout_seconds=600"], env(None), expect=2)
  assert f"pid {proc.pid}" in _one_error_line(busy)

  time.sleep(max(0.0, killed_at + 4.5 - time.time()))
  rerun = run(cmd, env(None))
  assert f"taking over the run lease of {run_dir} from host" in rerun.stdout and f"pid {proc.pid}" in rerun.stdout
  latest = [line for line in rerun.stdout.splitlines() if line.startswith("state: resumed from step ")]
  assert latest and int(latest[0].split()[4]) >= 10, rerun.stdout[-2000:]
  assert losses(run_dir) == lone_run


def test_allowed_changes_resume_normally(tmp_path):
  out = str(tmp_path)
  run(command(out, "grow", "steps=4", "checkpoint_period=2"), env(None))
  more = run(command(out, "grow", "steps=6", "checkpoint_period=3", "log_period=2", "ici_data_parallelism=2",
                     "ici_fsdp_parallelism=1", "run_lease_timeout_seconds=60", "eval_interval=100"), env(None))
  assert "state: resumed from step 4" in more.stdout and "mesh: data=2" in more.stdout, more.stdout[-2000:]
  history = storage.listdir(storage.join(out, "grow", "config_history"))
  assert len(history) == 2  # one entry per start, none overwritten
  assert "ici_data_parallelism: 2" in storage.read_text(storage.join(out, "grow", "config.yml"))
