"""Group relative policy optimisation (GRPO, Shao et al. 2024) and its variants: the loss and the
metrics users read, from per-token log-probabilities.

A GRPO batch holds one prompt + completion per row; `targets_segmentation` is 1 on the targets
that are completion tokens (the loss mask m), and each row has one advantage A (rl/rewards.py), or
each token its own A_t (on-policy distillation, objectives/teacher_advantage.py).
With r = exp(log π - log π_old) per completion token:

    l = -min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A) + β·(exp(log π_ref - log π) - (log π_ref - log π) - 1)

(the second term is the k3 estimator of KL(π‖π_ref), only when β > 0). The loss aggregates l:
  * grpo:    the mean over each sequence's tokens, then over sequences;
  * dapo:    the mean over every completion token of the batch;
  * dr_grpo: the sum over tokens / (sequences × max_completion_length).
Each is a sum divided by a count that adds up over micro-batches (`SUM_KEYS`, the objective's
divisor), so gradient accumulation gives the loss of the whole batch. Metric names follow TRL's
GRPOTrainer (`kl`, `entropy`, `clip_ratio/low_mean`, ...), token means over completion tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.models import ModelSpec, Params

Batch = dict[str, jax.Array]
Sums = dict[str, jax.Array]

OLD_LOGPS, REF_LOGPS = "old_logps", "ref_logps"  # fields objectives/grpo.py adds before the updates
SUM_KEYS = ("loss_sum", "sequence_count", "weight_sum", "kl_sum", "entropy_sum", "low_clipped_sum",
            "high_clipped_sum", "region_clipped_sum", "ratio_sum")


def token_logps(model: ModelSpec, params: Params, batch: Batch, dropout_rng: jax.Array | None,
                with_entropy: bool = True) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
  """(log-probability of each target token [B, L], the policy's entropy at each position [B, L],
  the model's auxiliary losses, e.g. MoE load balancing)."""
  logits_BLV, aux = model.apply_with_aux(params, batch["inputs"], batch["inputs_position"],
                                         batch["inputs_segmentation"], dropout_rng)
  logp_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
  logps_BL = jnp.take_along_axis(logp_BLV, batch["targets"][..., None], axis=-1)[..., 0]
  if not with_entropy:
    return logps_BL, None, dict(aux)
  return logps_BL, -jnp.sum(jnp.exp(logp_BLV) * logp_BLV, axis=-1), dict(aux)


def completion_mask(batch: Batch) -> jax.Array:
  return (batch["targets_segmentation"] != 0).astype(jnp.float32)


def loss_sums(logps_BL: jax.Array, old_logps_BL: jax.Array, ref_logps_BL: jax.Array | None, advantages_B: jax.Array,
              mask_BL: jax.Array, entropy_BL: jax.Array | None, *, loss_type: str, epsilon_low: float,
              epsilon_high: float, beta: float, max_completion_length: int,
              importance_weights_BL: jax.Array | None = None) -> Sums:
  """The SUM_KEYS sums of one batch; `loss_sum` / `sequence_count` (grpo, dr_grpo) or / `weight_sum`
  (dapo) is the loss. `advantages_B`: one per row [B], or one per token [B, L]. `importance_weights_BL`
  (rollout_correction.py, fixed) scale each token's policy-gradient term, not the KL term, as TRL
  applies its vLLM importance weights."""
  advantages_B1 = advantages_B if advantages_B.ndim == 2 else advantages_B[:, None]  # [B, L] or [B, 1]
  ratio_BL = jnp.exp(logps_BL - old_logps_BL)
  clipped_BL = jnp.clip(ratio_BL, 1.0 - epsilon_low, 1.0 + epsilon_high)
  per_token_BL = -jnp.minimum(ratio_BL * advantages_B1, clipped_BL * advantages_B1)
  if importance_weights_BL is not None:
    per_token_BL = per_token_BL * jax.lax.stop_gradient(importance_weights_BL)
  kl_BL = jnp.zeros_like(logps_BL)
  if beta != 0.0:
    assert ref_logps_BL is not None, "grpo_beta > 0 needs the reference's log-probs"
    delta_BL = ref_logps_BL - logps_BL
    kl_BL = jnp.exp(delta_BL) - delta_BL - 1.0
    per_token_BL = per_token_BL + beta * kl_BL
  tokens_B = jnp.sum(mask_BL, axis=1)
  masked_sum_B = jnp.sum(per_token_BL * mask_BL, axis=1)
  if loss_type == "grpo":
    loss_sum = jnp.sum(masked_sum_B / jnp.maximum(tokens_B, 1.0))
  elif loss_type == "dapo":
    loss_sum = jnp.sum(masked_sum_B)
  elif loss_type == "dr_grpo":
    loss_sum = jnp.sum(masked_sum_B) / max_completion_length
  else:
    raise ValueError(f"unknown grpo_loss_type {loss_type!r}")
  low_BL = ((ratio_BL < 1.0 - epsilon_low) & (advantages_B1 < 0)).astype(jnp.float32)
  high_BL = ((ratio_BL > 1.0 + epsilon_high) & (advantages_B1 > 0)).astype(jnp.float32)
  masked = lambda x: jnp.sum(jax.lax.stop_gradient(x) * mask_BL)  # noqa: E731
  return {
      "loss_sum": loss_sum,
      "sequence_count": jnp.float32(logps_BL.shape[0]),
      "weight_sum": jnp.sum(mask_BL),
      "kl_sum": masked(kl_BL),
      "entropy_sum": masked(entropy_BL) if entropy_BL is not None else jnp.float32(0.0),
      "low_clipped_sum": masked(low_BL),
      "high_clipped_sum": masked(high_BL),
      "region_clipped_sum": masked(jnp.maximum(low_BL, high_BL)),
      "ratio_sum": masked(ratio_BL),
  }


def divisor(sums: Sums, loss_type: str) -> jax.Array:
  count = sums["weight_sum"] if loss_type == "dapo" else sums["sequence_count"]
  return jnp.maximum(count, 1.0)


def metrics(sums: Sums, loss_type: str) -> dict[str, jax.Array]:
  """Token means over the completion tokens, named as TRL logs them."""
  tokens = jnp.maximum(sums["weight_sum"], 1.0)
  return {"loss": sums["loss_sum"] / divisor(sums, loss_type),
          "kl": sums["kl_sum"] / tokens,
          "entropy": sums["entropy_sum"] / tokens,
          "clip_ratio/low_mean": sums["low_clipped_sum"] / tokens,
          "clip_ratio/high_mean": sums["high_clipped_sum"] / tokens,
          "clip_ratio/region_mean": sums["region_clipped_sum"] / tokens,
          "policy_ratio_mean": sums["ratio_sum"] / tokens}
