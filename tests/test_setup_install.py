"""The plain install the README gives, `bash setup.sh`, for real: in a fresh virtual environment.

The docs' `install` blocks run setup.sh with DRY_RUN=1 (it prints its pip commands), so this test is
what shows the install itself works: a new venv (with pip, without the packages of this process),
`bash setup.sh` with that venv's python, then the venv imports MaxText and trains two steps. It needs
the package index setup.sh installs from and downloads JAX, libtpu and the rest, which tests otherwise
never do: it runs only under -m slow with MAXTEXT_INSTALL_TEST=1 (.ci/run sets it in the docs' stage,
where CI installs through setup.sh anyway), and is skipped, saying so, where the index cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

INSTALL_TIMEOUT_S = 1800


def _index_url() -> str:
  """The index pip would use: PIP_INDEX_URL, else pip's configuration, else PyPI."""
  if os.environ.get("PIP_INDEX_URL"):
    return os.environ["PIP_INDEX_URL"]
  try:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode == 0 and out.stdout.strip():
      return out.stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    pass
  return "https://pypi.org/simple/"


def _unreachable(index: str) -> str | None:
  """Why the index cannot be used, or None: one small request for the project page of jax."""
  url = index.rstrip("/") + "/jax/"
  try:
    with urllib.request.urlopen(url, timeout=10) as response:
      return None if response.status == 200 else f"{url} answered {response.status}"
  except (urllib.error.URLError, OSError) as e:
    return f"{url}: {e}"


@pytest.mark.slow
def test_plain_setup_sh_installs_into_a_fresh_venv(tmp_path: Path) -> None:
  if os.environ.get("MAXTEXT_INSTALL_TEST") != "1":
    pytest.skip("downloads setup.sh's packages from the package index: set MAXTEXT_INSTALL_TEST=1 to run it "
                "(.ci/run does)")
  index = _index_url()
  why = _unreachable(index)
  if why is not None:
    pytest.skip(f"the package index is unreachable ({why}); setup.sh cannot install here")
  repo = tmp_path / "repo"
  shutil.copytree(REPO_ROOT, repo, ignore=shutil.ignore_patterns(".git", "outputs", "__pycache__", "*.egg-info",
                                                                 "build", ".venv", ".mypy_cache", ".pytest_cache"))
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = venv / "bin" / "python"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "JAX_", "XLA_"))}
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  env["PYTHON"] = str(python)
  install = subprocess.run(["bash", "setup.sh"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=INSTALL_TIMEOUT_S)
  assert install.returncode == 0, f"bash setup.sh failed:\n{install.stdout[-4000:]}\n{install.stderr[-4000:]}"
  assert "setup.sh: ok: jax" in install.stdout, install.stdout[-2000:]
  # From outside the copy, so that MaxText is imported from the install, not from the current folder.
  run = subprocess.run([str(python), "-m", "MaxText.train", str(repo / "configs" / "base.yml"), "run_name=installed",
                        "steps=2",
                        "print_config=False"], cwd=tmp_path, env={**env, "PYTHONPATH": ""}, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0 and "done: steps 1..2" in run.stdout, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
