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
import functools
import json
import math
from typing import Any, Callable, Iterator, Sequence, TypeVar

import llguidance
import numpy as np

from MaxText.inference import grammar_stack, lark_spelling, row_params, tool_calls

T = TypeVar("T")

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
    self._matcher = _on_stack(grammar.text, lambda: llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0))
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
    message = _on_stack(text, lambda: llguidance.LLMatcher.validate_grammar(text, self.tokenizer))
    if message and not message.startswith("WARNING"):
      raise GrammarError(_clearer(" ".join(message.split()))[:300])
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
      reason = " ".join(start.error.split("<state>")[0].split())[:200]
      # A lexer's size limit is no proof that nothing matches (`(?:a{1000}){1000}` does): said as what it is, which
      # also tells regex() and lark() that the grammar they pruned is not empty, only too large.
      if any(limit in reason for limit in _SIZE_LIMITS):
        raise GrammarError(f"it is too large for llguidance's limits ({reason})")
      if "Too many items" in reason:  # instances that nest without end, or a forced run longer than the limit
        raise GrammarError(f"no text satisfies it within llguidance's parser limit ({reason})")
      raise GrammarError(f"no text satisfies it ({reason})")
    return grammar

  def json_schema(self, schema: dict[str, Any]) -> Grammar:
    _refuse_non_finite(schema, "the schema")
    schema = _without_no_ops(schema)
    unspelled: list[str] = []
    pruned: Any = schema if self._speller is None else self._speller.prune(schema, unspelled)
    why = f" (no token of the tokenizer spells {', '.join(unspelled)[:200]})" if unspelled else ""
    if pruned is False:  # the whole schema pruned
      raise GrammarError(f"no text satisfies it{why}")
    try:
      text = llguidance.LLMatcher.grammar_from_json_schema(pruned, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
      return self.compile(text)
    except ValueError as e:  # GrammarError among them
      message = _clearer(str(e))[:300]
      raise GrammarError(f"no text satisfies it: {message}{why}" if why and "no text satisfies" not in message
                         else message + why) from None

  @functools.cached_property
  def _pieces(self) -> frozenset[bytes] | None:
    """The bytes each token writes (special tokens aside); None when every byte has a token of its own (byte-level
    BPE, SentencePiece's byte fallback): then every text can be spelled."""
    tokenizer = self.tokenizer
    pieces = {tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size) if not tokenizer.is_special_token(i)}
    pieces.discard(b"")
    return None if all(bytes([b]) in pieces for b in range(256)) else frozenset(pieces)

  @functools.cached_property
  def _speller(self) -> _Speller | None:
    """Once per tokenizer: building one reads every token (tens of ms for a large vocabulary, on each schema)."""
    return None if self._pieces is None else _Speller(self._pieces)

  @functools.cached_property
  def _written(self) -> str | None:
    """A regex class of every character some token's bytes write, None when every one is. Exact for what it drops:
    where every token is whole UTF-8, a text's characters each lie inside one token; a token that is not (a piece of
    a character) lets every non-ASCII character through."""
    if self._pieces is None:
      return None
    points: set[int] = set()
    split = False
    for piece in self._pieces:
      try:
        points.update(map(ord, piece.decode()))
      except UnicodeDecodeError:
        split = True
        points.update(b for b in piece if b < 0x80)
    if split:
      return _char_class({p for p in points if p < 0x80}, "\\x{80}-\\x{D7FF}\\x{E000}-\\x{10FFFF}")
    return _char_class(points)

  def regex(self, pattern: str) -> Grammar:
    """With a tokenizer that has no token per byte, the pattern's texts are kept to the characters some token writes
    (a text with any other has no tokens: a reply starting one dead-ends, a 500), and one left with none is a
    GrammarError. A character written only inside longer tokens is kept: a reply may still dead-end there."""
    text = llguidance.LLMatcher.grammar_from_regex(pattern)
    pruned = _intersected(text, self._written)
    if pruned == text:
      return self.compile(text)
    try:
      return self.compile(pruned)
    except GrammarError as e:
      grammar = self.compile(text)  # the pattern's own error first
      if not str(e).startswith("no text satisfies it"):
        return grammar  # the intersection failed otherwise (a lexer limit): served as it was before it
      raise GrammarError("no text satisfies it (each text it matches has a character no token of the tokenizer "
                         "writes)") from None

  def lark(self, grammar: str) -> Grammar:
    """With a tokenizer that has no token per byte, the grammar is kept to the texts the tokens write
    (lark_spelling.prune: its lexemes and %json schemas pruned, the alternatives left with no text replaced by
    nothing), so a reply cannot start what it could not finish; one left with no text is a GrammarError. A grammar
    whose syntax the pruner does not read is served as it is."""
    text = llguidance.LLMatcher.grammar_from_lark(grammar)
    if self._written is None or self._speller is None:
      return self.compile(text)
    pruned = lark_spelling.prune(grammar, self._written, self._speller, self._satisfiable)
    if pruned is None:
      return self.compile(text)
    why = f" (no token of the tokenizer spells {', '.join(pruned.unspelled)[:200]})" if pruned.unspelled else ""
    try:
      original = self.compile(text)  # the grammar's own error first
    except GrammarError as e:
      raise GrammarError("no text satisfies it" + why if why and str(e).startswith("no text satisfies it")
                         else str(e)) from None
    if pruned.empty:
      raise GrammarError(f"no text satisfies it{why}")
    try:
      return self.compile(llguidance.LLMatcher.grammar_from_lark(pruned.text))
    except GrammarError as e:
      if not str(e).startswith("no text satisfies it"):
        return original  # the rewrite hit a limit of llguidance's: served as it was before it
      raise GrammarError(f"{e}{why}"[:400]) from None

  def _satisfiable(self, lark: str) -> bool:
    """Whether a Lark grammar has a text the tokens write (another error: taken as yes, the real compile reports it)."""
    try:
      self.compile(llguidance.LLMatcher.grammar_from_lark(lark))
    except GrammarError as e:
      return not str(e).startswith("no text satisfies it")
    return True

  def tool_call(self, tools: list[dict[str, Any]], fmt: str, parallel: bool = True) -> Grammar:
    """One or more (`parallel` False: exactly one) well-formed calls of `tools` (OpenAI's function tools) in the chat
    template's format (tool_calls.FORMATS: "tag" `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, "json"
    Llama 3.1's whole-reply `{"name": .., "parameters": {..}}`), each call's arguments matching its tool's
    parameters."""
    for tool in tools:
      _refuse_non_finite(tool["function"].get("parameters"), f"the parameters of {tool['function']['name']!r}")
    try:
      return self.lark(tool_call_lark(tools, fmt, parallel))
    except GrammarError as e:
      too_large = str(e).startswith("it is too large")  # the tools together, not one of them
      raise GrammarError((not too_large and _tool_culprit(tools, self.tokenizer)) or str(e)) from None


