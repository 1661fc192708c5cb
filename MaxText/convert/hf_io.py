"""Reading and writing Hugging Face checkpoint directories, one tensor at a time.

Reading: every `*.safetensors` file (then `*.bin` torch pickles, memory-mapped) in name
order, yielding (name, numpy array) so at most one HF tensor is materialised at once.
Writing: safetensors shards of at most `max_shard_bytes`, streamed to disk tensor by tensor,
plus the `model.safetensors.index.json` weight map when there is more than one shard.

A model directory may be on gs://: each weight file is downloaded to a temporary file just
before it is read (safetensors memory-maps a local file) and deleted after, so the disk holds
one shard at a time. The writer needs a local directory (maxtext_to_hf uploads it afterwards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from typing import IO, Any, Collection, Iterator

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from MaxText.paths import storage
from MaxText.errors import UserError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def read_hf_config(hf_path: str) -> dict[str, Any]:
  path = storage.join(hf_path, CONFIG_FILE)
  if not storage.is_file(path):
    raise UserError(f"{hf_path} is not a Hugging Face model directory: {CONFIG_FILE} is missing")
  try:
    config = json.loads(storage.read_bytes(path))
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise UserError(f"cannot parse {path}: {e}") from None
  if not isinstance(config, dict):
    raise UserError(f"{path} holds a JSON {type(config).__name__}, not the object of a model's config")
  _index_shards(hf_path)  # a missing shard is named before anything else is read
  return config


def _weight_map(path: str) -> dict[str, str]:
  """A shard index's weight_map (tensor name -> shard file), or one line saying the index is not one."""
  try:
    weight_map = json.loads(storage.read_bytes(path)).get("weight_map")
  except (ValueError, RecursionError, AttributeError):
    weight_map = None
  if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
    raise UserError(f"cannot parse {path}: it needs a weight_map of tensor names to shard files")
  return weight_map


def _index_shards(hf_path: str, name: str = INDEX_FILE) -> ShardIndex | None:
  """The index `name`'s shards (None: no such index). Each must be there: one missing (a download cut short)
  would otherwise surface as parameters the checkpoint does not fill."""
  path = storage.join(hf_path, name)
  if not storage.is_file(path):
    return None
  weight_map = _weight_map(path)
  shards = sorted(set(weight_map.values()))
  missing = [f for f in shards if not storage.is_file(storage.join(hf_path, f))]
  if missing:
    raise UserError(f"{path} names {len(missing)} shard(s) that are not in {hf_path}, e.g. {', '.join(missing[:3])}; "
                    "download the missing shards")
  tensors: dict[str, list[str]] = {storage.join(hf_path, f): [] for f in shards}
  for tensor, shard in weight_map.items():
    tensors[storage.join(hf_path, shard)].append(tensor)
  return ShardIndex(path, tensors)


@dataclasses.dataclass(frozen=True)
class ShardIndex:
  """An index file and, per shard path (in name order), the tensor names its weight_map puts there."""

  path: str
  tensors: dict[str, list[str]]

  def check_holds(self, shard: str, held: Collection[str]) -> None:
    """One line for a tensor the index puts in `shard` that it does not hold (a stale index, a shard saved
    again): it surfaced later, if at all, as a parameter the checkpoint does not fill, naming neither file."""
    lacking = [name for name in self.tensors.get(shard, []) if name not in held]
    if lacking:
      more = f" (and {len(lacking) - 1} more tensor(s) it maps there)" if len(lacking) > 1 else ""
      raise UserError(f"{self.path} maps {lacking[0]} to {storage.name(shard)}, which does not hold it{more}; "
                      "download that shard and the index again")


def checkpoint_files(hf_path: str) -> tuple[list[str], ShardIndex | None]:
  """The files transformers loads, with the index that named them (None: none did): the shards
  model.safetensors.index.json names, else model.safetensors, else every safetensors file (HF prefers them when
  both exist), else the .bin shards. A repository may hold other weights beside them (Mistral's
  consolidated.safetensors, in its own tensor names)."""
  # (training_args.bin beside .bin shards is the trainer's settings, a pickle: never globbed when an index names them)
  for index_name, single, pattern in ((INDEX_FILE, "model.safetensors", "*.safetensors"),
                                      (BIN_INDEX_FILE, "pytorch_model.bin", "*.bin")):
    index = _index_shards(hf_path, index_name)
    if index is not None:
      return list(index.tensors), index
    if storage.is_file(storage.join(hf_path, single)):
      return [storage.join(hf_path, single)], None
    files = storage.glob(storage.join(hf_path, pattern))
    if files:
      return files, None
  raise UserError(f"{hf_path} holds no *.safetensors or *.bin weights")


@contextlib.contextmanager
def local_model_dir(hf_path: str) -> Iterator[str]:
  """A local directory with the files directly in `hf_path` (for transformers' from_pretrained):
  `hf_path` itself when local, else a temporary download of its top-level files only (HF repos
  may carry large subdirectories, e.g. original/ weights, that loading never reads)."""
  if not storage.is_remote(hf_path):
    yield storage.resolve(hf_path)
    return
  with tempfile.TemporaryDirectory(prefix="maxtext-hf-") as local:
    for name in storage.listdir(hf_path):
      source = storage.join(hf_path, name)
      if storage.is_file(source):
        storage.copy_tree(source, storage.join(local, name))
    yield local


def _torch_to_numpy(tensor: Any) -> np.ndarray:
  import torch  # only .bin checkpoints need torch

  if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
    return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.contiguous().numpy()


