"""A finished run's process exits although user code (an RL environment, a reward function) left a thread
running that is not a daemon: after errors.EXIT_GRACE_S, one warning line naming the thread and the run's
own exit status (errors.run_cli, errors.exit_unheld). Each case runs in a process of its own, bounded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROLOGUE = """
import concurrent.futures, threading, time
from MaxText import errors
errors.EXIT_GRACE_S = 0.5

def poll():
  while True:
    time.sleep(0.01)
"""


def _run(body: str) -> subprocess.CompletedProcess:
  script = PROLOGUE + textwrap.dedent(body)
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _warning(stderr: str) -> str:
  lines = [line for line in stderr.splitlines() if line.startswith("warning: exiting")]
  assert len(lines) == 1, stderr
  return lines[0]


@pytest.mark.parametrize("returned, status", [(None, 0), (5, 5)])
def test_a_thread_left_running_does_not_keep_the_finished_run_alive(returned, status):
  """Python's exit waited for the thread for ever: the run printed its last line and never ended."""
  proc = _run(f"""
      def main(argv):
        threading.Thread(target=poll, name="my-poller").start()
        print("trained", flush=True)
        return {returned}
      errors.run_cli(main, ["train"])
  """)
  assert proc.returncode == status and proc.stdout == "trained\n"
  assert _warning(proc.stderr) == (
      f"warning: exiting with status {status} without waiting for threads still running after 0.5 s (my-poller at "
      "<string>:8 in poll); a thread your code starts (an RL environment's, a reward function's) must be a daemon "
      "(daemon=True) or end with the run")


def test_an_error_keeps_its_status_and_line_with_a_thread_left_running():
  proc = _run("""
      def main(argv):
        threading.Thread(target=poll, name="my-poller").start()
        raise errors.UserError("environment my_env:Env raised ValueError: bad (in step, prompt record 3)")
      errors.run_cli(main, ["train"])
  """)
  assert proc.returncode == 2
  assert proc.stderr.splitlines()[0] == "error: environment my_env:Env raised ValueError: bad (in step, prompt record 3)"
  assert "my-poller at <string>:8 in poll" in _warning(proc.stderr)


def test_an_executor_task_that_never_ends_does_not_keep_the_run_alive():
  proc = _run("""
      def main(argv):
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scorer").submit(poll)
        return 0
      errors.run_cli(main, ["train"])
  """)
  assert proc.returncode == 0 and "scorer_0 at <string>:8 in poll" in _warning(proc.stderr)


def test_threads_that_end_are_waited_for_without_a_warning():
  proc = _run("""
      def main(argv):
        def finish():
          time.sleep(0.2)
          print("finished", flush=True)
        threading.Thread(target=finish).start()
        return 0
      errors.run_cli(main, ["train"])
  """)
  assert proc.returncode == 0 and proc.stdout == "finished\n" and "warning" not in proc.stderr


def test_atexit_handlers_after_the_threads_ended_are_not_cut_short():
  """Once Python has joined every thread, the watch is off: a tracker's final upload in an atexit handler, longer
  than the grace, still ends (a watch that only slept the grace cut it and exited without its work)."""
  proc = _run("""
      import atexit
      def upload():
        time.sleep(1.5)
        print("uploaded", flush=True)
      atexit.register(upload)
      def main(argv):
        threading.Thread(target=time.sleep, args=(0.1,), name="short").start()
        return 0
      errors.run_cli(main, ["train"])
  """)
  assert proc.returncode == 0 and proc.stdout == "uploaded\n" and "warning" not in proc.stderr, proc
