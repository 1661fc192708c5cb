"""Run health: the straggler report, the hang watchdog and goodput.

Every process runs the same synchronous steps, so a slow host does not show in its own step
time (everyone waits for it inside the collectives) but in the time it spends on the host side
before it can dispatch: waiting for its own input batch. Every `straggler_report_period` steps
each process's mean step time and input wait over the period are gathered; a process whose input
wait exceeds the median process's by more than `straggler_threshold` x the median step time is
named in the log and counted in the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, ContextManager, Iterator

import numpy as np

from MaxText.training import metrics as metrics_lib
from MaxText.paths import storage
from MaxText.errors import UserError
from MaxText.configuration import elastic_config
from MaxText.configuration.config_groups import RunConfig
from MaxText.training.trainer import TRAIN_STEP, StepRecord, Trainer
from MaxText.training.train_state import TrainState


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
    self._first = 0  # the first step of the period being summed
    self.reported: list[tuple[int, list[int]]] = []  # (step, straggling processes) of each report

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    if not self._count:  # a resumed start's first period begins where it resumed, not at a multiple of period
      self._first = record.step
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
      print(f"warning: stragglers over steps {self._first}..{record.step}: {named}; the median "
            f"process waits {np.median(wait_s):.3f} s for input in a {np.median(step_s):.3f} s step: check "
            "those hosts' input pipelines, disks and CPU load", file=sys.stderr, flush=True)

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    pass


GOODPUT_FILE = "goodput.json"


@dataclasses.dataclass
class StartRecord:
  """One start of the run (a process launch that trained), as goodput.json keeps it."""

  started: float  # unix time the process started
  wall_s: float  # from then to the last step this start finished
  startup_s: float  # until its first step was dispatched (config, compile of init, restore, data)
  compile_s: float  # the first step's time beyond a typical step (tracing and compiling the step)
  data_wait_s: float
  first_step: int  # 1-based steps it ran
  last_step: int
  median_step_s: float  # a typical step, input wait excluded
  # Unix time an elastic supervisor saw the loss or return of a slice that this start was launched for
  # (elastic_config.RESIZE_ENV); None for any other start.
  resize_detected: float | None = None


def _checked(start: StartRecord) -> StartRecord:
  """`start` if its fields have their types: a hand-edited "12" or null would fail the summary's sums only
  at the end of the run, and NaN or Infinity would spread through it."""
  for field in dataclasses.fields(start):
    value = getattr(start, field.name)
    if value is None and field.name == "resize_detected":
      continue
    kinds, what = ((int,), "a whole number") if field.name.endswith("_step") else ((int, float), "a finite number")
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
      raise TypeError(f"{field.name} is {value!r}, not {what}")
  return start


def _resize_s(previous: StartRecord | None, start: StartRecord) -> tuple[float, float]:
  """(the seconds a resize lost before `start`'s first new step, of which outside every start's wall
  time): the stop of the previous start after the detection, the gap until this process started, and
  this start's start-up and compilation."""
  assert start.resize_detected is not None
  previous_end = previous.started + previous.wall_s if previous is not None else start.resize_detected
  stopping = max(0.0, min(previous_end, start.started) - start.resize_detected)
  gap = max(0.0, start.started - max(previous_end, start.resize_detected))
  return stopping + gap + start.startup_s + start.compile_s, gap


def summarize(starts: list[StartRecord]) -> dict[str, float]:
  """Productive time against wall time over all starts. A step counts once: the steps a start ran
  beyond the checkpoint the next start resumed from were redone, and are lost time. A start an
  elastic resize launched counts its start-up and compilation, and the time from the resize's
  detection to its process start, as the resize's (`resize_s`, `resizes`)."""
  totals = dict.fromkeys(("wall_s", "productive_s", "startup_s", "compile_s", "data_wait_s", "redone_s"), 0.0)
  resizes = [k for k, start in enumerate(starts) if start.resize_detected is not None]
  if resizes:
    totals.update(resize_s=0.0, resizes=float(len(resizes)))
  for k, start in enumerate(starts):
    resumed_at = starts[k + 1].first_step - 1 if k + 1 < len(starts) else start.last_step
    redone = max(0, start.last_step - resumed_at)
    steps = start.last_step - start.first_step + 1
    totals["wall_s"] += start.wall_s
    totals["productive_s"] += (steps - redone) * start.median_step_s
    totals["redone_s"] += redone * start.median_step_s
    totals["data_wait_s"] += start.data_wait_s
    if start.resize_detected is None:
      totals["startup_s"] += start.startup_s
      totals["compile_s"] += start.compile_s
      continue
    lost, gap = _resize_s(starts[k - 1] if k > 0 else None, start)
    totals["resize_s"] += lost
    totals["wall_s"] += gap
  accounted = sum(totals.get(n, 0.0) for n in ("productive_s", "startup_s", "compile_s", "data_wait_s", "redone_s",
                                                "resize_s"))
  totals["other_s"] = max(0.0, totals["wall_s"] - accounted)  # checkpoint blocking, evaluation, logging
  totals["goodput"] = totals["productive_s"] / totals["wall_s"] if totals["wall_s"] > 0 else 0.0
  return totals


