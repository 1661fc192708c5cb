"""Constrained decoding, the host side: a request's grammar (response_format's JSON schema or any JSON
object, a regex, a Lark grammar, or a forced tool call) compiled by llguidance against the served
tokenizer, and per request a `Constraint` that writes the allowed tokens' bitmask before each step
and advances with each token the request gets (the scheduler's TokenConstraint). The device side is
sampling.apply_token_mask: the bitmask goes up with the step and masked logits are -inf before
sampling or the argmax.

Why llguidance (not xgrammar or outlines-core) for a JAX sampler: it computes each step's mask on the
host, lazily from the tokenizer's token trie, straight into a plain int32 bitmask, so the jitted
sampler only takes one more array and nothing framework-specific is in the loop; a schema needs no
index over the vocabulary built before its first token (outlines-core builds one per schema); and it
is one small wheel with no dependencies (xgrammar's package brings torch and triton). JSON schemas,
regexes and Lark grammars compile through one API, which names what it cannot compile.

JSON is compact (no whitespace between tokens, separators "," and ":"): a model cannot spend its
tokens on blank space inside a value.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, Sequence

import llguidance
import numpy as np

from MaxText.inference import row_params, tool_calls

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
  """What llguidance cannot compile, in one line."""


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A grammar compiled and checked for one tokenizer; `constraint()` starts one request's matcher."""

  text: str  # llguidance's grammar (JSON with the schema, regex or Lark inside)
  tokenizer: Any  # llguidance.LLTokenizer
  vocab_size: int  # the model's (the bitmask's width: row_params.mask_words)

  def constraint(self) -> Constraint:
    return Constraint(self)


class Constraint:
  """One request's position in its grammar (a scheduler.TokenConstraint)."""

  def __init__(self, grammar: Grammar):
    self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
    self._tokenizer_words = (grammar.tokenizer.vocab_size + 31) // 32  # what llguidance writes
    self.words = row_params.mask_words(grammar.vocab_size)

  def fill(self, row: np.ndarray) -> None:
    """The allowed tokens' bits into `row` (int32 [words], C-contiguous); the bits past the tokenizer's
    vocabulary stay clear, which marks the row constrained (sampling.constrained_rows)."""
    if row.dtype != np.int32 or row.shape != (self.words,) or not row.flags["C_CONTIGUOUS"]:
      raise ValueError(f"a mask row must be C-contiguous int32 [{self.words}], got {row.dtype} {row.shape}")
    row[:] = 0
    self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._tokenizer_words * 4)

  def mask(self) -> np.ndarray:
    """int32 [1, words]: the next token's bitmask as one row."""
    row = np.zeros((1, self.words), np.int32)
    self.fill(row[0])
    return row

  def advance(self, token: int) -> bool:
    """Takes the request's token; True when the request must end: the grammar is complete (or, for a
    token the mask did not allow, broken: it can only end)."""
    return not self._matcher.consume_token(token) or self._matcher.is_stopped()

  def forced(self) -> list[int]:
    """The tokens the grammar forces next, whatever the model prefers (may be none)."""
    return list(self._matcher.compute_ff_tokens())

  @property
  def accepting(self) -> bool:
    """Whether the tokens so far are a complete sentence of the grammar."""
    return bool(self._matcher.is_accepting())

  @property
  def error(self) -> str:
    return str(self._matcher.get_error())

  def failure(self) -> str:
    """One line on the dead end the tokens so far reached (no token continues them and they do not complete
    the grammar: an unsatisfiable schema, a parser limit), "" when there is none."""
    if not self._matcher.is_error():
      return ""
    return "the constrained reply cannot be continued: " + " ".join(self.error.split("<state>")[0].split())[:200]


