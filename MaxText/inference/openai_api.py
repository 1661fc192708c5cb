"""The OpenAI request and response shapes the server speaks, apart from HTTP.

`parse_completion` / `parse_chat` turn a JSON body into `Completion`s (one per choice: prompt
ids, max_tokens, sampling parameters) or raise `ApiError` (status, message, the field at
fault) (a choice's token stream as text and logprobs: inference/choice_text.py).
No field can name a file, a path or another checkpoint: `model` is only compared to the served name.
A field a route does not implement is a 400 naming it (COMPLETION_FIELDS, CHAT_FIELDS; a few only at
their defaults, NO_OP_VALUES), bar IGNORED_FIELDS, which ask nothing of the answer.
`tools` with `tool_choice` "auto" are rendered through the chat template (`Codec.chat_tools`) and the
reply's calls parsed (inference/tool_calls.py); "required" and a named function also force a well-formed
call by constrained decoding, as `response_format` (json_object, json_schema, and the extensions regex and
grammar, a Lark grammar) forces its format: `Codec.grammars` compiles them (inference/grammar.py) into
the request's `grammar`. Chat content parts may carry images as data: URLs (`Codec.chat_images`, inference/image_chat.py);
an http(s) URL is refused, nothing is fetched.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
from typing import Any, Callable, Collection, Sequence

from MaxText import json_text
from MaxText.errors import UserError
from MaxText.inference import grammar as grammar_lib
from MaxText.inference.image_prompts import PromptImages
from MaxText.inference.row_params import NUM_TOP_LOGPROBS, SEED_LIMIT, RowParams

MAX_STOP_SEQUENCES = 4  # OpenAI's limit


class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

  def body(self) -> dict[str, Any]:
    kind = "invalid_request_error" if self.status < 500 else "server_error"
    return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  model_name: str
  vocab_size: int
  max_prompt_tokens: int  # max_prefill_predict_length
  max_target_length: int
  max_tokens: int  # serve_max_tokens
  max_choices: int  # serve_max_n
  image_token_id: int | None = None  # a vision-language model's placeholder: never typed into a prompt
  adapter_names: Callable[[], Sequence[str]] = tuple  # the LoRA adapters served beside the model (lora_adapters.py)


@dataclasses.dataclass(frozen=True)
class Codec:
  """Text <-> ids for one tokenizer (`chat` renders messages with the tokenizer's template)."""
  encode: Callable[[str], list[int]]
  decode: Callable[[list[int]], str]
  chat: Callable[[list[dict[str, Any]]], list[int]]
  # Messages with content parts, images among them -> (ids, the images: image_prompts.PromptImages
  # or None); raises UserError on a bad image. None: the server takes no images.
  chat_images: Callable[[list[dict[str, Any]]], tuple[list[int], Any]] | None = None
  # Messages and OpenAI `tools` -> ids; raises ApiError when the template cannot render tools.
  # None: the server renders no tools.
  chat_tools: Callable[[list[dict[str, Any]], list[dict[str, Any]]], list[int]] | None = None
  # The tokenizer's grammar compiler (grammar.Compiler; raises ApiError when the tokenizer has none) and the
  # tool-call format its chat template teaches (tool_calls.FORMATS). None: no constrained decoding.
  grammars: Callable[[], grammar_lib.Compiler] | None = None
  tool_format: Callable[[], str] | None = None
  # The ids `decode` reads are [0, token_limit) (the tokenizer's vocabulary, at most the model's); None: the
  # model's vocab_size. A prompt of ids beyond it would be answered with text the tokenizer cannot write.
  token_limit: int | None = None
  # A stop sequence spelled as a special token (Qwen's "<|im_end|>") -> its id, else None: decode writes no
  # special token, so the text would never hold it. None: every stop sequence is matched in the text.
  stop_token: Callable[[str], int | None] | None = None

  def stop_ids(self, stops: Sequence[str]) -> frozenset[int]:
    found = [self.stop_token(s) for s in stops] if self.stop_token is not None else []
    return frozenset(t for t in found if t is not None)


@dataclasses.dataclass(frozen=True)
class Completion:
  index: int
  prompt: list[int]
  max_tokens: int
  row: RowParams
  images: PromptImages | None = None  # of the prompt's placeholder runs


@dataclasses.dataclass(frozen=True)
class Request:
  choices: list[Completion]
  stream: bool
  stop: list[str]
  echo: bool = False
  logprobs: int | None = None  # completions: how many alternatives per token (0..5); None = none
  include_usage: bool = False  # streams: a last chunk with the usage (stream_options)
  tools: bool = False  # chat: tools were offered, the reply's tool calls are parsed
  grammar: grammar_lib.Grammar | None = None  # constrained decoding: what every choice's text must match
  model: str = ""  # the `model` asked for ("": the served model); a LoRA adapter's name picks that adapter


def _no_constant(name: str) -> Any:
  """Python's json reads NaN, Infinity and -Infinity (which Python's json.dumps writes): JSON has none of them,
  and a temperature or a schema's value of NaN passed range checks (every comparison with NaN is false)."""
  raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def parse_json(raw: bytes) -> Any:
  """A request body as JSON, or a 400: beside syntax errors, json raises ValueError for an integer
  of more digits than Python converts and RecursionError for nesting deeper than the stack."""
  try:
    body = json.loads(raw, parse_constant=_no_constant)
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
  except RecursionError:
    raise ApiError(400, "the request body is not valid JSON: it is nested too deeply", code="invalid_json") from None
  # json decodes an unpaired \ud800-\udfff escape into a str no tokenizer encodes (a 500 there). Only an escape,
  # a UTF-16/32 body or a surrogate's own UTF-8 bytes (ED A0..BF ..: json decodes bytes with "surrogatepass") can
  # hold one.
  if (b"\\u" in raw or b"\xed" in raw or json.detect_encoding(raw) not in ("utf-8", "utf-8-sig")) \
      and json_text.has_unpaired_surrogate(body):
    raise ApiError(400, "the request body is not valid JSON text: it holds an unpaired UTF-16 surrogate escape "
                   "(\\ud800 to \\udfff without its pair) or such a surrogate's UTF-8 bytes; send text",
                   code="invalid_json")
  return body


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
    raise ApiError(400, f"{name} must be a {_names(kinds)}, got {value!r}", name)
  if not isinstance(value, kinds):
    raise ApiError(400, f"{name} must be a {_names(kinds)}, got {type(value).__name__}", name)
  return value


def _names(kinds: type | tuple[type, ...]) -> str:
  return " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _check_model(body: dict[str, Any], limits: Limits) -> None:
  model = body.get("model")
  if model is not None and not isinstance(model, str):  # a name never matches: it is a malformed request
    raise ApiError(400, f"model must be a string, got {type(model).__name__}", "model")
  if model is not None and model != limits.model_name and model not in limits.adapter_names():
    adapters = limits.adapter_names()
    also = f" and the LoRA adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
    raise ApiError(404, f"the model {str(model)[:200]!r} does not exist; this server serves {limits.model_name!r}"
                   f"{also}", "model", "model_not_found")


def _model(body: dict[str, Any]) -> str:
  model = body.get("model")
  return model if isinstance(model, str) else ""


# The fields each route reads. Any other field with a value (null is no value) is a 400 naming it:
# a request is never answered as if it had asked for less than it did.
_SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias")
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS + ("prompt", "echo", "logprobs", "best_of", "suffix"))
CHAT_FIELDS = frozenset(_SAMPLING_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                            "response_format", "tools", "tool_choice", "functions", "function_call",
                                            "modalities"))
