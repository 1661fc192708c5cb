"""multihost_job against the fake `gcloud`: the upload, the queued-resource request (one slice
and multislice), the dry run, and the startup script itself, run for real on this machine."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

from tests.fake_gcloud import FakeCloud

REPO = Path(__file__).resolve().parent.parent


def job(cloud: FakeCloud, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
  src = tmp_path / "src"
  src.mkdir(exist_ok=True)
  (src / "code.py").write_text("print('the code')\n")
  argv = [sys.executable, "-m", "MaxText.multihost_job", "tpu_type=v5litepod-16", "version=v2-alpha-tpuv5-lite",
          "bucket_name=gs://bucket", "run_name=job1", f"script_dir={src}", f"local_dir={tmp_path / 'local'}",
          "zone=us-east5-a", *extra]
  return subprocess.run(argv, env=cloud.env, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_the_upload_the_startup_script_and_the_request(tmp_path):
  cloud = FakeCloud(tmp_path / "cloud", {})
  result = job(cloud, tmp_path, "dry_run=true", "command=python3 -m MaxText.train configs/base.yml run_name=job1")
  assert result.returncode == 0, result.stderr
  assert cloud.calls() == [] and not (tmp_path / "local").exists()
  lines = result.stdout.splitlines()
  upload = shlex.split(next(line for line in lines if line.startswith("gcloud storage cp")))
  assert upload[-1] == "gs://bucket/multihost_job/job1/code.tar.gz"
  create = shlex.split(next(line for line in lines if "queued-resources create" in line))
  assert create[1:7] == ["alpha", "compute", "tpus", "queued-resources", "create", "job1"]
  assert "--node-id=job1" in create and "--accelerator-type=v5litepod-16" in create
  assert not any(w.startswith("--node-count") for w in create)
  start, end = lines.index("#!/bin/bash"), lines.index("# ask for the slices:")
  script = "\n".join(lines[start:end]) + "\n"
  assert "python3 -m MaxText.train configs/base.yml run_name=job1" in script
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
  assert "queued-resources delete job1 --force" in result.stdout


def test_multislice_request_uploads_the_code_and_attaches_the_startup_script(tmp_path):
  cloud = FakeCloud(tmp_path / "cloud", {})
  result = job(cloud, tmp_path, "num_slices=4", "bucket_dir=team/jobs", "cqr_extra_args=--spot",
               "command=echo run")
  assert result.returncode == 0, result.stderr
  assert (tmp_path / "cloud" / "gcs" / "bucket" / "team" / "jobs" / "job1" / "code.tar.gz").is_file()
  create = next(c for c in cloud.calls() if "create" in c)
  assert "--node-count=4" in create and "--node-prefix=job1" in create and "--spot" in create
  assert "--zone=us-east5-a" in create and not any(w.startswith("--node-id") for w in create)
  script_flag = next(w for w in create if w.startswith("--metadata-from-file=startup-script="))
  script = Path(script_flag.split("=", 2)[2]).read_text()
  assert "GCS_DIR=gs://bucket/team/jobs/job1" in script and "bash -c 'echo run'" in script
  assert "queued resource job1 requested (4 x v5litepod-16)" in result.stdout


def test_failed_request_is_a_one_line_error(tmp_path):
  cloud = FakeCloud(tmp_path / "cloud", {}, create_exit=1)
  result = job(cloud, tmp_path, "command=true")
  assert result.returncode == 2
  assert result.stderr.splitlines()[-1].startswith("error: creating the queued resource failed (exit 1)")
  result = job(cloud, tmp_path, "command=true", "bucket_name=gs://bucket/sub")
  assert result.returncode == 2 and "put folders in bucket_dir" in result.stderr


def test_startup_script_fetches_runs_uploads_and_runs_only_once(tmp_path):
  cloud = FakeCloud(tmp_path / "cloud", {})
  result = job(cloud, tmp_path, "setup_command=echo setup-ran", "log_upload_seconds=1",
               "command=python3 code.py; sleep 1.5; exit 5")
  assert result.returncode == 0, result.stderr
  script = tmp_path / "local" / "startup.sh"
  env = {**cloud.env, "MULTIHOST_JOB_ROOT": str(tmp_path / "worker")}
  first = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
  assert first.returncode == 5, first.stderr
  log = (tmp_path / "cloud" / "gcs" / "bucket" / "multihost_job" / "job1" / "logs" /
         f"{socket.gethostname()}.log").read_text()
  assert "setup-ran" in log and "the code" in log and log.rstrip().endswith("with exit status 5")
  log_uploads = [c for c in cloud.calls() if c[:2] == ["storage", "cp"] and "/logs/" in c[3]]
  assert len(log_uploads) >= 2  # at least one while the job ran (every second here), and the last one
  again = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
  assert again.returncode == 0 and "already ran" in again.stdout
