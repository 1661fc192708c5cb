"""The Optax optimizer and learning-rate schedule built from OptimConfig."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from MaxText.config_groups import OptimConfig
from MaxText.errors import ConfigError

HOST_MEMORY_KIND = "pinned_host"


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to `cosine_final_fraction` of it.

  Steps past `schedule_steps` stay at the final value.
  """
  peak = cfg.learning_rate
  decay_steps = max(1, cfg.learning_rate_schedule_steps - cfg.warmup_steps)
  cosine = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.cosine_learning_rate_final_fraction)
  if cfg.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])


def create_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(
      learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
      eps_root=cfg.adam_eps_root, weight_decay=cfg.adam_weight_decay)
  if cfg.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
  return adamw


def check_host_memory_kinds(kinds: set[str], platform: str) -> None:
  """One-line error when the backend cannot hold arrays in pinned host memory."""
  if HOST_MEMORY_KIND not in kinds:
    raise ConfigError(
        f"optimizer_memory_host_offload=True needs the {HOST_MEMORY_KIND!r} memory kind, but {platform} devices "
        f"offer {sorted(kinds)}; set optimizer_memory_host_offload=False")


def host_offloaded(opt_shardings: Any, mesh: Mesh) -> Any:
  """The same shardings in pinned host memory: optimizer state (AdamW's mu and nu, 2x the
  float32 parameters) then lives in host RAM; the step copies it to the device for the update
  and back (`jax.device_put` inside the jitted step, overlapped by XLA with compute)."""
  device = mesh.devices.flat[0]
  try:
    kinds = {memory.kind for memory in device.addressable_memories()}
  except Exception:  # topology-only devices (AOT compile) have no memories to list; XLA checks at compile
    kinds = {HOST_MEMORY_KIND}
  check_host_memory_kinds(kinds, device.platform)
  return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY_KIND), opt_shardings,
                      is_leaf=lambda x: isinstance(x, NamedSharding))
