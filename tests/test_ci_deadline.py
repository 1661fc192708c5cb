"""The CI deadline (tests/conftest.py): past MAXTEXT_CI_DEADLINE less a test's allowance, the test is skipped with
the reason, so CI's run ends green inside its 90 minutes instead of being stopped in the middle."""

import os
import re
import subprocess
import sys
import time

from tests.conftest import REPO_ROOT


def test_target():
  """Run by the test below in a pytest of its own."""


def _run_target(deadline: float | None) -> str:
  env = {k: v for k, v in os.environ.items() if k != "MAXTEXT_CI_DEADLINE"}
  if deadline is not None:
    env["MAXTEXT_CI_DEADLINE"] = str(int(deadline))
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_ci_deadline.py::test_target"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, check=False)
  return result.stdout


def test_a_test_that_might_overrun_the_deadline_is_skipped_with_the_reason():
  out = _run_target(time.time() + 30)  # a default test is allowed 1 minute
  # 0.5 minutes, less however long the child took to start (a loaded machine takes seconds).
  assert "1 skipped" in out and re.search(r"CI budget: 0\.[2-5] minutes left before MAXTEXT_CI_DEADLINE", out), out


def test_tests_run_when_time_is_left_or_no_deadline_is_set():
  assert "1 passed" in _run_target(time.time() + 3600)
  assert "1 passed" in _run_target(None)
