"""The interface every training objective implements (see objectives/__init__.py)."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import jax

from MaxText.training import metrics
from MaxText.training.train_state import TrainState

if TYPE_CHECKING:
  from MaxText.configuration.config import Config
  from MaxText.configuration.model_config import ModelConfig
  from MaxText.input_pipeline import Encoded
  from MaxText.models import ModelSpec
  from MaxText.training.optimizers import Partition

Params = dict[str, Any]  # nested dict of arrays
Batch = dict[str, jax.Array]
Sums = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
T = TypeVar("T")


class Objective(abc.ABC):
  """What a run minimises and reports: its loss, the batch fields it reads, the state it keeps
  beside the parameters and its metrics. The train step (train_step.py) is the same for every
  objective: loss and gradients of `loss_sums` (summed over micro-batches), divided by `divisor`,
  the optimizer's update, then `train_metrics`; the eval step sums `eval_sums` over batches and
  the eval hook reports `eval_metrics`.

  Sums add up over micro-batches and eval batches, so accumulation and evaluation need no
  per-objective code; every objective's sums hold `weight_sum`, the tokens trained on (the step
  reports it as `num_tokens`, which throughput counts)."""

  # The batch fields the loss reads, exactly those input_pipeline/batch_spec.py declares for it.
  batch_fields: tuple[str, ...]
  # Model passes per batch row, a forward pass counting 1 (forward + backward: 3), for the FLOPs count.
  passes_per_row: int = 3
  # Of those, the sequences per row with a backward pass (3 passes each); the rest run forward only.
  trained_per_row: int = 1
  # The loss adds the lightning indexer's KL (indexer_loss_scaling_factor): its backward runs, for the FLOPs count.
  trains_indexer: bool = False
  # Other models run forward-only once per row (a distillation teacher), for the FLOPs count.
  forward_only_models: tuple[ModelConfig, ...] = ()
  # The train state's class: TrainState, or a subclass holding `extra_state`'s fields.
  state_class: type[TrainState] = TrainState
  # Why a fresh initialisation cannot start this objective; "" when it can.
  needs_loaded_params: str = ""
  # Optimizer updates the step makes on one batch (PPO-style iterations over a rollout batch).
  updates_per_batch: int = 1
  # The batches are the run's own samples (rl/rollouts.py), made from the current parameters.
  uses_rollouts: bool = False

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]:
    """The state's fields beyond step, params and opt_state, from the starting parameters (e.g. a
    frozen reference: `copy(params)`). Called on arrays, on their shapes and on their shardings,
    so it only arranges what `copy` gives, or, for a model of its own (a distillation teacher), its
    shardings where given shardings and placeholders elsewhere, which `load_extra_state` fills."""
    return {}

  def load_extra_state(self, state: TrainState) -> TrainState:
    """A state born in this run (fresh, or around load_parameters_path; not one restored from a
    checkpoint) with what `extra_state` only shaped read from elsewhere (a distillation teacher's
    weights)."""
    return state

  def context(self, state: TrainState) -> Params | None:
    """What the loss reads from the state besides the trained parameters (e.g. a frozen
    reference), taken before differentiating: it gets no gradient."""
    return None

  def prepare_batch(self, params: Params, context: Params | None, batch: Batch) -> Batch:
    """The batch with what stays fixed over the step's updates, computed once before them from the
    step's starting parameters (e.g. the old policy's log-probs); no gradient flows through it."""
    return batch

  @abc.abstractmethod
  def loss_sums(self, params: Params, context: Params | None, batch: Batch,
                dropout_rng: jax.Array | None) -> tuple[jax.Array, Sums]:
    """(the training loss summed, not averaged, over the batch; the sums the metrics come from)."""

  @abc.abstractmethod
  def eval_sums(self, params: Params, context: Params | None, batch: Batch) -> Sums:
    """The sums of one eval batch (no dropout), prepared (`prepare_batch`) and, with gradient
    accumulation, one micro-batch of it (the eval step adds their sums)."""

  @abc.abstractmethod
  def divisor(self, sums: Sums) -> jax.Array:
    """What turns the summed loss and gradients into means (e.g. per target token)."""

  @abc.abstractmethod
  def train_metrics(self, sums: Sums) -> Metrics:
    """The step's metrics from its sums; `loss` is the one the spike and non-finite guards read."""

  @abc.abstractmethod
  def eval_metrics(self, totals: Mapping[str, float]) -> tuple[dict[str, float], str]:
    """(`eval_`-named scalars, the eval log line's text) from the scalar sums over the eval batches."""


def declared_cost(objective: type[Objective]) -> Callable[[Config, Partition], metrics.ObjectiveCost]:
  """The cost of an objective whose passes are attributes of its class and that keeps no frozen copy."""
  return lambda config, partition: metrics.ObjectiveCost(objective.passes_per_row, objective.trained_per_row,
                                                         objective.trains_indexer)


@dataclasses.dataclass(frozen=True)
class ObjectiveRecord:
  """One objective as its module declares it and configuration/objective_registry.py names it: what
  the config check, the batch layout (input_pipeline/batch_spec.py), the input pipeline and
  objective_for read. Whether batches come from a dataset or from the run's own rollouts is the
  built Objective's `uses_rollouts`."""

  build: Callable[[Config, ModelSpec, Partition], Objective]  # (config, model, trained partition) -> the loss
  batch_fields: tuple[str, ...]  # the batch's fields (with max_images_per_row > 0, batch_spec.IMAGE_FIELDS)
  # The dataset records' encoder and the packer's arguments it needs (input_pipeline's *_encoder).
  encoder: Callable[[Config], Encoded]
  whole_records: bool  # the encoder takes each record whole, not its text column
  # None: no chat tokenizer; False: one whose template only message lists need; True: a template is required
  chat_template: bool | None
  # (config, the trained partition) -> its passes per row and frozen copy, without building it (the planner's)
  cost: Callable[[Config, Partition], metrics.ObjectiveCost] = declared_cost(Objective)  # type: ignore[type-abstract]
