"""The server's HTTP side, without JAX: the FastAPI app (serve_routes.py's routes behind the API key
and body-size guard) and `HttpServer`, what those routes ask of a server: the codec, the limits, the
metrics, and a request's jobs and their events with the deadline and the client's disconnect watched;
`run` / `serve`: uvicorn with the drain of the requests open when it is told to stop.
`serve.Server` is one in the engine's process (its scheduler thread beside the event loop);
`serve_frontend.FrontendServer` is one in an HTTP front-end process, whose jobs live in the engine's.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import time
import weakref
from typing import Any, AsyncGenerator, Awaitable, Callable, Sequence

import orjson

from MaxText.inference import job_events, lora_admin
from MaxText.inference import openai_api as api
from MaxText.inference import serve_metrics

API_KEY_ENV = "MAXTEXT_API_KEY"  # an environment variable, never a config key: configs are saved with runs
RETRY_AFTER_SECONDS = "1"
READ_TIMEOUT_SECONDS = 60.0  # serve_read_timeout_seconds' default, for apps built without a config
OPEN_ROUTES = ("/health", "/metrics")  # no API key needed: probes and scrapers; figures only
# A server told to stop (SIGTERM, SIGINT) lets its open requests run this long, then ends each with an error (`serve`):
# uvicorn's graceful stop waits for them with no limit, and a front end is killed by the engine's process
# (serve_processes._STOP_SECONDS) mid-answer, an "incomplete chunked read" for its client.
DRAIN_SECONDS = 5.0
STOPPING = "the server is stopping"


def refusal(e: job_events.QueueFull | job_events.TooLarge) -> api.ApiError:
  """The HTTP answer to the scheduler refusing a request's jobs."""
  if isinstance(e, job_events.QueueFull):
    return api.ApiError(503, f"the server is busy ({e}); retry later", code="queue_full",
                        headers={"Retry-After": RETRY_AFTER_SECONDS})
  return api.ApiError(400, f"{e} (kv_num_pages)", "max_tokens", "context_length_exceeded")


def adapter_of(request: api.Request, limits: api.Limits, score_prompt: bool) -> str | None:
  """The LoRA adapter a request names by `model` (None: the base model); echo with logprobs scores the
  prompt under the base model only (a 400 with an adapter)."""
  if request.model in ("", limits.model_name):
    return None
  if score_prompt:
    raise api.ApiError(400, "echo with logprobs scores the prompt under the base model only; not with a LoRA "
                       "adapter", "echo", "unsupported_parameter")
  return request.model


def gone(message: str = STOPPING) -> api.ApiError:
  """The answer to a request the server can no longer serve (it is stopping, or a front end's engine is gone): the
  code /health answers then."""
  return api.ApiError(503, message, code="engine_gone")


def unknown_adapter(name: str) -> api.ApiError:
  """The answer to a request whose adapter was removed after the request was read."""
  return api.ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found")


class _Open:
  """A request whose events are being read: `ended` (end_open's message) ends it at its reader's next wake-up."""

  __slots__ = ("queue", "ended", "__weakref__")

  def __init__(self, queue: asyncio.Queue[list[job_events.Event]], ended: str | None):
    self.queue, self.ended = queue, ended


