"""`quantize_weights`: the decoder stack's matmul kernels converted to 8-bit storage when an engine
takes its parameters (a checkpoint's at load, a policy's before each rollout), for decode, serve and
GRPO rollouts alike.

Converted: every projection of the decoder layers that runs in the `quantization` modes (attention's
query/key/value/out and MLA's pieces, the MLP's wi/wo, the MoE experts and shared experts). Kept in
float: the embedding, the output head, norms, biases, the MoE router, the MTP heads and the vision
tower. Each kernel becomes a `layers.weight_quantization.QuantizedWeight` at the same place in the
parameter tree: its values keep the kernel's sharding, its scales the kernel's with the contracting
axes unsplit (they have one entry per block there). Each kernel is converted by its own jitted call,
so the float tree and one converted kernel is the most memory a conversion holds at once. The jitted
converters are kept per (mode, axes, block, shardings, donation), so a later conversion of same-shaped
weights (each GRPO rollout's policy) runs the programs the first one compiled.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import ExpertKernel
from MaxText.layers.weight_quantization import QuantizedWeight, block_widths, quantize_weight
from MaxText.models import LAYER_STACKS, ModelSpec, Params, build_model_spec, stacked_layer_key

Path = tuple[str, ...]


def _in_stack(path: Path) -> bool:
  return bool(path) and (path[0] in LAYER_STACKS or stacked_layer_key(str(path[0])) is not None)


def _get(tree: Params, path: Path) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def replace_leaves(tree: Params, updates: dict[Path, Any]) -> Params:
  """A copy of the nested dict `tree` with the leaves at `updates`' paths replaced (others shared)."""
  out = dict(tree)
  children: dict[str, dict[Path, Any]] = {}
  for path, value in updates.items():
    if len(path) == 1:
      out[path[0]] = value
    else:
      children.setdefault(path[0], {})[path[1:]] = value
  for key, sub in children.items():
    out[key] = replace_leaves(tree[key], sub)
  return out


def kernel_contract_axes(spec: ModelSpec) -> dict[Path, tuple[int, ...]]:
  """Each converted kernel's path in the parameter tree -> its contracting axes there (after any
  leading layer axes of a scanned stack)."""
  model = nnx.merge(spec.graphdef, spec.abstract_params)
  found: dict[Path, tuple[int, ...]] = {}
  for graph_path, node in nnx.iter_graph(model):
    path = tuple(str(p) for p in graph_path)
    if not _in_stack(path):
      continue
    if isinstance(node, DenseGeneral) and node.quantize:
      ndim = len(_get(spec.abstract_params, path + ("kernel",)).shape)
      lead = ndim - len(node.in_shape) - len(node.out_shape)
      found[path + ("kernel",)] = tuple(range(lead, lead + len(node.in_shape)))
    elif isinstance(node, ExpertKernel):  # [..., E, in, out]
      ndim = len(_get(spec.abstract_params, path + ("kernel",)).shape)
      found[path + ("kernel",)] = (ndim - 2,)
  return found


@functools.lru_cache(maxsize=None)
def _quantize_fn(mode: str, contract_axes: tuple[int, ...], block: int) -> Callable[[jax.Array], QuantizedWeight]:
  """One function object per static arguments: jax caches traces by the function's identity."""
  return functools.partial(quantize_weight, mode=mode, contract_axes=contract_axes, block=block)


def _convert_and_check(kernel: jax.Array, mode: str, contract_axes: tuple[int, ...],
                       block: int) -> tuple[QuantizedWeight, jax.Array]:
  """The converted kernel and whether it is finite: a NaN or inf weight makes its block's scale NaN,
  so the scales (a few per output channel) answer for the whole kernel."""
  converted = quantize_weight(kernel, mode, contract_axes, block)
  return converted, jnp.all(jnp.isfinite(converted.scale))


# Bounded: every entry holds its compiled programs, and tests build engines on many meshes.
@functools.lru_cache(maxsize=256)
def _jitted_converter(mode: str, contract_axes: tuple[int, ...], block: int, values: Any, scale: Any, dtype: Any,
                      donate: bool) -> Callable[[jax.Array], tuple[QuantizedWeight, jax.Array]]:
  """The jitted conversion of one kernel into `values`/`scale` shardings (and its finiteness flag,
  replicated); one per key, so its compile cache outlives the call that made it."""
  flag = NamedSharding(values.mesh, PartitionSpec()) if isinstance(values, NamedSharding) else values
  convert = functools.partial(_convert_and_check, mode=mode, contract_axes=contract_axes, block=block)
  return jax.jit(convert, out_shardings=(QuantizedWeight(values, scale, dtype), flag),
                 donate_argnums=(0,) if donate else ())


