"""Real multi-process runs: several `python -m MaxText.train` processes on 127.0.0.1 joined by
jax.distributed (gloo CPU collectives), compared with one process holding all the devices."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env

TOTAL_DEVICES = 8
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", "learning_rate_schedule_steps=6", "checkpoint_period=2",
         "async_checkpointing=False", "distributed_heartbeat_timeout_seconds=10",
         "distributed_init_timeout_seconds=120"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(num_devices: int, **extra: str) -> dict:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(num_devices),
          "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env(), **extra}


def _launch(out: Path, run_name: str, num_processes: int, *args: str,
            per_process: list[list[str]] | None = None) -> list[subprocess.Popen]:
  """`per_process[i]`: process i's own further arguments."""
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={run_name}",
             f"base_output_directory={out}", *MODEL, *args]
  devices = TOTAL_DEVICES // num_processes
  if num_processes == 1:
    return [subprocess.Popen(command, cwd=REPO_ROOT, env=_env(devices), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)]
  address = f"127.0.0.1:{_free_port()}"
  return [subprocess.Popen(command + (per_process[i] if per_process else []), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env=_env(devices, JAX_COORDINATOR_ADDRESS=address, JAX_PROCESS_COUNT=str(num_processes),
                                    JAX_PROCESS_ID=str(i)))
          for i in range(num_processes)]


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
  outputs = []
  for i, proc in enumerate(procs):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"process {i} exited {proc.returncode}: {err[-3000:]}"
    outputs.append(out)
  return outputs


def _losses(run_dir: Path) -> dict[int, float]:
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def _assert_close(got: dict[int, float], want: dict[int, float]) -> None:
  assert sorted(got) == sorted(want)
  # Other process/mesh layouts reduce partial sums in another order: float32 rounding only.
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
  out = tmp_path_factory.mktemp("one_process")
  _wait(_launch(out, "ref", 1, "steps=6"))
  return _losses(out / "ref")


def test_two_processes_train_like_one_and_hand_checkpoints_back_and_forth(tmp_path, reference):
  """1 process (steps 1-2) → 2 processes with dcn_data_parallelism=2 (steps 3-4) → 1 process
  (steps 5-6), all resuming the same run: losses follow the single-process run throughout."""
  _wait(_launch(tmp_path, "mixed", 1, "steps=2"))
  outs = _wait(_launch(tmp_path, "mixed", 2, "steps=4", "dcn_data_parallelism=2"))
  assert "state: resumed from step 2" in outs[0] and "mesh: data=2, fsdp=4" in outs[0]
  # gloo's C++ log names its peers, and its lines are sometimes split by other output
  # Gloo's C++ lines, and on a loaded machine fragments of them that hold no word, are not ours.
  ours = [line for line in outs[1].splitlines()
          if "peer ranks" not in line and not line.startswith("[Gloo]") and re.search(r"[A-Za-z]", line)]
  assert not ours, f"only process 0 prints; process 1 printed: {ours[:5]}"
  outs = _wait(_launch(tmp_path, "mixed", 1, "steps=6"))
  assert "state: resumed from step 4" in outs[0]
  _assert_close(_losses(tmp_path / "mixed"), reference)
  written = sorted(p.name for p in (tmp_path / "mixed").iterdir())
  assert written == ["checkpoints", "config.yml", "config_history", "goodput.json", "metrics.jsonl", "tensorboard"]


@pytest.mark.slow
@pytest.mark.parametrize("num_processes, mesh_args", [
    (2, ["dcn_fsdp_parallelism=2", "dcn_data_parallelism=1"]),
    (4, ["dcn_data_parallelism=2", "dcn_fsdp_parallelism=2"]),
], ids=["2proc-dcn_fsdp", "4proc-dcn_data_x_fsdp"])
def test_more_process_layouts_match_one_process(tmp_path, reference, num_processes, mesh_args):
  _wait(_launch(tmp_path, "run", num_processes, "steps=6", *mesh_args))
  _assert_close(_losses(tmp_path / "run"), reference)


@pytest.mark.slow
def test_a_killed_process_fails_the_others_fast_and_the_job_resumes(tmp_path):
  args = ["steps=30", "dcn_data_parallelism=2"]
  procs = _launch(tmp_path, "crash", 2, *args)
  deadline = time.time() + 300
  for line in procs[0].stdout:
    if line.startswith("step ") and int(line.split()[1]) >= 3:
      break
    assert time.time() < deadline
  procs[1].send_signal(signal.SIGKILL)
  killed_at = time.time()
  try:
    procs[0].communicate(timeout=120)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    pytest.fail("the surviving process hung after its peer died")
  procs[1].communicate()
  assert procs[0].returncode != 0
  assert time.time() - killed_at < 120
  saved = sorted(int(p.name) for p in (tmp_path / "crash" / "checkpoints").iterdir() if p.name.isdigit())
  assert saved, "no checkpoint was written before the crash"

  outs = _wait(_launch(tmp_path, "crash", 2, *args))
  assert f"state: resumed from step {saved[-1]}" in outs[0]


def test_processes_started_with_different_configs_each_stop_with_one_line(tmp_path):
  """One host given another override: gloo aborted both with a C++ stack (a collective of another size);
  on TPU it can wait for good. Now every process names the key, before anything is written."""
  procs = _launch(tmp_path, "mixed", 2, "steps=6", per_process=[[], ["base_emb_dim=128"]])
  for i, proc in enumerate(procs):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    here, there = ("64", "128") if i == 0 else ("128", "64")
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == [f"error [process {i}/2]: the processes of this job were started with different configurations: "
                      f"process(es) 1 differ from process 0 (base_emb_dim: {there} on process {1 - i}, {here} here); "
                      "start every process with the same command, config file and M_* variables"], err[-3000:]
    assert "Traceback" not in err
  assert not (tmp_path / "mixed").exists()
