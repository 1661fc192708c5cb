"""The plain install the README gives, `bash setup.sh`, for real: in a fresh virtual environment.

The docs' `install` blocks run setup.sh with DRY_RUN=1 (it prints its pip commands), so this test is
what shows the install itself works: a new venv (with pip, without the packages of this process),
`bash setup.sh` with that venv's python, then the venv imports MaxText and trains two steps
(tests/venv_install.py). It downloads JAX, libtpu and the rest, which tests otherwise never do: it
runs only under -m slow with MAXTEXT_INSTALL_TEST=1 (.ci/run sets it in the docs' stage), and is
skipped, saying so, where the package index cannot be reached. tests/test_page_installs.py does the
same for the pages that state an install of their own, and runs their commands in it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import venv_install


@pytest.mark.slow
def test_plain_setup_sh_installs_into_a_fresh_venv(tmp_path: Path) -> None:
  why = venv_install.skip_reason()
  if why is not None:
    pytest.skip(why)
  venv = venv_install.install("", tmp_path)
  # From outside the copy, so that MaxText is imported from the install, not from the current folder.
  run = subprocess.run([str(venv.python), "-m", "MaxText.train", str(venv.repo / "configs" / "base.yml"),
                        "run_name=installed", "steps=2", "print_config=False"], cwd=tmp_path,
                       env={**venv.env, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0 and "done: steps 1..2" in run.stdout, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