class Compiler:
  """Grammars for one tokenizer (built once: it reads the whole vocabulary)."""

  def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
    """`hf_tokenizer`: a Hugging Face fast tokenizer (transformers') or its `tokenizers.Tokenizer`. Read
    here rather than through llguidance.hf, which imports transformers: the plain install has none."""
    self.vocab_size = vocab_size
    backend = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    if not hasattr(backend, "to_str"):
      raise ValueError(f"{type(hf_tokenizer).__name__} is not a fast (Rust `tokenizers`) tokenizer")
    backend = copy.copy(backend)  # the JSON llguidance reads must not pad or truncate
    backend.no_padding()
    backend.no_truncation()
    eos = list(eos_ids) or getattr(hf_tokenizer, "eos_token_id", None)
    self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)

  def compile(self, text: str) -> Grammar:
    """`text` (an llguidance grammar) checked against the tokenizer; GrammarError says why it does not compile."""
    message = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
    if message and not message.startswith("WARNING"):
      raise GrammarError(" ".join(message.split())[:300])
    grammar = Grammar(text, self.tokenizer, self.vocab_size)
    start = grammar.constraint()
    start.mask()  # a grammar no text satisfies fails here, before any token
    # Every reply starts with these tokens; a grammar whose forced opening never ends (a schema whose instances
    # nest without end: {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}) dead-ends at the first of them,
    # and one that forces a character no token spells (a tokenizer without byte tokens) at the token llguidance
    # stands in for it: on every request and whatever the model, so found here it is the client's 400, not a
    # failed generation (500).
    for token in [] if start.failure() else start.forced():
      if start.advance(token):
        break
    if start.failure():
      raise GrammarError(f"no text satisfies it ({' '.join(start.error.split('<state>')[0].split())[:200]})")
    return grammar

  def json_schema(self, schema: dict[str, Any]) -> Grammar:
    _refuse_non_finite(schema, "the schema")
    try:
      text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as e:
      raise GrammarError(str(e)[:300]) from None
    return self.compile(text)

  def regex(self, pattern: str) -> Grammar:
    return self.compile(llguidance.LLMatcher.grammar_from_regex(pattern))

  def lark(self, grammar: str) -> Grammar:
    return self.compile(llguidance.LLMatcher.grammar_from_lark(grammar))

  def tool_call(self, tools: list[dict[str, Any]], fmt: str, parallel: bool = True) -> Grammar:
    """One or more (`parallel` False: exactly one) well-formed calls of `tools` (OpenAI's function tools) in the chat
    template's format (tool_calls.FORMATS: "tag" `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, "json"
    Llama 3.1's whole-reply `{"name": .., "parameters": {..}}`), each call's arguments matching its tool's
    parameters."""
    for tool in tools:
      _refuse_non_finite(tool["function"].get("parameters"), f"the parameters of {tool['function']['name']!r}")
    return self.lark(tool_call_lark(tools, fmt, parallel))


def _refuse_non_finite(value: Any, what: str) -> None:
  """GrammarError for a NaN or an Infinity in a schema: Python's json reads them from a request body, but JSON has
  no such number, and llguidance reads one as null (a `const` of NaN forced the reply `null`). Iterative: a schema
  may nest as deep as the body parser allows."""
  stack: list[tuple[Any, str]] = [(value, "")]
  while stack:
    item, path = stack.pop()
    if isinstance(item, float) and not math.isfinite(item):
      raise GrammarError(f"{what}: {json.dumps(item)} at {path or '/'} is not a JSON number (JSON has no NaN or "
                         "Infinity)")
    if isinstance(item, dict):
      stack.extend((v, f"{path}/{k}") for k, v in item.items())
    elif isinstance(item, list):
      stack.extend((v, f"{path}/{i}") for i, v in enumerate(item))


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
  """The JSON schema of one call of any of `tools`: its name and its parameters' schema."""
  choices = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               arguments_key: tool["function"].get("parameters") or ANY_JSON_OBJECT},
              "required": ["name", arguments_key], "additionalProperties": False} for tool in tools]
  schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
  return {**schema, "x-guidance": JSON_OPTIONS}


def tool_call_lark(tools: list[dict[str, Any]], fmt: str, parallel: bool = True) -> str:
  """The Lark grammar of tool_call's calls (the json format is always one call: the whole reply)."""
  if fmt == "json":
    return f"start: call\ncall: %json {json.dumps(call_schema(tools, 'parameters'))}\n"
  if fmt != "tag":
    raise GrammarError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(tool_calls.FORMATS)}")
  more = "(\"\\n\" tagged)*" if parallel else ""
  return (f"start: tagged {more}\ntagged: {json.dumps(tool_calls.TAG_OPEN)} call "
          f"{json.dumps(tool_calls.TAG_CLOSE)}\ncall: %json {json.dumps(call_schema(tools, 'arguments'))}\n")
