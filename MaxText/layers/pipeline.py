"""Pipeline parallelism of the scanned decoder stack over the `stage` mesh axis.

Shape legend: P pipeline stages, R repeats (passes through the stages), J layers per stage
and pass, M microbatches, m rows per microbatch, L length, D embed, T schedule iterations.

The formulation is "vmap over stages and rotate": every device runs the same SPMD
program. The scanned layer parameters keep their checkpoint layout (a leading layer dim
of size num_decoder_layers, the `layers` logical axis mapped to `stage`), so pipelined
and non-pipelined runs share checkpoints, converters and optimizer-state shardings.
Each iteration of a `lax.scan`:

1. the activation buffer `state_PmLD` shifts by one stage (`jnp.roll` over the
   stage-sharded dim, which XLA lowers to a collective permute); stage 0 takes the next
   microbatch (or, in the circular schedule, a microbatch coming back for its next pass);
2. `jax.vmap(..., spmd_axis_name="stage")` runs every stage on its own microbatch with
   its own slice of the layer weights, so the layers' activation sharding constraints
   keep the stage dim on the `stage` axis;
3. the last stage's output is written to the output buffer slot of its microbatch.

Stage s at iteration t works on virtual index k = t - s, i.e. microbatch k mod M of
pass k div M; it idles (the bubble) when k is outside [0, M·R). That needs
T = M·R + P - 1 iterations, of which each stage computes M·R, so the idle fraction is
(P - 1) / (M·R + P - 1): (P - 1) / (M + P - 1) for GPipe (R = 1) and R times fewer
idle slots relative to the work for the circular schedule.

Schedules:
- `gpipe`: stage s owns layers [s·L/P, (s+1)·L/P), one pass. These are exactly the
  rows of the stage-sharded stack, so no weights move.
- `circular` (interleaved): stage s owns R non-contiguous groups; in pass r it runs
  layers [(r·P + s)·J, (r·P + s + 1)·J) with J = L/(P·R), so a microbatch loops through
  the stages R times. Because the stored stack is split into contiguous blocks, the
  step regroups the layer weights into [P, R, J] once per step (an all-to-all of the
  layer weights and, in the backward pass, of their gradients). Storing the stack
  block-cyclically would avoid that traffic but would give pipelined runs a different
  checkpoint layout; it is not done here.

The backward pass is JAX's transpose of this forward schedule: all forward iterations,
then all backward iterations in reverse (the GPipe order), with each stage step
rematerialised under `remat_policy` so only stage inputs are kept between them.
The `1f1b` schedule (pipeline_1f1b.py) interleaves one backward with each forward once the
pipeline is full, computing the loss per microbatch inside its loop, so a stage keeps at
most min(M, 2P - 1) microbatch inputs alive; its bubble is GPipe's. With R > 1 it is
interleaved 1F1B: circular's layer split and bubble, about (R + 1)·P stage inputs kept.

Per-layer behaviour stays tied to the true layer: each layer gets its global
`layer_index` (local/global attention patterns), positions and segment ids travel with
their microbatch, dropout keys are per (layer, microbatch), and auxiliary losses (MoE
load balancing) are summed over layers and averaged over microbatches, skipping bubbles.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

from MaxText.errors import UserError
from MaxText.platform import sharding
from MaxText.configuration.model_config import PipelineConfig
from MaxText.layers import pipeline_timetable
from MaxText.layers.remat import CheckpointPolicy

AuxLosses = dict[str, jax.Array]
Weights = TypeVar("Weights")  # a tree of stacked layer weights (nnx.State)
# (x_mLD, one layer's state, dropout key or None, layer_index, positions_mL, segment_ids_mL) -> (x_mLD, aux)
LayerFn = Callable[[jax.Array, Any, "jax.Array | None", jax.Array, jax.Array, jax.Array], tuple[jax.Array, AuxLosses]]
Policy = CheckpointPolicy
# (weights_J, x_mLD, positions_mL, segment_ids_mL, first_layer, micro) -> (x_mLD, aux summed over the J layers)
GroupFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, AuxLosses]]
# (weights_RJ or weights_J, x_mLD, positions_mL, segment_ids_mL, stage, repeat, micro) -> (x_mLD, aux)
StageFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, AuxLosses]]

_BUFFER_NAMES = ("layers", "activation_batch", "activation_length", "activation_embed")
_MICRO_NAMES = (None, "activation_batch", "activation_length", "activation_embed")


def num_iterations(num_stages: int, num_microbatches: int, num_repeats: int = 1) -> int:
  """Schedule length: every microbatch passes every stage `num_repeats` times, plus the fill."""
  return num_microbatches * num_repeats + num_stages - 1


def bubble_fraction(num_stages: int, num_microbatches: int, num_repeats: int = 1) -> float:
  """Fraction of stage-iterations spent idle: (P - 1) / (M·R + P - 1)."""
  return (num_stages - 1) / num_iterations(num_stages, num_microbatches, num_repeats)


def describe(pipe: PipelineConfig) -> str:
  """One start-up log line: schedule, layer split and bubble fraction."""
  s, m, r = pipe.num_pipeline_stages, pipe.num_pipeline_microbatches, pipe.num_pipeline_repeats
  layout = f"{pipe.layers_per_pipeline_stage} layers per stage" + (f" x {r} repeats" if r > 1 else "")
  name = f"interleaved {pipe.pipeline_schedule}" if pipe.pipeline_schedule == "1f1b" and r > 1 else pipe.pipeline_schedule
  line = (f"pipeline: {name} schedule, {s} stages, {m} microbatches, {layout}; "
          f"{num_iterations(s, m, r)} iterations, bubble fraction {bubble_fraction(s, m, r):.3f}")
  if pipe.pipeline_schedule == "1f1b":  # each iteration runs one forward and one backward per stage
    kind = "stage inputs (microbatch x pass)" if r > 1 else "microbatch inputs"
    line += f"; at most {pipeline_timetable.build(s, m, r).num_slots} {kind} kept per stage"
  return line


def _split_micro(x: jax.Array, num_micro: int) -> jax.Array:
  """[B, ...] → [M, B/M, ...], microbatch i taking rows i, M + i, 2M + i, ... (as train_step does)."""
  if x.shape[0] % num_micro:  # train and eval batches are checked with the config; a direct forward is not
    raise UserError(f"a pipelined forward pass of {x.shape[0]} row(s) cannot split into num_pipeline_microbatches="
                    f"{num_micro}; give it a multiple of {num_micro} rows, or run it with ici_pipeline_parallelism=1")
  return jnp.swapaxes(x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
  """Inverse of `_split_micro`."""
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def stage_weights(stacked_state: Weights, pipe: PipelineConfig) -> Weights:
  """Stacked [num_layers, ...] leaves → [P, R, J, ...]: [s, r, g] is layer (r·P + s)·J + g."""
  s, r, g = pipe.num_pipeline_stages, pipe.num_pipeline_repeats, pipe.layers_per_pipeline_stage

  def regroup(w: jax.Array) -> jax.Array:
    return jnp.swapaxes(w.reshape((r, s, g) + w.shape[1:]), 0, 1)

  return jax.tree.map(regroup, stacked_state)


def layer_group_fn(pipe: PipelineConfig, layer_fn: LayerFn, layer_rngs: jax.Array | None) -> GroupFn:
  """J consecutive layers, the first being `first_layer`, on one microbatch -> (x_mLD, aux summed over them)."""

  def run(weights_J: Any, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
          first_layer: jax.Array, micro: jax.Array) -> tuple[jax.Array, AuxLosses]:
    def one(x: jax.Array, per_layer: tuple[Any, jax.Array]) -> tuple[jax.Array, AuxLosses]:
      layer_state, g = per_layer
      layer_index = first_layer + g
      rng = None if layer_rngs is None else jax.random.fold_in(layer_rngs[layer_index], micro)
      return layer_fn(x, layer_state, rng, layer_index, positions_mL, segment_ids_mL)

    x_mLD, aux_J = jax.lax.scan(one, x_mLD, (weights_J, jnp.arange(pipe.layers_per_pipeline_stage)))
    return x_mLD, {name: jnp.sum(values) for name, values in aux_J.items()}

  return run


def first_layer(pipe: PipelineConfig, stage: jax.Array, repeat: jax.Array) -> jax.Array:
  """Index of the first layer stage `stage` runs in pass `repeat`."""
  return (repeat * pipe.num_pipeline_stages + stage) * pipe.layers_per_pipeline_stage


def _stage_fn(pipe: PipelineConfig, layer_fn: LayerFn, layer_rngs: jax.Array | None, policy: Policy) -> StageFn:
  """One stage's work in one iteration: its J layers of pass `repeat` on one microbatch."""
  run_group = layer_group_fn(pipe, layer_fn, layer_rngs)

  def run(weights_RJ: Any, x_mLD: jax.Array, positions_mL: jax.Array, segment_ids_mL: jax.Array,
          stage: jax.Array, repeat: jax.Array, micro: jax.Array) -> tuple[jax.Array, AuxLosses]:
    weights_J = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, keepdims=False), weights_RJ)
    return run_group(weights_J, x_mLD, positions_mL, segment_ids_mL, first_layer(pipe, stage, repeat), micro)

  if isinstance(policy, str):  # "none": no rematerialisation
    return run
  return jax.checkpoint(run, policy=policy)


