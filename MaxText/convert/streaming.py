"""Orbax writes and reads of a parameters-only checkpoint, one parameter at a time.

Writing: Orbax's numpy handler starts every array's TensorStore write at once, and each write
holds its compressed chunks until it finishes, so a plain save buffers about the whole
model. `save_params_one_by_one` registers a handler that awaits each array's write before
starting the next (the checkpoint layout, OCDBT included, is unchanged, so
`params_io.load_params` reads it as before), and returns freed allocator pages to the OS
between arrays: TensorStore's worker threads allocate in separate glibc arenas, which
otherwise keep the freed buffers of every array and grow with the model.

Reading: `ParamReader` restores single parameters (as numpy, in a requested dtype) with
`partial_restore`, so only that array is read into memory.

Both take local or gs:// paths (Orbax and TensorStore write and read buckets themselves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from MaxText.paths import storage
from MaxText.errors import UserError

PARAMS = "params"  # the item of a parameters-only checkpoint (MaxText.training.params_io's layout)
ParamPath = tuple[str, ...]


def _release_free_memory() -> None:
  """Gives freed heap pages of every glibc arena back to the OS (a no-op without glibc)."""
  name = ctypes.util.find_library("c")
  if not name:
    return
  try:
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
      libc.malloc_trim(0)
  except OSError:
    pass


class OneByOneNumpyHandler(ocp.type_handlers.NumpyHandler):  # type: ignore[misc]  # orbax ships no type information
  """Writes host arrays sequentially and without copying them first.

  The per-array write is the parent's `_background_serialize` (a protected method of this
  public class): Orbax has no public per-array write, and reimplementing it would need the
  private TensorStore spec builders.
  """

  def __init__(self) -> None:
    super().__init__(deepcopy_host_arrays=False)

  async def serialize(self, values: Sequence[np.ndarray], infos: Sequence[Any],
                      args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [ocp.SaveArgs()] * len(values))

    async def write_one_by_one() -> None:
      for value, info, arg in zip(values, infos, args):
        await self._background_serialize([value], [info], [arg])
        _release_free_memory()

    return [ocp.future.CommitFutureAwaitingContractedSignals(write_one_by_one(), name="one_by_one_numpy")]


def save_params_one_by_one(path: str, params: dict[str, Any]) -> None:
  """Writes {"params": params} (numpy leaves, e.g. memory maps) synchronously to a new `path`.

  Peak extra host memory is about one parameter (measured in benchmarks/convert_memory.py).
  The leaves must stay valid until this returns (the save is synchronous).
  """
  if storage.exists(path):
    raise UserError(f"{path} already exists; choose a new output path or remove it first")
  handlers = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, OneByOneNumpyHandler()), (jax.Array, ocp.type_handlers.ArrayHandler()))
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=handlers))
  try:
    checkpointer.save(storage.as_path(path), args=ocp.args.PyTreeSave({PARAMS: params}))
  finally:
    checkpointer.close()


def _nested(path: ParamPath, leaf: object) -> dict[str, Any]:
  out: dict[str, Any] = {path[-1]: leaf}
  for key in reversed(path[:-1]):
    out = {key: out}
  return out


class ParamReader:
  """Reads single parameters of an Orbax PyTree directory whose item holds {"params": ...}."""

  def __init__(self, directory: str, dtype: np.dtype | str):
    self.directory = storage.as_path(directory)
    self.dtype = np.dtype(dtype)
    self._checkpointer = ocp.PyTreeCheckpointer()
    item = self._checkpointer.metadata(self.directory).item_metadata
    if item is None or PARAMS not in item:  # Orbax answers None when the tree's metadata files are gone
      self._checkpointer.close()
      raise UserError(f"{directory} holds no readable {PARAMS!r} tree (its metadata or OCDBT manifest is missing): "
                      "its files are damaged or incomplete; copy the checkpoint again")
    metadata = item[PARAMS]
    flat = jax.tree_util.tree_flatten_with_path(
        metadata, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    self.shapes: dict[ParamPath, tuple[int, ...]] = {
        tuple(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in flat}

  @property
  def scanned(self) -> bool:
    return any(path[0] == "layers" for path in self.shapes)

  def read(self, path: ParamPath) -> np.ndarray:
    """The parameter at `path` as a numpy array of `self.dtype` (only it is read)."""
    if path not in self.shapes:
      raise UserError(f"the checkpoint {self.directory} has no parameter {'/'.join(path)}; "
                      "check that the model config matches the one that wrote it")
    _release_free_memory()  # the previous parameters' read buffers, freed in TensorStore's threads
    target = {PARAMS: _nested(path, jax.ShapeDtypeStruct(self.shapes[path], self.dtype))}
    restore_args = {PARAMS: _nested(path, ocp.RestoreArgs(restore_type=np.ndarray, dtype=self.dtype))}
    restored = self._checkpointer.restore(self.directory, args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=True))
    node = restored[PARAMS]
    for key in path:
      node = node[key]
    return np.asarray(node)

  def close(self) -> None:
    self._checkpointer.close()
