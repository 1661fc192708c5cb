"""The Optax optimizer and learning-rate schedule built from OptimConfig."""

from __future__ import annotations

import optax

from MaxText.config_groups import OptimConfig


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to `cosine_final_fraction` of it.

  Steps past `schedule_steps` stay at the final value.
  """
  peak = cfg.learning_rate
  decay_steps = max(1, cfg.schedule_steps - cfg.warmup_steps)
  cosine = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.cosine_final_fraction)
  if cfg.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])


def create_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(
      learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
      eps_root=cfg.adam_eps_root, weight_decay=cfg.weight_decay)
  if cfg.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
  return adamw
