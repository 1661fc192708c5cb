"""Device mesh, logical-axis rules and the shardings derived from them.

Layers name tensor dimensions logically ("embed", "activation_batch", ...);
`logical_axis_rules` alone decides which mesh axes those names map to.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TypeVar

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.platform import accelerators
from MaxText.platform.mesh_axes import HYBRID_RING_SLICE, HYBRID_RINGS, MESH_AXES, REPLICATED_PARAMETER_AXES
from MaxText.errors import ConfigError

if TYPE_CHECKING:  # the mesh keys' group: configuration builds on this package, not the other way
  from MaxText.configuration.config_groups import MeshConfig

# A tree (of arrays, abstract arrays, shardings or logical names) whose structure a call keeps.
Tree = TypeVar("Tree")
Rules = tuple[tuple[str, tuple[str, ...]], ...]
LogicalNames = tuple[str | None, ...]


def device_array(mesh_config: MeshConfig, devices: Sequence[Any]) -> np.ndarray:
  """Devices arranged in the mesh shape (ici × dcn per axis).

  Several slices (or, off TPU, several processes) get a hybrid layout whose dcn
  degrees span slices and whose ici degrees stay inside one.
  """
  ici = [degree for _, degree in mesh_config.ici]
  dcn = [degree for _, degree in mesh_config.dcn]
  split = mesh_config.allow_split_physical_axes
  try:
    if mesh_config.custom_mesh:
      return _hybrid_rings(mesh_config.custom_mesh, ici, dcn, devices)
    if math.prod(dcn) > 1:
      on_tpu = accelerators.device_family(devices[0]) == "tpu"
      return mesh_utils.create_hybrid_device_mesh(
          ici, dcn, devices, process_is_granule=not on_tpu, allow_split_physical_axes=split)
    return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=split)
  except (AssertionError, ValueError, NotImplementedError) as e:
    if math.prod(dcn) == 1 and not _whole_block(devices):
      # Part of a slice that is no physical block (a GRPO run's training chips beside its rollout
      # chips on every host): there is no torus to follow, so the devices go in the order given.
      return np.asarray(devices, dtype=object).reshape(ici)
    unsplit = "" if split else " without splitting a physical axis (allow_split_physical_axes=False; True allows it)"
    raise ConfigError(f"cannot lay out mesh ici={ici} dcn={dcn} on {len(devices)} devices{unsplit}: {e}") from None


def ring_order(grid: np.ndarray, ring: int) -> np.ndarray:
  """A 2-D grid of chips (rows of even count) as rows of `ring` chips: each a closed loop over a
  2 x ring/2 block of neighbours, along the block's top row and back along its bottom row."""
  width = ring // 2
  down = np.repeat([0, 1], width)
  across = np.concatenate([np.arange(width), np.arange(width)[::-1]])
  rows = 2 * np.arange(grid.shape[0] // 2)[:, None, None] + down
  cols = width * np.arange(grid.shape[1] // width)[None, :, None] + across
  return grid[rows, cols].reshape(-1, ring)


def _hybrid_rings(name: str, ici: list[int], dcn: list[int], devices: Sequence[Any]) -> np.ndarray:
  """custom_mesh=`name`: in each slice, its chips' 16 x 16 grid as rings of neighbours, the ring on the
  ici axis of the ring's degree and the rings along the other; the slices over the dcn degrees."""
  rings, size = HYBRID_RINGS[name]
  by_slice: dict[int, list[Any]] = {}
  for device in devices:
    by_slice.setdefault(getattr(device, "slice_index", None) or 0, []).append(device)
  if len(by_slice) != math.prod(dcn):
    raise ValueError(f"{len(by_slice)} slices for dcn degrees {dcn}")
  laid_out = []
  for index in sorted(by_slice):
    # The rings follow a 16 x 16 grid of chips; another slice of 256 (v5p's 4 x 8 x 8) fails in jax with advice
    # (allow_split_physical_axes=True) that cannot help here.
    box = _chip_box(by_slice[index])
    if box is not None and tuple(d for d in box if d > 1) != HYBRID_RING_SLICE:
      raise ConfigError(f"custom_mesh={name} lays out a slice of {' x '.join(map(str, HYBRID_RING_SLICE))} chips "
                        f"(v6e-256); this slice's chips are {' x '.join(map(str, box))}; drop custom_mesh")
    grid = mesh_utils.create_device_mesh(list(HYBRID_RING_SLICE), by_slice[index], allow_split_physical_axes=False)
    ordered = ring_order(grid, size)  # (rings, size)
    laid_out.append((ordered if ici.index(rings) < ici.index(size) else ordered.T).reshape(ici))
  # As jax's hybrid meshes: axis k of the result is dcn[k] blocks of ici[k].
  stacked = np.asarray(laid_out, dtype=object).reshape(dcn + ici)
  interleaved = stacked.transpose([i for k in range(len(ici)) for i in (k, len(ici) + k)])
  return interleaved.reshape([d * i for d, i in zip(dcn, ici)])


def _chip_box(devices: Sequence[Any]) -> tuple[int, ...] | None:
  """The extent of the TPU devices' chip coordinates along each physical axis; None for devices without them."""
  coords = {tuple(getattr(d, "coords", ())) for d in devices}
  if not all(coords) or len(coords) < 1:
    return None
  return tuple(max(c[i] for c in coords) - min(c[i] for c in coords) + 1 for i in range(len(next(iter(coords)))))


def _whole_block(devices: Sequence[Any]) -> bool:
  """Whether TPU devices fill the box of their chip coordinates (True for devices without them)."""
  box = _chip_box(devices)
  return box is None or math.prod(box) == len({tuple(d.coords) for d in devices})


def create_mesh(mesh_config: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
  """The (data, stage, fsdp, fsdp_transpose, sequence, tensor, expert) mesh."""
  devices = list(jax.devices() if devices is None else devices)
  return Mesh(device_array(mesh_config, devices), MESH_AXES)


def logical_to_mesh_spec(
    names: LogicalNames, rules: Rules, mesh: Mesh | None = None, shape: Sequence[int] | None = None
) -> PartitionSpec:
  """Maps logical dimension names to a PartitionSpec.

  For each name the first rule whose mesh axes are not yet used by an earlier
  dimension wins (the flax/MaxText convention). When `mesh` and `shape` are
  given, mesh axes that would not divide the dimension evenly are dropped
  (the dimension is then replicated over them; `check_sharding_tolerance`
  decides whether that is acceptable).
  """
  used: set[str] = set()
  spec: list[Any] = []
  for dim, name in enumerate(names):
    if name is None:
      spec.append(None)
      continue
    candidates = [axes for rule_name, axes in rules if rule_name == name]
    if not candidates:
      raise ConfigError(f"logical axis {name!r} has no entry in logical_axis_rules; add one (use [] to replicate)")
    chosen: tuple[str, ...] = ()
    for axes in candidates:
      if not any(axis in used for axis in axes):
        chosen = axes
        break
    if mesh is not None and shape is not None:
      kept, product = [], 1
      for axis in chosen:
        size = mesh.shape[axis]
        if size > 1 and shape[dim] % (product * size) == 0:
          kept.append(axis)
          product *= size
      chosen = tuple(kept)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*spec)


def named_shardings(abstract_tree: Tree, names_tree: Tree, mesh: Mesh, rules: Rules) -> Tree:
  """NamedShardings for a tree of arrays/ShapeDtypeStructs and a matching tree of logical names."""
  return jax.tree.map(
      lambda x, names: NamedSharding(mesh, logical_to_mesh_spec(names, rules, mesh, x.shape)),
      abstract_tree, names_tree, is_leaf=lambda n: isinstance(n, tuple),
  )


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def with_shardings(abstract: Tree, shardings: Tree) -> Tree:
  """ShapeDtypeStructs that carry the target shardings (what Orbax restores into, what AOT lowers for)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def on_host(x: jax.Array | np.ndarray) -> np.ndarray:
  """A global array's values on every process (one sharded across processes is gathered)."""
  if isinstance(x, np.ndarray) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def batch_sharding(mesh: Mesh, data_axes: Sequence[str]) -> NamedSharding:
  """Sharding of a [batch, length] input: batch split over `data_sharding` axes."""
  axes = tuple(a for a in data_axes if mesh.shape[a] > 1)
  return NamedSharding(mesh, PartitionSpec(axes if axes else None, None))


def for_rank(batch: NamedSharding, rank: int) -> NamedSharding:
  """`batch_sharding` for a batch field of another rank (e.g. one float per row: rank 1)."""
  return NamedSharding(batch.mesh, PartitionSpec(*tuple(batch.spec)[:1], *([None] * (rank - 1))))


def _unsharded_leaves(abstract_tree: object, shardings: object, mesh: Mesh) -> tuple[int, list[tuple[int, str]]]:
  """(total bytes, [(bytes, "path [shape]")] of each leaf not split over every non-data mesh axis)."""
  ignored = REPLICATED_PARAMETER_AXES
  target = math.prod(size for axis, size in mesh.shape.items() if axis not in ignored)
  total, unsharded = 0, []
  leaves = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
  for (path, x), sharding in zip(leaves, jax.tree.leaves(shardings)):
    nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
    shards = math.prod(mesh.shape[a] for entry in sharding.spec if entry
                       for a in ((entry,) if isinstance(entry, str) else entry) if a not in ignored)
    total += nbytes
    if shards < target:
      name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
      unsharded.append((nbytes, f"{name} {list(x.shape)}"))
  return total, unsharded


def unsharded_fraction(abstract_tree: object, shardings: object, mesh: Mesh) -> float:
  """Fraction of bytes not split over every non-data mesh axis (pure data parallelism
  replicates parameters by design, so the data axis does not count; nor does the pipeline
  `stage` axis, over which only the layer stack is split and embeddings are replicated by design,
  nor `autoregressive`, which splits only the decode KV cache)."""
  total, unsharded = _unsharded_leaves(abstract_tree, shardings, mesh)
  return sum(n for n, _ in unsharded) / total if total else 0.0


def check_sharding_tolerance(abstract_tree: object, shardings: object, mesh: Mesh, tolerance: float) -> float:
  total, unsharded = _unsharded_leaves(abstract_tree, shardings, mesh)
  fraction = sum(n for n, _ in unsharded) / total if total else 0.0
  if fraction > tolerance:
    # The largest culprits, so that a user sees what to change (e.g. LoRA adapters of a rank far above the
    # model's widths, whose rank axis no mesh axis splits).
    largest = sorted(unsharded, key=lambda item: (-item[0], item[1]))[:3]
    named = ", ".join(f"{what} {n / total:.1%}" for n, what in largest)
    lora = ("; LoRA adapters (lora_a, lora_b) are among them: their rank axis is never split, so a lora_rank near or "
            "above the model's widths leaves them whole on every device: lower lora_rank"
            if any(what.split(" ")[0].rsplit("/", 1)[-1] in ("lora_a", "lora_b") for _, what in largest) else "")
    raise ConfigError(
        f"{fraction:.1%} of parameter bytes are not fully sharded over mesh {dict(mesh.shape)} "
        f"(sharding_tolerance={tolerance}; largest: {named}){lora}; adjust the parallelism degrees so they divide "
        "the model dimensions, or raise sharding_tolerance")
  return fraction


# ---- activation constraints: layers call `constrain`; a run sets the mesh and rules once.
class _Unsharded:
  """The `unsharded()` context: layers run without activation constraints on purpose."""


_UNSHARDED = _Unsharded()
_ACTIVATION_CONTEXT: contextvars.ContextVar[tuple[Mesh, Rules] | _Unsharded | None] = contextvars.ContextVar(
    "activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """While tracing inside this context, `constrain` pins activations to the mesh."""
  token = _ACTIVATION_CONTEXT.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_CONTEXT.reset(token)


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
  """Runs the layers without activation constraints, on purpose: one device, a reference
  comparison, a unit test. Outside both contexts `constrain` refuses to guess."""
  token = _ACTIVATION_CONTEXT.set(_UNSHARDED)
  try:
    yield
  finally:
    _ACTIVATION_CONTEXT.reset(token)


def current_activation_context() -> tuple[Mesh, Rules] | None:
  """The (mesh, rules) set by the enclosing `activation_sharding`, or None under `unsharded`
  (e.g. for layers that need the mesh to build a shard_map)."""
  context = _ACTIVATION_CONTEXT.get()
  return None if isinstance(context, _Unsharded) else context


def trace_platform() -> str:
  """The platform family the traced program is for: the activation mesh's devices (a TPU topology
  during an AOT compile on CPU), else JAX's default backend."""
  context = current_activation_context()
  if context is not None:
    return accelerators.device_family(context[0].devices.flat[0])
  return accelerators.platform_family(jax.default_backend())


def constrain(x: jax.Array, names: LogicalNames) -> jax.Array:
  """with_sharding_constraint by logical names inside `activation_sharding`; unchanged inside
  `unsharded`; an error outside both (a model call that silently loses its sharding)."""
  context = _ACTIVATION_CONTEXT.get()
  if context is None:
    raise RuntimeError("a layer ran outside sharding.activation_sharding(mesh, rules) and sharding.unsharded(): "
                       "wrap the model call in one of them")
  if isinstance(context, _Unsharded):
    return x
  mesh, rules = context
  spec = logical_to_mesh_spec(names, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
