"""The downstream-task group (eval_tasks): lm-eval tasks scored inside training
(training/task_eval.py). Checked here without I/O; the task names are looked up in lm-eval's
registry when the run starts."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping

from MaxText.configuration.config_fields import key, read_keys
from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.config_yaml import split_items


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskEvalConfig:
  eval_tasks: tuple[str, ...] = key()  # lm-eval task names; () = off
  eval_tasks_path: str = key()  # a folder of task YAMLs (local or gs:// data files they name), "" = the registry only
  eval_tasks_interval: int = key()  # -1 = eval_interval's cadence
  eval_tasks_limit: int = key()  # documents per task, 0 = all
  eval_tasks_num_fewshot: int = key()  # -1 = each task's own

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "TaskEvalConfig":
    values = read_keys(cls, v)
    tasks = values["eval_tasks"]
    if isinstance(tasks, str):  # eval_tasks=a,b on the command line
      tasks = tuple(split_items("eval_tasks", tasks))
    _require(isinstance(tasks, (list, tuple)) and all(isinstance(t, str) and t for t in tasks),
             f"eval_tasks must be a list of lm-eval task names, got {tasks!r}")
    twice = [t for t, n in collections.Counter(tasks).items() if n > 1]
    _require(not twice, f"eval_tasks names {''.join(twice[:1])} twice; name each task once")
    values["eval_tasks"] = tuple(tasks)
    interval = values["eval_tasks_interval"]
    _require(interval == -1 or interval > 0, f"eval_tasks_interval must be > 0 or -1 (eval_interval's), got {interval}")
    if tasks:
      _require(interval > 0 or v["eval_interval"] > 0,
               f"eval_tasks={','.join(tasks)} never runs: set eval_tasks_interval (or eval_interval) to a number of steps")
    _require(values["eval_tasks_limit"] >= 0, f"eval_tasks_limit must be >= 0 (0 = all), got {values['eval_tasks_limit']}")
    _require(values["eval_tasks_num_fewshot"] >= -1,
             f"eval_tasks_num_fewshot must be >= 0, or -1 for each task's own, got {values['eval_tasks_num_fewshot']}")
    if tasks and interval == -1:
      values["eval_tasks_interval"] = v["eval_interval"]
    return cls(**values)
