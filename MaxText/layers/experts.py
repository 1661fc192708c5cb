"""The experts' computation, shared by both MoE dispatches (moe.py's gather path and
moe_dispatch.py's all-to-all): routed tokens in, each expert's gated MLP over the tokens routed
to it, each token's weighted sum of its experts' outputs out. Routing is moe.py's; moving rows
between devices is the dispatches' (no collective and no sharding constraint here).

Shape letters of moe.py: E experts, k experts per token, A = k·L assignments per sequence (or
b·L·k sorted rows), C capacity. Kernels are (wi_0, ..., wo): [E, in, out] each; biases are ()
or theirs, [E, out] each, added after each projection (GPT-OSS).

Two layouts of the assignments:
- **Capacity slots**: the assignments in priority order (choice-major: every token's first choice,
  then every second choice) each get a slot in their expert; `dispatch_slots` copies the tokens
  into [B, E, C, D] slot buffers, `dense_experts` runs every expert over its slots as one batched
  matmul per projection, `combine_slots` reads the slots back. A slot >= C is a dropped assignment.
- **Sorted rows** (dropless grouped): the assignments sorted by expert (`sort_by_expert`), one
  grouped matmul per projection over the rows (`grouped_mlp`, a kernel from grouped_matmul.py),
  unsorted and weighted (`combine_sorted`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.configuration import remat_policies
from MaxText.layers import quantization
from MaxText.layers.grouped_matmul import GroupedMatmul
from MaxText.layers.mlp import Activation

# "ebcd,edf->ebcf" and "ebcf,efd->ebcd" as dot_general: contract the last activation dim with the
# kernel's middle one, expert dim batched.
_EXPERT_DIMS = (((3,), (1,)), ((0,), (0,)))


def _named(x: jax.Array, moe_name: str, grouped: bool) -> jax.Array:
  """`x` named for remat policies as upstream's moe.py names it: the dense MLP's name inside the
  expert's own (remat_policies.EXPERT_ALSO_NAMED), so a preset keeping mlpwi_0 or mlpwo keeps the
  experts' too; on the grouped (sparse_matmul) path, as there, wi_1 carries only its moe_ name."""
  if not (grouped and moe_name in remat_policies.SPARSE_MATMUL_ONLY_MOE):
    x = checkpoint_name(x, remat_policies.EXPERT_ALSO_NAMED[moe_name])
  return checkpoint_name(x, moe_name)


def _gated_mlp(x: jax.Array, project: Callable[[jax.Array, int], jax.Array],
               activations: Sequence[Activation], grouped: bool) -> jax.Array:
  """The gated MLP with `project(x, i)` as projection i: the product of the activated input
  projections, then the output projection (named for rematerialisation policies)."""
  hidden: jax.Array | None = None
  for i, activation in enumerate(activations):
    h = activation(_named(project(x, i), f"moe_mlpwi_{i}", grouped))
    hidden = h if hidden is None else hidden * h
  assert hidden is not None  # mlp_activations is non-empty (config)
  return _named(project(hidden, len(activations)), "moe_mlpwo", grouped)


# ---------------------------------------------------------------- capacity slots


def choice_major(a_BLk: jax.Array) -> jax.Array:
  """[B, L, k] -> [B, A] in priority order: assignment a is choice a // L of token a % L."""
  return jnp.swapaxes(a_BLk, 1, 2).reshape(a_BLk.shape[0], -1)