def iter_hf_tensors(hf_path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Every tensor of the files transformers loads; one line naming both files for a name two of them hold (which
  copy transformers keeps depends on its load order)."""
  seen: dict[str, str] = {}
  for name, path, array in _file_tensors(hf_path):
    if name in seen:
      raise UserError(f"HF tensor {name} is in both {seen[name]} and {path}; remove the stale copy (or download the "
                      "checkpoint again)")
    seen[name] = path
    yield name, array


def _file_tensors(hf_path: str) -> Iterator[tuple[str, str, np.ndarray]]:
  files, index = checkpoint_files(hf_path)
  for path in files:
    if not path.endswith(".safetensors"):
      try:
        import torch
      except ImportError:
        raise UserError(f"{storage.name(path)} is a torch .bin checkpoint; reading it needs torch "
                        "(pip install torch), or convert it to safetensors first") from None
    with storage.local_copy(path) as local:  # a download of one shard when remote, removed after
      if path.endswith(".safetensors"):
        yield from ((name, path, array) for name, array in _safetensors_tensors(path, local, index))
        continue
      # mmap keeps the shard on disk; each tensor is copied out only when it is converted.
      try:
        state = torch.load(local, map_location="cpu", mmap=True, weights_only=True)
      except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... for a bad file
        raise UserError(f"cannot read {path}: {type(e).__name__}: {' '.join(str(e).split())[:200]}; the file is "
                        "damaged, incomplete or not a torch checkpoint (download it again)") from None
      if index is not None:
        index.check_holds(path, state)
      for name in list(state):
        yield name, path, _torch_to_numpy(state.pop(name))
      del state


def _safetensors_tensors(path: str, local: str, index: ShardIndex | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """The tensors of one safetensors file; one line naming the file for a damaged one (cut short,
  not safetensors) and the tensor for a dtype numpy cannot hold (float8: a quantised checkpoint).
  With the `index` that names the file, a tensor it puts there that the file lacks is one line first."""
  try:
    with safe_open(local, framework="numpy") as f:
      if index is not None:  # from the header alone: before any tensor of the shard is read
        index.check_holds(path, set(f.keys()))
      for name in f.keys():
        try:
          array = f.get_tensor(name)
        except (AttributeError, TypeError) as e:  # safetensors names a numpy dtype that does not exist
          dtype = f.get_slice(name).get_dtype()
          raise UserError(f"tensor {name} of {path} has dtype {dtype}, which the converter cannot read "
                          f"({type(e).__name__}); dequantise the checkpoint to bfloat16 or float32 first") from None
        yield name, array
  except SafetensorError as e:
    raise UserError(f"cannot read {path}: {' '.join(str(e).split())[:200]}; the file is damaged or incomplete "
                    "(download it again)") from None


# safetensors dtype names (https://github.com/huggingface/safetensors format description)
_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
                       np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
                       np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
_COPY_CHUNK = 16 * 2**20


class SafetensorsWriter:
  """Appends tensors to numbered shards of at most `max_shard_bytes` (a larger tensor gets its own).

  Streams: each tensor's bytes go straight to the current shard's data file on disk; when the
  shard is full its header (which must list every tensor's offsets first) is written and the
  data copied behind it in bounded chunks, so memory never holds more than one tensor.
  """

  def __init__(self, output_dir: str, max_shard_bytes: int):
    self.output_dir = output_dir
    self.max_shard_bytes = max_shard_bytes
    self._header: dict[str, Any] = {}
    self._data: IO[bytes] | None = None  # open data file of the current shard
    self._data_bytes = 0
    self._shards: list[list[str]] = []
    self.total_bytes = 0

  def _data_path(self, index: int) -> str:
    return storage.join(self.output_dir, f"shard-{index}.data.tmp")

  def add(self, name: str, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype not in _SAFETENSORS_DTYPES:
      raise UserError(f"tensor {name} has dtype {array.dtype}, which safetensors cannot store")
    if self._header and self._data_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    if self._data is None:
      self._data = storage.open_file(self._data_path(len(self._shards)), "wb")  # closed in _flush
    self._data.write(array.reshape(-1).view(np.uint8).data)
    self._header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                          "data_offsets": [self._data_bytes, self._data_bytes + array.nbytes]}
    self._data_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    index = len(self._shards)
    data_path = self._data_path(index)
    if self._data is None:  # an empty model still gets one (empty) file
      storage.write_bytes(data_path, b"")
    else:
      self._data.close()
    header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data start stays 8-byte aligned
    with storage.open_file(storage.join(self.output_dir, f"shard-{index}.tmp"), "wb") as out, \
        storage.open_file(data_path, "rb") as data:
      out.write(len(header).to_bytes(8, "little") + header)
      while chunk := data.read(_COPY_CHUNK):
        out.write(chunk)
    storage.remove_tree(data_path)
    self._shards.append(list(self._header))
    self._header, self._data, self._data_bytes = {}, None, 0

  def abort(self) -> None:
    """Closes the open shard's data file after a failure (the caller removes the directory's files)."""
    if self._data is not None:
      self._data.close()
      self._data = None

  def close(self) -> list[str]:
    """Writes the last shard, names the shards as HF does and writes the index; returns the file names."""
    if self._header or not self._shards:
      self._flush()
    count = len(self._shards)
    names = ["model.safetensors"] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for i, name in enumerate(names):
      storage.as_path(storage.join(self.output_dir, f"shard-{i}.tmp")).replace(storage.join(self.output_dir, name))
    if count > 1:
      weight_map = {tensor: names[i] for i, shard in enumerate(self._shards) for tensor in shard}
      index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
      storage.write_text(storage.join(self.output_dir, INDEX_FILE), json.dumps(index, indent=2))
    return names
