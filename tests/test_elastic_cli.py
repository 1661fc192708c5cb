"""`python3 -m MaxText.elastic`: the layout built from the run's config, its one-line mistakes, and
the TPU VM path against the fake gcloud (tests/test_elastic.py has the supervisor and the slow
loopback run through this command line)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from MaxText import elastic


def _wait_for(condition, what: str, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.2)


_RUN = ["configs/base.yml", "run_name=el", "num_slices=4", "elastic_min_slices=1", "per_device_batch_size=1",
        "dataset_type=synthetic"]


def test_the_command_line_builds_the_layout_from_the_runs_config_and_prints_its_plan(capsys, tmp_path):
  assert elastic.main(["elastic", *_RUN, f"base_output_directory={tmp_path}", "devices_per_process=2",
                       "dry_run=true"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[:4] == [
      "elastic: the global batch of 8 is kept on 4, 2, 1 slice(s) (elastic_min_slices=1):",
      "  4 slice(s): num_slices=4 dcn_data_parallelism=4 per_device_batch_size=1 gradient_accumulation_steps=1",
      "  2 slice(s): num_slices=2 dcn_data_parallelism=2 per_device_batch_size=2 gradient_accumulation_steps=2",
      "  1 slice(s): num_slices=1 dcn_data_parallelism=1 per_device_batch_size=4 gradient_accumulation_steps=4"]
  assert lines[4].startswith("elastic: generation 1 runs on 4 process(es) on 127.0.0.1, 2 device(s) each: "
                             "python3 -m MaxText.train configs/base.yml run_name=el ")
  # On TPU VMs the slice's devices come from its type: 2 slices of v5litepod-16 hold 32 devices.
  assert elastic.main(["elastic", *_RUN[:2], "num_slices=2", *_RUN[3:], "tpu_prefix=pod", "tpu_type=v5litepod-16",
                       "dry_run=true"]) == 0
  out = capsys.readouterr().out
  assert "  1 slice(s): num_slices=1 dcn_data_parallelism=1 per_device_batch_size=2 gradient_accumulation_steps=2" \
      in out and "runs on every worker of pod-0, pod-1 in ~/el: " in out


@pytest.mark.parametrize("extra,message", [
    (["elastic_min_slices=0"], r"^python3 -m MaxText.elastic supervises an elastic run: set elastic_min_slices=N"),
    (["run_name="], r"^set run_name=NAME: every generation of the job resumes the same run$"),
    # num_slices left at its default, 0 or negative (was: "num_slices=-1 does not divide the -8 devices")
    (["num_slices=-1"], r"^python3 -m MaxText.elastic needs num_slices=N >= 1, the slices the run starts on \(got "
                        r"num_slices=-1\)$"),
    (["num_slices=0", "tpu_prefix=pod", "tpu_type=v5litepod-8"], r"needs num_slices=N >= 1, .* \(got num_slices=0\)$"),
    (["zone=z"], r"^zone applies to TPU VMs only: add tpu_prefix=NAME"),
    (["tpu_prefix=pod"], r"^tpu_prefix needs tpu_type=TYPE"),
    (["tpu_prefix=pod", "tpu_type=v5litepod-12"], r"^tpu_type='v5litepod-12' is not a TPU type"),
    (["tpu_prefix=pod", "tpu_type=v5litepod-8", "run_name=My_run"], r"^run_name 'My_run' must be lower-case "),
])
def test_the_command_lines_mistakes_are_one_line_each(extra, message):
  with pytest.raises(elastic.UserError, match=message):
    elastic.main(["elastic", *_RUN, *extra, "dry_run=true"])


_FAKE_TRAIN = (Path(__file__).parent / "fake_elastic_worker.py").read_text()  # tests/fake_elastic_worker.py


@pytest.mark.slow  # about 12 s: every fake gcloud call is a Python process
def test_the_command_line_copies_the_code_once_and_shrinks_a_tpu_vm_job(tmp_path):
  """`tpu_prefix=` runs the job on the fake gcloud's slices from code copied once; a lost slice
  relaunches `python3 -m MaxText.train` with the run's arguments and the resize's on the other."""
  import subprocess

  from tests.conftest import REPO_ROOT
  from tests.fake_gcloud import FakeCloud

  cloud = FakeCloud(tmp_path / "cloud", {"job-0": 1, "job-1": 1})
  code, shared, runs = tmp_path / "code", tmp_path / "shared", tmp_path / "runs"
  (code / "MaxText").mkdir(parents=True)
  (code / "MaxText" / "__init__.py").write_text("")
  (code / "MaxText" / "train.py").write_text(_FAKE_TRAIN)  # stands in for training on the workers
  shared.mkdir()
  command = [sys.executable, "-m", "MaxText.elastic", *_RUN[:2], "num_slices=2", *_RUN[3:],
             f"base_output_directory={runs}", "tpu_prefix=job", "tpu_type=v5litepod-8", f"script_dir={code}",
             f"log_dir={tmp_path / 'logs'}", "project=p", "zone=z"]
  supervisor = subprocess.Popen(command, cwd=REPO_ROOT, env={**cloud.env, "FAKE_SHARED": str(shared)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for(lambda: (shared / "args_job-1").exists() and (shared / "args_job-0").exists(), "both workers", 120)
    cloud.configure(tpus={"job-0": {"workers": 1, "state": "READY"}, "job-1": {"workers": 1, "state": "PREEMPTED"}})
    (shared / "kill_job-1").write_text("")
    _wait_for(lambda: len((shared / "args_job-0").read_text().splitlines()) == 2, "the relaunch on slice 0", 120)
    (runs / "el" / "metrics.jsonl").write_text('{"step": 1}\n')  # the shrunk run's first new step
    _wait_for(lambda: "seconds_to_resume" in (runs / "el" / elastic.EVENTS_FILE).read_text(), "the resume", 60)
    (shared / "finish").write_text("")
    out, _ = supervisor.communicate(timeout=120)
  finally:
    if supervisor.poll() is None:
      supervisor.kill()
  assert supervisor.returncode == 0, out
  first, second = (shared / "args_job-0").read_text().splitlines()
  assert first.startswith("configs/base.yml run_name=el num_slices=2 ") and first.endswith(
      "num_slices=2 dcn_data_parallelism=2 per_device_batch_size=1 gradient_accumulation_steps=1")
  # v5litepod-8: 8 chips a slice, 16 rows a step; one slice takes them as 2 micro-batches of 8.
  assert second.endswith("num_slices=1 dcn_data_parallelism=1 per_device_batch_size=2 gradient_accumulation_steps=2")
  (resize,) = [json.loads(line) for line in (runs / "el" / elastic.EVENTS_FILE).read_text().splitlines()
               if "seconds_to_resume" in line]
  assert resize["to_slices"] == 1 and resize["cause"].startswith("process 1 (slice 1) ")
  assert (shared / "env_job-0").read_text().splitlines() == ["-", repr(resize["detected"])]
  scp = [c for c in cloud.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "scp"]]
  assert len(scp) == 2, scp  # once per slice, not once per generation
