"""The 1F1B pipeline schedule: each stage alternates one forward and one backward microbatch,
so a stage keeps at most min(M, 2S - 1) microbatch inputs alive instead of GPipe's M·(S + M - 1)
stage-iteration carries.

Shape legend as in pipeline.py: S stages, M microbatches, G layers per stage, m rows per
microbatch, L length, D embed, K ring-buffer slots.

GPipe's backward is JAX's transpose of the forward schedule, so every forward iteration's
carry lives until the backward reaches it. 1F1B needs the loss of a microbatch as soon as it
leaves the last stage, which autodiff cannot order; so this module computes the loss *and*
its gradients itself, in one loop, and hands them to JAX through `jax.custom_vjp` (forward
rule: run the loop, keep the gradients; backward rule: scale them by the incoming cotangent).

The loop is the same "vmap over stages and rotate" SPMD program as pipeline.py. At iteration t:
1. forward: activations shift one stage up (`jnp.roll`, a collective permute); stage s runs
   microbatch t - s and stores its input in a ring buffer slot;
2. head: the microbatch leaving the last stage goes through the final norm, logits and loss
   at once, giving the loss and d(loss)/d(stage output) (and the head's own gradients);
3. backward: gradients shift one stage down; stage s re-runs its forward on the stored input
   of microbatch t - (2S - 2 - s) under `jax.vjp` and applies the incoming gradient, adding
   to its weight gradients; stage 0's input gradient goes back to the embedding.
Iterations [0, S-1) only run forwards and [M+S-1, M+2S-2) only backwards, so the time is
(M + S - 1)·(F + B), the same bubble as GPipe: (S - 1) / (M + S - 1). The price of the
smaller memory is one extra stage forward per microbatch (the re-run in step 3), as with
full rematerialisation at stage granularity; inside the re-run, `remat_policy` applies per layer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from MaxText import sharding
from MaxText.config_groups import ModelConfig
from MaxText.layers.pipeline import LayerFn, Policy, _merge_micro, _split_micro, stage_weights
from MaxText.layers.pipeline import _stage_fn as stage_fn_with_repeats

# (head state, y_mLD, targets_mL, target_weights_mL) -> (loss sum, {"xent_sum", "z_loss_sum"}): the loss
# sum is what gets differentiated (cross-entropy plus the z-loss term), the dict holds metrics.
HeadFn = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
Sums = dict[str, jax.Array]

_STAGE_NAMES = ("layers", "activation_batch", "activation_length", "activation_embed")
_RING_NAMES = ("layers", None, "activation_batch", "activation_length", "activation_embed")


def num_ring_slots(num_stages: int, num_micro: int) -> int:
  """Stage inputs each stage keeps: stage s holds microbatch k from its forward (t = k + s) to
  its backward (t = k + 2S - 2 - s), at most 2S - 1 at once (stage 0)."""
  return min(num_micro, 2 * num_stages - 1)


def _stage_fn(cfg: ModelConfig, layer_fn: LayerFn, layer_rngs: jax.Array | None, policy: Policy) -> Callable:
  """One stage's G layers on one microbatch -> (x_mLD, aux summed over its layers): pipeline.py's
  stage function with a single repeat, rematerialised per layer rather than per stage, so the
  re-run in a backward slot holds one layer's internals at a time."""
  if not isinstance(policy, str):  # "none" means no rematerialisation
    layer_fn = jax.checkpoint(layer_fn, policy=policy)
  run_repeats = stage_fn_with_repeats(cfg, layer_fn, layer_rngs, "none")

  def run(weights_G: Any, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
          stage: jax.Array, micro: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    weights_RG = jax.tree.map(lambda w: w[None], weights_G)
    return run_repeats(weights_RG, x_mLD, positions_mL, segment_ids_mL, stage, jnp.zeros((), jnp.int32), micro)

  return run


def _zeros_like(tree: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, tree)


def _masked(valid: jax.Array, tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), tree)


