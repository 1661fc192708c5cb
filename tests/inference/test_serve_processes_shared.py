"""What the HTTP front-end processes (serve_http_processes >= 1) serve beyond text: chats with images (a front
end decodes and cuts them, without JAX, and sends their pixel values with the submit) answered as the
one-process server answers them, bad images the same 400s; and /metrics on any of several front ends counting
the whole server's requests, in the one-process server's metric names."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.inference.test_serve_processes import KEY, REPO, CliServer, httpx

from MaxText.inference import serve_app, serve_frontend, serve_processes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, write_tokenizer  # noqa: E402

LOAD = {"slots": 2, "active": 0, "waiting": 0, "pages_total": 0, "pages_free": 0, "pages_cached": 0,
        "pages_reserved": 0, "oldest_age_s": 0.0}


@contextlib.contextmanager
def answered_alike(tokenizer: Path, keys: dict[str, Any], chats: list, bad: list,
                   on_one: Callable[[CliServer], object] = lambda _: None
                   ) -> Iterator[tuple[CliServer, tuple[int, int], list[tuple[int, bytes | str]]]]:
  """Asks `chats` (answered 200) and `bad` (answered 400) of a one-process server (`on_one` runs before it
  stops), then of one with two front ends, each front end answering about half in turn (the other stopped with
  SIGSTOP: both accept on the one socket): the same greedy text and the same 400 bodies; neither front end
  maps jaxlib. Yields (that server, its front ends' pids, the one-process answers) with the first front end
  still stopped; stops the server after."""
  def ask(server: CliServer, messages: list) -> tuple[int, bytes | str]:
    answer = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=180, json={"model": "tiny-vlm", "messages": messages, "max_tokens": 6,
                                           "temperature": 0})
    if answer.status_code != 200:
      return answer.status_code, answer.content
    return 200, answer.json()["choices"][0]["message"]["content"]

  one = CliServer(tokenizer, 0, **keys)
  try:
    expected = [ask(one, m) for m in chats + bad]
    on_one(one)
  finally:
    one.stop()
  assert [code for code, _ in expected] == [200] * len(chats) + [400] * len(bad), expected
  server = CliServer(tokenizer, 2, **keys)
  first, second = server.front_ends()
  try:
    os.kill(second, signal.SIGSTOP)  # the first answers
    got = [ask(server, m) for m in chats[:2] + bad[:4]]
    os.kill(second, signal.SIGCONT)
    os.kill(first, signal.SIGSTOP)  # the second answers
    got += [ask(server, m) for m in chats[2:] + bad[4:]]
    assert got == [expected[i] for i in [0, 1, *range(len(chats), len(chats) + 4), *range(2, len(chats)),
                                         *range(len(chats) + 4, len(chats) + len(bad))]]
    for pid in (first, second):
      assert "jaxlib" not in Path(f"/proc/{pid}/maps").read_text()
    yield server, (first, second), expected
  finally:
    for pid in (first, second):
      os.kill(pid, signal.SIGCONT)
    assert server.stop() == 0


def _count(text: str, name: str, labels: str) -> float:
  found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
  return float(found.group(1)) if found else 0.0


def test_every_front_ends_metrics_count_the_whole_servers_requests():
  """Two front ends on socket pairs to the engine's side (a stand-in scheduler): what each observes (requests,
  latencies, times to first token) goes through the engine's process to the other, so /metrics on either
  counts all of them. Before, each counted only its own."""
  links, fronts = [], []
  scheduler = types.SimpleNamespace(load=lambda: dict(LOAD))
  for index in range(2):
    ours, theirs = socket.socketpair()
    links.append(serve_processes._Link(index, ours, scheduler, None, threading.Event()))
    fronts.append((serve_frontend.FrontendServer(types.SimpleNamespace(limits=None, request_timeout_seconds=10),
                                                 types.SimpleNamespace()), theirs))
  for link in links:
    link.peers = [other for other in links if other is not link]
    link.start()

  async def scrape() -> list[str]:
    readers = []
    for server, channel in fronts:
      server.share_metrics()
      readers.append(asyncio.create_task(server.read(await server.connect(channel))))
    (first, _), (second, _) = fronts
    for status in ("200", "200", "400"):
      first.metrics.observe_request("/v1/chat/completions", status, 0.2)
    first.metrics.observe_first_token("/v1/chat/completions", 0.0)
    await asyncio.sleep(0)  # this turn's observations go as one message
    # A channel's messages are handled in order: once a front end's own load answer is back, the engine has
    # passed its observations on, ahead of any later answer to the other.
    await asyncio.wait_for(first.refresh(), 10)
    second.metrics.observe_request("/v1/completions", "200", 0.1)
    await asyncio.sleep(0)
    await asyncio.wait_for(second.refresh(), 10)
    await asyncio.wait_for(first.refresh(), 10)
    texts = [server.metrics.exposition().decode() for server, _ in fronts]
    for link in links:
      link.close()
    await asyncio.wait_for(asyncio.gather(*readers), 10)
    return texts

  for text in asyncio.run(scrape()):
    assert _count(text, "maxtext_serve_requests_total", 'route="/v1/chat/completions",status="200"') == 2, text
    assert _count(text, "maxtext_serve_requests_total", 'route="/v1/chat/completions",status="400"') == 1
    assert _count(text, "maxtext_serve_requests_total", 'route="/v1/completions",status="200"') == 1
    assert _count(text, "maxtext_serve_request_seconds_count", 'route="/v1/chat/completions"') == 3
    assert _count(text, "maxtext_serve_time_to_first_token_seconds_count", 'route="/v1/chat/completions"') == 1
    assert "\nmaxtext_serve_slots_total 2.0\n" in text


def test_a_front_end_sends_a_requests_count_before_its_answer_goes_out() -> None:
  """A request's count leaves the front end (toward the others) before the last of its answer is sent, so a client
  that has the answer and then scrapes /metrics through another front end finds it counted (were it sent after,
  or on a later turn of the loop, a front end stopped or slow in between would leave it out)."""
  spec: Any = types.SimpleNamespace(limits=None, request_timeout_seconds=10)
  server = serve_frontend.FrontendServer(spec, types.SimpleNamespace())  # type: ignore[arg-type]
  server.share_metrics()
  sent: list[Any] = []
  server.send = sent.append  # type: ignore[method-assign,assignment]

  async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 400, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": True})
    await send({"type": "http.response.body", "body": b""})

  seen_at_send: list[list[Any]] = []

  async def send(message: dict[str, Any]) -> None:
    seen_at_send.append(list(sent))

  async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}

  scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
  asyncio.run(serve_app._Guard(app, None, 1000, server.metrics)(scope, receive, send))
  assert seen_at_send[:2] == [[], []]  # not before the answer's end
  [(kind, observed)] = seen_at_send[2]
  assert kind == "observe" and [o[:3] for o in observed] == [("request", "/v1/chat/completions", "400")]
  assert len(sent) == 1  # counted once


def test_the_front_ends_image_code_loads_no_jax(tmp_path):
  """The codec spec a vision model's front end gets (its image format resolved in the engine's process) renders a
  chat with an image in a process that never imports JAX."""
  from MaxText.configuration.config import Config
  from MaxText.serve import codec_spec
  from tests.test_serve_images import MODEL, SERVING, image_message, png_url

  tokenizer = write_tokenizer(tmp_path / "tok", GEMMA3, IMAGE_SPECIAL)
  spec = codec_spec(Config.for_testing(**MODEL, **SERVING, tokenizer_path=str(tokenizer)))
  (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
  (tmp_path / "messages.pkl").write_bytes(pickle.dumps(image_message("what is this", png_url(1))))
  script = ("import pickle, sys\nfrom MaxText.inference import serve_codec\n"
            f"spec = pickle.loads(open({str(tmp_path / 'spec.pkl')!r}, 'rb').read())\n"
            "codec, _ = serve_codec.build(spec)\n"
            f"ids, images = codec.chat_images(pickle.loads(open({str(tmp_path / 'messages.pkl')!r}, 'rb').read()))\n"
            "print(ids.count(12), images.pixels_MCRR.shape)\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))))\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("\n")[:2] == ["4 (1, 3, 16, 16)", "[]"], out.stdout


@pytest.mark.slow  # two servers of a vision model (JAX start-up and compiles each)
def test_image_chats_and_metrics_through_two_front_ends_answer_as_the_one_process_server(tmp_path):
  """A tiny Gemma 3 served in one process, then with two front ends: the same image chats (and a chat with a
  typed image marker, which is text) get the same greedy text and bad images the same 400 bodies, through either front end (the other stopped with SIGSTOP: both accept
  on the one socket); the front ends map no jaxlib; /metrics through either counts every request of both, with
  the one-process server's metric names."""
  from tests.test_serve_images import MODEL, SERVING, image_message, png_url

  tokenizer = write_tokenizer(tmp_path / "tok", GEMMA3, IMAGE_SPECIAL)
  keys = {**MODEL, **SERVING}
  chats = [image_message("what is this", png_url(1)), image_message("compare", png_url(2), png_url(3)),
           image_message("what is this", png_url(4, noise=True)),
           [{"role": "user", "content": "look <start_of_image> here"}]]  # a typed marker is text (test_image_text.py)
  bad = [image_message("hi", png_url(1), png_url(2), png_url(3)),  # more than serve_max_images
         image_message("hi", png_url(6, size=64)),  # more pixels than serve_max_image_pixels
         image_message("hi", png_url(5, size=40, noise=True)),  # more bytes than serve_max_image_bytes
         image_message("hi", "data:image/png;base64," + base64.b64encode(b"not an image").decode()),
         image_message("hi", "data:text/plain;base64,aGk="),
         image_message("hi", "https://example.com/cat.png")]

  def names(text: str) -> list[str]:
    return re.findall(r"^# TYPE (\S+)", text, re.M)

  one_names: list[str] = []
  with answered_alike(tokenizer, keys, chats, bad, lambda one: one_names.extend(
      names(httpx.get(f"{one.url}/metrics", timeout=10).text))) as (server, (first, second), expected):
    assert len({text for _, text in expected[:len(chats)]}) > 1
    route = 'route="/v1/chat/completions",status='

    def scrape() -> str:
      """/metrics, asked again (for a while) until it counts every request: a front end sends each count before
      its answer, but the engine's process reads each front end's channel on a thread of its own, so another
      front end's scrape may overtake a count on its way. A count held in a stopped front end never arrives."""
      deadline = time.monotonic() + 30
      while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        counts = [_count(text, "maxtext_serve_requests_total", route + f'"{code}"') for code in ("200", "400")]
        if counts == [len(chats), len(bad)] or time.monotonic() > deadline:
          return text
        time.sleep(0.05)

    scrapes = [scrape()]  # through the second (the first still stopped)
    os.kill(first, signal.SIGCONT)
    os.kill(second, signal.SIGSTOP)
    scrapes.append(scrape())  # through the first
    os.kill(second, signal.SIGCONT)
    for text in scrapes:
      assert names(text) == one_names
      assert _count(text, "maxtext_serve_requests_total", route + '"200"') == len(chats), text
      assert _count(text, "maxtext_serve_requests_total", route + '"400"') == len(bad), text
