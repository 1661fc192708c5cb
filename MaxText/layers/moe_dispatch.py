"""Expert parallelism by all-to-all (moe_dispatch=all_to_all): each device routes its own
tokens, sends only the routed rows to the devices that hold their experts, runs its experts
over what it received (experts.py), and sends the results back.

Everything below runs inside one `shard_map` over the mesh: tokens split over their batch axes
(which include `expert`), expert weights split over `expert` on the expert dimension and over
the tensor axes on the hidden (`mlp`) dimension; the weights' FSDP axes are all-gathered on
entry, as FSDP does, and the partial sums over the hidden dimension are added up (psum) on the
token-sized output at the end, the cheapest place (k times fewer rows than the assignments).

Two exchanges (shape letters of moe.py; X = expert-parallel degree, El = E / X local experts):

- **Capacity** (capacity_factor > 0, or dropless without sparse_matmul, where C = L): every
  sequence's [E, C, D] slot buffer, exactly as the gather path builds it, so both drop the same
  assignments. One fixed-size `all_to_all` sends each expert shard its experts' slots
  ([X, b, El, C, D]); the experts run as one batched matmul over [El, X·b, C, D]; a second
  all_to_all brings the outputs home. Runs everywhere.
- **Dropless grouped** (sparse_matmul=True): the b·L·k assignments sorted by expert; only the
  rows routed to shard j go to j. The row counts are exchanged first (an all-gather of
  [X, E] integers); the receiver groups the rows by its local experts, runs them as grouped
  matmuls (grouped_matmul.py), restores the arrival order and sends each row back to where it
  came from. The exchange is `jax.lax.ragged_all_to_all` (moe_all_to_all=ragged; TPU and GPU,
  moving only the routed rows) or, where XLA has no ragged all-to-all (CPU), the same exchange
  over a fixed-size `all_to_all` with one full-size chunk per peer (moe_all_to_all=padded:
  X times the bytes, same result). The receive buffer holds the worst case, X·b·L·min(k, El)
  rows (every peer's tokens routed here; a token picks an expert at most once), so nothing is
  ever dropped; with many experts per device that buffer, and the grouped matmul's static
  tiling over it, dominate memory and time. moe_ragged_buffer_factor > 0 sizes it to that many
  even shares (b·L·k rows) instead: rows that would land past it are not sent, i.e. dropped
  (each source's highest local experts first, sources in mesh order), and add zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from MaxText.platform import accelerators, sharding
from MaxText.errors import ConfigError
from MaxText.layers import experts
from MaxText.layers.grouped_matmul import GroupedMatmul
from MaxText.layers.mlp import Activation

# Platform families whose XLA backend implements ragged-all-to-all.
RAGGED_FAMILIES = ("tpu", "gpu")

Axes = tuple[str, ...]
# One device's exchange: (x [b, L, D], experts [b, L, k], weights [b, L, k], local kernels, local
# biases) -> (output [b, L, D], assignments it dropped); capacity_body or grouped_body with their
# keywords bound.
Body = Callable[[jax.Array, jax.Array, jax.Array, Sequence[jax.Array], Sequence[jax.Array]],
                tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """Where the tokens and expert weights live on the mesh, as this dispatch needs them."""
  mesh: Mesh
  token_axes: Axes  # the batch dimension's mesh axes (include the expert axes)
  expert_axes: Axes  # the expert dimension's
  mlp_axes: Axes  # the hidden dimension's, not shared with the tokens: partial sums over them

  @property
  def expert_degree(self) -> int:
    return _size(self.mesh, self.expert_axes)


def _size(mesh: Mesh, axes: Axes) -> int:
  shape = dict(mesh.shape)
  size = 1
  for axis in axes:
    size *= shape[axis]
  return size


def _axes(spec_entry: str | Sequence[str] | None) -> Axes:
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def expert_layout(mesh: Mesh, rules: sharding.Rules, batch: int, wi_shape: tuple[int, ...]) -> ExpertLayout | None:
  """The layout for tokens of `batch` rows and kernels of `wi_shape` [E, D, F], or None when the
  expert dimension is not split (nothing to exchange) or the tokens are not split over the
  expert axes too (a device would then hold tokens its expert peers hold as well)."""
  token_axes = _axes(sharding.logical_to_mesh_spec(("activation_batch",), rules, mesh, (batch,))[0])
  kernel_spec = sharding.logical_to_mesh_spec(("exp", "embed", "mlp"), rules, mesh, wi_shape)
  expert_axes = tuple(a for a in _axes(kernel_spec[0]) if dict(mesh.shape)[a] > 1)
  if not expert_axes or not set(expert_axes) <= set(token_axes):
    return None
  mlp_axes = tuple(a for a in _axes(kernel_spec[2]) if a not in token_axes and dict(mesh.shape)[a] > 1)
  token_axes = tuple(a for a in token_axes if dict(mesh.shape)[a] > 1)
  return ExpertLayout(mesh, token_axes, _axes(kernel_spec[0]), mlp_axes)


def select_exchange(name: str, platform: str) -> str:
  """`moe_all_to_all=name` on `platform`: ragged where XLA implements it, else padded."""
  if name == "auto":
    return "ragged" if accelerators.platform_family(platform) in RAGGED_FAMILIES else "padded"
  if name == "ragged" and accelerators.platform_family(platform) not in RAGGED_FAMILIES:
    raise ConfigError(f"moe_all_to_all=ragged needs XLA's ragged all-to-all, which the {platform} backend does "
                      "not implement; use moe_all_to_all=auto or padded")
  return name


def moe_all_to_all(layout: ExpertLayout, x_BLD: jax.Array, experts_BLk: jax.Array, weights_BLk: jax.Array,
                   kernels: Sequence[jax.Array], biases: Sequence[jax.Array] = (), *,
                   body: Body,
                   check_vma: bool = True) -> tuple[jax.Array, jax.Array]:
  """Runs `body(x, experts, weights, kernels, biases)` per device under `layout`: tokens split over
  their batch axes, kernels (and their biases, [E, out], if any) over the expert and hidden axes.
  Returns the tokens' [B, L, D] and the number of assignments the exchange dropped, over all
  devices (the body returns its own). `check_vma=False` for bodies whose kernels do not annotate
  how their outputs vary over the mesh (JAX's megablox Pallas call); the exchange is the same either way."""
  tokens = PartitionSpec(layout.token_axes or None)
  expert, mlp = layout.expert_axes or None, layout.mlp_axes or None
  # Under the pipeline's vmap over stages (spmd_axis_name="stage") JAX's batching of a vma-checked shard_map
  # leaves `stage` out of the out_specs it checks the outputs against, and refuses them; unchecked, the same.
  check_vma = check_vma and dict(layout.mesh.shape).get("stage", 1) == 1
  kernel_specs = tuple(PartitionSpec(expert, None, mlp) for _ in kernels[:-1]) + (PartitionSpec(expert, mlp, None),)
  bias_specs = tuple(PartitionSpec(expert, mlp) for _ in biases[:-1]) + (PartitionSpec(expert, None),) * bool(biases)

  def per_device(x: jax.Array, experts_bLk: jax.Array, weights: jax.Array, *local: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    local_kernels, local_biases = local[:len(kernels)], local[len(kernels):]
    if local_biases and layout.mlp_axes:
      # The output bias is whole on every hidden shard: add it on one, so the psum adds it once.
      first = (jax.lax.axis_index(layout.mlp_axes) == 0).astype(local_biases[-1].dtype)
      local_biases = (*local_biases[:-1], local_biases[-1] * first)
    y, dropped = body(x, experts_bLk, weights, local_kernels, local_biases)
    y = jax.lax.psum(y, layout.mlp_axes) if layout.mlp_axes else y
    return y, jax.lax.psum(dropped, layout.token_axes) if layout.token_axes else dropped

  return jax.shard_map(per_device, mesh=layout.mesh,
                       in_specs=(tokens, tokens, tokens, *kernel_specs, *bias_specs),
                       out_specs=(tokens, PartitionSpec()), check_vma=check_vma)(
                           x_BLD, experts_BLk, weights_BLk, *kernels, *biases)


def capacity_body(x_bLD: jax.Array, experts_bLk: jax.Array, weights_bLk: jax.Array, kernels: Sequence[jax.Array],
                  biases: Sequence[jax.Array], *, expert_axes: Axes, num_experts: int, capacity: int,
                  activations: Sequence[Activation]) -> tuple[jax.Array, jax.Array]:
  """One device's capacity exchange (module docstring). Its drops are the slots' (counted by
  moe.py), so it reports none of its own."""
  batch, _, dim = x_bLD.shape
  top_k = experts_bLk.shape[-1]
  degree = jax.lax.axis_size(expert_axes)
  local = num_experts // degree
  expert_bA, slot_bA = experts.assign_slots(experts_bLk, num_experts)
  weight_bA = experts.choice_major(weights_bLk)
  slots_bECD = experts.dispatch_slots(x_bLD, expert_bA, slot_bA, num_experts, capacity)
  send_XbECD = jnp.swapaxes(slots_bECD.reshape(batch, degree, local, capacity, dim), 0, 1)
  recv_XbECD = jax.lax.all_to_all(send_XbECD, expert_axes, 0, 0, tiled=True)  # [source shard, ...]
  x_EnCD = jnp.moveaxis(recv_XbECD, 2, 0).reshape(local, degree * batch, capacity, dim)
  out_EnCD = experts.dense_experts(x_EnCD, kernels, biases, activations)
  out_XbECD = jnp.moveaxis(out_EnCD.reshape(local, degree, batch, capacity, dim), 0, 2)
  home_XbECD = jax.lax.all_to_all(out_XbECD, expert_axes, 0, 0, tiled=True)  # [expert shard, ...]
  out_bECD = jnp.swapaxes(home_XbECD, 0, 1).reshape(batch, num_experts, capacity, dim)
  out_bLD = experts.combine_slots(out_bECD, expert_bA, slot_bA, weight_bA, top_k)
  return out_bLD, jnp.zeros((), jnp.float32)


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def padded_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                             send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                             axis_name: Axes) -> jax.Array:
  """`jax.lax.ragged_all_to_all`'s result over a fixed-size all_to_all: each peer's rows go in a
  chunk as long as the whole operand (for backends without a ragged all-to-all)."""
  rows, dim = operand.shape
  arange = jnp.arange(rows)
  index = jnp.clip(input_offsets[:, None] + arange[None, :], 0, rows - 1)
  sending = arange[None, :] < send_sizes[:, None]
  chunks_XND = jnp.where(sending[..., None], operand[index], jnp.zeros((), operand.dtype))
  got_XND = jax.lax.all_to_all(chunks_XND, axis_name, 0, 0, tiled=True)
  # Where each source asked its rows to land here.
  offsets_here = jax.lax.all_to_all(output_offsets[:, None], axis_name, 0, 0, tiled=True)[:, 0]
  target = offsets_here[:, None] + arange[None, :]
  target = jnp.where(arange[None, :] < recv_sizes[:, None], target, output.shape[0])  # out of range: dropped
  return output.at[target.reshape(-1)].set(got_XND.reshape(-1, dim), mode="drop", unique_indices=True)


def receive_rows(tokens: int, top_k: int, local_experts: int, degree: int, buffer_factor: float) -> int:
  """Rows of a device's receive buffer: the worst case (every peer's tokens routed here; a token
  picks an expert at most once), or `buffer_factor` times an even share (tokens·k) when > 0."""
  worst = degree * tokens * min(top_k, local_experts)
  if buffer_factor <= 0:
    return worst
  return max(1, min(worst, math.ceil(buffer_factor * tokens * top_k)))


def _exchange(kind: str) -> Callable[..., jax.Array]:
  if kind == "ragged":
    return jax.lax.ragged_all_to_all
  return padded_ragged_all_to_all


def grouped_body(x_bLD: jax.Array, experts_bLk: jax.Array, weights_bLk: jax.Array, kernels: Sequence[jax.Array],
                 biases: Sequence[jax.Array], *, expert_axes: Axes, num_experts: int,
                 activations: Sequence[Activation], matmul: GroupedMatmul,
                 exchange: str, buffer_factor: float = -1.0, custom_sort_vjp: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """One device's grouped exchange (module docstring); also the number of its assignments that
  did not fit the receive buffers."""
  batch, length, dim = x_bLD.shape
  top_k = experts_bLk.shape[-1]
  degree = jax.lax.axis_size(expert_axes)
  me = jax.lax.axis_index(expert_axes)
  local = num_experts // degree
  send_rows = functools.partial(_exchange(exchange), axis_name=expert_axes)

  # Sort this device's assignments by expert: the rows for shard j are then contiguous.
  x_AD, order_A, sizes_E = experts.sort_by_expert(x_bLD, experts_bLk, num_experts, custom_sort_vjp)
  # Everyone's per-expert counts: who sends what to whom, and where it lands.
  sizes_XE = jax.lax.all_gather(sizes_E, expert_axes)  # [source, E]
  rows_XX = jnp.sum(sizes_XE.reshape(degree, degree, local), axis=-1)  # [source, destination]
  land_XX = _exclusive_cumsum(rows_XX, axis=0)  # in each destination: rows of lower sources first
  recv_capacity = receive_rows(batch * length, top_k, local, degree, buffer_factor)
  # Rows that would land past the receive buffer are not sent (they contribute zeros).
  kept_XX = jnp.clip(recv_capacity - land_XX, 0, rows_XX)
  send_X, recv_X = kept_XX[me], kept_XX[:, me]
  send_offsets_X = _exclusive_cumsum(rows_XX[me])
  received_RD = send_rows(x_AD, jnp.zeros((recv_capacity, dim), x_AD.dtype), send_offsets_X, send_X,
                          land_XX[me], recv_X)

  # Arrival order is (source, local expert); group the rows by local expert for the matmuls.
  counts_XEl = jax.lax.dynamic_slice(sizes_XE, (0, me * local), (degree, local))
  counts_XEl = jnp.clip(recv_X[:, None] - _exclusive_cumsum(counts_XEl, axis=1), 0, counts_XEl)
  ends = jnp.cumsum(counts_XEl.reshape(-1))
  segment_R = jnp.searchsorted(ends, jnp.arange(recv_capacity), side="right")
  local_expert_R = jnp.where(segment_R < degree * local, segment_R % local, local)  # padding sorts last
  by_expert_R = jnp.argsort(local_expert_R, stable=True)
  arrival_R = jnp.argsort(by_expert_R)
  group_sizes = jnp.sum(counts_XEl, axis=0)
  if custom_sort_vjp:
    grouped_RD = experts.permute_rows(received_RD, by_expert_R, arrival_R)
  else:
    grouped_RD = received_RD[by_expert_R]
  out_RD = experts.grouped_mlp(grouped_RD, kernels, biases, group_sizes, activations, matmul)
  # arrival order again
  out_RD = experts.permute_rows(out_RD, arrival_R, by_expert_R) if custom_sort_vjp else out_RD[arrival_R]

  # Send every row back to the slot it left from.
  home_offsets_X = _exclusive_cumsum(rows_XX, axis=1)[:, me]  # where each source's rows to me started
  out_AD = send_rows(out_RD, jnp.zeros_like(x_AD), _exclusive_cumsum(recv_X), recv_X, home_offsets_X, send_X)
  out_bLD = experts.combine_sorted(out_AD, order_A, weights_bLk, custom_sort_vjp)
  return out_bLD, jnp.sum(rows_XX[me] - send_X).astype(jnp.float32)