def assign_slots(experts_BLk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Each assignment's slot in its expert: a running count of earlier assignments (in priority
  order) to the same expert. Returns (expert [B, A], slot [B, A]); slot >= capacity means dropped.
  """
  expert_BA = choice_major(experts_BLk)
  onehot_BAE = jax.nn.one_hot(expert_BA, num_experts, dtype=jnp.int32)
  slot_BA = jnp.sum((jnp.cumsum(onehot_BAE, axis=1) - 1) * onehot_BAE, axis=-1)
  return expert_BA, slot_BA


def _dispatch_one(x_LD: jax.Array, expert_A: jax.Array, slot_A: jax.Array, num_experts: int,
                  capacity: int, top_k: int) -> jax.Array:
  """One sequence's tokens copied into their experts' slots: [E, C, D] (empty slots are 0)."""
  x_AD = jnp.tile(x_LD, (top_k, 1))
  buffer_ECD = jnp.zeros((num_experts, capacity, x_LD.shape[-1]), x_LD.dtype)
  return buffer_ECD.at[expert_A, slot_A].set(x_AD, mode="drop", unique_indices=True)


def _combine_one(out_ECD: jax.Array, expert_A: jax.Array, slot_A: jax.Array, weight_A: jax.Array,
                 top_k: int) -> jax.Array:
  """Each token's weighted sum of its experts' outputs: [L, D]; dropped assignments read 0."""
  rows_AD = out_ECD.at[expert_A, slot_A].get(mode="fill", fill_value=0)
  rows_AD = rows_AD * weight_A[:, None].astype(rows_AD.dtype)
  return jnp.sum(rows_AD.reshape(top_k, -1, rows_AD.shape[-1]), axis=0)


def dispatch_slots(x_BLD: jax.Array, expert_BA: jax.Array, slot_BA: jax.Array, num_experts: int,
                   capacity: int) -> jax.Array:
  """Every sequence's slot buffer [B, E, C, D] (`assign_slots`' expert and slot per assignment).

  Index scatter rather than a one-hot dispatch einsum: a [L, E, C] one-hot mask costs O(L·E·C·D)
  FLOPs and memory quadratic in L per sequence, a routed token here one row copy in and one out,
  and the experts stay one batched matmul over a static buffer (the dense tile shape MXUs and
  tensor cores run at full rate). vmap over sequences gives the scatter and gather batch
  dimensions, which the SPMD partitioner keeps local to each batch shard.
  """
  top_k = expert_BA.shape[1] // x_BLD.shape[1]
  dispatch = jax.vmap(_dispatch_one, in_axes=(0, 0, 0, None, None, None))
  return dispatch(x_BLD, expert_BA, slot_BA, num_experts, capacity, top_k)


def combine_slots(out_BECD: jax.Array, expert_BA: jax.Array, slot_BA: jax.Array, weight_BA: jax.Array,
                  top_k: int) -> jax.Array:
  """Each token's weighted sum of its experts' slot outputs: [B, L, D]; `weight_BA` choice-major."""
  return jax.vmap(_combine_one, in_axes=(0, 0, 0, 0, None))(out_BECD, expert_BA, slot_BA, weight_BA, top_k)


def dense_experts(x_EBCD: jax.Array, kernels: Sequence[jax.Array], biases: Sequence[jax.Array],
                  activations: Sequence[Activation]) -> jax.Array:
  """Every expert's gated MLP over its slots [E, n, C, D], one batched matmul per projection
  (quantized when configured)."""

  def project(x: jax.Array, i: int) -> jax.Array:
    y = quantization.dot_general(x, kernels[i], _EXPERT_DIMS)
    return y + biases[i][:, None, None, :].astype(y.dtype) if biases else y

  return _gated_mlp(x_EBCD, project, activations, grouped=False)


# ---------------------------------------------------------------- sorted rows


@jax.custom_vjp
def permute_rows(x_ND: jax.Array, perm_N: jax.Array, inverse_N: jax.Array) -> jax.Array:
  """x[perm] for a permutation `perm` whose inverse is `inverse`, with the gradient gathered back by
  the inverse (g[inverse]) where autodiff would scatter-add it (use_custom_sort_vjp)."""
  return x_ND[perm_N]


def _permute_rows_fwd(x_ND: jax.Array, perm_N: jax.Array, inverse_N: jax.Array
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  return x_ND[perm_N], (perm_N, inverse_N)


def _permute_rows_bwd(residuals: tuple[jax.Array, jax.Array], g_ND: jax.Array) -> tuple[jax.Array, None, None]:
  _, inverse_N = residuals
  return g_ND[inverse_N], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def sort_by_expert(x_BLD: jax.Array, experts_BLk: jax.Array, num_experts: int, custom_vjp: bool = False
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The B·L·k assignments' rows sorted by expert (stable: token order within an expert):
  (rows [A, D], the sort order [A] over token-major assignments, rows per expert [E] int32).
  `custom_vjp`: each token's row is repeated k times and permuted (`permute_rows`), so the backward
  gathers and sums the k copies instead of scatter-adding."""
  top_k = experts_BLk.shape[-1]
  expert_A = experts_BLk.reshape(-1)  # token-major: assignment a is token a // k
  order_A = jnp.argsort(expert_A, stable=True)
  x_ND = x_BLD.reshape(-1, x_BLD.shape[-1])
  if custom_vjp:
    x_AD = permute_rows(jnp.repeat(x_ND, top_k, axis=0), order_A, jnp.argsort(order_A))
  else:
    x_AD = x_ND[order_A // top_k]
  sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  return x_AD, order_A, sizes_E


def grouped_mlp(rows_MD: jax.Array, kernels: Sequence[jax.Array], biases: Sequence[jax.Array], group_sizes: jax.Array,
                activations: Sequence[Activation], matmul: GroupedMatmul) -> jax.Array:
  """The experts' gated MLPs over rows sorted by expert: one grouped matmul per projection, then
  each row's expert's bias when `biases` ([G, out] each) are given; rows after the last group
  stay zeros."""
  if biases:  # each row's group; the rows after the last group index an appended zero bias
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows_MD.shape[0]), side="right")

  def project(x: jax.Array, i: int) -> jax.Array:
    y = matmul(x, kernels[i], group_sizes)
    if not biases:
      return y
    bias = jnp.concatenate([biases[i], jnp.zeros((1, biases[i].shape[-1]), biases[i].dtype)])
    return y + bias[group_M].astype(y.dtype)

  return _gated_mlp(rows_MD, project, activations, grouped=True)


def combine_sorted(out_AD: jax.Array, order_A: jax.Array, weights_BLk: jax.Array, custom_vjp: bool = False
                   ) -> jax.Array:
  """Expert outputs in sorted order -> each token's weighted sum of its k choices [B, L, D]."""
  batch, length, top_k = weights_BLk.shape
  # Unsort with the inverse permutation: a gather, whose gradient is a scatter-add, or with
  # `custom_vjp` a gather by `order_A` itself.
  unsort_A = jnp.argsort(order_A)
  unsorted_AD = permute_rows(out_AD, unsort_A, order_A) if custom_vjp else out_AD[unsort_A]
  out_BLkD = unsorted_AD.reshape(batch, length, top_k, out_AD.shape[-1])
  out_BLkD = out_BLkD * weights_BLk[..., None].astype(out_BLkD.dtype)
  out_BLD = out_BLkD[:, :, 0]  # choice by choice, in the slot path's order, so all paths round alike
  for choice in range(1, top_k):
    out_BLD = out_BLD + out_BLkD[:, :, choice]
  return out_BLD
