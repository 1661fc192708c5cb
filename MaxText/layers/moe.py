"""Sparse mixture-of-experts MLP: top-k routing over gated (SwiGLU) experts, as in Mixtral.

Shape legend (extends layers/__init__.py): E num_experts, k num_experts_per_tok,
A = k·L routed assignments per sequence, C expert capacity (slots per expert per sequence).

Routing. Router logits x·W_gate are computed in the activation dtype, the softmax
over all E experts in float32; each token keeps its k most probable experts and
their probabilities renormalised to sum to one (the Mixtral / HF rule). The
token's output is the weighted sum of those experts' gated MLPs.

Capacity and dropping. Routing happens per sequence (one batch row is one routing
group, so routing never crosses batch shards). Each expert has
C = min(L, ceil(capacity_factor · k · L / E)) slots per sequence. Slots are handed
out in priority order: every token's first choice in sequence order, then every
token's second choice, and so on. An assignment that finds its expert full is
dropped: that expert adds nothing to that token, the token's kept experts still add
their (not renormalised) weights, and a token that loses all k choices gets zeros
from this block, i.e. it passes the layer on the residual connection alone.
capacity_factor <= 0 is dropless: C = L, which no expert can overflow because a
token picks an expert at most once. Dropless is exact (what HF computes) but pads
every expert to L slots, so the expert matmuls cost E/k times the routed FLOPs;
set capacity_factor (e.g. 1.25) to train faster, or sparse_matmul.

Grouped (sparse_matmul=True, dropless only). The B·L·k assignments are sorted by
expert, each expert projection is one `jax.lax.ragged_dot` over the sorted rows with
the per-expert row counts as group sizes, and the rows are unsorted and combined with
the routing weights. Same result as the padded dropless path; on GPU and TPU, XLA runs
ragged_dot as a grouped GEMM (routed FLOPs only). On CPU, jax lowers ragged_dot to a
masked dense product over all groups (E times the routed FLOPs, like the padded path).
Sharding (a shard_map): every device sorts only its own batch shard's sequences. Under
expert parallelism the tokens are all-gathered over the `expert` axis, each device runs
ragged_dot on its own E/shards experts' rows only (its weights stay expert-sharded; their
`fsdp`/`tensor` parts are all-gathered as FSDP does), and the expert shards' outputs are
summed with an all-reduce over `expert`. A ragged all-to-all, moving only the routed rows to
their experts' devices, would need less communication; it is not implemented.

Load balancing (Switch Transformer, as Mixtral trains it). With f_e the fraction of
tokens whose top-k includes expert e (before any dropping; the f_e sum to k) and P_e
the mean router probability of e over the tokens, the loss is E · Σ_e f_e · P_e:
k for perfectly even routing, up to k·E when every token goes to the same experts.
It is computed per layer over the whole batch (padding included), sown as
`moe_lb_loss`, averaged over layers by models.py and added to the training loss
with weight load_balance_loss_weight by train_step.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText import sharding
from MaxText.model_config import ModelConfig
from MaxText.layers.linears import DenseGeneral
from MaxText.layers import quantization
from MaxText.layers.mlp import ACTIVATION_FNS

# "ebcd,edf->ebcf" and "ebcf,efd->ebcd" as dot_general: contract the last activation dim with the
# kernel's middle one, expert dim batched.
_EXPERT_DIMS = (((3,), (1,)), ((0,), (0,)))

# The expert buffer leads with E so "exp" claims the expert mesh axis first; the batch
# dimension then falls back to its rule without the expert axis. Going from the
# batch-sharded tokens to this layout is the all-to-all of expert parallelism.
_BUFFER_NAMES = ("activation_exp", "activation_batch", None, "activation_embed")
_TOKEN_BUFFER_NAMES = ("activation_batch", None, None, "activation_embed")


class ExpertKernel(nnx.Module):
  """Stacked weights of all experts, [E, in, out], initialised per expert by fan-in."""

  def __init__(self, num_experts: int, dim_in: int, dim_out: int, names: tuple[str, str, str], *,
               weight_dtype: jnp.dtype, rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                             batch_axis=(0,))
    self.kernel = nnx.Param(init(rngs.params(), (num_experts, dim_in, dim_out), weight_dtype), out_sharding=names)


def expert_capacity(cfg: ModelConfig, length: int) -> int:
  """Slots per expert for one sequence of `length` tokens (see the module docstring)."""
  if cfg.capacity_factor <= 0:
    return length
  even_share = cfg.num_experts_per_tok * length / cfg.num_experts
  return max(1, min(length, math.ceil(cfg.capacity_factor * even_share)))


def route(logits_BLE: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(router probabilities [B, L, E], chosen experts [B, L, k], their renormalised weights [B, L, k])."""
  probs_BLE = jax.nn.softmax(logits_BLE.astype(jnp.float32), axis=-1)
  top_probs_BLk, experts_BLk = jax.lax.top_k(probs_BLE, top_k)
  weights_BLk = top_probs_BLk / jnp.sum(top_probs_BLk, axis=-1, keepdims=True)
  return probs_BLE, experts_BLk, weights_BLk


