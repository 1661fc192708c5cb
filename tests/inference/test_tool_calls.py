"""Tool calls in /v1/chat/completions without a model: the parser on each format (several calls,
malformed JSON left as content), the streamed split of content and calls, the chat route's answer
built from a fixed generated text, and what parse_chat accepts, renders and refuses."""

from __future__ import annotations

import asyncio
import json

import pytest

from MaxText import serve
from MaxText.inference import openai_api as api
from MaxText.inference import scheduler as sched
from MaxText.inference import serve_routes, tool_calls

LIMITS = api.Limits("tiny", 272, 32, 48, 16, 4)
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "number"}, "b": {"type": "number"}}}}}
TWO_CALLS = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>{"name": "now", "arguments": {}}</tool_call>')


def test_tag_format_several_calls_and_the_content_before_them():
  parsed = tool_calls.parse(TWO_CALLS)
  assert parsed.calls == [tool_calls.ToolCall("add", {"a": 1, "b": 2}), tool_calls.ToolCall("now", {})]
  assert parsed.content == "Let me add.\n\n"


def test_llama_json_format_is_the_whole_reply():
  for text in ('{"name": "add", "parameters": {"a": 1, "b": 2}}', '<|python_tag|>{"name": "add", "parameters": '
               '{"a": 1, "b": 2}}\n'):
    assert tool_calls.parse(text) == tool_calls.Parsed("", [tool_calls.ToolCall("add", {"a": 1, "b": 2})])
  # JSON inside a longer reply is not a call.
  assert tool_calls.parse('see {"name": "add", "parameters": {}}').calls == []


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',  # cut JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {}}',  # never closed
    '{"name": "add", "parameters": {"a": }',
    "[" * 100000,  # deeper than json's recursion limit
])
def test_malformed_calls_are_plain_content(text):
  assert tool_calls.parse(text) == tool_calls.Parsed(text, [])


def test_one_malformed_call_among_good_ones_stays_content():
  bad = '<tool_call>{"name": oops}</tool_call>'
  parsed = tool_calls.parse(bad + '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>')
  assert parsed.content == bad and parsed.calls == [tool_calls.ToolCall("now", {})]


CLOSE_IN_STRING = ('<tool_call>{"name": "echo", "arguments": {"text": "write </tool_call> then <tool_call>"}}'
                   '</tool_call>')


def test_a_closing_tag_inside_an_arguments_string_does_not_cut_the_call():
  """A forced tool call's grammar allows any JSON string, closing tags included: the call ends after its JSON."""
  call = tool_calls.ToolCall("echo", {"text": "write </tool_call> then <tool_call>"})
  assert tool_calls.parse(CLOSE_IN_STRING) == tool_calls.Parsed("", [call])
  assert tool_calls.parse(f"a\n{CLOSE_IN_STRING}\n{CLOSE_IN_STRING}") == tool_calls.Parsed("a\n\n", [call, call])
  splitter, ready = tool_calls.ContentSplitter(), []
  for c in CLOSE_IN_STRING:
    splitter.add(c)
    ready += splitter.new_calls()
  assert ready == [call]
  # Junk between the JSON and the closing tag still leaves the call as content.
  junk = '<tool_call>{"name": "now", "arguments": {}} junk</tool_call>'
  assert tool_calls.parse(junk) == tool_calls.Parsed(junk, [])


def test_an_rl_turn_with_a_tag_inside_its_arguments_is_not_malformed():
  from MaxText.rl import environments
  turn = environments.model_turn(CLOSE_IN_STRING, True, 1)
  assert len(turn.calls) == 1 and not turn.malformed
  assert environments.model_turn('{"name": "f", "parameters": {"s": "<tool_call>"}}', True, 1).malformed is False
  assert environments.model_turn('<tool_call>{"name": f}</tool_call>', True, 1).malformed
  assert environments.model_turn('{"name": "f", "parameters": ', False, 1).malformed