class GoodputHook:
  """Times this start, keeps it in <run_dir>/goodput.json beside the earlier starts of the same run
  (written every `write_every` steps and at the end, so a killed start leaves its record up to its
  last write), and at the end adds their summary to it (TensorBoard gets it as `goodput/*`) and
  prints the run's goodput. Add with every=1, on process 0."""

  def __init__(self, run_dir: str, process_started: float, start_step: int,
               writer: metrics_lib.MetricWriter | None, write_every: int = 20, resize_detected: float | None = None):
    self.path = storage.join(run_dir, GOODPUT_FILE)
    self.resize_detected = resize_detected
    self.started, self.start_step, self.writer, self.write_every = process_started, start_step, writer, write_every
    if storage.is_dir(self.path):  # every write would fail, the first one after the whole run's last save
      raise UserError(f"{self.path} is a directory, not the run's goodput record: move it aside and rerun")
    self.earlier = self._read_earlier() if storage.exists(self.path) else []
    self.first_dispatch: float | None = None
    self.step_s: list[float] = []  # each step's time, input wait excluded
    self.data_wait_s = 0.0
    self.last_step = start_step

  def _read_earlier(self) -> list[StartRecord]:
    """The earlier starts' records; a file this program did not write whole (its writes are atomic: a
    copy cut short, an edit) costs them, not the run."""
    try:
      return [_checked(StartRecord(**r)) for r in json.loads(storage.read_bytes(self.path).decode("utf-8"))["starts"]]
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
      print(f"warning: {self.path} is unreadable ({type(e).__name__}: {str(e)[:200]}); the goodput figures leave "
            "the earlier starts out and the file is rewritten with this start's", flush=True)
      return []

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    wait = record.scalars.get("input_wait_s", 0.0)
    if self.first_dispatch is None:  # the first step's record: it was dispatched `seconds` ago
      self.first_dispatch = time.time() - record.seconds
    self.step_s.append(max(record.seconds - wait, 0.0))
    self.data_wait_s += wait
    self.last_step = record.step
    if record.step % self.write_every == 0:
      self._write()

  def this_start(self) -> StartRecord | None:
    if self.first_dispatch is None:
      return None
    median = float(np.median(self.step_s[1:])) if len(self.step_s) > 1 else self.step_s[0]
    return StartRecord(started=self.started, wall_s=time.time() - self.started,
                       startup_s=self.first_dispatch - self.started, compile_s=max(0.0, self.step_s[0] - median),
                       data_wait_s=self.data_wait_s, first_step=self.start_step + 1, last_step=self.last_step,
                       median_step_s=median, resize_detected=self.resize_detected)

  def _write(self, final: bool = False) -> tuple[list[StartRecord], dict[str, float] | None]:
    """Writes every start so far and, at the end, their summary (the run's goodput)."""
    mine = self.this_start()
    starts = self.earlier + ([mine] if mine is not None else [])
    record: dict[str, Any] = {"starts": [dataclasses.asdict(s) for s in starts]}
    summary = summarize(starts) if starts and final else None
    if summary is not None:
      record["summary"] = summary
    storage.write_text(self.path, json.dumps(record, indent=1))
    return starts, summary

  def ending(self) -> str:
    return f"writing {GOODPUT_FILE}"

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    starts, t = self._write(final=True)
    if t is None:
      return
    print(f"goodput: {t['goodput']:.1%} of {t['wall_s']:,.0f} s over {len(starts)} start(s): productive "
          f"{t['productive_s']:,.0f} s; lost: start-up {t['startup_s']:,.0f} s, compilation {t['compile_s']:,.0f} s, "
          f"{_resizes(t)}data wait {t['data_wait_s']:,.0f} s, redone steps {t['redone_s']:,.0f} s, other (checkpoints, "
          f"evaluation, logging) {t['other_s']:,.0f} s", flush=True)
    if self.writer is not None:
      self.writer.write_summary(self.last_step, {f"goodput/{name}": value for name, value in t.items()})


