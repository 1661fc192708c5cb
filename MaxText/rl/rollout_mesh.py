"""Where GRPO's rollouts run: on the training mesh (rl_rollout_devices=0, the parameters the step
wrote are the engine's input as they are) or on a mesh of their own, the last rl_rollout_devices
devices laid out (data, tensor) by rl_rollout_ici_tensor_parallelism, while the others train.

    train devices [0, n - r) ── update ──► params (train layout: fsdp/tensor of the run's mesh)
                                              │ jax.device_put to the engine's NamedShardings,
                                              ▼ every rl_weight_sync_interval updates
    rollout devices [n - r, n) ◄── weights (rollout layout) ── Engine.prefill_insert / decode_step

The copy goes device to device (no host round trip); each one's bytes and seconds are metrics.
The batch of step t samples from the copy made at step t - t % interval (at most interval - 1
updates old: rl_max_staleness bounds it), so once a copy is made every batch up to the next one
is determined and `RunAhead` generates them on a worker thread while the training runs. A copy is
made at every multiple of the interval and at the first rollout of a process: a run resumed at a
multiple samples exactly as the uninterrupted one did (its checkpointed weights are the copy's).
A checkpoint between two copies holds the completions made ahead (rollouts.py's data state), since
their copy is not in it, and the rerun trains on them as they were.

With LoRA (`frozen`: the run's partition, whose frozen part, the base model, never changes) only the
first copy of a process moves every weight; each later one moves the adapters alone and reuses the
base already on the rollout devices (converted once with quantize_weights). On the training mesh
with quantize_weights the base kernels are likewise converted once, not before every rollout.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from MaxText.configuration import rl_config
from MaxText.configuration.config import Config
from MaxText.inference.quantized_weights import replace_leaves
from MaxText.platform.mesh_axes import MESH_AXES
from MaxText.training.optimizers import Partition

T = TypeVar("T")
NO_COPY = {"weight_sync_bytes": 0.0, "weight_sync_s": 0.0}  # a step's metrics when it made no copy


def split_devices(config: Config, devices: Sequence[Any] | None = None) -> tuple[list[Any], list[Any]]:
  """(training devices, rollout devices): the rollout mesh takes the last rl_rollout_devices; with
  several processes (hosts), the last rl_rollout_devices / processes of each, so that both meshes
  span every process and each process drives both sides as one process does."""
  devices = list(jax.devices() if devices is None else devices)
  rollout = rl_config.own_rollout_devices(config.data.objective, config.rl)
  processes = sorted({d.process_index for d in devices})
  train: list[Any] = []
  roll: list[Any] = []
  for process in processes:  # rl_config.training_devices checked that the processes share them evenly
    local = [d for d in devices if d.process_index == process]
    cut = len(local) - rollout // len(processes)
    train, roll = train + local[:cut], roll + local[cut:]
  return train, roll


def training_devices(config: Config) -> list[Any] | None:
  """The devices build_run lays the training mesh on: None (all of them) without a rollout mesh."""
  return split_devices(config)[0] if rl_config.own_rollout_devices(config.data.objective, config.rl) else None


def rollout_mesh(config: Config, devices: Sequence[Any]) -> Mesh:
  """The rollout devices as a (data, tensor) mesh over the run's mesh axes (the others of size 1)."""
  tensor = config.rl.rl_rollout_ici_tensor_parallelism
  shape = {axis: 1 for axis in MESH_AXES}
  shape["data"], shape["tensor"] = len(devices) // tensor, tensor
  return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape[a] for a in MESH_AXES)), MESH_AXES)


def _staging_mesh(source: Sequence[Any], target: Mesh) -> Mesh:
  """The training devices as (copies, *target's shape): position p of every copy is a device of the
  process that holds the target's device p, so that what copy 0 holds there is that device's shard."""
  positions: dict[int, list[int]] = {}
  for position, device in enumerate(target.devices.flat):
    positions.setdefault(device.process_index, []).append(position)
  copies = len(source) // target.devices.size
  grid = np.empty((copies, target.devices.size), dtype=object)
  for process, where in positions.items():
    local = sorted((d for d in source if d.process_index == process), key=lambda d: d.id)
    if len(local) != copies * len(where):
      raise ValueError(f"process {process} has {len(local)} training devices for {len(where)} rollout devices; "
                       f"each process needs {copies} per rollout device (rl_config.training_devices checks it)")
    for copy in range(copies):
      grid[copy, where] = local[copy * len(where):(copy + 1) * len(where)]
  return Mesh(grid.reshape((copies, *target.devices.shape)), ("rollout_copy", *target.axis_names))


