"""The batch every iterator yields, declared once: five [global_batch, max_target_length] int32
arrays. The synthetic generator and the packed real-data pipeline build exactly these, and AOT
compiles the train step for them without running either."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.config_groups import DataConfig

# inputs/targets: token ids; inputs_position: 0, 1, ... per document; *_segmentation: 1, 2, ...
# per document in the row, 0 on padding.
FIELDS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
DTYPE = jnp.int32


def batch_spec(cfg: DataConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Name -> global shape and dtype of one batch for the data config `cfg` (config.data)."""
  shape = (cfg.global_batch_size, cfg.max_target_length)
  return {name: jax.ShapeDtypeStruct(shape, DTYPE) for name in FIELDS}