def _resizes(totals: dict[str, float]) -> str:
  """The goodput line's resize part, in elastic runs that resized only."""
  if "resize_s" not in totals:
    return ""
  return f"elastic resizes {totals['resize_s']:,.0f} s ({totals['resizes']:.0f}), "


class _StepBoard:
  """Each process's last started (dispatched) step, in the jax.distributed coordination service's key-value
  store (the only channel left when a collective hangs). Single-process runs keep it locally."""

  PREFIX = "maxtext_watchdog/"
  LEAVING = "maxtext_watchdog_leaving/"

  def __init__(self) -> None:
    import jax
    from jax._src import distributed  # the coordination client has no public accessor

    self.process = jax.process_index()
    self.client = distributed.global_state.client if jax.process_count() > 1 else None
    self.local: dict[int, int] = {}

  def set(self, step: int) -> None:
    if self.client is None:
      self.local[self.process] = step
      return
    self.client.key_value_set(f"{self.PREFIX}{self.process}", str(step), allow_overwrite=True)

  def all(self) -> dict[int, int]:
    if self.client is None:
      return dict(self.local)
    return {int(key.rsplit("/", 1)[1]): int(value) for key, value in self.client.key_value_dir_get(self.PREFIX)}

  def leave(self, grace_s: float) -> None:
    """Called by a watchdog that is about to exit. Process 0 hosts the coordination service: if it
    exits first, the other processes' coordination clients abort (SIGABRT) before their own
    watchdogs can name the hang and exit with the restart code. So every process says it is
    leaving, and process 0 waits (at most `grace_s`) for the others to say so too."""
    if self.client is None:
      return
    import jax

    self.client.key_value_set(f"{self.LEAVING}{self.process}", "1", allow_overwrite=True)
    if self.process != 0:
      return
    deadline = time.monotonic() + grace_s
    for other in range(1, jax.process_count()):
      remaining_ms = int((deadline - time.monotonic()) * 1000)
      if remaining_ms <= 0:
        return
      try:
        self.client.blocking_key_value_get(f"{self.LEAVING}{other}", remaining_ms)
      except Exception:  # noqa: BLE001 - a process that is gone or stuck for good does not hold us
        return
    time.sleep(1.0)  # their exit calls run after they set the key


_ACTIVITY: list[str] = []  # what the main thread is inside (innermost last), for the watchdog's line


@contextlib.contextmanager
def activity(what: str) -> Iterator[None]:
  """Marks a stretch of the loop that runs the user's code (a reward function), so a watchdog that
  fires inside it names it."""
  _ACTIVITY.append(what)
  try:
    yield
  finally:
    _ACTIVITY.pop()


Guard = Callable[[str], ContextManager[None]]  # StepWatchdog.guard, or `unguarded` without a watchdog


@contextlib.contextmanager
def unguarded(what: str) -> Iterator[None]:
  yield


def _in_activity() -> str | None:
  current = list(_ACTIVITY)
  return current[-1] if current else None


# Where JAX traces, lowers and compiles a function (XLA's own compilation runs under compiler.py's frames). A
# thread with one of these on its stack is compiling, which is no hang however long it takes: a call compiles
# whenever it meets a new shape (a GRPO rollout's first prompt of a longer bucket, an environment's first turn),
# not only at the first step, where the trainer can say so.
_COMPILING_FILES = ("/jax/_src/compiler.py", "/jax/_src/interpreters/mlir.py", "/jax/_src/interpreters/partial_eval.py")


def compiling_thread() -> str | None:
  """The name of a thread that is tracing, lowering or compiling a JAX function now, or None."""
  names = {t.ident: t.name for t in threading.enumerate()}
  for ident, frame in sys._current_frames().items():
    inner: Any = frame
    while inner is not None:
      if inner.f_code.co_filename.replace(os.sep, "/").endswith(_COMPILING_FILES):
        return names.get(ident, str(ident))
      inner = inner.f_back
  return None


