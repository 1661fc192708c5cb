"""Reinforcement learning from rewards (GRPO; the loss is grpo_loss.py's): rows are the run's own
sampled completions (rl/rollouts.py), each with its group-normalised advantage. With a teacher
(rl_teacher_kl_weight > 0, named by the distill_teacher_* keys) it is on-policy distillation: each
completion token's advantage also holds the teacher's log-prob of it (teacher_advantage.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import struct

from MaxText.configuration.config import Config
from MaxText.configuration import rl_config
from MaxText.configuration.rl_config import RLConfig
from MaxText.input_pipeline import document_encoder
from MaxText.input_pipeline.batch_spec import ADVANTAGES, GRPO_FIELDS, SAMPLER_LOGPS
from MaxText import models
from MaxText.models import ModelSpec
from MaxText.layers.moe import ROUTING_STATS
from MaxText.training.objectives import distill, grpo_loss, rollout_correction, teacher_advantage
from MaxText.training.objectives.base import Batch, Metrics, Objective, ObjectiveRecord, Params, Sums, T
from MaxText.training.objectives.language_model import routing_metrics
from MaxText.training import microbatches
from MaxText.training.metrics import ObjectiveCost
from MaxText.training.optimizers import Partition
from MaxText.training.train_state import PreferenceState, TrainState, reference_of

Rules = tuple[tuple[str, tuple[str, ...]], ...]


@struct.dataclass
class TeacherRLState(PreferenceState):
  """The train state of on-policy distillation: also the frozen teacher, sharded by the run's rules
  (no gradient, no optimizer state; saved with the run, as objective=distill keeps its teacher).
  `reference` is the frozen reference with grpo_beta > 0 (kept as a copy), else None."""

  teacher: Params | None = None


@dataclasses.dataclass(frozen=True)
class Teacher:
  """The teacher of on-policy distillation: its model, where its weights are, the run's rules."""

  model: ModelSpec
  path: str
  rules: Rules