# Read and ignored on both routes: they ask nothing of the answer (who asks, bookkeeping, billing and
# caching hints; parallel_tool_calls, which the chat route reads itself: false holds a forced call to one).
IGNORED_FIELDS = frozenset(("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "prompt_cache_options", "parallel_tool_calls"))
# Fields read only at the values that ask for nothing (their defaults), and why others are refused.
_NO_TOOLS = "use tools and tool_choice"
NO_OP_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0,), "only 0"),
    "frequency_penalty": ((0,), "only 0"),
    "logit_bias": (({},), "only {}"),
    "best_of": ((1,), "only 1"),
    "suffix": (("",), "only \"\""),
    "functions": (([],), f"deprecated: {_NO_TOOLS}"),
    "function_call": (("none",), f"deprecated: {_NO_TOOLS}"),
    "modalities": ((["text"],), 'only ["text"]'),
}
_CHAT_NO_OP_VALUES = {**NO_OP_VALUES,
                      "logprobs": ((False,), "logprobs are supported by /v1/completions only"),
                      "top_logprobs": ((0,), "logprobs are supported by /v1/completions only")}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the second ignored: nothing is padded


def _check_fields(body: dict[str, Any], route: str, fields: frozenset[str],
                  no_op_values: dict[str, tuple[tuple[Any, ...], str]]) -> None:
  for name, value in body.items():
    if value is None or name in IGNORED_FIELDS:
      continue
    if name not in fields:
      raise ApiError(400, f"{name[:100]} is not supported by {route}; remove it", name[:100], "unsupported_parameter")
    if name in no_op_values:
      allowed, why = no_op_values[name]
      if not any(type(value) is type(a) and value == a or _is_zero(value, a) for a in allowed):
        raise ApiError(400, f"{name} is not supported ({why})", name, "unsupported_parameter")


