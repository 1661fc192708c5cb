"""Preference records (DPO) → a chosen and a rejected sequence per example, one pair per batch row.

A record is `{"prompt", "chosen", "rejected"}`: three plain strings (the prompt, then each
completion appended as text, with the tokenizer's bos/eos as add_bos/add_eos say), or three
lists of messages (the prompt's turns, then each completion's assistant turn(s), rendered with
the chat template in tokenizer_path as objective=sft renders a prompt/completion pair). Each
sequence's target weights are 1 on its completion only (chat.py finds the assistant's tokens).

A pair is never packed with another: DPO compares whole-sequence log-probabilities, so each
row holds one example (chosen in the usual batch fields, rejected in the `rejected_` ones)
padded to max_target_length. A sequence longer than max_target_length + 1 tokens is truncated
at its end; a pair left without a completion token on either side, or whose two sides are the
same tokens (it prefers nothing), is dropped, counted and reported.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline.batch_spec import DPO_FIELDS, FIELDS, REJECTED_PREFIX
from MaxText.input_pipeline.chat import ChatTokenizer, DroppedSamples, SftEncoder, as_mapping, as_messages
from MaxText.input_pipeline.packing import DocumentCursor

RECORD_FIELDS = ("prompt", "chosen", "rejected")
_PAD = -1  # pads the shorter sequence of a pair in the encoded [4, n] array; never a token id


class PreferenceEncoder:
  """record → int32 [4, n]: chosen tokens, chosen weights, rejected tokens, rejected weights (the
  shorter one padded with _PAD tokens of weight 0); [4, 0] for a dropped pair."""

  def __init__(self, tokenizer: ChatTokenizer, tokenizer_path: str, max_target_length: int, add_bos: bool,
               add_eos: bool):
    self.sequences = SftEncoder(tokenizer, max_target_length, completion_only=True, add_bos=add_bos, add_eos=add_eos)
    self.tokenizer_path = tokenizer_path
    self.max_tokens = max_target_length + 1
    self.dropped = DroppedSamples("dpo")

  def __call__(self, value: object) -> np.ndarray:
    record = as_mapping(value, "dpo")
    # A table reader (datasets' JSON/Parquet) fills a field some other record has with None.
    present = [str(f) for f, value in record.items() if value is not None]
    missing = [f for f in RECORD_FIELDS if f not in present]
    if missing:
      raise UserError(f"a dpo record needs 'prompt', 'chosen' and 'rejected' fields; it lacks "
                      f"{', '.join(repr(f) for f in missing)} (it has {', '.join(present) or 'no fields'})")
    prompt = record["prompt"]
    conversational = not isinstance(prompt, str)
    if conversational:
      self._check_conversation(record)
    elif not (isinstance(record["chosen"], str) and isinstance(record["rejected"], str)):
      raise UserError("a dpo record's 'prompt', 'chosen' and 'rejected' must all be strings or all be lists of "
                      f"messages; got {', '.join(type(record[f]).__name__ for f in RECORD_FIELDS)}")
    sides = [self._truncated(prompt, record[f], f) for f in ("chosen", "rejected")]
    if any(side is None for side in sides):
      self.dropped.add(f"no completion token within max_target_length + 1 = {self.max_tokens} tokens")
      return np.zeros((4, 0), np.int32)
    if sides[0] == sides[1]:
      # Their log-ratios are equal at every step: the loss is log 2 with a zero gradient, and the pair
      # would only shrink the others' share of the mean.
      self.dropped.add(f"chosen and rejected are the same tokens within max_target_length + 1 = {self.max_tokens} "
                       "tokens: the pair prefers nothing")
      return np.zeros((4, 0), np.int32)
    length = max(len(tokens) for tokens, _ in sides)  # type: ignore[misc]
    encoded = np.zeros((4, length), np.int32)
    encoded[0::2] = _PAD
    for i, (tokens, weights) in enumerate(sides):  # type: ignore[misc]
      encoded[2 * i, :len(tokens)], encoded[2 * i + 1, :len(weights)] = tokens, weights
    return encoded

  def _check_conversation(self, record: Mapping[str, Any]) -> None:
    if not isinstance(record["prompt"], list):
      raise UserError(f"a dpo record's 'prompt' must be a string or a list of {{'role': ..., 'content': ...}} messages, "
                      f"got {type(record['prompt']).__name__} {str(record['prompt'])[:80]!r}")
    if self.sequences.tokenizer.chat_template is None:
      raise ConfigError(f"dpo records with message lists are rendered with the chat template, and the tokenizer in "
                        f"{self.tokenizer_path} has none (no chat_template in tokenizer_config.json and no "
                        "chat_template.jinja); use the model's own tokenizer files or plain-string records")
    for field in ("chosen", "rejected"):
      value = record[field]
      if not (isinstance(value, list) and any(isinstance(m, Mapping) and m.get("role") == "assistant"
                                              for m in value)):
        raise UserError(f"a dpo record's {field!r} must be a list of messages with an assistant turn (the completion "
                        f"to prefer or reject), got {str(value)[:80]!r}")
    for field in RECORD_FIELDS:  # named as the record names them (SftEncoder would say the sft 'completion')
      as_messages(record[field], field, "dpo")

  def _truncated(self, prompt: object, completion: object, field: str) -> tuple[list[int], list[int]] | None:
    tokens, weights = self.sequences.tokens_and_weights({"prompt": prompt, "completion": completion})
    if not any(weights[1:]):  # at any max_target_length: refused, not dropped as if truncated
      raise UserError(f"a dpo record's {field!r} has no token to train on: it is empty"
                      f"{self.sequences.no_eos_note()}; give it a completion or remove the record")
    tokens, weights = tokens[:self.max_tokens], weights[:self.max_tokens]
    return (tokens, weights) if any(weights[1:]) else None


def pack_preference_batch(cursor: DocumentCursor, num_rows: int, length: int,
                          packing: bool = False) -> tuple[dict[str, np.ndarray], int]:
  """[num_rows, length] int32 arrays of every DPO batch field, one pair per row, and how many
  rows hold a pair; past the end of finite data the rest are padding (no completion token, so
  no pair). `packing` is ignored: pairs are never packed."""
  del packing
  batch = {name: np.zeros((num_rows, length), np.int32) for name in DPO_FIELDS}
  row, empty_run = 0, 0
  while row < num_rows:
    encoded = cursor.current()
    if encoded is None:
      break
    cursor.advance()
    if encoded.shape[-1] == 0:  # a dropped pair
      empty_run += 1
      if empty_run > cursor.max_empty_run:
        raise UserError(f"{empty_run} dpo records in a row were dropped (no completion token within "
                        "max_target_length + 1 tokens, or chosen the same as rejected: the warnings above say which); "
                        "raise max_target_length or shorten the prompts, or check the records")
      continue
    empty_run = 0
    for prefix, tokens, weights in (("", encoded[0], encoded[1]), (REJECTED_PREFIX, encoded[2], encoded[3])):
      real = tokens[tokens != _PAD]
      pairs = len(real) - 1
      row_fields = {name: batch[prefix + name][row] for name in FIELDS}
      row_fields["inputs"][:pairs], row_fields["targets"][:pairs] = real[:-1], real[1:]
      row_fields["inputs_position"][:pairs] = np.arange(pairs, dtype=np.int32)
      row_fields["inputs_segmentation"][:pairs] = 1
      row_fields["targets_segmentation"][:pairs] = weights[1:pairs + 1] != 0
    row += 1
  return batch, row
