"""The distillation group (objective=distill): the teacher and the loss against it
(training/objectives/distill.py). Checked here without I/O; the teacher's model keys and weights are
read when the run builds its objective."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from MaxText.configuration.config_fields import LAYOUT, key, read_keys
from MaxText.configuration.config_fields import require as _require

DISTILL_LOSSES = ("forward_kl", "reverse_kl")  # KL(teacher || student), KL(student || teacher)
DISTILL_OBJECTIVES = ("distill", "distill_sft")  # on documents, on conversations (the completion's tokens)


TEACHER_PER_MICRO_BATCH, TEACHER_PER_ROLLOUT_BATCH = "micro_batch", "rollout_batch"


def live_teacher(objective: str, distill: "DistillConfig", rl_teacher_kl_weight: float) -> str:
  """Where a run's teacher runs beside the student: in every micro-batch's loss (distillation without
  top-k files), once per rollout batch (on-policy distillation: objective=grpo, rl_teacher_kl_weight > 0),
  or "" (no teacher in the run)."""
  if objective in DISTILL_OBJECTIVES and not distill.distill_top_k_path:
    return TEACHER_PER_MICRO_BATCH
  if objective == "grpo" and rl_teacher_kl_weight > 0:
    return TEACHER_PER_ROLLOUT_BATCH
  return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  distill_teacher_path: str = key()  # the teacher's weights: a parameters-only checkpoint or another run's checkpoints
  distill_teacher_model_name: str = key()  # configs/models/<name>.yml; "" = the model keys saved with the teacher
  distill_teacher_overrides: tuple[str, ...] = key()  # key=value model keys over the teacher's
  distill_loss: str = key()  # forward_kl | reverse_kl
  distill_alpha: float = key()  # weight of the distillation term; 1 - alpha weighs the hard-label loss
  distill_temperature: float = key()  # both distributions are softened by it; the KL term is scaled by its square
  distill_top_k: int = key()  # 0: the full vocabulary; k: the teacher's k most likely tokens per position
  # generate_teacher_top_k.py's output: the teacher's top k read beside the batches instead of running it.
  # Fixed on resume: with it the state holds no teacher, and the data position counts the files' batches.
  distill_top_k_path: str = key(fixed_on_resume=LAYOUT)

  @property
  def top_k_from_files(self) -> int:
    """k when the teacher's top k come with the batches (distill_top_k_path), else 0."""
    return self.distill_top_k if self.distill_top_k_path else 0

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "DistillConfig":
    if v["objective"] not in DISTILL_OBJECTIVES:  # the teacher's files are read by distillation only
      return cls(**read_keys(cls, v, distill_top_k_path=""))
    distill = cls(**read_keys(cls, v))
    _require(bool(distill.distill_teacher_path or distill.distill_top_k_path),
             f"objective={v['objective']} needs a teacher: set distill_teacher_path to its checkpoint (a "
             "parameters-only checkpoint or another run's checkpoints), or distill_top_k_path to its precomputed top k")
    _require(distill.distill_loss in DISTILL_LOSSES,
             f"distill_loss must be one of {', '.join(DISTILL_LOSSES)}, got {distill.distill_loss!r}")
    _require(0.0 <= distill.distill_alpha <= 1.0,
             f"distill_alpha (the distillation term's weight; 1 - alpha weighs the labels) must be in [0, 1], got "
             f"{distill.distill_alpha}")
    _require(distill.distill_temperature > 0, f"distill_temperature must be > 0, got {distill.distill_temperature}")
    _require(0 <= distill.distill_top_k <= v["vocab_size"],
             f"distill_top_k={distill.distill_top_k} must be in [0, vocab_size={v['vocab_size']}] (0 = the full "
             "vocabulary)")
    _require(not distill.distill_top_k_path or distill.distill_top_k > 0,
             f"distill_top_k_path={distill.distill_top_k_path} holds the teacher's top k only; set distill_top_k to "
             "k (the KL over the full vocabulary needs the teacher beside the student)")
    return distill
