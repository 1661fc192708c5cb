"""Supervised fine-tuning records → (tokens, 0/1 target weights), the documents packing.py packs.

Records are conversations (`{"messages": [{"role": ..., "content": ...}, ...]}`) or prompt /
completion pairs (plain strings, or lists of messages). Conversations are rendered by the chat
template of the model's own Hugging Face tokenizer files (`tokenizer_config.json`'s
`chat_template`, or `chat_template.jinja` beside it), through `transformers`, so a converted
Llama 3 / Qwen3 / Gemma checkpoint trains on its real template.

Which tokens are trained (`sft_train_on_completion_only`): the assistant turns. Most released
templates have no `{% generation %}` markers, so the assistant's characters are found by
rendering the conversation up to each assistant turn, once with the generation prompt and once
with the turn: the turn is the difference (what the model writes after the generation prompt,
through its end-of-turn token; whitespace the template adds after it is not the model's). The
characters map to tokens through the tokenizer's offsets. A template whose renderings are not
prefixes of one another cannot be split this way and is refused.

Samples longer than max_target_length + 1 tokens are truncated (a conversation never continues
into the next row: its continuation would have lost its prompt); one left with no trained
target is dropped, counted, and reported.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from MaxText.paths import storage
from MaxText.errors import ConfigError, UserError

PAIR_FIELDS = ("prompt", "completion")
# (rendered text, trained character spans) -> the same, rewritten.
Rewrite = Callable[[str, list[tuple[int, int]]], tuple[str, list[tuple[int, int]]]]


def _transformers() -> Any:
  try:
    import transformers
  except ImportError:
    raise ConfigError("objective=sft renders chat templates with transformers, which is not installed; "
                      "install the hf extra (EXTRAS=hf bash setup.sh)") from None
  return transformers


def _chat_template(tokenizer_dir: str, config: Mapping[str, Any]) -> str | None:
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: the default one
    template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  jinja_file = storage.join(tokenizer_dir, "chat_template.jinja")  # transformers >= 4.50 writes it apart
  if not template and storage.is_file(jinja_file):
    template = storage.read_text(jinja_file)
  return template or None


def no_template(tokenizer_path: str, needs: str) -> ConfigError:
  """The one error for a tokenizer without a chat template that `needs` (what the run asks of it)."""
  return ConfigError(f"the tokenizer in {tokenizer_path} has no chat template (no chat_template in "
                     f"tokenizer_config.json and no chat_template.jinja); {needs} needs the model's own template")


class ChatTokenizer(Protocol):
  """The Hugging Face tokenizer the chat paths call (load_chat_tokenizer's PreTrainedTokenizerFast)."""

  chat_template: str | None
  bos_token: str | None
  bos_token_id: int | None
  eos_token_id: int | None

  def apply_chat_template(self, conversation: list[dict[str, Any]], *, tokenize: bool,
                          add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None) -> str: ...

  def __call__(self, text: str, *, add_special_tokens: bool, return_offsets_mapping: bool = False
               ) -> Mapping[str, Any]: ...

  def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str: ...


def load_chat_tokenizer(tokenizer_path: str, require_template: bool = True) -> ChatTokenizer:
  """A transformers fast tokenizer with its chat template, from a (local or gs://) directory holding
  tokenizer.json and tokenizer_config.json. Without `require_template` a tokenizer with no template
  loads too (its chat_template is None): plain-text records do not need one."""
  transformers = _transformers()
  directory = tokenizer_path if storage.is_dir(tokenizer_path) else storage.parent(tokenizer_path)
  config_file = storage.join(directory, "tokenizer_config.json")
  config = json.loads(storage.read_text(config_file)) if storage.is_file(config_file) else {}
  template = _chat_template(directory, config)
  if template is None and require_template:
    raise no_template(directory, "objective=sft with conversations")
  from tokenizers import Tokenizer

  tokenizer_file = storage.join(directory, "tokenizer.json")
  if not storage.is_file(tokenizer_file):
    raise ConfigError(f"objective=sft needs a Hugging Face tokenizer directory; {tokenizer_file} does not exist")
  special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer.from_str(storage.read_text(tokenizer_file)),
      **{name: value for name, value in special.items() if value})
  tokenizer.chat_template = template
  return tokenizer


def chat_prompt_ids(tokenizer: ChatTokenizer, prompt: str) -> list[int]:
  """`prompt` as one user turn followed by the assistant's generation prompt, as token ids."""
  text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
  return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_text(value: object) -> str | None:
  return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class DroppedSamples:
  """Counts samples left with no trained token; reports the first few and then every doubling.
  Remembers the smallest max_target_length that would have kept one, for the error when every
  sample is dropped."""

  def __init__(self, what: str = "sft") -> None:
    self.count, self._lock, self.what = 0, threading.Lock(), what
    self.least_needed: int | None = None  # max_target_length that keeps the most easily kept sample
    self.longest = 0  # tokens of the longest dropped sample

  def add(self, reason: str, needed: int | None = None, num_tokens: int = 0) -> None:
    with self._lock:
      self.count += 1
      count = self.count
      if needed is not None and (self.least_needed is None or needed < self.least_needed):
        self.least_needed = needed
      self.longest = max(self.longest, num_tokens)
    if count <= 3 or count & (count - 1) == 0:
      print(f"warning: {self.what}: dropped a sample ({reason}); {count} dropped so far", flush=True)

  def explain_all_dropped(self, max_target_length: int) -> str | None:
    """Why a whole epoch gave nothing to train on, when it was these drops; else None."""
    if not self.count:
      return None
    keep = (f"max_target_length >= {self.least_needed} keeps at least one (the longest sample is {self.longest} "
            "tokens)") if self.least_needed is not None else "raise max_target_length"
    return (f"every {self.what} sample was dropped: none has a trained token within "
            f"max_target_length + 1 = {max_target_length + 1} tokens; {keep}, or shorten the prompts")