class HttpServer:
  """What the routes need of a server; `submit` (and `admit`, its form the routes await) is the
  subclass's. `adapters` is the LoRA adapter registry whose admin routes the app adds (None: none)."""

  adapters: Any = None

  def __init__(self, codec: api.Codec, limits: api.Limits, metrics: serve_metrics.ServeMetrics):
    self.codec, self.limits, self.metrics = codec, limits, metrics
    self._token_text: dict[int, str] = {}
    self.stopping: str | None = None  # end_open's message: new requests get a 503
    # Weak: a reader (events' generator) that never ran, its client gone first, leaves nothing behind.
    self._open: weakref.WeakSet[_Open] = weakref.WeakSet()

  def adapter_admin(self) -> lora_admin.Admin | None:
    """What the LoRA admin routes reach the adapters through (None: no adapters served)."""
    return None if self.adapters is None else lora_admin.LocalAdmin(self.adapters)

  @property
  def request_timeout_seconds(self) -> float:
    """serve_request_timeout_seconds."""
    raise NotImplementedError

  def token_text(self, token: int) -> str:
    """One token decoded alone (cached): the text a top alternative is cut from; not how a token reads in a text."""
    if token not in self._token_text:
      self._token_text[token] = self.codec.decode([token])
    return self._token_text[token]

  async def admit(self, request: api.Request, score_prompt: bool
                  ) -> tuple[Sequence[job_events.JobHandle], asyncio.Queue[list[job_events.Event]]]:
    """Queues the request's choices as jobs whose events arrive on the returned queue, in lists
    (an ApiError: 503 when full, 400 when a choice needs more KV pages than the whole pool)."""
    raise NotImplementedError

  async def refresh(self) -> None:
    """Brings the scheduler's figures /health and /metrics read up to date (they are read in place
    where the scheduler lives in this process)."""

  def check_serving(self) -> None:
    """A 503 engine_gone once end_open has run (the server is stopping): what admit says to a new request."""
    if self.stopping is not None:
      raise gone(self.stopping)

  def end_open(self, message: str) -> None:
    """Ends every request whose events are being read: an unstreamed one is a 503 engine_gone (`message`), a stream
    sends that error event, then [DONE]; their unfinished jobs are cancelled. Later requests get the same 503."""
    self.stopping = message
    for request in list(self._open):
      request.ended = message
      request.queue.put_nowait([])  # wakes its reader

  def events(self, jobs: Sequence[job_events.JobHandle], queue: asyncio.Queue[list[job_events.Event]],
             is_disconnected: Callable[[], Awaitable[bool]], route: str = ""
             ) -> AsyncGenerator[list[job_events.Event], None]:
    """The jobs' events, in the lists they arrived in, until each is done; every unfinished job is
    cancelled when the consumer stops early (client gone, deadline) or the deadline passes (504), or end_open ends
    the request (503). The deadline is serve_request_timeout_seconds from the jobs' submission: in a front end, the
    wait for the engine's admission counts too. The first token or prompt score is timed for /metrics under `route`."""
    # Registered now, not when the generator first runs: end_open reaches a request admitted but not yet read.
    request = _Open(queue, self.stopping)
    self._open.add(request)
    return self._events(request, jobs, is_disconnected, route)

  async def _events(self, request: _Open, jobs: Sequence[job_events.JobHandle],
                    is_disconnected: Callable[[], Awaitable[bool]], route: str
                    ) -> AsyncGenerator[list[job_events.Event], None]:
    queue, timeout = request.queue, self.request_timeout_seconds
    deadline = min(job.submitted for job in jobs) + timeout
    remaining, first = len(jobs), True
    # A tick (an empty list) on the queue at most every second wakes the loop below to check the deadline
    # and the client: one timer per second, not a timed wait per list of events.
    loop = asyncio.get_running_loop()
    ticking: list[asyncio.TimerHandle] = []

    def tick() -> None:
      queue.put_nowait([])
      ticking[0] = loop.call_later(min(1.0, max(deadline - time.monotonic(), 0.001)), tick)

    ticking.append(loop.call_later(min(1.0, max(deadline - time.monotonic(), 0.001)), tick))
    try:
      while remaining:
        if request.ended is not None:
          raise gone(request.ended)
        if time.monotonic() >= deadline:
          raise api.ApiError(504, f"the request took longer than serve_request_timeout_seconds={timeout}",
                             code="timeout")
        events = await queue.get()
        if not events:
          if await is_disconnected():
            return
          continue
        done = sum(isinstance(event, job_events.Done) for event in events)
        remaining -= done
        if first and done < len(events):
          first = False
          self.metrics.observe_first_token(route, jobs[0].submitted)
        yield events
    finally:
      ticking[0].cancel()
      self._open.discard(request)
      for job in jobs:
        job.cancel()


