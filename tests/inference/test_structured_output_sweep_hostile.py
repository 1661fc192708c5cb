"""Structured output and tool calls on hostile input, without a model: what llguidance can only refuse for its own
size limits is a 400 saying so (not "no text satisfies it", nor a pruning that claims an unspellable character), a
number llguidance cannot read is named, an overlapping oneOf says how to serve it, and a parsed tool call's
arguments are always JSON a client can read."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="needs llguidance (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="the tokenizer is read through transformers")

from MaxText.inference import grammar, tool_calls  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import write_tokenizer  # noqa: E402

VOCAB = 272


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: Any) -> tuple[grammar.Compiler, Any]:
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path_factory.mktemp("tok"), None)))
  return grammar.Compiler(tokenizer, VOCAB, [2]), tokenizer


def greedy_text(g: grammar.Grammar, tokenizer: Any, limit: int = 40) -> str:
  """The lowest allowed token each step, until the grammar ends or `limit` tokens."""
  constraint, out = g.constraint(), list[int]()
  for _ in range(limit):
    allowed = np.flatnonzero(np.unpackbits(constraint.mask()[0].view(np.uint8), bitorder="little"))
    assert len(allowed), tokenizer.decode(out)
    out.append(int(allowed[0]))
    if constraint.advance(out[-1]):
      assert not constraint.failure()
      break
  return tokenizer.decode([t for t in out if t != 2])


def test_a_long_counted_regex_compiles_where_only_the_pruning_hits_a_limit(compiler: Any) -> None:
  """The tokenizer has no token for some bytes, so the regex is intersected with the characters its tokens write; the
  intersection of `a{100000}` exceeds llguidance's lexer limit. Was: a 400 claiming every text has a character no
  token writes (every character here is written); now the regex is served as written."""
  c, tokenizer = compiler
  assert greedy_text(c.regex("a{100000}"), tokenizer, limit=8).startswith("a")
  assert greedy_text(c.lark("start: /a{100000}/"), tokenizer, limit=8).startswith("a")  # was: "no token spells"


def test_a_regex_over_the_lexers_limit_says_so(compiler: Any) -> None:
  c, _ = compiler
  with pytest.raises(grammar.GrammarError) as refused:
    c.regex("(?:a{1000}){1000}")
  message = str(refused.value)
  assert "too large" in message and "no text satisfies" not in message and "\n" not in message, message


def test_an_integer_outside_64_bits_in_a_schema_is_named(compiler: Any) -> None:
  """Was: "Value is not JSON serializable: 1000..." with no word of where or why."""
  c, _ = compiler
  with pytest.raises(grammar.GrammarError, match=r"^the schema: 1000000000000000000000000000000 at /properties/n/"
                     r"minimum is outside the 64-bit integers"):
    c.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**30}}})
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "n": {"const": -2**64}}}}}]
  with pytest.raises(grammar.GrammarError, match=r"^the parameters of 'f': -18446744073709551616 at "):
    c.tool_call(tools, "tag")
  c.json_schema({"type": "object", "properties": {"a": {"const": 2**63 - 1}, "b": {"minimum": -2**62}}})  # 64 bits compile


def test_an_overlapping_one_of_says_how_to_serve_it(compiler: Any) -> None:
  """Was: llguidance's "Enable 'coerce_one_of' option", an option no request field names."""
  c, tokenizer = compiler
  schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
  with pytest.raises(grammar.GrammarError) as refused:
    c.json_schema(schema)
  assert "anyOf" in str(refused.value) and '"x-guidance": {"coerce_one_of": true}' in str(refused.value)
  json.loads(greedy_text(c.json_schema({**schema, "x-guidance": {"coerce_one_of": True}}), tokenizer))


