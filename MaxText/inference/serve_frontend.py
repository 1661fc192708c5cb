"""An HTTP front-end process of the server (serve_http_processes >= 1; the engine's side is
serve_processes.py): the FastAPI app under uvicorn on the listening socket the engine's process bound,
parsing and validating requests, tokenising prompts, detokenising and streaming, without JAX. Its
`FrontendServer` stands in for serve.Server: a request's jobs live in the engine's process, reached
over one Unix socket to it:

    front end ── ("submit", request id, choices, grammar, logprobs, adapter) ──► engine: sched.Jobs, submit
              ◄── [("admit", id, refusal), ("event", id, event), ...] ── one message per flush of events
              ── ("cancel", id, index) / ("load",) ──►          ◄── [("load", scheduler.load())]
              ── ("observe", [metrics observations]) ──►   ◄── [("observe", [...])] to every other front end
              ── ("adapters", ask id, "add" | "remove" | "list", args) ──►
              ◄── [("adapter_names", names)] to every front end, then [("adapters", ask id, answer)]

Messages are pickled, each after its length (4 bytes). The process ends when the engine's does (the
socket's end of file): its requests end with an error and uvicorn stops. Told to stop (SIGTERM from the engine's
process), it drains its open requests as the one-process server does (serve_app.serve).

    python3 -m MaxText.inference.serve_frontend LISTEN_FD CHANNEL_FD INDEX   (started by serve_processes)
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Sequence

from MaxText.errors import UserError
from MaxText.inference import job_events, lora_admin, serve_app, serve_codec, serve_metrics
from MaxText.inference import openai_api as api

_LENGTH_BYTES = 4
_LOAD_SECONDS = 10.0  # the most /health and /metrics wait for the engine's figures


@dataclasses.dataclass(frozen=True)
class FrontSpec:
  """What a front end needs of the engine's config (the first message on its channel)."""
  codec: serve_codec.CodecSpec
  limits: api.Limits
  request_timeout_seconds: float
  max_body_bytes: int
  index: int = 0
  adapter_names: tuple[str, ...] | None = None  # the LoRA adapters loaded at start (None: none served)
  front_ends: int = 1  # how many front ends serve the socket (more than 1: their /metrics counts are shared)
  read_timeout_seconds: float = 60.0  # serve_read_timeout_seconds


def frame(message: Any) -> bytes:
  data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  return len(data).to_bytes(_LENGTH_BYTES, "big") + data


def read_frame(sock: socket.socket) -> Any:
  """The next message on a blocking socket; EOFError at its end."""
  return pickle.loads(read_payload(sock))


def read_payload(sock: socket.socket) -> bytes:
  """The next message's pickled bytes (the framing survives a message that does not unpickle)."""
  length = int.from_bytes(_read_exactly(sock, _LENGTH_BYTES), "big")
  return _read_exactly(sock, length)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
  data = bytearray()
  while len(data) < n:
    chunk = sock.recv(n - len(data))
    if not chunk:
      raise EOFError("the other process closed the channel")
    data += chunk
  return bytes(data)


class RemoteJob:
  """A job in the engine's process, as the routes hold it (job_events.JobHandle)."""

  def __init__(self, link: FrontendServer, request_id: int, index: int):
    self.link, self.request_id, self.index = link, request_id, index
    self.submitted = time.monotonic()
    self.finished = False  # its Done arrived (or it was cancelled): nothing more to send

  def cancel(self) -> None:
    if not self.finished:
      self.finished = True
      self.link.send(("cancel", self.request_id, self.index))


class RemoteAdmin(lora_admin.Admin):
  """The engine's LoRA adapter registry, asked over the channel; its name list as last sent here."""

  def __init__(self, link: FrontendServer, names: tuple[str, ...]):
    self.link, self.base_name, self.known = link, link.limits.model_name, names
    self._asks: dict[int, asyncio.Future[Any]] = {}
    self._next_id = 0

  def names(self) -> tuple[str, ...]:
    return self.known

  async def _ask(self, op: str, *args: str) -> Any:
    if self.link.engine_gone.is_set():
      raise serve_app.gone()
    ask_id, self._next_id = self._next_id, self._next_id + 1
    self._asks[ask_id] = asyncio.get_running_loop().create_future()
    self.link.send(("adapters", ask_id, op, args))
    try:
      answer = await self._asks[ask_id]
    finally:
      del self._asks[ask_id]
    if isinstance(answer, (UserError, lora_admin.UnknownAdapter, lora_admin.AdapterBusy, api.ApiError)):
      raise answer
    if isinstance(answer, Exception):
      raise api.ApiError(500, f"the LoRA adapter change failed in the engine's process: {answer}",
                         code="adapter_failed")
    return answer

  async def adapters(self) -> list[lora_admin.LoadedAdapter]:
    answer: list[lora_admin.LoadedAdapter] = await self._ask("list")
    return answer

  async def add(self, name: str, path: str) -> lora_admin.LoadedAdapter:
    answer: lora_admin.LoadedAdapter = await self._ask("add", name, path)
    return answer

  async def remove(self, name: str) -> lora_admin.LoadedAdapter:
    answer: lora_admin.LoadedAdapter = await self._ask("remove", name)
    return answer

  def answer(self, ask_id: int, answer: Any) -> None:
    asking = self._asks.get(ask_id)
    if asking is not None and not asking.done():
      asking.set_result(answer)

  def engine_gone(self) -> None:
    for asking in self._asks.values():
      if not asking.done():
        asking.set_result(serve_app.gone())


