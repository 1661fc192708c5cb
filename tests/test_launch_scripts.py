"""The operational shell scripts: syntax (and shellcheck where installed), setup.sh's MODE and
DRY_RUN, the dependency-image build, and the SLURM launcher with fake `srun`/`scontrol`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["setup.sh", "rto_setup.sh", "docker_build_dependency_image.sh", "end_to_end/gpu/slurm_train.sh"]
NIGHTLY_INDEX = "https://us-python.pkg.dev/ml-oss-artifacts-published/jax/simple/"


def bash(script: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(REPO / script), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                        env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_pass_shellcheck(script):
  assert subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True).returncode == 0
  if shutil.which("shellcheck"):
    result = subprocess.run(["shellcheck", str(REPO / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def pip_commands(stdout: str) -> list[list[str]]:
  return [shlex.split(line)[4:] for line in stdout.splitlines() if " -m pip install " in line]


def test_setup_dry_run_keeps_the_stable_ci_path_and_adds_nightly():
  stable = bash("setup.sh", env={"DRY_RUN": "1", "EXTRAS": "test", "DEVICE": "cpu", "MODE": ""})
  assert stable.returncode == 0, stable.stderr
  assert "DEVICE=cpu MODE=stable" in stable.stdout
  assert pip_commands(stable.stdout) == [
      ["--quiet", "jax[tpu]>=0.10,<0.13", "-r", "requirements.txt"],
      ["--quiet", "-r", "requirements-test.txt", "-r", "requirements-hf.txt"],
      ["--quiet", "--no-deps", "-e", "."]]
  nightly = bash("setup.sh", env={"DRY_RUN": "1", "DEVICE": "gpu", "MODE": "nightly"})
  assert nightly.returncode == 0, nightly.stderr
  commands = pip_commands(nightly.stdout)
  assert commands[0] == ["--quiet", "jax[cuda13,tpu]>=0.10,<0.13", "-r", "requirements.txt"]
  last = commands[-1]
  assert last[:4] == ["--quiet", "-U", "--pre", "--no-deps"] and last[last.index("-i") + 1] == NIGHTLY_INDEX
  assert {"jax", "jaxlib", "libtpu", "jax-cuda13-plugin", "jax-cuda13-pjrt"} <= set(last)
  cpu_nightly = bash("setup.sh", env={"DRY_RUN": "1", "DEVICE": "tpu", "MODE": "nightly"})
  assert "jax-cuda13-plugin" not in cpu_nightly.stdout and "libtpu" in pip_commands(cpu_nightly.stdout)[-1]
  wrong = bash("setup.sh", env={"DRY_RUN": "1", "MODE": "weekly"})
  assert wrong.returncode == 2 and "MODE must be stable or nightly" in wrong.stderr


def test_setup_refuses_an_unknown_extra_and_eval_brings_lm_evals_client():
  wrong = bash("setup.sh", env={"DRY_RUN": "1", "EXTRAS": "hf,trackng"})
  assert wrong.returncode == 2 and "got 'trackng'" in wrong.stderr and not wrong.stdout.strip()
  assert pip_commands(bash("setup.sh", env={"DRY_RUN": "1", "EXTRAS": "hf,eval", "DEVICE": "cpu"}).stdout)[1:3] == [
      ["--quiet", "-r", "requirements-hf.txt"], ["--quiet", "-r", "requirements-eval.txt"]]
  # `lm_eval --model local-completions` (Path_finetune.md) imports lm-eval's `api` extra.
  from packaging.requirements import Requirement
  lines = [l.split("#")[0].strip() for l in (REPO / "requirements-eval.txt").read_text().splitlines()]
  assert any(Requirement(l).name == "lm-eval" and "api" in Requirement(l).extras for l in lines if l)


def test_pyproject_requirement_files_hold_only_requirement_lines():
  """setuptools reads these files for pyproject's dynamic dependencies and extras; a pip-only line
  (`-r other.txt`) there breaks `pip install -e .` before anything is installed."""
  import tomllib
  from packaging.requirements import Requirement
  dynamic = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
  files = list(dynamic["dependencies"]["file"])
  for extra in dynamic["optional-dependencies"].values():
    files += extra["file"]
  assert "requirements-test.txt" in files and "requirements-hf.txt" in files
  for name in files:
    for line in (REPO / name).read_text().splitlines():
      line = line.split("#")[0].strip()
      if line:
        Requirement(line)  # raises InvalidRequirement on `-r ...`, `--index-url ...` and the like


def test_docker_build_dry_run_and_dockerfile_inputs():
  result = bash("docker_build_dependency_image.sh", "DRY_RUN=1", "DEVICE=gpu", "MODE=nightly", "LOCAL_IMAGE_NAME=img")
  assert result.returncode == 0, result.stderr
  words = shlex.split(result.stdout)
  assert words[:2] == ["docker", "build"] and words[-1] == "." and words[words.index("--tag") + 1] == "img"
  assert "DEVICE=gpu" in words and "MODE=nightly" in words
  wrong = bash("docker_build_dependency_image.sh", "DRY_RUN=1", "DEVICE=auto")
  assert wrong.returncode == 2 and "DEVICE must be tpu, gpu or cpu" in wrong.stderr
  dockerfile = (REPO / "Dockerfile").read_text()
  for line in re.findall(r"^COPY (.+) \./$", dockerfile, re.M):
    for source in line.split():
      assert (REPO / source).exists(), source
  assert 'bash setup.sh' in dockerfile and "WORKDIR /app" in dockerfile


@pytest.fixture
def slurm(tmp_path: Path) -> dict:
  """A fake srun (runs each task here, one after another, with SLURM_PROCID/LOCALID) and scontrol."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a\\ngpu-b\\n"\n')
  (bin_dir / "srun").write_text('''#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
per_node=$((SLURM_NTASKS / SLURM_JOB_NUM_NODES))
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % per_node)) "$@" || exit $?
done
''')
  for name in ("scontrol", "srun"):
    (bin_dir / name).chmod(0o755)
  return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "1234", "SLURM_JOB_NUM_NODES": "2",
          "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_SUBMIT_DIR": str(REPO), "DRY_RUN": "1"}


