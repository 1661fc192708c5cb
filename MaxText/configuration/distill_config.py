"""The distillation group (objective=distill): the teacher and the loss against it
(training/objectives/distill.py). Checked here without I/O; the teacher's model keys and weights are
read when the run builds its objective."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from MaxText.configuration.config_fields import LAYOUT, key, read_keys
from MaxText.configuration.config_fields import require as _require

DISTILL_LOSSES = ("forward_kl", "reverse_kl")  # KL(teacher || student), KL(student || teacher)
DISTILL_OBJECTIVES = ("distill", "distill_sft")  # on documents, on conversations (the completion's tokens)


TEACHER_PER_MICRO_BATCH, TEACHER_PER_ROLLOUT_BATCH = "micro_batch", "rollout_batch"
# Far past this the float32 logits / τ differ by little more than their rounding, so the τ²-scaled KL
# grows into rounding noise (even negative); recipes use τ of 1 to 20.
MAX_DISTILL_TEMPERATURE = 100.0


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
  # The teacher's parameters are part of the saved state: a resume reads them from the checkpoint, so another
  # teacher named at a resume would be recorded but never used (a new run from load_parameters_path switches).
  distill_teacher_path: str = key(fixed_on_resume=LAYOUT)  # the teacher's weights: a parameters-only checkpoint or another run's checkpoints
  distill_teacher_model_name: str = key(fixed_on_resume=LAYOUT)  # configs/models/<name>.yml; "" = the model keys saved with the teacher
  distill_teacher_overrides: tuple[str, ...] = key(fixed_on_resume=LAYOUT)  # key=value model keys over the teacher's
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
  def from_values(cls, v: Mapping[str, Any], reads_data: bool = True) -> "DistillConfig":
    """`reads_data`: False for a tool that trains nothing (and for a teacher's own configuration,
    which inherits the student's keys): a teacher named there is not a forgotten objective."""
    if v["objective"] not in DISTILL_OBJECTIVES:  # the teacher's files are read by distillation only
      if reads_data:
        _check_unread_teacher(v)
      return cls(**read_keys(cls, v, distill_top_k_path=""))
    distill = cls(**read_keys(cls, v))
    _require(bool(distill.distill_teacher_path or distill.distill_top_k_path),
             f"objective={v['objective']} needs a teacher: set distill_teacher_path to its checkpoint (a "
             "parameters-only checkpoint or another run's checkpoints), or distill_top_k_path to its precomputed top k")
    _require(distill.distill_loss in DISTILL_LOSSES,
             f"distill_loss must be one of {', '.join(DISTILL_LOSSES)}, got {distill.distill_loss!r}"
             f"{_did_you_mean(distill.distill_loss, DISTILL_LOSSES)}")
    _require(0.0 <= distill.distill_alpha <= 1.0,
             f"distill_alpha (the distillation term's weight; 1 - alpha weighs the labels) must be in [0, 1], got "
             f"{distill.distill_alpha}")
    # inf passed "> 0" and made every loss NaN (τ² · 0); a huge finite τ turns the KL into rounding noise.
    _require(0 < distill.distill_temperature <= MAX_DISTILL_TEMPERATURE,
             f"distill_temperature must be > 0 and <= {MAX_DISTILL_TEMPERATURE:g} (beyond it float32 logits / "
             f"temperature lose the differences the KL measures; 1 to 20 is usual), got {distill.distill_temperature}")
    _require(0 <= distill.distill_top_k <= v["vocab_size"],
             f"distill_top_k={distill.distill_top_k} must be in [0, vocab_size={v['vocab_size']}] (0 = the full "
             "vocabulary)")
    # Renormalised over one token both distributions are 1: the KL is 0 at every position, with no gradient.
    _require(distill.distill_top_k != 1,
             "distill_top_k=1 renormalises the teacher's and the student's distributions over one token, where "
             "both are 1, so the KL is 0 and teaches nothing; set distill_top_k >= 2 (or 0, the full vocabulary)")
    _require(not distill.distill_top_k_path or distill.distill_top_k > 0,
             f"distill_top_k_path={distill.distill_top_k_path} holds the teacher's top k only; set distill_top_k to "
             "k (the KL over the full vocabulary needs the teacher beside the student)")
    return distill


def _did_you_mean(given: str, allowed: tuple[str, ...]) -> str:
  close = difflib.get_close_matches(str(given).lower().replace("-", "_"), allowed, n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_unread_teacher(v: Mapping[str, Any]) -> None:
  """A teacher named for an objective that never reads it: the run would train without it and look
  like distillation (objective=distill forgotten). objective=grpo checks its own teacher (rl_config)."""
  objective, teacher, files = v["objective"], v["distill_teacher_path"], v["distill_top_k_path"]
  distils = "set objective=distill (documents) or distill_sft (conversations) to distil from it"
  _require(not teacher or objective == "grpo",
           f"distill_teacher_path={teacher} names a teacher, but objective={objective} reads none: {distils}, or "
           "objective=grpo with rl_teacher_kl_weight > 0 on rollouts; or drop distill_teacher_path")
  _require(not files, f"distill_top_k_path={files} holds a teacher's top k, but objective={objective} reads none: "
           f"{distils}; or drop distill_top_k_path")