class SftEncoder:
  """record → int32 [2, n] (tokens, target weights); an empty document for a dropped sample."""

  def __init__(self, tokenizer: ChatTokenizer, max_target_length: int, completion_only: bool, add_bos: bool,
               add_eos: bool):
    self.tokenizer, self.completion_only = tokenizer, completion_only
    self.max_tokens = max_target_length + 1  # max_target_length (input, target) pairs
    # Plain-text prompt/completion pairs get the tokenizer's bos/eos as configured; a chat
    # template writes its own.
    self.bos = (tokenizer.bos_token or "") if add_bos else ""
    self.eos_id = tokenizer.eos_token_id if add_eos else None
    self.dropped = DroppedSamples()

  def __call__(self, record: object) -> np.ndarray:
    tokens, weights = self.tokens_and_weights(as_mapping(record))
    if len(tokens) > self.max_tokens:
      if not any(weights[1:self.max_tokens]):
        # Token i is a target once max_target_length >= i: the first trained one says what would keep it.
        first = next((i for i, w in enumerate(weights) if i and w), None)
        self.dropped.add(f"no assistant token within max_target_length + 1 = {self.max_tokens} tokens",
                         needed=first, num_tokens=len(tokens))
        return np.zeros((2, 0), np.int32)
      tokens, weights = tokens[:self.max_tokens], weights[:self.max_tokens]
    return np.asarray([tokens, weights], np.int32)

  def explain_empty(self) -> str | None:
    return self.dropped.explain_all_dropped(self.max_tokens - 1)

  def tokens_and_weights(self, record: Mapping[str, Any], rewrite: Rewrite | None = None) -> tuple[list[int], list[int]]:
    """The whole sample's tokens and 0/1 target weights, before truncation. `rewrite` changes the
    rendered text and moves the trained spans with it (image_sft.py expands image markers)."""
    text, spans, plain = self.render(record)
    if rewrite is not None:
      text, spans = rewrite(text, spans)
    encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(encoding["input_ids"])
    weights = [int(not self.completion_only or _overlaps(offset, spans)) for offset in encoding["offset_mapping"]]
    if plain and self.eos_id is not None:
      tokens, weights = tokens + [self.eos_id], weights + [1]  # the completion learns to stop
    return tokens, weights

  def render(self, record: Mapping[str, Any]) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, character spans of the trained parts, whether it is a plain-text pair)."""
    if "messages" in record:
      return (*self._conversation(as_messages(record["messages"], "messages"), first_trained=0), False)
    if all(field in record for field in PAIR_FIELDS):
      prompt, completion = record["prompt"], record["completion"]
      if isinstance(prompt, str) and isinstance(completion, str):
        start = len(self.bos) + len(prompt)
        return self.bos + prompt + completion, [(start, start + len(completion))], True
      prompt_messages = as_messages(prompt, "prompt")
      return (*self._conversation(prompt_messages + as_messages(completion, "completion"),
                                  first_trained=len(prompt_messages)), False)
    raise UserError(f"an sft record needs a 'messages' list or 'prompt' and 'completion' fields; it has "
                    f"{', '.join(map(str, record)) or 'no fields'}")

  def _conversation(self, messages: list[dict[str, Any]], first_trained: int) -> tuple[str, list[tuple[int, int]]]:
    if not messages:
      raise UserError("an sft conversation is empty (no messages); give it a user and an assistant turn, or remove it")

    def render(turns: list[dict[str, Any]], prompt: bool = False) -> str:
      try:
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)
      except Exception as e:  # noqa: BLE001 - a record the template cannot take (a jinja error, a bad field)
        raise UserError(f"the chat template cannot render this conversation: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None

    text = render(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    if not turns:
      raise UserError(f"an sft conversation has no assistant turn to train on (roles: "
                      f"{', '.join(m['role'] for m in messages)})")
    spans = []
    for i in turns:
      before, through = render(messages[:i], prompt=True), render(messages[:i + 1])
      if not (through.startswith(before) and text.startswith(through)):
        raise ConfigError("the chat template does not render a conversation as a prefix of its continuation, so "
                          "the assistant's tokens cannot be found; set sft_train_on_completion_only=False or use "
                          "a template with {% generation %} markers")
      end = len(before) + len(through[len(before):].rstrip())
      spans.append((len(before), end))
    return text, spans


def as_mapping(record: object, what: str = "sft") -> Mapping[str, Any]:
  if isinstance(record, (bytes, bytearray)):
    record = json.loads(bytes(record).decode("utf-8"))
  if not isinstance(record, Mapping):
    raise UserError(f"{what} records must be JSON objects, got {type(record).__name__}")
  return record


def as_messages(value: object, field: str) -> list[dict[str, Any]]:
  if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                            for m in value):
    raise UserError(f"sft field {field!r} must be a list of {{'role': ..., 'content': ...}} messages, got "
                    f"{str(value)[:80]!r}")
  return [dict(m) for m in value]


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
  """A token is trained when any of its characters is (as transformers' assistant mask counts)."""
  start, end = offset
  return end > start and any(start < b and a < end for a, b in spans)
