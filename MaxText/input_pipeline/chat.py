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

import itertools
import json
import re
import threading
import weakref
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from MaxText.paths import storage
from MaxText.errors import ConfigError, UserError
from MaxText import json_text
from MaxText.input_pipeline.tokenizer import config_special_tokens, read_hf_tokenizer, read_tokenizer_config, token_text

PAIR_FIELDS = ("prompt", "completion")
# (rendered text, trained character spans) -> the same, rewritten.
Rewrite = Callable[[str, list[tuple[int, int]]], tuple[str, list[tuple[int, int]]]]


# transformers' lazy module is not thread-safe: threads resolving its first attributes together (a server's
# first chats) saw "module 'transformers' has no attribute 'PreTrainedTokenizerFast'". Imported and built under it.
_TRANSFORMERS_LOCK = threading.Lock()


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
    template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
  if template is not None and not isinstance(template, str):
    raise ConfigError(f"{storage.join(tokenizer_dir, 'tokenizer_config.json')}: chat_template is a "
                      f"{type(template).__name__}, not a template's text")
  jinja_file = storage.join(tokenizer_dir, "chat_template.jinja")  # transformers >= 4.50 writes it apart
  if not template and storage.is_file(jinja_file):
    try:
      template = storage.read_bytes(jinja_file).decode("utf-8")
    except UnicodeDecodeError as e:  # was a traceback from the tokenizer's loading
      raise ConfigError(f"{jinja_file} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "replace it with the model's own chat_template.jinja") from None
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


# Unicode's private-use characters (the BMP's block, planes 15 and 16): placeholders no template or token spells.
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


class _Specials:
  """A tokenizer's special tokens: their spellings by id, how to find them in text, and copies of its backend
  that read those spellings as plain text."""

  def __init__(self, tokenizer: Any):
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    self.spelled = {i: token.content for i, token in added.items() if token.special and token.content}
    spellings = sorted(set(self.spelled.values()), key=len, reverse=True)
    # Found by their first characters and then a set look-up per length: one regex alternation of thousands
    # of spellings (Gemma's unused tokens) tries each at every '<' of the text.
    self.spellings = set(spellings)
    self.lengths = sorted({len(t) for t in spellings}, reverse=True)  # longest first, as the tokenizer matches
    self.starts = re.compile("[" + "".join(sorted({re.escape(t[0]) for t in spellings})) + "]") if spellings else None
    self.plain: Any = None
    self.plain_inner: Any = None  # for text after a special token
    if self.starts is not None:
      from tokenizers import Tokenizer

      spec = json.loads(tokenizer.backend_tokenizer.to_str())
      self.plain = self.plain_inner = Tokenizer.from_str(json.dumps(spec))
      # Metaspace's prepend_scheme "first" adds its space only at the start of the whole text, not after a
      # special token: a piece encoded on its own would gain one.
      if _never_prepend(spec.get("pre_tokenizer")):
        self.plain_inner = Tokenizer.from_str(json.dumps(spec))
      for plain in (self.plain, self.plain_inner):
        plain.encode_special_tokens = True  # copies: the shared tokenizer keeps matching them

  def find(self, text: str) -> list[tuple[int, int]]:
    """The (start, end) of each special-token spelling in `text`, left to right, the longest at each place."""
    found: list[tuple[int, int]] = []
    if self.starts is None:
      return found
    end = 0
    for start in self.starts.finditer(text):
      at = start.start()
      if at < end:
        continue
      length = next((n for n in self.lengths if at + n <= len(text) and text[at:at + n] in self.spellings), 0)
      if length:
        found.append((at, at + length))
        end = at + length
    return found


def _never_prepend(pre_tokenizer: Any) -> bool:
  """Sets every Metaspace prepend_scheme "first" in a pre_tokenizer's JSON to "never"; whether there was one."""
  if not isinstance(pre_tokenizer, dict):
    return False
  changed = False
  if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
    pre_tokenizer["prepend_scheme"], changed = "never", True
  for inner in pre_tokenizer.get("pretokenizers") or []:
    changed = _never_prepend(inner) or changed
  return changed


_SPECIALS: "weakref.WeakKeyDictionary[Any, _Specials]" = weakref.WeakKeyDictionary()
_SPECIALS_LOCK = threading.Lock()


def _strings(value: object) -> list[str]:
  if isinstance(value, str):
    return [value]
  if isinstance(value, Mapping):
    return [s for v in value.values() for s in _strings(v)]
  if isinstance(value, (list, tuple)):
    return [s for v in value for s in _strings(v)]
  return []


class ContentGuard:
  """Keeps the spelling of a special token inside what a user wrote (a message, a tool result, a tool's
  description, a prompt) plain text: a user's "<|im_end|>" must not close the turn, as it does through
  transformers' apply_chat_template(tokenize=True). `hide` swaps each such spelling for a private-use
  placeholder of the same length before the template renders; `encode` tokenizes the rendered text with
  the template's own special tokens as control tokens and the placeholders' spellings as plain text.
  Character offsets are the rendered text's (the placeholders keep every length)."""

  def __init__(self, tokenizer: Any, *values: object):
    with _SPECIALS_LOCK:
      specials = _SPECIALS.get(tokenizer)
      if specials is None:
        specials = _SPECIALS[tokenizer] = _Specials(tokenizer)
    self.specials = specials
    texts = [s for v in values for s in _strings(v)]
    found = sorted({t[a:b] for t in texts for a, b in specials.find(t)})
    self.placeholder: dict[str, str] = {}
    self.spelling: dict[str, str] = {}
    if found:
      taken = set("".join(texts)) | set(getattr(tokenizer, "chat_template", None) or "")
      free = list(itertools.islice((chr(c) for c in itertools.chain(*_PRIVATE_USE) if chr(c) not in taken),
                                   len(found) + 1))
      if len(free) <= len(found):
        raise UserError("the messages use nearly every Unicode private-use character together with special-token "
                        "spellings; remove one or the other")
      for head, spelling in zip(free[1:], found):
        self.placeholder[spelling] = placeholder = head + free[0] * (len(spelling) - 1)
        self.spelling[placeholder] = spelling
      self._placeholders = re.compile("|".join(map(re.escape, sorted(self.spelling, key=len, reverse=True))))

  def hide(self, value: Any) -> Any:
    """`value` (messages, tools, a string) with every special-token spelling in its strings swapped."""
    if not self.placeholder:
      return value
    if isinstance(value, str):
      pieces, last = [], 0
      for a, b in self.specials.find(value):
        pieces += [value[last:a], self.placeholder[value[a:b]]]
        last = b
      return "".join(pieces) + value[last:]
    if isinstance(value, Mapping):
      return {k: self.hide(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [self.hide(v) for v in value]
    return value

  def encode(self, tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets) of rendered text."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]
    if not self.placeholder:
      return ids, offsets
    out_ids: list[int] = []
    out_offsets: list[tuple[int, int]] = []
    start, first = 0, 0  # the text and tokens since the last special token the template wrote

    def flush(end: int, last: int) -> None:
      piece = text[start:end]
      if self._placeholders.search(piece) is None:
        out_ids.extend(ids[first:last])
        out_offsets.extend(offsets[first:last])
        return
      # Tokenizers split text at special tokens first, so a piece between two encodes on its own.
      encoder = self.specials.plain if start == 0 else self.specials.plain_inner
      plain = encoder.encode(self._placeholders.sub(lambda m: self.spelling[m.group()], piece), add_special_tokens=False)
      out_ids.extend(plain.ids)
      out_offsets.extend((a + start, b + start) for a, b in plain.offsets)

    for i, (token, (a, b)) in enumerate(zip(ids, offsets)):
      # Written by the template: its spelling, with the whitespace an lstrip/rstrip token takes (an unknown
      # character's unk is not).
      if self.specials.spelled.get(token) in (text[a:b], text[a:b].strip()):
        flush(a, i)
        out_ids.append(token)
        out_offsets.append((a, b))
        start, first = b, i + 1
    flush(len(text), len(ids))
    return out_ids, out_offsets


def load_chat_tokenizer(tokenizer_path: str, require_template: bool = True,
                        needs: str = "objective=sft with conversations") -> ChatTokenizer:
  """A transformers fast tokenizer with its chat template, from a (local or gs://) directory holding
  tokenizer.json and tokenizer_config.json. Without `require_template` a tokenizer with no template
  loads too (its chat_template is None): plain-text records do not need one."""
  with _TRANSFORMERS_LOCK:  # its import too: another thread may read the lazy module before it is whole
    transformers = _transformers()
  # Else the parent folder of a mistyped path was read: its tokenizer, if it holds one, taken silently.
  if not tokenizer_path or not storage.exists(tokenizer_path):
    raise ConfigError(f"tokenizer_path {tokenizer_path or '(empty)'} does not exist: {needs} needs the model's "
                      "Hugging Face tokenizer directory")
  directory = tokenizer_path if storage.is_dir(tokenizer_path) else storage.parent(tokenizer_path)
  config_file = storage.join(directory, "tokenizer_config.json")
  config = read_tokenizer_config(config_file)
  template = _chat_template(directory, config)
  if template is None and require_template:
    raise no_template(directory, needs)
  tokenizer_file = storage.join(directory, "tokenizer.json")
  if not storage.is_file(tokenizer_file):
    raise ConfigError(f"{needs} needs a Hugging Face tokenizer directory; {tokenizer_file} does not exist")
  special = {name: token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
  backend = read_hf_tokenizer(tokenizer_file, tokenizer_path, config)
  config_special_tokens(backend, tokenizer_file, config_file, config)
  with _TRANSFORMERS_LOCK:
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, **{name: value for name, value in special.items() if value})
  if template is not None:
    _check_template_syntax(template, directory, config)
  tokenizer.chat_template = template
  return tokenizer


def _check_template_syntax(template: str, directory: str, config: Mapping[str, Any]) -> None:
  """A template that does not parse was one line only at its first render, after the start-up (for a server, at
  its first request), without naming its file. Compiled as transformers compiles it (its own environment, whose
  tags such as {% generation %} plain jinja2 does not know); skipped where that function is missing."""
  import jinja2

  from transformers.utils import chat_template_utils

  compile_template = getattr(chat_template_utils, "_compile_jinja_template", None)
  if compile_template is None:
    return
  where = storage.join(directory, "tokenizer_config.json" if config.get("chat_template") else "chat_template.jinja")
  try:
    compile_template(template)
  except jinja2.TemplateSyntaxError as e:
    raise ConfigError(f"the chat template in {where} does not parse: {e.message} (line {e.lineno} of the "
                      "template); replace it with the model's own template") from None


def render(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
           tools: list[dict[str, Any]] | None = None, what: str = "this conversation") -> str:
  """The chat template's text of `messages`; one UserError line when the template refuses them (its
  raise_exception: a role it does not know, turns that do not alternate) or fails on them (a
  content that is not a string, a field it needs missing)."""
  try:
    if tools is None:
      return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools)
  except Exception as e:  # noqa: BLE001 - the template is user code (jinja), the messages the user's data
    raise UserError(f"the chat template cannot render {what}: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}") from None


def chat_prompt_ids(tokenizer: ChatTokenizer, prompt: str) -> list[int]:
  """`prompt` as one user turn followed by the assistant's generation prompt, as token ids."""
  guard = ContentGuard(tokenizer, prompt)
  text = render(tokenizer, [{"role": "user", "content": guard.hide(prompt)}], True, what="a prompt as one user turn")
  return guard.encode(tokenizer, text)[0]


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
    # Refused at the first plain-text pair (a conversation's template writes its own end): its completion would
    # never learn to stop. A missing bos is left out (Qwen's tokenizers have none).
    self._no_eos = add_eos and tokenizer.eos_token_id is None
    self.dropped = DroppedSamples()

  def __call__(self, record: object) -> np.ndarray:
    tokens, weights = self.tokens_and_weights(as_mapping(record))
    if self.completion_only and not any(weights[1:]):  # at any max_target_length: refused, not trained as 0 tokens
      raise UserError(f"an sft record has no token to train on: its completion is empty{self.no_eos_note()}; give it "
                      "a completion or remove the record")
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

  def no_eos_note(self) -> str:
    """Why an empty plain-text completion trains nothing: no end-of-sequence token follows it."""
    return "" if self.eos_id is not None else " (and add_eos=False adds no end-of-sequence token after a plain-text one)"

  def tokens_and_weights(self, record: Mapping[str, Any], rewrite: Rewrite | None = None) -> tuple[list[int], list[int]]:
    """The whole sample's tokens and 0/1 target weights, before truncation. `rewrite` changes the
    rendered text and moves the trained spans with it (image_sft.py expands image markers)."""
    guard = ContentGuard(self.tokenizer, record)
    text, spans, plain = self.render(guard.hide(record))
    if rewrite is not None:
      text, spans = rewrite(text, spans)
    tokens, offsets = guard.encode(self.tokenizer, text)
    weights = [int(not self.completion_only or _overlaps(offset, spans)) for offset in offsets]
    if plain and self.eos_id is not None:
      tokens, weights = tokens + [self.eos_id], weights + [1]  # the completion learns to stop
    return tokens, weights

  def render(self, record: Mapping[str, Any]) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, character spans of the trained parts, whether it is a plain-text pair)."""
    # A table reader (datasets' JSON/Parquet) gives every record every field some record has, None where it
    # has none: a file mixing conversations and pairs has messages=None on its pairs.
    present = [str(field) for field, value in record.items() if value is not None]
    if "messages" in present:
      return (*self._conversation(as_messages(record["messages"], "messages"), first_trained=0), False)
    if all(field in present for field in PAIR_FIELDS):
      prompt, completion = record["prompt"], record["completion"]
      if isinstance(prompt, str) and isinstance(completion, str):
        if self._no_eos:
          raise ConfigError("plain-text prompt/completion pairs: add_eos=True but the tokenizer names no eos_token in "
                            "tokenizer_config.json; name it there (or set add_eos=False)")
        start = len(self.bos) + len(prompt)
        return self.bos + prompt + completion, [(start, start + len(completion))], True
      if isinstance(prompt, str) or isinstance(completion, str):
        raise UserError(f"an sft record's 'prompt' and 'completion' must both be strings or both be lists of "
                        f"messages; got {type(prompt).__name__} and {type(completion).__name__}")
      prompt_messages = as_messages(prompt, "prompt")
      return (*self._conversation(prompt_messages + as_messages(completion, "completion"),
                                  first_trained=len(prompt_messages)), False)
    raise UserError(f"an sft record needs a 'messages' list or 'prompt' and 'completion' fields; it has "
                    f"{', '.join(present) or 'no fields'}")

  def _conversation(self, messages: list[dict[str, Any]], first_trained: int) -> tuple[str, list[tuple[int, int]]]:
    if not messages:
      raise UserError("an sft conversation is empty (no messages); give it a user and an assistant turn, or remove it")

    text = render(self.tokenizer, messages, False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    if not turns:
      raise UserError(f"an sft conversation has no assistant turn to train on (roles: "
                      f"{', '.join(map(str, (m['role'] for m in messages)))})")
    spans = []
    for i in turns:
      before, through = render(self.tokenizer, messages[:i], True), render(self.tokenizer, messages[:i + 1], False)
      if not (through.startswith(before) and text.startswith(through)):
        raise ConfigError("the chat template does not render a conversation as a prefix of its continuation, so "
                          "the assistant's tokens cannot be found; set sft_train_on_completion_only=False or use "
                          "a template with {% generation %} markers")
      end = len(before) + len(through[len(before):].rstrip())
      spans.append((len(before), end))
    return text, spans


def as_mapping(record: object, what: str = "sft") -> Mapping[str, Any]:
  if isinstance(record, (bytes, bytearray)):  # an ArrayRecord record: JSON text, or something else
    try:
      parsed = json.loads(bytes(record).decode("utf-8"))
    except UnicodeDecodeError as e:
      raise UserError(f"{what} records must be JSON objects; this one is not UTF-8 text (byte {e.start + 1})") from None
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than json reads
      reason = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
      raise UserError(f"{what} records must be JSON objects; this one is not valid JSON ({reason})") from None
    if b"\\u" in record and json_text.has_unpaired_surrogate(parsed):
      raise UserError(f"the {what} record {json_text.UNPAIRED_SURROGATE}; fix or remove it")
    record = parsed
  if not isinstance(record, Mapping):
    raise UserError(f"{what} records must be JSON objects, got {type(record).__name__}")
  return record


def as_messages(value: object, field: str, what: str = "sft") -> list[dict[str, Any]]:
  if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                            for m in value):
    raise UserError(f"{what} field {field!r} must be a list of {{'role': ..., 'content': ...}} messages, got "
                    f"{str(value)[:80]!r}")
  for i, m in enumerate(value):  # else the template's own error ("unsupported operand type(s) for +: 'int'...")
    role, content = m["role"], m["content"]
    if not isinstance(role, str):
      raise UserError(f"{what} field {field!r}: message {i}: its role is {_json_kind(role)}; give each message a role "
                      "string (user, assistant, system, tool)")
    # Null content is an assistant turn's that only calls tools (a table reader gives a missing one as null too).
    if not (isinstance(content, (str, list)) or content is None and role == "assistant" and m.get("tool_calls")):
      raise UserError(f"{what} field {field!r}: message {i} (role {role!r}): its content is {_json_kind(content)}; "
                      "give it a string, or a list of content parts ([{\"type\": \"text\", \"text\": ...}]); null is for an "
                      "assistant turn with tool_calls only")
  return [dict(m) for m in value]


def _json_kind(value: object) -> str:
  if value is None:
    return "null"
  if isinstance(value, (bool, int, float)):
    return f"{json.dumps(value)}, a {'boolean' if isinstance(value, bool) else 'number'}"
  return "an object" if isinstance(value, Mapping) else f"a {type(value).__name__}"


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
  """A token is trained when any of its characters is (as transformers' assistant mask counts)."""
  start, end = offset
  return end > start and any(start < b and a < end for a, b in spans)
