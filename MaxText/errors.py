"""Errors a user can fix, and the entry-point wrapper that prints them as one line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable, Iterable, Iterator, NoReturn


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


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
  """Runs an entry point; user errors become `error: ...` on stderr and a non-zero exit. The
  process's own start-up (signals, library logs) is the entry point's first step:
  `startup.start`."""
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
