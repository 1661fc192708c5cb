"""Where GRPO's rollouts run: on the training mesh (rl_rollout_devices=0, the parameters the step
wrote are the engine's input as they are) or on a mesh of their own, the last rl_rollout_devices
devices laid out (data, tensor) by rl_rollout_ici_tensor_parallelism, while the others train.

    train devices [0, n - r) ── update ──► params (train layout: fsdp/tensor of the run's mesh)
                                              │ jax.device_put to the engine's NamedShardings,
                                              ▼ every rl_weight_sync_interval updates
    rollout devices [n - r, n) ◄── weights (rollout layout) ── Engine.prefill / decode_step

The copy goes device to device (no host round trip); each one's bytes and seconds are metrics.
Between copies the rollouts sample from the last one, which is as many updates old as the
interval allows. A copy is made at every step that is a multiple of the interval and at the
first rollout of a process, so a run resumed at such a step samples exactly as the uninterrupted
one did.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from MaxText.configuration.config import Config
from MaxText.platform.mesh_axes import MESH_AXES


def split_devices(config: Config, devices: Sequence[Any] | None = None) -> tuple[list[Any], list[Any]]:
  """(training devices, rollout devices): the rollout mesh takes the last rl_rollout_devices."""
  devices = list(jax.devices() if devices is None else devices)
  rollout = config.rl.rl_rollout_devices if config.data.objective == "grpo" else 0
  return devices[:len(devices) - rollout], devices[len(devices) - rollout:]


def training_devices(config: Config) -> list[Any] | None:
  """The devices build_run lays the training mesh on: None (all of them) without a rollout mesh."""
  return split_devices(config)[0] if config.data.objective == "grpo" and config.rl.rl_rollout_devices else None


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
      return self.copy, {"weight_sync_bytes": 0.0, "weight_sync_s": 0.0, "policy_lag": float(step - (self.copied_at or 0))}
    started = time.perf_counter()
    self.copy = jax.block_until_ready(jax.device_put(params, self.shardings))
    self.copied_at = step
    return self.copy, {"weight_sync_bytes": float(tree_bytes(self.copy)), "weight_sync_s": time.perf_counter() - started,
                       "policy_lag": 0.0}
