"""The server's routes: /health, /metrics, /v1/models, /v1/completions and /v1/chat/completions
(whole answers or server-sent events: `data: {chunk}` lines, then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import time
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from MaxText.inference import choice_text
from MaxText.inference import openai_api as api
from MaxText.inference import job_events
from MaxText.inference import serve_metrics
from MaxText.inference import tool_calls

if TYPE_CHECKING:
  from MaxText.inference.serve_app import HttpServer as Server


@dataclasses.dataclass
class _Choice:
  """One choice's progress: its text, the tokens with their scores, why it ended."""
  text: choice_text.ChoiceText
  prompt: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  tops: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  prompt_scores: job_events.PromptScores | None = None
  finish_reason: str | None = None


def _choices(server: "Server", request: api.Request, chat: bool = False) -> dict[int, _Choice]:
  """A completion's text continues its prompt's (prompt + text is the whole text, a leading space kept); a chat's
  reply starts a message of its own."""
  stop_ids = server.codec.stop_ids(request.stop)
  return {c.index: _Choice(choice_text.ChoiceText(server.codec.decode, request.stop, stop_ids,
                                          () if chat else c.prompt[-1:]), c.prompt)
          for c in request.choices}


Unit = job_events.Event  # what one chunk of a stream answers


def _units(events: list[job_events.Event], sharing: dict[int, list[int]] | None = None) -> list[Unit]:
  """`events` with one choice's consecutive runs of tokens merged into one: their text goes out in one
  chunk (the events that reached the stream together). A prompt's scores go to every choice in `sharing` (the
  choice that scored it -> the choices with its prompt, job_events.prompt_owners), as if each had scored it: the
  first with a prompt is admitted first, so its scores still come before any of the others' tokens."""
  units: list[Unit] = []
  for event in events:
    last = units[-1] if units else None
    if isinstance(event, job_events.Tokens) and isinstance(last, job_events.Tokens) and last.index == event.index:
      units[-1] = job_events.Tokens(event.index, last.tokens + event.tokens, last.logprobs + event.logprobs,
                                    last.tops + event.tops)
    elif isinstance(event, job_events.PromptScores) and sharing and event.index in sharing:
      units += [job_events.PromptScores(index, event.logprobs, event.top) for index in sharing[event.index]]
    else:
      units.append(event)
  return units


def _sharing(request: api.Request, score_prompt: bool) -> dict[int, list[int]]:
  """_units' `sharing` of a request: the choice that scores each prompt -> the choices with that prompt."""
  if not score_prompt:
    return {}
  sharing: dict[int, list[int]] = {}
  for index, owner in job_events.prompt_owners((c.index, c.prompt) for c in request.choices).items():
    sharing.setdefault(owner, []).append(index)
  return sharing


def _index(unit: Unit) -> int:
  return unit.index


def _apply(unit: Unit, choice: _Choice, job: job_events.JobHandle) -> str:
  """Folds one unit into its choice; returns the new text that is safe to send."""
  if isinstance(unit, job_events.PromptScores):
    choice.prompt_scores = unit
    return ""
  if isinstance(unit, job_events.Tokens):
    if choice.text.stopped:
      return ""  # tokens the slot made before the scheduler saw the cancellation
    delta, taken = choice.text.add_many(unit.tokens)
    choice.tokens += unit.tokens[:taken]
    choice.logprobs += unit.logprobs[:taken]
    choice.tops += unit.tops[:taken]
    if choice.text.stopped:
      job.cancel()
    return delta
  event = unit
  if event.reason == "error":
    raise api.ApiError(500, f"generation failed: {event.message}", code="generation_failed")
  delta = choice.text.flush()  # may find a stop sequence in the last characters
  choice.finish_reason = "stop" if choice.text.stopped or event.reason == "stop" else "length"
  return delta


def _texts(server: "Server", context: Sequence[int]) -> choice_text.TokenTexts:
  return choice_text.TokenTexts(server.codec.decode, context, server.token_text)


def _alternative(server: "Server", texts: choice_text.TokenTexts, first: int) -> Callable[[int, int], str]:
  """completion_logprobs' `alternative` for the tokens from the `first`-th of `texts`."""
  return lambda i, token: choice_text.alternative_text(server.codec.decode, texts.previous(first + i), token, server.token_text)


def _prompt_logprobs(server: "Server", choice: _Choice, how_many: int) -> dict[str, Any]:
  """The logprobs object of an echoed prompt (its first token has no score); each token's text is as it stands in
  the prompt's text, so that they join to it. Its choices share one (their scores are one prompt's)."""
  assert choice.prompt_scores is not None
  prompt = _texts(server, ())
  scores = choice.prompt_scores
  return choice_text.completion_logprobs(prompt.add(choice.prompt) + prompt.finish(), choice.prompt,
                                 [None, *scores.logprobs[1:]], [None, *scores.top[1:]], how_many,
                                 _alternative(server, prompt, 0))


