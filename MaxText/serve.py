"""An OpenAI-compatible HTTP server over the decode engine:

    python3 -m MaxText.serve configs/base.yml load_parameters_path=CKPT tokenizer_path=TOK [port=8000] \\
        [host=127.0.0.1] [serve_max_slots=8] [serve_max_queue=64] [serve_max_tokens=256] ...

Routes: POST /v1/completions (echo, logprobs), POST /v1/chat/completions (the tokenizer's chat
template), both streamed as server-sent events with `"stream": true`; GET /v1/models; GET /health
(slots in use, queue length, KV pages free and reserved, the oldest request's age) and GET /metrics
(the same figures for Prometheus, with request counts and latency histograms).
Reads like a table of contents: config → tokenizer → engine + params → scheduler thread → app → uvicorn.
Safe by default: binds 127.0.0.1; with MAXTEXT_API_KEY set every route but /health and /metrics
needs `Authorization: Bearer <key>` (the scheme in any case; 401 otherwise). Those two stay open
because load balancers and Prometheus scrapers probe them without keys, and they show counts and
timings only, never a prompt or a text. Bodies, prompts, max_tokens, n and the waiting list are
bounded (413 / 400 / 503 with Retry-After), and every request has a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable

if __package__ in (None, ""):  # `python3 MaxText/serve.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText.configuration import config as config_lib
from MaxText import startup
from MaxText.platform import distributed
from MaxText.errors import UserError, run_cli
from MaxText.inference import grammar, image_chat, tool_calls
from MaxText.inference import openai_api as api
from MaxText.inference import scheduler as sched
from MaxText.inference import lora_adapters, serve_metrics, speculative_engine
from MaxText.inference.engine_api import DecodeEngine, EngineParams

if TYPE_CHECKING:
  from jax.sharding import Mesh

API_KEY_ENV = "MAXTEXT_API_KEY"  # an environment variable, never a config key: configs are saved with runs
RETRY_AFTER_SECONDS = "1"
OPEN_ROUTES = ("/health", "/metrics")  # no API key needed: probes and scrapers; figures only


def _codec(config: config_lib.Config) -> tuple[api.Codec, int | None]:
  """The tokenizer as the server uses it, and its end-of-sequence id."""
  from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer

  data = config.data
  if not data.tokenizer_path:
    raise UserError("MaxText.serve needs tokenizer_path=... (clients send and receive text)")
  tokenizer = load_tokenizer(data.tokenizer_type, data.tokenizer_path)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise UserError(f"the tokenizer {data.tokenizer_path} has {tokenizer.vocab_size} tokens but the model's "
                    f"vocab_size is {config.model.vocab_size}: this tokenizer does not belong to this checkpoint")
  encode = DocumentEncoder(tokenizer, data.add_bos, add_eos=False)
  chat_tokenizer: list[Any] = []

  def template_tokenizer() -> Any:
    from MaxText.errors import ConfigError
    from MaxText.input_pipeline import chat as chat_lib

    try:
      if not chat_tokenizer:
        chat_tokenizer.append(chat_lib.load_chat_tokenizer(data.tokenizer_path))
    except ConfigError as e:
      raise api.ApiError(400, f"chat completions need a chat template: {e}") from None
    return chat_tokenizer[0]

  def chat(messages: list[dict[str, Any]]) -> list[int]:
    text = template_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(template_tokenizer()(text, add_special_tokens=False)["input_ids"])

  def chat_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    template = template_tokenizer().chat_template
    if not isinstance(template, str) or "tools" not in template:  # it would drop them without a word
      raise api.ApiError(400, f"tools: the chat template of {data.tokenizer_path} does not render tools; serve a "
                         "tokenizer whose template does", "tools", "unsupported_parameter")
    text = template_tokenizer().apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(template_tokenizer()(text, add_special_tokens=False)["input_ids"])

  d = config.decode
  limits = image_chat.ImageLimits(d.serve_max_images, d.serve_max_image_bytes, d.serve_max_image_pixels)

  def chat_images(messages: list[dict[str, Any]]) -> tuple[list[int], Any]:
    return image_chat.conversation_ids(template_tokenizer(), messages, config.model, files=False, limits=limits)

  compilers: list[grammar.Compiler] = []

  def grammars() -> grammar.Compiler:
    """Built at the first constrained request: it reads the whole vocabulary."""
    if not compilers:
      try:
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        compilers.append(grammar.Compiler(template_tokenizer(), config.model.vocab_size, eos))
      except ValueError as e:  # llguidance reads Hugging Face fast tokenizers only
        raise api.ApiError(400, f"response_format and forced tool calls need a Hugging Face fast tokenizer: {e}",
                           "response_format", "unsupported_parameter") from None
    return compilers[0]

  def tool_format() -> str:
    return tool_calls.template_format(template_tokenizer().chat_template)

  return api.Codec(encode, tokenizer.decode, chat, chat_images, chat_tools, grammars, tool_format), tokenizer.eos_id


class _Mailbox:
  """Carries the scheduler thread's events to one event loop: they gather by their job's queue, and
  one callback on the loop moves each queue's events in as one list, so a call's tokens for every
  job wake the loop once (and a stream sends them as one chunk)."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._lock = threading.Lock()
    self._pending: dict[asyncio.Queue[list[sched.Event]], list[sched.Event]] = {}

  def emitter(self, queue: asyncio.Queue[list[sched.Event]]) -> Callable[[sched.Event], None]:
    """A job's `emit` (called on the scheduler thread) whose events arrive on `queue`."""

    def emit(event: sched.Event) -> None:
      with self._lock:
        moving = bool(self._pending)  # a move is already on its way
        self._pending.setdefault(queue, []).append(event)
      if moving:
        return
      try:
        self.loop.call_soon_threadsafe(self._move)
      except RuntimeError:  # the event loop is closed: the server is stopping
        pass

    return emit

  def _move(self) -> None:
    with self._lock:
      pending, self._pending = self._pending, {}
    for queue, events in pending.items():
      queue.put_nowait(events)


