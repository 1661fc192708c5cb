"""The training loop and its hooks.

The loop dispatches step t before it reads step t-1's metrics, so the host never
stalls the device on logging. Side effects (printing, metric files, evaluation)
are hooks; the jitted step stays pure.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping, Protocol, runtime_checkable

import jax
import numpy as np

from MaxText.training import metrics as metrics_lib
from MaxText.configuration.config import Config
from MaxText.run_dir.checkpointing import RunCheckpoints
from MaxText.run_dir.preemption import PreemptionWatcher
from MaxText.run_dir.run_lease import Lease
from MaxText.paths import storage, storage_retry
from MaxText.errors import TrainingError
from MaxText.training.train_state import TrainState


@dataclasses.dataclass
class StepRecord:
  """Host-side metrics of one finished step."""

  step: int  # 1-based: the number of optimizer steps done after it
  seconds: float
  scalars: dict[str, float]
  nonfinite: bool = False  # its loss or gradient norm was NaN/inf: the state after it is never saved


class ResumableBatches(Protocol):
  """The data iterators of input_pipeline: global batches plus a checkpointable position."""

  def __next__(self) -> Any: ...

  def get_state(self) -> Any: ...


class RestartableBatches(Protocol):
  """Eval batches that start again from the first at each evaluation."""

  def reset(self) -> Iterator[Any]: ...


@runtime_checkable
class ReportsDataMetrics(Protocol):
  """Batches with host-side scalars of their own for the step's metrics (a mixture's tokens per source)."""

  def host_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class OnPolicyBatches(Protocol):
  """Batches made from the parameters about to be trained (rl/rollouts.py): the loop hands each
  step's starting state over and gets the batch with host-side scalars for the step's metrics."""

  def next_for(self, state: TrainState) -> tuple[Any, dict[str, float]]: ...

  def prime(self, state: TrainState, guard: Callable[[str], ContextManager[None]] | None = None) -> None:
    """Makes the first batch now (the run checks its data before it writes anything); the part that
    runs the user's code inside `guard(what)` (the hang watchdog's, when there is one)."""
    ...

  def get_state(self) -> Any: ...


class LossSpikeLimit:
  """The loss above which a step counts as a spike (loss_spike_threshold): the mean of the last
  `window` applied steps' losses plus `threshold` standard deviations; +inf until the window is full.

  Host-side, from losses the loop reads anyway: the step gets the limit as an argument and
  decides on the device, so a spike is never applied and nothing waits. The limit lags one step
  (the loop reads step t-1's loss after dispatching step t), which the statistics of a window
  do not notice."""

  def __init__(self, threshold: float, window: int):
    self.threshold = threshold
    self.losses: collections.deque[float] = collections.deque(maxlen=window)

  def limit(self) -> float:
    if len(self.losses) < (self.losses.maxlen or 0):
      return math.inf
    values = np.asarray(self.losses, np.float64)
    return float(values.mean() + self.threshold * values.std())

  def add(self, loss: float) -> None:
    self.losses.append(loss)

  def describe(self) -> str:
    return f"mean + {self.threshold:g} standard deviations of the last {self.losses.maxlen} applied steps"


class Hook(Protocol):
  """A side effect of the loop. The Trainer owns the cadence (`add_hook(hook, every=N)`) and
  calls on_step only at the steps it is due."""

  def on_step(self, trainer: "Trainer", record: StepRecord, state: TrainState | None) -> None: ...

  def on_end(self, trainer: "Trainer", state: TrainState | None) -> None: ...


class ScheduledHook(Hook, Protocol):
  """A hook whose steps are not a fixed period (checkpoint: period, SIGTERM, last step; profiler:
  the two ends of the trace). `due` is asked exactly once per step, right after it is dispatched."""

  def due(self, step: int) -> bool: ...


class Watchdog(Hook, Protocol):
  """The hang watchdog (health.StepWatchdog) as the loop sees it: the trainer ends it after every
  other hook, running their ends inside its `guard` (the checkpoint hook's waits for the last async
  save, which can hang on a disk that stops answering), and a hook compiles its step (the first
  evaluation) inside its `compiling`."""

  def guard(self, what: str) -> ContextManager[None]: ...

  def compiling(self) -> ContextManager[None]: ...


def _ending(hook: Hook) -> str:
  """What a hook's end does, for the watchdog's line should it hang (a hook's `ending()` says)."""
  ending = getattr(hook, "ending", None)
  try:
    return str(ending()) if callable(ending) else f"the end of {getattr(hook, 'activity', type(hook).__name__)}"
  except Exception:  # noqa: BLE001 - a name must not keep the hook from ending
    return f"the end of {type(hook).__name__}"


@dataclasses.dataclass
class _Entry:
  hook: Hook
  every: int  # 0: the hook's own `due`
  needs_state: bool  # on_step must see the state right after its step (the loop waits for it)

  def due(self, step: int) -> bool:
    return self.hook.due(step) if self.every == 0 else step % self.every == 0  # type: ignore[attr-defined]


@dataclasses.dataclass
class LoopState:
  """What the loop carries between iterations (instead of a long tuple)."""

  state: TrainState
  next_step: int  # 0-based index of the next step to dispatch
  # Dispatched, not yet read: (step index, device metrics, the hooks due at that step).
  pending: tuple[int, dict[str, jax.Array | float], list[_Entry]] | None = None
  last_done: float = dataclasses.field(default_factory=time.perf_counter)
  # The first and the latest finished step of this start (every step's metrics go to the hooks;
  # keeping them all here would grow without bound on a long run).
  first: StepRecord | None = None
  last: StepRecord | None = None


TRAIN_STEP = "the train step"  # Trainer.activity outside the hooks and the rollouts


class Trainer:
  def __init__(self, config: Config, train_step: Callable[..., Any], data: ResumableBatches, rng: jax.Array,
               flops: metrics_lib.StepFlops, peak_tflops_per_device: float):
    self.config, self.train_step, self.data, self.rng = config, train_step, data, rng
    self.flops, self.peak = flops, peak_tflops_per_device
    self._entries: list[_Entry] = []
    self.tokens_per_step = config.data.global_batch_size * config.data.max_target_length
    self.stop_reason: str | None = None  # a hook sets it to end the run after the current step
    self.skipped_steps: list[int] = []  # steps whose update was not applied (non-finite, or a loss spike)
    self.skipped_in_a_row = 0
    self.nonfinite_since: int | None = None  # the first non-finite step since the last applied one
    self.nonfinite_in_a_row = 0  # of the skipped_in_a_row, those that were non-finite (the rest were spikes)
    # What to do about a run stopped by non-finite steps, given the first of them (train.py names
    # the checkpoint to go back to and the command).
    self.advise_nonfinite: Callable[[int], str] = \
        lambda first: "lower learning_rate, enable gradient_clipping_threshold, or check the data"
    run = config.run
    self.spike_limit = LossSpikeLimit(run.loss_spike_threshold, run.loss_spike_window) \
        if run.loss_spike_threshold > 0 else None
    self._batch_starts: dict[int, str] = {}  # step index -> where its batch starts in the data (for messages)
    # Steps of this start whose metrics were read: 0 while the first is compiled, dispatched or running.
    self.steps_finished = 0
    # What the loop is doing (still named after it failed): a message's "in ..." for an error from the devices.
    self.activity = TRAIN_STEP
    self.watchdog: Watchdog | None = None  # the hang watchdog, one of the hooks (health.add_health_hooks)

  def add_hook(self, hook: Hook, every: int = 1, needs_state: bool = False) -> None:
    """Runs `hook.on_step` after every `every`-th step; every=0: at the steps `hook.due` names."""
    if every < 0:
      raise ValueError(f"every must be >= 0, got {every}")
    if every == 0 and not hasattr(hook, "due"):
      raise TypeError(f"{type(hook).__name__} has no due(step): give it a period (every=N)")
    self._entries.append(_Entry(hook, every, needs_state))

  @property
  def hooks(self) -> list[Hook]:
    return [entry.hook for entry in self._entries]

  def compiling(self) -> ContextManager[None]:
    """Around a hook's first call of its jitted step (the evaluation's): its compilation is no hang
    for the watchdog, as the first train step's is none."""
    return self.watchdog.compiling() if self.watchdog is not None else contextlib.nullcontext()

  def _finish(self, loop: LoopState, state: TrainState | None) -> None:
    """Waits for the pending step's metrics, checks them and runs the hooks."""
    assert loop.pending is not None
    index, device_metrics, due = loop.pending
    loop.pending = None
    scalars = metrics_lib.host_scalars(jax.device_get(device_metrics))
    self.steps_finished += 1  # before the hooks: an eval step's failure is not the train step's
    now = time.perf_counter()
    seconds, loop.last_done = now - loop.last_done, now
    nonfinite = self._check_step(index + 1, scalars, self._batch_starts.pop(index, ""))
    t = metrics_lib.throughput(seconds, scalars["num_tokens"], self.flops, self.config.mesh.num_devices, self.peak)
    scalars.update(step_seconds=seconds, tokens_per_s=t.tokens_per_s, tokens_per_s_per_device=t.tokens_per_s_per_device,
                   tflops_per_s_per_device=t.tflops_per_s_per_device, mfu=t.mfu)
    if isinstance(self.data, OnPolicyBatches):  # the step's time but its rollout: the update
      scalars["update_s"] = max(seconds - scalars["input_wait_s"], 0.0)
    record = StepRecord(index + 1, seconds, scalars, nonfinite)
    loop.first, loop.last = loop.first or record, record
    for entry in due:
      self.activity = f"{getattr(entry.hook, 'activity', type(entry.hook).__name__)} at step {record.step}"
      entry.hook.on_step(self, record, state if entry.needs_state else None)
    self.activity = TRAIN_STEP

  def _check_step(self, step: int, scalars: dict[str, float], batch_start: str) -> bool:
    """A skipped step (non-finite with skip_nonfinite_steps, or a loss spike) was not applied: say
    which batch it was and go on, unless it is the max_consecutive_skipped_steps-th in a row. A
    non-finite step that was applied (skip_nonfinite_steps=False) ends the run. Returns whether
    the step was non-finite."""
    loss = scalars["loss"]
    finite = math.isfinite(loss) and math.isfinite(scalars["grad_norm"])
    if not finite and self.nonfinite_since is None:
      self.nonfinite_since = step
    self.nonfinite_in_a_row += not finite
    if not scalars.get("skipped", 0.0):
      if not finite:
        raise TrainingError(f"loss became {loss} at step {step} (grad_norm {scalars['grad_norm']:.3g}); "
                            f"{self.advise_nonfinite(step)}")
      self.skipped_in_a_row = self.nonfinite_in_a_row = 0
      self.nonfinite_since = None
      if scalars.get("num_tokens", 1.0) == 0:
        # The loss is a mean over no tokens: reported as 0, it is no measurement, and in the spike window it
        # would move the limit (a stable loss then reads as a spike).
        where = f" ({batch_start})" if batch_start else ""
        print(f"warning: step {step}'s batch{where} has no target tokens (every target weight is 0: rows of padding, "
              "or SFT rows with no assistant token): its loss 0 is not a measurement and its gradient was 0 (the "
              "weights moved by the optimizer's momentum and weight decay alone); check the data if this repeats",
              file=sys.stderr, flush=True)
      elif self.spike_limit is not None:
        self.spike_limit.add(loss)
      return False
    self.skipped_in_a_row += 1
    self.skipped_steps.append(step)
    if finite:
      assert self.spike_limit is not None
      kind, what = "a loss spike", (f"loss {loss:.4g} > {scalars['loss_limit']:.4g}, the "
                                    f"{self.spike_limit.describe()}")
      advice = "if the loss moved for good, raise loss_spike_threshold; otherwise check the data"
    else:
      kind, what = "non-finite", f"loss {loss}, grad_norm {scalars['grad_norm']:.3g}"
    limit = self.config.run.max_consecutive_skipped_steps
    if self.skipped_in_a_row >= limit:
      # A streak with a non-finite step in it is a diverged model whatever its last step was.
      nonfinite, spikes = self.nonfinite_in_a_row, self.skipped_in_a_row - self.nonfinite_in_a_row
      were = "spikes" if not nonfinite else "non-finite" if not spikes else \
          f"skipped ({nonfinite} non-finite, {spikes} spikes)"
      if nonfinite:
        advice = self.advise_nonfinite(self.nonfinite_since or step)
      raise TrainingError(f"{limit} steps in a row were {were}, up to step {step} ({what}); "
                          f"the model, not one batch, is broken: {advice}")
    where = f" ({batch_start})" if batch_start else ""
    print(f"warning: step {step} was {kind} ({what}): its update was not applied and its batch{where} is skipped "
          f"({self.skipped_in_a_row} in a row, {len(self.skipped_steps)} in this run)", file=sys.stderr, flush=True)
    return not finite

  def run(self, state: TrainState, start_step: int = 0) -> LoopState:
    """Runs steps start_step..steps-1; returns the loop state (first and last step records)."""
    loop = LoopState(state=state, next_step=start_step)
    try:
      while loop.next_step < self.config.run.steps:
        if isinstance(self.data, OnPolicyBatches):  # sampled from the state the previous step writes:
          jax.block_until_ready(loop.state.params)  # its update is not input wait
        waited_from = time.perf_counter()
        self._note_batch_start(loop.next_step)
        if isinstance(self.data, OnPolicyBatches):
          self.activity = f"the rollout for step {loop.next_step + 1}"
          batch, host_scalars = self.data.next_for(loop.state)
          self.activity = TRAIN_STEP
        else:
          self.activity = f"reading the batch of step {loop.next_step + 1}"  # a reader that hangs is named
          batch = next(self.data)
          self.activity = TRAIN_STEP
          host_scalars = self.data.host_metrics() if isinstance(self.data, ReportsDataMetrics) else {}
        input_wait_s = time.perf_counter() - waited_from  # > 0 means the input pipeline is the bottleneck
        if self.spike_limit is None:
          loop.state, device_metrics = self.train_step(loop.state, batch, self.rng)
        else:
          loop.state, device_metrics = self.train_step(loop.state, batch, self.rng,
                                                       np.float32(self.spike_limit.limit()))
        if loop.pending is not None:
          self._finish(loop, None)  # the state after that step was donated to this one
        loop.next_step += 1
        due = [entry for entry in self._entries if entry.due(loop.next_step)]  # each asked once
        loop.pending = (loop.next_step - 1, {**device_metrics, **host_scalars, "input_wait_s": input_wait_s}, due)
        if any(entry.needs_state for entry in due):
          self._finish(loop, loop.state)
        if self.stop_reason is not None:
          break
      if loop.pending is not None:
        self._finish(loop, loop.state)
    except BaseException as e:
      if isinstance(e, KeyboardInterrupt):
        done = loop.last.step if loop.last else start_step
        print(f"stopped by Ctrl-C after step {done}", flush=True)
      self._end_hooks(loop, failing=True)
      raise
    self._end_hooks(loop, failing=False)
    return loop

  def _note_batch_start(self, index: int) -> None:
    """Where step `index`'s batch starts, while the loop may still skip it (iterators that can say)."""
    describe = getattr(self.data, "describe_next_position", None)
    if describe is not None and (self.config.run.skip_nonfinite_steps or self.spike_limit is not None):
      self._batch_starts[index] = describe()

  def _end_hooks(self, loop: LoopState, failing: bool) -> None:
    """Every hook's on_end runs; while an error is already on its way out, a hook's own failure
    (e.g. the same broken storage) is reported in one line instead of replacing it. Otherwise the first
    failure is raised once the later hooks have ended too: the checkpoint hook's end waits for the last
    save, which an exit before it loses.

    The hang watchdog ends last: every other hook's end runs inside its `guard`, so one that hangs
    (the last save, to a local disk or NFS mount that stopped answering) prints the stacks and exits
    with the watchdog's status, as a hang in a step does, instead of hanging the process for good."""
    first_failure: Exception | None = None
    watchdog = self.watchdog if any(hook is self.watchdog for hook in self.hooks) else None
    hooks = [hook for hook in self.hooks if hook is not watchdog] + ([watchdog] if watchdog is not None else [])
    activity = self.activity  # what failed, for the caller's message
    try:
      for hook in hooks:
        what = _ending(hook)
        self.activity = what
        try:
          with watchdog.guard(what) if watchdog is not None and hook is not watchdog else contextlib.nullcontext():
            hook.on_end(self, loop.state)
        except Exception as e:  # noqa: BLE001
          if not failing and first_failure is None:
            first_failure = e
            continue
          if isinstance(e, storage_retry.StorageUnavailable):
            continue  # the same unreachable storage: the error line says it once
          print(f"warning: while stopping, {type(hook).__name__} failed too: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300], file=sys.stderr, flush=True)
    finally:
      self.activity = activity
    if first_failure is not None:
      raise first_failure


class LeaseHook:
  """Stops the run (before it writes anything more) once another run took its lease over."""

  def __init__(self, lease: Lease):
    self.lease = lease

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    self.lease.check()

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    pass


class LoggingHook:
  """Prints one line per due step (every log_period) and writes every scalar to JSONL/TensorBoard."""

  def __init__(self, writer: metrics_lib.MetricWriter | None, is_primary: bool):
    self.writer, self.is_primary = writer, is_primary

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    if not self.is_primary:
      return
    s = record.scalars
    t = metrics_lib.Throughput(s["tokens_per_s"], s["tokens_per_s_per_device"], s["tflops_per_s_per_device"], s["mfu"])
    if self.writer is not None:  # files first: a reader of stdout may act on the line at once
      self.writer.write(record.step, s)
    line = metrics_lib.format_step_line(record.step, s["loss"], record.seconds, t)
    if "reward" in s:  # an RL run's loss is near 0 by construction; its progress is the reward
      line += f" | reward {s['reward']:.4f}"
    print(line, flush=True)

  def ending(self) -> str:
    return "closing the metric files"

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    if self.writer is not None:
      self.writer.close()


class RouterHealthHook:
  """Warns, naming the layer, when a MoE router sends more than `fraction` of the tokens to one
  expert (and at least twice that expert's even share) in `logs` metric logs in a row: the sign
  of a collapsed router, which the load-balancing loss should have prevented."""

  def __init__(self, fraction: float, logs: int, even_share: float):
    self.fraction, self.logs, self.even_share = fraction, logs, even_share
    self.streaks: dict[str, int] = {}

  def on_step(self, trainer: "Trainer", record: StepRecord, state: TrainState | None) -> None:
    for name, load in record.scalars.items():
      if not name.startswith("moe_load_max/"):
        continue
      layer = name.split("/", 1)[1]
      collapsed = load > self.fraction and load >= 2 * self.even_share
      self.streaks[layer] = self.streaks.get(layer, 0) + 1 if collapsed else 0
      if self.streaks[layer] == self.logs:
        print(f"warning: MoE router of {layer.replace('_', ' ')} sent {load:.0%} of the tokens to one expert "
              f"(even share {self.even_share:.0%}) in {self.logs} logs in a row up to step {record.step}; it may "
              "have collapsed: raise load_balance_loss_weight or lower learning_rate", file=sys.stderr, flush=True)

  def on_end(self, trainer: "Trainer", state: TrainState | None) -> None:
    pass


class EvalHook:
  """The objective's eval metrics (e.g. mean loss and perplexity; DPO's loss and rewards per
  preference pair) over `eval_steps` eval batches at each due step (needs the state)."""

  activity = "the evaluation"

  def __init__(self, eval_step: Callable[..., Any], eval_data: RestartableBatches, eval_steps: int,
               writer: metrics_lib.MetricWriter | None, is_primary: bool,
               summarise: Callable[[Mapping[str, float]], tuple[dict[str, float], str]]):
    """`eval_data` has `reset()`, so every evaluation sees the same batches; `summarise`: the
    objective's eval_metrics, from the summed scalars to (scalars, the log line's text)."""
    self.eval_step, self.eval_data, self.eval_steps = eval_step, eval_data, eval_steps
    self.writer, self.is_primary, self.summarise = writer, is_primary, summarise
    self._compiled = False  # the eval step's first call (this start's first evaluation) compiles it

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    assert state is not None, "add EvalHook with needs_state=True"
    data = self.eval_data.reset()
    totals: dict[str, float] = {}
    for _ in range(self.eval_steps):
      batch = next(data)  # reading it is watched
      # The first call's dispatch compiles the eval step, which is no hang for the watchdog (as the
      # first train step's is none); running it is watched again.
      compiling = getattr(trainer, "compiling", contextlib.nullcontext)  # a bare call (tests) has no trainer
      with contextlib.nullcontext() if self._compiled else compiling():
        pending = self.eval_step(state, batch)
      self._compiled = True
      sums = jax.device_get(pending)
      for name, value in sums.items():
        if np.ndim(value) == 0:
          totals[name] = totals.get(name, 0.0) + float(value)
    if totals.get("weight_sum", 1.0) == 0:
      # Every objective's means divide by at least 1: over no tokens they read as a perfect score (loss 0).
      if self.is_primary:
        print(f"warning: the evaluation at step {record.step} had no target tokens in its {self.eval_steps} batches "
              "(every target weight 0); it reports nothing: check the eval data",
              file=sys.stderr, flush=True)
      return
    scalars, line = self.summarise(totals)
    if self.is_primary:
      print(f"eval   {record.step:>6d} | {line}", flush=True)
      if self.writer is not None:
        self.writer.write(record.step, scalars)

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    pass


class CheckpointHook:
  """Saves the train state and data position every `checkpoint_period` steps, after the last
  step, and at the first step boundary after SIGTERM (then asks the loop to stop); with a local
  tier, also every `local_checkpoint_period` steps to each host's own disk.

  The state after a non-finite step is never saved: its parameters have just given NaN/inf, and
  a rerun would resume them and stop again whatever the learning rate. A periodic save due then
  waits for the next finite step."""

  activity = "the checkpoint save"

  def __init__(self, checkpoints: RunCheckpoints, period: int, last_step: int, preemption: PreemptionWatcher, rng: jax.Array,
               before_save: Callable[[], None] = lambda: None, meta: dict[str, Any] | None = None,
               grow_back: Callable[[], bool] | None = None):
    """`before_save` runs before every save (the metric writer's sync: a resumed run keeps
    the metric lines up to its checkpoint, so they must be durable first); `meta` is saved
    with every step (the run's resume keys); `grow_back` (an elastic run with a local tier) says
    whether a SIGTERM is the supervisor's grow-back stop, whose step then goes to the local tier
    only (collective)."""
    self.checkpoints, self.period, self.last_step, self.preemption = checkpoints, period, last_step, preemption
    self.before_save, self.grow_back = before_save, grow_back
    self.meta = {**(meta or {}), "rng_key_data": np.asarray(jax.random.key_data(rng)).tolist()}
    self._preempted_at: int | None = None
    self._deferred = False  # a periodic save skipped at a non-finite step, made at the next finite one

  def due(self, step: int) -> bool:
    # JAX's multi-process sync point (preemption.reached) must be queried exactly once per
    # step, which the Trainer guarantees for `due`.
    if self._preempted_at is None and self.preemption.reached(step):
      self._preempted_at = step
    return self._persistent(step) or self.checkpoints.local_due(step)

  def _persistent(self, step: int) -> bool:
    return step % self.period == 0 or self._preempted_at == step or step == self.last_step or self._deferred

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    assert state is not None, "add CheckpointHook with needs_state=True"
    persistent = self._persistent(record.step)
    if record.nonfinite:
      self._skip_nonfinite(trainer, record.step, persistent)
      return
    self._deferred = False
    meta = {**self.meta, "step": record.step}
    self.before_save()
    if self._preempted_at == record.step and self._stop_to_local_tier(record.step):
      self.checkpoints.save_local(record.step, state, trainer.data.get_state(), meta)
      self.checkpoints.wait_local()
      trainer.stop_reason = (f"SIGTERM to grow the elastic job back: saved step {record.step} to the local tier, "
                             "which the returning processes are handed")
      return
    if not persistent:  # a local-tier step only
      self.checkpoints.save_local(record.step, state, trainer.data.get_state(), meta)
      return
    if self.checkpoints.last_saved_step != record.step:
      self.checkpoints.save(record.step, state, trainer.data.get_state(), meta)
    if self._preempted_at == record.step:
      self.checkpoints.wait(record.step)
      trainer.stop_reason = f"SIGTERM: saved step {record.step} to {self.checkpoints.directory}"

  def _stop_to_local_tier(self, step: int) -> bool:
    """A grow-back stop at a step no period saves persistently (the same answer on every process)."""
    regular = step % self.period == 0 or step == self.last_step
    return self.grow_back is not None and self.checkpoints.local is not None and not regular and self.grow_back()

  def _skip_nonfinite(self, trainer: Trainer, step: int, persistent: bool) -> None:
    if not persistent:
      return
    newest = self.checkpoints.last_saved_step
    kept = f"the newest checkpoint is step {newest}" if newest is not None else "there is no checkpoint yet"
    if self._preempted_at == step:
      trainer.stop_reason = f"SIGTERM at step {step}, which was non-finite and is not saved ({kept})"
      return
    if self._deferred and step != self.last_step:
      return  # said at the step the save was due
    self._deferred = step != self.last_step
    later = "the save waits for the next finite step" if self._deferred else "the run ends without saving it"
    print(f"warning: step {step} is not saved: it was non-finite, its parameters give NaN/inf ({kept}); {later}",
          file=sys.stderr, flush=True)

  def ending(self) -> str:
    """The hang watchdog's name for this hook's end, which waits for the last (async) save."""
    step = self.checkpoints.unfinished_step
    return f"the final checkpoint save at step {step}" if step is not None else "closing the checkpoints"

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    self.preemption.close()
    self.checkpoints.close()


class ProfilerHook:
  """Captures a jax.profiler (xplane) trace of steps first+1 .. first+num_steps into `directory`.
  `clean` (profile_cleanly): add it with needs_state=True, so the loop waits for the step at both
  ends and the trace holds exactly those steps; otherwise the trace starts and stops when the loop
  reads those steps' metrics, while the next step is already running, and the loop never waits."""

  def __init__(self, directory: str, first: int, num_steps: int, active: bool, clean: bool = True):
    self.directory, self.first, self.last, self.active = directory, first, first + num_steps, active
    self.clean = clean
    self.tracing = False
    self._staging: tempfile.TemporaryDirectory[str] | None = None
    if active and first == 0:
      self._start()

  def _start(self) -> None:
    # The profiler writes through the C++ file layer, which knows local disk only: a gs://
    # trace is written to a local folder first and copied up when it stops.
    if storage.is_remote(self.directory):
      self._staging = tempfile.TemporaryDirectory(prefix="maxtext-profile-")
    jax.profiler.start_trace(self._staging.name if self._staging else self.directory)
    self.tracing = True

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self.tracing = False
    if self._staging is not None:
      storage.copy_tree(self._staging.name, self.directory)
      self._staging.cleanup()
      self._staging = None
    steps = (f"steps {self.first + 1}..{self.last}" if self.clean else
             f"part of step {self.first + 1} to part of step {self.last + 1} (profile_cleanly=False)")
    print(f"profile: {steps} traced into {self.directory} (open with TensorBoard's profile plugin or Perfetto)",
          flush=True)

  def due(self, step: int) -> bool:
    return self.active and step in (self.first, self.last)

  def on_step(self, trainer: Trainer, record: StepRecord, state: TrainState | None) -> None:
    if record.step == self.first and not self.tracing:
      self._start()
    elif record.step == self.last and self.tracing:
      self._stop()

  def ending(self) -> str:
    return "stopping the profile trace" if self.tracing else "the end of the profiler"

  def on_end(self, trainer: Trainer, state: TrainState | None) -> None:
    if self.tracing:
      self._stop()


def profile_hook(directory: str, first: int, num_steps: int, run_steps: int, active: bool, clean: bool
                 ) -> ProfilerHook | None:
  """The run's ProfilerHook with its trace cut at the run's last step `run_steps`, so its line names the
  steps traced; None, with a warning line, when the run ends before the trace would start."""
  if first >= run_steps:
    print(f"warning: profile_start_step={first} is not before steps={run_steps}: no step is traced; set "
          f"profile_start_step below {run_steps}", file=sys.stderr, flush=True)
    return None
  return ProfilerHook(directory, first, min(num_steps, run_steps - first), active, clean)