def run(uv: Any, server: HttpServer, sockets: list[socket.socket]) -> None:
  """`uv` (a uvicorn.Server of `server`'s app) on `sockets` until it is told to stop, under `serve`'s drain, on
  the event loop uvicorn's config picks: what uv.run does, with the drain."""
  with asyncio.Runner(loop_factory=uv.config.get_loop_factory()) as runner:
    runner.run(serve(uv, server, sockets))


async def serve(uv: Any, server: HttpServer, sockets: list[socket.socket]) -> None:
  """uv.serve(sockets); once told to stop (SIGTERM, SIGINT: uv.should_exit) the requests still open get DRAIN_SECONDS,
  then server.end_open ends each with an error (a stream's error event, then [DONE]), so uvicorn's graceful stop,
  which waits for them, ends."""
  async def drain() -> None:
    while not uv.should_exit:
      await asyncio.sleep(0.1)
    await asyncio.sleep(DRAIN_SECONDS)
    server.end_open(STOPPING)

  draining = asyncio.create_task(drain())
  try:
    await uv.serve(sockets=sockets)
  finally:
    draining.cancel()


def error_response(e: api.ApiError) -> Any:
  from fastapi.responses import JSONResponse

  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def sse(obj: object) -> str:
  """One server-sent event. orjson writes a chunk several times faster than json (the JSON of each chunk is a
  large share of a stream's time on the event loop); a value orjson refuses (a lone surrogate in a text) goes
  through json."""
  try:
    return f"data: {orjson.dumps(obj).decode()}\n\n"
  except TypeError:  # orjson.JSONEncodeError
    return f"data: {json.dumps(obj)}\n\n"


