"""Direct preference optimisation (DPO, Rafailov et al. 2023): the loss and the metrics users read.

A DPO batch holds each example twice, row for row: the chosen sequence in the usual fields
(`inputs`, `targets`, ...) and the rejected one in the same fields prefixed `rejected_`
(input_pipeline/batch_spec.py), both starting with the same prompt; target weights are 1 on the
completion only. A sequence's log-probability is the sum of its completion tokens' log-probs.

    Δ = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected))
    loss = -(1 - ε) log σ(βΔ) - ε log σ(-βΔ)        (β = dpo_beta, ε = dpo_label_smoothing)

ε > 0 is conservative DPO (labels flipped with probability ε). The rewards are β times each
log-ratio; accuracy counts pairs whose chosen reward is strictly higher, as TRL's DPOTrainer logs
them. A row without completion tokens (eval padding past the end of the data) is not a pair.

The reference is the run's starting model: a copy held in the train state
(`PreferenceState.reference`) or LoRA's frozen base with the adapters off, as the preference
objective (objectives/preference.py) passes it; it is only ever evaluated here, in `reference_logps`.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from MaxText.input_pipeline.batch_spec import REJECTED_PREFIX as REJECTED
from MaxText.models import ModelSpec, Params

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]

# Sums that add up over micro-batches and eval batches; `dpo_metrics` turns them into means.
SUM_KEYS = ("dpo_loss_sum", "chosen_reward_sum", "rejected_reward_sum", "accuracy_sum", "chosen_logps_sum",
            "rejected_logps_sum", "pair_count", "weight_sum")


def sequence_logps(model: ModelSpec, params: Params, batch: Batch, prefix: str,
                   dropout_rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(summed completion log-probs [B], completion tokens [B]) of the sequence under `prefix`."""
  logits_BLV, _ = model.apply_with_aux(params, batch[prefix + "inputs"], batch[prefix + "inputs_position"],
                                       batch[prefix + "inputs_segmentation"], dropout_rng)
  xent_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), batch[prefix + "targets"])
  weights_BL = (batch[prefix + "targets_segmentation"] != 0).astype(jnp.float32)
  return -jnp.sum(xent_BL * weights_BL, axis=1), jnp.sum(weights_BL, axis=1)


def reference_logps(model: ModelSpec, reference: Params, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected) summed completion log-probs [B] under the frozen reference (no dropout,
  no gradient). The one place the reference is evaluated: a reference that is the policy with
  its adapters switched off changes only this function."""
  reference = jax.lax.stop_gradient(reference)
  chosen, _ = sequence_logps(model, reference, batch, "", None)
  rejected, _ = sequence_logps(model, reference, batch, REJECTED, None)
  return chosen, rejected


def dpo_losses(policy_chosen: jax.Array, policy_rejected: jax.Array, reference_chosen: jax.Array,
               reference_rejected: jax.Array, beta: float, label_smoothing: float
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(per-pair loss, chosen reward, rejected reward), each [B], from summed log-probs."""
  chosen_logratios = policy_chosen - reference_chosen
  rejected_logratios = policy_rejected - reference_rejected
  logits = beta * (chosen_logratios - rejected_logratios)
  losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits) - label_smoothing * jax.nn.log_sigmoid(-logits)
  return losses, jax.lax.stop_gradient(beta * chosen_logratios), jax.lax.stop_gradient(beta * rejected_logratios)


def dpo_loss_sums(model: ModelSpec, params: Params, reference: Params, batch: Batch, dropout_rng: jax.Array | None,
                  beta: float, label_smoothing: float) -> tuple[jax.Array, Metrics]:
  """(summed per-pair loss, the SUM_KEYS sums) over the batch's pairs."""
  rng_chosen, rng_rejected = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
  policy_chosen, chosen_tokens = sequence_logps(model, params, batch, "", rng_chosen)
  policy_rejected, rejected_tokens = sequence_logps(model, params, batch, REJECTED, rng_rejected)
  reference_chosen, reference_rejected = reference_logps(model, reference, batch)
  sums = pair_sums(policy_chosen, policy_rejected, reference_chosen, reference_rejected, chosen_tokens,
                   rejected_tokens, beta, label_smoothing)
  return sums["dpo_loss_sum"], sums


def pair_sums(policy_chosen: jax.Array, policy_rejected: jax.Array, reference_chosen: jax.Array,
              reference_rejected: jax.Array, chosen_tokens: jax.Array, rejected_tokens: jax.Array, beta: float,
              label_smoothing: float) -> Metrics:
  """The SUM_KEYS sums from per-row summed log-probs [B] and completion token counts [B]."""
  losses, chosen_rewards, rejected_rewards = dpo_losses(policy_chosen, policy_rejected, reference_chosen,
                                                        reference_rejected, beta, label_smoothing)
  is_pair = ((chosen_tokens > 0) & (rejected_tokens > 0)).astype(jnp.float32)
  return {
      "dpo_loss_sum": jnp.sum(losses * is_pair),
      "chosen_reward_sum": jnp.sum(chosen_rewards * is_pair),
      "rejected_reward_sum": jnp.sum(rejected_rewards * is_pair),
      "accuracy_sum": jnp.sum((chosen_rewards > rejected_rewards) * is_pair),
      "chosen_logps_sum": jnp.sum(jax.lax.stop_gradient(policy_chosen) * is_pair),
      "rejected_logps_sum": jnp.sum(jax.lax.stop_gradient(policy_rejected) * is_pair),
      "pair_count": jnp.sum(is_pair),
      "weight_sum": jnp.sum(chosen_tokens) + jnp.sum(rejected_tokens),
  }


def dpo_metrics(sums: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Means per pair, named as TRL logs them (`rewards/chosen`, ...); works on device arrays in the
  step and on host floats in the eval hook (`prefix="eval_"`)."""
  pairs = jnp.maximum(sums["pair_count"], 1.0) if isinstance(sums["pair_count"], jax.Array) \
      else max(float(sums["pair_count"]), 1.0)
  chosen, rejected = sums["chosen_reward_sum"] / pairs, sums["rejected_reward_sum"] / pairs
  return {f"{prefix}loss": sums["dpo_loss_sum"] / pairs,
          f"{prefix}rewards/chosen": chosen,
          f"{prefix}rewards/rejected": rejected,
          f"{prefix}rewards/margins": chosen - rejected,
          f"{prefix}rewards/accuracies": sums["accuracy_sum"] / pairs,
          f"{prefix}logps/chosen": sums["chosen_logps_sum"] / pairs,
          f"{prefix}logps/rejected": sums["rejected_logps_sum"] / pairs}