# Schema keywords whose values are schemas (a map of them, a list of them, or one); "not" and "if" are left out: a
# branch pruned under them would let more through, not less.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("additionalProperties", "items", "then", "else", "contains", "propertyNames", "additionalItems",
               "unevaluatedProperties", "unevaluatedItems")


class _Speller:
  """Prunes from a JSON schema what no sequence of tokens writes, for a tokenizer without a token per byte: llguidance
  masks by each token's first bytes, so a reply may start an enum value, a const or an optional key whose later
  character no token spells and dead-end there (a failed generation). An enum loses such values, a const or an
  optional property such a branch, and a pattern is intersected with the characters the tokens spell (a character
  spelled only inside a longer token is left out of it). What is left unsatisfiable is a 400 when compiled."""

  def __init__(self, pieces: frozenset[bytes]):
    self.pieces = pieces
    self.longest = max(map(len, pieces), default=0)
    chars = {c for piece in pieces for c in piece.decode("utf-8", errors="ignore")}
    self.chars = "".join(sorted(c for c in chars if self.spells(c)))

  def spells(self, text: str) -> bool:
    """Whether some sequence of tokens writes `text`'s bytes."""
    data = text.encode()
    reach = [True] + [False] * len(data)
    for start in range(len(data)):
      if reach[start]:
        for end in range(start + 1, min(start + self.longest, len(data)) + 1):
          reach[end] = reach[end] or data[start:end] in self.pieces
    return reach[-1]

  def spelled(self) -> str:
    """A regex of the texts of characters the tokens spell."""
    escaped = "".join("\\x{%X}" % ord(c) for c in self.chars)
    return f"[{escaped}]*" if escaped else ""

  def prune(self, schema: Any, unspelled: list[str]) -> Any:
    """A pruned copy of `schema`; `unspelled` gets what was dropped, by name."""
    try:
      pruned = self._prune(json.loads(json.dumps(schema)), unspelled)
      while _falsify_refs(pruned, pruned):  # until no reference is left to a pruned schema
        pass
      return pruned
    except RecursionError:
      raise GrammarError("the schema nests too deep to compile") from None

  def _prune(self, schema: Any, unspelled: list[str]) -> Any:
    if not isinstance(schema, dict):
      return schema
    if "const" in schema and not self.spells(_json(schema["const"])):
      unspelled.append(f"the const {_json(schema['const'])[:40]}")
      return False
    if isinstance(schema.get("enum"), list):
      # Each value written and checked once (was: `not in kept`, quadratic: a 30000-value enum held a thread for
      # seconds, and 1 == True hid one of the two from the list of what was dropped).
      texts = [_json(value) for value in schema["enum"]]
      spelled = [self.spells(text) for text in texts]
      kept = [value for value, ok in zip(schema["enum"], spelled) if ok]
      unspelled += [f"the enum value {text[:40]}" for text, ok in zip(texts, spelled) if not ok]
      if not kept:
        return False
      schema["enum"] = kept
    required_names = schema.get("required")
    for name in required_names if isinstance(required_names, list) and schema.get("type") == "object" else []:
      if isinstance(name, str) and not self.spells(_json(name)):  # every instance writes it: the schema, pruned
        unspelled.append(f"the required key {_json(name)[:40]}")
        return False
    if isinstance(schema.get("properties"), dict):
      required = set(schema.get("required") or [])
      for name in [n for n in schema["properties"] if n not in required and not self.spells(_json(n))]:
        unspelled.append(f"the key {_json(name)[:40]}")
        del schema["properties"][name]
    for key in _SCHEMA_MAPS:
      if isinstance(schema.get(key), dict):
        schema[key] = {name: self._prune(sub, unspelled) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
      if isinstance(schema.get(key), list):
        schema[key] = [self._prune(sub, unspelled) for sub in schema[key]]
    for key in _SCHEMA_ONE:
      if isinstance(schema.get(key), dict):
        schema[key] = self._prune(schema[key], unspelled)
    if isinstance(schema.get("pattern"), str):  # after the walk: this allOf is not walked again
      schema["allOf"] = [*(schema.get("allOf") or []), {"pattern": f"^{self.spelled()}$"}]
    return schema


def _falsify_refs(node: Any, root: Any) -> bool:
  """Each subschema that is a local `$ref` to a pruned (false) schema made false itself, in place: llguidance refuses a
  reference to a false schema even in a branch it could leave out. True when one was. A schema with an `$id` (a
  tool's parameters in a call's schema) is the root its own local references resolve in."""
  changed = False
  root = node if isinstance(node, dict) and isinstance(node.get("$id"), str) else root
  items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
  for key, sub in list(items):
    if isinstance(sub, dict) and isinstance(sub.get("$ref"), str) and _resolve(root, sub["$ref"]) is False:
      node[key] = False
      changed = True
    elif isinstance(sub, (dict, list)):
      changed = _falsify_refs(sub, root) or changed
  return changed


def _resolve(root: Any, ref: str) -> Any:
  """A local JSON pointer (`#/$defs/x`) in `root`, None where it is not one or leads nowhere."""
  if not ref.startswith("#"):
    return None
  node = root
  for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]:
    if isinstance(node, dict) and part in node:
      node = node[part]
    elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
      node = node[int(part)]
    else:
      return None
  return node


