"""Tool calls in a model's reply, in the formats chat templates teach: `parse` splits a reply into its
content and its calls; `ContentSplitter` says, while a reply streams, which text is surely content.

FORMATS, tried in order on a whole reply:
  tag:  Qwen 2.5/3 and Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more,
        with content around them;
  json: Llama 3.1, the whole reply one `{"name": ..., "parameters": {...}}` (after an optional
        `<|python_tag|>`).
Either format's arguments key ("arguments" or "parameters") is read in both; a whole-reply JSON needs one of them.
A call whose JSON is malformed (or not a name with an object of arguments, or holding NaN or Infinity, which
JSON has not) stays in the content as written: the client sees what the model said, never an error.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Callable

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


def _call(text: str, arguments_key: str, required: bool = False) -> ToolCall | None:
  """The call `text` writes: a name and its arguments under `arguments_key` or, where that is absent, the other
  format's key (models trained on one format write the other's, and the arguments were dropped); with `required`,
  one of them must be there (a whole reply that is JSON with a "name" is otherwise content)."""
  try:
    obj = json.loads(text, parse_constant=_no_constant)
  except (ValueError, RecursionError):
    return None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  key = next((k for k in (arguments_key, *_ARGUMENT_KEYS) if k in obj), None)
  if key is None and required:
    return None
  arguments = obj[key] if key is not None else {}
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError):
      return None
  return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


_DECODER = json.JSONDecoder()


def _close(text: str, start: int) -> int:
  """Where the closing tag of the call opened at `start` begins (-1: none yet): after the JSON value that
  follows the opening tag, so a closing tag inside one of its strings does not cut it; where that value
  does not read, at the first closing tag (the call is then malformed)."""
  at = start + len(TAG_OPEN)
  at += len(text[at:]) - len(text[at:].lstrip())
  try:
    _, after = _DECODER.raw_decode(text, at)
  except (ValueError, RecursionError):
    return text.find(TAG_CLOSE, start)
  after += len(text[after:]) - len(text[after:].lstrip())
  return after if text.startswith(TAG_CLOSE, after) else text.find(TAG_CLOSE, start)


def _tagged(text: str) -> Parsed:
  content, calls, at = [], [], 0
  while (start := text.find(TAG_OPEN, at)) >= 0:
    end = _close(text, start)
    if end < 0:
      break  # an unclosed tag (cut by max_tokens): content
    call = _call(text[start + len(TAG_OPEN):end], "arguments")
    content.append(text[at:start] if call else text[at:end + len(TAG_CLOSE)])
    calls += [call] if call else []
    at = end + len(TAG_CLOSE)
  content.append(text[at:])
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
  and its calls begin with those `new_calls` returned on the way."""

  def __init__(self) -> None:
    self.text = ""
    self.sent = 0
    self.calls_sent = 0
    self._last_close = -1

  def new_calls(self) -> list[ToolCall]:
    """The tagged calls closed since the last time asked (the whole reply's parse starts with them)."""
    end = self.text.rfind(TAG_CLOSE)
    if end < 0 or end == self._last_close:
      return []
    self._last_close = end
    calls = _tagged(self.text[:end + len(TAG_CLOSE)]).calls
    out, self.calls_sent = calls[self.calls_sent:], max(self.calls_sent, len(calls))
    return out

  def add(self, delta: str) -> str:
    self.text += delta
    head = self.text.lstrip()
    if head.startswith("{") or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]):
      return ""  # maybe a whole-reply JSON call (or only whitespace so far)
    safe = self.text.find(TAG_OPEN)
    if safe < 0:
      safe = len(self.text)
      for keep in range(min(len(TAG_OPEN) - 1, len(self.text)), 0, -1):
        if TAG_OPEN.startswith(self.text[-keep:]):
          safe -= keep
          break
    if safe <= self.sent:
      return ""
    out, self.sent = self.text[self.sent:safe], safe
    return out
