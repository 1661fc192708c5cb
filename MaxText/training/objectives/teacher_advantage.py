"""On-policy distillation inside GRPO (objective=grpo with rl_teacher_kl_weight > 0; objectives/grpo.py):
the student samples the rollouts, a frozen teacher scores every sampled token, and each completion
token gets its own advantage from the two log-probabilities:

    A_t = w_r · A_reward + λ · (log p_teacher(y_t | y_<t) - log π_old(y_t | y_<t))

with A_reward the row's group-normalised reward advantage (rl/rewards.py), w_r =
rl_reward_advantage_weight and λ = rl_teacher_kl_weight. The second term is minus the one-sample
estimate of the per-token reverse KL(π_old ‖ p_teacher) at the sampled token, so the policy gradient
of GRPO's clipped loss with A_t lowers the reverse KL to the teacher on the student's own samples.
Each token's term stands alone (no sum over the later tokens: a discount of 0), as Thinking Machines'
on-policy distillation recipe does; w_r = 0, λ = 1 is that recipe, and w_r > 0 mixes in the rewards.

A_t is fixed during the step's updates (the teacher is frozen; π_old is the ratio's old policy: the
trainer's log-probs at the step, or the engine's where grpo_old_logps resolves to the sampler), and 0
outside the completion tokens, which the loss masks anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TEACHER_LOGPS = "teacher_logps"  # float32 [B, L], the field objectives/grpo.py's prepare_batch adds


def token_advantages(advantages_B: jax.Array, old_logps_BL: jax.Array, teacher_logps_BL: jax.Array,
                     mask_BL: jax.Array, reward_weight: float, teacher_weight: float) -> jax.Array:
  """A_t [B, L] (see the module docstring); no gradient flows through it."""
  teacher_term_BL = teacher_weight * (teacher_logps_BL - old_logps_BL) * mask_BL
  return jax.lax.stop_gradient(reward_weight * advantages_B[:, None] + teacher_term_BL)


def reverse_kl_sum(old_logps_BL: jax.Array, teacher_logps_BL: jax.Array, mask_BL: jax.Array) -> jax.Array:
  """Σ_t (log π_old - log p_teacher) over the completion tokens: the sampled estimate of the reverse
  KL to the teacher, summed (the `teacher_kl` metric divides it by the completion tokens)."""
  return jnp.sum(jax.lax.stop_gradient(old_logps_BL - teacher_logps_BL) * mask_BL)