@pytest.mark.parametrize("text", [TWO_CALLS, "plain text < not a tag", '{"name": "add", "parameters": {}}',
                                  'a <tool_call>{"bad"}</tool_call> b'])
def test_streamed_content_is_a_prefix_of_the_parsed_content(text):
  splitter = tool_calls.ContentSplitter()
  sent = "".join(splitter.add(c) for c in text)
  parsed = tool_calls.parse(text)
  assert parsed.content.startswith(sent) and "<tool_call" not in sent
  if not parsed.calls:
    assert sent == text[:len(sent)]


def test_a_streamed_call_is_ready_when_its_tag_closes():
  splitter, ready = tool_calls.ContentSplitter(), []
  for i, ch in enumerate(TWO_CALLS):
    splitter.add(ch)
    ready += [(i + 1, call.name) for call in splitter.new_calls()]
  first_close = TWO_CALLS.index(tool_calls.TAG_CLOSE) + len(tool_calls.TAG_CLOSE)
  assert ready == [(first_close, "add"), (len(TWO_CALLS), "now")]


def test_the_answer_built_from_a_generated_call():
  choice = serve_routes.chat_choice(0, TWO_CALLS, "stop", tools=True)
  assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add.\n\n"
  calls = choice["message"]["tool_calls"]
  assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
      ("function", "add", {"a": 1, "b": 2}), ("function", "now", {})]
  assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
  # Without tools offered the same text is content.
  assert serve_routes.chat_choice(0, TWO_CALLS, "stop", tools=False)["message"] == {"role": "assistant",
                                                                                     "content": TWO_CALLS}


class _Job:
  def cancel(self) -> None:
    pass


class _Server:
  """What the routes read of a server (tests/test_serve_params_hostile.py serves its own codec through it)."""

  class limits:
    model_name = "tiny"

  def __init__(self, codec: api.Codec | None = None):
    self.codec = codec or api.Codec(encode=lambda t: [5], decode=lambda ids: "".join(chr(i) for i in ids),
                                    chat=lambda m: [5])

  def token_text(self, token: int) -> str:
    return self.codec.decode([token])


def _streamed(text: str, reason: str = "stop") -> list[dict]:
  """The chat stream's chunks for a choice that generates `text` (one character per token) and ends for
  `reason`."""
  request = api.Request([api.Completion(0, [5], 99, None)], stream=True, stop=[], tools=True)  # type: ignore[arg-type]

  async def events():
    for ch in text:
      yield [sched.Tokens(0, [ord(ch)], [0.0], [[]])]
    yield [sched.Done(0, reason)]

  async def collect():
    return [piece async for piece in serve_routes._stream(_Server(), request, [_Job()], events(),  # type: ignore[arg-type]
                                                          serve._sse, chat=True)]

  # A piece is one write of the answer: the events that reached the stream together, each "data: ...".
  return [json.loads(event[len("data: "):]) for piece in asyncio.run(collect()) for event in piece.split("\n\n")
          if event.startswith("data: {")]


def test_a_stream_sends_the_content_then_one_delta_per_call():
  chunks = _streamed(TWO_CALLS)
  deltas = [c["choices"][0]["delta"] for c in chunks]
  assert "".join(d.get("content") or "" for d in deltas) == "Let me add.\n\n"
  calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
  assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add"), (1, "now")]
  assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_reply_cut_by_the_token_limit_ends_in_length_with_the_calls_before_the_cut():
  cut = TWO_CALLS + '<tool_call>{"name": "add", "argu'
  choice = serve_routes.chat_choice(0, cut, "length", tools=True)
  assert choice["finish_reason"] == "length"
  assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add", "now"]
  assert choice["message"]["content"].endswith('<tool_call>{"name": "add", "argu')
  chunks = _streamed(cut, "length")
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  assert [d["tool_calls"][0]["function"]["name"] for d in (c["choices"][0]["delta"] for c in chunks)
          if "tool_calls" in d] == ["add", "now"]