def build_app(server: HttpServer, api_key: str | None = None, max_body_bytes: int = 1 << 20,
              read_timeout_seconds: float = READ_TIMEOUT_SECONDS) -> Any:
  """The FastAPI app; `api_key` (else MAXTEXT_API_KEY) guards every route but OPEN_ROUTES; a body not
  received within read_timeout_seconds of the request's head is a 408 (serve_read_timeout_seconds)."""
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse
  from starlette.exceptions import HTTPException as StarletteHTTPException

  from MaxText.inference.serve_routes import SseResponse, add_routes

  key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
  app = FastAPI(title="MaxText", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(api.ApiError(e.status_code, str(e.detail)))

  @app.exception_handler(api.ApiError)
  async def api_error(_: Request, e: api.ApiError) -> JSONResponse:
    return error_response(e)

  posts = add_routes(app, server, JSONResponse, SseResponse, sse)
  from MaxText.inference import lora_routes

  admin = server.adapter_admin()
  if admin is not None:
    lora_routes.add_routes(app, admin, admin_allowed=bool(key))
  else:
    lora_routes.add_absent_routes(app)
  return _Guard(app, key, max_body_bytes, server.metrics, posts, read_timeout_seconds)


def bearer_token(authorization: str) -> str:
  """The credentials of an `Authorization: Bearer <token>` header ("" for any other scheme): the
  scheme is case-insensitive (RFC 7235) and may be followed by several spaces."""
  scheme, _, token = authorization.strip().partition(" ")
  return token.strip() if scheme.lower() == "bearer" else ""


def read_timeout(seconds: float, what: str) -> api.ApiError:
  """The 408 of a request whose `what` (head or body) did not arrive in time; the connection is closed after it."""
  return api.ApiError(408, f"the request {what} did not arrive within serve_read_timeout_seconds={seconds:g}",
                      code="request_timeout", headers={"connection": "close"})


def uvicorn_config(app: Any, read_timeout_seconds: float, **kwargs: Any) -> Any:
  """uvicorn's Config for the server's `app` (kwargs: host, port, ...), whose HTTP protocol gives a request's head
  read_timeout_seconds from the connection's start (or the next request's first byte) to arrive, else a 408 and
  the connection closed. uvicorn bounds only the wait between a keep-alive connection's requests
  (timeout_keep_alive), which a client's first byte ends: without this, a client sending a head a few bytes a
  minute holds its connection for ever. Such a 408 is counted in the metrics of `app` (a _Guard, as build_app
  makes) as _Guard counts every answer, by the route its head named so far ("other" when none)."""
  import uvicorn

  metrics = app.metrics if isinstance(app, _Guard) else None
  return uvicorn.Config(app, http=_head_timeout_protocol(read_timeout_seconds, metrics), log_level="warning", **kwargs)


def _head_timeout_protocol(seconds: float, metrics: serve_metrics.ServeMetrics | None = None) -> type[Any] | str:
  """uvicorn's httptools protocol (its parser, which requirements.txt installs) with a head deadline, its 408s
  counted in `metrics`; without httptools, uvicorn's own choice (h11), whose heads are not bounded here (bodies
  still are, by _Guard)."""
  try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
  except ImportError:
    return "auto"

  error = read_timeout(seconds, "head")
  payload = json.dumps(error.body()).encode()
  answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)

  class HeadDeadline(HttpToolsProtocol):
    _head_timer: asyncio.TimerHandle | None = None
    _head_since = 0.0

    def connection_made(self, transport: Any) -> None:
      super().connection_made(transport)
      self._arm()

    def on_message_begin(self) -> None:
      super().on_message_begin()
      if self._head_timer is None:  # the next request on a kept-alive connection: its own deadline
        self._arm()

    def on_headers_complete(self) -> None:
      self._disarm()  # the body's deadline is the app's (_Guard)
      super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
      self._disarm()
      super().connection_lost(exc)

    def _arm(self, since: float | None = None) -> None:
      self._disarm()
      self._head_since = time.monotonic() if since is None else since
      self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

    def _disarm(self) -> None:
      if self._head_timer is not None:
        self._head_timer.cancel()
        self._head_timer = None

    def _head_timed_out(self) -> None:
      self._head_timer = None
      if self.transport.is_closing():
        return
      if self.cycle is not None and not self.cycle.response_complete:
        # A pipelined head, behind an answer still being sent (a stream may outlast the deadline): that answer
        # is not cut; the head is timed out once it has gone.
        self._arm(self._head_since)
        return
      self.transport.write(answer)
      self.transport.close()
      if metrics is not None:
        # uvicorn's parser gathers the request line's target in self.url, from b"" at a request's first byte
        # (absent before any); a part of a route's path counts as "other", as any unknown path.
        url = getattr(self, "url", b"")
        path = url.split(b"?", 1)[0].decode("latin-1") if isinstance(url, bytes) else ""
        metrics.observe_request(path, "408", time.monotonic() - self._head_since)

  return HeadDeadline


