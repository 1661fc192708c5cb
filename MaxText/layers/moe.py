"""Sparse mixture-of-experts MLP: top-k routing over gated (SwiGLU) experts, as in Mixtral.

This module routes and holds the layer and its gather dispatch; the experts' computation (slots,
dispatch and combine, the batched or grouped expert matmuls) is experts.py's, and the
expert-parallel all-to-all exchange moe_dispatch.py's.

Shape legend (extends layers/__init__.py): E num_experts, k num_experts_per_tok,
A = k·L routed assignments per sequence, C expert capacity (slots per expert per sequence).

Routing. Router logits x·W_gate are computed in the activation dtype, the softmax
over all E experts in float32; each token keeps its k most probable experts and
their probabilities renormalised to sum to one (the Mixtral / HF rule; the same weights as
GPT-OSS's softmax over the k largest logits). The token's output is the weighted sum of
those experts' gated MLPs. DeepSeek's variants (`route`): sigmoid scores, a correction bias
that steers only the choice, the choice limited to the best expert groups, and a routed
scaling factor on the weights. With use_bias (GPT-OSS) the router and every expert
projection add a bias (the experts' per expert, [E, out], after each grouped or batched matmul).

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
expert, each expert projection is one grouped matmul over the sorted rows with the
per-expert row counts as group sizes (grouped_matmul.py: ragged_dot, or megablox on TPU),
and the rows are unsorted and combined with the routing weights. Same result as the padded
dropless path, with routed FLOPs only on GPU and TPU (on CPU, ragged_dot is a masked dense
product over all groups, E times the routed FLOPs, like the padded path).

Expert parallelism (the `expert` mesh axis). moe_dispatch=all_to_all (the default) sends each
device's routed rows to the devices that hold their experts and the results back
(moe_dispatch.py), for both paths above. moe_dispatch=gather is the older way, kept for
comparison: the padded path lets XLA re-lay the slot buffers from token-sharded to
expert-sharded; the grouped path all-gathers the tokens of the whole expert group onto every
device, each device multiplies only its own experts' rows and the expert shards' outputs are
summed with an all-reduce. Without an expert axis both run locally per batch shard (each
device sorts only its own sequences).

Input-scaled routing (moe_router_scales_input, Llama 4, top-1): the chosen expert's weight is
sigmoid(its router logit) and multiplies the token before the expert, whose output is added
unweighted. It is applied to the tokens before dispatch, so every path above runs it unchanged.

Shared experts (shared_experts > 0, DeepSeek / Llama 4): one dense gated MLP of width
shared_experts·mlp_dim that every token goes through, added to the routed output (with
shared_expert_gate, Qwen3-Next's, scaled first by a per-token sigmoid of x · W, W [D, 1]).

Routing health (sown per layer, reported by train_step.py): the fraction of tokens routed to
each expert before dropping (`moe_load`, [E], sums to k), the fraction of assignments dropped
for capacity, and the router's mean entropy over the tokens.

Load balancing (Switch Transformer, as Mixtral trains it). With f_e the fraction of
tokens whose top-k includes expert e (before any dropping; the f_e sum to k) and P_e
the mean router probability of e over the tokens, the loss is E · Σ_e f_e · P_e:
k for perfectly even routing, up to k·E when every token goes to the same experts.
It is computed per layer over the whole batch (padding included), sown as
`moe_lb_loss`, averaged over layers by the model (models/transformer.py) and added to the training loss
with weight load_balance_loss_weight by train_step.py.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from MaxText.platform import sharding
from MaxText.configuration.model_config import ModelConfig, MoeConfig
from MaxText.platform.sharding import trace_platform
from MaxText.layers.grouped_matmul import GroupedMatmul
from MaxText.layers.linears import DenseGeneral
from MaxText.layers import experts, grouped_matmul, moe_dispatch
from MaxText.layers.mlp import Activation, MlpBlock, activation_fns

# What MoeBlock sows besides the load-balancing loss: statistics, not losses (the model keeps
# them per layer and out of the gradient).
ROUTING_STATS = ("moe_load", "moe_router_entropy", "moe_dropped_fraction")

# The expert buffer leads with E so "exp" claims the expert mesh axis first; the batch
# dimension then falls back to its rule without the expert axis. Going from the
# batch-sharded tokens to this layout is the all-to-all of expert parallelism.
_BUFFER_NAMES = ("activation_exp", "activation_batch", None, "activation_embed")
_TOKEN_BUFFER_NAMES = ("activation_batch", None, None, "activation_embed")


class ExpertKernel(nnx.Module):
  """Stacked weights of all experts, [E, in, out], initialised per expert by fan-in; with
  `use_bias`, one bias per expert [E, out] (GPT-OSS), initialised to zero."""

  def __init__(self, num_experts: int, dim_in: int, dim_out: int, names: tuple[str, str, str], *,
               weight_dtype: jnp.dtype, rngs: nnx.Rngs, use_bias: bool = False):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                             batch_axis=(0,))
    self.kernel = nnx.Param(init(rngs.params(), (num_experts, dim_in, dim_out), weight_dtype), out_sharding=names)
    if use_bias:
      self.bias = nnx.Param(jnp.zeros((num_experts, dim_out), weight_dtype), out_sharding=(names[0], names[2]))


def expert_capacity(moe: MoeConfig, length: int) -> int:
  """Slots per expert for one sequence of `length` tokens (see the module docstring)."""
  if moe.capacity_factor <= 0:
    return length
  even_share = moe.num_experts_per_tok * length / moe.num_experts
  return max(1, min(length, math.ceil(moe.capacity_factor * even_share)))


def route(logits_BLE: jax.Array, top_k: int, renormalise: bool = True, *, score_function: str = "softmax",
          bias_E: jax.Array | None = None, num_groups: int = 1, topk_groups: int = 1, group_score: str = "max",
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(router probabilities [B, L, E], chosen experts [B, L, k], their weights [B, L, k]).

  Scores are the softmax over the experts or each expert's sigmoid (`score_function`). The
  experts are chosen by score + `bias_E` (DeepSeek-V3's correction bias: it steers the choice
  only), among the best `topk_groups` of `num_groups` equal expert groups (a group scores its best
  expert, or its best two summed with `group_score`=top2_sum). The weights are the chosen
  scores, renormalised to sum to one unless `renormalise` is False, times `scaling`. The returned
  probabilities are the scores normalised over the experts (for the balancing loss and entropy).
  """
  logits_BLE = logits_BLE.astype(jnp.float32)
  if score_function == "sigmoid":
    scores_BLE = jax.nn.sigmoid(logits_BLE)
    probs_BLE = scores_BLE / jnp.sum(scores_BLE, axis=-1, keepdims=True)
  else:
    scores_BLE = probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
  choice_BLE = scores_BLE if bias_E is None else scores_BLE + bias_E.astype(jnp.float32)[None, None, :]
  if topk_groups < num_groups:
    batch, length, num_experts = choice_BLE.shape
    grouped_BLGe = choice_BLE.reshape(batch, length, num_groups, num_experts // num_groups)
    group_BLG = (jnp.max(grouped_BLGe, axis=-1) if group_score == "max"
                 else jnp.sum(jax.lax.top_k(grouped_BLGe, 2)[0], axis=-1))
    best_BLg = jax.lax.top_k(group_BLG, topk_groups)[1]
    keep_BLG = jnp.any(best_BLg[..., None] == jnp.arange(num_groups)[None, None, None, :], axis=-2)
    keep_BLE = jnp.repeat(keep_BLG, num_experts // num_groups, axis=-1)
    choice_BLE = jnp.where(keep_BLE, choice_BLE, -jnp.inf)
  experts_BLk = jax.lax.top_k(choice_BLE, top_k)[1]
  weights_BLk = jnp.take_along_axis(scores_BLE, experts_BLk, axis=-1)
  if renormalise:
    weights_BLk = weights_BLk / jnp.sum(weights_BLk, axis=-1, keepdims=True)
  if scaling != 1.0:
    weights_BLk = weights_BLk * scaling
  return probs_BLE, experts_BLk, weights_BLk


CORRECTION_BIAS = "score_correction_bias"


def update_correction_biases(new_params: Any, old_params: Any, load_NE: jax.Array | None, rate: float) -> Any:
  """`new_params` with every MoE layer's correction bias set to its value in `old_params` plus
  rate · sign(mean load - the expert's load) (DeepSeek-V3's aux-loss-free balancing: underloaded
  experts become likelier choices). The optimizer's own change to the bias (weight decay; its
  gradient is zero) is discarded. `load_NE`: the routed fraction per expert of each MoE layer
  ([layers, E], `moe_load`), in the order of the `layers` stack; unused when `rate` is 0."""
  def update(path: tuple[Any, ...], new: jax.Array, old: jax.Array) -> jax.Array:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] != CORRECTION_BIAS:
      return new
    stack = keys[0]
    if rate == 0 or load_NE is None or stack.startswith("mtp_"):  # an MTP layer's load is not reported
      return old
    load = load_NE if stack == "layers" else load_NE[int(stack.rpartition("_")[2])]
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (old.astype(jnp.float32) + rate * step).astype(old.dtype)
  return jax.tree_util.tree_map_with_path(update, new_params, old_params)


def routed_fraction(experts_BLk: jax.Array, num_experts: int) -> jax.Array:
  """[E] fraction of the tokens whose top-k includes each expert (sums to k); no gradient. A
  count, not a one-hot sum: [B, L, k, E] floats would be large with hundreds of experts."""
  tokens = experts_BLk.shape[0] * experts_BLk.shape[1]
  return jnp.bincount(experts_BLk.reshape(-1), length=num_experts).astype(jnp.float32) / tokens


def load_balance_loss(probs_BLE: jax.Array, experts_BLk: jax.Array, routed_E: jax.Array | None = None) -> jax.Array:
  """E · Σ_e (fraction of tokens routed to e) · (mean router probability of e)."""
  num_experts = probs_BLE.shape[-1]
  routed_E = routed_fraction(experts_BLk, num_experts) if routed_E is None else routed_E
  mean_prob_E = jnp.mean(probs_BLE, axis=(0, 1))
  return num_experts * jnp.sum(routed_E * mean_prob_E)


def _grouped_experts(x_BLD: jax.Array, experts_BLk: jax.Array, weights_BLk: jax.Array, *params: jax.Array,
                     activations: Sequence[Activation], num_experts: int, matmul: GroupedMatmul,
                     expert_axis: str | None = None, custom_sort_vjp: bool = False) -> jax.Array:
  """Sort the B·L·k assignments by expert, grouped matmul per projection, unsort, combine.
  `params` are the kernels (wi_0, ..., wo), then their biases if any.

  With `expert_axis` (inside shard_map, moe_dispatch=gather) the kernels hold this device's
  E/shards experts: it computes only the rows of its experts and the expert shards' outputs are summed.
  """
  kernels, biases = params[:len(activations) + 1], params[len(activations) + 1:]
  x_AD, order_A, group_sizes_E = experts.sort_by_expert(x_BLD, experts_BLk, num_experts, custom_sort_vjp)
  offset: int | jax.Array = 0
  if expert_axis is not None:
    # This shard's experts own a contiguous run of the sorted rows: rotate it to the front;
    # the grouped matmul gives zeros for the rows after the last group, i.e. every other shard's rows.
    local = kernels[-1].shape[0]
    first = jax.lax.axis_index(expert_axis) * local
    offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, group_sizes_E, 0))
    group_sizes_E = jax.lax.dynamic_slice(group_sizes_E, (first,), (local,))
    x_AD = jnp.roll(x_AD, -offset, axis=0)
  out_AD = experts.grouped_mlp(x_AD, kernels, biases, group_sizes_E, activations, matmul)
  if expert_axis is not None:
    out_AD = jax.lax.psum(jnp.roll(out_AD, offset, axis=0), expert_axis)
  return experts.combine_sorted(out_AD, order_A, weights_BLk, custom_sort_vjp)