def _codec(seen: list):
  def chat_tools(messages, tools):
    seen.append((messages, tools))
    return [5, 6]
  return api.Codec(encode=lambda t: [5], decode=lambda ids: "x", chat=lambda m: seen.append((m, None)) or [5],
                   chat_tools=chat_tools)


def test_tools_and_tool_messages_reach_the_template():
  seen: list = []
  messages = [{"role": "user", "content": "1+2?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
  request = api.parse_chat({"messages": messages, "tools": [TOOL]}, LIMITS, _codec(seen))
  assert request.tools and request.choices[0].prompt == [5, 6]
  rendered, tools = seen[-1]
  assert tools == [TOOL]
  assert rendered[1] == {"role": "assistant", "content": "", "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
  assert rendered[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
  # tool_choice "none": the tools are not rendered and no call is parsed.
  request = api.parse_chat({"messages": messages, "tools": [TOOL], "tool_choice": "none"}, LIMITS, _codec(seen))
  assert not request.tools and seen[-1][1] is None


@pytest.mark.parametrize("fields, message", [
    ({"tools": [TOOL], "tool_choice": "required"}, "needs constrained decoding"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "needs constrained decoding"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, 'tool_choice must be "auto"'),
    ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "add"}}]}, "'add' more than once"),
    # Names OpenAI refuses (was: served; a forced call of "</tool_call>" came back as content, not a call).
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\].function.name '' must be 1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "my func"}}]}, "'my func' must be 1 to 64 of a-z"),
    ({"tools": [{"type": "function", "function": {"name": "h\u00e9llo"}}]}, "must be 1 to 64 of a-z"),
    ({"tools": [{"type": "function", "function": {"name": "</tool_call>"}}]}, "must be 1 to 64 of a-z"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "must be 1 to 64 of a-z"),
    # Parameters that are no object's schema (was: rendered, or forced into calls tool_calls.parse does not read).
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     r"tools\[0\].function.parameters must be a JSON schema object .*got str"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     r"parameters must be a JSON schema object .*got string"),
])
def test_refusals_name_the_field(fields, message):
  with pytest.raises(api.ApiError, match=message) as raised:
    api.parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, LIMITS, _codec([]))
  assert raised.value.status == 400 and raised.value.param in ("tool_choice", "tools")
  assert "\n" not in raised.value.message


@pytest.mark.parametrize("arguments", ["[" * 100000, '{"a": ' * 100000 + "1" + "}" * 100000], ids=["array", "object"])
def test_arguments_nested_deeper_than_json_reads_are_a_400(arguments):
  """A past call's arguments nested past json's recursion limit name the message (was: RecursionError, a 500)."""
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
  with pytest.raises(api.ApiError, match=r"messages\[1\].tool_calls: arguments of 'add' are not JSON") as raised:
    api.parse_chat({"messages": messages, "tools": [TOOL]}, LIMITS, _codec([]))
  assert raised.value.status == 400 and raised.value.param == "messages"


ADD_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize("message, words", [
    ({"role": "tool", "content": "3"}, r"messages\[2\] \(role tool\) needs tool_call_id"),
    ({"role": "tool", "tool_call_id": 5, "content": "3"}, "needs tool_call_id"),  # was dropped without a word
    ({"role": "assistant", "content": None, "tool_calls": [
        {**ADD_CALL, "function": {"name": "add", "arguments": "[1]"}}]},
     r"messages\[2\].tool_calls: arguments of 'add' must be a JSON object as text .*got list"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {**ADD_CALL, "function": {"name": "add", "arguments": 5}}]},
     "arguments of 'add' must be a JSON object as text .*got int"),
], ids=["tool-without-id", "tool-id-not-a-string", "arguments-a-list", "arguments-a-number"])
def test_tool_turns_the_template_cannot_read_are_a_400_naming_the_message(message, words):
  """Was: rendered as they came (a tool result answering no call; a list or a number as a call's arguments)."""
  messages = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": None, "tool_calls": [ADD_CALL]},
              message]
  with pytest.raises(api.ApiError, match=words) as raised:
    api.parse_chat({"messages": messages, "tools": [TOOL]}, LIMITS, _codec([]))
  assert raised.value.status == 400 and raised.value.param == "messages" and "\n" not in raised.value.message


