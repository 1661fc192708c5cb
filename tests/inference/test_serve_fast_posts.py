"""serve_app's guard answers a POST to /v1/completions or /v1/chat/completions with the route's own
function, without FastAPI's routing and middleware: the same status, headers and body as the app
gives (a stream, a whole answer, a 400, a 503 with Retry-After), and the app still answers every
other method there; a prompt scored once answers its choices as if each had scored it. No model: a fake server whose
jobs' events are ready at submit."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")

from MaxText.inference import job_events, serve_app, serve_metrics, serve_routes  # noqa: E402
from MaxText.inference import openai_api as api  # noqa: E402

CODEC = api.Codec(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(chr(i) for i in ids),
                  chat=lambda messages: [ord("h")])


class _Job:
  def __init__(self) -> None:
    self.submitted = time.monotonic()  # a request's deadline runs from its jobs' submission

  def cancel(self) -> None:
    pass


class _Server(serve_app.HttpServer):
  """Each choice answers "abc" (one token, then two together), then ends; `full` refuses every submit."""

  full = False

  @property
  def request_timeout_seconds(self) -> float:
    return 60.0

  async def admit(self, request: api.Request, score_prompt: bool) -> Any:
    if self.full:
      raise serve_app.refusal(job_events.QueueFull("8 waiting"))
    queue: asyncio.Queue[list[job_events.Event]] = asyncio.Queue()
    for c in request.choices:
      queue.put_nowait([job_events.Tokens(c.index, [ord("a")], [-0.5], [[]])])
      queue.put_nowait([job_events.Tokens(c.index, [ord("b")], [-0.25], [[]]), job_events.Tokens(c.index, [ord("c")], [-1.0], [[]]),
                        job_events.Done(c.index, "length")])
    return [_Job() for _ in request.choices], queue


def _app(full: bool = False) -> Any:
  server = _Server(CODEC, api.Limits("tiny", 256, 32, 64, 16, 4), serve_metrics.ServeMetrics(lambda: {}))
  server.full = full
  return serve_app.build_app(server, api_key="")


def _call(app: Any, method: str, path: str, body: dict[str, Any] | bytes | None = None,
          headers: tuple[tuple[bytes, bytes], ...] = ()) -> list[dict[str, Any]]:
  payload = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
  scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
           "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
           "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json"), *headers],
           "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
  sent: list[dict[str, Any]] = []
  delivered = False

  async def receive() -> dict[str, Any]:
    nonlocal delivered
    if not delivered:
      delivered = True
      return {"type": "http.request", "body": payload, "more_body": False}
    await asyncio.sleep(3600)  # the client stays
    return {"type": "http.disconnect"}

  async def send(message: dict[str, Any]) -> None:
    sent.append(message)

  asyncio.run(app(scope, receive, send))
  return sent


def _answer(messages: list[dict[str, Any]]) -> tuple[int, dict[bytes, bytes], bytes]:
  start = messages[0]
  body = b"".join(m.get("body", b"") for m in messages[1:])
  return start["status"], dict(start["headers"]), body


def _through_the_app(app: Any) -> Any:
  """The same guard with no POST answered by itself (every request through FastAPI, as before)."""
  return serve_app._Guard(app.app, app.api_key, app.max_body_bytes, app.metrics)  # noqa: SLF001


class _Recording:
  def __init__(self, app: Any):
    self.app, self.paths = app, list[tuple[str, str]]()

  async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
    self.paths.append((scope["method"], scope["path"]))
    await self.app(scope, receive, send)


def test_a_completions_post_skips_the_app_and_other_methods_reach_it() -> None:
  app = _app()
  recording = _Recording(app.app)
  app.app = recording
  status, _, body = _answer(_call(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}))
  assert status == 200 and body.endswith(serve_routes.STREAM_END.encode())
  status, _, _ = _answer(_call(app, "POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
  assert status == 200
  assert recording.paths == []
  status, _, _ = _answer(_call(app, "GET", "/v1/completions"))
  assert status == 405 and recording.paths == [("GET", "/v1/completions")]


CASES = {
    "stream": ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True, "logprobs": 0,
                                   "stream_options": {"include_usage": True}}, False),
    "whole": ("/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True}, False),
    "chat stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                             "stream": True}, False),
    "chat whole": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, False),
    "400": ("/v1/completions", {"prompt": "x", "max_tokens": 3, "best_of": 2}, False),
    "bad json": ("/v1/completions", None, False),
    "503": ("/v1/completions", {"prompt": "x", "max_tokens": 3}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_guard_answers_as_the_app_does(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(serve_routes, "_new_id", lambda prefix: f"{prefix}-1")
  monkeypatch.setattr("time.time", lambda: 1700000000.0)  # the answers' "created"
  path, body, full = CASES[case]
  fast = _answer(_call(_app(full), "POST", path, body))
  slow = _answer(_call(_through_the_app(_app(full)), "POST", path, body))
  assert fast == slow
  status, headers, payload = fast
  assert status == {"400": 400, "bad json": 400, "503": 503}.get(case, 200)
  if case == "503":
    assert headers[b"retry-after"] == b"1" and json.loads(payload)["error"]["code"] == "queue_full"


def test_a_compressed_body_is_a_415_naming_its_coding():
  """Content-Encoding: gzip was read as JSON: a 400 about byte 0x8b. The app's own routes get the same answer."""
  import gzip

  body = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 3}).encode())
  for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
    status, headers, payload = _answer(_call(_app(), "POST", path, body, ((b"content-encoding", b"gzip"),)))
    assert status == 415 and headers[b"accept-encoding"] == b"identity"
    assert json.loads(payload)["error"]["message"] == ("the request body has Content-Encoding: gzip; this server reads "
                                                       "uncompressed bodies only: send it without Content-Encoding")
  status, _, _ = _answer(_call(_app(), "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3},
                               ((b"content-encoding", b"identity"),)))
  assert status == 200


