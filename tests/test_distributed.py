"""Process-topology detection, the join timeout, profiling and stack-trace wiring."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from MaxText.platform import distributed
from MaxText.errors import UserError
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env


@pytest.mark.parametrize("environ, platform, expected", [
    ({}, "cpu", None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_PROCESS_COUNT": "4", "JAX_PROCESS_ID": "2"}, "gpu",
     ("10.0.0.1:1234", 4, 2)),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "1", "JAX_PROCESS_ID": "0"}, "cpu", None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, "gpu", (None, None, None)),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, "gpu", None),
    ({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, "tpu", (None, None, None)),
    ({"TPU_WORKER_HOSTNAMES": "a"}, "tpu", None),
])
def test_detect(environ, platform, expected):
  topology = distributed.detect(environ, platform)
  if expected is None:
    assert topology is None
  else:
    assert (topology.coordinator_address, topology.num_processes, topology.process_id) == expected


@pytest.mark.parametrize("environ, message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2"}, "JAX_PROCESS_ID is missing"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "2"},
     r"JAX_PROCESS_ID=2 must be in \[0, JAX_PROCESS_COUNT=2\)"),
])
def test_detect_errors(environ, message):
  with pytest.raises(UserError, match=message):
    distributed.detect(environ, "cpu")


def test_unreachable_coordinator_fails_within_the_timeout_naming_it(tmp_path):
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT),
         "JAX_COORDINATOR_ADDRESS": "127.0.0.1:9", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "1"}
  start = time.time()
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=x",
                         f"base_output_directory={tmp_path}", "distributed_init_timeout_seconds=5"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "could not join the multi-process job at 127.0.0.1:9 within 5 s" in proc.stderr
  assert time.time() - start < 120


def test_profiler_traces_the_chosen_steps(tmp_path, tiny_overrides):
  args = [f"{k}={v}" for k, v in tiny_overrides.items()]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=prof",
                         f"base_output_directory={tmp_path}", *args, "steps=6", "profiler=xplane",
                         "profile_start_step=2", "profile_steps=2", "collect_stack_trace=True", "stack_trace_interval_seconds=1",
                         "cpu_peak_tflops=0.1", "enable_checkpointing=False"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "profile: steps 3..4 traced into" in proc.stdout
  assert list((tmp_path / "prof" / "profile").rglob("*.xplane.pb"))
  assert "stack trace snapshot every 1 seconds" in proc.stderr  # cloud-tpu-diagnostics, to the console


def test_stack_traces_context_is_a_no_op_when_off():
  with distributed.stack_traces(False, False, 600):
    pass