def copy_across_processes(params: Any, shardings: Any) -> Any:
  """`jax.device_put(params, shardings)` for a rollout mesh on other devices of the same processes,
  which JAX refuses with several processes (a reshard between device sets must keep the set). In two
  moves, neither through a host: each parameter is resharded on the training devices to the rollout
  layout (a collective of the training mesh, the devices grouped as `_staging_mesh`), then each
  rollout device takes its shard from a training device of its own process."""
  leaves, tree = jax.tree.flatten(params)
  targets = jax.tree.leaves(jax.tree.map(lambda _, where: where, params, shardings))
  staged = jax.device_put(leaves, [NamedSharding(_staging_mesh(list(x.sharding.device_set), s.mesh), s.spec)
                                   for x, s in zip(leaves, targets)])
  pieces, devices = [], []
  for x, s in zip(staged, targets):
    home = dict(zip(s.mesh.devices.flat, x.sharding.mesh.devices[0].flat))
    held = {shard.device: shard.data for shard in x.addressable_shards}
    ordered = sorted(s.addressable_devices, key=lambda d: d.id)
    pieces.append([held[home[d]] for d in ordered])
    devices.append(ordered)
  moved = jax.device_put([p for group in pieces for p in group], [d for group in devices for d in group])
  out, at = [], 0
  for x, s, group in zip(leaves, targets, pieces):
    out.append(jax.make_array_from_single_device_arrays(x.shape, s, moved[at:at + len(group)]))
    at += len(group)
  return jax.tree.unflatten(tree, out)


