"""The device mesh's axes, in mesh order, and the config keys that set each one's degree
(`ici_<key>_parallelism` within a slice, `dcn_<key>_parallelism` across slices). Free of jax:
the configuration, sharding.py and the planner read it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

# ici: devices within a slice; dcn: across slices (or, off TPU, processes).
Group = Literal["ici", "dcn"]
GROUPS: tuple[Group, ...] = ("ici", "dcn")
_SUFFIX = "_parallelism"


class MeshAxis(StrEnum):
  DATA = "data"
  STAGE = "stage"
  FSDP = "fsdp"
  FSDP_TRANSPOSE = "fsdp_transpose"
  SEQUENCE = "sequence"
  TENSOR = "tensor"
  EXPERT = "expert"
  AUTOREGRESSIVE = "autoregressive"

  @property
  def key_name(self) -> str:
    """Its word in the config keys. The pipeline axis is `stage` in logical_axis_rules (as in
    MaxText) but `pipeline` in its keys."""
    return "pipeline" if self is MeshAxis.STAGE else self.value

  def key(self, group: Group) -> str:
    return f"{group}_{self.key_name}{_SUFFIX}"

  @property
  def ici_key(self) -> str:
    return self.key("ici")

  @property
  def dcn_key(self) -> str:
    return self.key("dcn")

  @classmethod
  def of_key(cls, key: str) -> tuple[Group, MeshAxis] | None:
    """(group, axis) of an `ici_*_parallelism` / `dcn_*_parallelism` key; None for any other key."""
    for group in GROUPS:
      for axis in cls:
        if key == axis.key(group):
          return group, axis
    return None


# The axis names, in mesh order, as jax's Mesh takes them.
MESH_AXES: tuple[str, ...] = tuple(axis.value for axis in MeshAxis)
# Axes parameters are replicated over by design, which the replication check does not count:
# pure data parallelism; the pipeline stages, which split only the layer stack; autoregressive,
# which splits only the decode KV cache.
REPLICATED_PARAMETER_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.STAGE, MeshAxis.AUTOREGRESSIVE)

# custom_mesh (upstream MaxText's names): a v6e-256 slice's 16 x 16 chips as (rings, chips per ring),
# each ring a closed loop of neighbouring chips (a 2 x 2 or 2 x 4 block), over two ici axes of those degrees.
HYBRID_RINGS: dict[str, tuple[int, int]] = {"hybrid_ring_64x4": (64, 4), "hybrid_ring_32x8": (32, 8)}
HYBRID_RING_SLICE = (16, 16)
