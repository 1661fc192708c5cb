"""What a collective costs on a TPU slice's ICI torus or across slices over the data-centre
network (DCN), and a host transfer over the host link: bytes, the devices' torus coordinates and
the published per-chip figures (sources in getting_started/AOT.md, "The step-time model").

A collective whose group spans k torus axes runs its ring algorithm over all of them at once:
each axis adds two links per chip when the group is a whole wrapped ring of that axis (a
bidirectional ring), one when it is a line or a part of a ring (a ring embedded on a line uses
each link in both directions). Latency is one hop per ring step."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Mapping, Sequence

from MaxText.aot.step_time.saved import StepTarget


@dataclasses.dataclass(frozen=True)
class Network:
  """Published per-chip figures of one TPU generation, in bytes/s. Where a chip is several JAX
  devices (tpu7x: one per TensorCore) they share its links, DCN, host link and HBM."""

  ici_bidirectional: float  # all of a chip's ICI links together, both directions
  ici_links: int  # links per chip: 4 on a 2D torus, 6 on a 3D one
  dcn_per_chip: float  # the data-centre network's share of one chip, one direction
  host_link: float  # host <-> chip (PCIe), one direction
  hbm: float
  devices_per_chip: int = 1

  @property
  def link_one_way(self) -> float:
    return self.ici_bidirectional / self.ici_links / 2

  @property
  def hbm_per_device(self) -> float:
    return self.hbm / self.devices_per_chip

  @property
  def dcn_per_device(self) -> float:
    return self.dcn_per_chip / self.devices_per_chip


NETWORKS: dict[str, Network] = {
    # cloud.google.com/tpu/docs/v5e: ICI 400 GBps bidirectional per chip, DCN 6.4 Tbps per 256-chip pod,
    # HBM 819 GBps; host link: the JAX scaling book's PCIe figure, 1.5e10 bytes/s per chip (AOT.md).
    "v5e": Network(ici_bidirectional=400e9, ici_links=4, dcn_per_chip=6.4e12 / 8 / 256, host_link=1.5e10, hbm=819e9),
    # cloud.google.com/tpu/docs/v5p: ICI 1200 GBps bidirectional per chip, DCN 50 Gbps per chip, HBM 2765 GBps;
    # host link as v5e.
    "v5p": Network(ici_bidirectional=1200e9, ici_links=6, dcn_per_chip=50e9 / 8, host_link=1.5e10, hbm=2765e9),
    # cloud.google.com/tpu/docs/v6e: ICI 800 GBps bidirectional over 4 ports, HBM 1638 GBps; DCN 100 Gb/s per
    # chip from the tpu7x page's comparison table; host link: the scaling book's v6e PCIe figure.
    "v6e": Network(ici_bidirectional=800e9, ici_links=4, dcn_per_chip=100e9 / 8, host_link=1.5e10, hbm=1638e9),
    # cloud.google.com/tpu/docs/tpu7x: ICI 1200 GB/s bidirectional per chip on a 3D torus (6 neighbours),
    # DCN 100 Gb/s per chip, HBM 7380 GB/s; no published host-link figure: v6e's, assumed (AOT.md).
    "tpu7x": Network(ici_bidirectional=1200e9, ici_links=6, dcn_per_chip=100e9 / 8, host_link=1.5e10, hbm=7380e9,
                     devices_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The physical constants fitted to the published MFU points (benchmarks/step_time_table.py):
  the share of the links' bandwidth a collective achieves, the DCN's achieved share and its
  latency per transfer, the share of peak a Pallas kernel reaches. One set for every model."""

  mxu_efficiency: float = 0.9
  matmul_cost: str = "flops"  # "flops": FLOPs / (peak x mxu_efficiency); "compiler": the compiler's cycles
  other_compute_scale: float = 1.0  # the compiler's cycle estimates of everything but matmuls, scaled
  ici_efficiency: float = 1.0
  ici_hop_latency_s: float = 1e-6
  dcn_efficiency: float = 1.0
  dcn_latency_s: float = 0.0
  kernel_efficiency: float = 0.6
  host_efficiency: float = 1.0
  # Slices meet at every step's cross-slice gradient exchange, so the step runs at the pace of the
  # slowest; the share of the step that costs per doubling of the slice count (the depth of a
  # reduction tree over the slices). No HLO op shows it (AOT.md, "The step-time model").
  slice_sync_share: float = 0.0

  def efficiency(self, resource: str) -> float:
    return {"ici": self.ici_efficiency, "dcn": self.dcn_efficiency, "host": self.host_efficiency,
            "kernel": self.kernel_efficiency, "mxu": self.mxu_efficiency}[resource]

  def latency(self, resource: str) -> float:
    return {"ici": self.ici_hop_latency_s, "dcn": self.dcn_latency_s}.get(resource, 0.0)


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Work on one resource (ici, dcn, host, kernel): seconds at the published figure, plus
  latency units (ring hops, DCN round trips) priced by the calibration."""

  resource: str
  base_s: float
  latency_units: float = 0.0
  axis: str = ""
  link: str = ""  # which physical links it occupies (work on other links runs at the same time)

  @property
  def queue(self) -> str:
    return f"{self.resource}:{self.link}"

  def seconds(self, cal: Calibration) -> float:
    return self.base_s / cal.efficiency(self.resource) + self.latency_units * cal.latency(self.resource)


def mesh_axes_of(group: Sequence[int], mesh: dict[str, int]) -> str:
  """Which mesh axes vary within a group of device ids (ids index the mesh's devices in order)."""
  names, sizes = list(mesh), list(mesh.values())
  varying: set[str] = set()
  first = _unravel(group[0], sizes)
  for device in group[1:]:
    index = _unravel(device, sizes)
    varying.update(names[k] for k in range(len(sizes)) if index[k] != first[k])
  return "+".join(n for n in names if n in varying) or "none"


def _unravel(flat: int, sizes: list[int]) -> list[int]:
  index = []
  for size in reversed(sizes):
    index.append(flat % size if size else 0)
    flat //= max(size, 1)
  return index[::-1]


def _ring_bandwidth(group: Sequence[int], target: StepTarget, net: Network) -> tuple[float, int, str]:
  """(one-way link bandwidth the group's ring uses per chip, ring steps, the torus axes it uses)."""
  coords = [target.coords[d] for d in group]
  extents = [len({c[axis] for c in coords}) for axis in range(len(target.shape))]
  steps = sum(size - 1 for size in extents if size > 1)
  used = "".join("xyz"[axis] for axis, size in enumerate(extents) if size > 1)
  return torus_ring_bandwidth(extents, target.shape, target.wrap, net), steps, used


def torus_ring_bandwidth(extents: Sequence[int], shape: Sequence[int], wrap: Sequence[bool], net: Network) -> float:
  """One-way link bandwidth per chip of a ring over a group that spans `extents[a]` chips along torus
  axis a: two links for each axis it spans as a whole wrapped ring, one for each it spans in part."""
  return sum(net.link_one_way * (2 if wrap[axis] and size == shape[axis] else 1)
             for axis, size in enumerate(extents) if size > 1)


def mesh_axis_extents(shape: Sequence[int], degrees: Mapping[str, int], axis: str) -> tuple[int, ...]:
  """The chips a group of mesh axis `axis` spans along each physical axis of a slice of `shape`, given
  every mesh axis's in-slice degree in mesh order (`degrees`). As jax's mesh_utils lays a mesh out:
  the innermost mesh axis first, each on as many whole physical axes as multiply to its degree.
  Where no such axes remain (jax then splits a physical axis), the group takes its degree from the
  largest axis left, spilling onto the next. The 4- and 8-chip slices' own ring orders are not modelled."""
  free = list(shape)  # 0: taken by an inner mesh axis
  for name in reversed(list(degrees)):
    degree = degrees[name]
    if degree <= 1:  # jax leaves it on no physical axis
      if name == axis:
        return (1,) * len(free)
      continue
    whole = None
    for count in range(len(free), 0, -1):
      whole = next((c for c in itertools.combinations(range(len(free)), count)
                    if all(free[i] for i in c) and math.prod(free[i] for i in c) == degree), None)
      if whole is not None:
        break
    if whole is None:
      return _spill([size or 1 for size in free], degrees[axis])
    if name == axis:
      return tuple(free[i] if i in whole else 1 for i in range(len(free)))
    free = [0 if i in whole else size for i, size in enumerate(free)]
  return (1,) * len(shape)


def _spill(free: Sequence[int], degree: int) -> tuple[int, ...]:
  extents, rest = [1] * len(free), degree
  for i in sorted(range(len(free)), key=lambda i: -free[i]):
    if rest > 1 and free[i] > 1:
      extents[i] = min(free[i], rest)
      rest = -(-rest // extents[i])
  return tuple(extents)


def mesh_axis_bandwidth(net: Network, shape: Sequence[int], wrap: Sequence[bool], degrees: Mapping[str, int],
                        axis: str, devices_per_chip: int = 1) -> float:
  """One-way bandwidth per device of a ring over one group of mesh axis `axis` in a slice, as
  `collective_transfer` prices it from the compiled groups' coordinates (so the analytical model and
  the step-time model price one network). `degrees` are the in-slice degrees in mesh order, counted in
  devices; a chip's devices (tpu7x's TensorCores) are its innermost physical axis and share its links."""
  physical = tuple(shape) + ((devices_per_chip,) if devices_per_chip > 1 else ())
  extents = mesh_axis_extents(physical, degrees, axis)
  chips, sharing = extents[:len(shape)], (extents[-1] if devices_per_chip > 1 else 1)
  if math.prod(chips) == 1:
    return net.hbm_per_device if sharing > 1 else math.inf
  return torus_ring_bandwidth(chips, shape, wrap, net) / sharing


def _permute_link(pair: Sequence[int], target: StepTarget) -> str:
  """The torus axis and direction of a permute's first source -> target pair (a bidirectional
  windowed matmul sends both ways at once, on different links)."""
  source, dest = target.coords[pair[0]], target.coords[pair[1]]
  for axis in range(len(target.shape)):
    delta = (dest[axis] - source[axis]) % max(target.shape[axis], 1)
    if delta:
      return "xyz"[axis] + ("+" if delta <= target.shape[axis] // 2 else "-")
  return "self"


def _devices_per_chip(group: Sequence[int], target: StepTarget) -> tuple[int, int]:
  """(the group's chips, its devices per chip): tpu7x's two TensorCores share a chip's coordinates."""
  per_chip = collections.Counter(target.coords[d] for d in group)
  return len(per_chip), max(per_chip.values(), default=1)


def collective_transfer(kind: str, result_bytes: int, group: Sequence[int], target: StepTarget,
                        net: Network, axis: str = "") -> Transfer:
  """One collective with the links to itself. `result_bytes` is what each device ends with
  (all-gather: the gathered array; reduce-scatter: its shard; all-reduce: the array)."""
  n = len(group)
  if n < 2:
    return Transfer("ici", 0.0)
  axis = axis or mesh_axes_of(group, target.mesh)
  slices = {target.coords[d][3] for d in group}
  if kind == "collective-permute":
    moved, passes = float(result_bytes), 1.0
  elif kind == "reduce-scatter":
    moved, passes = result_bytes * (n - 1.0), 1.0
  elif kind == "reduce-scatter-full":  # given the unscattered size (an all-reduce fused with its slice)
    moved, passes = result_bytes * (n - 1.0) / n, 1.0
  elif kind == "all-reduce":
    moved, passes = result_bytes * (n - 1.0) / n, 2.0
  elif kind in ("all-to-all", "ragged-all-to-all"):
    moved, passes = result_bytes * (n - 1.0) / n * max(1.0, n / 4), 1.0  # bisection-bound on a ring
  else:  # all-gather
    moved, passes = result_bytes * (n - 1.0) / n, 1.0
  if len(slices) > 1:  # across slices: each device's share of its host's DCN carries its part
    dcn_bytes = passes * moved * n / (n - 1.0) * (len(slices) - 1) / len(slices)
    return Transfer("dcn", dcn_bytes / net.dcn_per_device, passes, axis, "dcn")
  chips, sharing = _devices_per_chip(group, target)
  if chips == 1:  # the TensorCores of one chip: no ICI link; priced at the device's HBM bandwidth
    return Transfer("ici", passes * moved / net.hbm_per_device, 0.0, axis, "on-chip")
  if kind == "collective-permute":
    link = _permute_link(group, target)
    if link == "self":
      return Transfer("ici", moved / net.hbm_per_device, 0.0, axis, "on-chip")
    return Transfer("ici", moved / net.link_one_way, 1.0, axis, link)
  bandwidth, steps, used = _ring_bandwidth(group, target, net)
  # A chip's devices in the group share its links: each link carries all of their parts.
  return Transfer("ici", passes * moved * sharing / bandwidth, passes * steps, axis, used)


def dcn_all_reduce(array_bytes: int, num_slices: int, net: Network, axis: str = "data") -> Transfer:
  """A cross-slice all-reduce of `array_bytes` per chip (XLA's megascale send/recv) as a ring over
  the slices: every chip moves 2 (s - 1) / s of its array over its share of the host's DCN, in
  2 (s - 1) steps of one latency each."""
  if num_slices < 2:
    return Transfer("dcn", 0.0, 0.0, axis)
  moved = 2.0 * array_bytes * (num_slices - 1) / num_slices
  return Transfer("dcn", moved / net.dcn_per_device, 2.0 * (num_slices - 1), axis, "dcn")


def host_transfer(array_bytes: int, net: Network) -> Transfer:
  return Transfer("host", array_bytes / (net.host_link / net.devices_per_chip), 0.0, "host")