def _with_target(params: EngineParams, target: EngineParams) -> EngineParams:
  """`params` with the target model's replaced: a speculative engine's are (target's, draft's)."""
  return (target, params[1]) if isinstance(params, tuple) else target


class Server:
  """The engine's scheduler and what the routes need to turn requests into jobs and answers."""

  def __init__(self, config: config_lib.Config, engine: DecodeEngine, params: EngineParams,
               codec: api.Codec, eos_id: int | None, adapters: lora_adapters.Registry | None = None):
    d = config.decode
    self.codec, self.decode_cfg = codec, d
    self.adapters = adapters  # LoRA adapters served beside the model, by name (their admin routes: lora_routes.py)
    self.limits = api.Limits(d.serve_model_name or config["model_name"], config.model.vocab_size,
                             d.max_prefill_predict_length, config.model.max_target_length, d.serve_max_tokens,
                             d.serve_max_n,
                             config.model.vision.image_token_id if config.model.vision.use_multimodal else None,
                             adapters.names if adapters is not None else tuple)
    self.scheduler = sched.Scheduler(engine, params, d.serve_max_queue, [] if eos_id is None else [eos_id]).start()
    if adapters is not None:  # an adapter added or removed: the scheduler's next engine call takes the new tables
      adapters.swap = lambda new: setattr(self.scheduler, "params", _with_target(self.scheduler.params, new))
    self.metrics = serve_metrics.ServeMetrics(self.scheduler.load)
    self._token_text: dict[int, str] = {}
    self._mailbox: _Mailbox | None = None  # of the event loop that submitted last

  def token_text(self, token: int) -> str:
    if token not in self._token_text:
      self._token_text[token] = self.codec.decode([token])
    return self._token_text[token]

  def submit(self, request: api.Request, score_prompt: bool
             ) -> tuple[list[sched.Job], asyncio.Queue[list[sched.Event]]]:
    """Queues the request's choices as jobs whose events arrive on the returned queue, in lists
    (503 when full, 400 when a choice needs more KV pages than the whole pool)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue[list[sched.Event]]()
    mailbox = self._mailbox
    if mailbox is None or mailbox.loop is not loop:
      mailbox = self._mailbox = _Mailbox(loop)
    emit = mailbox.emitter(queue)

    if self.adapters is not None and request.model not in ("", self.limits.model_name):
      return self._submit_to_adapter(request, score_prompt, emit), queue
    jobs = [sched.Job(c.index, c.prompt, c.max_tokens, c.row, emit, score_prompt, images=c.images,
                      constraint=None if request.grammar is None else request.grammar.constraint())
            for c in request.choices]
    self._submit(jobs)
    return jobs, queue

  def _submit_to_adapter(self, request: api.Request, score_prompt: bool, emit: Callable[[sched.Event], None]
                         ) -> list[sched.Job]:
    """The jobs of a request naming a LoRA adapter: each decodes with the adapter's table row and holds
    the adapter (it cannot be removed) until its Done event."""
    assert self.adapters is not None
    if score_prompt:
      raise api.ApiError(400, "echo with logprobs scores the prompt under the base model only; not with a LoRA "
                         "adapter", "echo", "unsupported_parameter")
    adapters, name = self.adapters, request.model
    jobs: list[sched.Job] = []
    for c in request.choices:
      try:
        row = adapters.acquire(name)
        key = adapters.cache_key(name)  # held by the request: it stays until release
      except lora_adapters.UnknownAdapter:  # removed since the request was read
        for _ in jobs:
          adapters.release(name)
        raise api.ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found") from None

      def emit_releasing(event: sched.Event) -> None:
        if isinstance(event, sched.Done):
          adapters.release(name)
        emit(event)

      jobs.append(sched.Job(c.index, c.prompt, c.max_tokens, dataclasses.replace(c.row, adapter=row), emit_releasing,
                            score_prompt, images=c.images,
                            constraint=None if request.grammar is None else request.grammar.constraint(),
                            cache_key=key))
    try:
      self._submit(jobs)
    except api.ApiError:
      for _ in jobs:
        adapters.release(name)
      raise
    return jobs

  def _submit(self, jobs: list[sched.Job]) -> None:
    try:
      self.scheduler.submit(jobs)
    except sched.QueueFull as e:
      raise api.ApiError(503, f"the server is busy ({e}); retry later", code="queue_full",
                         headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
    except sched.TooLarge as e:
      raise api.ApiError(400, f"{e} (kv_num_pages)", "max_tokens", "context_length_exceeded") from None

  async def events(self, jobs: list[sched.Job], queue: asyncio.Queue[list[sched.Event]],
                   is_disconnected: Callable[[], Awaitable[bool]], route: str = ""
                   ) -> AsyncGenerator[list[sched.Event], None]:
    """The jobs' events, in the lists they arrived in, until each is done; every unfinished job is
    cancelled when the consumer stops early (client gone, deadline) or the deadline passes (504). The first token or prompt
    score is timed for /metrics under `route`."""
    timeout = self.decode_cfg.serve_request_timeout_seconds
    deadline = time.monotonic() + timeout
    remaining, first = len(jobs), True
    # A tick (an empty list) on the queue at most every second wakes the loop below to check the deadline
    # and the client: one timer per second, not a timed wait per list of events.
    loop = asyncio.get_running_loop()
    ticking: list[asyncio.TimerHandle] = []

    def tick() -> None:
      queue.put_nowait([])
      ticking[0] = loop.call_later(min(1.0, max(deadline - time.monotonic(), 0.001)), tick)

    ticking.append(loop.call_later(min(1.0, timeout), tick))
    try:
      while remaining:
        if time.monotonic() >= deadline:
          raise api.ApiError(504, f"the request took longer than serve_request_timeout_seconds={timeout}",
                             code="timeout")
        events = await queue.get()
        if not events:
          if await is_disconnected():
            return
          continue
        done = sum(isinstance(event, sched.Done) for event in events)
        remaining -= done
        if first and done < len(events):
          first = False
          self.metrics.observe_first_token(route, jobs[0].submitted)
        yield events
    finally:
      ticking[0].cancel()
      for job in jobs:
        job.cancel()


def _error(e: api.ApiError) -> Any:
  from fastapi.responses import JSONResponse

  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj: object) -> str:
  return f"data: {json.dumps(obj)}\n\n"


def build_app(server: Server, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> Any:
  """The FastAPI app; `api_key` (else MAXTEXT_API_KEY) guards every route but OPEN_ROUTES."""
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse
  from starlette.exceptions import HTTPException as StarletteHTTPException

  from MaxText.inference.serve_routes import SseResponse, add_routes

  key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
  app = FastAPI(title="MaxText", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    return _error(api.ApiError(e.status_code, str(e.detail)))

  @app.exception_handler(api.ApiError)
  async def api_error(_: Request, e: api.ApiError) -> JSONResponse:
    return _error(e)

  add_routes(app, server, JSONResponse, SseResponse, _sse)
  if server.adapters is not None:
    from MaxText.inference import lora_routes

    lora_routes.add_routes(app, server.adapters, admin_allowed=bool(key))
  return _Guard(app, key, max_body_bytes, server.metrics)


def bearer_token(authorization: str) -> str:
  """The credentials of an `Authorization: Bearer <token>` header ("" for any other scheme): the
  scheme is case-insensitive (RFC 7235) and may be followed by several spaces."""
  scheme, _, token = authorization.strip().partition(" ")
  return token.strip() if scheme.lower() == "bearer" else ""


class _Guard:
  """ASGI middleware in front of the app: the API key, then the body-size limit (the body is read
  here, at most max_body_bytes + 1 of it, and replayed to the app); every answer is counted and
  timed for /metrics."""

  def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: serve_metrics.ServeMetrics):
    self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

  async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                     send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    start, status = time.monotonic(), "disconnected"  # what is counted when no answer starts

    async def counted_send(message: dict[str, Any]) -> None:
      nonlocal status
      if message["type"] == "http.response.start":
        status = str(message["status"])
      await send(message)

    try:
      await self._guarded(scope, receive, counted_send)
    except Exception:  # not a cancellation (a client gone): that stays "disconnected"
      if status == "disconnected":
        status = "500"  # uvicorn answers an exception that escapes the app with a 500
      raise
    finally:
      self.metrics.observe_request(scope["path"], status, time.monotonic() - start)
    return None

  async def _guarded(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                     send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    if self.api_key and scope["path"] not in OPEN_ROUTES:
      headers = dict(scope["headers"])
      token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
      if not hmac.compare_digest(token.encode("latin-1"), self.api_key.encode()):
        return await _send_error(send, api.ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                                    code="invalid_api_key"))
    body, more = b"", True
    while more:
      message = await receive()
      if message["type"] == "http.disconnect":
        return None
      body += message.get("body", b"")
      more = message.get("more_body", False)
      if len(body) > self.max_body_bytes:
        return await _send_error(send, api.ApiError(413, f"the request body is larger than {self.max_body_bytes} "
                                                    "bytes (serve_max_body_bytes)", code="body_too_large"))
    replayed = False

    async def replay() -> dict[str, Any]:
      nonlocal replayed
      if not replayed:
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}
      return await receive()  # after the body: the client's disconnect

    return await self.app(scope, replay, send)


async def _send_error(send: Callable[[dict[str, Any]], Awaitable[None]], e: api.ApiError) -> None:
  payload = json.dumps(e.body()).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
  if e.status == 401:
    headers.append((b"www-authenticate", b"Bearer"))
  await send({"type": "http.response.start", "status": e.status, "headers": headers})
  await send({"type": "http.response.body", "body": payload})



def build_server(config: config_lib.Config, mesh: Mesh | None = None) -> Server:
  """Tokenizer, engine and parameters (load_parameters_path, else random ones; with
  speculative_tokens > 0 the draft's too), scheduler thread."""
  codec, eos_id = _codec(config)
  fresh = "serve: no load_parameters_path given; serving randomly initialised parameters"
  d = config.decode
  if d.serve_lora_adapters or d.serve_lora_slots:  # LoRA adapters beside the model, in adapter tables
    table_engine, adapters = lora_adapters.load_engine(config, d.serve_max_slots, fresh, d.serve_model_name or
                                                       config["model_name"], mesh)
    if d.speculative_tokens:  # the draft (a named model, or the base's MTP heads on the adapted hidden states)
      # proposes without adapters; the target verifies with each slot's
      rounds, draft_params = speculative_engine.with_draft(config, table_engine)
      return Server(config, rounds, (adapters.params, draft_params), codec, eos_id, adapters)
    return Server(config, table_engine, adapters.params, codec, eos_id, adapters)
  engine, params = speculative_engine.load(config, d.serve_max_slots, fresh, mesh)
  return Server(config, engine, params, codec, eos_id)


def listen(host: str, port: int) -> socket.socket:
  """The server's socket, bound and listening before the model loads: a port another program holds
  stops the server at once (a client polling that port would otherwise get the other program's
  answers), and port=0 takes a free one, which the start-up line names."""
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse a port in TIME_WAIT
  try:
    sock.bind((host, port))
    sock.listen(2048)
  except OSError as e:
    sock.close()
    raise UserError(f"serve: cannot listen on {host}:{port} ({e.strerror or e}): choose another port=, or port=0 "
                    "for any free one (the start-up line names it)") from None
  return sock


def address(host: str, sock: socket.socket) -> str:
  """The base URL of a listening socket (its real port, also when port=0 chose it)."""
  port = sock.getsockname()[1]
  return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


TOOL = startup.Tool("serve", reads_run=True, joins_job=True, reads_data=False)


def main(argv: list[str]) -> int:
  import uvicorn

  config = startup.start(TOOL, argv).config
  d = config.decode
  sock = listen(d.host, d.port)
  server = build_server(config)
  app = build_app(server, max_body_bytes=d.serve_max_body_bytes)
  # What serving needs lives as long as the process: kept out of the collector's full passes, each of
  # which would otherwise stop every stream for as long as it takes to scan it all.
  gc.freeze()
  if d.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(API_KEY_ENV):
    distributed.log(f"serve: warning: binding {d.host} with no {API_KEY_ENV}: anyone who reaches it can use the model")
  distributed.log(f"serve: model {server.limits.model_name!r} on {address(d.host, sock)}/v1 "
              f"({d.serve_max_slots} slots, {d.serve_max_queue} waiting at most)")
  uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
  server.scheduler.stop()
  return 0


if __name__ == "__main__":
  run_cli(main)
