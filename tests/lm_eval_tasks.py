"""lm-eval task YAMLs written by the tests (local JSONL data, nothing downloaded)."""

from __future__ import annotations

CHOICE_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def choice_task(name: str, data: object) -> str:
  """A multiple-choice task over a JSONL of {"context", "choices", "label"} records."""
  return CHOICE_TASK.format(name=name, data=data)
