"""Language modelling (pre-training and SFT): next-token cross-entropy over the weighted targets
(SFT's assistant-only weights ride in `targets_segmentation`; multimodal SFT's images in
`pixel_values`, declared as a batch field when the batches carry them), plus the z-loss, the MoE
load-balancing loss, in training, multi-token prediction and, for DeepSeek-V3.2 with
indexer_loss_scaling_factor > 0, the lightning indexer's KL loss (layers/indexer.py)."""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp

from MaxText.configuration.config import Config
from MaxText.input_pipeline import conversation_encoder, document_encoder
from MaxText.input_pipeline.batch_spec import FIELDS, PIXEL_VALUES
from MaxText.layers.moe import ROUTING_STATS
from MaxText.models import ModelSpec, token_loss_sums
from MaxText.training.objectives.base import Batch, Metrics, Objective, ObjectiveRecord, Params, Sums, declared_cost
from MaxText.training.objectives.pipelined import one_f_one_b_loss
from MaxText.training.optimizers import Partition


def routing_metrics(sums: Sums, num_micro: int) -> Metrics:
  """Per-layer routing health from the summed statistics: each a [num_layers] vector (the metric
  writers name its entries per layer). Load = fraction of tokens routed to an expert."""
  if "moe_load" not in sums:
    return {}
  load_NE = sums["moe_load"] / num_micro
  mean_N = jnp.mean(load_NE, axis=-1)
  return {"moe_load_min": jnp.min(load_NE, axis=-1), "moe_load_max": jnp.max(load_NE, axis=-1),
          "moe_load_cv": jnp.std(load_NE, axis=-1) / jnp.maximum(mean_N, 1e-30),
          "moe_dropped_fraction": sums["moe_dropped_fraction"] / num_micro,
          "moe_router_entropy": sums["moe_router_entropy"] / num_micro}