def _logprobs(server: "Server", choice: _Choice, how_many: int, echo: bool, echoed: dict[str, Any] | None = None
              ) -> dict[str, Any]:
  """The choice's logprobs object: with echo, the prompt's first (`echoed`, else _prompt_logprobs made here), then
  its own tokens', whose texts join to its text."""
  if not echo or choice.prompt_scores is None:
    echoed = None
  elif echoed is None:
    echoed = _prompt_logprobs(server, choice, how_many)
  own = _texts(server, choice.prompt[-1:])
  start = sum(len(text) for text in echoed["tokens"]) if echoed is not None else 0
  generated = choice_text.completion_logprobs(own.add(choice.tokens) + own.finish(), choice.tokens, choice.logprobs,
                                      choice.tops, how_many, _alternative(server, own, 0), start)
  return generated if echoed is None else {key: echoed[key] + generated[key] for key in generated}


def _usage(request: api.Request, choices: dict[int, _Choice]) -> dict[str, int]:
  prompts = {id(c.prompt): len(c.prompt) for c in request.choices}
  return api.usage(sum(prompts.values()), sum(len(c.tokens) for c in choices.values()))


Handler = Callable[[Request], Awaitable[Any]]  # a POST route's function: a Response, or a dict to answer as JSON


def add_routes(app: FastAPI, server: "Server", json_response: Any, streaming_response: Any,
               sse: Callable[[Any], str]) -> dict[str, Handler]:
  """The routes on `app`; returns the generation routes' functions by path, which serve_app's guard
  calls itself for a POST (FastAPI's routing and middleware cost more per request than the answer
  around a short completion); `app` keeps them for every other method (a 405)."""
  async def read_json(request: Request) -> Any:
    return api.parse_json(await request.body())

  @app.get("/health")
  async def health() -> dict[str, Any]:
    await server.refresh()
    return server.metrics.health()

  @app.get("/metrics")
  async def metrics() -> Response:
    await server.refresh()
    return Response(server.metrics.exposition(), media_type=serve_metrics.CONTENT_TYPE)

  async def _run(http: Request, request: api.Request, score_prompt: bool, chat: bool) -> Any:
    """Submits the request's jobs; a streaming request gets its response, any other the
    finished choices by index."""
    jobs, queue = await server.admit(request, score_prompt=score_prompt)
    events = server.events(jobs, queue, http.is_disconnected, route=http.scope["path"])
    sharing = _sharing(request, score_prompt)
    if request.stream:
      return streaming_response(_stream(server, request, jobs, events, sse, chat=chat, sharing=sharing),
                                media_type="text/event-stream")
    choices = _choices(server, request, chat)
    async with contextlib.aclosing(events):
      async for batch in events:
        for unit in _units(batch, sharing):
          _apply(unit, choices[_index(unit)], jobs[_index(unit)])
    return choices

  @app.get("/v1/models")
  async def models() -> dict[str, Any]:
    adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "maxtext", "parent": server.limits.model_name}
                for name in server.limits.adapter_names()]  # LoRA adapters served beside the model
    return {"object": "list", "data": [{"id": server.limits.model_name, "object": "model", "created": 0,
                                        "owned_by": "maxtext"}, *adapters]}

  @app.post("/v1/completions")
  async def completions(http: Request) -> Any:
    request = api.parse_completion(await read_json(http), server.limits, server.codec)
    choices = await _run(http, request, request.echo and request.logprobs is not None, chat=False)
    if not isinstance(choices, dict):
      return choices  # the stream
    out = []
    owners = job_events.prompt_owners((c.index, c.prompt) for c in request.choices) if request.echo else {}
    echoes: dict[int, tuple[str, dict[str, Any] | None]] = {}  # by owner: its prompt's text and logprobs
    for index, choice in sorted(choices.items()):
      prompt_text, echoed = "", None
      if request.echo:
        if owners[index] not in echoes:
          echoes[owners[index]] = (server.codec.decode(choice.prompt), None if request.logprobs is None or
                           choice.prompt_scores is None else _prompt_logprobs(server, choice, request.logprobs))
        prompt_text, echoed = echoes[owners[index]]
      logprobs = None
      if request.logprobs is not None:
        logprobs = _logprobs(server, choice, request.logprobs, request.echo, echoed)
      out.append({"index": index, "text": prompt_text + choice.text.text, "logprobs": logprobs,
                  "finish_reason": choice.finish_reason})
    return {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": request.model or server.limits.model_name, "choices": out, "usage": _usage(request, choices)}

  @app.post("/v1/chat/completions")
  async def chat_completions(http: Request) -> Any:
    body = await read_json(http)
    # Decoding and resizing images, compiling a grammar: not on the event loop other requests share.
    if api.has_images(body) or api.has_grammar(body):
      request = await asyncio.to_thread(api.parse_chat, body, server.limits, server.codec)
    else:
      request = api.parse_chat(body, server.limits, server.codec)
    choices = await _run(http, request, False, chat=True)
    if not isinstance(choices, dict):
      return choices  # the stream
    out = [chat_choice(index, choice.text.text, choice.finish_reason, request.tools)
           for index, choice in sorted(choices.items())]
    return {"id": _new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": request.model or server.limits.model_name, "choices": out, "usage": _usage(request, choices)}

  return {"/v1/completions": completions, "/v1/chat/completions": chat_completions}


def chat_choice(index: int, text: str, finish_reason: str | None, tools: bool) -> dict[str, Any]:
  """One choice of a chat answer; with tools offered, the calls in its text as `tool_calls`."""
  message: dict[str, Any] = {"role": "assistant", "content": text}
  parsed = tool_calls.parse(text) if tools else None
  if parsed is not None and parsed.calls:
    message = {"role": "assistant", "content": parsed.content or None,
               "tool_calls": [call.openai() for call in parsed.calls]}
    finish_reason = _with_calls(finish_reason)
  return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}


def _call_chunks(index: int, calls: list[tool_calls.ToolCall], first: int) -> list[dict[str, Any]]:
  """One `delta.tool_calls` chunk per call; `first` numbers them after those already sent."""
  return [{"index": index, "delta": {"tool_calls": [{"index": first + i, **call.openai()}]}, "logprobs": None,
           "finish_reason": None} for i, call in enumerate(calls)]


def _tool_chunks(index: int, splitter: tool_calls.ContentSplitter, finish_reason: str | None
                 ) -> tuple[list[dict[str, Any]], str | None]:
  """A streamed choice's end with tools offered: the content not yet sent and the calls not yet sent."""
  parsed = tool_calls.parse(splitter.text)
  rest = parsed.content[splitter.sent:]
  bodies: list[dict[str, Any]] = [{"index": index, "delta": {"content": rest}, "logprobs": None,
                                   "finish_reason": None}] if rest else []
  bodies += _call_chunks(index, parsed.calls[splitter.calls_sent:], splitter.calls_sent)
  return bodies, _with_calls(finish_reason) if parsed.calls else finish_reason


def _with_calls(finish_reason: str | None) -> str | None:
  """A reply with calls ends in "tool_calls", unless the token limit cut it: then "length", so that a
  client knows a call after the parsed ones may be missing (its cut tag stays in the content)."""
  return finish_reason if finish_reason == "length" else "tool_calls"


async def _stream(server: "Server", request: api.Request, jobs: Sequence[job_events.JobHandle],
                  events: AsyncGenerator[list[job_events.Event], None], sse: Callable[[Any], str],
                  chat: bool, sharing: dict[int, list[int]] | None = None) -> AsyncIterator[str]:
  """Server-sent events: a chunk per piece of text (the tokens of a choice that arrived together,
  with their logprobs, one entry per token), a last chunk per choice with its finish_reason, the
  usage when stream_options asks for it, then [DONE]. An error mid-stream is sent as an error event.
  `sharing`: _units' (the choices that share a prompt's scores)."""
  kind, prefix = ("chat.completion.chunk", "chatcmpl") if chat else ("text_completion", "cmpl")
  head: dict[str, Any] = {"id": _new_id(prefix), "object": kind, "created": int(time.time()),
                          "model": request.model or server.limits.model_name}
  if request.include_usage:
    head["usage"] = None  # every chunk but the last, which has the usage and no choices
  choices = _choices(server, request, chat)
  splitters = {index: tool_calls.ContentSplitter() for index in choices} if chat and request.tools else {}
  offsets = dict.fromkeys(choices, 0)  # text_offset counts from the choice's start, as unstreamed, not a chunk's
  token_texts = {index: _texts(server, choice.prompt[-1:]) for index, choice in choices.items()}
  logged = dict.fromkeys(choices, 0)  # tokens whose logprobs entries went out
  owner = {index: first for first, indices in (sharing or {}).items() for index in indices}
  echoes: dict[int, tuple[str, dict[str, Any]]] = {}  # by owner: its prompt's text and logprobs

  def chunk(index: int, text: str | None, finish_reason: str | None, logprobs: Any = None) -> str:
    if chat:
      delta = {} if text is None else {"content": text}
      body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
      body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return sse({**head, "choices": [body]})

  for index, choice in sorted(choices.items()):  # the opening chunk: role, or the echoed prompt
    if chat:
      yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]})
    elif request.echo and request.logprobs is None:
      yield chunk(index, server.codec.decode(choice.prompt), None)
  def answer(unit: Unit) -> list[str]:
    """The chunks for one unit (none while its text is held back)."""
    index = _index(unit)
    choice = choices[index]
    had = len(choice.tokens)
    delta = _apply(unit, choice, jobs[index])
    logprobs = None
    if request.logprobs is not None and not chat:
      if isinstance(unit, job_events.PromptScores) and request.echo:
        key = owner.get(index, index)
        if key not in echoes:
          echoes[key] = (server.codec.decode(choice.prompt), _prompt_logprobs(server, choice, request.logprobs))
        delta, logprobs = echoes[key]
      else:  # the entries of the tokens whose text is settled (a character's last byte settles its first)
        texts = token_texts[index]
        settled = texts.add(choice.tokens[had:]) + (texts.finish() if isinstance(unit, job_events.Done) else [])
        if settled:
          first, logged[index] = logged[index], logged[index] + len(settled)
          logprobs = choice_text.completion_logprobs(settled, choice.tokens[first:logged[index]],
                                             choice.logprobs[first:logged[index]],
                                             list(choice.tops[first:logged[index]]), request.logprobs,
                                             _alternative(server, texts, first), offsets[index])
      if logprobs is not None:
        offsets[index] += sum(len(text) for text in logprobs["tokens"])
    if index in splitters:
      delta = splitters[index].add(delta)
    out = []
    if isinstance(unit, job_events.Done) and index in splitters:
      if delta:
        out.append(chunk(index, delta, None))
      bodies, finish_reason = _tool_chunks(index, splitters[index], choice.finish_reason)
      out += [sse({**head, "choices": [body]}) for body in bodies]
      out.append(chunk(index, None, finish_reason))
    elif isinstance(unit, job_events.Done):
      out.append(chunk(index, delta or None, choice.finish_reason, logprobs))
    elif index in splitters:  # a call whose closing tag just arrived goes out now
      if delta:
        out.append(chunk(index, delta, None))
      first = splitters[index].calls_sent
      out += [sse({**head, "choices": [body]}) for body in _call_chunks(index, splitters[index].new_calls(), first)]
    elif delta or logprobs is not None:
      out.append(chunk(index, delta, None, logprobs))
    return out

  # The chunks of the events that arrived together go out in one write; those of the last (every choice
  # finished) with the usage and [DONE], which SseResponse sends with the end of the answer.
  lines: list[str] = []
  try:
    async with contextlib.aclosing(events):  # closing it cancels the jobs (a client that went away)
      async for batch in events:
        for unit in _units(batch, sharing):
          lines += answer(unit)
        if lines and any(choice.finish_reason is None for choice in choices.values()):
          yield "".join(lines)
          lines = []
  except api.ApiError as e:
    lines.append(sse(e.body()))
  else:
    if request.include_usage:
      lines.append(sse({**head, "choices": [], "usage": _usage(request, choices)}))
  lines.append(STREAM_END)
  yield "".join(lines)


