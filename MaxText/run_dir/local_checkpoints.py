"""The fast tier of multi-tier checkpointing: each process saves its own shards to its host's disk.

Layout (`local_checkpoint_directory/run_name/process_<i>/<step>/`):
    manifest.json   step, process count, every leaf's global shape, dtype and the index of each
                    shard this process holds, the data iterator's state and the run's meta
    <n>.npy         the bytes of one shard (as uint8, so bfloat16 and friends round-trip)
A step is written into `<step>.partial-<pid>/` and renamed when complete: a directory named by
a bare number is always whole.

A process writes under its own index but reads from every `process_<j>` folder on its disk: the
manifest says which regions a step holds, so a host whose process index changed (the survivors
of an elastic run renumbered) still finds the steps it saved under its old index.

Restore needs every process to hold the same step with the regions of each leaf that the
current mesh gives it; the processes agree on the newest such step with one all-gather. Where
some processes lack it (a replaced host, a slice that returns) the others hand their regions
over (`peer_handover.py`); where no process holds a region that is needed, the run restores
from the persistent tier. Fewer processes that keep their regions (an elastic run on fewer
slices) restore from it.

Why not Orbax here: its emergency checkpoint manager (orbax.checkpoint.experimental.emergency)
is marked experimental and needs a multi-slice replica layout, and its standard handlers
refuse host-local arrays in a multi-process job and write numpy leaves from process 0 only,
so a per-host tier cannot be expressed with them on the versions we support. The persistent
tier stays Orbax's.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.errors import TrainingError

State = TypeVar("State")  # the run's state tree; its abstract twin and shardings share its type

MANIFEST = "manifest.json"
MAX_STEPS_COMPARED = 16  # newest local steps each process reports when the processes agree on one


# A leaf's path in the state tree, as tree_flatten_with_path gives it.
LeafPath = tuple[jax.tree_util.DictKey | jax.tree_util.SequenceKey | jax.tree_util.GetAttrKey
                 | jax.tree_util.FlattenedIndexKey, ...]


def _leaf_name(path: LeafPath) -> str:
  return jax.tree_util.keystr(path)


def _index_key(index: tuple[slice, ...]) -> list[list[int | None]]:
  return [[s.start, s.stop] for s in index]


class LocalTier:
  """Saves and restores this process's shards of the train state on its own disk."""

  def __init__(self, directory: str, period: int, max_to_keep: int):
    self.directory = directory
    self.root = os.path.join(directory, f"process_{jax.process_index()}")
    self.period, self.max_to_keep = period, max_to_keep
    os.makedirs(self.root, exist_ok=True)
    for entry in os.listdir(self.root):  # a save cut short by a kill
      if ".partial-" in entry:
        shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)
    self._writer: threading.Thread | None = None
    self._error: BaseException | None = None
    self.last_saved_step: int | None = None

  def folders(self) -> list[str]:
    """Every process folder on this disk, this process's own first (a renumbered host's earlier
    index is among the others)."""
    others = sorted(os.path.join(self.directory, e) for e in os.listdir(self.directory)
                    if e.startswith("process_") and os.path.join(self.directory, e) != self.root)
    return [self.root, *others]

  def steps(self) -> list[int]:
    """Complete local steps in any process folder on this disk, oldest first."""
    return sorted({s for folder in self.folders() for s in _steps_in(folder)})

  # ------------------------------------------------------------------ save

  def save(self, step: int, state: object, data_state: object, meta: dict[str, Any]) -> None:
    """Copies this process's shards to host memory now, writes them in the background."""
    self.wait()
    leaves: list[Any] = []
    shards: list[Any] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      entries = []
      for shard in _unique_shards(leaf):
        entries.append({"index": _index_key(shard.index), "file": f"{len(shards)}.npy"})
        # A real copy: on a CPU backend np.asarray can alias the device buffer, which the next
        # (donating) step may reuse while the background writer still reads it.
        shards.append(np.array(shard.data, copy=True))
      leaves.append({"name": _leaf_name(path), "shape": list(leaf.shape), "dtype": str(leaf.dtype),
                     "shards": entries})
    manifest = {"step": step, "process_index": jax.process_index(), "process_count": jax.process_count(),
                "leaves": leaves, "data": data_state, "meta": meta}
    self._writer = threading.Thread(target=self._write, args=(step, manifest, shards), daemon=True,
                                    name=f"local-checkpoint-{step}")
    self._writer.start()
    self.last_saved_step = step

  def _write(self, step: int, manifest: dict[str, Any], shards: list[np.ndarray]) -> None:
    partial = os.path.join(self.root, f"{step}.partial-{os.getpid()}")
    try:
      os.makedirs(partial, exist_ok=True)
      for i, data in enumerate(shards):
        with open(os.path.join(partial, f"{i}.npy"), "wb") as f:
          np.save(f, np.ascontiguousarray(data).reshape(-1).view(np.uint8), allow_pickle=False)
          f.flush()
          os.fsync(f.fileno())
      with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
      final = os.path.join(self.root, str(step))
      if os.path.exists(final):
        shutil.rmtree(final)
      os.rename(partial, final)
      kept = _steps_in(self.root)[-self.max_to_keep:]
      for folder in self.folders():  # a renumbered host's older folders keep no newer steps
        for old in _steps_in(folder):
          if old < kept[0] or (folder == self.root and old not in kept):
            shutil.rmtree(os.path.join(folder, str(old)), ignore_errors=True)
    except BaseException as e:  # noqa: BLE001 - reported by wait() on the training thread
      self._error = e
      shutil.rmtree(partial, ignore_errors=True)

  def wait(self) -> None:
    """Blocks until the pending local save is on disk; raises TrainingError if it failed."""
    if self._writer is not None:
      self._writer.join()
      self._writer = None
    if self._error is not None:
      error, self._error = self._error, None
      raise TrainingError(f"saving the local checkpoint to {self.root} failed: {type(error).__name__}: {error}; "
                          "free space on the local disk or set enable_emergency_checkpoint=False")

  def close(self) -> None:
    self.wait()

  # ------------------------------------------------------------------ restore

  def agreed_step(self, shardings: object, abstract_state: object) -> int | None:
    """The newest step every process holds whole, with this mesh's shard layout (collective)."""
    mine = self.held_steps(shardings, abstract_state)
    padded = np.full(MAX_STEPS_COMPARED, -1, np.int64)
    padded[:len(mine)] = mine
    everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)
    common = set(everyone[0].tolist())
    for row in everyone[1:]:
      common &= set(row.tolist())
    common.discard(-1)
    return max(common) if common else None

  def held_steps(self, shardings: object, abstract_state: object) -> list[int]:
    """The newest steps this host holds whole with this mesh's shard layout, oldest first."""
    return [s for s in self.steps() if self.locate(s, abstract_state, shardings)][-MAX_STEPS_COMPARED:]

  def locate(self, step: int, abstract_state: object, shardings: object) -> str | None:
    """The folder of `step` whose regions are this process's under `shardings` (None: none)."""
    for folder in self.folders():
      directory = os.path.join(folder, str(step))
      if os.path.isdir(directory) and _layout_matches(directory, abstract_state, shardings):
        return directory
    return None

  def meta(self, step: int) -> dict[str, Any] | None:
    """The run's meta saved with `step` on this host, or None when it is unreadable."""
    for folder in self.folders():
      try:
        return _manifest(os.path.join(folder, str(step))).get("meta") or {}
      except (OSError, ValueError):
        continue
    return None

  def set_aside(self, step: int, name: str) -> str:
    """Renames every copy of `step` on this disk to `name` (never deleted); returns the first new path."""
    self.wait()
    moved = []
    for folder in self.folders():
      try:
        os.rename(os.path.join(folder, str(step)), os.path.join(folder, name))
        moved.append(os.path.join(folder, name))
      except FileNotFoundError:  # not in this folder, or another process on a shared disk moved it first
        continue
    return moved[0] if moved else os.path.join(self.root, name)

  def restore(self, step: int, abstract_state: State, shardings: State) -> tuple[State, Any, dict[str, Any]]:
    """(state, data state, meta) of `step`, built from this host's files into `shardings`."""
    directory = self.locate(step, abstract_state, shardings)
    if directory is None:
      raise FileNotFoundError(f"no folder under {self.directory} holds step {step} with this process's regions")
    manifest = _manifest(directory)
    flat, treedef = jax.tree.flatten(abstract_state)
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    arrays = []
    for leaf, sharding, saved in zip(flat, flat_shardings, manifest["leaves"]):
      by_index = {json.dumps(e["index"]): e["file"] for e in saved["shards"]}
      dtype = np.dtype(leaf.dtype)
      pieces = []
      for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        raw = np.load(os.path.join(directory, by_index[json.dumps(_index_key(_normalise(index, leaf.shape)))]),
                      allow_pickle=False)
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(_normalise(index, leaf.shape), leaf.shape))
        pieces.append(jax.device_put(raw.view(dtype).reshape(shape), device))
      arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces))
    return jax.tree.unflatten(treedef, arrays), manifest.get("data"), manifest.get("meta") or {}

  def read_regions(self, step: int, abstract_state: object, shardings: object
                   ) -> tuple[list[dict[str, np.ndarray]], Any, dict[str, Any]]:
    """Every region this process holds of `step` in host memory (per leaf: region key -> array),
    with the step's data state and meta; raises when a file is missing or has the wrong size."""
    directory = self.locate(step, abstract_state, shardings)
    if directory is None:
      raise FileNotFoundError(f"no folder under {self.directory} holds step {step} with this process's regions")
    manifest = _manifest(directory)
    regions: list[dict[str, np.ndarray]] = []
    for leaf, saved in zip(jax.tree.leaves(abstract_state), manifest["leaves"]):
      dtype, out = np.dtype(leaf.dtype), {}
      for entry in saved["shards"]:
        shape = tuple(stop - start for start, stop in entry["index"])
        raw = np.load(os.path.join(directory, entry["file"]), allow_pickle=False)
        if raw.size != int(np.prod(shape)) * dtype.itemsize:
          raise ValueError(f"{entry['file']} holds {raw.size} bytes, its region needs {int(np.prod(shape)) * dtype.itemsize}")
        out[json.dumps(entry["index"])] = raw.view(dtype).reshape(shape)
      regions.append(out)
    return regions, manifest.get("data"), manifest.get("meta") or {}


