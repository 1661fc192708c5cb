"""Kill a real training process (SIGKILL, SIGTERM) and rerun the same command: the resumed run
continues bit for bit like one that was never interrupted (same data, same RNG, same state)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

STEPS = 20
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", f"steps={STEPS}"]


def _env() -> dict:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PATH": "/usr/bin:/bin",
          "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT)}


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


def test_finished_run_rerun_does_nothing(tmp_path):
  command = _command(tmp_path, "done", "steps=3")
  _run(command)
  rerun = _run(command)
  assert "already at step 3 of steps=3" in rerun.stdout


def test_checkpointing_disabled_writes_nothing(tmp_path):
  _run(_command(tmp_path, "off", "steps=2", "enable_checkpointing=False"))
  assert not (tmp_path / "off" / "checkpoints").exists()