def _is_zero(value: Any, allowed: Any) -> bool:
  """0 and 0.0 alike (not False or True)."""
  return allowed == 0 and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _include_usage(body: dict[str, Any]) -> bool:
  """stream_options: {"include_usage": true} asks for a last chunk with the usage."""
  options = body.get("stream_options")
  if options is None:
    return False
  if not isinstance(options, dict):
    raise ApiError(400, "stream_options must be an object", "stream_options")
  if not body.get("stream"):
    raise ApiError(400, "stream_options is only allowed with \"stream\": true", "stream_options")
  for name, value in options.items():
    if name not in STREAM_OPTIONS:
      raise ApiError(400, f"stream_options.{name[:100]} is not supported; remove it", "stream_options",
                     "unsupported_parameter")
    if value is not None and not isinstance(value, bool):
      raise ApiError(400, f"stream_options.{name} must be true or false, got {str(value)[:40]!r}", "stream_options")
  return bool(options.get("include_usage"))


def _stop(body: dict[str, Any]) -> list[str]:
  stop = body.get("stop")
  stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
  if len(stops) > MAX_STOP_SEQUENCES:
    raise ApiError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}", "stop")
  return stops


def _float(body: dict[str, Any], name: str, default: float) -> float:
  """A number field as a float: JSON integers have no size limit, floats do."""
  value = _get(body, name, (int, float), default)
  try:
    return float(value)
  except OverflowError:
    raise ApiError(400, f"{name} is an integer too large to be a number ({len(str(value))} digits)", name) from None


def _sampling(body: dict[str, Any], vocab_size: int) -> tuple[float, float, int, int | None, int]:
  temperature = _float(body, "temperature", 1.0)
  top_p = _float(body, "top_p", 1.0)
  top_k = _get(body, "top_k", int, 0)
  seed = _get(body, "seed", int, None)
  n = _get(body, "n", int, 1)
  if not 0 <= temperature <= 2:
    raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
  if not 0 < top_p <= 1:
    raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
  if top_k < -1:
    raise ApiError(400, f"top_k must be >= 0, or -1 (0 and -1 = all tokens), got {top_k}", "top_k")
  top_k = max(top_k, 0)  # -1: vLLM's spelling of "all tokens"
  if n < 1:
    raise ApiError(400, f"n must be >= 1, got {n}", "n")
  if seed is not None and not 0 <= seed < SEED_LIMIT:  # folding it in would make it repeat another seed
    raise ApiError(400, f"seed must be in [0, 2**32), got {str(seed)[:40]}", "seed")
  # top_k >= the vocabulary keeps every token, as 0 does; the cap keeps it an int32 on the device.
  return temperature, top_p, min(top_k, vocab_size), seed, n


