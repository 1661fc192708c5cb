"""Elastic training's arithmetic: the configuration a job continues with on fewer (or again all) slices.

An elastic run (elastic_min_slices > 0) spreads only data parallelism across slices
(dcn_data_parallelism = num_slices, every other dcn_* degree 1), so each slice holds a whole
replica of the state and any subset of slices can carry the run on. On fewer slices the global
batch is kept by more gradient-accumulation micro-batches of the same size per device: the
optimizer sees the same batch at the same step, and the data position (global step -> the batch's
examples) is unchanged (file readers keep it per virtual data shard: input_pipeline/pipeline.data_shards).
Pure: no JAX, no I/O; the launcher (MaxText/elastic.py) turns a `Resize` into command-line overrides.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Mapping, Protocol, Sequence

from MaxText.configuration import batch_split
from MaxText.errors import ConfigError
from MaxText.platform.mesh_axes import Group

# Set by the supervisor on the processes it relaunches for a resize: the unix time it saw the cause,
# so the run's goodput counts the seconds from there to its first new step as the resize's.
RESIZE_ENV = "MAXTEXT_ELASTIC_RESIZE_DETECTED"


def resize_detected(environ: Mapping[str, str]) -> float | None:
  """The detection time the supervisor handed this process (None: not relaunched for a resize)."""
  text = environ.get(RESIZE_ENV, "")
  try:
    detected = float(text) if text else None
  except ValueError:
    detected = math.nan
  if detected is not None and not math.isfinite(detected):  # nan or inf would spread into goodput.json
    raise ConfigError(f"{RESIZE_ENV}={text!r} is not a unix time; it is set by MaxText/elastic.py, unset it")
  return detected


class MeshLike(Protocol):
  """What the arithmetic reads from MeshConfig (kept structural: config_groups imports this module)."""

  @property
  def num_slices(self) -> int: ...

  def degrees(self, group: Group) -> tuple[tuple[str, int], ...]: ...


@dataclasses.dataclass(frozen=True)
class SliceLayout:
  """The run as configured on all its slices: what every resize is computed from."""

  num_slices: int
  devices_per_slice: int
  # Devices of one slice that hold different rows of the batch (the data group's batch_axes: with fewer
  # rows than data_sharding devices, those on tensor or sequence repeat them).
  batch_shards_per_slice: int
  global_batch_size: int
  gradient_accumulation_steps: int
  min_slices: int

  @property
  def micro_rows(self) -> Fraction:
    """Rows of one micro-batch on one batch shard: the memory a step needs, kept by every resize."""
    return Fraction(self.global_batch_size,
                    self.num_slices * self.batch_shards_per_slice * self.gradient_accumulation_steps)


@dataclasses.dataclass(frozen=True)
class Resize:
  """The run on `num_slices` slices with the same global batch and micro-batch size."""

  num_slices: int
  per_device_batch_size: Fraction
  gradient_accumulation_steps: int

  def overrides(self) -> list[str]:
    """key=value arguments that relaunch the run this way (after the run's own arguments)."""
    pdb = self.per_device_batch_size
    pdb_text = str(pdb.numerator) if pdb.denominator == 1 else repr(float(pdb))
    return [f"num_slices={self.num_slices}", f"dcn_data_parallelism={self.num_slices}",
            f"per_device_batch_size={pdb_text}", f"gradient_accumulation_steps={self.gradient_accumulation_steps}"]


def layout_of(mesh: MeshLike, num_devices: int, global_batch_size: int, gradient_accumulation_steps: int,
              min_slices: int, batch_axes: Sequence[str]) -> SliceLayout:
  """The layout of a validated mesh (its -1 degrees resolved) whose batch splits over `batch_axes`
  (DataConfig.batch_axes)."""
  ici = dict(mesh.degrees("ici"))
  return SliceLayout(num_slices=mesh.num_slices, devices_per_slice=num_devices // mesh.num_slices,
                     batch_shards_per_slice=batch_split.row_devices(ici, batch_axes),
                     global_batch_size=global_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                     min_slices=min_slices)


def why_not(layout: SliceLayout, slices: int) -> str | None:
  """Why the run cannot keep its global batch on `slices` slices, or None when it can."""
  unit = layout.batch_shards_per_slice * layout.micro_rows  # rows one slice takes per micro-batch
  if not slices >= 1:
    return f"{slices} slices hold no device"
  if Fraction(layout.global_batch_size) % (slices * unit):
    return (f"the global batch {layout.global_batch_size} is not divisible by {slices} slice(s) x "
            f"{layout.batch_shards_per_slice} batch shards x {_rows(layout.micro_rows)} row(s) per micro-batch")
  return None


def keeping_counts(layout: SliceLayout) -> list[int]:
  """Slice counts from 1 to num_slices on which the global batch is kept."""
  return [s for s in range(1, layout.num_slices + 1) if why_not(layout, s) is None]


def resize(layout: SliceLayout, slices: int) -> Resize:
  """The configuration on `slices` slices that keeps the global batch and the micro-batch size."""
  reason = why_not(layout, slices)
  if reason is not None:
    raise ConfigError(f"elastic resize to {slices} slice(s) cannot keep the global batch: {reason}; "
                      f"slice counts that keep it: {_listing(keeping_counts(layout))}")
  accumulation = Fraction(layout.global_batch_size, slices * layout.batch_shards_per_slice) / layout.micro_rows
  assert accumulation.denominator == 1
  return Resize(slices, Fraction(layout.global_batch_size, slices * layout.devices_per_slice), int(accumulation))


def usable_slices(layout: SliceLayout, available: int) -> int | None:
  """The most slices, at most `available` and at least min_slices, that keep the global batch
  (None: the run must stop). Three survivors of four may continue on two."""
  fits = [s for s in keeping_counts(layout) if layout.min_slices <= s <= available]
  return max(fits) if fits else None


def check(values: Mapping[str, object], mesh: MeshLike, num_devices: int, global_batch_size: int,
          batch_axes: Sequence[str]) -> None:
  """The elastic keys against the mesh and the batch split over `batch_axes` (config build time); one
  line per mistake."""
  min_slices = values["elastic_min_slices"]
  if not isinstance(min_slices, int) or min_slices < 0:
    raise ConfigError(f"elastic_min_slices must be a whole number >= 0 (0 = not elastic), got {min_slices!r}")
  if min_slices == 0:
    return
  if min_slices > mesh.num_slices:
    raise ConfigError(f"elastic_min_slices={min_slices} is above the run's {mesh.num_slices} slice(s) (num_slices); "
                      f"set it to at most {mesh.num_slices}")
  uncovered = _data_without_virtual_shards(values)
  if uncovered:
    raise ConfigError(f"elastic_min_slices={min_slices}: {uncovered} keeps its data position per process, which a "
                      "resize changes, so the relaunched run could not read on exactly; an elastic run reads "
                      "dataset_type tfds, hf, grain or stream (or a data_mixture of them, or synthetic); set "
                      "elastic_min_slices=0")
  others = [f"dcn_{axis}_parallelism={d}" for axis, d in mesh.degrees("dcn") if axis != "data" and d != 1]
  if others:
    raise ConfigError(f"an elastic run spreads only data parallelism across slices, so a slice can be dropped; "
                      f"set {', '.join(others)} to 1 or elastic_min_slices=0")
  accumulation = values["gradient_accumulation_steps"]
  assert isinstance(accumulation, int)
  layout = layout_of(mesh, num_devices, global_batch_size, accumulation, min_slices, batch_axes)
  reason = why_not(layout, min_slices)
  if reason is not None:
    raise ConfigError(f"elastic_min_slices={min_slices} cannot keep the global batch with gradient accumulation: "
                      f"{reason}; slice counts that keep it: {_listing(keeping_counts(layout))}")


def _data_without_virtual_shards(values: Mapping[str, object]) -> str | None:
  """The data settings whose reader has no virtual data shards (input_pipeline/pipeline.data_shards),
  so its position does not survive a change of process count; None when the run's data does."""
  if values["dataset_type"] == "synthetic":  # a batch is a function of the step alone
    return None
  if values.get("distill_top_k_path"):
    return f"distill_top_k_path={values['distill_top_k_path']}"
  if values.get("objective") == "grpo":
    return "objective=grpo (its prompts)"
  return None


def _rows(rows: Fraction) -> str:
  return str(rows.numerator) if rows.denominator == 1 else f"{rows.numerator}/{rows.denominator}"


def _listing(counts: Sequence[int]) -> str:
  return ", ".join(map(str, counts)) or "none"
