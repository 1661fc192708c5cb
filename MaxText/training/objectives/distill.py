"""Knowledge distillation (objective=distill; the loss is distill_loss.py's): the student trains on
documents against a frozen teacher's next-token distributions, mixed with the labels.

The teacher is another model (any family the project loads, of another size, with the same
tokenizer) named by distill_teacher_path and its model keys (distill_teacher_model_name, else the keys
saved with its checkpoint, plus distill_teacher_overrides; configuration/config.companion_config, as a
speculative draft is named). It runs forward-only on the student's mesh, its parameters sharded by the
same logical rules, with no optimizer state and no gradient: it lives in the train state
(`DistillState.teacher`), so it is born sharded, counted by the AOT memory report and saved with the
run's checkpoints (a resumed run reads it from there, not from distill_teacher_path, and is bitwise
equal; the path must still exist: the teacher's model keys and tokenizer are checked against it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, cast

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from MaxText import models
from MaxText.configuration import config as config_lib
from MaxText.configuration import distill_config
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import conversation_encoder, document_encoder
from MaxText.input_pipeline.batch_spec import FIELDS, TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS
from MaxText.layers.moe import ROUTING_STATS
from MaxText.models import ModelSpec, token_loss_sums
from MaxText.paths import storage
from MaxText.training import params_io
from MaxText.training.objectives import distill_loss
from MaxText.training.objectives.base import Batch, Metrics, Objective, ObjectiveRecord, Params, Sums, T, declared_cost
from MaxText.training.optimizers import Partition
from MaxText.training.train_state import TrainState

TEACHER_KEYS = ("distill_teacher_model_name", "distill_teacher_path", "distill_teacher_overrides")


@struct.dataclass
class DistillState(TrainState):
  """The train state of a distillation run: also the frozen teacher's parameters, sharded like a
  model's under the run's rules (only read by the step: no gradient, no optimizer state)."""

  teacher: Params | None = None


def teacher_config(config: Config, use: str = "objective=distill") -> Config:
  """The teacher's configuration: its model keys, every other key the student's (mesh, rules, dtype,
  max_target_length); a UserError when it is missing or reads another vocabulary or tokenizer.
  `use`: what needs the teacher, for the messages (objective=grpo reads one for on-policy distillation)."""
  d = config.distill
  path = d.distill_teacher_path
  if not storage.exists(path):
    raise UserError(f"distill_teacher_path {path} does not exist; point it at the teacher's checkpoint (a "
                    "parameters-only checkpoint or another run's checkpoints)")
  teacher = config_lib.companion_config(config, "teacher", d.distill_teacher_model_name, path,
                                        d.distill_teacher_overrides, TEACHER_KEYS, use,
                                        objective="lm", lora_rank=0)
  # The teacher runs on the student's rows: a shorter max_target_length in its overrides passed the
  # teacher's own position checks (max_position_embeddings) and its forward then read past them (NaN loss).
  if teacher.model.max_target_length != config.model.max_target_length:
    raise ConfigError(f"{use}: distill_teacher_overrides sets max_target_length={teacher.model.max_target_length}, "
                      f"but the teacher runs on the student's rows of max_target_length="
                      f"{config.model.max_target_length}; drop max_target_length from distill_teacher_overrides (the "
                      "teacher takes the student's)")
  student_vocab, teacher_vocab = config.model.vocab_size, teacher.model.vocab_size
  if student_vocab != teacher_vocab:
    raise UserError(f"the teacher ({path}) has vocab_size={teacher_vocab}, the student {student_vocab}: distillation "
                    "compares next-token distributions token by token, so both must use the same tokenizer; pick a "
                    "teacher of the student's tokenizer")
  run_dir = run_record.run_dir_of(path)
  saved = run_record.read_saved(run_dir) if run_dir is not None else None
  if saved and "tokenizer_path" in saved:
    theirs = (str(saved.get("tokenizer_type", "")), str(saved["tokenizer_path"]))
    ours = (config.data.tokenizer_type, config.data.tokenizer_path)
    # One file however it is spelled (relative, a trailing slash, a link): its text alone refused the same tokenizer.
    if theirs[0] != ours[0] or not storage.same_file(theirs[1], ours[1]):
      raise UserError(f"the teacher ({path}) was trained with tokenizer {theirs[1]} ({theirs[0]}), the student reads "
                      f"{ours[1]} ({ours[0]}): distillation needs the same tokenizer; set tokenizer_path and "
                      "tokenizer_type to the teacher's")
  return teacher


def teacher_field(teacher: ModelSpec, rules: tuple[tuple[str, tuple[str, ...]], ...], params: T) -> T:
  """The state's `teacher` field in the form of `params` (the student's): on shardings, the teacher's
  (the same rules on the same mesh); on arrays or their shapes, zeros that `load_teacher` replaces."""
  leaf = jax.tree.leaves(params)[0]
  if isinstance(leaf, NamedSharding):
    assert isinstance(leaf.mesh, jax.sharding.Mesh), "the state is sharded on a concrete mesh"
    return cast(T, models.shard_params_like(teacher, leaf.mesh, rules))
  return cast(T, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), teacher.abstract_params))


def load_teacher(teacher: ModelSpec, path: str, placeholder: Params) -> Params:
  """The teacher's weights read from `path` into the shardings of `placeholder` (`teacher_field`'s
  zeros), which is freed first."""
  shardings = jax.tree.map(lambda x: x.sharding, placeholder)
  jax.tree.map(lambda x: x.delete(), placeholder)  # the placeholder goes before the teacher comes
  try:
    return params_io.load_params(path, teacher.abstract_params, shardings)
  except UserError as e:  # its lines name a path and "the model config": say they are the teacher's, and whose keys
    keys = (" (the teacher's model keys: distill_teacher_model_name and distill_teacher_overrides, else those saved "
            "with its checkpoint)") if "model config" in str(e) else ""
    e.args = (f"distill_teacher_path: {e}{keys}",)
    raise  # the same kind of error (its exit code, a storage failure's exit at once)


@dataclasses.dataclass(frozen=True)
class TeacherRun:
  """How an objective runs its teacher, for the planner's analytical model (aot/plan_model.Teacher)."""

  cfg: ModelConfig
  held_bytes_per_token: int  # its output kept through the student's forward and backward
  per_micro_batch: bool  # its forward runs in every micro-batch's loss (else once per step's batch)