@dataclasses.dataclass
class _Request:
  jobs: list[RemoteJob]
  queue: asyncio.Queue[list[job_events.Event]]
  admitted: asyncio.Future[tuple[str, str] | None]
  open: int  # jobs without their Done yet


class FrontendServer(serve_app.HttpServer):
  """serve_app.HttpServer whose jobs run in the engine's process, reached over `channel`."""

  def __init__(self, spec: FrontSpec, codec: api.Codec):
    self._load: dict[str, Any] = {}
    self.spec = spec
    super().__init__(codec, spec.limits, serve_metrics.ServeMetrics(lambda: self._load))
    self._requests: dict[int, _Request] = {}
    self._next_id = 0
    self._writer: asyncio.StreamWriter | None = None
    self._loading: asyncio.Future[None] | None = None
    self.engine_gone = asyncio.Event()
    self._admin: RemoteAdmin | None = None
    self._observed: list[serve_metrics.Observation] = []  # this loop turn's, not sent yet

  def share_metrics(self) -> None:
    """Sends this front end's request counts and latencies to the engine's process, which passes them
    to the other front ends; theirs come back the same way (`_deliver`), so /metrics on any front end
    shows the whole server's. The engine's process only forwards them: its own counts stay unused."""
    self.metrics.share = self._share

  def _share(self, observation: serve_metrics.Observation) -> None:
    if not self._observed and observation[0] != "request":  # this loop turn's go as one message
      asyncio.get_running_loop().call_soon(self._send_observed)
    self._observed.append(observation)
    if observation[0] == "request":  # now, not next turn: it is counted as its answer goes out (serve_app._Guard)
      self._send_observed()

  def _send_observed(self) -> None:
    observed, self._observed = self._observed, []
    if observed:
      self.send(("observe", observed))

  def serve_adapters(self, names: tuple[str, ...]) -> None:
    """Serves the engine's LoRA adapters (`names` loaded at start): requests by `model`, the admin
    routes, /v1/models; before build_app."""
    self._admin = RemoteAdmin(self, names)
    admin = self._admin
    self.limits = dataclasses.replace(self.limits, adapter_names=lambda: admin.known)

  def adapter_admin(self) -> lora_admin.Admin | None:
    return self._admin

  @property
  def request_timeout_seconds(self) -> float:
    return self.spec.request_timeout_seconds

  def send(self, message: Any) -> None:
    if self._writer is not None and not self.engine_gone.is_set():
      self._writer.write(frame(message))

  async def admit(self, request: api.Request, score_prompt: bool
                  ) -> tuple[Sequence[job_events.JobHandle], asyncio.Queue[list[job_events.Event]]]:
    self.check_serving()
    adapter = None if self._admin is None else serve_app.adapter_of(request, self.limits, score_prompt)
    request_id, self._next_id = self._next_id, self._next_id + 1
    jobs = [RemoteJob(self, request_id, c.index) for c in request.choices]
    pending = _Request(jobs, asyncio.Queue(), asyncio.get_running_loop().create_future(), len(jobs))
    self._requests[request_id] = pending
    choices = [(c.index, c.prompt, c.max_tokens, c.row, c.images) for c in request.choices]
    self.send(("submit", request_id, choices, score_prompt, None if request.grammar is None else request.grammar.text,
               bool(request.logprobs), adapter))
    try:  # an answer that never comes (a submit lost in the engine's process) is the request's deadline
      refused = await asyncio.wait_for(asyncio.shield(pending.admitted), self.request_timeout_seconds)
    except (asyncio.CancelledError, asyncio.TimeoutError) as e:  # or the client went away meanwhile
      for job in jobs:
        job.cancel()
      self._requests.pop(request_id, None)
      if isinstance(e, asyncio.TimeoutError):
        raise api.ApiError(504, "the engine's process did not admit the request within "
                           f"serve_request_timeout_seconds={self.request_timeout_seconds}", code="timeout") from None
      raise
    if refused is not None:
      kind, message = refused
      if kind == "error":
        raise api.ApiError(500, f"generation failed: {message}", code="generation_failed")
      if kind == "gone":
        raise serve_app.gone(message)
      if kind == "unknown":  # removed since the request was read here
        raise serve_app.unknown_adapter(message)
      raise serve_app.refusal(job_events.QueueFull(message) if kind == "full" else job_events.TooLarge(message))
    return jobs, pending.queue

  async def refresh(self) -> None:
    """The scheduler's figures, asked of the engine's process (one question for every caller waiting)."""
    if self.engine_gone.is_set():
      raise serve_app.gone()
    if self._loading is None:
      self._loading = asyncio.get_running_loop().create_future()
      self.send(("load",))
    loading = self._loading
    try:
      await asyncio.wait_for(asyncio.shield(loading), _LOAD_SECONDS)
    except asyncio.TimeoutError:  # a question lost or held up there: the next caller asks again
      if self._loading is loading:
        self._loading = None
      raise api.ApiError(503, f"the engine's process did not answer for its load figures within {_LOAD_SECONDS} s",
                         code="engine_busy") from None
    if self.engine_gone.is_set():  # the question was ended by the engine's going, not answered: no figures
      raise serve_app.gone()

  async def read(self, reader: asyncio.StreamReader) -> None:
    """Delivers the engine's messages until its end of file: each message's events go to each
    request's queue as one list (one wake-up of its stream per message)."""
    try:
      while True:
        length = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
        self._deliver(pickle.loads(await reader.readexactly(length)))
    except (asyncio.IncompleteReadError, ConnectionError):
      pass
    self._engine_gone()

  def _deliver(self, items: list[tuple[Any, ...]]) -> None:
    batches: dict[int, list[job_events.Event]] = {}
    for item in items:
      if item[0] == "event":
        batches.setdefault(item[1], []).append(item[2])
      elif item[0] == "admit":  # may follow some of the request's events, even its last
        pending = self._requests.get(item[1])
        if pending is not None and not pending.admitted.done():
          pending.admitted.set_result(item[2])
          if pending.open <= 0 or item[2] is not None:
            del self._requests[item[1]]
      elif item[0] == "adapter_names" and self._admin is not None:
        self._admin.known = tuple(item[1])
      elif item[0] == "adapters" and self._admin is not None:
        self._admin.answer(item[1], item[2])
      elif item[0] == "observe":
        self.metrics.apply(item[1])
      elif item[0] == "load":
        self._load = item[1]
        if self._loading is not None:
          self._loading.set_result(None)
          self._loading = None
    for request_id, events in batches.items():
      pending = self._requests.get(request_id)
      if pending is None:
        continue
      for event in events:
        if isinstance(event, job_events.Done):
          pending.jobs[event.index].finished = True
          pending.open -= 1
      if pending.open <= 0 and pending.admitted.done():
        del self._requests[request_id]
      pending.queue.put_nowait(events)

  def _engine_gone(self) -> None:
    """Every request still open ends with an error; new ones get 503 while uvicorn stops."""
    self.engine_gone.set()
    self.end_open("the engine's process is gone")
    if self._admin is not None:
      self._admin.engine_gone()
    if self._loading is not None:
      self._loading.set_result(None)
      self._loading = None

  def end_open(self, message: str) -> None:
    """HttpServer.end_open, and a request still waiting for its admission is the same 503; the jobs are cancelled
    in the engine's process while it is there."""
    for pending in self._requests.values():
      if not pending.admitted.done():
        pending.admitted.set_result(("gone", message))
    self._requests.clear()
    super().end_open(message)

  async def connect(self, channel: socket.socket) -> asyncio.StreamReader:
    reader, self._writer = await asyncio.open_unix_connection(sock=channel)
    return reader