def test_unique_items_false_is_no_constraint(compiler: Any) -> None:
  """uniqueItems false asks nothing of an instance; was a 400 "Unimplemented keys". true is still refused by name,
  and a property that is named uniqueItems is left alone."""
  c, tokenizer = compiler
  schema = {"type": "array", "items": {"type": "object", "properties": {"uniqueItems": {"type": "array",
            "uniqueItems": False, "maxItems": 0}}, "required": ["uniqueItems"], "additionalProperties": False},
            "uniqueItems": False, "minItems": 1, "maxItems": 1}
  assert json.loads(greedy_text(c.json_schema(schema), tokenizer)) == [{"uniqueItems": []}]
  with pytest.raises(grammar.GrammarError, match="uniqueItems"):
    c.json_schema({"type": "array", "uniqueItems": True})


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": [Infinity]}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": -Infinity}"}</tool_call>',
    '{"name": "f", "parameters": {"a": NaN}}',
    # Past a float's range: was read as inf, and the call's `arguments` string held `Infinity`.
    '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": [-2.5e400]}"}</tool_call>',
    '{"name": "f", "parameters": {"a": 1E+309}}',
])
def test_a_call_with_a_non_json_number_stays_content(text: str) -> None:
  """Python's json reads NaN and Infinity; the call's `arguments` string then held `NaN`, which JSON.parse and other
  clients' strict readers refuse. As any malformed call, it stays in the content as the model wrote it."""
  parsed = tool_calls.parse(text)
  assert parsed.calls == [] and parsed.content == text
  splitter = tool_calls.ContentSplitter()
  splitter.add(text)
  assert splitter.new_calls() == []


def test_a_forced_run_past_the_parsers_limit_names_the_limit(compiler: Any) -> None:
  """`"a"{100000}` has a text, but llguidance's parser stops at 50000 items on the first token: refused, as before,
  and now saying it is the parser's limit rather than only "no text satisfies it"."""
  c, _ = compiler
  with pytest.raises(grammar.GrammarError, match=r"^no text satisfies it within llguidance's parser limit") as refused:
    c.lark('start: "a"{100000}')
  assert "Too many items" in str(refused.value) and "\n" not in str(refused.value)


def test_a_forced_call_among_more_tools_than_the_parser_takes_says_so(compiler: Any) -> None:
  """Was: "no text satisfies it (... consider making your grammar left-recursive ...)" for 2100 well-formed tools."""
  c, _ = compiler
  tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(2100)]
  with pytest.raises(grammar.GrammarError) as refused:
    c.tool_call(tools, "json")
  message = str(refused.value)
  assert message.startswith("it is too large for llguidance's limits") and "2100" in message, message


@pytest.mark.parametrize("fmt", ["tag", "json"])
def test_a_forced_calls_bad_parameters_name_their_tool(compiler: Any, fmt: str) -> None:
  """Was: llguidance's error at a line of the grammar built around the tools, the grammar echoed (cut at 300
  characters) and no tool named; and for an overlapping oneOf an "x-guidance" hint that does not reach a tool's
  parameters."""
  c, _ = compiler
  tools: list[dict[str, Any]] = [{"type": "function", "function": {"name": "g"}},
           {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
               "a": {"type": "strin"}}}}}]
  with pytest.raises(grammar.GrammarError, match=r"^the parameters of 'f': Invalid type: strin$"):
    c.tool_call(tools, fmt)
  tools[1]["function"]["parameters"]["properties"]["a"] = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
  with pytest.raises(grammar.GrammarError, match=r"^the parameters of 'f': oneOf whose") as refused:
    c.tool_call(tools, fmt)
  assert "x-guidance" not in str(refused.value) and "anyOf" in str(refused.value)


@pytest.mark.parametrize("fmt, key", [
    ({"type": "json_object", "schema": {"type": "integer"}}, "schema"),  # another vendor's spelling of a schema
    ({"type": "text", "json_schema": {"schema": {"type": "integer"}}}, "json_schema"),
    ({"type": "regex", "regex": "a", "flags": "i"}, "flags"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "schema_": {"type": "integer"}}},
     "json_schema.schema_"),
])
def test_a_response_format_key_the_server_does_not_read_is_a_400(compiler: Any, fmt: dict[str, Any],
                                                                  key: str) -> None:
  """Was: ignored, so `{"type": "json_object", "schema": ...}` constrained the reply to any object, not the schema."""
  from MaxText.inference import openai_api as api

  codec = api.Codec(encode=lambda t: [5], decode=lambda ids: "x", chat=lambda m: [5], grammars=lambda: compiler[0])
  body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
  with pytest.raises(api.ApiError) as refused:
    api.parse_chat(body, api.Limits("tiny", 272, 32, 48, 16, 4), codec)
  assert refused.value.status == 400 and refused.value.param == "response_format", refused.value
  assert f"response_format.{key}" in str(refused.value), refused.value
  fine = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": {}, "strict": True}}
  assert api.parse_chat({**body, "response_format": fine}, api.Limits("tiny", 272, 32, 48, 16, 4), codec).grammar


