"""Reading and writing Hugging Face checkpoint directories, one tensor at a time.

Reading: every `*.safetensors` file (then `*.bin` torch pickles, memory-mapped) in name
order, yielding (name, numpy array) so at most one HF tensor is materialised at once.
Writing: safetensors shards of at most `max_shard_bytes`, plus the
`model.safetensors.index.json` weight map when there is more than one shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

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


class SafetensorsWriter:
  """Appends tensors to numbered shards of at most `max_shard_bytes` (a larger tensor gets its own)."""

  def __init__(self, output_dir: str, max_shard_bytes: int):
    self.output_dir = Path(output_dir)
    self.max_shard_bytes = max_shard_bytes
    self._pending: dict[str, np.ndarray] = {}
    self._pending_bytes = 0
    self._shards: list[list[str]] = []
    self.total_bytes = 0

  def add(self, name: str, array: np.ndarray) -> None:
    if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    self._pending[name] = np.ascontiguousarray(array)
    self._pending_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    index = len(self._shards)
    save_file(self._pending, str(self.output_dir / f"shard-{index}.tmp"), metadata={"format": "pt"})
    self._shards.append(list(self._pending))
    self._pending, self._pending_bytes = {}, 0

  def close(self) -> list[str]:
    """Writes the last shard, names the shards as HF does and writes the index; returns the file names."""
    if self._pending or not self._shards:
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
