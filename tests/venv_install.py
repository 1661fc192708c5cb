"""A real `bash setup.sh` into a fresh virtual environment, for the tests that check the installs
themselves (tests/test_setup_install.py, tests/test_page_installs.py).

A fresh venv (pip, none of this process's packages: `--system-site-packages` would hide a missing
dependency), a copy of the repository, then setup.sh with that venv's python and the given EXTRAS.
It downloads JAX, libtpu and the rest from the package index, which tests otherwise never do: it
runs only with MAXTEXT_INSTALL_TEST=1 (.ci/run sets it in the docs' stage, where CI installs through
setup.sh anyway), and not where the index cannot be reached.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1800
_COPY_IGNORE = shutil.ignore_patterns(".git", "outputs", "__pycache__", "*.egg-info", "build", ".venv", ".mypy_cache",
                                      ".pytest_cache")


def index_url() -> str:
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


def unreachable(index: str) -> str | None:
  """Why the index cannot be used, or None: one small request for the project page of jax."""
  url = index.rstrip("/") + "/jax/"
  try:
    with urllib.request.urlopen(url, timeout=10) as response:
      return None if response.status == 200 else f"{url} answered {response.status}"
  except (urllib.error.URLError, OSError) as e:
    return f"{url}: {e}"


@functools.cache
def skip_reason() -> str | None:
  """Why a real install cannot run here, or None."""
  if os.environ.get("MAXTEXT_INSTALL_TEST") != "1":
    return ("downloads setup.sh's packages from the package index: set MAXTEXT_INSTALL_TEST=1 to run it "
            "(.ci/run does)")
  why = unreachable(index_url())
  return None if why is None else f"the package index is unreachable ({why}); setup.sh cannot install here"


@dataclasses.dataclass
class Venv:
  python: Path
  repo: Path  # the copy setup.sh installed from
  env: dict[str, str]  # this process's environment with the venv first on PATH, no JAX/XLA/PYTHON settings

  @property
  def bin(self) -> Path:
    return self.python.parent


def install(extras: str, where: Path) -> Venv:
  """`EXTRAS=<extras> bash setup.sh` into a fresh venv under `where`; AssertionError with setup.sh's
  output if it fails."""
  repo = where / "repo"
  shutil.copytree(REPO_ROOT, repo, ignore=_COPY_IGNORE)
  venv = where / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = venv / "bin" / "python"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "JAX_", "XLA_"))}
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  result = subprocess.run(["bash", "setup.sh"], cwd=repo, env={**env, "PYTHON": str(python), "EXTRAS": extras},
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
  assert result.returncode == 0 and "setup.sh: ok: jax" in result.stdout, (
      f"EXTRAS={extras} bash setup.sh failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
  return Venv(python, repo, env)