def test_parallel_tool_calls_must_be_a_bool():
  """Was: any value accepted and ignored ("no" read as nothing)."""
  with pytest.raises(api.ApiError, match="parallel_tool_calls must be a bool") as raised:
    api.parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "parallel_tool_calls": "no"},
                   LIMITS, _codec([]))
  assert raised.value.status == 400 and raised.value.param == "parallel_tool_calls"
  for value in (True, False, None):
    api.parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "parallel_tool_calls": value},
                   LIMITS, _codec([]))


def test_a_codec_without_tools_refuses_them():
  codec = api.Codec(encode=lambda t: [5], decode=lambda ids: "x", chat=lambda m: [5])
  with pytest.raises(api.ApiError, match="tools are not supported") as raised:
    api.parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, LIMITS, codec)
  assert raised.value.param == "tools"


def test_tools_with_images_are_refused():
  codec = api.Codec(encode=lambda t: [5], decode=lambda ids: "x", chat=lambda m: [5],
                    chat_images=lambda m: ([5], None), chat_tools=lambda m, t: [5])
  image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
  with pytest.raises(api.ApiError, match="tools with images") as raised:
    api.parse_chat({"messages": [{"role": "user", "content": [image]}], "tools": [TOOL]}, LIMITS, codec)
  assert raised.value.param == "tools"


def test_streamed_calls_are_chunks_the_openai_client_reads():
  openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
  chunks = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in _streamed(TWO_CALLS)]
  calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
  assert [(t.index, t.type, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
      (0, "function", "add", {"a": 1, "b": 2}), (1, "function", "now", {})]
  # No tool call: the stream is the text, finish_reason as without tools.
  plain = _streamed("<b>plain</b>")
  assert "".join(c["choices"][0]["delta"].get("content") or "" for c in plain) == "<b>plain</b>"
  assert plain[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_call_named_with_a_lone_surrogate_escape_is_content_and_the_answer_is_utf8():
  """A model may write `"\\ud800"` in a call's name: json reads it as a lone surrogate, which UTF-8 cannot write, and
  the unstreamed answer's JSON failed (a 500). Such a name is no call; in the arguments the escape is kept as written."""
  text = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'
  assert tool_calls.parse(text) == tool_calls.Parsed(text, [])
  choice = serve_routes.chat_choice(0, text + '<tool_call>{"name": "f", "arguments": {"s": "\\udc00"}}</tool_call>',
                                    "stop", tools=True)
  assert json.dumps(choice, ensure_ascii=False).encode()  # what the JSON response writes
  assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"s": "\udc00"}


def test_streaming_many_calls_parses_each_once(monkeypatch):
  """Each closing tag parsed the whole reply again: a reply of thousands of calls (a model repeating one) held the
  event loop for a minute. Now the calls before the last settled one are not read again."""
  parsed: list[str] = []
  real = tool_calls._call
  monkeypatch.setattr(tool_calls, "_call", lambda text, *args, **kw: parsed.append(text) or real(text, *args, **kw))
  call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
  bad = '<tool_call>{"name": now}</tool_call>\n'
  text = (call + bad) * 300
  splitter, ready = tool_calls.ContentSplitter(), 0
  for at in range(0, len(text), 7):
    splitter.add(text[at:at + 7])
    ready += len(splitter.new_calls())
  assert ready == 300 and len(parsed) <= 2 * 600, len(parsed)
  assert splitter.text == text and tool_calls.parse(text).content == ("\n" + bad) * 300