def _check_prompt(ids: list[int], limits: Limits, token_limit: int | None, has_images: bool = False,
                  param: str = "prompt") -> None:
  """`param`: the field the ids came from (a chat's "messages": its request has no "prompt" to name)."""
  what = "the prompt" if param == "prompt" else f"the prompt the {param} render to"
  if not ids:
    raise ApiError(400, f"{what} is empty (it must have at least one token)", param)
  if len(ids) > limits.max_prompt_tokens:
    raise ApiError(400, f"{what} has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens} "
                   "(max_prefill_predict_length)", param, "context_length_exceeded")
  limit = limits.vocab_size if token_limit is None else min(token_limit, limits.vocab_size)
  bad = [t for t in ids if not 0 <= t < limit]
  if bad:
    whose = "" if limit == limits.vocab_size else f" of the tokenizer (the model's is [0, {limits.vocab_size}))"
    raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {limit}){whose}", param)
  if not has_images and limits.image_token_id is not None and limits.image_token_id in ids:
    raise ApiError(400, f"{what} holds the image placeholder token {limits.image_token_id} but no image; send "
                   "images as image_url content parts of /v1/chat/completions", param)


def _max_tokens(value: Any, name: str, prompt_len: int, limits: Limits, minimum: int) -> int:
  room = limits.max_target_length + 1 - prompt_len  # the last token needs no cache entry
  if value is None:
    return max(min(limits.max_tokens, room), minimum)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
  if value < minimum:
    raise ApiError(400, f"{name} must be >= {minimum}, got {value}", name)
  if value > limits.max_tokens:
    raise ApiError(400, f"{name}={value} is more than this server's limit of {limits.max_tokens} (serve_max_tokens)",
                   name)
  if value > room:
    raise ApiError(400, f"{prompt_len} prompt tokens + {name}={value} exceed the context of "
                   f"{limits.max_target_length + 1} tokens (max_target_length + 1)", name, "context_length_exceeded")
  return value


def _choices(prompts: list[list[int]], body: dict[str, Any], name: str, limits: Limits, minimum: int,
             images: PromptImages | None = None, token_limit: int | None = None,
             prompt_param: str = "prompt") -> list[Completion]:
  temperature, top_p, top_k, seed, n = _sampling(body, limits.vocab_size)
  if len(prompts) * n > limits.max_choices:
    raise ApiError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} completions; this server allows at "
                   f"most {limits.max_choices} per request (serve_max_n)", "n")
  out = []
  for p, ids in enumerate(prompts):
    _check_prompt(ids, limits, token_limit, images is not None, prompt_param)
    max_tokens = _max_tokens(body.get(name), name, len(ids), limits, minimum)
    for j in range(n):
      index = p * n + j
      # A greedy row never draws: no random seed (a system call on the event loop) for it. A seeded prompt's
      # choices count from the seed whatever other prompts share the list, as they would alone (vLLM's rule).
      row_seed = (secrets.randbits(32) if temperature > 0 else 0) if seed is None else (seed + j) % SEED_LIMIT
      out.append(Completion(index, ids, max_tokens, RowParams(temperature, top_p, top_k, row_seed), images))
  return out


def _check_body(body: Any, limits: Limits, chat: bool) -> None:
  """What every generation request must satisfy: a JSON object naming the served model, with
  no field this server does not implement."""
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  _check_model(body, limits)
  if chat:
    _check_fields(body, "/v1/chat/completions", CHAT_FIELDS, _CHAT_NO_OP_VALUES)
  else:
    _check_fields(body, "/v1/completions", COMPLETION_FIELDS, NO_OP_VALUES)