class Grpo(Objective):
  """The policy-gradient loss of one rollout batch, applied `updates_per_batch` times.

  Before the updates the step asks `prepare_batch` for what stays fixed across them: the old
  policy's log-probs (the parameters the rollout sampled from; with one update they are the
  current ones, so the ratio is 1 and only its gradient counts) and, with grpo_beta > 0, the
  frozen reference's. The reference is a copy of the starting weights in the state or, under
  LoRA, the base with the adapters off (as DPO does). With rl_importance_sampling on, it also
  weighs each token by the trainer's over the engine's probability (rollout_correction.py). With
  grpo_old_logps resolving to the sampler (auto: batches made ahead, no importance sampling), π_old is
  the engine's log-prob of each token instead: the policy that made the batch, up to
  rl_max_staleness updates old, so the clip bounds the update against it as PPO's ratio does.

  With a teacher, `prepare_batch` also scores the completions with it (forward-only, on the training
  mesh), and the loss gives each completion token its own advantage (teacher_advantage.py)."""

  batch_fields = GRPO_FIELDS
  needs_loaded_params = ("objective=grpo samples from the starting policy: set load_parameters_path to its weights (a "
                         "params-only checkpoint, e.g. an SFT run's export); a fresh init samples noise")
  uses_rollouts = True

  def __init__(self, model: ModelSpec, partition: Partition, rl: RLConfig, load_balance_loss_weight: float = 0.0,
               num_micro: int = 1, teacher: Teacher | None = None):
    self.model, self.partition, self.rl, self.teacher = model, partition, rl, teacher
    self.load_balance_loss_weight, self.num_micro = load_balance_loss_weight, num_micro
    self.updates_per_batch = rl.grpo_num_iterations
    self.corrects = rl.rl_importance_sampling != "off"
    self.old_from_sampler = rl_config.old_logps_from_sampler(rl)
    self.uses_reference = rl.grpo_beta > 0
    cost = step_cost(rl, partition)
    self.keeps_copy = cost.reference_copy
    self.state_class = TeacherRLState if teacher else PreferenceState if self.keeps_copy else TrainState
    # The teacher's forward, once per rollout batch, counts on its own model.
    self.forward_only_models = (teacher.model.cfg,) if teacher else ()
    self.passes_per_row, self.trained_per_row = cost.passes_per_row, cost.trained_per_row

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    extra = {"reference": copy(params)} if self.keeps_copy else {}
    if self.teacher:
      extra["teacher"] = distill.teacher_field(self.teacher.model, self.teacher.rules, params)
    return extra

  def load_extra_state(self, state: TrainState) -> TrainState:
    if not self.teacher:
      return state
    assert isinstance(state, TeacherRLState) and state.teacher is not None
    return dataclasses.replace(state, teacher=distill.load_teacher(self.teacher.model, self.teacher.path, state.teacher))

  def _reference(self, state: TrainState) -> Params | None:
    if not self.uses_reference:
      return None
    if self.keeps_copy:
      reference: Params | None = reference_of(state)
      return reference
    return self.partition.base_model(state.params)

  def context(self, state: TrainState) -> Params | None:
    """The frozen reference (grpo_beta > 0); with a teacher, {"reference": it or None, "teacher": ...}."""
    if not self.teacher:
      return self._reference(state)
    assert isinstance(state, TeacherRLState), type(state)
    return {"reference": self._reference(state), "teacher": state.teacher}

  def prepare_batch(self, params: Params, context: Params | None, batch: Batch) -> Batch:
    """The batch with the log-probs that stay fixed over the updates (no dropout, no gradient)."""
    extra = {}

    def logps(model: Any, weights: Params) -> jax.Array:
      # One micro-batch at a time, as the gradients: the whole batch's logits at once would need more memory
      # than the step's micro-batches do, however many gradient_accumulation_steps split them.
      return microbatches.map_rows(lambda b: grpo_loss.token_logps(model, weights, b, None, with_entropy=False)[0],
                                   batch, self.num_micro)

    if self.teacher:
      assert context is not None, "the step hands on-policy distillation its teacher (context)"
      extra[teacher_advantage.TEACHER_LOGPS] = logps(self.teacher.model, context["teacher"])
      context = context["reference"]
    if self.updates_per_batch > 1:
      extra[grpo_loss.OLD_LOGPS] = logps(self.model, params)
    if context is not None:
      extra[grpo_loss.REF_LOGPS] = logps(self.model, context)
    if self.corrects:  # π_old as TRL scores it for the weights: with one update, an extra forward kept apart
      old_BL = extra[grpo_loss.OLD_LOGPS] if grpo_loss.OLD_LOGPS in extra else logps(self.model, params)
      extra.update(self._importance_fields(old_BL, batch))
    return {**batch, **jax.lax.stop_gradient(extra)}

  def _importance_fields(self, old_BL: jax.Array, batch: Batch) -> Batch:
    """The weights [B, L] and the mismatch metrics of the whole batch, each a [B] field holding
    the batch's value in every row (so micro-batches split them without changing them)."""
    rl, mask_BL = self.rl, grpo_loss.completion_mask(batch)
    sampler_BL = batch[SAMPLER_LOGPS]
    weights, ratio = rollout_correction.weights(old_BL, sampler_BL, mask_BL, rl.rl_importance_sampling,
                                                rl.rl_importance_sampling_cap, rl.rl_importance_sampling_floor)
    rows = old_BL.shape[0]
    fields = {rollout_correction.WEIGHTS: jnp.broadcast_to(weights, old_BL.shape)}
    for name, value in rollout_correction.metrics(old_BL, sampler_BL, mask_BL, weights, ratio).items():
      fields[rollout_correction.METRIC_PREFIX + name] = jnp.full((rows,), value, jnp.float32)
    return fields

  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    rl = self.rl
    logps_BL, entropy_BL, aux = grpo_loss.token_logps(self.model, params, batch, dropout_rng)
    old_BL = batch[grpo_loss.OLD_LOGPS] if grpo_loss.OLD_LOGPS in batch else jax.lax.stop_gradient(logps_BL)
    if self.old_from_sampler:  # the behaviour policy; a token it did not score (NaN) keeps the trainer's
      old_BL = jnp.where(jnp.isnan(batch[SAMPLER_LOGPS]), old_BL, batch[SAMPLER_LOGPS])
    mask_BL, advantages = grpo_loss.completion_mask(batch), batch[ADVANTAGES]
    teacher_BL = batch.get(teacher_advantage.TEACHER_LOGPS)
    if teacher_BL is not None:  # on-policy distillation: one advantage per token
      advantages = teacher_advantage.token_advantages(advantages, old_BL, teacher_BL, mask_BL,
                                                      rl.rl_reward_advantage_weight, rl.rl_teacher_kl_weight)
    sums = grpo_loss.loss_sums(logps_BL, old_BL, batch.get(grpo_loss.REF_LOGPS), advantages,
                               mask_BL, entropy_BL, loss_type=rl.grpo_loss_type,
                               epsilon_low=rl.grpo_epsilon_low, epsilon_high=rl.grpo_epsilon_high,
                               beta=rl.grpo_beta, max_completion_length=rl.max_completion_length,
                               importance_weights_BL=batch.get(rollout_correction.WEIGHTS))
    if teacher_BL is not None:
      sums["teacher_kl_sum"] = teacher_advantage.reverse_kl_sum(old_BL, teacher_BL, mask_BL)
    total = sums["loss_sum"]
    if "moe_lb_loss" in aux:  # a per-batch mean: weighted by what the loss is divided by
      lb_sum = aux["moe_lb_loss"] * grpo_loss.divisor(sums, rl.grpo_loss_type)
      total = total + self.load_balance_loss_weight * lb_sum
      sums["moe_lb_loss_sum"] = lb_sum
    sums.update({name: aux[name] for name in ROUTING_STATS if name in aux})
    for name in batch:  # each micro-batch adds its share of the batch's value
      if name.startswith(rollout_correction.METRIC_PREFIX):
        sums[name] = batch[name][0] / self.num_micro
    return total, sums

  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    return self.loss_sums(params, context, batch, None)[1]  # the eval step has prepared the batch

  def divisor(self, sums: Sums) -> jax.Array:
    return grpo_loss.divisor(sums, self.rl.grpo_loss_type)

  def train_metrics(self, sums: Sums) -> Metrics:
    metrics = grpo_loss.metrics(sums, self.rl.grpo_loss_type)
    if "teacher_kl_sum" in sums:  # per completion token, as `kl` (to the reference) is
      metrics["teacher_kl"] = sums["teacher_kl_sum"] / jnp.maximum(sums["weight_sum"], 1.0)
    metrics.update({name[len(rollout_correction.METRIC_PREFIX):]: value for name, value in sums.items()
                    if name.startswith(rollout_correction.METRIC_PREFIX)})
    if "moe_lb_loss_sum" in sums:
      metrics["moe_lb_loss"] = sums["moe_lb_loss_sum"] / self.divisor(sums)
      metrics.update(routing_metrics(sums, self.num_micro))
    return metrics

  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    loss = totals["loss_sum"] / max(totals["weight_sum" if self.rl.grpo_loss_type == "dapo" else "sequence_count"], 1.0)
    return {"eval_loss": loss}, f"loss {loss:8.4f}"


