"""Every field the installed `openai` client can send to /v1/completions and /v1/chat/completions
(read from its typed request parameters) is either implemented, ignored because it asks nothing of
the answer, or refused with a 400 naming it: never silently dropped. The table below says which
for each; a field a newer client adds must be refused until the server implements it. Parsing
only: no model, no HTTP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

from MaxText.inference import openai_api as api  # noqa: E402

LIMITS = api.Limits("tiny", 272, 32, 48, 16, 4)
CODEC = api.Codec(encode=lambda text: [5, 6, 7], decode=lambda ids: "x", chat=lambda messages: [5, 6, 7],
                  chat_tools=lambda messages, tools: [5, 6, 7])
OK, REFUSED = "ok", "400"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> (a value a client would send, what it gets). Fields read only at their defaults get a value
# that asks for something (their defaults are checked below).
COMPLETIONS = {
    "prompt": ("the", OK), "model": ("tiny", OK), "max_tokens": (4, OK), "temperature": (0.5, OK),
    "top_p": (0.9, OK), "seed": (3, OK), "n": (2, OK), "stop": (["\n"], OK), "stream": (True, OK),
    "stream_options": ({"include_usage": True}, OK), "echo": (True, OK), "logprobs": (2, OK), "user": ("u1", OK),
    "best_of": (2, REFUSED), "frequency_penalty": (0.5, REFUSED), "presence_penalty": (0.5, REFUSED),
    "logit_bias": ({"5": 10}, REFUSED), "suffix": ("end", REFUSED),
}
CHAT = {
    "messages": ([{"role": "user", "content": "hi"}], OK), "model": ("tiny", OK), "max_tokens": (4, OK),
    "max_completion_tokens": (4, OK), "temperature": (0.5, OK), "top_p": (0.9, OK), "seed": (3, OK), "n": (2, OK),
    "stop": ("\n", OK), "stream": (True, OK), "stream_options": ({"include_usage": True}, OK),
    # Ignored: they ask nothing of the answer.
    "user": ("u1", OK), "metadata": ({"k": "v"}, OK), "store": (True, OK), "service_tier": ("auto", OK),
    "safety_identifier": ("s", OK), "prompt_cache_key": ("k", OK), "prompt_cache_retention": ("24h", OK),
    "prompt_cache_options": ({"ttl": "30m"}, OK), "parallel_tool_calls": (True, OK),
    # Tools rendered by the chat template, calls parsed (response_format and forced calls need a codec with grammars).
    "tools": ([TOOL], OK), "tool_choice": ("auto", OK),
    # Refused unless at their defaults.
    "frequency_penalty": (0.5, REFUSED), "presence_penalty": (0.5, REFUSED), "logit_bias": ({"5": 10}, REFUSED),
    "logprobs": (True, REFUSED), "top_logprobs": (2, REFUSED),
    "response_format": ({"type": "json_object"}, REFUSED),
    "functions": ([TOOL["function"]], REFUSED), "function_call": ("auto", REFUSED),
    "modalities": (["text", "audio"], REFUSED),
    # Refused: not implemented.
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED), "prediction": ({"type": "content", "content": "x"}, REFUSED),
    "reasoning_effort": ("high", REFUSED), "verbosity": ("low", REFUSED), "web_search_options": ({}, REFUSED),
    "moderation": ({"model": "omni-moderation-latest"}, REFUSED),
}
DEFAULTS = {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "suffix": "",
            "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
            "functions": [], "function_call": "none", "modalities": ["text"]}


def _client_fields(module) -> set[str]:
  return {name for cls in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
          for name in cls.__annotations__}


ROUTES = {"completions": (completion_create_params, COMPLETIONS, api.parse_completion, {"prompt": "the"}),
          "chat": (chat_create_params, CHAT, api.parse_chat, {"messages": [{"role": "user", "content": "hi"}]})}


def _cases():
  for route, (module, table, _, _) in ROUTES.items():
    for name in sorted(_client_fields(module) | set(table)):
      value, outcome = table.get(name, ("a value", REFUSED))  # a field newer than this table: refused
      yield pytest.param(route, name, value, outcome, id=f"{route}-{name}")


@pytest.mark.parametrize("route, name, value, outcome", list(_cases()))
def test_every_client_field_is_implemented_ignored_or_refused_by_name(route, name, value, outcome):
  _, _, parse, base = ROUTES[route]
  body = {**base, name: value, **({"stream": True} if name == "stream_options" else {})}
  if outcome == OK:
    parse(body, LIMITS, CODEC)
    return
  with pytest.raises(api.ApiError) as raised:
    parse(body, LIMITS, CODEC)
  error = raised.value.body()["error"]
  assert raised.value.status == 400 and error["param"] == name and name in error["message"], error
  assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ROUTES)
def test_fields_read_only_at_their_defaults_accept_them_and_null(route):
  module, table, parse, base = ROUTES[route]
  for name in DEFAULTS.keys() & {n for n, (_, outcome) in table.items() if outcome == REFUSED}:
    parse({**base, name: DEFAULTS[name]}, LIMITS, CODEC)
  for name in table:  # null is no value, for every field but the one each route needs
    if name not in base:
      parse({**base, name: None}, LIMITS, CODEC)


def test_unknown_fields_are_refused_by_name():
  for parse, base in ((api.parse_completion, {"prompt": "the"}), (api.parse_chat, {"messages": [{"role": "user",
                                                                                                "content": "hi"}]})):
    with pytest.raises(api.ApiError, match="repetition_penalty is not supported by /v1/") as raised:
      parse({**base, "repetition_penalty": 1.2}, LIMITS, CODEC)
    assert raised.value.param == "repetition_penalty"


def test_stream_options_ask_for_a_usage_chunk_only_in_a_stream():
  request = api.parse_completion({"prompt": "the", "stream": True, "stream_options": {"include_usage": True}},
                                 LIMITS, CODEC)
  assert request.include_usage
  assert not api.parse_completion({"prompt": "the", "stream": True}, LIMITS, CODEC).include_usage
  for options, stream, message in (({"include_usage": True}, False, 'only allowed with "stream": true'),
                                   ({"include_usage": "yes"}, True, "must be true or false"),
                                   ({"chunk_size": 4}, True, "stream_options.chunk_size is not supported")):
    with pytest.raises(api.ApiError, match=re.escape(message)):
      api.parse_chat({**ROUTES["chat"][3], "stream": stream, "stream_options": options}, LIMITS, CODEC)


def test_serving_md_names_every_field_each_route_reads():
  """The routes' table and the list of ignored fields in Serving.md name every field the server reads."""
  text = (Path(__file__).resolve().parents[2] / "getting_started" / "Serving.md").read_text()
  named = set(re.findall(r"`([a-z_]+)`", text))
  missing = (api.COMPLETION_FIELDS | api.CHAT_FIELDS | api.IGNORED_FIELDS) - named
  assert not missing, f"Serving.md does not name {sorted(missing)}"