STREAM_END = "data: [DONE]\n\n"  # a stream's last event


class SseResponse(StreamingResponse):
  """A stream of server-sent events whose last piece (ending with STREAM_END) also ends the answer:
  one write less per request than StreamingResponse's separate empty end. No task listens for the
  client's disconnect beside the stream (StreamingResponse starts one per request under uvicorn's
  ASGI 2.3): `serve_app.HttpServer.events` asks once a second whether the client is still there and, when it
  is gone, ends the stream and cancels its jobs."""

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    await self.stream_response(send)
    if self.background is not None:
      await self.background()

  async def stream_response(self, send: Send) -> None:
    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
    ended = False
    async for piece in self.body_iterator:
      data = piece if isinstance(piece, (bytes, memoryview)) else piece.encode(self.charset)
      ended = bytes(data[-len(STREAM_END):]) == STREAM_END.encode()
      await send({"type": "http.response.body", "body": data, "more_body": not ended})
    if not ended:
      await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Ids:
  """Response ids: a random part drawn once per process (again in a forked child), then a count; a
  uuid4 per request was a getrandom system call and a few objects on the event loop for every answer."""

  def __init__(self) -> None:
    self.reset()
    os.register_at_fork(after_in_child=self.reset)

  def reset(self) -> None:
    self.random, self.count = os.urandom(6).hex(), itertools.count()

  def new(self, prefix: str) -> str:
    return f"{prefix}-{self.random}{next(self.count):012x}"


_IDS = _Ids()


def _new_id(prefix: str) -> str:
  return _IDS.new(prefix)