def tree_bytes(tree: Any) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class WeightSync:
  """The rollout side's copy of the policy: `for_step(params, step)` returns the parameters a
  rollout at `step` samples from and the copy's metrics (weight_sync_bytes, weight_sync_s; 0 at a
  step that reuses the last copy). Without a rollout mesh (`shardings` None) it is `params`.
  `prepare(params, donate)`: the engine's conversion of the weights it decodes from (quantize_weights),
  applied to each copy once it is made (donated), or without a rollout mesh to `params` at every step.
  `frozen`: a partition whose frozen part stays as it is for the whole run (LoRA's base model): it is
  copied and prepared once, and later copies move only the trained part."""

  def __init__(self, shardings: Any | None, interval: int, across_processes: bool | None = None,
               prepare: Callable[[Any, bool], Any] | None = None, frozen: Partition | None = None):
    self.shardings, self.interval, self.prepare, self.frozen = shardings, interval, prepare, frozen
    self.across_processes = jax.process_count() > 1 if across_processes is None else across_processes
    self.copy: Any | None = None
    self.copied_at: int | None = None  # the step (= updates applied) of the policy in `copy`
    # Without a rollout mesh: the frozen leaves `prepare` converted (the rest is read from `params`, whose
    # buffers each train step donates, so none of them is kept).
    self._converted: dict[tuple[str, ...], Any] | None = None

  def for_step(self, params: Any, step: int) -> tuple[Any, dict[str, float]]:
    if self.shardings is None:
      return self._on_training_mesh(params), {}
    if self.copy is not None and step % self.interval != 0:
      return self.copy, {**NO_COPY, "policy_lag": float(step - (self.copied_at or 0))}
    started = time.perf_counter()
    move = copy_across_processes if self.across_processes else jax.device_put
    if self.frozen is not None and self.copy is not None:  # the base is on the rollout devices: the adapters alone
      trained = jax.block_until_ready(move(self.frozen.split(params)[0], self.frozen.split(self.shardings)[0]))
      copied = tree_bytes(trained)
      self.copy = self.frozen.combine(trained, self.frozen.split(self.copy)[1])
    else:
      self.copy = jax.block_until_ready(move(params, self.shardings))
      copied = tree_bytes(self.copy)
      if self.prepare is not None:
        self.copy = jax.block_until_ready(self.prepare(self.copy, True))
    self.copied_at = step
    seconds = time.perf_counter() - started
    return self.copy, {"weight_sync_bytes": float(copied), "weight_sync_s": seconds, "policy_lag": 0.0}

  def next_copy(self, step: int) -> int:
    """The step of the copy after `step`'s."""
    return (step // self.interval + 1) * self.interval

  def _on_training_mesh(self, params: Any) -> Any:
    if self.prepare is None:
      return params
    if self.frozen is None:
      return self.prepare(params, False)
    if self._converted is None:
      converted = _new_leaves(params, self.prepare(params, False))
      frozen = _new_leaves({}, self.frozen.split(params)[1])
      assert set(converted) <= set(frozen), "prepare converted a trained leaf"
      self._converted = converted
    return replace_leaves(params, self._converted)


def _new_leaves(before: Any, after: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
  """The leaves of the nested dict `after` that are not (the same objects as) `before`'s, by path."""
  out: dict[tuple[str, ...], Any] = {}
  for key, value in after.items():
    old = before.get(key) if isinstance(before, dict) else None
    if isinstance(value, dict):
      out.update(_new_leaves(old if isinstance(old, dict) else {}, value, path + (key,)))
    elif value is not old:
      out[path + (key,)] = value
  return out


class IdleClock:
  """Each side's idle share of a step's cycle (from one batch handed to the training loop to the
  next, so the update before it and the wait for it): `trainer_idle_share`, the time the loop waited
  for its batch; `rollout_idle_share`, the time no rollout was generated or scored (the rollout side
  waiting for the training: for the weights, or for the staleness bound to let it start a batch)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.busy_s = 0.0
    self.running_since: float | None = None
    self.last: tuple[float, float] | None = None  # (time, busy_s) at the last hand-over

  def add(self, seconds: float) -> None:
    with self.lock:
      self.busy_s += seconds

  def timed(self, work: Callable[[], T]) -> Callable[[], T]:
    def run() -> T:
      with self.lock:
        self.running_since = time.perf_counter()
      try:
        return work()
      finally:
        with self.lock:
          self.busy_s += time.perf_counter() - (self.running_since or 0.0)
          self.running_since = None
    return run

  def handed(self, waited_s: float) -> dict[str, float]:
    """The shares of the cycle that ends now, the loop having waited `waited_s` ({} for the first)."""
    now = time.perf_counter()
    with self.lock:
      busy = self.busy_s + (now - self.running_since if self.running_since is not None else 0.0)
    last, self.last = self.last, (now, busy)
    if last is None or now <= last[0]:
      return {}
    cycle = now - last[0]
    return {"trainer_idle_share": min(1.0, waited_s / cycle),
            "rollout_idle_share": max(0.0, 1.0 - (busy - last[1]) / cycle)}


class RunAhead(Generic[T]):
  """Rollouts queued ahead of the training, made one at a time in step order on a worker thread
  (their device work runs on the rollout mesh, beside the train step's on the training mesh).
  `inline` (the default with several processes) makes each when it is queued, on the caller's
  thread: every process must start its collectives in the same order, which two threads do not keep
  (the worker's decode beside the main thread's global broadcasts fails in gloo)."""

  def __init__(self, inline: bool | None = None, clock: IdleClock | None = None) -> None:
    self.inline = jax.process_count() > 1 if inline is None else inline
    self.clock = clock
    self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
    self.pending: dict[int, Future[T]] = {}

  def has(self, step: int) -> bool:
    return step in self.pending

  def submit(self, step: int, work: Callable[[], T]) -> None:
    work = work if self.clock is None else self.clock.timed(work)
    if not self.inline:
      self.pending[step] = self.pool.submit(work)
      return
    made: Future[T] = Future()
    try:
      made.set_result(work())
    except Exception as error:  # noqa: BLE001 - raised when the step takes its batch, as from the worker
      made.set_exception(error)
    self.pending[step] = made

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