@dataclasses.dataclass(frozen=True)
class WeightQuantizer:
  """Converts a parameter tree of `spec`'s model to `mode` storage (blocks of `block` input rows, 0:
  one scale per output channel)."""

  mode: str
  block: int
  contract_axes: dict[Path, tuple[int, ...]]

  @classmethod
  def for_model(cls, spec: ModelSpec, mode: str, block: int) -> "WeightQuantizer":
    axes = kernel_contract_axes(spec)
    for path, contract in axes.items():
      try:
        block_widths(_get(spec.abstract_params, path).shape, contract, block)
      except ValueError as e:
        raise UserError(f"quantize_weights_block={block} {e} of {'/'.join(path)}; choose a "
                        "block that divides every kernel's input axes, or 0 (one scale per output channel)") from None
    return cls(mode, block, axes)

  def _convert(self, path: Path) -> Callable[[jax.Array], QuantizedWeight]:
    return _quantize_fn(self.mode, self.contract_axes[path], self.block)

  def shardings(self, abstract: Any, sharding: Any, path: Path) -> QuantizedWeight:
    """Where a converted kernel lives: values like the kernel, scales unsplit on contracting axes."""
    shape = jax.eval_shape(self._convert(path), abstract)
    if not isinstance(sharding, NamedSharding):
      return QuantizedWeight(sharding, sharding, shape.dtype)
    spec = list(sharding.spec) + [None] * (len(abstract.shape) - len(sharding.spec))
    scale_spec = [None if axis in self.contract_axes[path] else s for axis, s in enumerate(spec)]
    return QuantizedWeight(sharding, NamedSharding(sharding.mesh, PartitionSpec(*scale_spec)), shape.dtype)

  def __call__(self, params: Params, shardings: Params, donate: bool = False) -> Params:
    """`params` (laid out as `shardings`) with every converted kernel in 8-bit storage; `donate`:
    the float kernels' buffers may be reused (the caller holds no other reference to them)."""
    updates: dict[Path, Any] = {}
    finite: dict[Path, jax.Array] = {}
    for path in self.contract_axes:
      kernel, sharding = _get(params, path), _get(shardings, path)
      if isinstance(kernel, QuantizedWeight):
        continue  # already converted
      out = self.shardings(kernel, sharding, path)
      convert = _jitted_converter(self.mode, self.contract_axes[path], self.block, out.values, out.scale, out.dtype,
                                  donate)
      updates[path], finite[path] = convert(kernel)
    # One read of the flags once every kernel is dispatched. A NaN or inf weight (a corrupt checkpoint, a
    # diverged policy) would decode as NaN logits, i.e. arbitrary tokens with no sign of why: say where it is.
    bad = [path for path, ok in zip(finite, jax.device_get(list(finite.values()))) if not ok]
    if bad:
      raise UserError(f"quantize_weights={self.mode}: the parameters hold NaN or inf weights in {len(bad)} of the "
                      f"{len(finite)} kernels converted, first {'/'.join(bad[0])}; load a checkpoint whose weights are "
                      "finite (the float model would decode them as NaN logits too)")
    return replace_leaves(params, updates)

  def describe(self, abstract_params: Params, params: Params) -> str:
    """One line on what the conversion saved: the parameters' bytes now and as float."""
    return (f"quantize_weights={self.mode}: {len(self.contract_axes)} kernel arrays of the decoder stored 8-bit; "
            f"the parameters take {weight_bytes(params) / 2**20:.2f} MiB ({weight_bytes(abstract_params) / 2**20:.2f} "
            "MiB in float)")

  def abstract(self, abstract_params: Params) -> Params:
    """Shapes with shardings (`jax.ShapeDtypeStruct`s whose `sharding` is set) as `__call__` returns
    them: what an ahead-of-time compile of the decode step takes."""
    updates: dict[Path, Any] = {}
    for path in self.contract_axes:
      leaf = _get(abstract_params, path)
      out = jax.eval_shape(self._convert(path), leaf)
      where = self.shardings(leaf, leaf.sharding, path)
      updates[path] = QuantizedWeight(jax.ShapeDtypeStruct(out.values.shape, out.values.dtype, sharding=where.values),
                                      jax.ShapeDtypeStruct(out.scale.shape, out.scale.dtype, sharding=where.scale),
                                      out.dtype)
    return replace_leaves(abstract_params, updates)


def weight_bytes(params: Params) -> int:
  """Bytes of every parameter array (a converted kernel: its values and its scales)."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def parameter_count(params: Params) -> int:
  """Parameters in the tree, a converted kernel counted once (its values; not its scales)."""
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
  return sum(int(x.values.size if isinstance(x, QuantizedWeight) else x.size) for x in leaves)


def for_engine(spec: ModelSpec, mode: str, block: int) -> WeightQuantizer | None:
  """The converter an engine applies to the parameters it takes; None when quantize_weights is ""."""
  return WeightQuantizer.for_model(spec, mode, block) if mode else None


def rollout_preparer(config: Config, shardings: Params) -> Callable[[Params, bool], Params] | None:
  """GRPO's weight sync's `prepare` (rl/rollout_mesh.WeightSync): the policy's parameters converted as
  the rollout engine's (laid out as `shardings`, its param_shardings) are; None without quantize_weights."""
  decode = config.decode
  if not decode.quantize_weights:
    return None
  quantizer = WeightQuantizer.for_model(build_model_spec(config.model), decode.quantize_weights,
                                        decode.quantize_weights_block)
  return lambda params, donate: quantizer(params, shardings, donate)
