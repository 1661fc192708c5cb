"""Where GRPO's rollouts run: on the training mesh (rl_rollout_devices=0, the parameters the step
wrote are the engine's input as they are) or on a mesh of their own, the last rl_rollout_devices
devices laid out (data, tensor) by rl_rollout_ici_tensor_parallelism, while the others train.

    train devices [0, n - r) ── update ──► params (train layout: fsdp/tensor of the run's mesh)
                                              │ jax.device_put to the engine's NamedShardings,
                                              ▼ every rl_weight_sync_interval updates
    rollout devices [n - r, n) ◄── weights (rollout layout) ── Engine.prefill / decode_step

The copy goes device to device (no host round trip); each one's bytes and seconds are metrics.
The batch of step t samples from the copy made at step t - t % interval (at most interval - 1
updates old: rl_max_staleness bounds it), so once a copy is made every batch up to the next one
is determined and `RunAhead` generates them on a worker thread while the training runs. A copy is
made at every multiple of the interval and at the first rollout of a process: a run resumed at a
multiple samples exactly as the uninterrupted one did (its checkpointed weights are the copy's).
A checkpoint between two copies holds the completions made ahead (rollouts.py's data state), since
their copy is not in it, and the rerun trains on them as they were.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from MaxText.configuration import rl_config
from MaxText.configuration.config import Config
from MaxText.platform.mesh_axes import MESH_AXES

T = TypeVar("T")
NO_COPY = {"weight_sync_bytes": 0.0, "weight_sync_s": 0.0}  # a step's metrics when it made no copy


def split_devices(config: Config, devices: Sequence[Any] | None = None) -> tuple[list[Any], list[Any]]:
  """(training devices, rollout devices): the rollout mesh takes the last rl_rollout_devices."""
  devices = list(jax.devices() if devices is None else devices)
  rollout = rl_config.own_rollout_devices(config.data.objective, config.rl)
  return devices[:len(devices) - rollout], devices[len(devices) - rollout:]


def training_devices(config: Config) -> list[Any] | None:
  """The devices build_run lays the training mesh on: None (all of them) without a rollout mesh."""
  return split_devices(config)[0] if rl_config.own_rollout_devices(config.data.objective, config.rl) else None


def rollout_mesh(config: Config, devices: Sequence[Any]) -> Mesh:
  """The rollout devices as a (data, tensor) mesh over the run's mesh axes (the others of size 1)."""
  tensor = config.rl.rl_rollout_ici_tensor_parallelism
  shape = {axis: 1 for axis in MESH_AXES}
  shape["data"], shape["tensor"] = len(devices) // tensor, tensor
  return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape[a] for a in MESH_AXES)), MESH_AXES)


def tree_bytes(tree: Any) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class WeightSync:
  """The rollout side's copy of the policy: `for_step(params, step)` returns the parameters a
  rollout at `step` samples from and the copy's metrics (weight_sync_bytes, weight_sync_s; 0 at a
  step that reuses the last copy). Without a rollout mesh (`shardings` None) it is `params`."""

  def __init__(self, shardings: Any | None, interval: int):
    self.shardings, self.interval = shardings, interval
    self.copy: Any | None = None
    self.copied_at: int | None = None  # the step (= updates applied) of the policy in `copy`

  def for_step(self, params: Any, step: int) -> tuple[Any, dict[str, float]]:
    if self.shardings is None:
      return params, {}
    if self.copy is not None and step % self.interval != 0:
      return self.copy, {**NO_COPY, "policy_lag": float(step - (self.copied_at or 0))}
    started = time.perf_counter()
    self.copy = jax.block_until_ready(jax.device_put(params, self.shardings))
    self.copied_at = step
    seconds = time.perf_counter() - started
    return self.copy, {"weight_sync_bytes": float(tree_bytes(self.copy)), "weight_sync_s": seconds, "policy_lag": 0.0}

  def next_copy(self, step: int) -> int:
    """The step of the copy after `step`'s."""
    return (step // self.interval + 1) * self.interval


class RunAhead(Generic[T]):
  """Rollouts queued ahead of the training, made one at a time in step order on a worker thread
  (their device work runs on the rollout mesh, beside the train step's on the training mesh)."""

  def __init__(self) -> None:
    self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
    self.pending: dict[int, Future[T]] = {}

  def has(self, step: int) -> bool:
    return step in self.pending

  def submit(self, step: int, work: Callable[[], T]) -> None:
    self.pending[step] = self.pool.submit(work)

  def result(self, step: int) -> T:
    return self.pending.pop(step).result()

  def clear(self) -> None:
    """Drops the queued rollouts (their prompts are given back by the caller's data state)."""
    for future in self.pending.values():
      future.cancel()
    for future in self.pending.values():
      if not future.cancelled():
        future.exception()  # the one running finishes before the engine is used again
    self.pending.clear()
