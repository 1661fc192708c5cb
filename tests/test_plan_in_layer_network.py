"""The analytical model prices tensor/sequence/expert exchanges on the links one group of that mesh
axis has, as the step-time model prices the compiled collective (network.mesh_axis_bandwidth)."""

import dataclasses
import itertools

import numpy as np
import pytest
from jax.experimental import mesh_utils

from MaxText.aot import plan_model
from MaxText.aot.step_time import network
from MaxText.aot.step_time.saved import StepTarget
from MaxText.platform import accelerators
from MaxText.platform.mesh_axes import MESH_AXES

from tests.test_plan import SMALL, analytic


@dataclasses.dataclass(frozen=True)
class FakeTpu:
  id: int
  coords: tuple[int, int, int]
  device_kind: str
  core_on_chip: int = 0
  platform: str = "tpu"
  slice_index: int = 0
  process_index: int = 0


def jax_layout(topology: accelerators.TpuTopology, degrees: dict[str, int]) -> tuple[np.ndarray, StepTarget]:
  """The devices as jax's mesh_utils lays the mesh out on `topology`'s torus, and their StepTarget."""
  shape = tuple(topology.shape) + (1,) * (3 - len(topology.shape))
  devices = [FakeTpu(i, (x, y, z), topology.generation.device_kind)
             for i, (z, y, x) in enumerate(itertools.product(*(range(n) for n in reversed(shape))))]
  grid = mesh_utils.create_device_mesh([degrees[a] for a in MESH_AXES], devices, allow_split_physical_axes=True)
  target = StepTarget.from_devices(topology, 1, list(grid.flat), degrees, 1.0, 0.0)
  return grid, target


@pytest.mark.parametrize("name, mesh", [
    ("v5p-128", dict(tensor=2, fsdp=32)), ("v5p-128", dict(tensor=4, fsdp=16)), ("v5p-128", dict(tensor=16, fsdp=4)),
    ("v5p-128", dict(sequence=2, tensor=4, fsdp=8)), ("v5e-256", dict(tensor=2, fsdp=128)),
    ("v5e-256", dict(tensor=16, fsdp=16)), ("v5e-32", dict(tensor=4, fsdp=8)), ("v5e-32", dict(expert=8, fsdp=4)),
    ("v5p-64", dict(tensor=4, fsdp=8)), ("v5p-256", dict(tensor=2, fsdp=64)), ("v5p-128", dict(tensor=8, fsdp=8)),
])
def test_a_mesh_axis_group_gets_the_links_of_the_group_jax_lays_out(name: str, mesh: dict[str, int]) -> None:
  topology = accelerators.tpu_topology(name)
  degrees = {a: mesh.get(a, 1) for a in MESH_AXES}
  grid, target = jax_layout(topology, degrees)
  net = network.NETWORKS[topology.generation.name]
  for axis in ("tensor", "sequence", "expert", "fsdp"):
    if degrees[axis] == 1:
      continue
    # Replica groups name devices by their place in the mesh (StepTarget.coords' order).
    places = np.arange(grid.size).reshape(grid.shape)
    group = list(np.moveaxis(places, MESH_AXES.index(axis), -1).reshape(-1, degrees[axis])[0])
    compiled = network._ring_bandwidth(group, target, net)[0]  # noqa: SLF001  (what the step-time model prices)
    assert network.mesh_axis_bandwidth(net, topology.shape, topology.wrap, degrees, axis) == compiled, axis


def test_tensor_exchanges_cost_the_bytes_over_one_link_of_one_torus_axis(monkeypatch: pytest.MonkeyPatch) -> None:
  """tensor=2 on a 4x4x4 v5p slice spans part of one torus axis: one link one way, not the chip's six. data=2
  keeps the FSDP group at 16 chips, whose reductions overlap compute (test_plan_fsdp_sync)."""
  settings = dict(SMALL, per_device_batch_size=4, remat_policy="minimal", ici_tensor_parallelism=2,
                  ici_fsdp_parallelism=16, ici_data_parallelism=2)
  first = analytic("v5p-128", **settings)
  net = network.NETWORKS["v5p"]
  # Halving the per-link figure (the same chip total over twice the links) moves only the in-layer exchanges.
  monkeypatch.setitem(network.NETWORKS, "v5p", dataclasses.replace(net, ici_links=2 * net.ici_links))
  slower = analytic("v5p-128", **settings)
  tokens_per_chip, tensor, emb, layers = 4 * 256, 2, 512, 4
  exchanged = tokens_per_chip * tensor * emb * 2 * (tensor - 1) / tensor
  passes = layers * plan_model.TENSOR_LAYER_PASSES + plan_model.TENSOR_OUTSIDE_PASSES
  assert slower.ici_s - first.ici_s == pytest.approx(passes * exchanged / net.link_one_way)
  assert slower.step_s - first.step_s == pytest.approx(passes * exchanged / net.link_one_way)


def test_sequence_exchanges_cost_four_passes_of_the_keys_and_values_over_one_link(monkeypatch: pytest.MonkeyPatch) -> None:
  """sequence=2 on a 4x4x4 v5p slice: the all_gather strategy's 4 passes a layer, over one link. data=4 keeps
  the FSDP group (fsdp x sequence) at 16 chips, whose reductions overlap compute (test_plan_fsdp_sync)."""
  settings = dict(SMALL, per_device_batch_size=4, remat_policy="minimal", ici_sequence_parallelism=2,
                  ici_fsdp_parallelism=8, ici_data_parallelism=4)
  first = analytic("v5p-128", **settings)
  net = network.NETWORKS["v5p"]
  monkeypatch.setitem(network.NETWORKS, "v5p", dataclasses.replace(net, ici_links=2 * net.ici_links))
  slower = analytic("v5p-128", **settings)
  tokens_per_chip, seq, kv_width, layers = 4 * 256, 2, 4 * 128, 4
  exchanged = tokens_per_chip * seq * 2 * kv_width * 2 * (seq - 1) / seq
  assert slower.step_s - first.step_s == pytest.approx(layers * 4 * exchanged / net.link_one_way)