def _char_class(points: set[int], more: str = "") -> str:
  """A regex class of `points` (code points, no surrogates) as ranges of \\x{..} escapes, and `more`'s."""
  if not points and not more:
    return "[^\\x{0}-\\x{10FFFF}]"
  ranges: list[list[int]] = []
  for point in sorted(points):
    if ranges and point == ranges[-1][1] + 1:
      ranges[-1][1] = point
    else:
      ranges.append([point, point])
  return "[" + "".join("\\x{%X}" % a if a == b else "\\x{%X}-\\x{%X}" % (a, b) for a, b in ranges) + more + "]"


def _intersected(text: str, chars: str | None) -> str:
  """llguidance's grammar of one regex (grammar_from_regex) with its texts kept to `chars`' characters (None: as it
  is); as it is too where the grammar is not of the form that function writes."""
  try:
    spec = json.loads(text)
    lark = spec["grammars"][0]["lark_grammar"]
  except (ValueError, KeyError, IndexError, TypeError):
    return text
  if chars is None or len(spec["grammars"]) != 1 or not isinstance(lark, str) or not lark.startswith("start: /") \
      or not lark.endswith("/") or "\n" in lark:
    return text
  # `&` intersects lexemes (regular languages), so the pattern's meaning is kept for every text the tokens write.
  spec["grammars"][0]["lark_grammar"] = f"start: WRITTEN\nWRITTEN: {lark[len('start: '):]} & /{chars}*/"
  return json.dumps(spec)