def _print_stacks() -> None:
  """Every thread's Python stack, named, on stderr (faulthandler needs a real file descriptor)."""
  names = {t.ident: t.name for t in threading.enumerate()}
  for ident, frame in sys._current_frames().items():
    stack = "".join(traceback.format_stack(frame))
    print(f"--- thread {names.get(ident, ident)} (most recent call last):\n{stack}", file=sys.stderr, end="")
  sys.stderr.flush()


class StepWatchdog:
  """Ends a run whose next step does not finish within `timeout_s` (a hang inside a collective, a
  stuck host): prints every thread's Python stack, names the processes that did not reach the step
  the others are waiting in, and exits with EXIT_CODE so the scheduler restarts the job, which
  resumes from its last checkpoint. Armed once the first step is dispatched (compiling it is not a
  hang; nor is compiling the first evaluation, inside `compiling`, nor any compilation that the
  deadline finds in progress) and, before it, inside `guard`
  (the first batch: a reward function or a reader that never returns); after the last step, through
  the other hooks' ends (the last checkpoint save), which the trainer runs inside `guard`. Add with
  every=0 (its `due` records each dispatch) on every process, and set it as the trainer's `watchdog`."""

  EXIT_CODE = 4

  def __init__(self, timeout_s: float, exit: Callable[[int], None] = os._exit):
    self.timeout_s, self._exit = timeout_s, exit
    self.board = _StepBoard()
    self._petted = threading.Event()
    self._armed = threading.Event()
    self._stopped = threading.Event()
    self._thread: threading.Thread | None = None
    self._guarding: str | None = None  # what `guard` watches, while it does
    self.trainer: Trainer | None = None  # its `activity` names what hangs outside the step (a checkpoint save)
    self.last_step = 0

  def due(self, step: int) -> bool:
    """Asked right after step `step` is dispatched: this process reached it. The first dispatch
    arms the watchdog: the step is compiled by then, and what follows before its on_step (its run,
    the next batch: for GRPO the next rollout with its reward functions) can hang."""
    self.board.set(step)
    if not self._armed.is_set():
      self.last_step = step - 1
      self._start()
      self._armed.set()
      self._petted.set()
    return True

  @contextlib.contextmanager
  def guard(self, what: str) -> Iterator[None]:
    """Fires when the block (`what`, e.g. "the first rollout", or the end of a hook: "the final
    checkpoint save at step N") does not finish within timeout_s; disarmed again after it, until the
    first step finishes."""
    self._guarding = what
    self._start()
    self._armed.set()
    self._petted.set()
    try:
      yield
    finally:
      self._armed.clear()
      self._guarding = None
      self._petted.set()

  @contextlib.contextmanager
  def compiling(self) -> Iterator[None]:
    """A block that compiles (a hook's first call of its jitted step: the first evaluation's), which
    is no hang, as the first train step's compilation is none: no deadline inside it, and the whole
    timeout again after it."""
    was_armed = self._armed.is_set()
    self._armed.clear()
    self._petted.set()  # wakes the watching thread, which then waits for the arming
    try:
      yield
    finally:
      if was_armed:
        self._armed.set()
        self._petted.set()

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    self.last_step = record.step
    self._start()
    self._armed.set()
    self._petted.set()

  def _start(self) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
      self._thread.start()

  def _watch(self) -> None:
    while not self._stopped.is_set():
      self._armed.wait()  # unarmed: no deadline (compiling the first step)
      if self._petted.wait(self.timeout_s):
        self._petted.clear()
        continue
      if self._armed.is_set() and not self._stopped.is_set():
        if self._waited_out_a_compilation():
          continue
        self._fire()
        return

  def _waited_out_a_compilation(self) -> bool:
    """At the deadline: when a thread is compiling, waits until none is (or a step finishes), then the
    whole timeout again, as after the first step's compilation; False when nothing compiles."""
    thread = compiling_thread()
    if thread is None:
      return False
    print(f"note: step_timeout_seconds={self.timeout_s:g} passed while thread {thread} compiles a JAX function, which "
          "is no hang: the watchdog waits for the compilation, then the whole timeout again", file=sys.stderr,
          flush=True)
    poll = min(1.0, self.timeout_s)
    while not self._stopped.is_set() and not self._petted.wait(poll) and compiling_thread() is not None:
      pass
    return True

  def _fire(self) -> None:
    _print_stacks()
    doing = _in_activity() or self._loop_activity()
    if self._guarding is not None:
      inside = f" (in {doing})" if doing and doing != self._guarding else ""
      print(f"error: {self._guarding} did not finish in step_timeout_seconds={self.timeout_s:g}{inside}; Python "
            f"stacks above. Exiting with status {self.EXIT_CODE} so the job restarts", file=sys.stderr, flush=True)
      self._leave()
      return
    try:
      steps = self.board.all()
    except Exception as e:  # noqa: BLE001 - the coordination service may be what is broken
      steps, unreachable = {}, f" (the other processes' progress is unknown: {type(e).__name__})"
    else:
      unreachable = ""
    ahead = max(steps.values(), default=self.last_step)
    behind = sorted(p for p, s in steps.items() if s < ahead)
    where = (f"process(es) {', '.join(map(str, behind))} did not reach step {ahead} "
             f"({', '.join(f'process {p} started step {steps[p]} last' for p in behind)})" if behind
             else f"every process started step {ahead}" + ("" if doing else ", and it did not finish"))
    inside = f"; this process is in {doing}" if doing else ""
    print(f"error: no step finished in step_timeout_seconds={self.timeout_s:g} after step {self.last_step} on "
          f"this process; {where}{unreachable}{inside}; Python stacks above. Exiting with status {self.EXIT_CODE} so "
          "the job restarts and resumes from its last checkpoint", file=sys.stderr, flush=True)
    self._leave()

  def _loop_activity(self) -> str | None:
    """What the loop is in beyond the step (a checkpoint save, reading a batch), or None."""
    trainer_activity = self.trainer.activity if self.trainer is not None else TRAIN_STEP
    return None if trainer_activity == TRAIN_STEP else trainer_activity

  def _leave(self) -> None:
    try:
      self.board.leave(grace_s=min(30.0, self.timeout_s))
    except Exception:  # noqa: BLE001 - exiting with the restart code matters more than an orderly exit
      pass
    self._exit(self.EXIT_CODE)

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    """The trainer ends the watchdog after every other hook (trainer.watchdog), guarding each of
    their ends with `guard`: the checkpoint hook's waits for the last (async) save."""
    self._stopped.set()
    self._armed.set()
    self._petted.set()