@pytest.mark.parametrize("text", [
    '{"name": "f", "arguments": {"a": 1}}',  # Llama's whole-reply call with the tag format's key
    '<|python_tag|>{"name": "f", "arguments": {"a": 1}}',
    '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',  # a tag with Llama's key
])
def test_a_call_written_with_the_other_formats_arguments_key_keeps_its_arguments(text: str) -> None:
  """Was: a call of f with arguments {} (the arguments the model wrote dropped without a word)."""
  assert tool_calls.parse(text).calls == [tool_calls.ToolCall("f", {"a": 1})]


def test_a_whole_reply_json_object_with_a_name_and_no_arguments_is_content() -> None:
  """A reply that is JSON with a "name" (an answer of structured content) is not a call unless it carries arguments,
  as the Llama format always writes them; was: a call of the function "Ada" with {}."""
  text = '{"name": "Ada", "born": 1815}'
  assert tool_calls.parse(text) == tool_calls.Parsed(text, [])
  assert tool_calls.parse('<tool_call>{"name": "now"}</tool_call>').calls == [tool_calls.ToolCall("now", {})]


DEEP_CHAINS = """
import sys, threading, tokenizers
from MaxText.inference import grammar

def main():
  compiler = grammar.Compiler(tokenizers.Tokenizer.from_file(sys.argv[1]), 272, [2])
  defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(600)}
  compiler.json_schema({"$defs": {**defs, "d600": {"type": "integer"}}, "$ref": "#/$defs/d0"})
  compiler.lark("start: r0\\n" + "".join(f'r{i}: "a" r{i + 1}?\\n' for i in range(3000)) + 'r3000: "b"\\n')
  print("compiled")

threading.stack_size(2 << 20)  # a worker thread's stack where `ulimit -s` is unlimited
thread = threading.Thread(target=main)
thread.start()
thread.join()
"""


def test_a_long_chain_of_references_compiles_on_a_small_threads_stack(tmp_path: Path) -> None:
  """llguidance compiles a chain of `$ref`s or of rules naming the next by recursion on the native stack: past the
  calling thread's it was a segmentation fault, which ended the whole server for one request. (In a subprocess: a
  crash must fail this test, not the session.)"""
  tokenizer = write_tokenizer(tmp_path, None) / "tokenizer.json"
  done = subprocess.run([sys.executable, "-c", DEEP_CHAINS, str(tokenizer)], capture_output=True, text=True,
                        timeout=600, cwd=Path(__file__).parents[2])
  assert done.returncode == 0 and done.stdout.strip() == "compiled", (done.returncode, done.stderr[-2000:])


def test_a_grammar_too_large_for_any_compile_stack_is_one_line(compiler: Any) -> None:
  """A chain longer than grammar_stack's largest stack allows is refused before llguidance sees it (was: a
  segmentation fault)."""
  c, _ = compiler
  lark = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(40000)) + 'r40000: "b"\n'
  with pytest.raises(grammar.GrammarError, match=r"^it is too large to compile: \d+ levels of rules, schema objects "
                     r"and brackets that may nest \(at most \d+\); split it or make it smaller$"):
    c.lark(lark)


def test_a_large_enum_is_pruned_in_linear_time(compiler: Any) -> None:
  """With a tokenizer without byte tokens each enum value is checked for a spelling: the check of what was dropped
  was quadratic (40000 values held a compile thread for tens of seconds)."""
  c, tokenizer = compiler
  started = time.perf_counter()
  g = c.json_schema({"enum": list(range(40000))})
  assert time.perf_counter() - started < 10
  assert json.loads(greedy_text(g, tokenizer)) in range(40000)
