"""What a launcher of an elastic job's processes hands the supervisor (MaxText/elastic.py): one
generation of processes, how each ended, and which slices are up. The launchers live apart from
the supervisor: LoopbackLauncher and TpuVmLauncher in elastic.py, the GKE JobSet launcher in
platform/gke_launch.py, queued-resource replacements in platform/queued_slices.py."""

from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path
from typing import Mapping, Protocol, Sequence

WATCHDOG_EXIT = 4  # training/health.py's StepWatchdog: no step finished in step_timeout_seconds
SIGTERM_EXIT = 128 + signal.SIGTERM  # train.py after saving at a SIGTERM step boundary
PEER_FAILURES = (-signal.SIGABRT, 128 + signal.SIGABRT, WATCHDOG_EXIT)  # ends caused by another process
LOST_EXIT = 128 + signal.SIGKILL  # a process whose host went away: no status of its own (a pod's lost node)


@dataclasses.dataclass(frozen=True)
class Exit:
  """A process of the current generation that has ended."""

  slice_id: int
  process: int  # its process index in the generation
  code: int  # negative: killed by that signal
  reason: str = ""  # what ended it when the platform says and the status does not (a pod's lost node)

  @property
  def infrastructure(self) -> bool:
    """Lost to its host or a peer (a signal, JAX's abort, the hang watchdog, ssh's lost connection),
    not the run's own error. Over ssh a signal reads as status 128 + the signal."""
    return self.code < 0 or self.code > 128 or self.code in PEER_FAILURES

  def describe(self) -> str:
    if self.reason:
      return f"process {self.process} (slice {self.slice_id}) {self.reason}"
    how = f"was killed by signal {-self.code}" if self.code < 0 else f"exited with status {self.code}"
    return f"process {self.process} (slice {self.slice_id}) {how}"


class Generation(Protocol):
  """One launch of the job's processes."""

  def exits(self) -> list[Exit]:
    """Every process that has ended so far."""
    ...

  def running(self) -> int:
    ...

  def signal_all(self, signum: int) -> None:
    ...

  def resumed_from(self) -> tuple[int, str] | None:
    """The step the run resumed from and where it came from, once the run has said (None before)."""
    ...


class Launcher(Protocol):
  def start(self, slices: Sequence[int], overrides: Sequence[str], env: Mapping[str, str]) -> Generation:
    """The job's processes on `slices`, with `overrides` after the command's arguments and `env` added."""
    ...

  def available(self) -> set[int]:
    """The slices that are up now."""
    ...

  def mark_lost(self, slice_id: int) -> None:
    ...


def logged_generations(log_dir: Path) -> int:
  """The highest generation whose logs `log_dir` holds (generation_<N>... names), 0 for none. A launcher
  numbers its generations after it: a rerun of the supervisor with the same log_dir wrote over the logs
  that said how the last run ended."""
  numbers = [int(m.group(1)) for path in log_dir.iterdir() if (m := re.match(r"generation_(\d+)(?:_|$)", path.name))]
  return max(numbers, default=0)
