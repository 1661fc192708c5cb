"""Tool calls in a model's reply, in the formats chat templates teach: `parse` splits a reply into its
content and its calls; `ContentSplitter` says, while a reply streams, which text is surely content.

FORMATS, tried in order on a whole reply:
  tag:  Qwen 2.5/3 and Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more,
        with content around them;
  json: Llama 3.1, the whole reply one `{"name": ..., "parameters": {...}}` (after an optional
        `<|python_tag|>`).
Either format's arguments key ("arguments" or "parameters") is read in both; a whole-reply JSON needs one of them.
A call whose JSON is malformed (or not a name with an object of arguments, or holding NaN or Infinity, which
JSON has not, also as a number too large for a float, or a name that is not text: a lone surrogate escape) stays in
the content as written: the client sees what the model said, never an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from typing import Any, Callable

from MaxText import json_text

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # the tag format's, Llama 3.1's


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]

  def openai(self) -> dict[str, Any]:
    """OpenAI's shape: the arguments as a JSON string."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclasses.dataclass(frozen=True)
class Parsed:
  content: str  # the reply with its calls taken out ("" when only calls)
  calls: list[ToolCall]


def _no_constant(name: str) -> Any:
  # NaN and Infinity: Python reads them, but they are not JSON; a call holding one would send `arguments` that
  # strict clients (JSON.parse) cannot read, so it is malformed.
  raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
  # 1e999 reads as inf, which json.dumps writes back as Infinity: malformed, as the constant is.
  value = float(text)
  if not math.isfinite(value):
    raise ValueError(f"{text[:20]} is beyond a float")
  return value


def _json(text: str) -> Any:
  return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _call(text: str, arguments_key: str, required: bool = False) -> ToolCall | None:
  """The call `text` writes: a name and its arguments under `arguments_key` or, where that is absent, the other
  format's key (models trained on one format write the other's, and the arguments were dropped); with `required`,
  one of them must be there (a whole reply that is JSON with a "name" is otherwise content)."""
  try:
    obj = _json(text)
  except (ValueError, RecursionError):
    return None
  # A name with a lone surrogate escape ("\ud800") cannot be written as UTF-8: the answer's JSON failed (a 500).
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or json_text.has_unpaired_surrogate(obj["name"]):
    return None
  key = next((k for k in (arguments_key, *_ARGUMENT_KEYS) if k in obj), None)
  if key is None and required:
    return None
  arguments = obj[key] if key is not None else {}
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = _json(arguments)
    except (ValueError, RecursionError):
      return None
  return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


_DECODER = json.JSONDecoder()


_SPACE = re.compile(r"\s*")
_LOOKAHEAD = 8  # characters past a JSON error that prove it is no text cut short (`\uXXXX`, `false`)


def _space_end(text: str, at: int) -> int:
  match = _SPACE.match(text, at)
  return match.end() if match else at


def _close(text: str, start: int) -> tuple[int, bool]:
  """Where the closing tag of the call opened at `start` begins (-1: none yet): after the JSON value that
  follows the opening tag, so a closing tag inside one of its strings does not cut it; where that value
  does not read, at the first closing tag (the call is then malformed). And whether more text after `text`
  could move it: not when the value read, nor when it failed on a character before the end."""
  at = _space_end(text, start + len(TAG_OPEN))
  try:
    _, after = _DECODER.raw_decode(text, at)
  except RecursionError:
    return text.find(TAG_CLOSE, start), True
  except ValueError as e:
    settled = isinstance(e, json.JSONDecodeError) and not e.msg.startswith("Unterminated string") \
        and e.pos + _LOOKAHEAD < len(text)
    return text.find(TAG_CLOSE, start), settled
  after = _space_end(text, after)
  return (after if text.startswith(TAG_CLOSE, after) else text.find(TAG_CLOSE, start)), True


def _scan(text: str, at: int = 0) -> tuple[list[str], list[ToolCall], int, int]:
  """The tagged calls from `at` on: the content around them, the calls, and where the settled part ends with the
  calls in it (the calls and malformed tags that no text appended to `text` can change)."""
  content, calls, settled, settled_calls, settling = [], [], at, 0, True
  while (start := text.find(TAG_OPEN, at)) >= 0:
    end, fixed = _close(text, start)
    if end < 0:
      break  # an unclosed tag (cut by max_tokens): content
    call = _call(text[start + len(TAG_OPEN):end], "arguments")
    content.append(text[at:start] if call else text[at:end + len(TAG_CLOSE)])
    calls += [call] if call else []
    at = end + len(TAG_CLOSE)
    settling = settling and fixed
    if settling:
      settled, settled_calls = at, len(calls)
  content.append(text[at:])
  return content, calls, settled, settled_calls


