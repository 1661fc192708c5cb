"""Whole training runs whose run directory is on gs:// (a real GCS JSON API on 127.0.0.1):
kill and resume bit for bit, SIGTERM, a damaged step, every run file in the bucket, and bad
buckets or endpoints stopping the run with one line."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from MaxText.paths import storage
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env
from tests.test_resume import _start_and_signal

STEPS = 12
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "print_config=False", "cpu_peak_tflops=0.1", f"steps={STEPS}", f"learning_rate_schedule_steps={STEPS}"]


def env(gcs, **extra: str) -> dict:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
          "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **(gcs.env() if gcs else {}), **jax_cache_env(), **extra}


def command(out: str, run_name: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={run_name}",
          f"base_output_directory={out}", *MODEL, *extra]


def run(cmd: list[str], environment: dict, expect: int = 0) -> subprocess.CompletedProcess:
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=600)
  assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def losses(run_dir: str) -> dict[int, float]:
  records = [json.loads(line) for line in storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()]
  steps = [r["step"] for r in records if "loss" in r]
  assert len(steps) == len(set(steps)), f"metrics.jsonl repeats steps: {steps}"
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def committed_steps(run_dir: str) -> list[int]:
  directory = storage.join(run_dir, "checkpoints")
  if not storage.exists(directory):
    return []
  return sorted(int(n) for n in storage.listdir(directory)
                if n.isdigit() and storage.exists(storage.join(directory, n, "commit_success.txt")))


def start_and_signal(cmd: list[str], environment: dict, after_step: int, ready, sig: int | None) -> subprocess.Popen:
  return _start_and_signal(cmd, after_step, ready, sig, env=environment)


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory) -> dict[int, float]:
  """The same run, uninterrupted, on local disk."""
  out = tmp_path_factory.mktemp("local")
  run(command(str(out), "ref", "checkpoint_period=4"), env(None))
  return losses(str(out / "ref"))


def _tensorboard_scalars(data: bytes) -> set[str]:
  """Tags in a TFRecord file of Event protos (length, crc, payload, crc per record)."""
  from tensorboardX.proto import event_pb2

  tags, offset = set(), 0
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
    tags |= {v.tag for v in event.summary.value}
    offset += 12 + length + 4
  return tags


# The default run's one training run on gs:// (with a resume); the chaos campaign has the rest.
def test_sigkill_on_gcs_resumes_bitwise_like_an_uninterrupted_local_run(gcs, gcs_bucket, local_reference):
  out = f"{gcs_bucket}/runs"
  run_dir = f"{out}/killed"
  cmd = command(out, "killed", "checkpoint_period=4", "profiler=xplane", "profile_start_step=1", "profile_steps=1")
  proc = start_and_signal(cmd, env(gcs), 6, lambda: 4 in committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  latest = committed_steps(run_dir)[-1]

  rerun = run(cmd, env(gcs))
  assert f"state: resumed from step {latest} of {run_dir}/checkpoints" in rerun.stdout
  assert losses(run_dir) == local_reference  # CPU runs of one program are deterministic: bitwise
  assert set(storage.listdir(run_dir)) == {"checkpoints", "config.yml", "config_history", "goodput.json", "metrics.jsonl",
                                             "profile", "tensorboard"}
  assert "base_output_directory: " + out in storage.read_text(f"{run_dir}/config.yml")
  events = storage.glob(f"{run_dir}/tensorboard/events.out.tfevents.*")
  assert events and {"loss", "learning_rate"} <= set().union(*(_tensorboard_scalars(storage.read_bytes(e))
                                                                for e in events))
  assert any(name.endswith(".xplane.pb") for name in gcs.objects(gcs_bucket[5:], "runs/killed/profile/"))
  # Nothing landed on local disk under a mangled 'gs:' folder.
  assert not (REPO_ROOT / "gs:").exists()


@pytest.mark.slow  # SIGTERM itself is in test_resume's default run; this adds gs://
def test_sigterm_on_gcs_saves_then_resumes(gcs, gcs_bucket, local_reference):
  out = f"{gcs_bucket}/runs"
  cmd = command(out, "preempted", "checkpoint_period=1000")
  proc = start_and_signal(cmd, env(gcs), 5, lambda: True, signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  saved = committed_steps(f"{out}/preempted")
  assert len(saved) == 1 and f"stopped: SIGTERM: saved step {saved[0]}" in stdout
  run(cmd, env(gcs))
  assert losses(f"{out}/preempted") == local_reference


@pytest.mark.slow
def test_a_damaged_step_on_gcs_is_set_aside_and_the_previous_one_restores(gcs, gcs_bucket, local_reference):
  out = f"{gcs_bucket}/runs"
  run_dir = f"{out}/damaged"
  run(command(out, "damaged", "checkpoint_period=4", "steps=8"), env(gcs))
  assert committed_steps(run_dir) == [4, 8]
  bucket = gcs_bucket[5:]
  # Truncate every array data file of step 8: the step is still listed but cannot be read.
  data_files = [n for n in gcs.objects(bucket, "runs/damaged/checkpoints/8/state/") if "/d/" in n]
  assert data_files
  for name in data_files:
    storage.write_bytes(f"{gcs_bucket}/{name}", b"")

  rerun = run(command(out, "damaged", "checkpoint_period=4"), env(gcs))
  assert "checkpoint step 8" in rerun.stdout and "incomplete or corrupt" in rerun.stdout
  assert "state: resumed from step 4" in rerun.stdout
  assert losses(run_dir) == local_reference
  names = storage.listdir(f"{run_dir}/checkpoints")
  aside = [n for n in names if n.startswith("8.corrupt-")]
  assert len(aside) == 1, names  # the damaged step is kept beside the others, never deleted
  assert gcs.objects(bucket, f"runs/damaged/checkpoints/{aside[0]}/state/")


def test_a_missing_bucket_stops_before_any_compile(gcs):
  proc = run(command("gs://no-such-bucket-here/runs", "x"), env(gcs), expect=2)
  assert proc.stderr.strip().splitlines()[-1].startswith("error: base_output_directory=gs://no-such-bucket-here/runs: "
                                                         "bucket gs://no-such-bucket-here does not exist")
  assert "mesh:" not in proc.stdout and "Traceback" not in proc.stderr


def test_an_unreachable_endpoint_fails_within_the_timeout(gcs):
  started = time.time()
  unreachable = env(None, STORAGE_EMULATOR_HOST="http://127.0.0.1:9")  # discard port: nothing listens
  proc = run(command("gs://bucket/runs", "x", "storage_timeout_seconds=5"), unreachable, expect=2)
  assert time.time() - started < 60
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: base_output_directory=gs://bucket/runs: ") and "127.0.0.1:9" in last, last


def test_missing_credentials_fail_with_one_line_within_the_timeout(tmp_path):
  """No emulator, no application-default credentials (an empty HOME), no metadata server: the
  real Google endpoint path, as on a laptop that never ran `gcloud auth`."""
  started = time.time()
  no_credentials = env(None, HOME=str(tmp_path), GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9")
  proc = run(command("gs://bucket/runs", "x", "storage_timeout_seconds=5"), no_credentials, expect=2)
  assert time.time() - started < 60
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith("error: base_output_directory=gs://bucket/runs: ") and "credentials" in lines[-1], lines
  assert "Traceback" not in proc.stderr and "mesh:" not in proc.stdout


@pytest.mark.slow
def test_writes_refused_mid_run_stop_it_with_one_line_and_older_steps_still_restore(gcs, gcs_bucket,
                                                                                   local_reference):
  from tests.chaos.fault_proxy import FaultProxy

  proxy = FaultProxy(gcs.url)
  try:
    out = f"{gcs_bucket}/runs"
    run_dir = f"{out}/refused"
    cmd = command(out, "refused", "checkpoint_period=4", "async_checkpointing=False")
    proc = start_and_signal(cmd, env(None, **proxy.env()), 5, lambda: 4 in committed_steps(run_dir), None)
    proxy.set_mode("forbid_writes")
    stdout, stderr = proc.communicate(timeout=300)
  finally:
    proxy.close()
  assert proc.returncode not in (0, -signal.SIGKILL), stdout[-2000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "refused" in last and "Traceback" not in stderr, stderr[-3000:]
  assert committed_steps(run_dir) == [4]

  rerun = run(cmd, env(gcs))  # storage works again: the same command resumes
  assert "state: resumed from step 4" in rerun.stdout
  assert losses(run_dir) == local_reference


@pytest.mark.slow  # two more runs; the code paths are the resume's
def test_pruning_and_load_full_state_path_on_gcs(gcs, gcs_bucket):
  out = f"{gcs_bucket}/runs"
  run(command(out, "pruned", "checkpoint_period=2", "steps=6", "max_num_checkpoints_to_keep=1"), env(gcs))
  assert committed_steps(f"{out}/pruned") == [6]
  started = run(command(out, "next", "steps=8", f"load_full_state_path={out}/pruned/checkpoints"), env(gcs))
  assert f"state: loaded the full state of step 6 from {out}/pruned/checkpoints" in started.stdout
  assert sorted(losses(f"{out}/next")) == [7, 8]