def teacher_runs(config: Config) -> tuple[TeacherRun, ...]:
  """The teacher `config`'s objective runs beside the student, configured as the objective's build
  reads it: objective=distill's in each micro-batch's loss, its float32 log-probs (all, or the top k
  with their indices) live until the student's backward; on-policy distillation's (objective=grpo,
  rl_teacher_kl_weight > 0) once per rollout batch, one log-prob per token kept; none otherwise."""
  d = config.distill
  where = distill_config.live_teacher(config.data.objective, d, config.rl.rl_teacher_kl_weight)
  if where == distill_config.TEACHER_PER_MICRO_BATCH:
    held = 8 * d.distill_top_k if d.distill_top_k else 4 * config.model.vocab_size
    return (TeacherRun(teacher_config(config).model, held, per_micro_batch=True),)
  if where == distill_config.TEACHER_PER_ROLLOUT_BATCH:
    return (TeacherRun(teacher_config(config, "rl_teacher_kl_weight > 0").model, 4, per_micro_batch=False),)
  return ()


class Distill(Objective):
  """The loss is a mean per target token: sums {loss_sum, distill_kl_sum, xent_sum, z_loss_sum,
  moe_lb_loss_sum, weight_sum}. The teacher's forward runs inside each micro-batch's loss (its
  top k taken there), so only one micro-batch's teacher logits are ever live."""

  batch_fields: tuple[str, ...] = FIELDS
  state_class: type[TrainState] = DistillState

  def __init__(self, model: ModelSpec, teacher: ModelSpec, teacher_path: str, rules: tuple[tuple[str, tuple[str, ...]], ...],
               kind: str, alpha: float, temperature: float, top_k: int, z_loss_multiplier: float = 0.0,
               load_balance_loss_weight: float = 0.0):
    self.model, self.teacher, self.teacher_path, self.rules = model, teacher, teacher_path, rules
    self.kind, self.alpha, self.temperature, self.top_k = kind, alpha, temperature, top_k
    self.z_loss_multiplier, self.load_balance_loss_weight = z_loss_multiplier, load_balance_loss_weight
    # The student's forward and backward per row; the teacher's forward is counted on its own model.
    self.forward_only_models: tuple[ModelConfig, ...] = (teacher.cfg,)

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    return {"teacher": teacher_field(self.teacher, self.rules, params)}

  def load_extra_state(self, state: TrainState) -> TrainState:
    assert isinstance(state, DistillState) and state.teacher is not None
    return dataclasses.replace(state, teacher=load_teacher(self.teacher, self.teacher_path, state.teacher))

  def context(self, state: TrainState) -> Params | None:
    assert isinstance(state, DistillState), type(state)
    return state.teacher

  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    targets = self.teacher_targets(context, batch)
    logits_BLV, aux = self.model.apply_with_aux(params, *inputs, dropout_rng)
    weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    _, sums = token_loss_sums(logits_BLV, batch["targets"], weights_BL, self.z_loss_multiplier)
    kl_sum = jnp.sum(distill_loss.token_kl(logits_BLV, targets, self.kind, self.temperature) * weights_BL)
    weight_sum = jnp.sum(weights_BL)
    loss_sum = distill_loss.mixed(kl_sum, sums["xent_sum"], self.alpha, self.temperature)
    lb_sum = aux.get("moe_lb_loss", jnp.zeros((), jnp.float32)) * weight_sum
    total = loss_sum + self.z_loss_multiplier * sums["z_loss_sum"] + self.load_balance_loss_weight * lb_sum
    stats = {name: aux[name] for name in ROUTING_STATS if name in aux}
    return total, {"loss_sum": loss_sum, "distill_kl_sum": kl_sum, "xent_sum": sums["xent_sum"],
                   "z_loss_sum": sums["z_loss_sum"], "moe_lb_loss_sum": lb_sum, "weight_sum": weight_sum, **stats}

  def teacher_targets(self, context: Params | None, batch: Batch) -> distill_loss.TeacherTargets:
    """The teacher's distribution at every position of the (micro-)batch: its forward pass here."""
    assert context is not None, "the step hands distillation its teacher (context)"
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    teacher_logits_BLV = self.teacher.apply(jax.lax.stop_gradient(context), *inputs)
    return distill_loss.teacher_targets(teacher_logits_BLV, self.temperature, self.top_k)

  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    return self.loss_sums(params, context, batch, None)[1]

  def divisor(self, sums: Sums) -> jax.Array:
    return jnp.maximum(sums["weight_sum"], 1.0)

  def train_metrics(self, sums: Sums) -> Metrics:
    tokens = self.divisor(sums)
    metrics = {"loss": sums["loss_sum"] / tokens, "distill_kl": sums["distill_kl_sum"] / tokens,
               "xent": sums["xent_sum"] / tokens, "z_loss": sums["z_loss_sum"] / tokens}
    if self.model.cfg.moe.num_experts > 1:
      metrics["moe_lb_loss"] = sums["moe_lb_loss_sum"] / tokens
    return metrics

  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    tokens = max(totals["weight_sum"], 1.0)
    loss, kl, xent = totals["loss_sum"] / tokens, totals["distill_kl_sum"] / tokens, totals["xent_sum"] / tokens
    perplexity = math.exp(min(xent, 50.0))
    return ({"eval_loss": loss, "eval_distill_kl": kl, "eval_xent": xent, "eval_perplexity": perplexity},
            f"loss {loss:8.4f} | xent {xent:8.4f} | kl {kl:.4f} | perplexity {perplexity:.3f}")


