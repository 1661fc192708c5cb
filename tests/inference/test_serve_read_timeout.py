"""Slow clients (serve_read_timeout_seconds): a request whose head or body does not arrive in time is a 408 with
a one-line JSON error and its connection closed; uvicorn alone waits for ever (it bounds only the idle wait
between a kept-alive connection's requests). A real uvicorn server on 127.0.0.1, configured as MaxText.serve
configures it, and raw sockets; the app is the server's (serve_app.build_app), the model a stand-in."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import httpx
import pytest

from MaxText.inference import openai_api as api
from MaxText.inference import serve_app, serve_metrics
from tests.uvicorn_thread import UvicornThread

sys.path.insert(0, str(Path(__file__).parents[1] / "input_pipeline"))

SECONDS = 2.0  # the deadline under test: long enough that a loaded CI machine delivers a head sent at once within it
# Between a slow client's parts: the deadline falls mid-wait (0.4 s from either send), never as a part is sent, whose
# bytes would then meet a closed socket and its reset discard the 408.
PAUSE = SECONDS * 0.4
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


class _NoModel(serve_app.HttpServer):
  """The routes' server without a model: a request that reaches admission is a 503."""

  def __init__(self) -> None:
    super().__init__(api.Codec(encode=lambda text: [1], decode=lambda ids: "x", chat=lambda messages: [1]),
                     api.Limits("tiny", 16, 8, 16, 4, 1), serve_metrics.ServeMetrics(lambda: {}))

  @property
  def request_timeout_seconds(self) -> float:
    return 30.0

  async def admit(self, request, score_prompt):
    raise api.ApiError(503, "no model here", code="no_model")


@pytest.fixture(scope="module")
def server():
  http = UvicornThread(serve_app.build_app(_NoModel(), api_key="", read_timeout_seconds=SECONDS), SECONDS)
  yield http
  http.close()


def _answer(server, *parts: bytes, pause: float = 0.0) -> bytes:
  """Everything the server sends on one connection until it closes it, `parts` sent `pause` seconds apart (those
after the server's first bytes are not sent). socket.timeout (the test fails) when the server keeps the
connection open."""
  out = b""
  with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
    for part in parts:
      conn.sendall(part)
      if pause:
        conn.settimeout(pause)
        try:
          out = conn.recv(65536)
        except TimeoutError:
          continue
        finally:
          conn.settimeout(30)
        if out:
          break
    while chunk := conn.recv(65536):
      out += chunk
  return out


def _timed_out(answer: bytes, what: str) -> None:
  head, _, body = answer.partition(b"\r\n\r\n")
  assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), answer
  assert body.count(b"\n") == 0, body
  error = json.loads(body)["error"]
  assert error["code"] == "request_timeout" and error["message"] == \
      f"the request {what} did not arrive within serve_read_timeout_seconds={SECONDS:g}", error


def test_a_body_not_received_in_time_is_a_408_and_the_connection_closes(server):
  _timed_out(_answer(server, POST + b"Content-Length: 100\r\n\r\n{\"model\": "), "body")


@pytest.mark.parametrize("head, part", [
    (b"Transfer-Encoding: chunked\r\n\r\n", b"5\r\n{\"mod\r\n"),  # chunks that never reach the last (0) one
    (b"Content-Length: 1000000\r\n\r\n", b"{" * 100000),  # far less than it declared
], ids=["chunked_never_ending", "shorter_than_declared"])
def test_a_body_that_never_ends_is_a_408(server, head, part):
  _timed_out(_answer(server, POST + head + part), "body")


def test_a_body_sent_a_byte_at_a_time_is_bounded_as_a_whole(server):
  """Each byte comes within the limit, the whole body does not: a per-read limit would wait for ever."""
  body = b'{"model": "tiny", "prompt": "the"}'
  parts = [POST + f"Content-Length: {len(body)}\r\n\r\n".encode()] + [body[i:i + 1] for i in range(len(body))]
  _timed_out(_answer(server, *parts, pause=PAUSE), "body")


@pytest.mark.parametrize("parts", [[], [b"POST /v1/completions HTTP/1.1\r\nHost:"], [b"P", b"O", b"S", b"T", b" ", b"/"]],
                         ids=["nothing", "half_a_head", "a_head_byte_by_byte"])
def test_a_head_not_received_in_time_is_a_408_and_the_connection_closes(server, parts):
  _timed_out(_answer(server, *parts, pause=PAUSE), "head")


def test_on_a_kept_alive_connection_the_next_requests_head_has_its_own_deadline(server):
  """A whole request answered, then half of the next head: the first answer, then the 408."""
  body = b'{"model": "tiny", "prompt": "the"}'
  answer = _answer(server, POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, b"POST /v1/comp")
  first, _, rest = answer.partition(b"HTTP/1.1 408 ")
  assert first.startswith(b"HTTP/1.1 503 ") and b"no_model" in first, answer
  _timed_out(b"HTTP/1.1 408 " + rest, "head")


