"""Prices a step's schedule (program.Op) for one calibration: the TensorCore runs the ops in
order; asynchronous work (collectives, DCN exchanges, host transfers) starts on its link when
its start is reached, queues behind earlier work on the same link, and costs the TensorCore
only what is left of it when the matching done is reached: that remainder is *exposed*, the
rest was hidden behind the compute scheduled in between. A loop body runs twice and the
steady-state difference is extrapolated to the remaining trips. On more than one slice the step
then waits for the slowest slice: `slice_sync_share` of it per doubling of the slice count."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterable

from MaxText.aot.step_time.network import Calibration
from MaxText.aot.step_time.program import Op


@dataclasses.dataclass
class Prediction:
  step_s: float
  mfu: float
  seconds: dict[str, float]  # compute, kernel, and the exposed part of each link's work by kind and mesh axis
  busy: dict[str, float]  # each link's total work, hidden or not
  top_exposed: list[tuple[str, str, str, float]]  # (what, op, source, exposed seconds), largest first

  def exposed(self, prefix: str) -> float:
    return sum(v for k, v in self.seconds.items() if k.startswith(prefix))


class _State:
  def __init__(self) -> None:
    self.t = 0.0
    self.free: dict[str, float] = {}
    self.pending: dict[str, tuple[float, Op]] = {}
    self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
    self.busy: collections.defaultdict[str, float] = collections.defaultdict(float)
    self.by_op: collections.defaultdict[tuple[str, str, str], float] = collections.defaultdict(float)

  def counters(self) -> tuple[collections.defaultdict[Any, float], ...]:
    return self.seconds, self.busy, self.by_op

  def expose(self, op: Op, wait: float) -> None:
    if wait <= 0:
      return
    label = f"{op.category} over {op.work.axis}" if op.work and op.work.axis else op.category
    self.seconds[label] += wait
    self.by_op[(label, op.name, op.source)] += wait


def _run(ops: Iterable[Op], st: _State, cal: Calibration) -> None:
  for op in ops:
    if op.kind == "compute":
      if op.category == "matmul" and cal.matmul_cost == "compiler":
        seconds = op.cycles_s
      else:
        scale = cal.other_compute_scale if op.category == "other compute" else 1.0
        seconds = op.seconds * scale + (op.work.seconds(cal) if op.work else 0.0)
      st.t += seconds
      st.seconds[op.category] += seconds
    elif op.kind in ("start", "sync") and op.work is not None:
      seconds = op.work.seconds(cal)
      resource = op.work.queue
      begin = max(st.t, st.free.get(resource, 0.0))
      end = begin + seconds
      st.free[resource] = end
      st.busy[op.work.resource] += seconds
      if op.kind == "start":
        st.pending[op.key] = (end, op)
      else:
        st.expose(op, end - st.t)
        st.t = max(st.t, end)
    elif op.kind == "done" and op.key in st.pending:
      end, started = st.pending.pop(op.key)
      st.expose(started, end - st.t)
      st.t = max(st.t, end)
    elif op.kind == "loop":
      _loop(op, st, cal)


def _loop(op: Op, st: _State, cal: Calibration) -> None:
  if op.trips <= 2:
    for _ in range(op.trips):
      _run(op.body, st, cal)
    return
  _run(op.body, st, cal)
  before_t = st.t
  before = [dict(c) for c in st.counters()]
  _run(op.body, st, cal)
  rest = op.trips - 2
  dt = st.t - before_t
  for counter, old in zip(st.counters(), before):
    delta = {k: v - old.get(k, 0.0) for k, v in counter.items()}
    for k, v in delta.items():
      counter[k] += rest * v
  st.t += rest * dt
  for resource, free in st.free.items():
    if free > before_t:
      st.free[resource] = free + rest * dt
  for key, (end, started) in st.pending.items():
    if end > before_t:
      st.pending[key] = (end + rest * dt, started)


SLICE_SYNC = "slice synchronisation"  # not DCN traffic: waiting for the slowest slice


def simulate(program: list[Op], cal: Calibration, model_tflops_per_device: float, peak_tflops: float,
             num_slices: int = 1) -> Prediction:
  st = _State()
  _run(program, st, cal)
  for end, started in st.pending.values():  # started but never waited for: the step ends with it
    st.expose(started, end - st.t)
    st.t = max(st.t, end)
  if num_slices > 1 and cal.slice_sync_share > 0:
    wait = st.t * cal.slice_sync_share * math.log2(num_slices)
    st.seconds[SLICE_SYNC] += wait
    st.by_op[(SLICE_SYNC, "", "")] += wait
    st.t += wait
  mfu = model_tflops_per_device / st.t / peak_tflops if st.t > 0 else 0.0
  largest = sorted(st.by_op.items(), key=lambda kv: -kv[1])[:5]
  top = [(label, name, source, seconds) for (label, name, source), seconds in largest]
  return Prediction(st.t, mfu, dict(st.seconds), dict(st.busy), top)
