"""Errors a user can fix, and the entry-point wrapper that prints them as one line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, NoReturn


class UserError(Exception):
  """A problem with the user's input (config, files, mesh): printed as one line, exit code 2."""

  exit_code = 2


class ConfigError(UserError):
  """An unknown key, a value of the wrong type, or an impossible combination of values."""


class TrainingError(UserError):
  """The run itself went wrong in a way the user must act on (e.g. a NaN loss)."""

  exit_code = 3


def choices(allowed: Iterable[str], empty: str = "off") -> str:
  """A message's list of allowed values: the empty value is written `"" (<empty>)`, not as nothing."""
  return ", ".join(f'"" ({empty})' if a == "" else a for a in allowed)


# "process i/n" once a multi-process job is joined, so each process's errors say which it is.
_process_label = ""


def set_process_label(label: str) -> None:
  global _process_label
  _process_label = label


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
  """Raises one library logger's threshold for a block (a library that logs, then raises, what
  the caller turns into its own one line)."""
  logger = logging.getLogger(name)
  saved = logger.level
  logger.setLevel(level)
  try:
    yield
  finally:
    logger.setLevel(saved)


# An error line names its culprit first; past this a value echoed into it (a pasted list, a file's worth of text) is
# cut in the middle, so the line still fits a terminal and a log viewer.
ERROR_LINE_CHARACTERS = 2000


def _cut(message: str) -> str:
  if len(message) <= ERROR_LINE_CHARACTERS:
    return message
  head, tail = message[:ERROR_LINE_CHARACTERS - 400], message[-300:]
  return f"{head} ... ({len(message) - len(head) - len(tail)} characters left out) ... {tail}"


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
  """Runs an entry point; user errors become `error: ...` on stderr and a non-zero exit. The
  process's own start-up (signals, library logs) is the entry point's first step:
  `startup.start`. Its exit does not wait for ever on threads left running (`exit_unheld`)."""
  try:
    code = main(list(sys.argv if argv is None else argv))
  except UserError as e:
    where = f" [{_process_label}]" if _process_label else ""
    print(f"error{where}: {_cut(str(e))}", file=sys.stderr, flush=True)
    if getattr(e, "exit_at_once", False):
      # Library threads still blocked on what failed (a storage's endpoint) would keep a normal
      # exit waiting for ever: the line is out and everything durable is already written.
      sys.stdout.flush()
      os._exit(e.exit_code)
    exit_unheld(e.exit_code)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    exit_unheld(130)
  exit_unheld(code or 0)


EXIT_GRACE_S = 30.0  # how long the exit waits for threads that are not daemons before it leaves them
# The status the watch exits with: the latest call's. A host that catches the SystemExit and goes on (a test
# session) clears it, and then no watch runs at its own exit.
_exit_code: list[int] = []


def exit_unheld(code: int) -> NoReturn:
  """sys.exit(code), which Python makes wait for every thread that is not a daemon (and every
  ThreadPoolExecutor task): a user's environment or reward function that started one and never stops
  it would keep the finished run's process alive for ever. Once the exit has waited EXIT_GRACE_S for
  them, one `warning:` line names them and the process exits with `code` without them."""
  register: Any = getattr(threading, "_register_atexit", None)  # run before Python joins the threads
  if not _exit_code and register is not None:
    try:
      register(_watch_exit)
    except RuntimeError:  # already shutting down
      pass
  _exit_code[:] = [code]
  sys.exit(code)


def forget_exit_status() -> None:
  """For a host that caught run_cli's SystemExit and goes on (a test session): its own exit is then not watched."""
  _exit_code.clear()


def _watch_exit() -> None:
  if not _exit_code:  # a host that caught every SystemExit (a test session) and cleared the status exits its own way
    return
  threading.Thread(target=_leave_after_grace, name="exit-watch", daemon=True).start()


def _lingering() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread() and t.is_alive()]


def _leave_after_grace() -> None:
  # Disarmed once Python has joined every such thread: the atexit handlers that run next (a tracker's final upload)
  # may take as long as they need.
  deadline = time.monotonic() + EXIT_GRACE_S
  while _lingering():
    if time.monotonic() >= deadline:
      break
    time.sleep(0.2)
  else:
    return
  lingering = _lingering()
  shown = ", ".join(_where(t) for t in lingering[:3]) + (f" and {len(lingering) - 3} more" if len(lingering) > 3 else "")
  code = _exit_code[-1] if _exit_code else 0
  print(f"warning: exiting with status {code} without waiting for threads still running after "
        f"{EXIT_GRACE_S:g} s ({shown or 'none named'}); a thread your code starts (an RL environment's, a reward "
        "function's) must be a daemon (daemon=True) or end with the run", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(code)


def _where(thread: threading.Thread) -> str:
  """A thread's name and the innermost line of its stack outside Python's own library (the user's loop)."""
  frame = sys._current_frames().get(thread.ident or -1)
  while frame is not None:
    module = str(frame.f_globals.get("__name__", ""))
    if module.split(".")[0] not in sys.stdlib_module_names:
      return f"{thread.name} at {frame.f_code.co_filename.rsplit(os.sep, 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
    frame = frame.f_back
  return thread.name