def _loop(cfg: ModelConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Any,
          head_state: Any, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[Sums, tuple[Any, Any, jax.Array]]:
  """Runs the schedule: (loss sums, (stacked layer grads, head grads, d x_BLD)) of the summed loss."""
  num_stages, num_micro = cfg.num_pipeline_stages, cfg.num_pipeline_microbatches
  num_slots = num_ring_slots(num_stages, num_micro)
  rng = data["dropout_rng"]
  layer_rngs = jax.random.split(rng, cfg.num_decoder_layers) if rng is not None else None
  split = functools.partial(_split_micro, num_micro=num_micro)
  inputs_MmLD = sharding.constrain(split(x_BLD), (None,) + _STAGE_NAMES[1:])
  positions_MmL, segment_ids_MmL = split(data["positions"]), split(data["segment_ids"])
  targets_MmL, target_weights_MmL = split(data["targets"]), split(data["target_weights"])
  aux_cotangents: dict[str, jax.Array] = data["aux_cotangents"]
  weights_SG = jax.tree.map(lambda w: w[:, 0], stage_weights(stacked_state, cfg))  # one repeat: [S, G, ...]
  stages_S = jnp.arange(num_stages)
  run = _stage_fn(cfg, layer_fn, layer_rngs, policy)

  def stage_backward(weights_G: Any, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
                     stage: jax.Array, micro: jax.Array, dy_mLD: jax.Array, valid: jax.Array) -> tuple[Any, jax.Array]:
    (_, aux), vjp = jax.vjp(lambda w, x: run(w, x, positions_mL, segment_ids_mL, stage, micro), weights_G, x_mLD)
    daux = {name: jnp.asarray(aux_cotangents.get(name, 0.0), value.dtype) for name, value in aux.items()}
    dw, dx = vjp((dy_mLD, daux))
    return _masked(valid, dw), jnp.where(valid, dx, jnp.zeros_like(dx))

  forward_stages = jax.vmap(run, spmd_axis_name="stage")
  backward_stages = jax.vmap(stage_backward, spmd_axis_name="stage")
  write_slot = jax.vmap(lambda ring, x, slot, valid: jax.lax.dynamic_update_index_in_dim(
      ring, jnp.where(valid, x, ring[slot]), slot, 0))
  read_slot = jax.vmap(lambda ring, slot: ring[slot])

  def forward(carry: dict[str, Any], t: jax.Array) -> dict[str, Any]:
    feed_mLD = inputs_MmLD[jnp.minimum(t, num_micro - 1)]
    state_SmLD = sharding.constrain(jnp.roll(carry["fwd"], 1, axis=0).at[0].set(feed_mLD), _STAGE_NAMES)
    k_S = t - stages_S
    valid_S = (k_S >= 0) & (k_S < num_micro)
    micro_S = jnp.clip(k_S, 0, num_micro - 1)
    ring = sharding.constrain(write_slot(carry["ring"], state_SmLD, k_S % num_slots, valid_S), _RING_NAMES)
    out_SmLD, aux_S = forward_stages(weights_SG, state_SmLD, positions_MmL[micro_S], segment_ids_MmL[micro_S],
                                     stages_S, micro_S)
    aux = {name: carry["aux"].get(name, 0.0) + jnp.sum(jnp.where(valid_S, v, 0.0)) for name, v in aux_S.items()}
    return {**carry, "fwd": sharding.constrain(out_SmLD, _STAGE_NAMES), "ring": ring, "aux": aux}

  def head(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    """Loss of the microbatch that just left the last stage, and d(loss)/d(its activations)."""
    k = t - (num_stages - 1)
    loss, vjp, sums = jax.vjp(lambda hs, y: head_fn(hs, y, targets_MmL[k], target_weights_MmL[k]),
                              head_state, carry["fwd"][num_stages - 1], has_aux=True)
    dhead, dy_mLD = vjp(jnp.ones_like(loss))
    sums = {**sums, "loss": loss}
    carry = {**carry, "dhead": jax.tree.map(jnp.add, carry["dhead"], dhead),
             "sums": jax.tree.map(jnp.add, carry["sums"], sums)}
    return carry, dy_mLD

  def backward(carry: dict[str, Any], t: jax.Array, dy_mLD: jax.Array | None) -> dict[str, Any]:
    grads_SmLD = jnp.roll(carry["bwd"], -1, axis=0)
    if dy_mLD is not None:
      grads_SmLD = grads_SmLD.at[num_stages - 1].set(dy_mLD.astype(grads_SmLD.dtype))
    grads_SmLD = sharding.constrain(grads_SmLD, _STAGE_NAMES)
    k_S = t - (2 * num_stages - 2 - stages_S)
    valid_S = (k_S >= 0) & (k_S < num_micro)
    micro_S = jnp.clip(k_S, 0, num_micro - 1)
    x_SmLD = sharding.constrain(read_slot(carry["ring"], k_S % num_slots), _STAGE_NAMES)
    dw_SG, dx_SmLD = backward_stages(weights_SG, x_SmLD, positions_MmL[micro_S], segment_ids_MmL[micro_S],
                                     stages_S, micro_S, grads_SmLD, valid_S)
    dinputs = jax.lax.dynamic_update_index_in_dim(
        carry["dinputs"], jnp.where(valid_S[0], dx_SmLD[0], carry["dinputs"][micro_S[0]]), micro_S[0], 0)
    return {**carry, "bwd": sharding.constrain(dx_SmLD, _STAGE_NAMES), "dinputs": dinputs,
            "dweights": jax.tree.map(jnp.add, carry["dweights"], dw_SG)}

  def warmup(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
    return forward(carry, t), None

  def steady(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
    carry, dy_mLD = head(forward(carry, t), t)
    return backward(carry, t, dy_mLD), None

  def drain(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
    return backward(carry, t, None), None

  stage_buffer = sharding.constrain(jnp.zeros((num_stages,) + inputs_MmLD.shape[1:], x_BLD.dtype), _STAGE_NAMES)
  ring = jnp.zeros((num_stages, num_slots) + inputs_MmLD.shape[1:], x_BLD.dtype)
  zero = jnp.zeros((), jnp.float32)
  # Every aux name the layers sow must be in the carry from the start (scan needs a fixed structure).
  aux_names = jax.eval_shape(lambda: run(jax.tree.map(lambda w: w[0], weights_SG), inputs_MmLD[0],
                                         positions_MmL[0], segment_ids_MmL[0], jnp.int32(0), jnp.int32(0)))[1]
  carry = {"fwd": stage_buffer, "bwd": stage_buffer, "ring": sharding.constrain(ring, _RING_NAMES),
           "dinputs": jnp.zeros_like(inputs_MmLD), "dweights": _zeros_like(weights_SG), "dhead": _zeros_like(head_state),
           "sums": {"loss": zero, "xent_sum": zero, "z_loss_sum": zero}, "aux": {name: zero for name in aux_names}}
  carry, _ = jax.lax.scan(warmup, carry, jnp.arange(num_stages - 1))
  carry, _ = jax.lax.scan(steady, carry, jnp.arange(num_stages - 1, num_micro + num_stages - 1))
  carry, _ = jax.lax.scan(drain, carry, jnp.arange(num_micro + num_stages - 1, num_micro + 2 * num_stages - 2))
  # [S, G, ...] -> the stacked [num_layers, ...] layout (stage s holds layers s·G ... s·G + G - 1).
  dstacked = jax.tree.map(lambda g, w: g.reshape(w.shape).astype(w.dtype), carry["dweights"], stacked_state)
  dx_BLD = _merge_micro(carry["dinputs"]).astype(x_BLD.dtype)
  sums = {**carry["sums"], **{f"aux_{name}": value for name, value in carry["aux"].items()}}
  return sums, (dstacked, carry["dhead"], dx_BLD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def pipelined_loss(cfg: ModelConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Any,
                   head_state: Any, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[jax.Array, Sums]:
  """(differentiable scalar loss, sums) of the stack + head under the 1F1B schedule.

  The loss is the sum of `head_fn`'s losses plus Σ_name aux_cotangents[name] · (the aux `name`
  summed over layers and microbatches). Only the loss is differentiable: the sums ("loss",
  "xent_sum", "z_loss_sum", "aux_<name>") are metrics. `data`: positions, segment_ids,
  targets, target_weights ([B, L] each), dropout_rng (or None), aux_cotangents (name -> scalar).
  """
  return _loss_and_grads(cfg, layer_fn, head_fn, policy, stacked_state, head_state, x_BLD, data)[0]


def _loss_and_grads(cfg: ModelConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Any,
                    head_state: Any, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[tuple[jax.Array, Sums], Any]:
  sums, grads = _loop(cfg, layer_fn, head_fn, policy, stacked_state, head_state, x_BLD, data)
  loss = sums["loss"] + sum((jnp.asarray(weight, jnp.float32) * sums[f"aux_{name}"]
                             for name, weight in data["aux_cotangents"].items() if f"aux_{name}" in sums),
                            jnp.zeros((), jnp.float32))
  return (loss, sums), grads


def _backward_rule(cfg, layer_fn, head_fn, policy, grads, cotangents):  # type: ignore[no-untyped-def]
  g_loss = cotangents[0]
  scale = lambda tree: jax.tree.map(lambda x: (g_loss * x).astype(x.dtype), tree)  # noqa: E731
  dstacked, dhead, dx_BLD = grads
  return scale(dstacked), scale(dhead), scale(dx_BLD), None


# Forward rule: the loop itself, keeping the gradients as residuals.
pipelined_loss.defvjp(_loss_and_grads, _backward_rule)
