"""Errors a user can fix, and the entry-point wrapper that prints them as one line."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import types
from typing import Any, Callable, Iterator, NoReturn

from MaxText import cloud_env


class UserError(Exception):
  """A problem with the user's input (config, files, mesh): printed as one line, exit code 2."""

  exit_code = 2


class ConfigError(UserError):
  """An unknown key, a value of the wrong type, or an impossible combination of values."""


class TrainingError(UserError):
  """The run itself went wrong in a way the user must act on (e.g. a NaN loss)."""

  exit_code = 3


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


class _FirstLineOnly(logging.Filter):
  """Library log records (Orbax logs through absl) reach the console as their first line,
  without the traceback: the run's own `error:` line says what failed and what to do."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info or record.exc_text:
      record.exc_info, record.exc_text = None, None
    message = record.getMessage().strip().splitlines()
    record.msg, record.args = (message[0] if message else ""), None
    return True


class _NoAbandonedFutures(logging.Filter):
  """asyncio's "exception was never retrieved" records: reads a failed restore abandoned (see
  _is_abandoned_async_work); the restore's own line reports the failure."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _one_line_library_logs() -> None:
  logger = logging.getLogger("absl")
  if not any(isinstance(f, _FirstLineOnly) for f in logger.filters):
    logger.addFilter(_FirstLineOnly())
  # gcsfs logs each request it gave up on, with a traceback; storage_retry retries or reports it.
  logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _NoAbandonedFutures) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_NoAbandonedFutures())


def _is_abandoned_async_work(exc: BaseException | None, obj: object = None) -> bool:
  """Noise of a failed checkpoint read: once its restore gave up, TensorStore's threads still
  call back into the closed asyncio loop, and Orbax's pending read coroutines are collected
  with their errors. The restore's own warning or error line already said what failed."""
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    return True
  code = getattr(obj, "cr_code", None)
  return code is not None and ("orbax" in code.co_filename or "tensorstore" in code.co_filename)


def _filter_background_noise() -> None:
  """Drops `_is_abandoned_async_work` tracebacks from the terminal; every other uncaught or
  unraisable error is printed as before."""
  if getattr(sys.excepthook, "_maxtext_filter", False):
    return
  previous_excepthook, previous_unraisable = sys.excepthook, sys.unraisablehook

  def excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    if not _is_abandoned_async_work(value):
      previous_excepthook(kind, value, tb)

  def unraisablehook(unraisable: Any) -> None:  # sys.UnraisableHookArgs
    if not _is_abandoned_async_work(getattr(unraisable, "exc_value", None), getattr(unraisable, "object", None)):
      previous_unraisable(unraisable)

  excepthook._maxtext_filter = True  # type: ignore[attr-defined]
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
  """Runs an entry point; user errors become `error: ...` on stderr and a non-zero exit."""
  # A process started in the background by a non-interactive shell inherits SIGINT as ignored,
  # and Python then never raises KeyboardInterrupt: Ctrl-C / SIGINT would be lost on the way
  # to the clean stop (and the checkpoint) the entry points promise.
  if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  cloud_env.configure_cloud_env()  # before any library opens a gs:// path
  _one_line_library_logs()
  _filter_background_noise()
  try:
    code = main(list(sys.argv if argv is None else argv))
  except UserError as e:
    where = f" [{_process_label}]" if _process_label else ""
    print(f"error{where}: {e}", file=sys.stderr, flush=True)
    if getattr(e, "exit_at_once", False):
      # Library threads still blocked on what failed (a storage's endpoint) would keep a normal
      # exit waiting for ever: the line is out and everything durable is already written.
      sys.stdout.flush()
      os._exit(e.exit_code)
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
  sys.exit(code or 0)
