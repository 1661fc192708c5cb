"""Off-policy correction between the rollout engine and the trainer: truncated or masked importance
sampling on the engine's recorded log-probabilities (rl_importance_sampling).

The engine samples completions from μ (its own kernels, bf16); the trainer scores the same tokens
as π_old (its parameters at the rollout, before any update). The policy-gradient term of each
completion token is multiplied by a fixed weight w (no gradient flows through it):

    Δ = log π_old - log μ per completion token (0 where μ is not known: NaN)
    token_*:    r = exp(Δ) per token           sequence_*: r = exp(Σ_t Δ) per sequence
    *_truncate: w = clip(r, floor, cap)        (TIS)
    *_mask:     w = r, or 0 outside [floor, cap] (MIS: the token or the sequence is rejected)

This is Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(2025; truncated and masked importance sampling, TIS / MIS), as TRL's GRPOTrainer implements it
for vLLM rollouts (`vllm_importance_sampling_mode` token_truncate | token_mask | sequence_truncate |
sequence_mask, `vllm_importance_sampling_clip_max` / `_clip_min`): tests/test_rollout_correction.py
runs TRL's code on the same log-probs. The weights and the mismatch metrics are computed once per
rollout batch over the whole batch (`prepare_batch`), so they do not depend on micro-batching.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.configuration.rl_config import IMPORTANCE_SAMPLING_MODES as MODES
WEIGHTS = "importance_weights"  # float32 [B, L], the field prepare_batch adds
METRIC_PREFIX = "importance_metric/"  # float32 [B] fields: the batch's value in every row
# What TRL logs (sampling/...), plus the k3 estimate of KL(μ ‖ π_old) and the corrected share.
METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max", "sampling/kl", "sampling/importance_sampling_corrected")


def weights(trainer_BL: jax.Array, sampler_BL: jax.Array, mask_BL: jax.Array, mode: str, cap: float, floor: float
            ) -> tuple[jax.Array, jax.Array]:
  """(the weights w, the raw ratios r): [B, L] for token_* modes, [B, 1] for sequence_* modes."""
  delta_BL = jnp.nan_to_num((trainer_BL - sampler_BL) * mask_BL, nan=0.0)
  if mode.startswith("sequence_"):
    delta_BL = jnp.sum(delta_BL, axis=-1, keepdims=True)
  ratio = jnp.exp(delta_BL)
  if mode.endswith("_truncate"):
    return jnp.clip(ratio, floor, cap), ratio
  if mode.endswith("_mask"):
    return jnp.where((ratio < floor) | (ratio > cap), 0.0, ratio), ratio
  raise ValueError(f"unknown rl_importance_sampling {mode!r}; expected one of {', '.join(MODES)}")


def metrics(trainer_BL: jax.Array, sampler_BL: jax.Array, mask_BL: jax.Array, weights_B_: jax.Array,
            ratio_B_: jax.Array) -> dict[str, jax.Array]:
  """The mismatch of one rollout batch (METRICS). Log-prob differences and the KL are over the
  completion tokens whose sampler log-prob is known; the ratios over the completion tokens (token
  modes) or the sequences (sequence modes), as TRL reports them."""
  delta_BL = trainer_BL - sampler_BL
  known_BL = (mask_BL > 0) & ~jnp.isnan(delta_BL)
  delta_BL = jnp.where(known_BL, delta_BL, 0.0)
  num_known = jnp.maximum(jnp.sum(known_BL), 1)
  # k3 = r - 1 - log r with r = π_old / μ: a non-negative, unbiased estimate of KL(μ ‖ π_old) on samples of μ.
  k3_BL = jnp.exp(delta_BL) - 1.0 - delta_BL
  per_token = weights_B_.shape[-1] != 1
  counted = (mask_BL > 0) if per_token else jnp.ones(weights_B_.shape, bool)
  count = jnp.maximum(jnp.sum(counted), 1)
  return {
      "sampling/sampling_logp_difference/mean": jnp.sum(jnp.abs(delta_BL)) / num_known,
      "sampling/sampling_logp_difference/max": jnp.max(jnp.abs(delta_BL)),
      "sampling/importance_sampling_ratio/min": jnp.min(jnp.where(counted, weights_B_, jnp.inf)),
      "sampling/importance_sampling_ratio/mean": jnp.sum(jnp.where(counted, weights_B_, 0.0)) / count,
      "sampling/importance_sampling_ratio/max": jnp.max(jnp.where(counted, weights_B_, -jnp.inf)),
      "sampling/kl": jnp.sum(k3_BL) / num_known,
      "sampling/importance_sampling_corrected": jnp.sum(counted & (weights_B_ != ratio_B_)) / count,
  }
