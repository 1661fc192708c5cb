"""The batch every iterator yields, declared once: five [global_batch, max_target_length] int32
arrays (ten with objective=dpo: the rejected sequence of each pair in the same fields prefixed
`rejected_`, row for row beside its chosen one, so both halves of a pair share a device under
any batch sharding and stay together when gradient accumulation splits the rows; with objective=grpo,
one prompt + completion per row, the completion's targets weighted, plus each row's float32
`advantages` [global_batch] and float32 `sampler_logps` [global_batch, max_target_length], the
engine's log-probability of each completion target token (0 elsewhere); with max_images_per_row > 0,
multimodal SFT's float32 `pixel_values` [global_batch, max_images_per_row, 3, image_size,
image_size]: each row's images in token order, zeros after them, which the model ignores; with
objective=distill reading distill_top_k_path, the teacher's top k per position). The synthetic
generator and the real-data pipelines build exactly these, and AOT compiles the train step for
them without running either."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.configuration import objective_registry
from MaxText.configuration.data_config import DataConfig

# inputs/targets: token ids; inputs_position: 0, 1, ... per document; *_segmentation: 1, 2, ...
# per document in the row, 0 on padding.
FIELDS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
DTYPE = jnp.int32
REJECTED_PREFIX = "rejected_"
DPO_FIELDS = FIELDS + tuple(REJECTED_PREFIX + name for name in FIELDS)
ADVANTAGES = "advantages"  # float32 [global_batch]: one per row (rl/rollouts.py)
SAMPLER_LOGPS = "sampler_logps"  # float32 [global_batch, max_target_length] (rl/rollouts.py)
GRPO_FIELDS = FIELDS + (ADVANTAGES, SAMPLER_LOGPS)
PIXEL_VALUES = "pixel_values"  # float32 [global_batch, max_images_per_row, 3, R, R] (packing.py)
IMAGE_FIELDS = FIELDS + (PIXEL_VALUES,)
NUM_CHANNELS = 3
# objective=distill with distill_top_k_path: the teacher's top k per position, read from files
# (teacher_top_k.py): int32 token ids and float32 log-probs [global_batch, max_target_length, k].
TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS = "teacher_top_k_indices", "teacher_top_k_logps"
FLOAT_FIELDS = (ADVANTAGES, SAMPLER_LOGPS, PIXEL_VALUES, TEACHER_TOP_K_LOGPS)


def fields(cfg: DataConfig) -> tuple[str, ...]:
  """The objective's fields (its record's, configuration/objective_registry.py); IMAGE_FIELDS with images."""
  if cfg.max_images_per_row:
    return IMAGE_FIELDS
  return objective_registry.record(cfg.objective).batch_fields


def _shape(cfg: DataConfig, name: str, teacher_top_k: int) -> tuple[int, ...]:
  if name in (TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS):
    return (cfg.global_batch_size, cfg.max_target_length, teacher_top_k)
  if name == ADVANTAGES:
    return (cfg.global_batch_size,)
  if name == PIXEL_VALUES:
    return (cfg.global_batch_size, cfg.max_images_per_row, NUM_CHANNELS, cfg.image_size, cfg.image_size)
  return (cfg.global_batch_size, cfg.max_target_length)


def batch_spec(cfg: DataConfig, teacher_top_k: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
  """Name -> global shape and dtype of one batch for the data config `cfg` (config.data);
  `teacher_top_k` > 0 adds a precomputed teacher's top k (config.distill.top_k_from_files)."""
  names = fields(cfg) + ((TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS) if teacher_top_k else ())
  return {name: jax.ShapeDtypeStruct(_shape(cfg, name, teacher_top_k), jnp.float32 if name in FLOAT_FIELDS else DTYPE)
          for name in names}