def parse_completion(body: Any, limits: Limits, codec: Codec) -> Request:
  _check_body(body, limits, chat=False)
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    prompts = [codec.encode(prompt)]
  elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    prompts = [list(prompt)]
  elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
    prompts = [codec.encode(x) for x in prompt]
  elif isinstance(prompt, list) and prompt and all(
      isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in prompt):
    prompts = [list(x) for x in prompt]
  else:
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   "prompt")
  best_of, n = body.get("best_of"), _get(body, "n", int, 1)
  if best_of is not None and best_of < n:  # OpenAI and vLLM refuse it: the n returned are picked from best_of
    raise ApiError(400, f"best_of must be >= n, got best_of={best_of} and n={n} (best_of is supported only at 1: "
                   "omit it with n > 1)", "best_of")
  echo = bool(_get(body, "echo", bool, False))
  logprobs = _get(body, "logprobs", int, None)
  if logprobs is not None and not 0 <= logprobs <= NUM_TOP_LOGPROBS:
    raise ApiError(400, f"logprobs must be in [0, {NUM_TOP_LOGPROBS}], got {logprobs}", "logprobs")
  # Ids the client typed are checked against the tokenizer; ids the server encoded come from it.
  choices = _choices(prompts, body, "max_tokens", limits, minimum=0 if echo else 1, token_limit=codec.token_limit)
  return Request(choices, bool(_get(body, "stream", bool, False)), _stop(body), echo, logprobs,
                 _include_usage(body), model=_model(body))


def parse_chat(body: Any, limits: Limits, codec: Codec) -> Request:
  _check_body(body, limits, chat=True)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise ApiError(400, f"messages[{i}] must be an object with a role and a content", "messages")
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  both = body.get("max_tokens"), body.get("max_completion_tokens")
  # max_completion_tokens is read: a max_tokens beside it that says otherwise (or is malformed) was ignored, a 200.
  if None not in both and not (type(both[0]) is type(both[1]) and both[0] == both[1]):
    raise ApiError(400, f"max_tokens={str(both[0])[:40]} and max_completion_tokens={str(both[1])[:40]} differ; send "
                   "max_completion_tokens alone (max_tokens is its deprecated name)", "max_tokens")
  tools, forced = _tools(body)
  # false: at most one call. Held for a forced call (its grammar takes one); with "auto" the model may write more.
  parallel = _get(body, "parallel_tool_calls", bool, True)
  grammar = _grammar(body, codec, forced, parallel)
  if has_images(body) or (codec.chat_images is not None and limits.image_token_id is not None):
    if codec.chat_images is None:
      raise ApiError(400, "this server takes no images", "messages")
    if tools or forced:
      raise ApiError(400, "tools with images are not supported yet; send one or the other", "tools",
                     "unsupported_parameter")
    for i, message in enumerate(messages):  # as the text path checks: other contents reached the template, unread
      content = message.get("content")
      if not isinstance(content, (str, list)) and not (content is None and message.get("tool_calls")):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of content parts", "messages")
    try:
      ids, images = codec.chat_images(messages)
    except UserError as e:
      raise ApiError(400, str(e), "messages", "invalid_image") from None
    choices = _choices([ids], body, name, limits, minimum=1, images=images, prompt_param="messages")
    return Request(choices, bool(_get(body, "stream", bool, False)), _stop(body),
                   include_usage=_include_usage(body), grammar=grammar, model=_model(body))
  rendered = []
  for i, message in enumerate(messages):
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts are understood
      if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                 for part in content):
        raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
      content = "".join(part["text"] for part in content)
    if content is None and message.get("tool_calls"):
      content = ""  # an assistant turn that only called tools
    if not isinstance(content, str):
      raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    rendered.append({"role": message["role"], "content": content, **_tool_fields(message, i)})
  if tools:
    if codec.chat_tools is None:
      raise ApiError(400, "tools are not supported by this server's chat", "tools", "unsupported_parameter")
    ids = codec.chat_tools(rendered, tools)
  else:
    ids = codec.chat(rendered)
  choices = _choices([ids], body, name, limits, minimum=1, prompt_param="messages")
  return Request(choices, bool(_get(body, "stream", bool, False)), _stop(body),
                 include_usage=_include_usage(body), tools=bool(tools), grammar=grammar, model=_model(body))


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _grammar(body: dict[str, Any], codec: Codec, forced: list[dict[str, Any]] | None,
             parallel: bool = True) -> grammar_lib.Grammar | None:
  """What response_format or a forced tool call (tool_choice "required" or a named function) constrains the
  reply to, compiled for the tokenizer; None: the reply is free."""
  fmt = body.get("response_format")
  if fmt is not None and (not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str)):
    raise ApiError(400, 'response_format must be an object with a "type"', "response_format")
  kind = "text" if fmt is None else fmt["type"]
  if kind not in RESPONSE_FORMATS:
    raise ApiError(400, f"response_format type {kind[:100]!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
                   "response_format")
  # A key the server does not read is refused, not ignored: `{"type": "json_object", "schema": ...}` (another
  # vendor's spelling) had constrained the reply to any object, not to the schema.
  spec = fmt.get("json_schema") if fmt is not None and kind == "json_schema" else None
  keys = ("type", kind) if kind in ("json_schema", "regex", "grammar") else ("type",)
  for prefix, given, known in (("", fmt, keys), ("json_schema.", spec, _JSON_SCHEMA_KEYS)):
    extra = [k for k, v in given.items() if k not in known and v is not None] if isinstance(given, dict) else []
    if extra:
      raise ApiError(400, f"response_format.{prefix}{str(extra[0])[:60]} is not read by response_format {kind}; "
                     f"send {', '.join(known)} only", "response_format", "unsupported_parameter")
  if kind == "text" and forced is None:
    return None
  if kind != "text" and forced is not None:
    raise ApiError(400, f"response_format {kind} and a forced tool call (tool_choice) both constrain the reply; "
                   "send one of them", "tool_choice", "unsupported_parameter")
  if codec.grammars is None:
    raise ApiError(400, f"{'tool_choice' if forced else 'response_format'} needs constrained decoding, which this "
                   "server's tokenizer does not offer", "tool_choice" if forced else "response_format",
                   "unsupported_parameter")
  compiler = codec.grammars()
  try:
    if forced is not None:
      return compiler.tool_call(forced, codec.tool_format() if codec.tool_format else "tag", parallel)
    assert fmt is not None
    return _response_format(compiler, fmt, kind)
  except grammar_lib.GrammarError as e:
    part = "tools (a forced call's parameters)" if forced is not None else f"response_format {kind}"
    raise ApiError(400, f"{part} does not compile to a grammar: {e}", "tools" if forced else "response_format",
                   "invalid_grammar") from None