def test_a_seed_the_sampler_cannot_tell_apart_is_a_400_naming_seed():
  """Seeds are 32-bit PRNG seeds: 2**32 would repeat 0 and -1 would repeat 2**32 - 1, so both are refused."""
  for seed in (0, 2**32 - 1):
    api.parse_completion({"prompt": "the", "seed": seed}, LIMITS, CODEC)
  rows = api.parse_completion({"prompt": "the", "seed": 2**32 - 1, "n": 2}, LIMITS, CODEC).choices
  assert [c.row.seed for c in rows] == [2**32 - 1, 0]  # each choice its own seed, within the sampler's range
  for seed in (2**32, -1, 10**400):
    for parse, base in ((api.parse_completion, {"prompt": "the"}), (api.parse_chat, ROUTES["chat"][3])):
      with pytest.raises(api.ApiError, match=re.escape("seed must be in [0, 2**32)")) as raised:
        parse({**base, "seed": seed}, LIMITS, CODEC)
      assert raised.value.status == 400 and raised.value.param == "seed"


@pytest.mark.parametrize("body", [rb'{"prompt": "a\ud800b"}', rb'{"stop": ["\uDFFF"]}', rb'{"\ud83d": 1}',
                                  '{"prompt": "\\ud800"}'.encode("utf-16"), b'{"prompt": "a\xed\xa0\x80b"}',
                                  b'{"messages": [{"role": "user", "content": "\xed\xbf\xbf"}]}'])
