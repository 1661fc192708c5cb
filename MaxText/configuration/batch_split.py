"""How a batch's rows split over the mesh: the one rule that config validation (MeshConfig.batch_axes,
the data and pipeline checks), the elastic resize arithmetic and the planner's search all read.

A batch that covers every data_sharding device splits its rows over all of them. One that does
not (a per_device_batch_size under 1, as upstream MaxText runs it) splits them only over the axes
the layers split rows over ("activation_batch" rules' axes, and the pipeline stage); devices that
differ only on the others (by default sequence and tensor, which split within a row) hold the same
rows. With pipeline stages, each pipeline microbatch's rows split over those axes less the stage.
Pure: no JAX.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

Rules = Sequence[tuple[str, Sequence[str]]]


def pipeline_microbatches(shape: Mapping[str, int], requested: int) -> int:
  """Microbatches per gradient-accumulation step that a pipeline splits the rows into: 1 without
  stages, else num_pipeline_microbatches (-1 = the stages; a bad value is refused by check_pipeline)."""
  stages = shape.get("stage", 1)
  if stages <= 1:
    return 1
  return stages if requested == -1 else max(1, requested)


def row_devices(shape: Mapping[str, int], axes: Sequence[str]) -> int:
  """Devices that hold different rows of the batch: the product of the degrees of `axes`."""
  return math.prod(shape[a] for a in axes)


def splits(shape: Mapping[str, int], axes: Sequence[str], rows: int, micro_batches: int = 1,
           pipeline_micro: int = 1) -> bool:
  """Whether each of `micro_batches` micro-batches of `rows` rows splits into whole rows over the
  devices of `axes`, and each of its `pipeline_micro` pipeline microbatches over those less the stage."""
  return (rows % (row_devices(shape, axes) * micro_batches) == 0
          and rows % (row_devices(shape, [a for a in axes if a != "stage"]) * micro_batches * pipeline_micro) == 0)


def batch_axes(shape: Mapping[str, int], data_sharding: Sequence[str], rules: Rules, rows: int,
               micro_batches: int = 1, pipeline_micro: int = 1) -> tuple[str, ...]:
  """The data_sharding axes a batch of `rows` rows is split over (see the module docstring). The
  caller checks with `splits` that they divide the rows."""
  if splits(shape, data_sharding, rows, micro_batches, pipeline_micro):
    return tuple(data_sharding)
  splitting = {a for name, axes in rules if name == "activation_batch" for a in axes}
  return tuple(a for a in data_sharding if a in splitting or a == "stage")


def named(shape: Mapping[str, int], axes: Sequence[str]) -> str:
  """`axis=degree` of the axes of degree > 1, or "none"."""
  return ", ".join(f"{a}={shape[a]}" for a in axes if shape[a] > 1) or "none"


def over(shape: Mapping[str, int], data_sharding: Sequence[str], axes: Sequence[str]) -> str:
  """The devices `axes` split rows over, and the data_sharding axes whose devices repeat the rows
  (the stage passes microbatches on instead)."""
  same_rows = [a for a in data_sharding if a not in axes and a != "stage" and shape[a] > 1]
  shards = row_devices(shape, axes)
  if same_rows:
    return f"the {shards} devices that split rows ({named(shape, axes)}; rows repeated over {named(shape, same_rows)})"
  return f"the {shards} devices of data_sharding ({named(shape, axes)})"
