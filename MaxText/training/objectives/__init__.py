"""Training objectives, chosen once per run (`objective_for`, called by run_assembly.build_run).

An objective owns its loss, the batch fields it reads, the state it keeps beside the parameters
and its train and eval metrics (base.Objective); the train step, the eval step, the eval hook,
the state layout and the FLOPs count ask it instead of branching on the kind of run.

  * `language_model.LanguageModel`: pre-training and SFT (next-token loss, z-loss, MoE
    load balancing, multi-token prediction; under the 1F1B schedule through `pipelined.py`);
  * `preference.Preference`: DPO against a frozen reference (objective=dpo);
  * `grpo.Grpo`: reinforcement learning on the run's own sampled completions (objective=grpo).

Each objective's module also declares it whole in an `ObjectiveRecord` (base.py): how to build it,
its batch fields and its data (the records' encoder, whole records or a text column, the chat
template it needs). A new objective is one module here (its `Objective` subclass and its record)
plus one line in configuration/objective_registry.OBJECTIVES naming the record under the config's
name; the config check, input_pipeline/batch_spec.py, the input pipeline and `objective_for` all
read the record from there (tests/test_objectives.py registers a made-up one that way).
"""

from __future__ import annotations

from MaxText.configuration import objective_registry
from MaxText.configuration.config import Config
from MaxText.models import ModelSpec
from MaxText.training.objectives.base import Objective, ObjectiveRecord
from MaxText.training.objectives.grpo import Grpo
from MaxText.training.objectives.language_model import LanguageModel
from MaxText.training.objectives.preference import Preference
from MaxText.training.optimizers import Partition


def objective_for(config: Config, model: ModelSpec, partition: Partition) -> Objective:
  """The objective `config` trains `model` with; `partition`: which parameters the optimizer trains."""
  return objective_registry.record(config.data.objective).build(config, model, partition)


__all__ = ["Grpo", "LanguageModel", "Objective", "ObjectiveRecord", "Preference", "objective_for"]
