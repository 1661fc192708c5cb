"""The prompts of a GRPO run: records read through the input pipeline's sources, rendered and
tokenised once at start-up, then served in a seeded order, epoch after epoch.

Every process reads every prompt in the same order: the rollout samples the whole batch on the
global mesh (rl/rollouts.py), so the processes must agree on it. Tokenising all prompts first
checks each one before the run writes anything (a record without the prompt column, a prompt over
max_prefill_predict_length tokens); the cost is one pass of the tokenizer over the prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.input_pipeline import chat, open_records
from MaxText.rl.rewards import ARGUMENTS


@dataclasses.dataclass(frozen=True)
class Prompt:
  index: int  # the record's index in the train split
  ids: list[int]  # the prompt's tokens as the model sees them (chat template and generation prompt)
  prompt: str | list[dict[str, Any]]  # the record's prompt (a string or a message list), given to the reward functions
  columns: Mapping[str, Any]  # the record's other columns


def encode_prompt(tokenizer: chat.ChatTokenizer, value: object, add_bos: bool, tokenizer_path: str = "tokenizer_path"
                  ) -> list[int]:
  """A prompt's token ids: a message list rendered with the chat template and the assistant's
  generation prompt; a string as one user turn when the tokenizer has a template, else as plain
  text (with the tokenizer's bos when add_bos)."""
  if isinstance(value, list):
    messages = chat.as_messages(value, "prompt", "grpo")
    if not tokenizer.chat_template:
      raise chat.no_template(tokenizer_path, "objective=grpo with message-list prompts (or give prompts as plain strings)")
    guard = chat.ContentGuard(tokenizer, messages)  # a typed "<|im_end|>" stays text
    return guard.encode(tokenizer, chat.render(tokenizer, guard.hide(messages), True, what="the prompt's messages"))[0]
  if not isinstance(value, str):
    raise UserError(f"a prompt must be a string or a list of messages, got {type(value).__name__}")
  if tokenizer.chat_template:
    return chat.chat_prompt_ids(tokenizer, value)
  bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
  guard = chat.ContentGuard(tokenizer, value)
  return bos + guard.encode(tokenizer, guard.hide(value))[0]


class PromptSet:
  """All prompts, tokenised; `take(n)` gives the next n in the seeded order, `position` how many
  were taken (the checkpointed data position)."""

  def __init__(self, config: Config, tokenizer: chat.ChatTokenizer):
    data, column = config.data, config.rl.rl_prompt_column
    records, describe = open_records(data, train=True)
    limit = config.decode.max_prefill_predict_length
    self.prompts: list[Prompt] = []
    for index in range(len(records)):
      try:
        record = chat.as_mapping(records[index], "grpo")
      except UserError as e:
        raise type(e)(f"prompt record {index} of {describe}: {e}") from None
      if column not in record:
        raise UserError(f"prompt record {index} of {describe} has no {column!r} field (rl_prompt_column); its "
                        f"fields: {', '.join(map(str, record)) or 'none'}")
      clash = sorted(set(record) & set(ARGUMENTS) - {column})
      if clash:
        raise UserError(f"{describe} has a column named {clash[0]!r} (prompt record {index}), which is an argument the "
                        f"reward functions are called with ({', '.join(ARGUMENTS)}); rename the column in the file")
      if config.rl.rl_environment and column != "prompt" and "prompt" in record:
        # The environment's `prompt` keyword is rl_prompt_column's value: the column would have replaced it.
        raise UserError(f"{describe} has a column named 'prompt' (prompt record {index}) beside rl_prompt_column="
                        f"{column!r}; rl_environment={config.rl.rl_environment} gets the prompt as its `prompt` "
                        "argument, so rename that column in the file")
      try:
        ids = encode_prompt(tokenizer, record[column], data.add_bos, data.tokenizer_path)
      except UserError as e:
        raise type(e)(f"prompt record {index} of {describe}: {e}") from None
      if not 1 <= len(ids) <= limit:
        raise UserError(f"prompt record {index} of {describe} has {len(ids)} tokens; prompts must have 1 to "
                        f"max_prefill_predict_length={limit} tokens (raise it, keeping max_prefill_predict_length "
                        "+ max_completion_length <= max_target_length + 1, or shorten the prompt)")
      self.prompts.append(Prompt(index, ids, record[column], {k: v for k, v in record.items() if k != column}))
    if not self.prompts:
      raise UserError(f"{describe} is empty: it holds no prompt records")
    _check_answers(self.prompts, config, describe)
    self.shuffle_seed = data.data_shuffle_seed if data.enable_data_shuffling else None
    self.position = 0
    self.describe = describe
    self._epoch_order: tuple[int, np.ndarray] = (-1, np.arange(0))

  def _order(self, epoch: int) -> np.ndarray:
    if self._epoch_order[0] != epoch:
      order = np.arange(len(self.prompts)) if self.shuffle_seed is None \
          else np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.prompts))
      self._epoch_order = (epoch, order)
    return self._epoch_order[1]

  def take(self, count: int) -> list[Prompt]:
    out = []
    for _ in range(count):
      epoch, offset = divmod(self.position, len(self.prompts))
      out.append(self.prompts[int(self._order(epoch)[offset])])
      self.position += 1
    return out

  def get_state(self) -> dict[str, int]:
    return {"prompts_taken": self.position}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.position = int(state["prompts_taken"])


def _check_answers(prompts: Sequence[Prompt], config: Config, describe: str) -> None:
  """Where exact_match or the calculator reads rl_answer_column and the file has it, every record needs an
  answer: a null one compared as the text "none", and a blank one matched nothing, both silently."""
  rl = config.rl
  readers = [n for n in ("exact_match",) if n in rl.reward_functions] + (
      ["the calculator"] if rl.rl_environment == "calculator" else [])
  column = rl.rl_answer_column
  if not readers or not any(column in p.columns for p in prompts):
    return  # no reader, or no such column at all: the reader names the missing column when it runs
  for p in prompts:
    answer = p.columns.get(column)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
      shown = "null or missing" if answer is None else "blank"
      raise UserError(f"prompt record {p.index} of {describe} has a {shown} answer in rl_answer_column={column!r}, "
                      f"which {' and '.join(readers)} {'compare' if len(readers) > 1 else 'compares'} the completions "
                      "with; give it an answer or drop the "
                      "record")


def columns_of(prompts: Sequence[Prompt], repeat: int) -> dict[str, list[Any]]:
  """Each record column as a list with one value per completion (every prompt's `repeat` times)."""
  names = sorted({name for p in prompts for name in p.columns})
  return {name: [p.columns.get(name) for p in prompts for _ in range(repeat)] for name in names}
