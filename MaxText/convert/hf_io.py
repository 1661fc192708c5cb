"""Reading and writing Hugging Face checkpoint directories, one tensor at a time.

Reading: every `*.safetensors` file (then `*.bin` torch pickles, memory-mapped) in name
order, yielding (name, numpy array) so at most one HF tensor is materialised at once.
Writing: safetensors shards of at most `max_shard_bytes`, streamed to disk tensor by tensor,
plus the `model.safetensors.index.json` weight map when there is more than one shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

from MaxText.errors import UserError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(hf_path: str) -> dict[str, Any]:
  path = Path(hf_path) / CONFIG_FILE
  if not path.is_file():
    raise UserError(f"{hf_path} is not a Hugging Face model directory: {CONFIG_FILE} is missing")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise UserError(f"cannot parse {path}: {e}") from None


def checkpoint_files(hf_path: str) -> list[Path]:
  """safetensors shards if any (HF prefers them when both exist), else .bin shards."""
  root = Path(hf_path)
  files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
  if not files:
    raise UserError(f"{hf_path} holds no *.safetensors or *.bin weights")
  return files


def _torch_to_numpy(tensor: Any) -> np.ndarray:
  import torch  # only .bin checkpoints need torch

  if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
    return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.contiguous().numpy()


def iter_hf_tensors(hf_path: str) -> Iterator[tuple[str, np.ndarray]]:
  for path in checkpoint_files(hf_path):
    if path.suffix == ".safetensors":
      with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
          yield name, f.get_tensor(name)
      continue
    try:
      import torch
    except ImportError:
      raise UserError(f"{path.name} is a torch .bin checkpoint; reading it needs torch "
                      "(pip install torch), or convert it to safetensors first") from None
    # mmap keeps the shard on disk; each tensor is copied out only when it is converted.
    state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    for name in list(state):
      yield name, _torch_to_numpy(state.pop(name))
    del state


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
    self.output_dir = Path(output_dir)
    self.max_shard_bytes = max_shard_bytes
    self._header: dict[str, Any] = {}
    self._data: Any = None  # open data file of the current shard
    self._data_bytes = 0
    self._shards: list[list[str]] = []
    self.total_bytes = 0

  def _data_path(self, index: int) -> Path:
    return self.output_dir / f"shard-{index}.data.tmp"

  def add(self, name: str, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype not in _SAFETENSORS_DTYPES:
      raise UserError(f"tensor {name} has dtype {array.dtype}, which safetensors cannot store")
    if self._header and self._data_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    if self._data is None:
      self._data = open(self._data_path(len(self._shards)), "wb")  # noqa: SIM115 - closed in _flush
    self._data.write(array.reshape(-1).view(np.uint8).data)
    self._header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                          "data_offsets": [self._data_bytes, self._data_bytes + array.nbytes]}
    self._data_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    index = len(self._shards)
    data_path = self._data_path(index)
    if self._data is None:  # an empty model still gets one (empty) file
      data_path.write_bytes(b"")
    else:
      self._data.close()
    header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data start stays 8-byte aligned
    with open(self.output_dir / f"shard-{index}.tmp", "wb") as out, open(data_path, "rb") as data:
      out.write(len(header).to_bytes(8, "little") + header)
      while chunk := data.read(_COPY_CHUNK):
        out.write(chunk)
    data_path.unlink()
    self._shards.append(list(self._header))
    self._header, self._data, self._data_bytes = {}, None, 0

  def close(self) -> list[str]:
    """Writes the last shard, names the shards as HF does and writes the index; returns the file names."""
    if self._header or not self._shards:
      self._flush()
    count = len(self._shards)
    names = ["model.safetensors"] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for i, name in enumerate(names):
      os.replace(self.output_dir / f"shard-{i}.tmp", self.output_dir / name)
    if count > 1:
      weight_map = {tensor: names[i] for i, shard in enumerate(self._shards) for tensor in shard}
      index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
      (self.output_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return names
