"""Experiment trackers beside metrics.jsonl and TensorBoard, chosen by `metric_trackers`.

Each tracker gets the run's configuration once, when it opens, and then every scalar the
metric writer logs (train steps, eval, the goodput summary). Only process 0 opens them (the
metric writer lives there). A tracker is an outside service or file format whose failure must
not cost training time: `Trackers` runs each call inside a guard, and the first exception turns
that tracker off with one warning naming it; the others and the run go on.

  wandb               Weights & Biases through the `wandb` package (EXTRAS=tracking). The W&B
                      run id is `run_name`, so a resumed run continues the same W&B run. With a
                      local run directory its files go under <run_dir>/wandb (offline mode
                      keeps everything there for `wandb sync`).
  vertex_tensorboard  TensorBoard event files in the layout Vertex AI TensorBoard reads: one
                      folder per run, <log dir>/<run_name>/events.out.tfevents.*, under
                      `vertex_tensorboard_dir` or the $AIP_TENSORBOARD_LOG_DIR a Vertex AI
                      training job sets; written through the storage layer (gs:// included).
                      The configuration is a text summary tagged `config`.
"""

from __future__ import annotations

import functools
import math
import os
import importlib
import importlib.util
import sys
from typing import Any, Callable, Mapping, Protocol, cast

from MaxText.configuration.config import Config
from MaxText.configuration.config_groups import METRIC_TRACKERS, RunConfig
from MaxText.errors import ConfigError
from MaxText.paths import storage
from MaxText.training import metrics

# An optional extra (requirements-tracking.txt), imported only by a run that names it: its import
# would otherwise add to every process start.
WANDB_MODULE = "wandb"

VERTEX_LOG_DIR_ENV = "AIP_TENSORBOARD_LOG_DIR"


class Tracker(Protocol):
  def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

  def close(self) -> None: ...


def _numbers(scalars: Mapping[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_installed(run: RunConfig) -> None:
  """A tracker's missing package is a setup error, reported before the run builds anything."""
  if "wandb" in run.metric_trackers and importlib.util.find_spec(WANDB_MODULE) is None:
    raise ConfigError("metric_trackers=wandb needs the wandb package: pip install wandb "
                      "(or EXTRAS=tracking bash setup.sh), or drop wandb from metric_trackers")


class WandbTracker:
  def __init__(self, config: Config):
    check_installed(config.run)
    wandb = importlib.import_module(WANDB_MODULE)
    run = config.run
    local_dir = None if storage.is_remote(run.run_dir) else storage.resolve(run.run_dir)
    if local_dir is not None:
      storage.makedirs(local_dir)
    # No console capture: the step lines are the run's own stdout, read by people and tools.
    settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False)
    self._run = wandb.init(project=run.wandb_project, entity=run.wandb_entity or None, name=run.run_name,
                           id=run.run_name, resume="allow", config=dict(config.values), dir=local_dir,
                           mode=cast(Any, run.wandb_mode or None), settings=settings)

  def log(self, step: int, scalars: Mapping[str, float]) -> None:
    self._run.log(dict(scalars), step=step)

  def close(self) -> None:
    self._run.finish()


def vertex_log_dir(config: Config) -> str:
  """The run's folder in the log directory Vertex AI TensorBoard reads: one folder per run."""
  base = (config.run.vertex_tensorboard_dir or os.environ.get(VERTEX_LOG_DIR_ENV, "")
          or storage.join(config.run.run_dir, "vertex_tensorboard"))
  return storage.join(storage.resolve(base), config.run.run_name)


class VertexTensorboardTracker:
  def __init__(self, config: Config):
    self.log_dir = vertex_log_dir(config)
    self._writer = metrics.tensorboard_summary_writer()(self.log_dir)
    # Four spaces make the YAML a code block in TensorBoard's markdown text view.
    self._writer.add_text("config", "\n".join("    " + line for line in config.to_yaml().splitlines()), 0)

  def log(self, step: int, scalars: Mapping[str, float]) -> None:
    for key, value in scalars.items():
      if not math.isnan(value):
        self._writer.add_scalar(key, value, step)

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()


TRACKERS: dict[str, Callable[[Config], Tracker]] = {
    "wandb": WandbTracker,
    "vertex_tensorboard": VertexTensorboardTracker,
}
assert set(TRACKERS) == set(METRIC_TRACKERS), "config_groups.METRIC_TRACKERS names the trackers of this table"


class Trackers:
  """The configured trackers behind one guard: a tracker that raises is named in one warning
  and turned off; training never stops for one."""

  def __init__(self, opened: Mapping[str, Tracker]):
    self._active: dict[str, Tracker] = dict(opened)

  @classmethod
  def open(cls, config: Config, factories: Mapping[str, Callable[[Config], Tracker]] = TRACKERS) -> "Trackers":
    opened: dict[str, Tracker] = {}
    for name in config.run.metric_trackers:
      try:
        opened[name] = factories[name](config)
      except ConfigError:
        raise  # a missing package is a setup error, reported before training starts
      except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
        _warn(name, "start", e)
    return cls(opened)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self._active)

  def log(self, step: int, scalars: Mapping[str, Any]) -> None:
    numbers = _numbers(scalars)
    for name, tracker in list(self._active.items()):
      self._guarded(name, "log", functools.partial(tracker.log, step, numbers))

  def close(self) -> None:
    for name, tracker in list(self._active.items()):
      self._guarded(name, "close", tracker.close)
    self._active.clear()

  def _guarded(self, name: str, what: str, call: Callable[[], None]) -> None:
    try:
      call()
    except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
      del self._active[name]
      _warn(name, what, e)


def _warn(name: str, what: str, error: Exception) -> None:
  print(f"warning: metric tracker {name} failed to {what} ({type(error).__name__}: {error}); "
        "it is turned off and training goes on", file=sys.stderr, flush=True)