def _json(value: Any) -> str:
  """A value as the grammar writes it (compact JSON)."""
  return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _refuse_non_finite(value: Any, what: str) -> None:
  """GrammarError for a NaN or an Infinity in a schema: Python's json reads them from a request body, but JSON has
  no such number, and llguidance reads one as null (a `const` of NaN forced the reply `null`); and for an integer
  outside 64 bits, which llguidance cannot take at all (its error named neither the number nor where). Iterative: a
  schema may nest as deep as the body parser allows."""
  stack: list[tuple[Any, str]] = [(value, "")]
  while stack:
    item, path = stack.pop()
    if isinstance(item, float) and not math.isfinite(item):
      raise GrammarError(f"{what}: {json.dumps(item)} at {path or '/'} is not a JSON number (JSON has no NaN or "
                         "Infinity)")
    if isinstance(item, int) and not -2**63 <= item < 2**63:
      raise GrammarError(f"{what}: {str(item)[:60]} at {path or '/'} is outside the 64-bit integers the grammar "
                         "compiler reads")
    if isinstance(item, dict):
      stack.extend((v, f"{path}/{k}") for k, v in item.items())
    elif isinstance(item, list):
      stack.extend((v, f"{path}/{i}") for i, v in enumerate(item))


# What llguidance's failed mask says when a grammar grew past its size limits: a lexer's (a regex's counted
# repetitions), a parser row's (an anyOf of thousands of branches: a call forced among 2100 tools).
_SIZE_LIMITS = ("too many expressions", "fuel exhausted", "Current row has")


def _clearer(message: str, options: bool = True) -> str:
  """llguidance's message, where it names an option of its own, said in terms of the request (`options`: whether the
  schema's own "x-guidance" reaches llguidance: not from a tool's parameters, inside the call's schema)."""
  if "coerce_one_of" in message:
    return ("oneOf whose branches may overlap is not supported (an instance must match exactly one, which the grammar "
            "cannot check): use anyOf" + (', or add "x-guidance": {"coerce_one_of": true} to the schema to read it as '
                                          "anyOf" if options else ""))
  return message