def warn_if_spikes_never_checked(settings: RunConfig, start_step: int) -> None:
  """The spike limit needs loss_spike_window applied steps of this start, and lags a step behind the one
  it is passed to: a start shorter than that would run with loss_spike_threshold set and check nothing."""
  steps, window = settings.steps - start_step, settings.loss_spike_window
  if settings.loss_spike_threshold > 0 and steps < window + 2:
    advice = f"set loss_spike_window to at most {steps - 2}" if steps >= 4 else "no window (at least 2) fits"
    print(f"warning: loss_spike_threshold={settings.loss_spike_threshold:g} checks nothing in this start: its "
          f"{steps} step(s) are too few to fill loss_spike_window={window} first (the first step it checks is "
          f"this start's step {window + 2}); {advice}", file=sys.stderr, flush=True)


def add_health_hooks(trainer: Trainer, settings: RunConfig, writer: metrics_lib.MetricWriter | None,
                     is_primary: bool, num_processes: int, process_started: float, start_step: int,
                     watchdog: StepWatchdog | None = None) -> None:
  """`watchdog`: the one that guarded the first batch (train.py), else one is made here."""
  if is_primary:
    warn_if_spikes_never_checked(settings, start_step)
  if settings.straggler_report_period > 0 and num_processes > 1:
    trainer.add_hook(StragglerHook(settings.straggler_report_period, settings.straggler_threshold, writer,
                                   is_primary), every=1)
  if settings.step_timeout_seconds > 0:
    watchdog = watchdog or StepWatchdog(settings.step_timeout_seconds)
    watchdog.trainer, trainer.watchdog = trainer, watchdog  # the trainer ends it last: it watches the hooks' ends
    trainer.add_hook(watchdog, every=0)
  if is_primary:
    trainer.add_hook(GoodputHook(settings.run_dir, process_started, start_step, writer,
                                 resize_detected=elastic_config.resize_detected(os.environ)), every=1)