def test_an_unpaired_surrogate_escape_is_a_400(body):
  """A prompt (or any string) holding an unpaired surrogate escape reached the tokenizer, which raised: a 500. So did a
  surrogate sent as its own (ill-formed) UTF-8 bytes, which json decodes with "surrogatepass"."""
  with pytest.raises(api.ApiError, match="unpaired UTF-16 surrogate escape") as refused:
    api.parse_json(body)
  assert refused.value.status == 400


def test_a_surrogate_pair_escape_is_its_character():
  assert api.parse_json(rb'{"prompt": "\ud83d\ude00 ok"}') == {"prompt": "\U0001F600 ok"}


def test_a_greedy_choice_without_a_seed_draws_no_random_seed(monkeypatch: pytest.MonkeyPatch):
  """temperature 0 never samples, so its choices take no random seed (was: secrets.randbits, an os.urandom call per
  choice on the event loop); a sampled choice without a seed still gets a random one of its own."""
  import secrets

  drawn = iter(range(7, 100))
  monkeypatch.setattr(secrets, "randbits", lambda bits: next(drawn))
  greedy = api.parse_completion({"prompt": "the", "temperature": 0, "n": 2}, LIMITS, CODEC).choices
  assert [c.row.seed for c in greedy] == [0, 0] and next(drawn) == 7
  sampled = api.parse_completion({"prompt": "the", "temperature": 0.5, "n": 2}, LIMITS, CODEC).choices
  assert [c.row.seed for c in sampled] == [8, 9]


class _AnySchema:
  def json_schema(self, schema):
    return schema


@pytest.mark.parametrize("spec, refusal", [({"schema": {}, "strict": "yes"}, "strict must be true or false"),
                                           ("{}", "json_schema is a str"),
                                           ({"schema": '{"type": "object"}'}, "json_schema.schema is a str")])
def test_a_json_schema_response_format_of_the_wrong_types_is_a_400_naming_the_part(spec, refusal):
  with pytest.raises(api.ApiError, match=refusal):
    api._response_format(_AnySchema(), {"json_schema": spec}, "json_schema")
  assert api._response_format(_AnySchema(), {"json_schema": {"schema": {}, "strict": True}}, "json_schema") == {}
  # A schema sent as null counts as absent, as every null field does: any JSON.
  assert api._response_format(_AnySchema(), {"json_schema": {"name": "x", "schema": None}}, "json_schema") == {}
  assert api._response_format(_AnySchema(), {"json_schema": {"name": "x"}}, "json_schema") == {}


def test_a_chat_too_long_for_the_prompt_limit_is_a_400_naming_messages():
  """A chat request has no "prompt" field: its rendered conversation past max_prefill_predict_length was a 400 naming
  "prompt" (a client looking for the field at fault found none); it names "messages", as OpenAI's context-length
  error does. A completion still names "prompt"."""
  ids = list(range(5, 45))  # 40 tokens; the limit is 32
  long = api.Codec(encode=lambda text: ids, decode=lambda ids: "x", chat=lambda messages: ids)
  for parse, base, param in ((api.parse_chat, ROUTES["chat"][3], "messages"),
                             (api.parse_completion, ROUTES["completions"][3], "prompt")):
    with pytest.raises(api.ApiError, match="has 40 tokens; this server takes at most 32") as raised:
      parse(base, LIMITS, long)
    assert (raised.value.status, raised.value.param, raised.value.code) == (400, param, "context_length_exceeded")


def test_a_chat_max_tokens_beside_a_different_max_completion_tokens_is_a_400_naming_max_tokens():
  """max_completion_tokens is the one read: a max_tokens beside it that said otherwise, or was malformed ("abc", -5,
  true), was ignored without a word (a 200 of max_completion_tokens tokens). The same value twice is one limit."""
  base = ROUTES["chat"][3]
  for max_tokens in (8, "abc", -5, True, 2.0):
    with pytest.raises(api.ApiError, match="differ; send max_completion_tokens alone") as raised:
      api.parse_chat({**base, "max_tokens": max_tokens, "max_completion_tokens": 2}, LIMITS, CODEC)
    assert (raised.value.status, raised.value.param) == (400, "max_tokens")
  for fields in ({"max_tokens": 2, "max_completion_tokens": 2}, {"max_tokens": None, "max_completion_tokens": 2},
                 {"max_completion_tokens": 2}, {"max_tokens": 2}):
    assert [c.max_tokens for c in api.parse_chat({**base, **fields}, LIMITS, CODEC).choices] == [2]