class _Guard:
  """ASGI middleware in front of the app: the API key, then the body-size limit and read deadline (the body is
  read here, at most max_body_bytes + 1 of it, within read_timeout_seconds, and replayed to the app); every answer is counted and
  timed for /metrics. A POST to one of `posts`' paths is answered here by its route function, as
  the app would (an ApiError as its JSON error, a dict as JSON), without the app's routing and middleware."""

  def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: serve_metrics.ServeMetrics,
               posts: dict[str, Any] | None = None, read_timeout_seconds: float = READ_TIMEOUT_SECONDS):
    self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics
    self.posts = posts or {}
    self.read_timeout_seconds = read_timeout_seconds

  async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                     send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    start, status, counted = time.monotonic(), "disconnected", False  # status: counted when no answer starts

    def count() -> None:
      nonlocal counted
      if not counted:
        counted = True
        self.metrics.observe_request(scope["path"], status, time.monotonic() - start)

    async def counted_send(message: dict[str, Any]) -> None:
      nonlocal status
      if message["type"] == "http.response.start":
        status = str(message["status"])
      elif message["type"] == "http.response.body" and not message.get("more_body", False):
        # counted (and, by a front end, sent to the others) before the client can have the answer, so a
        # scrape it makes next, through any front end, counts this request
        count()
      await send(message)

    try:
      await self._guarded(scope, receive, counted_send)
    except Exception:  # not a cancellation (a client gone): that stays "disconnected"
      if status == "disconnected":
        status = "500"  # uvicorn answers an exception that escapes the app with a 500
      raise
    finally:
      count()
    return None

  async def _guarded(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                     send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    if self.api_key and scope["path"] not in OPEN_ROUTES:
      headers = dict(scope["headers"])
      token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
      if not hmac.compare_digest(token.encode("latin-1"), self.api_key.encode()):
        return await _send_error(send, api.ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                                    code="invalid_api_key"))
    for name, value in scope["headers"]:  # a body declared too large is refused before it is read (or waited for)
      if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
        return await _send_error(send, api.ApiError(413, f"the request body is larger than {self.max_body_bytes} "
                                                    "bytes (serve_max_body_bytes)", code="body_too_large"))
      # A compressed body read as JSON was a 400 about an undecodable byte (RFC 7694: 415 names the coding).
      if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
        return await _send_error(send, api.ApiError(
            415, f"the request body has Content-Encoding: {value.decode('latin-1').strip()}; this server reads "
            "uncompressed bodies only: send it without Content-Encoding", code="unsupported_content_encoding",
            headers={"Accept-Encoding": "identity"}))
    body, more, refused = b"", True, None
    try:
      # A client sending its body a few bytes a minute would hold this task and its connection for ever.
      async with asyncio.timeout(self.read_timeout_seconds):
        while more:
          message = await receive()
          if message["type"] == "http.disconnect":
            return None
          body += message.get("body", b"")
          more = message.get("more_body", False)
          if len(body) > self.max_body_bytes:
            refused = api.ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                                   "(serve_max_body_bytes)", code="body_too_large")
            break
    except TimeoutError:
      refused = read_timeout(self.read_timeout_seconds, "body")
    if refused is not None:
      return await _send_error(send, refused)
    replayed = False

    async def replay() -> dict[str, Any]:
      nonlocal replayed
      if not replayed:
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}
      return await receive()  # after the body: the client's disconnect

    handler = self.posts.get(scope["path"]) if scope["method"] == "POST" and not scope.get("root_path") else None
    if handler is not None:
      return await _answer(handler, scope, replay, send)
    return await self.app(scope, replay, send)


async def _answer(handler: Callable[[Any], Awaitable[Any]], scope: dict[str, Any],
                  receive: Callable[[], Awaitable[dict[str, Any]]], send: Callable[[dict[str, Any]], Awaitable[None]]
                  ) -> None:
  """What the app answers a POST to `handler`'s route: its Response, or its dict as JSON (FastAPI's
  encoding), or an ApiError's JSON error. Any other exception reaches uvicorn, which answers 500."""
  from fastapi.encoders import jsonable_encoder
  from fastapi.responses import JSONResponse, Response
  from starlette.requests import Request

  try:
    result = await handler(Request(scope, receive))
  except api.ApiError as e:
    response = error_response(e)
  else:
    response = result if isinstance(result, Response) else JSONResponse(jsonable_encoder(result))
  await response(scope, receive, send)


async def _send_error(send: Callable[[dict[str, Any]], Awaitable[None]], e: api.ApiError) -> None:
  payload = json.dumps(e.body()).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
  if e.status == 401:
    headers.append((b"www-authenticate", b"Bearer"))
  headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in e.headers.items()]
  await send({"type": "http.response.start", "status": e.status, "headers": headers})
  await send({"type": "http.response.body", "body": payload})
