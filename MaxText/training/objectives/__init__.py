"""Training objectives, chosen once per run (`objective_for`, called by run_assembly.build_run).

An objective owns its loss, the batch fields it reads, the state it keeps beside the parameters
and its train and eval metrics (base.Objective); the train step, the eval step, the eval hook,
the state layout and the FLOPs count ask it instead of branching on the kind of run.

  * `language_model.LanguageModel`: pre-training and SFT (next-token loss, z-loss, MoE
    load balancing, multi-token prediction; under the 1F1B schedule through `pipelined.py`);
  * `preference.Preference`: DPO against a frozen reference (objective=dpo);
  * `grpo.Grpo`: reinforcement learning on the run's own sampled completions (objective=grpo).

A new objective: a module here with an `Objective` subclass and its line in `OBJECTIVES`, its name
in configuration/data_config.OBJECTIVES, its batch fields' line in input_pipeline/batch_spec.py's
OBJECTIVE_FIELDS and its records' line in input_pipeline's OBJECTIVE_DATA (tests/test_objectives.py
checks that the four name the same objectives).
"""

from __future__ import annotations

from typing import Callable

from MaxText.configuration.config import Config
from MaxText.models import ModelSpec
from MaxText.training.objectives.base import Objective
from MaxText.training.objectives.grpo import Grpo
from MaxText.training.objectives.language_model import LanguageModel
from MaxText.training.objectives.preference import Preference
from MaxText.training.optimizers import Partition


def _language_model(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  optim = config.optim
  return LanguageModel(model, optim.z_loss_multiplier, config.model.moe.load_balance_loss_weight,
                       optim.gradient_accumulation_steps, images=config.data.max_images_per_row > 0)


def _preference(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  return Preference(model, partition, config.optim.dpo_beta, config.optim.dpo_label_smoothing)


def _grpo(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  return Grpo(model, partition, config.rl, config.model.moe.load_balance_loss_weight,
              config.optim.gradient_accumulation_steps)


# The config key `objective` -> how to build its Objective (its data: input_pipeline.OBJECTIVE_DATA and
# batch_spec.OBJECTIVE_FIELDS under the same name).
OBJECTIVES: dict[str, Callable[[Config, ModelSpec, Partition], Objective]] = {
    "lm": _language_model, "sft": _language_model, "dpo": _preference, "grpo": _grpo}


def objective_for(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  """The objective `config` trains `model` with; `partition`: which parameters the optimizer trains."""
  return OBJECTIVES[config.data.objective](config, model, partition)


__all__ = ["OBJECTIVES", "Grpo", "LanguageModel", "Objective", "Preference", "objective_for"]
