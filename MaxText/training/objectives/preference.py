"""Preference optimisation (DPO; the loss and metrics are dpo.py's): pairs of a chosen and a
rejected sequence against a frozen reference, the run's starting model."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from MaxText.configuration.config import Config
from MaxText.training.objectives import dpo
from MaxText.input_pipeline import preference_encoder
from MaxText.input_pipeline.batch_spec import DPO_FIELDS
from MaxText.models import ModelSpec
from MaxText.training.metrics import ObjectiveCost
from MaxText.training.objectives.base import Batch, Metrics, Objective, ObjectiveRecord, Params, Sums, T
from MaxText.training.optimizers import Partition
from MaxText.training.train_state import PreferenceState, TrainState, reference_of


class Preference(Objective):
  """The loss is a mean per preference pair. The reference is a copy of the starting weights kept
  in the state (`PreferenceState.reference`), or, when the optimizer's partition freezes a base
  that is the starting model (LoRA), that base's function (adapters off): no copy."""

  batch_fields = DPO_FIELDS
  # Two sequences trained (chosen and rejected) and the same two through the reference (forward only).
  passes_per_row = 2 * 3 + 2 * 1
  trained_per_row = 2
  needs_loaded_params = ("objective=dpo needs a reference model: set load_parameters_path to the starting weights (a "
                         "params-only checkpoint or another run's checkpoints); a fresh init has nothing to prefer "
                         "against")

  def __init__(self, model: ModelSpec, partition: Partition, beta: float, label_smoothing: float):
    self.model, self.partition, self.beta, self.label_smoothing = model, partition, beta, label_smoothing
    self.keeps_copy = copies_reference(partition)
    self.state_class = PreferenceState if self.keeps_copy else TrainState

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    return {"reference": copy(params)} if self.keeps_copy else {}

  def context(self, state: TrainState) -> Params | None:
    if self.keeps_copy:
      reference: Params | None = reference_of(state)
      return reference
    return self.partition.base_model(state.params)

  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    assert context is not None, "the step hands DPO its reference (context)"
    return dpo.dpo_loss_sums(self.model, params, context, batch, dropout_rng, self.beta, self.label_smoothing)

  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    return self.loss_sums(params, context, batch, None)[1]

  def divisor(self, sums: Sums) -> jax.Array:
    return jnp.maximum(sums["pair_count"], 1.0)

  def train_metrics(self, sums: Sums) -> Metrics:
    return dpo.dpo_metrics(sums)

  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    scalars = dpo.dpo_metrics(totals, prefix="eval_")
    return scalars, (f"loss {scalars['eval_loss']:8.4f} | reward accuracy {scalars['eval_rewards/accuracies']:.3f} | "
                     f"reward margin {scalars['eval_rewards/margins']:.4f}")


def copies_reference(partition: Partition) -> bool:
  """Whether the state holds the reference as a copy: unless the frozen part gives the starting model (LoRA)."""
  return not partition.frozen_gives_base_model


def _cost(config: Config, partition: Partition) -> ObjectiveCost:
  return ObjectiveCost(Preference.passes_per_row, Preference.trained_per_row, Preference.trains_indexer,
                       reference_copy=copies_reference(partition))


def _build(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  return Preference(model, partition, config.optim.dpo_beta, config.optim.dpo_label_smoothing)


# objective=dpo: {"prompt", "chosen", "rejected"} records, one pair per row.
PREFERENCE_PAIRS = ObjectiveRecord(_build, DPO_FIELDS, preference_encoder, whole_records=True, chat_template=False,
                                   cost=_cost)
