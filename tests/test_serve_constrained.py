"""Structured output and forced tool calls through the server (constrained decoding, inference/grammar.py),
driven by the official `openai` client against a random tiny model on a paged cache with prefix caching and
chunked prefill: response_format json_schema replies validate against their schemas (nested objects, enums,
arrays, numbers), json_object replies are JSON objects, greedy decoding under a grammar that admits the free
greedy reply gives that reply, tool_choice "required" and a named function give a parseable call of a
given tool (whole and streamed), and each bad input is a 400 naming its part."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
pytest.importorskip("llguidance", reason="needs llguidance (pip install -r requirements.txt)")
import jsonschema  # noqa: E402 - requirements-test.txt

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.serve import build_app, build_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "inference"))
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from decode_test_utils import one_device_mesh  # noqa: E402
from tests.uvicorn_thread import UvicornThread, answers_health_while_held  # noqa: E402
from sft_fixtures import write_tokenizer  # noqa: E402

# A compact ChatML that renders the tools' names (no tag in it: the tag format is forced).
TEMPLATE = ("{%- for tool in tools or [] %}{{ tool.function.name }}{%- endfor %}"
            "{%- for message in messages %}{{ '<|im_start|>' + message['content'] + '<|im_end|>' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>' }}{%- endif %}")
MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=272, max_target_length=160, max_prefill_predict_length=64,
             dtype="float32", print_config=False, tokenizer_type="huggingface", add_bos=False,
             kv_cache_layout="paged", kv_page_size=8, kv_num_pages=80, prefix_caching=True, prefill_chunk_size=16,
             serve_max_slots=4, serve_max_queue=64, serve_max_tokens=96, serve_max_n=4, serve_model_name="tiny")
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
        "required": ["color", "tags"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "ys": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
               "maxItems": 4}}, "required": ["x", "ys"], "additionalProperties": False},
    "top_array": {"type": "array", "items": {"enum": [1, 2, "three", None]}, "maxItems": 5},
}
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
  tokenizer = write_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)
  server = build_server(Config.for_testing(**MODEL, tokenizer_path=str(tokenizer)), mesh=one_device_mesh())
  http = UvicornThread(build_app(server, api_key="k"))
  yield openai.OpenAI(base_url=f"{http.url}/v1", api_key="k", max_retries=0, timeout=300)
  http.close()
  server.scheduler.stop()


def json_schema(name: str) -> dict:
  return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check_schemas(client, requests_per_schema: int, n: int) -> None:
  for name, schema in SCHEMAS.items():
    for r in range(requests_per_schema):
      answer = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=json_schema(name),
                                              temperature=1.0, seed=1000 * r, n=n, max_tokens=96)
      for choice in answer.choices:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_replies_validate_against_their_schemas(client):
  check_schemas(client, requests_per_schema=1, n=2)  # 8 sampled replies
  # Any object: a random model's free strings may outrun max_tokens (finish_reason "length": cut, not wrong).
  answer = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                          temperature=1.0, seed=7, max_tokens=96, n=2)
  for choice in answer.choices:
    text = choice.message.content
    assert isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith("{"), text
  stream = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=json_schema("nested"),
                                          temperature=1.0, seed=3, max_tokens=96, stream=True)
  jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream)), SCHEMAS["nested"])


@pytest.mark.slow
def test_a_hundred_sampled_json_schema_replies_validate(client):
  check_schemas(client, requests_per_schema=25, n=1)


def test_greedy_under_a_grammar_that_admits_the_free_reply_is_that_reply(client):
  """The free greedy reply's longest run of plain-text tokens (a random model also picks special tokens, which a
  text grammar excludes), then the same under a regex admitting that text and anything after it."""
  texts = [client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                          max_tokens=n).choices[0].message.content for n in range(1, 9)]
  n = 0
  while n < len(texts) and len(texts[n]) > len(texts[n - 1] if n else "") and "\ufffd" not in texts[n]:
    n += 1
  assert n >= 3, texts
  regex = {"type": "regex", "regex": re.escape(texts[n - 1]) + "(.|\n)*"}
  constrained = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=n,
                                               response_format=regex)
  assert constrained.choices[0].message.content == texts[n - 1]


def call_of(name: str, arguments: str) -> dict:
  tool = next(t for t in TOOLS if t["function"]["name"] == name)
  args = json.loads(arguments)
  jsonschema.validate(args, tool["function"]["parameters"])
  return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_is_a_well_formed_call_of_a_tool(client, choice):
  for seed in range(3):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            temperature=1.0, seed=seed, max_tokens=96)
    message = answer.choices[0].message
    # A random model may go on to a further call that max_tokens cuts: its calls so far, ending in "length".
    cut = answer.usage.completion_tokens == 96
    assert answer.choices[0].finish_reason == ("length" if cut else "tool_calls") and message.tool_calls, message
    call = message.tool_calls[0].function
    call_of(call.name, call.arguments)
    if isinstance(choice, dict):
      assert all(c.function.name == "add" for c in message.tool_calls)
  stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                          temperature=1.0, seed=11, max_tokens=96, stream=True,
                                          stream_options={"include_usage": True})
  chunks = list(stream)
  usage, chunks = chunks[-1].usage, chunks[:-1]  # the last chunk: usage alone
  calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
  assert calls and chunks[-1].choices[0].finish_reason == ("length" if usage.completion_tokens == 96 else "tool_calls")
  call_of(calls[0].function.name, calls[0].function.arguments)


@pytest.mark.parametrize("fields, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format", "does not compile"),
    (dict(response_format={"type": "yaml"}), "response_format", "'yaml' is not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}), "response_format",
     "json_schema"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}}), "tool_choice",
     "'mul', which is not among tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "both constrain"),
    # Every instance nests without end: was compiled, and every reply dead-ended at its first token (a 500).
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}), "response_format",
     "no text satisfies it"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": '{"type": "object"}'}}),
     "response_format", "json_schema.schema is a str"),
    (dict(tools=[{"type": "function", "function": {"name": "my tool"}}], tool_choice="required"), "tools",
     "'my tool' must be 1 to 64 of a-z"),
], ids=["uncompilable-schema", "unknown-type", "schema-not-an-object", "unknown-function", "both", "endless-schema",
        "schema-as-json-text", "tool-name-with-a-space"])
def test_bad_constraints_are_a_400_naming_the_part(client, fields, param, words):
  with pytest.raises(openai.BadRequestError) as raised:
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
  body = raised.value.body
  assert raised.value.status_code == 400 and body["param"] == param and words in body["message"], body
  assert "\n" not in body["message"]
  # ... and the server goes on serving constrained requests.
  answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                          response_format={"type": "json_object"})
  assert answer.choices[0].message.content.startswith("{")


def test_parallel_tool_calls_false_forces_one_call(client):
  """parallel_tool_calls false holds a forced reply to one call (was: ignored; this seed's first choice wrote a call,
  then a second one that max_tokens cut, which came back as content beside the call)."""
  answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, seed=3, n=2, max_tokens=96)
  for choice in answer.choices:
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1, choice
    call_of(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)


def test_a_grammar_is_compiled_off_the_event_loop(client, monkeypatch):
  """While one request's schema is being compiled (held until /health has answered), the server keeps
  answering other requests."""
  from MaxText.inference import grammar

  answer = answers_health_while_held(
      str(client.base_url).removesuffix("/v1/"), monkeypatch, grammar.Compiler, "json_schema",
      lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=json_schema("nested"),
                                             temperature=0, max_tokens=96))
  assert json.loads(answer.choices[0].message.content) is not None
