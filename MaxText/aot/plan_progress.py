"""The planner's progress on stderr while its compiles run (MaxText/plan.py): a line as each
candidate starts compiling, then a bar with done/total and the ETA from the mean compile time
so far. On a terminal the bar is redrawn in place; elsewhere (a log, CI) every update is a line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

# How often the planner looks for compiles that have started, in seconds.
POLL_SECONDS = 1.0


class Progress:
  def __init__(self, total: int, workers: int):
    self.total, self.workers, self.done, self.seconds = total, workers, 0, 0.0
    self.start = time.monotonic()
    self.tty = sys.stderr.isatty()
    self._bar = ""

  def started(self, number: int, label: str, log: Path) -> None:
    """Candidate `number` of `total` began compiling; its worker's output goes to `log`."""
    line = f"compiling candidate {number}/{self.total}: {label} (log: {log})"
    if self.tty:  # above the bar, which is redrawn under it
      print("\r" + line.ljust(110) + ("\n" + self._bar if self._bar else "\n"), end="", file=sys.stderr, flush=True)
    else:
      print(line, file=sys.stderr, flush=True)

  def update(self, label: str, compile_s: float) -> None:
    self.done += 1
    self.seconds += compile_s
    remaining = self.total - self.done
    eta = self.seconds / self.done * remaining / max(1, min(self.workers, remaining)) if remaining else 0.0
    bar = "#" * round(20 * self.done / self.total)
    self._bar = f"[{bar:<20}] {self.done}/{self.total} compiled, ETA {eta:.0f} s ({label}: {compile_s:.1f} s)"
    print(("\r" + self._bar.ljust(110)) if self.tty else self._bar, end="" if self.tty else "\n", file=sys.stderr,
          flush=True)

  def finish(self) -> None:
    if self.tty and self.done:
      print(file=sys.stderr)