class DistillFromFiles(Distill):
  """distill_top_k_path: the teacher's top k come with each batch, read from the files
  generate_teacher_top_k.py wrote (input_pipeline/teacher_top_k.py), so no teacher sits in the state
  or runs in the step. Its log-probs are at temperature 1; divided by τ and renormalised over the k
  (distill_loss.token_kl does that) they are the teacher's distribution at τ over its top k."""

  batch_fields = FIELDS + (TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS)
  state_class = TrainState

  def __init__(self, model: ModelSpec, kind: str, alpha: float, temperature: float, top_k: int,
               z_loss_multiplier: float = 0.0, load_balance_loss_weight: float = 0.0):
    # Distill's loss without its teacher model: nothing of a teacher to build, hold or count.
    self.model, self.kind, self.alpha, self.temperature, self.top_k = model, kind, alpha, temperature, top_k
    self.z_loss_multiplier, self.load_balance_loss_weight = z_loss_multiplier, load_balance_loss_weight
    self.forward_only_models = ()

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    return {}

  def load_extra_state(self, state: TrainState) -> TrainState:
    return state

  def context(self, state: TrainState) -> Params | None:
    return None

  def teacher_targets(self, context: Params | None, batch: Batch) -> distill_loss.TeacherTargets:
    return distill_loss.TeacherTargets(batch[TEACHER_TOP_K_LOGPS] / self.temperature, batch[TEACHER_TOP_K_INDICES])


def _build(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  cfg = config.model
  if cfg.pipeline.num_pipeline_stages > 1 and cfg.pipeline.pipeline_schedule == "1f1b":
    raise UserError("objective=distill runs the plain forward pass; set pipeline_schedule=gpipe or "
                    "num_pipeline_stages=1")
  if cfg.mtp.mtp_num_layers > 0:
    raise UserError("objective=distill trains the next-token head only; set mtp_num_layers=0")
  d = config.distill
  if d.distill_top_k_path:  # the teacher's top k come with the batches: distill_teacher_path is not read
    return DistillFromFiles(model, d.distill_loss, d.distill_alpha, d.distill_temperature, d.distill_top_k,
                            config.optim.z_loss_multiplier, cfg.moe.load_balance_loss_weight)
  teacher = models.build_model_spec(teacher_config(config).model)
  return Distill(model, teacher, d.distill_teacher_path, config.mesh.logical_axis_rules, d.distill_loss,
                 d.distill_alpha, d.distill_temperature, d.distill_top_k, config.optim.z_loss_multiplier,
                 cfg.moe.load_balance_loss_weight)


# objective=distill: documents, their text column tokenized, as objective=lm reads them.
DOCUMENTS = ObjectiveRecord(_build, FIELDS, document_encoder, whole_records=False, chat_template=None,
                            cost=declared_cost(Distill))
# objective=distill_sft: conversations rendered with the chat template, as objective=sft reads them; the
# prompt's targets carry no weight (targets_segmentation 0), so the KL and the labels count the completion only.
CONVERSATIONS = ObjectiveRecord(_build, FIELDS, conversation_encoder, whole_records=True, chat_template=True,
                                cost=declared_cost(Distill))