def step_cost(rl: RLConfig, partition: Partition) -> ObjectiveCost:
  """Per row: the update's forward and backward (3 passes) each iteration; once per rollout batch the old
  policy's forward (when iterated or importance-sampled) and, with grpo_beta > 0, the reference's, a copy in
  the state unless the frozen part gives it (LoRA). The rollouts' decoding is not counted."""
  updates, uses_reference = rl.grpo_num_iterations, rl.grpo_beta > 0
  fixed_passes = int(updates > 1 or rl.rl_importance_sampling != "off") + int(uses_reference)
  return ObjectiveCost(3 * updates + fixed_passes, updates, Grpo.trains_indexer,
                       reference_copy=uses_reference and not partition.frozen_gives_base_model)


def _build(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  teacher = None
  if config.rl.rl_teacher_kl_weight > 0:
    teacher_model = models.build_model_spec(distill.teacher_config(config, "rl_teacher_kl_weight > 0").model)
    teacher = Teacher(teacher_model, config.distill.distill_teacher_path, config.mesh.logical_axis_rules)
  return Grpo(model, partition, config.rl, config.model.moe.load_balance_loss_weight,
              config.optim.gradient_accumulation_steps, teacher)


# objective=grpo: its train batches are rollouts (uses_rollouts) of the prompts rl/prompts.py reads.
ROLLOUTS = ObjectiveRecord(_build, GRPO_FIELDS, document_encoder, whole_records=False, chat_template=False,
                         cost=lambda config, partition: step_cost(config.rl, partition))