def test_a_request_received_in_time_is_answered_and_its_connection_kept(server):
  body = b'{"model": "tiny", "prompt": "the"}'
  with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
    for _ in range(2):
      conn.sendall(POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
      answer = conn.recv(65536)
      assert answer.startswith(b"HTTP/1.1 503 ") and b"no_model" in answer, answer


def _count(metrics: serve_metrics.ServeMetrics, route: str, status: str) -> float:
  return sum(sample.value for family in metrics.requests.collect() for sample in family.samples
             if sample.name == "maxtext_serve_requests_total" and sample.labels == {"route": route, "status": status})


def test_every_408_is_counted_in_the_metrics_by_route() -> None:
  """A head not received in time was answered by the HTTP protocol, outside the app, and never counted: the head's
  408s now count by the route the head named so far ("other" before one), as the body's did."""
  no_model = _NoModel()
  http = UvicornThread(serve_app.build_app(no_model, api_key="", read_timeout_seconds=SECONDS), SECONDS)
  try:
    _timed_out(_answer(http, POST + b"Content-Length: 100\r\n\r\n{"), "body")
    _timed_out(_answer(http, b"POST /v1/completions HTTP/1.1\r\nHost:"), "head")
    _timed_out(_answer(http, b"POST /v1/completions?x=1 HTTP/1.1\r\nHost:"), "head")
    _timed_out(_answer(http, b"GET /nowhere HTTP/1.1\r\n"), "head")
    _timed_out(_answer(http, b"POST /v1/comp"), "head")
    _timed_out(_answer(http), "head")
  finally:
    http.close()
  assert _count(no_model.metrics, "/v1/completions", "408") == 3
  assert _count(no_model.metrics, "other", "408") == 3


def test_the_timeouts_take_fractions_of_a_second_and_must_be_positive():
  """base.yml's whole-number defaults made a fraction a type error (serve_request_timeout_seconds=0.5 was refused)."""
  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  decode = Config.for_testing(print_config=False, serve_read_timeout_seconds=0.5,
                              serve_request_timeout_seconds=2.5).decode
  assert (decode.serve_read_timeout_seconds, decode.serve_request_timeout_seconds) == (0.5, 2.5)
  for value in (0, -1):
    with pytest.raises(ConfigError, match=f"^serve_read_timeout_seconds must be > 0, got {value}"):
      Config.for_testing(print_config=False, serve_read_timeout_seconds=value)


@pytest.mark.parametrize("processes", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["one_process", "front_end_process"])
def test_python_m_maxtext_serve_bounds_slow_clients(tmp_path, processes):
  """The server as started from the command line, HTTP in its process or in a front end (serve_http_processes):
  a half-sent body and a half-sent head each get the 408 and a closed connection."""
  from sft_fixtures import CHATML, without_markers, write_tokenizer
  from tests.inference.test_serve_processes import CliServer

  server = CliServer(write_tokenizer(tmp_path / "tok", without_markers(CHATML)), processes,
                     serve_read_timeout_seconds=SECONDS)
  try:
    port = int(server.url.rsplit(":", 1)[1])
    served = type("Served", (), {"port": port})
    auth = f"Authorization: Bearer {server.client.api_key}\r\n".encode()
    _timed_out(_answer(served, POST + auth + b"Content-Length: 100\r\n\r\n{"), "body")
    _timed_out(_answer(served, b"POST /v1/completions HTTP/1.1\r\nHost:"), "head")
    # Both counted where /metrics is answered (a front end's, with serve_http_processes).
    assert 'maxtext_serve_requests_total{route="/v1/completions",status="408"} 2.0' in \
        httpx.get(f"{server.url}/metrics", timeout=30).text
  finally:
    server.stop()


def test_without_httptools_uvicorn_parses_as_it_would(monkeypatch):
  """httptools is a requirement, but a server started without it still starts (h11: bodies bounded, heads not)."""
  monkeypatch.setitem(sys.modules, "uvicorn.protocols.http.httptools_impl", None)  # its import fails
  assert serve_app.uvicorn_config(serve_app.build_app(_NoModel(), api_key=""), SECONDS).http == "auto"


def test_an_answer_streamed_past_the_deadline_is_not_cut_by_the_next_heads_deadline():
  """A streamed answer lasting three deadlines, with half of a pipelined next head behind it: the whole stream, then
  the 408 for that head. The head's deadline passing mid-answer closed the connection, cutting the stream."""

  async def stream(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(6):
      await send({"type": "http.response.body", "body": f"part{i};".encode(), "more_body": True})
      await asyncio.sleep(SECONDS / 2)
    await send({"type": "http.response.body", "body": b"end", "more_body": False})

  app = serve_app._Guard(stream, None, 1000, serve_metrics.ServeMetrics(lambda: {}), None, SECONDS)
  http = UvicornThread(app, SECONDS)
  try:
    answer = _answer(http, b"GET /s HTTP/1.1\r\nHost: x\r\n\r\nGET /t HT")
  finally:
    http.close()
  first, _, rest = answer.partition(b"HTTP/1.1 408 ")
  assert first.startswith(b"HTTP/1.1 200 ") and b"part5;" in first and first.endswith(b"3\r\nend\r\n0\r\n\r\n"), answer
  _timed_out(b"HTTP/1.1 408 " + rest, "head")