def run_pipeline(pipe: PipelineConfig, layer_fn: LayerFn, stacked_state: object, x_BLD: jax.Array,
                 positions_BL: jax.Array, segment_ids_BL: jax.Array, dropout_rng: jax.Array | None,
                 policy: Policy) -> tuple[jax.Array, AuxLosses]:
  """The decoder stack as a pipeline; returns x_BLD and the aux losses summed over layers
  (averaged over microbatches), like the non-pipelined stack."""
  num_stages, num_micro, num_repeats = pipe.num_pipeline_stages, pipe.num_pipeline_microbatches, pipe.num_pipeline_repeats
  layer_rngs = jax.random.split(dropout_rng, pipe.num_layers) if dropout_rng is not None else None
  inputs_MmLD = sharding.constrain(_split_micro(x_BLD, num_micro), _MICRO_NAMES)
  positions_MmL, segment_ids_MmL = _split_micro(positions_BL, num_micro), _split_micro(segment_ids_BL, num_micro)
  weights_PRJ = stage_weights(stacked_state, pipe)
  stages_P = jnp.arange(num_stages)
  run_stages = jax.vmap(_stage_fn(pipe, layer_fn, layer_rngs, policy), spmd_axis_name="stage")

  def iteration(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], AuxLosses]:
    state_PmLD, outputs_MmLD = carry
    # Stage 0 takes microbatch t on the first pass, later the same microbatch back from the last stage.
    feed_mLD = jnp.where(t < num_micro, inputs_MmLD[t % num_micro], outputs_MmLD[t % num_micro])
    state_PmLD = jnp.roll(state_PmLD, 1, axis=0).at[0].set(feed_mLD)
    state_PmLD = sharding.constrain(state_PmLD, _BUFFER_NAMES)
    k_P = t - stages_P
    micro_P, repeat_P = k_P % num_micro, jnp.clip(k_P // num_micro, 0, num_repeats - 1)
    valid_P = (k_P >= 0) & (k_P < num_micro * num_repeats)
    state_PmLD, aux_P = run_stages(weights_PRJ, state_PmLD, positions_MmL[micro_P], segment_ids_MmL[micro_P],
                                   stages_P, repeat_P, micro_P)
    state_PmLD = sharding.constrain(state_PmLD, _BUFFER_NAMES)
    # The last stage finished microbatch k_last (its row in the output buffer) unless it idled.
    k_last = t - (num_stages - 1)
    slot = k_last % num_micro
    done_mLD = jnp.where(k_last >= 0, state_PmLD[num_stages - 1], outputs_MmLD[slot])
    outputs_MmLD = jax.lax.dynamic_update_index_in_dim(outputs_MmLD, done_mLD, slot, axis=0)
    aux = {name: jnp.sum(jnp.where(valid_P, values, 0.0)) for name, values in aux_P.items()}
    return (state_PmLD, outputs_MmLD), aux

  state_PmLD = jnp.zeros((num_stages,) + inputs_MmLD.shape[1:], x_BLD.dtype)
  carry = (sharding.constrain(state_PmLD, _BUFFER_NAMES), jnp.zeros_like(inputs_MmLD))
  steps = jnp.arange(num_iterations(num_stages, num_micro, num_repeats))
  (_, outputs_MmLD), aux_T = jax.lax.scan(iteration, carry, steps)
  x_BLD = _merge_micro(sharding.constrain(outputs_MmLD, _MICRO_NAMES))
  return x_BLD, {name: jnp.sum(values) / num_micro for name, values in aux_T.items()}
