"""The 1F1B pipeline schedule, plain and interleaved: each stage alternates one forward and one
backward once the pipeline is full, so it keeps only the stage inputs whose backward has not
run yet (min(M, 2P - 1) for one pass) instead of the M·R + P - 1 iteration carries per stage
that GPipe (R = 1) and the circular schedule keep.

Shape legend as in pipeline.py: P stages, R passes (`num_pipeline_repeats`), M microbatches,
J layers per stage and pass, m rows per microbatch, L length, D embed.

GPipe's backward is JAX's transpose of the forward schedule, so every forward iteration's
carry lives until the backward reaches it. 1F1B needs the loss of a microbatch as soon as it
leaves the last stage, which autodiff cannot order; so this module computes the loss *and*
its gradients itself, in one loop, and hands them to JAX through `jax.custom_vjp` (forward
rule: run the loop, keep the gradients; backward rule: scale them by the incoming cotangent).

The loop is the same "vmap over stages and rotate" SPMD program as pipeline.py, driven by a
static timetable (pipeline_timetable.py: which microbatch and pass each stage runs forward and
backward at each iteration, and which ring slot holds its input). At iteration t:
1. forward: activations shift one stage up (`jnp.roll`, a collective permute); stage 0 takes
   a new microbatch, or the one that just left the last stage for its next pass; each stage
   runs its item and stores its input in its ring slot;
2. head: when a microbatch's last pass leaves the last stage, the caller's head (e.g. final norm,
   logits and the objective's loss) runs at once, giving the loss and d(loss)/d(stage output)
   (and the head's own gradients);
3. backward: gradients shift one stage down (stage 0's wrap to the last stage for the previous
   pass); each stage re-runs its forward on the stored input under `jax.vjp` and applies the
   incoming gradient, adding to its weight gradients; stage 0's input gradient of the first
   pass goes back to the embedding.
Warm-up iterations only run forwards and drain iterations only backwards, so the time is
(M·R + P - 1)·(F + B) with F, B one stage-pass: the bubble of GPipe (R = 1) or of the circular
schedule (R > 1). The price of the smaller memory is one extra stage forward per item (the
re-run in step 3), as with full rematerialisation at stage granularity; inside the re-run,
`remat_policy` applies per layer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

from MaxText.platform import sharding
from MaxText.configuration.model_config import PipelineConfig
from MaxText.layers import pipeline_timetable
from MaxText.layers.pipeline import LayerFn, Policy, StageFn, _merge_micro, _split_micro
from MaxText.layers.pipeline import first_layer, layer_group_fn, stage_weights

Sums = dict[str, jax.Array]
Tree = TypeVar("Tree")  # a tree of weights or their gradients, kept in structure
Stacked = TypeVar("Stacked")  # the stack's layer weights (and their gradients)
Head = TypeVar("Head")  # the loss head's weights (and their gradients)
# (head state, y_mLD, the microbatch's head inputs) -> (loss sum, sums): the loss sum is what gets
# differentiated, the sums are metrics (scalars that add up over microbatches). The head inputs
# are whatever the caller passes in data["head_inputs"] ([B, ...] each), split like the batch.
HeadFn = Callable[[Any, jax.Array, Sums], tuple[jax.Array, Sums]]

_STAGE_NAMES = ("layers", "activation_batch", "activation_length", "activation_embed")
_RING_NAMES = ("layers", None, "activation_batch", "activation_length", "activation_embed")


def _stage_fn(pipe: PipelineConfig, layer_fn: LayerFn, layer_rngs: jax.Array | None, policy: Policy) -> StageFn:
  """One stage's J layers of one pass on one microbatch -> (x_mLD, aux summed over its layers),
  rematerialised per layer rather than per stage, so the re-run in a backward slot holds one
  layer's internals at a time."""
  if not isinstance(policy, str):  # "none" means no rematerialisation
    layer_fn = jax.checkpoint(layer_fn, policy=policy)
  run_group = layer_group_fn(pipe, layer_fn, layer_rngs)

  def run(weights_J: Any, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
          stage: jax.Array, repeat: jax.Array, micro: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return run_group(weights_J, x_mLD, positions_mL, segment_ids_mL, first_layer(pipe, stage, repeat), micro)

  return run


def _accumulator_zeros(tree: Tree) -> Tree:
  """Zeros to sum gradients of `tree` in: float32 for float16 weights, whose range a sum over a batch's
  microbatches passes long before float32's does; other dtypes their own (their results stay unchanged)."""
  return jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32 if w.dtype == jnp.float16 else w.dtype), tree)


def _masked(valid: jax.Array, tree: Tree) -> Tree:
  return jax.tree.map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), tree)


