"""The compiled, scheduled HLO of a train step and what the step-time model needs beside it
(topology, device coordinates, model FLOPs), saved by train_compile when MAXTEXT_SAVE_STEP_HLO
names a path stem, so the model can be iterated on without compiling again
(benchmarks/step_time_table.py)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from typing import Any, Sequence

from MaxText.paths import storage
from MaxText.platform.accelerators import TpuTopology

SAVE_ENV = "MAXTEXT_SAVE_STEP_HLO"


@dataclasses.dataclass(frozen=True)
class StepTarget:
  """Where a compiled step runs: `coords[i]` is (x, y, z, slice) of the device with id i in the
  HLO's replica groups (the compile's device assignment, i.e. the mesh's devices in order)."""

  generation: str
  topology: str
  shape: tuple[int, ...]
  wrap: tuple[bool, ...]
  num_slices: int
  coords: tuple[tuple[int, int, int, int], ...]
  mesh: dict[str, int]
  model_tflops_per_device: float
  attention_tflops_per_device: float = 0.0

  @classmethod
  def from_devices(cls, topology: TpuTopology, num_slices: int, devices: Sequence[Any], mesh: dict[str, int],
                   model_tflops_per_device: float, attention_tflops_per_device: float) -> "StepTarget":
    coords = []
    for device in devices:
      xyz = list(getattr(device, "coords", (0, 0, 0)))[:3] + [0, 0, 0]
      coords.append((int(xyz[0]), int(xyz[1]), int(xyz[2]), int(getattr(device, "slice_index", 0) or 0)))
    return cls(topology.generation.name, topology.name, tuple(topology.shape), tuple(topology.wrap), num_slices,
               tuple(coords), dict(mesh), model_tflops_per_device, attention_tflops_per_device)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "StepTarget":
    data = dict(data)
    data["shape"] = tuple(data["shape"])
    data["wrap"] = tuple(data["wrap"])
    data["coords"] = tuple(tuple(c) for c in data["coords"])
    return cls(**data)


def save_requested() -> str | None:
  return os.environ.get(SAVE_ENV) or None


def save_step(stem: str, hlo_text: str, target: StepTarget, extra: dict[str, Any]) -> None:
  """Writes STEM.hlo.gz (the compiled HLO text) and STEM.json (the target and `extra`); local or gs://."""
  storage.makedirs(storage.parent(stem))
  storage.write_bytes(f"{stem}.hlo.gz", gzip.compress(hlo_text.encode()))
  storage.write_text(f"{stem}.json", json.dumps({"target": target.to_json(), **extra}))


def load_step(stem: str) -> tuple[str, StepTarget, dict[str, Any]]:
  hlo_text = gzip.decompress(storage.read_bytes(f"{stem}.hlo.gz")).decode()
  data = json.loads(storage.read_text(f"{stem}.json"))
  target = StepTarget.from_json(data.pop("target"))
  return hlo_text, target, data
