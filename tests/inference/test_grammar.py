"""Constrained decoding's host side (inference/grammar.py) without a model: random walks through each grammar's
bitmasks end in text the grammar promises (a JSON schema's instances, forced tool calls that
tool_calls.parse reads in both template formats), the bitmask's layout is the one the device expands,
and what llguidance cannot compile is a one-line GrammarError."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="needs llguidance (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="the tokenizer is read through transformers")
jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (EXTRAS=test bash setup.sh)")

from MaxText.inference import grammar, sampling, tool_calls  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import write_tokenizer  # noqa: E402

VOCAB = 272  # the model's, past the tokenizer's 264
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add"}}]  # no parameters: any object


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path_factory.mktemp("tok"), None)))
  return grammar.Compiler(tokenizer, VOCAB, [2]), tokenizer


def walk(g: grammar.Grammar, tokenizer, seed: int, limit: int = 200) -> str:
  """Uniformly random allowed tokens until the grammar is complete."""
  rng, constraint, out = np.random.default_rng(seed), g.constraint(), []
  for _ in range(limit):
    row = np.zeros(constraint.words, np.int32)
    constraint.fill(row)
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert not allowed[VOCAB:].any()  # past the vocabulary: clear (a constrained row)
    token = int(rng.choice(np.flatnonzero(allowed)))
    out.append(token)
    if constraint.advance(token):
      assert constraint.accepting and not constraint.error
      return tokenizer.decode([t for t in out if t != 2])
  raise AssertionError(f"no end after {limit} tokens: {tokenizer.decode(out)!r}")


def test_json_schema_walks_end_in_instances(compiler):
  compiler, tokenizer = compiler
  schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                             "e": {"enum": ["a", "b"]}, "l": {"type": "array", "maxItems": 2,
                                                                              "items": {"type": "boolean"}}},
            "required": ["n", "e", "l"], "additionalProperties": False}
  g = compiler.json_schema(schema)
  for seed in range(5):
    text = walk(g, tokenizer, seed)
    jsonschema.validate(json.loads(text), schema)
    assert " " not in text  # compact JSON


@pytest.mark.parametrize("fmt", ["tag", "json"])
def test_forced_tool_calls_parse_in_the_templates_format(compiler, fmt):
  compiler, tokenizer = compiler
  for seed in range(4):
    text = walk(compiler.tool_call(TOOLS, fmt), tokenizer, seed, limit=400)
    parsed = tool_calls.parse(text)
    assert parsed.calls and parsed.content == "", text
    assert text.startswith(tool_calls.TAG_OPEN if fmt == "tag" else "{")
    for call in parsed.calls:
      if call.name == "now":
        assert call.arguments in ({"tz": "UTC"}, {"tz": "CET"})
      else:
        assert call.name == "add" and isinstance(call.arguments, dict)


def test_parallel_tool_calls_false_forces_exactly_one_call(compiler):
  """parallel_tool_calls false: the tag format's grammar takes one call and ends (was: one or more)."""
  compiler, tokenizer = compiler
  for seed in range(4):
    text = walk(compiler.tool_call(TOOLS, "tag", parallel=False), tokenizer, seed, limit=400)
    assert len(tool_calls.parse(text).calls) == 1 and text.endswith(tool_calls.TAG_CLOSE), text
  assert "tagged (" not in grammar.tool_call_lark(TOOLS, "tag", parallel=False)
  assert "tagged (" in grammar.tool_call_lark(TOOLS, "tag")


POINT = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                             "required": ["x", "y"], "additionalProperties": False}},
         "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
         "additionalProperties": False}  # as pydantic writes a model's schema
TREE = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["child"],
        "additionalProperties": False}