class _Scoring(_Server):
  """Scores each prompt as the scheduler does for the server's jobs: a PromptScores event before the tokens of the
  first choice with that prompt, none for the others (their job does not score it)."""

  async def admit(self, request: api.Request, score_prompt: bool) -> Any:
    jobs, tokens = await super().admit(request, score_prompt)
    queue: asyncio.Queue[list[job_events.Event]] = asyncio.Queue()
    first: dict[tuple[int, ...], int] = {}
    for c in request.choices:
      if score_prompt and first.setdefault(tuple(c.prompt), c.index) == c.index:
        queue.put_nowait([job_events.PromptScores(c.index, [-0.1 * (t % 7) for t in c.prompt],
                                                  [[(t, -0.1 * (t % 7)), (ord("z"), -3.0)] for t in c.prompt])])
      queue.put_nowait(tokens.get_nowait())
      queue.put_nowait(tokens.get_nowait())
    return jobs, queue


def test_a_prompt_scored_once_answers_each_of_its_choices_as_a_choice_alone(monkeypatch: pytest.MonkeyPatch) -> None:
  """Echo with logprobs, n=2 and a prompt listed twice, the prompt scored by one job per prompt: each choice's answer,
  whole or its streamed chunks, is byte for byte that of its prompt alone with n=1 (before, the choices whose job did
  not score the prompt came back without its entries)."""
  monkeypatch.setattr(serve_routes, "_new_id", lambda prefix: f"{prefix}-1")
  monkeypatch.setattr("time.time", lambda: 1700000000.0)

  def answer(prompt: Any, n: int, stream: bool) -> dict[int, list[str]]:
    """Each choice's JSON (whole) or chunks (streamed), its index read as 0."""
    server = _Scoring(CODEC, api.Limits("tiny", 256, 32, 64, 16, 8), serve_metrics.ServeMetrics(lambda: {}))
    body = {"prompt": prompt, "max_tokens": 3, "n": n, "echo": True, "logprobs": 1, "stream": stream}
    status, _, payload = _answer(_call(serve_app.build_app(server, api_key=""), "POST", "/v1/completions", body))
    assert status == 200, payload
    out: dict[int, list[str]] = {}
    if not stream:
      for choice in json.loads(payload)["choices"]:
        out[choice["index"]] = [json.dumps({**choice, "index": 0})]
      return out
    for line in payload.decode().splitlines():  # one choice per chunk
      if line.startswith("data: {"):
        [choice] = json.loads(line[len("data: "):])["choices"]
        index = choice["index"]
        out.setdefault(index, []).append(line.replace(f'"choices":[{{"index":{index},', '"choices":[{"index":0,'))
    return out

  for stream in (False, True):
    ab, cd = answer("ab", 1, stream)[0], answer("cd", 1, stream)[0]
    assert any('"tokens":["a","b"' in piece.replace(" ", "") for piece in ab)  # the echoed prompt's entries
    assert answer(["ab", "cd", "ab"], 2, stream) == {0: ab, 1: ab, 2: cd, 3: cd, 4: ab, 5: ab}