def _log(index: int, message: str) -> None:
  print(f"serve: HTTP front end {index}: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
  import uvicorn

  listen_fd, channel_fd, index = (int(a) for a in argv)
  channel = socket.socket(fileno=channel_fd)
  spec: FrontSpec = read_frame(channel)
  codec, _ = serve_codec.build(spec.codec)  # with images where spec.codec.images says
  server = FrontendServer(spec, codec)
  if spec.adapter_names is not None:
    server.serve_adapters(spec.adapter_names)
  if spec.front_ends > 1:
    server.share_metrics()
  app = serve_app.build_app(server, max_body_bytes=spec.max_body_bytes, read_timeout_seconds=spec.read_timeout_seconds)
  uv_config = serve_app.uvicorn_config(app, spec.read_timeout_seconds)
  uv = uvicorn.Server(uv_config)
  gc.freeze()  # as serve.main: what serving needs lives as long as the process

  async def serve() -> None:
    reader = await server.connect(channel)

    async def follow_engine() -> None:
      try:
        await server.read(reader)
      except Exception:  # a bug here would leave every request waiting: stop the process (the engine's stops too)
        traceback.print_exc()
        os._exit(1)
      if not uv.should_exit:
        _log(index, "the engine's process is gone; stopping")
        uv.should_exit = True
        asyncio.get_running_loop().call_later(3.0, lambda: setattr(uv, "force_exit", True))

    following = asyncio.create_task(follow_engine())
    await serve_app.serve(uv, server, [socket.socket(fileno=listen_fd)])  # SIGTERM: the drain
    following.cancel()

  with asyncio.Runner(loop_factory=uv_config.get_loop_factory()) as runner:
    runner.run(serve())
  return 1 if server.engine_gone.is_set() else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