def test_slurm_one_process_per_gpu(slurm, tmp_path):
  result = bash("end_to_end/gpu/slurm_train.sh", "steps=10", env={**slurm, "SLURM_NTASKS": "4"}, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  tasks = [line for line in result.stdout.splitlines() if line.startswith("task ")]
  assert [t.split()[1] for t in tasks] == ["0/4", "1/4", "2/4", "3/4"]
  port = 1234 % 4096 + 61440
  assert all(f"JAX_COORDINATOR_ADDRESS=gpu-a:{port}" in t for t in tasks)
  assert [re.search(r"SLURM_LOCALID=(\S+)", t).group(1) for t in tasks] == ["0", "1", "0", "1"]
  assert tasks[0].rstrip().endswith("python3 -m MaxText.train configs/base.yml run_name=slurm-1234 steps=10")


def test_slurm_one_process_per_node(slurm, tmp_path):
  env = {**slurm, "PROCESSES": "node", "COORDINATOR_PORT": "7000", "RUN_NAME": "r"}
  result = bash("end_to_end/gpu/slurm_train.sh", env={**env, "SLURM_NTASKS": "2"}, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  tasks = [line for line in result.stdout.splitlines() if line.startswith("task ")]
  assert len(tasks) == 2 and all("gpu-a:7000" in t and "SLURM_LOCALID=unset" in t for t in tasks)
  wrong = bash("end_to_end/gpu/slurm_train.sh", env={**env, "SLURM_NTASKS": "16"}, cwd=tmp_path)
  assert wrong.returncode == 2 and "needs one task per node" in wrong.stderr
  outside = bash("end_to_end/gpu/slurm_train.sh", env={"SLURM_JOB_ID": ""}, cwd=tmp_path)
  assert outside.returncode == 2 and "run it with sbatch" in outside.stderr
