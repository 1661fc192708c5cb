"""The objectives a run can train: the config key `objective` -> where the objective is declared.

Each objective is one module under training/objectives/ holding its `Objective` subclass and an
`ObjectiveRecord` (objectives/base.py): its batch fields, its data (the records' encoder, whole
records or a text column, the chat template it needs, a dataset or its own rollouts) and how to
build its `Objective`. A new objective is that module plus its line in OBJECTIVES; the config's
check of the name, input_pipeline/batch_spec.py, the input pipeline and objectives.objective_for
all read the record from here.

The modules sit above configuration/ and input_pipeline/ (they build models and encoders), so the
registry names each record by its dotted path and `record` imports its module when first asked.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from MaxText.training.objectives.base import ObjectiveRecord

# name -> "package.module.RECORD"
OBJECTIVES: dict[str, str] = {
    "lm": "MaxText.training.objectives.language_model.DOCUMENTS",  # next-token loss on documents
    "sft": "MaxText.training.objectives.language_model.CONVERSATIONS",  # the same on chat-rendered records
    "dpo": "MaxText.training.objectives.preference.PREFERENCE_PAIRS",
    "grpo": "MaxText.training.objectives.grpo.ROLLOUTS",
    "distill": "MaxText.training.objectives.distill.DOCUMENTS",  # a frozen teacher's distributions + the labels
    "distill_sft": "MaxText.training.objectives.distill.CONVERSATIONS",  # the same on chat-rendered records
}
# The objectives that read conversations through the chat template (the data checks' hf/grain and
# huggingface-tokenizer rules apply to them).
CHAT_OBJECTIVES = ("sft", "distill_sft")


def record(name: str) -> ObjectiveRecord:
  """The record of the objective registered as `name` (a config's `objective`, already checked)."""
  module, _, attribute = OBJECTIVES[name].rpartition(".")
  found: ObjectiveRecord = getattr(importlib.import_module(module), attribute)
  return found
