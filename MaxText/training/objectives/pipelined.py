"""Loss drivers for the pipeline schedules that compute gradients themselves (1F1B): the model
gives the embedding, the stage-sharded stack and its final modules; the objective gives the loss
on the logits of each microbatch leaving the last stage."""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from MaxText.layers import pipeline_1f1b, quantization
from MaxText.models import ModelSpec, output_logits, remat_policy
from MaxText.training.objectives.base import Batch, Params, Sums

# (float32 logits [m, L, V] of one microbatch, its head inputs) -> (loss sum, sums)
LogitsLoss = Callable[[jax.Array, Sums], tuple[jax.Array, Sums]]
# The final norm's and the output module's variables, as the schedule differentiates them.
HeadState = tuple[nnx.State[Any, Any], nnx.State[Any, Any]]


def one_f_one_b_loss(model: ModelSpec, params: Params, batch: Batch, dropout_rng: jax.Array | None,
                     logits_loss: LogitsLoss, head_inputs: Sums, aux_cotangents: dict[str, jax.Array],
                     loss_scale: jax.Array | float = 1.0) -> tuple[jax.Array, Sums]:
  """(differentiable loss, sums) of the model under the 1F1B schedule (layers/pipeline_1f1b.py),
  which computes the gradients inside its own loop. `head_inputs` ([B, ...] each) are split into
  microbatches like the batch and handed to `logits_loss`; the loss adds Σ aux_cotangents[name] ·
  (the aux loss `name` summed over layers and microbatches), the sums hold it as `aux_<name>`. `loss_scale`:
  about the cotangent the loss will get (pipeline_1f1b.pipelined_loss), which keeps float16 sums in range."""
  cfg = model.cfg
  module = model.module(params)
  x_BLD = module.embed(batch["inputs"], batch["inputs_position"])
  stacked_state, apply_layer = module.stage_layers()
  norm, output = module.final_modules()
  norm_graphdef, norm_state = nnx.split(norm)
  output_graphdef, output_state = nnx.split(output)

  def head(head_state: HeadState, y_mLD: jax.Array, inputs_m: Sums) -> tuple[jax.Array, Sums]:
    with quantization.use_quantization(""):  # as in the full pass: logits stay in float
      logits = output_logits(cfg, nnx.merge(norm_graphdef, head_state[0]), nnx.merge(output_graphdef, head_state[1]),
                             y_mLD)
    return logits_loss(logits, inputs_m)

  data = {"positions": batch["inputs_position"], "segment_ids": batch["inputs_segmentation"],
          "head_inputs": head_inputs, "dropout_rng": dropout_rng, "aux_cotangents": aux_cotangents,
          "loss_scale": loss_scale}
  with quantization.use_quantization(cfg.quantization):
    loss, sums = pipeline_1f1b.pipelined_loss(cfg.pipeline, apply_layer, head, remat_policy(cfg),
                                              stacked_state, (norm_state, output_state), x_BLD, data)
  return loss, sums
