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
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if __package__ in (None, ""):  # `python3 MaxText/serve.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText.configuration import config as config_lib
from MaxText import startup
from MaxText.platform import distributed
from MaxText.errors import UserError, run_cli
from MaxText.inference import image_chat, job_events, serve_app, serve_codec
from MaxText.inference import openai_api as api
from MaxText.inference import scheduler as sched
from MaxText.inference import lora_adapters, serve_frontend, serve_metrics, serve_processes, speculative_engine
from MaxText.inference.engine_api import DecodeEngine, EngineParams

if TYPE_CHECKING:
  from jax.sharding import Mesh

API_KEY_ENV = serve_app.API_KEY_ENV


def _codec(config: config_lib.Config) -> tuple[api.Codec, int | None]:
  """The tokenizer as the server uses it, and its end-of-sequence id."""
  return serve_codec.build(codec_spec(config), probe_chat=True)


def codec_spec(config: config_lib.Config) -> serve_codec.CodecSpec:
  """What the codec reads of `config`, the same in one process and in each HTTP front end."""
  data, d = config.data, config.decode
  limits = image_chat.ImageLimits(d.serve_max_images, d.serve_max_image_bytes, d.serve_max_image_pixels)
  return serve_codec.CodecSpec(data.tokenizer_type, data.tokenizer_path, data.add_bos, config.model.vocab_size,
                               image_chat.ImageChat.of(config.model, limits))


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