def routing_health(probs_BLE: jax.Array, routed_E: jax.Array, dropped_fraction: jax.Array) -> dict[str, jax.Array]:
  """Per-layer routing statistics (no gradient): token fraction per expert [E] (`routed_fraction`),
  router entropy, fraction of assignments dropped."""
  probs_BLE = jax.lax.stop_gradient(probs_BLE)
  entropy = -jnp.mean(jnp.sum(probs_BLE * jnp.log(jnp.maximum(probs_BLE, 1e-30)), axis=-1))
  return {"moe_load": routed_E, "moe_router_entropy": entropy,
          "moe_dropped_fraction": jax.lax.stop_gradient(dropped_fraction).astype(jnp.float32)}


def scale_routed_input(x_BLD: jax.Array, logits_BLE: jax.Array, experts_BLk: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Llama 4's routing (top-1): (the token scaled by sigmoid of its chosen expert's router logit,
  unit combine weights [B, L, 1]). The expert sees w·x rather than its output being scaled by w,
  which differs because the gated MLP is not linear."""
  chosen_BL1 = jnp.take_along_axis(logits_BLE.astype(jnp.float32), experts_BLk, axis=-1)
  scaled_BLD = (x_BLD * jax.nn.sigmoid(chosen_BL1).astype(x_BLD.dtype)).astype(x_BLD.dtype)
  return scaled_BLD, jnp.ones(experts_BLk.shape, jnp.float32)


class MoeBlock(nnx.Module):
  """Drop-in for MlpBlock (same call): x [B, L, D] -> [B, L, D]; sows `moe_lb_loss` and the
  routing-health statistics (ROUTING_STATS)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, d, f = cfg.moe.num_experts, cfg.emb_dim, cfg.mlp_dim
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    # The router is tiny; its expert dimension stays replicated. Not quantized: int8/fp8 router
    # logits would flip near-tied top-k choices.
    # use_bias (GPT-OSS): the router and every expert projection have biases.
    self.gate = DenseGeneral((d,), (e,), ("embed", None), dtype=dtype, weight_dtype=weight_dtype, rngs=rngs,
                             quantize=False, use_bias=cfg.use_bias)
    expert = functools.partial(ExpertKernel, weight_dtype=weight_dtype, rngs=rngs, use_bias=cfg.use_bias)
    for i in range(len(cfg.mlp_activations)):
      setattr(self, f"wi_{i}", expert(e, d, f, ("exp", "embed", "mlp")))
    self.wo = expert(e, f, d, ("exp", "mlp", "embed"))
    if cfg.moe.shared_experts > 0:
      self.shared_mlp = MlpBlock(cfg, rngs=rngs, mlp_dim=cfg.moe.shared_experts * f)
    if cfg.moe.shared_expert_gate:
      self.shared_gate = DenseGeneral((d,), (1,), ("embed", None), dtype=dtype, weight_dtype=weight_dtype, rngs=rngs,
                                      quantize=False)
    if cfg.moe.moe_score_correction_bias:  # moves only by moe_bias_update_rate (train_step.py), never by gradients
      self.score_correction_bias = nnx.Param(jnp.zeros((e,), weight_dtype), out_sharding=(None,))
    self.cfg, self.moe, self.dtype, self.activations = cfg, cfg.moe, dtype, activation_fns(cfg)

  def _projections(self) -> tuple[ExpertKernel, ...]:
    return (*(getattr(self, f"wi_{i}") for i in range(len(self.cfg.mlp_activations))), self.wo)

  def _kernels(self) -> tuple[jax.Array, ...]:
    """(wi_0, ..., wo) in the activation dtype."""
    return tuple(p.kernel[...].astype(self.dtype) for p in self._projections())

  def _biases(self) -> tuple[jax.Array, ...]:
    """Their biases in the activation dtype, or () without use_bias."""
    return tuple(p.bias[...].astype(self.dtype) for p in self._projections()) if self.cfg.use_bias else ()

  def _matmul(self) -> GroupedMatmul:
    return grouped_matmul.select(self.moe.moe_grouped_matmul, trace_platform())

  def _grouped(self, x_BLD: jax.Array, experts_BLk: jax.Array, weights_BLk: jax.Array) -> jax.Array:
    """Dropless experts as grouped matmuls, each batch shard sorting and computing its own tokens
    (under expert parallelism with moe_dispatch=gather: tokens gathered, outputs all-reduced)."""
    moe = self.moe
    kernels = self._kernels() + self._biases()
    matmul = self._matmul()
    grouped = functools.partial(_grouped_experts, activations=self.activations, num_experts=moe.num_experts,
                                matmul=matmul, custom_sort_vjp=moe.use_custom_sort_vjp)
    # The mesh and rules `sharding.constrain` uses (sharding.py has no public getter for them).
    context = sharding.current_activation_context()
    if context is None:
      return grouped(x_BLD, experts_BLk, weights_BLk, *kernels)
    mesh, rules = context
    batch_axes = sharding.logical_to_mesh_spec(("activation_batch",), rules, mesh, x_BLD.shape[:1])[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    expert_axes = sharding.logical_to_mesh_spec(("exp",), rules, mesh, kernels[0].shape[:1])[0]
    expert_axis = expert_axes if isinstance(expert_axes, str) else (expert_axes[0] if expert_axes else None)
    if expert_axis is not None and len(expert_axes if not isinstance(expert_axes, str) else [expert_axes]) > 1:
      expert_axis = None  # several mesh axes on the expert dim: gather the weights instead
    token_axes = tuple(a for a in batch_axes if a != expert_axis)
    if not token_axes and expert_axis is None:
      return grouped(x_BLD, experts_BLk, weights_BLk, *kernels)
    # Each device sorts only its own sequences (a global sort would gather every assignment
    # onto every device). The weights' other axes (fsdp, tensor) are all-gathered, as FSDP does.
    tokens = PartitionSpec(token_axes or None)
    expert_spec = PartitionSpec(expert_axis)
    return jax.shard_map(functools.partial(grouped, expert_axis=expert_axis), mesh=mesh,
                         in_specs=(tokens, tokens, tokens, *(expert_spec,) * len(kernels)),
                         out_specs=tokens, check_vma=grouped_matmul.annotates_vma(matmul))(
                             x_BLD, experts_BLk, weights_BLk, *kernels)

  def _padded(self, x_BLD: jax.Array, expert_BA: jax.Array, slot_BA: jax.Array, weight_BA: jax.Array,
              capacity: int) -> jax.Array:
    """Slot buffers laid out by expert through sharding constraints (moe_dispatch=gather)."""
    moe = self.moe
    # Pinning the buffer to the token layout first keeps the scatter local; the change of
    # layout below is then XLA's to make (left unpinned, it all-gathers the tokens instead).
    buffer_BECD = sharding.constrain(experts.dispatch_slots(x_BLD, expert_BA, slot_BA, moe.num_experts, capacity),
                                     _TOKEN_BUFFER_NAMES)
    buffer_EBCD = sharding.constrain(jnp.swapaxes(buffer_BECD, 0, 1), _BUFFER_NAMES)
    out_EBCD = sharding.constrain(
        experts.dense_experts(buffer_EBCD, self._kernels(), self._biases(), self.activations), _BUFFER_NAMES)
    out_BECD = sharding.constrain(jnp.swapaxes(out_EBCD, 0, 1), _TOKEN_BUFFER_NAMES)
    return experts.combine_slots(out_BECD, expert_BA, slot_BA, weight_BA, moe.num_experts_per_tok)

  def _all_to_all(self, layout: moe_dispatch.ExpertLayout, x_BLD: jax.Array, experts_BLk: jax.Array,
                  weights_BLk: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(output, assignments the exchange dropped) under moe_dispatch=all_to_all."""
    moe = self.moe
    body: moe_dispatch.Body
    matmul = self._matmul()
    if moe.sparse_matmul:
      body = functools.partial(moe_dispatch.grouped_body, expert_axes=layout.expert_axes,
                               num_experts=moe.num_experts, activations=self.activations, matmul=matmul,
                               buffer_factor=moe.moe_ragged_buffer_factor, custom_sort_vjp=moe.use_custom_sort_vjp,
                               exchange=moe_dispatch.select_exchange(moe.moe_all_to_all, trace_platform()))
    else:
      body = functools.partial(moe_dispatch.capacity_body, expert_axes=layout.expert_axes,
                               num_experts=moe.num_experts, capacity=capacity, activations=self.activations)
    return moe_dispatch.moe_all_to_all(layout, x_BLD, experts_BLk, weights_BLk, self._kernels(), self._biases(),
                                       body=body,
                                       check_vma=grouped_matmul.annotates_vma(matmul) or not moe.sparse_matmul)

  def _layout(self, batch: int) -> moe_dispatch.ExpertLayout | None:
    """The all-to-all layout when this call runs expert-parallel with moe_dispatch=all_to_all."""
    context = sharding.current_activation_context()
    if context is None or self.moe.moe_dispatch != "all_to_all":
      return None
    return moe_dispatch.expert_layout(*context, batch, getattr(self, "wi_0").kernel.shape)

  def __call__(self, x_BLD: jax.Array, router_BLD: jax.Array | None = None,
               expert_scale_E: jax.Array | None = None) -> jax.Array:
    """`router_BLD`: what the router reads when it is not the experts' input (Gemma 4); `expert_scale_E`: each
    expert's learned factor on its routing weights (Gemma 4)."""
    moe = self.moe
    top_k, num_experts, length = moe.num_experts_per_tok, moe.num_experts, x_BLD.shape[1]
    x_BLD = x_BLD.astype(self.dtype)
    logits_BLE = self.gate(x_BLD if router_BLD is None else router_BLD.astype(self.dtype))
    bias_E = (jax.lax.stop_gradient(self.score_correction_bias[...]) if moe.moe_score_correction_bias else None)
    probs_BLE, experts_BLk, weights_BLk = route(
        logits_BLE, top_k, moe.norm_topk_prob, score_function=moe.moe_score_function, bias_E=bias_E,
        num_groups=moe.moe_num_groups, topk_groups=moe.moe_topk_groups, group_score=moe.moe_group_score,
        scaling=moe.routed_scaling_factor)
    if expert_scale_E is not None:
      weights_BLk = weights_BLk * jnp.take(expert_scale_E.astype(jnp.float32), experts_BLk)
    routed_BLD = x_BLD
    if moe.moe_router_scales_input:  # top-1 (config): the weight moves onto the expert's input
      routed_BLD, weights_BLk = scale_routed_input(x_BLD, logits_BLE, experts_BLk)
    routed_E = routed_fraction(experts_BLk, num_experts)
    self.sow(nnx.Intermediate, "moe_lb_loss", load_balance_loss(probs_BLE, experts_BLk, routed_E))
    capacity = expert_capacity(self.moe, length)
    dropped = jnp.zeros((), jnp.float32)  # the slot paths' drops, counted here; the grouped exchange's, below
    if not moe.sparse_matmul:
      expert_BA, slot_BA = experts.assign_slots(experts_BLk, num_experts)
      dropped = jnp.mean((slot_BA >= capacity).astype(jnp.float32))

    layout = self._layout(x_BLD.shape[0])
    if layout is not None:
      out_BLD, exchange_dropped = self._all_to_all(layout, routed_BLD, experts_BLk, weights_BLk, capacity)
      if moe.sparse_matmul:  # the grouped exchange's receive buffers may drop rows
        dropped = exchange_dropped / experts_BLk.size
    elif moe.sparse_matmul:
      out_BLD = self._grouped(routed_BLD, experts_BLk, weights_BLk)
    else:
      weight_BA = experts.choice_major(weights_BLk)
      out_BLD = self._padded(routed_BLD, expert_BA, slot_BA, weight_BA, capacity)
    for name, value in routing_health(probs_BLE, routed_E, dropped).items():
      self.sow(nnx.Intermediate, name, value)
    if moe.shared_experts > 0:
      shared_BLD = self.shared_mlp(x_BLD)
      if moe.shared_expert_gate:  # Qwen3-Next: a per-token sigmoid scales the shared experts' output
        shared_BLD = shared_BLD * jax.nn.sigmoid(self.shared_gate(x_BLD).astype(jnp.float32)).astype(shared_BLD.dtype)
      out_BLD = out_BLD + shared_BLD
    return out_BLD