class LanguageModel(Objective):
  """The loss is a mean per target token: sums {xent_sum, z_loss_sum, moe_lb_loss_sum,
  weight_sum} (+ the routing statistics and, training with MTP, mtp_xent_sum and mtp_weight_sum).
  The load-balancing loss is a per-batch mean, so it enters weighted by the batch's target count
  (0 for dense models)."""

  batch_fields: tuple[str, ...] = FIELDS
  trains_indexer = True  # _sums adds the indexer's KL

  def __init__(self, model: ModelSpec, z_loss_multiplier: float, load_balance_loss_weight: float = 0.0,
               num_micro: int = 1, images: bool = False):
    """`num_micro`: the step's gradient-accumulation steps (routing statistics are means over them);
    `images`: the batches carry `pixel_values` for the model's vision tower."""
    self.model, self.num_micro = model, num_micro
    self.batch_fields = FIELDS + (PIXEL_VALUES,) if images else FIELDS
    self.z_loss_multiplier, self.load_balance_loss_weight = z_loss_multiplier, load_balance_loss_weight

  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    cfg = self.model.cfg
    if cfg.pipeline.num_pipeline_stages > 1 and cfg.pipeline.pipeline_schedule == "1f1b":
      return self._pipelined_sums(params, batch, dropout_rng)
    return self._sums(params, batch, dropout_rng, with_mtp=cfg.mtp.mtp_num_layers > 0)

  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    # Multi-token prediction is a training objective: evaluation reports the next-token loss only;
    # the 1F1B schedule's forward-only pass is the plain one.
    return self._sums(params, batch, None, with_mtp=False)[1]

  def _sums(self, params: Params, batch: Batch, dropout_rng: jax.Array | None,
            with_mtp: bool) -> tuple[jax.Array, Sums]:
    cfg = self.model.cfg
    weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    mtp_targets = (batch["targets"], weights_BL) if with_mtp else None
    sums, aux = self.model.apply_loss_sums(params, batch["inputs"], batch["inputs_position"],
                                           batch["inputs_segmentation"], batch["targets"], weights_BL,
                                           self.z_loss_multiplier, dropout_rng, mtp_targets, batch.get(PIXEL_VALUES))
    xent_sum, z_sum = sums["xent_sum"], sums["z_loss_sum"]
    weight_sum = jnp.sum(weights_BL)
    lb_sum = aux.get("moe_lb_loss", jnp.zeros((), jnp.float32)) * weight_sum
    total = xent_sum + self.z_loss_multiplier * z_sum + self.load_balance_loss_weight * lb_sum
    stats = {name: aux[name] for name in ROUTING_STATS if name in aux}  # summed over microbatches too
    if mtp_targets is not None:
      # A sum like the others (micro-batches add up); divided by the step's target count, it is
      # λ times the mean over depths of each depth's per-token loss.
      total = total + cfg.mtp.mtp_loss_scaling_factor / cfg.mtp.mtp_num_layers * aux["mtp_xent_sum"]
      stats.update(mtp_xent_sum=aux["mtp_xent_sum"], mtp_weight_sum=aux["mtp_weight_sum"])
    if "indexer_kl_sum" in aux:
      # The mean KL per (layer, query), weighted by the batch's target count like the load-balancing
      # loss. Its gradient reaches only the indexer (its inputs are detached, its target constant).
      indexer_sum = aux["indexer_kl_sum"] / jnp.maximum(aux["indexer_queries"], 1.0) * weight_sum
      total = total + cfg.mla.indexer_loss_scaling_factor * indexer_sum
      stats["indexer_loss_sum"] = indexer_sum
    return total, {"xent_sum": xent_sum, "z_loss_sum": z_sum, "moe_lb_loss_sum": lb_sum, "weight_sum": weight_sum,
                   **stats}

  def _pipelined_sums(self, params: Params, batch: Batch, dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    """The same loss with the stack and the head run by the 1F1B schedule (no routing statistics)."""
    cfg = self.model.cfg
    target_weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    weight_sum = jnp.sum(target_weights_BL)
    z_loss_multiplier = self.z_loss_multiplier

    def logits_loss(logits_mLV: jax.Array, inputs: Sums) -> tuple[jax.Array, Sums]:
      return token_loss_sums(logits_mLV, inputs["targets"], inputs["target_weights"], z_loss_multiplier)

    # d(total)/d(aux summed over layers and microbatches): the load-balancing term enters the
    # loss as its mean over layers and microbatches, weighted by the batch's target count.
    lb_scale = weight_sum / (cfg.pipeline.num_pipeline_microbatches * cfg.num_decoder_layers)
    # With float16 weights train_step differentiates the loss over its tokens (a cotangent of 1/weight_sum): the
    # schedule's own loop then takes that per-token gradient, whose sums stay inside float16's range.
    float16 = any(p.dtype == jnp.float16 for p in jax.tree.leaves(params))
    loss_scale = 1.0 / jax.lax.stop_gradient(self.divisor({"weight_sum": weight_sum})) if float16 else 1.0
    loss, sums = one_f_one_b_loss(self.model, params, batch, dropout_rng, logits_loss,
                                  {"targets": batch["targets"], "target_weights": target_weights_BL},
                                  {"moe_lb_loss": self.load_balance_loss_weight * lb_scale}, loss_scale)
    lb_sum = sums.get("aux_moe_lb_loss", jnp.zeros((), jnp.float32)) * lb_scale
    return loss, {"xent_sum": sums["xent_sum"], "z_loss_sum": sums["z_loss_sum"], "moe_lb_loss_sum": lb_sum,
                  "weight_sum": weight_sum}

  def divisor(self, sums: Sums) -> jax.Array:
    return jnp.maximum(sums["weight_sum"], 1.0)

  def train_metrics(self, sums: Sums) -> Metrics:
    num_tokens = self.divisor(sums)
    metrics = {"loss": sums["xent_sum"] / num_tokens, "z_loss": sums["z_loss_sum"] / num_tokens}
    if "mtp_xent_sum" in sums:
      metrics["mtp_loss"] = sums["mtp_xent_sum"] / jnp.maximum(sums["mtp_weight_sum"], 1.0)
    if "indexer_loss_sum" in sums:
      metrics["indexer_loss"] = sums["indexer_loss_sum"] / num_tokens
    if self.model.cfg.moe.num_experts > 1:
      metrics["moe_lb_loss"] = sums["moe_lb_loss_sum"] / num_tokens
      metrics.update(routing_metrics(sums, self.num_micro))
    return metrics

  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    loss = totals["xent_sum"] / max(totals["weight_sum"], 1.0)
    perplexity = math.exp(min(loss, 50.0))
    return {"eval_loss": loss, "eval_perplexity": perplexity}, f"loss {loss:8.4f} | perplexity {perplexity:.3f}"


def _build(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  optim = config.optim
  return LanguageModel(model, optim.z_loss_multiplier, config.model.moe.load_balance_loss_weight,
                       optim.gradient_accumulation_steps, images=config.data.max_images_per_row > 0)


# objective=lm: documents, their text column tokenized.
DOCUMENTS = ObjectiveRecord(_build, FIELDS, document_encoder, whole_records=False, chat_template=None,
                            cost=declared_cost(LanguageModel))
# objective=sft: conversations or prompt/completion pairs rendered with the chat template (and their images).
CONVERSATIONS = ObjectiveRecord(_build, FIELDS, conversation_encoder, whole_records=True, chat_template=True,
                                cost=declared_cost(LanguageModel))
