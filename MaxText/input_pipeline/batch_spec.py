"""The batch every iterator yields, declared once: five [global_batch, max_target_length] int32
arrays (ten with use_dpo: the rejected sequence of each pair in the same fields prefixed
`rejected_`, row for row beside its chosen one, so both halves of a pair share a device under
any batch sharding and stay together when gradient accumulation splits the rows; with use_grpo,
one prompt + completion per row, the completion's targets weighted, plus each row's float32
`advantages` [global_batch]). The synthetic
generator and the real-data pipelines build exactly these, and AOT compiles the train step for
them without running either."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.configuration.config_groups import DataConfig

# inputs/targets: token ids; inputs_position: 0, 1, ... per document; *_segmentation: 1, 2, ...
# per document in the row, 0 on padding.
FIELDS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
DTYPE = jnp.int32
REJECTED_PREFIX = "rejected_"
DPO_FIELDS = FIELDS + tuple(REJECTED_PREFIX + name for name in FIELDS)
ADVANTAGES = "advantages"  # float32 [global_batch]: one per row (rl/rollouts.py)
GRPO_FIELDS = FIELDS + (ADVANTAGES,)


def fields(cfg: DataConfig) -> tuple[str, ...]:
  return DPO_FIELDS if cfg.use_dpo else GRPO_FIELDS if cfg.use_grpo else FIELDS


def batch_spec(cfg: DataConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Name -> global shape and dtype of one batch for the data config `cfg` (config.data)."""
  shape = (cfg.global_batch_size, cfg.max_target_length)
  return {name: jax.ShapeDtypeStruct(shape[:1], jnp.float32) if name == ADVANTAGES
          else jax.ShapeDtypeStruct(shape, DTYPE) for name in fields(cfg)}