def _tool_culprit(tools: list[dict[str, Any]], tokenizer: Any) -> str:
  """What the first tool whose parameters llguidance refuses on their own is refused for, naming it ("" when each
  compiles alone): the error of the whole call's grammar is at a line of a grammar the client never wrote."""
  for tool in tools:
    parameters = tool["function"].get("parameters")
    if parameters is None:
      continue
    try:
      text = llguidance.LLMatcher.grammar_from_json_schema(_without_no_ops(parameters),
                                                           defaults=JSON_OPTIONS)  # type: ignore[arg-type]
      message = _on_stack(text, lambda: llguidance.LLMatcher.validate_grammar(text, tokenizer))
    except ValueError as e:
      message = str(e)
    if message and not message.startswith("WARNING"):
      return f"the parameters of {tool['function']['name']!r}: {_clearer(' '.join(message.split()), False)}"[:300]
  return ""


def _on_stack(text: str, fn: Callable[[], T]) -> T:
  """fn(), an llguidance call that compiles `text`, with room for its recursion (grammar_stack.py): a chain of
  references deeper than a thread's stack was a segmentation fault that ended the server."""
  try:
    return grammar_stack.call(text, fn)
  except grammar_stack.TooLarge as e:
    raise GrammarError(str(e)) from None


def _without_no_ops(schema: Any) -> Any:
  """`schema` less its `"uniqueItems": false`, which asks nothing of an instance and which llguidance refuses as an
  unimplemented key (true is still refused, by name). A copy where there is one; keywords are read only where a
  schema stands, so a property named uniqueItems is kept."""
  if not any(node.get("uniqueItems") is False for node in _subschemas(schema)):
    return schema
  try:
    copied = json.loads(json.dumps(schema))
  except RecursionError:
    raise GrammarError("the schema nests too deep to compile") from None
  for node in _subschemas(copied):
    if node.get("uniqueItems") is False:
      del node["uniqueItems"]
  return copied


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
  """Every schema object in `schema`, itself included (iterative: a schema may nest as deep as the body parser
  allows)."""
  stack = [schema]
  while stack:
    node = stack.pop()
    if not isinstance(node, dict):
      continue
    yield node
    for key in (*_SCHEMA_MAPS, "dependencies"):
      if isinstance(node.get(key), dict):
        stack.extend(node[key].values())
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONE, "not", "if"):
      sub = node.get(key)
      stack.extend(sub if isinstance(sub, list) else [sub])


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
  """The JSON schema of one call of any of `tools`: its name and its parameters' schema."""
  choices = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               arguments_key: _parameters(tool)},
              "required": ["name", arguments_key], "additionalProperties": False} for tool in tools]
  schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
  return {**schema, "x-guidance": JSON_OPTIONS}


def _parameters(tool: dict[str, Any]) -> Any:
  """A tool's parameters as the call's schema holds them. Their local `$ref`s ("#/$defs/X", as pydantic writes them,
  or "#") name places in the parameters, not in the call around them: an `$id` makes the parameters the resource they
  resolve in (was: "Pointer '/$defs/X' does not exist", and "#" forced a whole call object as an argument)."""
  parameters = _without_no_ops(tool["function"].get("parameters") or ANY_JSON_OBJECT)
  if isinstance(parameters, dict) and "$id" not in parameters and any(
      isinstance(node.get("$ref"), str) for node in _subschemas(parameters)):
    parameters = {"$id": f"urn:maxtext:tool:{tool['function']['name']}", **parameters}
  return parameters


def tool_call_lark(tools: list[dict[str, Any]], fmt: str, parallel: bool = True) -> str:
  """The Lark grammar of tool_call's calls (the json format is always one call: the whole reply)."""
  if fmt == "json":
    return f"start: call\ncall: %json {json.dumps(call_schema(tools, 'parameters'))}\n"
  if fmt != "tag":
    raise GrammarError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(tool_calls.FORMATS)}")
  more = "(\"\\n\" tagged)*" if parallel else ""
  return (f"start: tagged {more}\ntagged: {json.dumps(tool_calls.TAG_OPEN)} call "
          f"{json.dumps(tool_calls.TAG_CLOSE)}\ncall: %json {json.dumps(call_schema(tools, 'arguments'))}\n")
