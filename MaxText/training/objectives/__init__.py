"""Training objectives, chosen once per run (`objective_for`, called by run_assembly.build_run).

An objective owns its loss, the batch fields it reads, the state it keeps beside the parameters
and its train and eval metrics (base.Objective); the train step, the eval step, the eval hook,
the state layout and the FLOPs count ask it instead of branching on the kind of run.

  * `language_model.LanguageModel`: pre-training and SFT (next-token loss, z-loss, MoE
    load balancing, multi-token prediction; under the 1F1B schedule through `pipelined.py`);
  * `preference.Preference`: DPO against a frozen reference (objective=dpo);
  * `grpo.Grpo`: reinforcement learning on the run's own sampled completions (objective=grpo).

A new objective: a module here with an `Objective` subclass, and its line in `objective_for`
(its batch fields also go in input_pipeline/batch_spec.py, its records' encoding in input_pipeline/).
"""

from __future__ import annotations

from MaxText.configuration.config import Config
from MaxText.layers.models import ModelSpec
from MaxText.training.objectives.base import Objective
from MaxText.training.objectives.grpo import Grpo
from MaxText.training.objectives.language_model import LanguageModel
from MaxText.training.objectives.preference import Preference
from MaxText.training.optimizers import Partition


def objective_for(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  """The objective `config` trains `model` with; `partition`: which parameters the optimizer trains."""
  optim = config.optim
  if config.data.objective == "dpo":
    return Preference(model, partition, optim.dpo_beta, optim.dpo_label_smoothing)
  if config.data.objective == "grpo":
    return Grpo(model, partition, config.rl, config.model.moe.load_balance_loss_weight,
                optim.gradient_accumulation_steps)
  return LanguageModel(model, optim.z_loss_multiplier, config.model.moe.load_balance_loss_weight,
                       optim.gradient_accumulation_steps, images=config.data.max_images_per_row > 0)


__all__ = ["Grpo", "LanguageModel", "Objective", "Preference", "objective_for"]