class Server(serve_app.HttpServer):
  """The engine's scheduler and what the routes need to turn requests into jobs and answers."""

  def __init__(self, config: config_lib.Config, engine: DecodeEngine, params: EngineParams,
               codec: api.Codec, eos_id: int | None, adapters: lora_adapters.Registry | None = None):
    d = config.decode
    self.decode_cfg = d
    self.adapters = adapters  # LoRA adapters served beside the model, by name (their admin routes: lora_routes.py)
    self.scheduler = sched.Scheduler(engine, params, d.serve_max_queue, [] if eos_id is None else [eos_id]).start()
    super().__init__(codec, limits(config, adapters), serve_metrics.ServeMetrics(self.scheduler.load))
    if adapters is not None:  # an adapter added or removed: the scheduler's next engine call takes the new tables
      adapters.swap = lambda new: setattr(self.scheduler, "params", _with_target(self.scheduler.params, new))
    self._mailbox: _Mailbox | None = None  # of the event loop that submitted last

  @property
  def request_timeout_seconds(self) -> float:
    return self.decode_cfg.serve_request_timeout_seconds

  async def admit(self, request: api.Request, score_prompt: bool
                  ) -> tuple[list[sched.Job], asyncio.Queue[list[sched.Event]]]:
    self.check_serving()
    return self.submit(request, score_prompt)

  def submit(self, request: api.Request, score_prompt: bool
             ) -> tuple[list[sched.Job], asyncio.Queue[list[sched.Event]]]:
    """Queues the request's choices as jobs whose events arrive on the returned queue, in lists
    (503 when full, 400 when a choice needs more KV pages than the whole pool)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue[list[sched.Event]]()
    mailbox = self._mailbox
    if mailbox is None or mailbox.loop is not loop:
      mailbox = self._mailbox = _Mailbox(loop)
    emit = mailbox.emitter(queue)

    adapter = None if self.adapters is None else serve_app.adapter_of(request, self.limits, score_prompt)
    if adapter is not None:
      return self._submit_to_adapter(request, score_prompt, emit, adapter), queue
    jobs = [sched.Job(c.index, c.prompt, c.max_tokens, c.row, emit, scores, images=c.images,
                      constraint=None if request.grammar is None else request.grammar.constraint(),
                      top_logprobs=bool(request.logprobs))
            for c, scores in zip(request.choices, _scoring(request, score_prompt))]
    self._submit(jobs)
    return jobs, queue

  def _submit_to_adapter(self, request: api.Request, score_prompt: bool, emit: Callable[[sched.Event], None],
                         name: str) -> list[sched.Job]:
    """The jobs of a request naming a LoRA adapter: each decodes with the adapter's table row and holds
    the adapter (it cannot be removed) until its Done event."""
    assert self.adapters is not None
    adapters = self.adapters
    try:
      row, key = adapters.hold(name, len(request.choices))  # the cache key too: it stays until release
    except lora_adapters.UnknownAdapter:  # removed since the request was read
      raise serve_app.unknown_adapter(name) from None
    try:  # held from here: anything that stops the jobs from reaching the scheduler gives the holds back, else the
      # adapter stays "in flight" for ever and DELETE answers 409 until a restart
      jobs = [sched.Job(c.index, c.prompt, c.max_tokens, dataclasses.replace(c.row, adapter=row),
                        adapters.releasing(name, emit), scores, images=c.images,
                        constraint=None if request.grammar is None else request.grammar.constraint(),
                        cache_key=key, top_logprobs=bool(request.logprobs))
              for c, scores in zip(request.choices, _scoring(request, score_prompt))]
      self._submit(jobs)
    except BaseException:
      for _ in request.choices:
        adapters.release(name)
      raise
    return jobs

  def _submit(self, jobs: list[sched.Job]) -> None:
    try:
      self.scheduler.submit(jobs)
    except (sched.QueueFull, sched.TooLarge) as e:
      raise serve_app.refusal(e) from None


def _scoring(request: api.Request, score_prompt: bool) -> list[bool]:
  return job_events.scoring([(c.index, c.prompt) for c in request.choices], score_prompt)


def limits(config: config_lib.Config, adapters: lora_adapters.Registry | None = None) -> api.Limits:
  """What a request may ask of this model and server."""
  d = config.decode
  return api.Limits(d.serve_model_name or config["model_name"], config.model.vocab_size,
                    d.max_prefill_predict_length, config.model.max_target_length, d.serve_max_tokens, d.serve_max_n,
                    config.model.vision.image_token_id if config.model.vision.use_multimodal else None,
                    adapters.names if adapters is not None else tuple)


build_app = serve_app.build_app
_sse = serve_app.sse


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
  if d.serve_http_processes:  # before the model loads
    serve_processes.check_count(d.serve_http_processes)
  sock = listen(d.host, d.port)
  server = build_server(config)
  app: Any = None if d.serve_http_processes else build_app(server, max_body_bytes=d.serve_max_body_bytes,
                                                          read_timeout_seconds=d.serve_read_timeout_seconds)
  # What serving needs lives as long as the process: kept out of the collector's full passes, each of
  # which would otherwise stop every stream for as long as it takes to scan it all.
  gc.freeze()
  if d.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(API_KEY_ENV):
    distributed.log(f"serve: warning: binding {d.host} with no {API_KEY_ENV}: anyone who reaches it can use the model")
  front_ends = f", {d.serve_http_processes} HTTP processes" if d.serve_http_processes else ""
  distributed.log(f"serve: model {server.limits.model_name!r} on {address(d.host, sock)}/v1 "
              f"({d.serve_max_slots} slots, {d.serve_max_queue} waiting at most{front_ends})")
  if d.serve_http_processes:  # HTTP in processes of its own (inference/serve_processes.py)
    # The adapter names travel as a list (FrontSpec.adapter_names), not as the registry's method.
    spec = serve_frontend.FrontSpec(codec_spec(config), dataclasses.replace(server.limits, adapter_names=tuple),
                                    d.serve_request_timeout_seconds, d.serve_max_body_bytes,
                                    read_timeout_seconds=d.serve_read_timeout_seconds)
    code = serve_processes.serve(server.scheduler, server.codec.grammars, sock, spec, d.serve_http_processes,
                                 server.adapters)
  else:  # SIGTERM: the open requests get serve_app.DRAIN_SECONDS, then end with an error
    serve_app.run(uvicorn.Server(serve_app.uvicorn_config(app, d.serve_read_timeout_seconds)), server, [sock])
    code = 0
  server.scheduler.stop()
  return code


if __name__ == "__main__":
  run_cli(main)