def _tagged(text: str) -> Parsed:
  content, calls, _, _ = _scan(text)
  joined = "".join(content)
  return Parsed(joined if joined.strip() or not calls else "", calls)


def _whole_json(text: str) -> Parsed:
  body = text.strip()
  body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
  call = _call(body, "parameters", required=True)
  return Parsed("", [call]) if call else Parsed(text, [])


FORMATS: dict[str, Callable[[str], Parsed]] = {"tag": _tagged, "json": _whole_json}


def template_format(template: str | None) -> str:
  """Which of FORMATS a chat template teaches its model: Llama 3.1's whole-reply JSON where it names
  `<|python_tag|>` or a call's "parameters" and no tag; else the tag."""
  text = template or ""
  return "json" if TAG_OPEN not in text and (PYTHON_TAG in text or '"parameters"' in text) else "tag"


def parse(text: str) -> Parsed:
  for fmt in FORMATS.values():
    parsed = fmt(text)
    if parsed.calls:
      return parsed
  return Parsed(text, [])


class ContentSplitter:
  """While a reply streams: `add(delta)` returns the text that is content whatever follows, i.e. the
  text before the first `<tool_call>` (less a tail that could begin one); a reply that opens like a
  Llama JSON call is held whole. `parse(text)` of the whole reply then has this text as its prefix,
  and its calls begin with those `new_calls` returned on the way.

  Each delta costs its own length, not the reply's (was: the reply copied and searched per delta, and parsed again
  from its start per closing tag: a reply of thousands of calls held the event loop for a minute)."""

  def __init__(self) -> None:
    self._pieces: list[str] = []
    self._length = 0
    self._tail = ""  # the reply's last characters, enough to find a tag that a delta completes
    self._head = ""  # the reply's first characters after its leading whitespace, as many as PYTHON_TAG has
    self._open = -1  # where the first opening tag begins
    self._closed = -1  # where the last closing tag begins
    self._unsent = ""  # the reply after `sent`, until nothing more of it can be content
    self._held = False
    self.sent = 0
    self.calls_sent = 0
    self._last_close = -1
    self._settled = 0  # the reply before this is parsed for good (tool_calls._scan)
    self._settled_calls = 0

  @property
  def text(self) -> str:
    if len(self._pieces) != 1:
      self._pieces = ["".join(self._pieces)]
    return self._pieces[0]

  def new_calls(self) -> list[ToolCall]:
    """The tagged calls closed since the last time asked (the whole reply's parse starts with them)."""
    end = self._closed
    if end < 0 or end == self._last_close:
      return []
    self._last_close = end
    _, calls, settled, settled_calls = _scan(self.text[:end + len(TAG_CLOSE)], self._settled)
    out = calls[max(self.calls_sent - self._settled_calls, 0):]
    self.calls_sent = max(self.calls_sent, self._settled_calls + len(calls))
    self._settled, self._settled_calls = settled, self._settled_calls + settled_calls
    return out

  def add(self, delta: str) -> str:
    start = self._length - len(self._tail)  # where the window below begins in the reply
    window = self._tail + delta
    self._pieces.append(delta)
    self._length += len(delta)
    self._tail = window[-len(TAG_CLOSE):]
    if self._open < 0 and (found := window.find(TAG_OPEN)) >= 0:
      self._open = start + found
    if (found := window.rfind(TAG_CLOSE)) >= 0:
      self._closed = start + found
    if len(self._head) < len(PYTHON_TAG):
      self._head = (self._head + delta if self._head else delta.lstrip())[:len(PYTHON_TAG)]
    if self._held:
      return ""
    self._unsent += delta
    if self._head.startswith("{") or PYTHON_TAG.startswith(self._head):
      # maybe a whole-reply JSON call (or only whitespace so far); held for good once the head is whole
      self._held = self._head.startswith("{") or self._head == PYTHON_TAG
      return ""
    safe = self._open
    if safe < 0:
      safe = self._length
      for keep in range(min(len(TAG_OPEN) - 1, self._length), 0, -1):
        if TAG_OPEN.startswith(window[-keep:]):
          safe -= keep
          break
    else:
      self._held = True  # nothing after the first opening tag is content while streaming
    if safe <= self.sent:
      return ""
    out, self._unsent = self._unsent[:safe - self.sent], self._unsent[safe - self.sent:]
    self.sent = safe
    return out