def _response_format(compiler: grammar_lib.Compiler, fmt: dict[str, Any], kind: str) -> grammar_lib.Grammar:
  if kind == "json_object":
    return compiler.json_schema(grammar_lib.ANY_JSON_OBJECT)
  if kind == "json_schema":
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if isinstance(spec, dict) and schema is None:  # absent, or null (which counts as absent): any JSON
      schema = {}
    if not isinstance(schema, dict):
      # What came instead, so a schema sent as its JSON text (a str) says so.
      got = f"json_schema.schema is a {type(schema).__name__}" if isinstance(spec, dict) else \
          f"json_schema is {'missing' if spec is None else 'a ' + type(spec).__name__}"
      raise ApiError(400, 'response_format json_schema must be {"type": "json_schema", "json_schema": {"name": ..., '
                     f'"schema": {{...}}}}}} with the schema as a JSON object; {got}', "response_format")
    strict = spec.get("strict") if isinstance(spec, dict) else None  # a dict here: schema came from it
    if strict is not None and not isinstance(strict, bool):
      raise ApiError(400, f"response_format json_schema.strict must be true or false, got {strict!r:.40}",
                     "response_format")
    return compiler.json_schema(schema)
  text = fmt.get(kind)
  if not isinstance(text, str) or not text:
    raise ApiError(400, f'response_format {kind} needs {{"type": "{kind}", "{kind}": "..."}} (a non-empty string)',
                   "response_format")
  return compiler.regex(text) if kind == "regex" else compiler.lark(text)


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
  """(the tools to render: none without tools or with tool_choice "none" (the model is not told of them);
  the tools a call is forced among: every one for "required", the named one, None for "auto" and "none")."""
  tools = _get(body, "tools", list, [])
  for i, tool in enumerate(tools):
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
        or not isinstance(function.get("name"), str):
      raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    # OpenAI's rule for a name. Others ("", "a b", "</tool_call>") can break the template's text or the call's tag,
    # and a forced call of one would come back as content, not as a call.
    if not TOOL_NAME.fullmatch(function["name"]):
      raise ApiError(400, f"tools[{i}].function.name {function['name'][:100]!r} must be 1 to 64 of a-z, A-Z, 0-9, "
                     "_ and -", "tools")
    parameters = function.get("parameters")
    # A call's arguments are a JSON object (tool_calls.parse reads nothing else): a schema of another type made a
    # forced call's reply unparseable, sent back as content with no tool_calls.
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
      got = parameters.get("type") if isinstance(parameters, dict) else type(parameters).__name__
      raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object of \"type\": \"object\" (a "
                     f"call's arguments are an object), got {str(got)[:40]}", "tools")
  seen: set[str] = set()
  for tool in tools:  # a call of a name given twice could not say which tool (nor which parameters) it means
    name = tool["function"]["name"]
    if name in seen:
      raise ApiError(400, f"tools name the function {name[:100]!r} more than once; give each tool its own name",
                     "tools")
    seen.add(name)
  choice = body.get("tool_choice")
  if choice is None:
    choice = "auto"
  forced: list[dict[str, Any]] | None = None
  if choice == "required":
    forced = tools
  elif isinstance(choice, dict):
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
      raise ApiError(400, 'a named tool_choice must be {"type": "function", "function": {"name": ...}}',
                     "tool_choice")
    forced = [tool for tool in tools if tool["function"]["name"] == name]
    if not forced:
      names = ", ".join(repr(tool["function"]["name"][:50]) for tool in tools[:10]) or "none"
      raise ApiError(400, f"tool_choice names the function {name[:100]!r}, which is not among tools ({names})",
                     "tool_choice")
  elif choice not in ("auto", "none"):
    raise ApiError(400, f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r:.100}',
                   "tool_choice")
  if forced is not None and not forced:
    raise ApiError(400, 'tool_choice "required" needs tools to call', "tool_choice")
  return (tools if choice != "none" else []), forced