@pytest.mark.parametrize("fmt", ["tag", "json"])
def test_a_forced_calls_parameters_resolve_their_own_references(compiler, fmt):
  """Inside the call's schema a tool's local `$ref`s pointed at the call: `#/$defs/Point` was a 400 ("Pointer
  '/$defs/Point' does not exist") and `#` forced a whole call object (name and arguments) as an argument."""
  compiler, tokenizer = compiler
  tools = [{"type": "function", "function": {"name": "put", "parameters": POINT}},
           {"type": "function", "function": {"name": "tree", "parameters": TREE}}]
  g = compiler.tool_call(tools, fmt, parallel=False)
  for seed in range(6):
    [call] = tool_calls.parse(walk(g, tokenizer, seed, limit=800)).calls
    jsonschema.validate(call.arguments, POINT if call.name == "put" else TREE)


def test_the_template_names_its_format():
  assert tool_calls.template_format("{{ '<tool_call>' }}...") == "tag"
  assert tool_calls.template_format('{"name": function name, "parameters": ...}<|python_tag|>') == "json"
  assert tool_calls.template_format(None) == "tag"


def test_what_does_not_compile_is_one_line(compiler):
  compiler, _ = compiler
  for bad in (lambda: compiler.json_schema({"type": "strin"}), lambda: compiler.regex("[a-"),
              lambda: compiler.lark("start: nowhere"), lambda: compiler.tool_call(TOOLS, "xml")):
    with pytest.raises(grammar.GrammarError) as raised:
      bad()
    assert str(raised.value) and "\n" not in str(raised.value)


def test_a_grammar_no_text_satisfies_is_refused_and_a_dead_end_is_a_failure(compiler):
  """A schema or regex that admits no text is a GrammarError when compiled (was: compiled, and the reply was "" with
  finish_reason "stop"), and so is one whose every instance nests without end (was: compiled, and every reply
  dead-ended at its first token: a 500 generation_failed); a token that leaves the grammar is reported as a failure,
  not as a complete reply."""
  compiler, tokenizer = compiler
  endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
  for bad in (lambda: compiler.json_schema({"$ref": "#"}), lambda: compiler.regex("[^\\x00-\\U0010ffff]"),
              lambda: compiler.json_schema(endless), lambda: compiler.lark('start: a\na: "x" a')):
    with pytest.raises(grammar.GrammarError, match="no text satisfies it") as raised:
      bad()
    assert "\n" not in str(raised.value)
  # Recursion a reply can end (an optional property, or an array that may close) compiles.
  compiler.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}})
  compiler.json_schema({"type": "array", "items": endless})
  constraint = compiler.regex("ab").constraint()
  assert constraint.failure() == ""
  constraint.mask()
  assert constraint.advance(tokenizer("b", add_special_tokens=False)["input_ids"][0])  # not allowed: it must end
  assert not constraint.accepting
  assert constraint.failure().startswith("the constrained reply cannot be continued: ") and "\n" not in \
      constraint.failure()
  complete = compiler.regex("ab").constraint()
  assert [complete.advance(t) for t in tokenizer("ab", add_special_tokens=False)["input_ids"]][-1]
  assert complete.accepting and complete.failure() == ""


def test_a_mask_row_has_the_devices_width(compiler):
  compiler, _ = compiler
  constraint = compiler.regex("a+").constraint()
  assert constraint.words == sampling.mask_words(VOCAB) == constraint.mask().shape[1]
  with pytest.raises(ValueError, match="int32"):
    constraint.fill(np.zeros(constraint.words, np.int64))


def test_a_schema_with_nan_or_infinity_is_refused_by_the_compiler(compiler):
  """The HTTP routes refuse such a body as they read it; an in-process caller (GRPO's tool specs) reaches the
  compiler, where llguidance read NaN as null and forced the reply `null`."""
  c, _ = compiler
  with pytest.raises(grammar.GrammarError, match=r"^the schema: NaN at /const is not a JSON number"):
    c.json_schema({"const": float("nan")})
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"enum": [float("inf")]}}}}}]
  with pytest.raises(grammar.GrammarError, match=r"^the parameters of 'f': Infinity at /properties/a/enum/0 is not"):
    c.tool_call(tools, "hermes")
