"""The saved compiled train step: magic + header length + JSON header + pickled executable.
The header says what the step was built for (config groups, input shapes and shardings,
devices, compiler versions); a run loads the file only when its own header agrees.

A saved step file is executable code wrapped in a pickle: loading it runs whatever it
contains. Load only files you (or someone you trust) compiled. It may be local or on gs://.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pickle
import struct
from typing import TYPE_CHECKING, Any, Callable

import jax
from jax.experimental import serialize_executable

from MaxText.paths import storage
from MaxText.errors import UserError

if TYPE_CHECKING:
  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import StepInputs

_MAGIC = b"MAXTEXT-COMPILED-TRAIN-STEP\n"
_FORMAT_VERSION = 2  # 2: the model section nests ModelConfig's records (moe, rope, ...)
# Header sections that must agree between the file and the run that loads it.
_CHECKED_SECTIONS = ("target", "versions", "batch", "model", "optim", "mesh", "guards", "inputs")


def runtime_versions() -> dict[str, str | None]:
  def version(dist: str) -> str | None:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {"jax": jax.__version__, "jaxlib": version("jaxlib"), "libtpu": version("libtpu") or version("libtpu-nightly")}


def _jsonable(value: object) -> Any:
  return json.loads(json.dumps(value, default=str))


def step_header(config: Config, inputs: StepInputs, topology_name: str) -> dict[str, Any]:
  """What the compiled step depends on: the config groups the step is built from, the input
  shapes/dtypes/shardings, the devices and the compiler versions."""
  flat = jax.tree_util.tree_flatten_with_path(inputs.as_args())[0]
  shapes = {jax.tree_util.keystr(path): [list(x.shape), str(x.dtype), str(x.sharding.spec)] for path, x in flat}
  target = config.target
  return _jsonable({
      "format": _FORMAT_VERSION,
      "topology": topology_name,
      "model": dataclasses.asdict(config.model),
      "optim": dataclasses.asdict(config.optim),
      "mesh": dataclasses.asdict(config.mesh),
      "guards": {"skip_nonfinite_steps": config.run.skip_nonfinite_steps,
                 "loss_spike_threshold": config.run.loss_spike_threshold > 0},
      "batch": {"global_batch_size": config.data.global_batch_size,
                "max_target_length": config.data.max_target_length},
      "inputs": shapes,
      "target": {"platform": target.platform, "device_kind": target.device_kind,
                 "num_devices": target.num_devices, "num_slices": config.mesh.num_slices},
      "versions": runtime_versions(),
      "flags": {name: os.environ.get(name, "") for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")},
  })


def header_differences(saved: dict[str, Any], expected: dict[str, Any], limit: int = 4) -> list[str]:
  """'section.key: file X, this run Y' for the checked sections that disagree."""
  out: list[str] = []

  def walk(prefix: str, a: object, b: object) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
      for key in sorted(set(a) | set(b)):
        walk(f"{prefix}.{key}" if prefix else str(key), a.get(key), b.get(key))
    elif a != b:
      out.append(f"{prefix}: file {a!r}, this run {b!r}")

  for section in _CHECKED_SECTIONS:
    walk(section, saved.get(section), expected.get(section))
  return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def save_compiled_step(path: str, compiled: jax.stages.Compiled, header: dict[str, Any]) -> int:
  """Writes magic + header length + JSON header + pickled executable; returns the file size."""
  payload = pickle.dumps(serialize_executable.serialize(compiled))
  header_bytes = json.dumps(header).encode()
  storage.write_bytes(path, _MAGIC + struct.pack(">Q", len(header_bytes)) + header_bytes + payload)
  return storage.size(path)


def read_header(path: str) -> tuple[dict[str, Any], int]:
  """(header, offset of the payload); a UserError for a file that is not a saved step."""
  try:
    with storage.open_file(path, "rb") as f:  # only the header is read (a ranged read on gs://)
      magic = f.read(len(_MAGIC))
      if magic != _MAGIC:
        raise UserError(f"compiled_trainstep_file {path!r} is not a compiled train step written by train_compile")
      (length,) = struct.unpack(">Q", f.read(8))
      header = json.loads(f.read(length))
  except OSError as e:
    raise UserError(f"cannot read compiled_trainstep_file {path!r}: {e.strerror or type(e).__name__}") from None
  except (struct.error, ValueError):
    raise UserError(f"compiled_trainstep_file {path!r} has a damaged header; compile it again") from None
  return header, len(_MAGIC) + 8 + length


def load_compiled_step(path: str, expected_header: dict[str, Any]) -> jax.stages.Compiled:
  """The saved executable, after its header is checked against this run (before unpickling)."""
  header, offset = read_header(path)
  if header.get("format") != _FORMAT_VERSION:
    raise UserError(f"compiled_trainstep_file {path!r} has format {header.get('format')}, "
                    f"this version reads {_FORMAT_VERSION}; compile it again")
  differences = header_differences(header, expected_header)
  if differences:
    raise UserError(f"compiled_trainstep_file {path!r} was compiled for a different run "
                    f"(topology {header.get('topology')}): {'; '.join(differences)}. "
                    "Compile it again with train_compile and this run's settings")
  with storage.open_file(path, "rb") as f:
    f.seek(offset)
    serialized, in_tree, out_tree = pickle.load(f)  # trusted: see the module docstring
  return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