def load_balance_loss(probs_BLE: jax.Array, experts_BLk: jax.Array) -> jax.Array:
  """E · Σ_e (fraction of tokens routed to e) · (mean router probability of e)."""
  num_experts = probs_BLE.shape[-1]
  num_tokens = probs_BLE.shape[0] * probs_BLE.shape[1]
  routed_E = jnp.sum(jax.nn.one_hot(experts_BLk, num_experts, dtype=jnp.float32), axis=(0, 1, 2)) / num_tokens
  mean_prob_E = jnp.mean(probs_BLE, axis=(0, 1))
  return num_experts * jnp.sum(routed_E * mean_prob_E)


def assign_slots(experts_BLk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Flattens choices to assignments in priority order (choice-major) and gives each its
  slot in its expert: a running count of earlier assignments to the same expert.

  Returns (expert [B, A], slot [B, A]); slot >= capacity means dropped.
  """
  batch = experts_BLk.shape[0]
  expert_BA = jnp.swapaxes(experts_BLk, 1, 2).reshape(batch, -1)
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


def _grouped_experts(x_BLD: jax.Array, experts_BLk: jax.Array, weights_BLk: jax.Array, *kernels: jax.Array,
                     activations: tuple[str, ...], num_experts: int, expert_axis: str | None = None) -> jax.Array:
  """Sort the B·L·k assignments by expert, ragged_dot per projection, unsort, combine.

  With `expert_axis` (inside shard_map) the kernels hold this device's E/shards experts: it
  computes only the rows of its experts and the expert shards' outputs are summed.
  """
  batch, length, dim = x_BLD.shape
  top_k = experts_BLk.shape[-1]
  expert_A = experts_BLk.reshape(-1)  # token-major: assignment a is token a // k
  order_A = jnp.argsort(expert_A, stable=True)
  x_AD = x_BLD.reshape(-1, dim)[order_A // top_k]
  group_sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  offset: int | jax.Array = 0
  if expert_axis is not None:
    # This shard's experts own a contiguous run of the sorted rows: rotate it to the front;
    # ragged_dot gives zeros for the rows after the last group, i.e. every other shard's rows.
    local = kernels[-1].shape[0]
    first = jax.lax.axis_index(expert_axis) * local
    offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, group_sizes_E, 0))
    group_sizes_E = jax.lax.dynamic_slice(group_sizes_E, (first,), (local,))
    x_AD = jnp.roll(x_AD, -offset, axis=0)
  hidden_AF: jax.Array | None = None
  for name, kernel_EDF in zip(activations, kernels[:-1]):
    h = ACTIVATION_FNS[name](checkpoint_name(jax.lax.ragged_dot(x_AD, kernel_EDF, group_sizes_E), "mlpwi"))
    hidden_AF = h if hidden_AF is None else hidden_AF * h
  assert hidden_AF is not None  # mlp_activations is non-empty (config)
  out_AD = checkpoint_name(jax.lax.ragged_dot(hidden_AF, kernels[-1], group_sizes_E), "mlpwo")
  if expert_axis is not None:
    out_AD = jax.lax.psum(jnp.roll(out_AD, offset, axis=0), expert_axis)
  # Unsort with the inverse permutation (a gather, whose gradient is a scatter-add).
  out_BLkD = out_AD[jnp.argsort(order_A)].reshape(batch, length, top_k, dim)
  out_BLkD = out_BLkD * weights_BLk[..., None].astype(out_BLkD.dtype)
  # Summed choice by choice, in the padded path's order, so both paths round alike.
  out_BLD = out_BLkD[:, :, 0]
  for choice in range(1, top_k):
    out_BLD = out_BLD + out_BLkD[:, :, choice]
  return out_BLD


class MoeBlock(nnx.Module):
  """Drop-in for MlpBlock (same call): x [B, L, D] -> [B, L, D]; sows `moe_lb_loss`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, d, f = cfg.num_experts, cfg.emb_dim, cfg.mlp_dim
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    # The router is tiny; its expert dimension stays replicated.
    self.gate = DenseGeneral((d,), (e,), ("embed", None), dtype=dtype, weight_dtype=weight_dtype, rngs=rngs,
                             quantize=False)  # int8/fp8 router logits would flip near-tied top-k choices
    for i in range(len(cfg.mlp_activations)):
      setattr(self, f"wi_{i}", ExpertKernel(e, d, f, ("exp", "embed", "mlp"), weight_dtype=weight_dtype, rngs=rngs))
    self.wo = ExpertKernel(e, f, d, ("exp", "mlp", "embed"), weight_dtype=weight_dtype, rngs=rngs)
    self.cfg, self.dtype = cfg, dtype

  def _experts(self, x_EBCD: jax.Array) -> jax.Array:
    """Every expert's gated MLP over its slots, one batched matmul per projection (quantized when configured)."""
    hidden_EBCF: jax.Array | None = None
    for i, name in enumerate(self.cfg.mlp_activations):
      kernel_EDF = getattr(self, f"wi_{i}").kernel[...].astype(self.dtype)
      h = ACTIVATION_FNS[name](checkpoint_name(quantization.dot_general(x_EBCD, kernel_EDF, _EXPERT_DIMS), "mlpwi"))
      hidden_EBCF = h if hidden_EBCF is None else hidden_EBCF * h
    assert hidden_EBCF is not None  # mlp_activations is non-empty (config)
    out_EBCD = quantization.dot_general(hidden_EBCF, self.wo.kernel[...].astype(self.dtype), _EXPERT_DIMS)
    return checkpoint_name(out_EBCD, "mlpwo")

  def _grouped(self, x_BLD: jax.Array, experts_BLk: jax.Array, weights_BLk: jax.Array) -> jax.Array:
    """Dropless experts as grouped matmuls, each batch shard sorting and computing its own tokens."""
    cfg = self.cfg
    kernels = tuple(getattr(self, f"wi_{i}").kernel[...].astype(self.dtype) for i in range(len(cfg.mlp_activations)))
    kernels += (self.wo.kernel[...].astype(self.dtype),)
    grouped = functools.partial(_grouped_experts, activations=cfg.mlp_activations, num_experts=cfg.num_experts)
    # The mesh and rules `sharding.constrain` uses (sharding.py has no public getter for them).
    context = sharding.current_activation_context()
    if context is None:
      return grouped(x_BLD, experts_BLk, weights_BLk, *kernels)
    mesh, rules = context
    batch_axes = sharding.logical_to_mesh_spec(("activation_batch",), rules, mesh, x_BLD.shape[:1])[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    expert_axes = sharding.logical_to_mesh_spec(("exp",), rules, mesh, kernels[-1].shape[:1])[0]
    expert_axis = expert_axes if isinstance(expert_axes, str) else (expert_axes[0] if expert_axes else None)
    if expert_axis is not None and len(expert_axes if not isinstance(expert_axes, str) else [expert_axes]) > 1:
      expert_axis = None  # several mesh axes on the expert dim: gather the weights instead
    token_axes = tuple(a for a in batch_axes if a != expert_axis)
    if not token_axes and expert_axis is None:
      return grouped(x_BLD, experts_BLk, weights_BLk, *kernels)
    # Each device sorts only its own sequences (a global sort would gather every assignment
    # onto every device). Expert parallelism: the tokens are gathered over the `expert` axis,
    # each device multiplies only the rows routed to its own experts, and the expert shards'
    # outputs are summed (an all-reduce of [A, D], where a ragged all-to-all would move only
    # the routed rows). The weights' other axes (fsdp, tensor) are all-gathered, as FSDP does.
    tokens = PartitionSpec(token_axes or None)
    expert_spec = PartitionSpec(expert_axis)
    return jax.shard_map(functools.partial(grouped, expert_axis=expert_axis), mesh=mesh,
                         in_specs=(tokens, tokens, tokens, *(expert_spec,) * len(kernels)),
                         out_specs=tokens)(x_BLD, experts_BLk, weights_BLk, *kernels)

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    # Why index scatter/gather and not one-hot dispatch einsums: a [L, E, C] one-hot
    # dispatch mask costs O(L·E·C·D) FLOPs and memory quadratic in L per sequence; here
    # each routed token costs one row copy in and one row copy out (O(k·L·D)), and the
    # experts stay one batched matmul over a static [E, B, C, D] buffer, the dense tile
    # shape MXUs and tensor cores run at full rate. vmap over sequences gives the
    # scatter/gather batch dimensions, which the SPMD partitioner keeps local to each
    # batch shard.
    cfg = self.cfg
    top_k, num_experts, length = cfg.num_experts_per_tok, cfg.num_experts, x_BLD.shape[1]
    x_BLD = x_BLD.astype(self.dtype)
    probs_BLE, experts_BLk, weights_BLk = route(self.gate(x_BLD), top_k)
    self.sow(nnx.Intermediate, "moe_lb_loss", load_balance_loss(probs_BLE, experts_BLk))
    if cfg.sparse_matmul:
      return self._grouped(x_BLD, experts_BLk, weights_BLk)

    capacity = expert_capacity(cfg, length)
    expert_BA, slot_BA = assign_slots(experts_BLk, num_experts)
    weight_BA = jnp.swapaxes(weights_BLk, 1, 2).reshape(weights_BLk.shape[0], -1)
    dispatch = jax.vmap(_dispatch_one, in_axes=(0, 0, 0, None, None, None))
    # Pinning the buffer to the token layout first keeps the scatter local; the change of
    # layout below is then one all-to-all (left unpinned, XLA all-gathers the tokens instead).
    buffer_BECD = sharding.constrain(dispatch(x_BLD, expert_BA, slot_BA, num_experts, capacity, top_k),
                                     _TOKEN_BUFFER_NAMES)
    buffer_EBCD = sharding.constrain(jnp.swapaxes(buffer_BECD, 0, 1), _BUFFER_NAMES)
    out_EBCD = sharding.constrain(self._experts(buffer_EBCD), _BUFFER_NAMES)
    out_BECD = sharding.constrain(jnp.swapaxes(out_EBCD, 0, 1), _TOKEN_BUFFER_NAMES)
    combine = jax.vmap(_combine_one, in_axes=(0, 0, 0, 0, None))
    return combine(out_BECD, expert_BA, slot_BA, weight_BA, top_k)