def _steps_in(folder: str) -> list[int]:
  """The complete steps in one process folder, oldest first."""
  if not os.path.isdir(folder):
    return []
  return sorted(int(e) for e in os.listdir(folder) if e.isdigit() and os.path.isfile(os.path.join(folder, e, MANIFEST)))


def _manifest(directory: str) -> dict[str, Any]:
  with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
    manifest = json.load(f)
  if not isinstance(manifest, dict):
    raise ValueError(f"{os.path.join(directory, MANIFEST)} holds no JSON object")
  return manifest


def _layout_matches(directory: str, abstract_state: object, shardings: object) -> bool:
  try:
    return _manifest_matches(_manifest(directory), abstract_state, shardings)
  except (OSError, ValueError, KeyError, TypeError):  # a damaged manifest (not UTF-8, cut, other fields): not held
    return False


def _manifest_matches(manifest: dict[str, Any], abstract_state: object, shardings: object) -> bool:
  # The process count may differ: an elastic run relaunched on fewer slices (each slice a whole
  # replica, laid out within it as before) asks each survivor for the regions it saved itself.
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  if len(flat) != len(manifest["leaves"]) or len(flat_shardings) != len(flat):
    return False
  for (path, leaf), sharding, saved in zip(flat, flat_shardings, manifest["leaves"]):
    if saved["name"] != _leaf_name(path) or saved["shape"] != list(leaf.shape) or saved["dtype"] != str(leaf.dtype):
      return False
    wanted = {json.dumps(_index_key(i)) for i in _local_indices(sharding, leaf.shape)}
    if wanted != {json.dumps(e["index"]) for e in saved["shards"]}:
      return False
  return True


def region_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
  """A region's name in manifests and plans: json of [[start, stop], ...] with explicit bounds."""
  return json.dumps(_index_key(_normalise(index, shape)))


def _normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
  """Full slices with explicit bounds, so equal regions compare equal."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _local_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
  seen, out = set(), []
  for index in sharding.addressable_devices_indices_map(shape).values():
    assert index is not None, "an addressable device holds a region of the array"
    norm = _normalise(index, shape)
    key = json.dumps(_index_key(norm))
    if key not in seen:
      seen.add(key)
      out.append(norm)
  return out


def _unique_shards(leaf: jax.Array) -> list[Any]:
  """One shard per distinct region this process holds (replicas within the process once)."""
  seen, out = set(), []
  for shard in leaf.addressable_shards:
    norm = _normalise(shard.index, leaf.shape)
    key = json.dumps(_index_key(norm))
    if key not in seen:
      seen.add(key)
      out.append(_Shard(norm, shard.data))
  return out


class _Shard:
  def __init__(self, index: tuple[slice, ...], data: jax.Array):
    self.index, self.data = index, data
