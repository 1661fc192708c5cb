"""Run health beyond one process: the straggler report.

Every process runs the same synchronous steps, so a slow host does not show in its own step
time (everyone waits for it inside the collectives) but in the time it spends on the host side
before it can dispatch: waiting for its own input batch. Every `straggler_report_period` steps
each process's mean step time and input wait over the period are gathered; a process whose input
wait exceeds the median process's by more than `straggler_threshold` x the median step time is
named in the log and counted in the metrics.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from MaxText import metrics as metrics_lib
from MaxText.trainer import StepRecord, Trainer
from MaxText.train_state import TrainState


def _gather_across_processes(values: np.ndarray) -> np.ndarray:
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


class StragglerHook:
  """Add with every=1 (it accumulates every step and reports every `period` steps); every process
  must run it, as the report is a collective."""

  def __init__(self, period: int, threshold: float, writer: metrics_lib.MetricWriter | None, is_primary: bool,
               gather: Callable[[np.ndarray], np.ndarray] = _gather_across_processes):
    self.period, self.threshold, self.writer, self.is_primary, self.gather = period, threshold, writer, is_primary, gather
    self._sums = np.zeros(2)  # step seconds, input wait seconds
    self._count = 0
    self.reported: list[tuple[int, list[int]]] = []  # (step, straggling processes) of each report

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    self._sums += (record.seconds, record.scalars.get("input_wait_s", 0.0))
    self._count += 1
    if record.step % self.period:
      return
    per_process = self.gather(self._sums / self._count)  # [processes, (step s, input wait s)]
    self._sums[:], self._count = 0.0, 0
    step_s, wait_s = per_process[:, 0], per_process[:, 1]
    allowance = self.threshold * float(np.median(step_s))
    slow = [int(p) for p in np.flatnonzero(wait_s - np.median(wait_s) > allowance)]
    self.reported.append((record.step, slow))
    if not self.is_primary:
      return
    if self.writer is not None:
      self.writer.write(record.step, {"stragglers": float(len(slow)),
                                      **{f"input_wait_s/process_{p}": float(w) for p, w in enumerate(wait_s)}})
    if slow:
      named = ", ".join(f"process {p} (input wait {wait_s[p]:.3f} s a step)" for p in slow)
      print(f"warning: stragglers over steps {record.step - self.period + 1}..{record.step}: {named}; the median "
            f"process waits {np.median(wait_s):.3f} s for input in a {np.median(step_s):.3f} s step: check "
            "those hosts' input pipelines, disks and CPU load", file=sys.stderr, flush=True)

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    pass


def add_health_hooks(trainer: Trainer, settings: Any, writer: metrics_lib.MetricWriter | None,
                     is_primary: bool, num_processes: int) -> None:
  if settings.straggler_report_period > 0 and num_processes > 1:
    trainer.add_hook(StragglerHook(settings.straggler_report_period, settings.straggler_threshold, writer,
                                   is_primary), every=1)