def _tool_fields(message: dict[str, Any], i: int) -> dict[str, Any]:
  """A message's tool_calls (arguments as objects, as templates render them), tool_call_id and name."""
  out: dict[str, Any] = {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
  # The call a tool's result answers (OpenAI requires it; templates that pair results with calls read it): a missing
  # or non-string id was dropped without a word.
  if message.get("role") == "tool" and not out.get("tool_call_id"):
    raise ApiError(400, f"messages[{i}] (role tool) needs tool_call_id: the id of the assistant's call it answers",
                   "messages")
  calls = message.get("tool_calls")
  if not calls:
    return out
  if not isinstance(calls, list):
    raise ApiError(400, f"messages[{i}].tool_calls must be a list", "messages")
  out["tool_calls"] = []
  for call in calls:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
      raise ApiError(400, f"messages[{i}].tool_calls: each needs a function with a name", "messages")
    arguments = function.get("arguments", "{}")
    try:
      arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json's stack
      raise ApiError(400, f"messages[{i}].tool_calls: arguments of {function['name'][:100]!r} are not JSON",
                     "messages") from None
    if not isinstance(arguments, dict):  # a number or a list reached the template as if it were a call's arguments
      raise ApiError(400, f"messages[{i}].tool_calls: arguments of {function['name'][:100]!r} must be a JSON object "
                     f"as text (as the reply gave them), got {type(arguments).__name__}", "messages")
    out["tool_calls"].append({"id": call.get("id"), "type": "function",
                              "function": {"name": function["name"], "arguments": arguments}})
  return out


IMAGE_PART_TYPES = ("image_url", "image")


def has_grammar(body: Any) -> bool:
  """Whether a chat body asks for constrained decoding (response_format other than text, or a forced tool call):
  compiling its grammar can take long enough to stall the event loop other requests share."""
  if not isinstance(body, dict):
    return False
  fmt, choice = body.get("response_format"), body.get("tool_choice")
  return (isinstance(fmt, dict) and fmt.get("type") != "text") or choice == "required" or isinstance(choice, dict)


def has_images(body: Any) -> bool:
  """Whether a chat body's messages carry image parts (decoded off the event loop)."""
  messages = body.get("messages") if isinstance(body, dict) else None
  return isinstance(messages, list) and any(
      isinstance(m, dict) and isinstance(m.get("content"), list)
      and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"]) for m in messages)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}