def _pass_weights(weights_RJ: Tree, repeat: jax.Array) -> Tree:
  return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, keepdims=False), weights_RJ)


def _loop(pipe: PipelineConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Stacked,
          head_state: Head, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[Sums, tuple[Stacked, Head, jax.Array]]:
  """Runs the schedule: (loss sums, (stacked layer grads, head grads, d x_BLD)) of the summed loss."""
  num_stages, num_micro, num_repeats = pipe.num_pipeline_stages, pipe.num_pipeline_microbatches, pipe.num_pipeline_repeats
  table = pipeline_timetable.build(num_stages, num_micro, num_repeats)
  rng = data["dropout_rng"]
  layer_rngs = jax.random.split(rng, pipe.num_layers) if rng is not None else None
  split = functools.partial(_split_micro, num_micro=num_micro)
  inputs_MmLD = sharding.constrain(split(x_BLD), (None,) + _STAGE_NAMES[1:])
  positions_MmL, segment_ids_MmL = split(data["positions"]), split(data["segment_ids"])
  head_inputs_M = jax.tree.map(split, data["head_inputs"])
  loss_scale = jnp.asarray(data.get("loss_scale", 1.0), jnp.float32)
  # The loop differentiates loss_scale · loss: the head's cotangent and the aux losses' weights both scaled.
  aux_cotangents = {name: jnp.asarray(weight, jnp.float32) * loss_scale for name, weight in data["aux_cotangents"].items()}
  weights_PRJ = stage_weights(stacked_state, pipe)
  stages_P = jnp.arange(num_stages)
  run = _stage_fn(pipe, layer_fn, layer_rngs, policy)

  def stage_forward(weights_RJ: Tree, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
                    stage: jax.Array, repeat: jax.Array, micro: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return run(_pass_weights(weights_RJ, repeat), x_mLD, positions_mL, segment_ids_mL, stage, repeat, micro)

  def stage_backward(weights_RJ: Tree, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
                     stage: jax.Array, repeat: jax.Array, micro: jax.Array, dy_mLD: jax.Array,
                     valid: jax.Array) -> tuple[Tree, jax.Array]:
    (_, aux), vjp = jax.vjp(lambda w, x: run(w, x, positions_mL, segment_ids_mL, stage, repeat, micro),
                            _pass_weights(weights_RJ, repeat), x_mLD)
    daux = {name: jnp.asarray(aux_cotangents.get(name, 0.0), value.dtype) for name, value in aux.items()}
    dw_J, dx = vjp((dy_mLD, daux))
    return _masked(valid, dw_J), jnp.where(valid, dx, jnp.zeros_like(dx))

  def add_pass_grads(dweights_PRJ: Tree, dw_PJ: Tree, pass_P: jax.Array) -> Tree:
    # Added where the pass matches, elementwise over [P, R, J, ...]: XLA fuses it into one in-place update.
    this_pass_PR = pass_P[:, None] == jnp.arange(num_repeats)[None]
    return jax.tree.map(
        lambda acc, g: acc + jnp.where(this_pass_PR.reshape(this_pass_PR.shape + (1,) * (g.ndim - 1)),
                                       g[:, None].astype(acc.dtype), 0),
        dweights_PRJ, dw_PJ)

  forward_stages = jax.vmap(stage_forward, spmd_axis_name="stage")
  backward_stages = jax.vmap(stage_backward, spmd_axis_name="stage")
  write_slot = jax.vmap(lambda ring, x, slot, valid: jax.lax.dynamic_update_index_in_dim(
      ring, jnp.where(valid, x, ring[slot]), slot, 0))
  read_slot = jax.vmap(lambda ring, slot: ring[slot])

  def forward(carry: dict[str, Any], row: dict[str, jax.Array]) -> dict[str, Any]:
    state_PmLD = jnp.roll(carry["fwd"], 1, axis=0)  # the last stage's output wraps to stage 0 for its next pass
    # Indexed from the iteration counter rather than a table entry: XLA then slices the inputs
    # before gathering them (fewer bytes live; test_1f1b_keeps_fewer_activations_than_gpipe).
    micro = pipeline_timetable.first_pass_micro(row["iteration"], num_stages, num_repeats)
    feed_mLD = inputs_MmLD[jnp.minimum(micro, num_micro - 1)]
    state_PmLD = state_PmLD.at[0].set(jnp.where(row["feed_from_inputs"], feed_mLD, state_PmLD[0]))
    state_PmLD = sharding.constrain(state_PmLD, _STAGE_NAMES)
    valid_P, micro_P = row["fwd_valid"], row["fwd_micro"]
    ring = sharding.constrain(write_slot(carry["ring"], state_PmLD, row["fwd_slot"], valid_P), _RING_NAMES)
    out_PmLD, aux_P = forward_stages(weights_PRJ, state_PmLD, positions_MmL[micro_P], segment_ids_MmL[micro_P],
                                     stages_P, row["fwd_pass"], micro_P)
    aux = {name: carry["aux"].get(name, 0.0) + jnp.sum(jnp.where(valid_P, v, 0.0)) for name, v in aux_P.items()}
    return {**carry, "fwd": sharding.constrain(out_PmLD, _STAGE_NAMES), "ring": ring, "aux": aux}

  def head_loss(head_state_: Head, y_mLD: jax.Array, micro: jax.Array) -> tuple[Head, Sums, jax.Array]:
    """Loss of the microbatch that just left the last stage, and d(loss)/d(head, its activations)."""
    inputs_m = jax.tree.map(lambda x: x[micro], head_inputs_M)
    loss, vjp, sums = jax.vjp(lambda hs, y: head_fn(hs, y, inputs_m), head_state_, y_mLD, has_aux=True)
    dhead, dy_mLD = vjp(jnp.full_like(loss, loss_scale))
    return dhead, {**sums, "loss": loss}, dy_mLD

  def head(carry: dict[str, Any], row: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
    args = (head_state, carry["fwd"][num_stages - 1], row["head_micro"])
    if num_repeats == 1:  # a microbatch leaves the last stage for good at every steady iteration
      dhead, sums, dy_mLD = head_loss(*args)
    else:  # only in P of every P·R iterations: skip the vocabulary-sized work in the others
      dhead, sums, dy_mLD = jax.lax.cond(
          row["head_valid"], head_loss,
          lambda *a: jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), jax.eval_shape(head_loss, *a)), *args)
    carry = {**carry, "dhead": jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), carry["dhead"], dhead),
             "sums": jax.tree.map(jnp.add, carry["sums"], sums)}
    return carry, dy_mLD

  def backward(carry: dict[str, Any], row: dict[str, jax.Array], dy_mLD: jax.Array | None) -> dict[str, Any]:
    grads_PmLD = jnp.roll(carry["bwd"], -1, axis=0)  # stage 0's wraps to the last stage for the previous pass
    if dy_mLD is not None:
      last = grads_PmLD[num_stages - 1]
      grads_PmLD = grads_PmLD.at[num_stages - 1].set(jnp.where(row["head_valid"], dy_mLD.astype(last.dtype), last))
    grads_PmLD = sharding.constrain(grads_PmLD, _STAGE_NAMES)
    valid_P, micro_P, pass_P = row["bwd_valid"], row["bwd_micro"], row["bwd_pass"]
    x_PmLD = sharding.constrain(read_slot(carry["ring"], row["bwd_slot"]), _STAGE_NAMES)
    dw_PJ, dx_PmLD = backward_stages(weights_PRJ, x_PmLD, positions_MmL[micro_P], segment_ids_MmL[micro_P],
                                     stages_P, pass_P, micro_P, grads_PmLD, valid_P)
    dweights = add_pass_grads(carry["dweights"], dw_PJ, pass_P)
    to_input = valid_P[0] & (pass_P[0] == 0)  # stage 0 finished a microbatch's first pass: d(embedding output)
    dinputs = jax.lax.dynamic_update_index_in_dim(
        carry["dinputs"], jnp.where(to_input, dx_PmLD[0], carry["dinputs"][micro_P[0]]), micro_P[0], 0)
    return {**carry, "bwd": sharding.constrain(dx_PmLD, _STAGE_NAMES), "dinputs": dinputs, "dweights": dweights}

  def warmup(carry: dict[str, Any], row: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
    return forward(carry, row), None

  def steady(carry: dict[str, Any], row: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
    carry, dy_mLD = head(forward(carry, row), row)
    return backward(carry, row, dy_mLD), None

  def drain(carry: dict[str, Any], row: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
    return backward(carry, row, None), None

  stage_buffer = sharding.constrain(jnp.zeros((num_stages,) + inputs_MmLD.shape[1:], x_BLD.dtype), _STAGE_NAMES)
  ring = jnp.zeros((num_stages, table.num_slots) + inputs_MmLD.shape[1:], x_BLD.dtype)
  zero = jnp.zeros((), jnp.float32)
  # Every aux name the layers sow must be in the carry from the start (scan needs a fixed structure).
  aux_names = jax.eval_shape(lambda: run(_pass_weights(jax.tree.map(lambda w: w[0], weights_PRJ), jnp.int32(0)),
                                         inputs_MmLD[0], positions_MmL[0], segment_ids_MmL[0], jnp.int32(0),
                                         jnp.int32(0), jnp.int32(0)))[1]
  head_sums = jax.eval_shape(lambda: head_fn(head_state, stage_buffer[0], jax.tree.map(lambda x: x[0], head_inputs_M)))[1]
  carry: dict[str, Any] = {
      "fwd": stage_buffer, "bwd": stage_buffer, "ring": sharding.constrain(ring, _RING_NAMES),
      "dinputs": jnp.zeros_like(inputs_MmLD), "dweights": _accumulator_zeros(weights_PRJ), "dhead": _accumulator_zeros(head_state),
      "sums": {"loss": zero, **{name: jnp.zeros(v.shape, v.dtype) for name, v in head_sums.items()}},
      "aux": {name: zero for name in aux_names}}
  rows = {"iteration": jnp.arange(table.num_iterations), **{k: jnp.asarray(v) for k, v in table.rows().items()}}
  phases = ((warmup, 0, table.warmup_end), (steady, table.warmup_end, table.steady_end),
            (drain, table.steady_end, table.num_iterations))
  for body, start, end in phases:
    if end > start:
      carry, _ = jax.lax.scan(body, carry, jax.tree.map(lambda x: x[start:end], rows))  # noqa: B023
  # [P, R, J, ...] -> the stacked [num_layers, ...] layout (stage s, pass r holds layers (r·P + s)·J ...), still in
  # the accumulators' dtype: the backward rule casts after its scaling.
  dstacked = jax.tree.map(lambda g, w: jnp.swapaxes(g, 0, 1).reshape(w.shape),
                          carry["dweights"], stacked_state)
  dx_BLD = _merge_micro(carry["dinputs"]).astype(x_BLD.dtype)
  sums = {**carry["sums"], **{f"aux_{name}": value for name, value in carry["aux"].items()}}
  return sums, (dstacked, carry["dhead"], dx_BLD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def pipelined_loss(pipe: PipelineConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Stacked,
                   head_state: Head, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[jax.Array, Sums]:
  """(differentiable scalar loss, sums) of the stack + head under the 1F1B schedule.

  The loss is the sum of `head_fn`'s losses plus Σ_name aux_cotangents[name] · (the aux `name`
  summed over layers and microbatches). Only the loss is differentiable: the sums ("loss", the
  head's own, "aux_<name>") are metrics. `data`: positions, segment_ids ([B, L] each),
  head_inputs (name -> [B, ...]), dropout_rng (or None), aux_cotangents (name -> scalar), and optionally
  loss_scale (a scalar, 1 by default): the loop differentiates loss_scale · loss and the backward rule divides it
  out again, so a caller whose cotangent will be about 1/N passes 1/N and keeps float16 sums in range.
  """
  return _loss_and_grads(pipe, layer_fn, head_fn, policy, stacked_state, head_state, x_BLD, data)[0]


def _loss_and_grads(pipe: PipelineConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, stacked_state: Stacked,
                    head_state: Head, x_BLD: jax.Array, data: dict[str, Any]) -> tuple[tuple[jax.Array, Sums], Any]:
  sums, grads = _loop(pipe, layer_fn, head_fn, policy, stacked_state, head_state, x_BLD, data)
  # The primal dtypes, as scalars (residuals must be arrays), to cast the scaled gradients back to.
  dtypes = jax.tree.map(lambda x: jnp.zeros((), x.dtype), (stacked_state, head_state, x_BLD))
  residuals = (grads, dtypes, jnp.asarray(data.get("loss_scale", 1.0), jnp.float32))
  loss = sums["loss"] + sum((jnp.asarray(weight, jnp.float32) * sums[f"aux_{name}"]
                             for name, weight in data["aux_cotangents"].items() if f"aux_{name}" in sums),
                            jnp.zeros((), jnp.float32))
  return (loss, sums), residuals


def _backward_rule(pipe: PipelineConfig, layer_fn: LayerFn, head_fn: HeadFn, policy: Policy, residuals: Any,
                   cotangents: tuple[jax.Array, Sums]) -> tuple[Any, Any, jax.Array, None]:
  grads, dtypes, loss_scale = residuals
  factor = cotangents[0] / loss_scale  # the loop's gradients are of loss_scale · loss
  dstacked, dhead, dx_BLD = jax.tree.map(lambda g, like: (factor * g).astype(like.dtype), grads, dtypes)
  return dstacked, dhead, dx_BLD, None


# Forward rule: the loop itself, keeping the gradients as residuals.
pipelined_loss.defvjp(_loss_and_grads, _backward_rule)
