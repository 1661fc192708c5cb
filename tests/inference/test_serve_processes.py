"""The server with its HTTP in processes of its own (serve_http_processes >= 1, inference/serve_processes.py
and serve_frontend.py): `python3 -m MaxText.serve` started as a subprocess on 127.0.0.1 with a tiny random
model, driven by the official `openai` client. The front end loads no JAX; completions, streams and chats are
answered; greedy text equals the one-process server's; a client gone mid-stream gives its slot back; a full
queue is a 503; LoRA adapters answer as in one process, their admin routes on any front end; a front end killed stops the engine's process with one line and a non-zero exit; SIGTERM stops
every process; a front end ends when the engine's process is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")
try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
  import httpx2 as httpx
except ImportError:
  httpx = pytest.importorskip("httpx")

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.errors import ConfigError, UserError  # noqa: E402
from MaxText.inference import lora_admin, serve_processes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import CHATML, write_tokenizer, without_markers  # noqa: E402
from tests.compile_settings import cpu_xla_flags  # noqa: E402
from tests.test_serve import MODEL  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "split-key"
PROMPTS = ["the quick brown fox", "to be or not", "a lazy dog"]
# The tiny model of test_serve.py, dense (a long-running request needs no pages), with room for long streams.
KEYS = {**MODEL, "kv_cache_layout": "dense", "kv_num_pages": 0, "max_target_length": 48, "serve_max_tokens": 16,
        "serve_max_slots": 2, "serve_model_name": "tiny"}


def _children(pid: int) -> list[int]:
  out = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        stat = Path(f"/proc/{entry}/stat").read_text()
      except OSError:
        continue
      if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
        out.append(int(entry))
  return out


class CliServer:
  """`python3 -m MaxText.serve` on a free port with the test model; `lines` is what it printed."""

  def __init__(self, tokenizer: Path, processes: int, **keys: object):
    args = [f"{k}={v}" for k, v in {**KEYS, **keys}.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "MAXTEXT_API_KEY": KEY}
    self.process = subprocess.Popen([sys.executable, "-m", "MaxText.serve", "configs/base.yml", *args,
                                     f"tokenizer_path={tokenizer}", "port=0", f"serve_http_processes={processes}"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    threading.Thread(target=self._read, daemon=True).start()
    deadline, self.url = time.monotonic() + 240, ""
    while not self.url:
      assert self.process.poll() is None and time.monotonic() < deadline, "\n".join(self.lines)
      found = [re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line) for line in self.lines]
      self.url = next((m.group(1) for m in found if m), "")
      time.sleep(0.1)
    while True:  # the front ends answer once they are up
      try:
        if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        assert self.process.poll() is None and time.monotonic() < deadline, "\n".join(self.lines)
        time.sleep(0.2)
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

  def _read(self) -> None:
    assert self.process.stdout is not None
    for line in self.process.stdout:
      self.lines.append(line.rstrip())

  def front_ends(self) -> list[int]:
    return _children(self.process.pid)

  def stop(self, sig: int = signal.SIGTERM) -> int:
    """SIGTERM (or `sig`); the exit code, once every front end is gone too."""
    front_ends = self.front_ends()
    if self.process.poll() is None:
      self.process.send_signal(sig)
    code = self.process.wait(60)
    for pid in front_ends:
      assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid
    return code


def _finished(server: CliServer) -> dict[str, float]:
  """The server's completions ended so far, by reason."""
  text = httpx.get(f"{server.url}/metrics", timeout=10).text
  found = dict(re.findall(r'^maxtext_serve_completions_finished_total\{reason="(\w+)"\} (\S+)$', text, re.M))
  assert "cancelled" in found, text
  return {reason: float(count) for reason, count in found.items()}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
  return write_tokenizer(tmp_path_factory.mktemp("split") / "tok", without_markers(CHATML))


@pytest.fixture(scope="module")
def endless_tokenizer(tmp_path_factory) -> Path:
  """The tokenizer without an end-of-sequence token: a long stream of the random model ends only by its length or
  its client leaving (with one, the model sampled it within a few hundred tokens on some runs, before a dropped
  stream was noticed or an adapter's removal was tried)."""
  tokenizer = write_tokenizer(tmp_path_factory.mktemp("endless") / "tok", without_markers(CHATML))
  config = json.loads((tokenizer / "tokenizer_config.json").read_text())
  del config["eos_token"]
  (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
  return tokenizer


def test_the_front_end_loads_no_jax_and_refusals_are_one_line(tokenizer):
  """What a front end imports and builds (the routes, the codec with its chat template and grammar compiler)
  leaves JAX out (its image code: test_serve_processes_shared.py); a negative key is refused by name."""
  script = ("import sys\nfrom MaxText.inference import serve_frontend, serve_routes, serve_app, lora_routes\n"
            "from MaxText.inference.serve_codec import CodecSpec, build\n"
            f"codec, _ = build(CodecSpec('huggingface', {str(tokenizer)!r}, False, 272))\n"
            "codec.chat([{'role': 'user', 'content': 'to be'}]); codec.grammars().json_schema({'type': 'object'})\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))))\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]"
  with pytest.raises(ConfigError, match="serve_http_processes must be >= 0"):
    Config.for_testing(**MODEL, serve_http_processes=-1)


def test_more_front_ends_than_cores_is_one_line_before_the_model_loads(monkeypatch):
  """serve_http_processes=100000: one line naming the cores. Before, the server loaded the model and then started
  that many Python processes, until the machine's memory ran out."""
  from MaxText import serve

  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  monkeypatch.setattr(serve, "build_server", lambda config: pytest.fail("the model was loaded"))
  with pytest.raises(UserError, match=r"^serve_http_processes=100000 is more than the 2 CPU cores this server may "
                                      r"use, .*: set serve_http_processes to at most 2$"):
    serve.main(["serve", "configs/base.yml", *(f"{k}={v}" for k, v in MODEL.items()), "port=0",
                "serve_http_processes=100000"])


def test_a_front_end_process_serves_and_its_death_stops_the_server(tokenizer):
  """One front end: a completion, a stream joining to the same text, a chat and /health; the front end has
  no JAX mapped; killed, it takes the engine's process down with one line and a non-zero exit."""
  server = CliServer(tokenizer, 1)
  try:
    [front_end] = server.front_ends()
    whole = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert whole.usage.completion_tokens == 8
    streamed = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "to be"}],
                                                 max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["slots_total"] == 2 and health["slots_in_use"] == 0
    assert "jaxlib" not in Path(f"/proc/{front_end}/maps").read_text()
    os.kill(front_end, signal.SIGKILL)
    code = server.process.wait(60)
    time.sleep(0.2)  # the reader thread's last lines
    assert code != 0
    errors = [line for line in server.lines if "error" in line]
    assert len(errors) == 1 and "HTTP front-end process 0" in errors[0] and "exited" in errors[0], server.lines
  finally:
    if server.process.poll() is None:
      server.process.kill()


@pytest.mark.slow  # three servers (JAX start-up and compiles each)
def test_greedy_text_equals_the_one_process_servers_and_sigterm_or_sigint_stops_every_process(tokenizer):
  answers = {}
  for processes in (0, 1, 2):
    server = CliServer(tokenizer, processes)
    try:
      if processes == 2:
        assert len(server.front_ends()) == 2
      texts = [server.client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in PROMPTS]
      streamed = ["".join(c.choices[0].text for c in server.client.completions.create(
          model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True)) for p in PROMPTS]
      chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "to be"}],
                                                   max_tokens=6, temperature=0).choices[0].message.content
      answers[processes] = (texts, streamed, chat)
    finally:  # one process: uvicorn re-raises the SIGTERM it caught once it has stopped; two: Ctrl-C's SIGINT
      assert server.stop(signal.SIGINT if processes == 2 else signal.SIGTERM) in (
          (0, -signal.SIGTERM) if processes == 0 else (0,))
  assert answers[0][0] == answers[0][1]
  assert answers[1] == answers[0] and answers[2] == answers[0]


@pytest.mark.slow  # a server with room for long streams
def test_a_dropped_stream_frees_its_slot_a_full_queue_is_a_503_and_the_front_end_ends_with_the_engine(
    endless_tokenizer):
  # A stream far longer than the test (a dense cache of 32768 positions makes each step slower too).
  server = CliServer(endless_tokenizer, 1, max_target_length=32768, max_prefill_predict_length=32, serve_max_tokens=32000,
                     serve_max_slots=1, serve_max_queue=0)
  try:
    with httpx.Client(timeout=60) as http:
      body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 32000, "stream": True}
      with http.stream("POST", f"{server.url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        busy = http.post(f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                         headers={"Authorization": f"Bearer {KEY}"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json()["error"]["code"] == "queue_full"
      # The stream is closed: noticed within a second or so when idle, its job cancelled; the bound is loose
      # because on a loaded 2-core machine (beside a full test run) it once took more than 20 s.
      deadline = time.monotonic() + 90
      while _finished(server)["cancelled"] < 1 or httpx.get(f"{server.url}/health", timeout=10).json()["slots_in_use"]:
        assert time.monotonic() < deadline, ("the dropped stream's job is not cancelled or still holds its slot: "
                                             f"{_finished(server)}, {httpx.get(f'{server.url}/health').json()}")
        time.sleep(0.2)
    out = server.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    [front_end] = server.front_ends()
    server.process.kill()  # the engine's process gone without a word: its front end sees the channel end
    server.process.wait(30)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{front_end}").exists() and "Z" not in Path(f"/proc/{front_end}/stat").read_text().split()[2]:
      assert time.monotonic() < deadline, "the front end outlived the engine's process"
      time.sleep(0.2)
  finally:
    if server.process.poll() is None:
      server.process.kill()


def test_a_submit_the_engine_cannot_build_is_answered_and_a_closed_channel_is_noticed():
  """The engine's side of one front end's channel, on a socket pair with a stand-in scheduler: a submit whose
  jobs cannot be built is answered with an error (the front end's request gets a 500, not a wait for ever), a
  cancel of an unknown request is ignored, the load figures are answered, and the channel's end is noticed."""
  import socket
  import types

  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  theirs.settimeout(10)  # an answer that never comes fails the test
  lost = threading.Event()
  scheduler = types.SimpleNamespace(load=lambda: {"slots": 3})
  serve_processes._Link(0, ours, scheduler, None, lost).start()
  theirs.sendall(serve_frontend.frame(("submit", 7, [("not", "a", "choice")], False, None)))
  theirs.sendall(serve_frontend.frame(("cancel", 8, 0)))
  theirs.sendall(serve_frontend.frame(("load",)))
  items = serve_frontend.read_frame(theirs)
  if len(items) == 1:  # the writer sends what queued meanwhile as one message: the two answers, or one each
    items += serve_frontend.read_frame(theirs)
  [(kind, request, (error, message)), load] = items
  assert (kind, request, error) == ("admit", 7, "error") and "ValueError" in message
  assert load == ("load", {"slots": 3})
  theirs.close()
  assert lost.wait(10)


def test_the_front_ends_reader_threads_build_the_grammar_compiler_one_at_a_time():
  """The grammar compiler is built lazily and not thread-safe (two front ends' first constrained requests at once
  failed one of them with a 500: transformers imported on two threads). A stand-in builder that fails when entered
  twice at once is entered by one reader thread at a time; its error is each request's answer."""
  import socket
  import types

  from MaxText.inference import serve_frontend

  inside, most = [0], [0]

  def grammars():
    inside[0] += 1
    most[0] = max(most[0], inside[0])
    time.sleep(0.3)
    inside[0] -= 1
    raise RuntimeError("stand-in compiler")

  theirs = []
  for index in range(2):
    ours, other = socket.socketpair()
    other.settimeout(10)
    serve_processes._Link(index, ours, types.SimpleNamespace(), grammars, threading.Event()).start()
    theirs.append(other)
  for other in theirs:
    other.sendall(serve_frontend.frame(("submit", 1, [(0, [1, 2], 2, 0, None)], False, '{"type": "object"}')))
  for other in theirs:
    [(kind, request, (error, message))] = serve_frontend.read_frame(other)
    assert (kind, request, error) == ("admit", 1, "error") and "stand-in compiler" in message
    other.close()
  assert most[0] == 1


def test_a_message_the_engine_cannot_read_or_handle_is_one_line_and_the_channel_serves_on(capfd):
  """A message that does not unpickle, one of an unknown kind, a cancel of a choice the request lacks and a submit
  the scheduler fails on each print one line (the submit's request gets an error); the reader thread goes on
  (it died, and every later request of that front end waited for ever)."""
  import socket
  import types

  from MaxText.inference import serve_frontend

  def submit(jobs):
    if jobs[0].max_tokens == 99:
      raise RuntimeError("stand-in scheduler")

  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  scheduler = types.SimpleNamespace(load=lambda: {"slots": 3}, submit=submit)
  serve_processes._Link(0, ours, scheduler, None, threading.Event()).start()
  garbage = b"\x80\x05not a pickle"  # a pickle's protocol header, no valid body
  theirs.sendall(len(garbage).to_bytes(4, "big") + garbage)
  theirs.sendall(serve_frontend.frame(("hello",)))
  theirs.sendall(serve_frontend.frame(("submit", 1, [(0, [1, 2], 2, 0, None)], False, None)))
  assert serve_frontend.read_frame(theirs) == [("admit", 1, None)]
  theirs.sendall(serve_frontend.frame(("cancel", 1, 5)))
  theirs.sendall(serve_frontend.frame(("submit", 2, [(0, [1, 2], 99, 0, None)], False, None)))
  [(kind, request, (error, message))] = serve_frontend.read_frame(theirs)
  assert (kind, request, error) == ("admit", 2, "error") and "stand-in scheduler" in message
  theirs.sendall(serve_frontend.frame(("submit", 3)))
  [(kind, request, (error, message))] = serve_frontend.read_frame(theirs)
  assert (kind, request, error) == ("admit", 3, "error")
  theirs.sendall(serve_frontend.frame(("load",)))
  assert serve_frontend.read_frame(theirs) == [("load", {"slots": 3})]
  theirs.close()
  lines = [line for line in capfd.readouterr().err.splitlines() if "HTTP front-end process 0" in line]
  assert len(lines) == 4 and all(line.startswith("serve: error: a message from") for line in lines), lines
  assert "UnpicklingError" in lines[0] and "unknown message 'hello'" in lines[1] and "IndexError" in lines[2]


def test_a_submit_the_engine_never_answers_is_a_504_at_the_requests_deadline():
  """A front end whose submit gets no answer (lost in the engine's process) answers 504 at
  serve_request_timeout_seconds and cancels its jobs there, where the request waited for ever."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  spec = types.SimpleNamespace(limits=None, request_timeout_seconds=0.5)
  server = serve_frontend.FrontendServer(spec, types.SimpleNamespace())
  request = types.SimpleNamespace(choices=[types.SimpleNamespace(index=0, prompt=[1], max_tokens=2, row=0,
                                                                 images=None)], grammar=None, logprobs=None)

  async def ask() -> api.ApiError:
    await server.connect(ours)
    with pytest.raises(api.ApiError) as e:
      await asyncio.wait_for(server.admit(request, False), 10)
    await asyncio.sleep(0.1)  # the cancel is written
    return e.value

  error = asyncio.run(ask())
  assert error.status == 504 and "serve_request_timeout_seconds=0.5" in str(error.body())
  assert serve_frontend.read_frame(theirs)[0] == "submit" and serve_frontend.read_frame(theirs) == ("cancel", 0, 0)


def test_a_request_waiting_for_its_admission_when_the_engine_goes_is_a_503_server_stopping():
  """The engine's process gone before it admitted a request: 503 engine_gone ("the server is stopping"), as a
  request arriving after; it was a 503 queue_full, "the server is busy (the engine's process is gone); retry
  later"."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  spec = types.SimpleNamespace(limits=None, request_timeout_seconds=10)
  server = serve_frontend.FrontendServer(spec, types.SimpleNamespace())
  request = types.SimpleNamespace(choices=[types.SimpleNamespace(index=0, prompt=[1], max_tokens=2, row=0,
                                                                 images=None)], grammar=None, logprobs=0)

  async def ask() -> list[api.ApiError]:
    reader = await server.connect(ours)
    following = asyncio.create_task(server.read(reader))
    admitting = asyncio.create_task(server.admit(request, False))
    await asyncio.sleep(0.1)
    theirs.close()
    errors = []
    for admission in (admitting, server.admit(request, False)):
      with pytest.raises(api.ApiError) as e:
        await asyncio.wait_for(admission, 5)
      errors.append(e.value)
    await following
    return errors

  for error in asyncio.run(ask()):
    assert error.status == 503 and error.body()["error"]["code"] == "engine_gone", error.body()


def test_a_requests_deadline_runs_from_its_submission_not_again_from_its_admission():
  """serve_request_timeout_seconds bounds a request once, from its submission, as in one process: admitted late and
  then given no events, it is a 504 at that deadline. Before, the wait for its events had a deadline of its own from
  the admission, so a request could take twice the timeout."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  timeout = 2.0
  server = serve_frontend.FrontendServer(types.SimpleNamespace(limits=None, request_timeout_seconds=timeout),
                                         types.SimpleNamespace())
  request = types.SimpleNamespace(choices=[types.SimpleNamespace(index=0, prompt=[1], max_tokens=2, row=0,
                                                                 images=None)], grammar=None, logprobs=None)

  async def connected() -> bool:
    return False

  async def ask() -> tuple[api.ApiError, float]:
    following = asyncio.create_task(server.read(await server.connect(ours)))
    start = time.monotonic()
    admitting = asyncio.create_task(server.admit(request, False))
    submit = await asyncio.to_thread(serve_frontend.read_frame, theirs)
    await asyncio.sleep(start + 0.75 * timeout - time.monotonic())
    theirs.sendall(serve_frontend.frame([("admit", submit[1], None)]))  # admitted; then no event comes
    jobs, queue = await asyncio.wait_for(admitting, 10)
    with pytest.raises(api.ApiError) as e:
      async for _ in server.events(jobs, queue, connected):
        pass
    took = time.monotonic() - start
    theirs.close()
    await following
    return e.value, took

  error, took = asyncio.run(ask())
  assert error.status == 504 and error.body()["error"]["code"] == "timeout", error.body()
  assert timeout <= took < 1.5 * timeout, took  # before: 1.75 x the timeout


def _asgi_post(app, path: str, body: dict) -> "asyncio.Future":
  """The app's answer to a POST (status, body bytes) on the running event loop; the client stays connected."""
  import asyncio

  scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
           "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
           "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
           "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
  payload, sent = json.dumps(body).encode(), []

  async def receive() -> dict:
    if not sent and payload:
      sent.append({"type": "received"})
      return {"type": "http.request", "body": payload, "more_body": False}
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}

  async def send(message: dict) -> None:
    sent.append(message)

  async def answer() -> tuple[int, bytes]:
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

  return asyncio.ensure_future(answer())


def test_requests_open_when_the_engine_goes_are_a_503_engine_gone_or_a_streams_error_event():
  """The engine's process gone while a front end's requests are admitted and decoding: an unstreamed one is a 503
  engine_gone (as /health says), a stream ends with that error event and [DONE]. Before, the unstreamed one was a
  500 generation_failed."""
  import asyncio
  import socket
  import types

  from MaxText.inference import job_events, serve_app, serve_frontend
  from MaxText.inference import openai_api as api

  ours, theirs = socket.socketpair()
  codec = api.Codec(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(map(chr, ids)),
                    chat=lambda messages: [1])
  spec = types.SimpleNamespace(limits=api.Limits("tiny", 256, 16, 32, 8, 2), request_timeout_seconds=30)
  server = serve_frontend.FrontendServer(spec, codec)
  app = serve_app.build_app(server, api_key="")

  async def ask() -> list[tuple[int, bytes]]:
    following = asyncio.create_task(server.read(await server.connect(ours)))
    answers = [_asgi_post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 8, "stream": stream})
               for stream in (False, True)]
    for _ in answers:
      submit = await asyncio.to_thread(serve_frontend.read_frame, theirs)
      theirs.sendall(serve_frontend.frame([("admit", submit[1], None),
                                           ("event", submit[1], job_events.Tokens(0, [ord("c")], [-0.5], [[]]))]))
    await asyncio.sleep(0.2)
    theirs.close()
    out = [await asyncio.wait_for(answer, 10) for answer in answers]
    await following
    return out

  (status, whole), (stream_status, stream) = asyncio.run(ask())
  assert status == 503 and json.loads(whole)["error"]["code"] == "engine_gone", whole
  events = [line for line in stream.decode().splitlines() if line]
  assert stream_status == 200 and events[-1] == "data: [DONE]", events
  assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_gone", events


def test_the_choices_of_one_prompt_score_it_once():
  """Echo with logprobs and n > 1 (or a prompt listed twice): only the first choice with a prompt scores it, the
  others share its scores (serve_routes). Before, every choice's job scored the prompt again."""
  import socket
  import types

  from MaxText.inference import serve_frontend

  submitted: list = []
  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  scheduler = types.SimpleNamespace(load=lambda: {}, submit=submitted.extend)
  serve_processes._Link(0, ours, scheduler, None, threading.Event()).start()
  prompts = [[1, 2], [1, 2], [3], [3], [1, 2]]
  theirs.sendall(serve_frontend.frame(("submit", 0, [(i, p, 0, 0, None) for i, p in enumerate(prompts)], True, None)))
  assert serve_frontend.read_frame(theirs) == [("admit", 0, None)]
  assert [job.score_prompt for job in submitted] == [True, False, True, False, False]
  theirs.close()


def test_a_submit_says_whether_its_jobs_tokens_carry_their_top_alternatives():
  """The front end sends whether the request asked for logprobs >= 1; the engine's jobs carry it
  (Job.top_logprobs: without, the scheduler neither reads nor sends the alternatives), a submit without
  the flag keeps them."""
  import socket
  import types

  from MaxText.inference import serve_frontend

  submitted: list = []
  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  scheduler = types.SimpleNamespace(load=lambda: {}, submit=submitted.extend)
  serve_processes._Link(0, ours, scheduler, None, threading.Event()).start()
  for request_id, flag in enumerate(((False,), (True,), ())):
    theirs.sendall(serve_frontend.frame(("submit", request_id, [(0, [1, 2], 2, 0, None)], False, None, *flag)))
    assert serve_frontend.read_frame(theirs) == [("admit", request_id, None)]
  assert [job.top_logprobs for job in submitted] == [False, True, True]
  theirs.close()

  import asyncio

  from MaxText.inference import openai_api as api

  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  server = serve_frontend.FrontendServer(types.SimpleNamespace(limits=None, request_timeout_seconds=0.2),
                                         types.SimpleNamespace())
  choice = types.SimpleNamespace(index=0, prompt=[1], max_tokens=2, row=0, images=None)

  async def ask() -> None:
    await server.connect(ours)
    for logprobs in (None, 0, 2):
      with pytest.raises(api.ApiError):  # no engine answers here: the request's deadline
        await server.admit(types.SimpleNamespace(choices=[choice], grammar=None, logprobs=logprobs), False)
    await asyncio.sleep(0.1)  # the cancels are written

  asyncio.run(ask())
  sent = [serve_frontend.read_frame(theirs) for _ in range(6)]
  assert [m[5] for m in sent if m[0] == "submit"] == [False, False, True]


def test_load_figures_the_engine_never_sends_are_a_503_and_the_next_caller_asks_again(monkeypatch):
  """/health and /metrics of a front end whose question for the load figures gets no answer: a 503 after a bound,
  and the next call asks again (they waited for ever, and so did every later one: the question stayed pending)."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  monkeypatch.setattr(serve_frontend, "_LOAD_SECONDS", 0.3)
  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  server = serve_frontend.FrontendServer(types.SimpleNamespace(limits=None, request_timeout_seconds=10),
                                         types.SimpleNamespace())

  async def ask() -> list[api.ApiError]:
    await server.connect(ours)
    errors = []
    for _ in range(2):
      with pytest.raises(api.ApiError) as e:
        await asyncio.wait_for(server.refresh(), 5)
      errors.append(e.value)
    return errors

  for error in asyncio.run(ask()):
    assert error.status == 503 and error.body()["error"]["code"] == "engine_busy"
  assert [serve_frontend.read_frame(theirs) for _ in range(2)] == [("load",), ("load",)]


def _items(sock, until) -> list:
  """The items of the messages on `sock` until `until(items)` (the writer sends what queued meanwhile as one)."""
  from MaxText.inference import serve_frontend

  items: list = []
  while not until(items):
    items += serve_frontend.read_frame(sock)
  return items


def test_the_engine_side_serves_lora_adapters_to_every_front_end():
  """Two front ends' channels on socket pairs, one registry (its weights stood in for): an add through one
  front end sends the new name list to both, then its answer; a submit naming the adapter through the other
  gets the adapter's table row and cache key and holds it (a remove is refused as busy) until its Done; a
  removed name's submit is refused as unknown (the front end's 404); a taken name is NameTaken (the route's 409).
  Before, the engine side knew no "adapters" message nor a submit's adapter."""
  import socket
  import types

  from MaxText.inference import lora_adapters, serve_frontend
  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  class Registry(lora_adapters.Registry):  # the name bookkeeping as it is; adding writes no weights
    def add(self, name, path):
      if name in self._by_name:
        raise lora_adapters.NameTaken(f"a LoRA adapter named {name!r} is already loaded")
      loaded = lora_adapters.LoadedAdapter(name, len(self._by_name) + 1, 2, 4.0, ("q_proj",))
      self._by_name[name], self._in_flight[name], self._cache_keys[name] = loaded, 0, name.encode()
      return loaded

  table = types.SimpleNamespace(capacity=3, set_row=lambda params, row, adapter: params)
  registry = Registry(table, "tiny", {})
  registry.add("alpha", "")
  submitted: list = []
  scheduler = types.SimpleNamespace(load=lambda: {}, submit=submitted.extend)
  adapters = serve_processes._Adapters(registry)
  theirs = []
  for index in range(2):
    ours, other = socket.socketpair()
    other.settimeout(10)
    adapters.links.append(serve_processes._Link(index, ours, scheduler, None, threading.Event(), adapters))
    theirs.append(other)
  for link in adapters.links:
    link.start()

  def answer(items) -> bool:
    return any(item[0] in ("adapters", "admit") for item in items)

  theirs[0].sendall(serve_frontend.frame(("adapters", 1, "add", ("kappa", "/adapters/kappa"))))
  assert _items(theirs[0], answer) == [("adapter_names", ("alpha", "kappa")),
                                       ("adapters", 1, lora_adapters.LoadedAdapter("kappa", 2, 2, 4.0, ("q_proj",)))]
  assert _items(theirs[1], bool) == [("adapter_names", ("alpha", "kappa"))]
  theirs[1].sendall(serve_frontend.frame(("submit", 5, [(0, [1, 2], 2, RowParams(), None)], False, None, False,
                                          "kappa")))
  assert _items(theirs[1], answer) == [("admit", 5, None)]
  [job] = submitted
  assert (job.row.adapter, job.cache_key) == (2, b"kappa")
  theirs[0].sendall(serve_frontend.frame(("adapters", 2, "remove", ("kappa",))))
  [(kind, ask, busy)] = _items(theirs[0], answer)
  assert (kind, ask) == ("adapters", 2) and isinstance(busy, lora_admin.AdapterBusy), busy
  job.emit(sched.Done(0, "length"))  # the job's end releases the adapter
  theirs[0].sendall(serve_frontend.frame(("adapters", 3, "remove", ("kappa",))))
  assert _items(theirs[0], answer)[-1] == ("adapters", 3, lora_adapters.LoadedAdapter("kappa", 2, 2, 4.0, ("q_proj",)))
  theirs[1].sendall(serve_frontend.frame(("submit", 6, [(0, [1, 2], 2, RowParams(), None)], False, None, False,
                                          "kappa")))
  assert _items(theirs[1], answer)[-1] == ("admit", 6, ("unknown", "kappa"))
  theirs[1].sendall(serve_frontend.frame(("adapters", 4, "add", ("alpha", "/adapters/alpha"))))
  [(kind, ask, taken)] = _items(theirs[1], answer)
  assert (kind, ask) == ("adapters", 4) and isinstance(taken, lora_admin.NameTaken) and "already loaded" in str(taken)
  theirs[1].sendall(serve_frontend.frame(("adapters", 5, "add")))  # a malformed ask is answered, not left waiting
  [(kind, ask, failed)] = _items(theirs[1], answer)
  assert (kind, ask) == ("adapters", 5) and isinstance(failed, RuntimeError), failed
  for other in theirs:
    other.close()


def test_a_full_adapter_table_reaches_the_front_end_as_itself():
  """Registry.add's SlotsFull crosses the channel as itself, so a front end's admin route answers the one-process 409
  adapter_slots_full (as a plain UserError it would be the route's 400 invalid_adapter)."""
  crossed = serve_processes._portable(lora_admin.SlotsFull("all serve_lora_slots=3 adapter rows are taken"))
  assert type(crossed) is lora_admin.SlotsFull and str(crossed) == "all serve_lora_slots=3 adapter rows are taken"


def test_a_front_end_sends_the_adapter_and_maps_the_engines_adapter_answers():
  """A front end serving adapters: a request naming one sends its name with the submit, and an adapter removed
  meanwhile ("unknown") is the 404 model_not_found; echo with logprobs under it is the one-process 400; the name
  list follows the engine's; an admin answer's refusal is raised as the registry's own, and an add waiting when
  the engine goes is a 503."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  theirs.settimeout(10)
  spec = types.SimpleNamespace(limits=api.Limits("tiny", 272, 16, 32, 8, 2), request_timeout_seconds=5)
  server = serve_frontend.FrontendServer(spec, types.SimpleNamespace())
  server.serve_adapters(("alpha",))
  admin = server.adapter_admin()
  choice = types.SimpleNamespace(index=0, prompt=[1], max_tokens=2, row=0, images=None)
  request = types.SimpleNamespace(model="alpha", choices=[choice], grammar=None, logprobs=None)

  async def ask() -> list:
    reader = await server.connect(ours)
    following = asyncio.create_task(server.read(reader))
    with pytest.raises(api.ApiError) as echo:
      await server.admit(request, True)
    admitting = asyncio.create_task(server.admit(request, False))
    await asyncio.sleep(0.1)
    submit = serve_frontend.read_frame(theirs)
    theirs.sendall(serve_frontend.frame([("adapter_names", ("alpha", "kappa")), ("admit", submit[1], ("unknown",
                                                                                                      "alpha"))]))
    with pytest.raises(api.ApiError) as unknown:
      await asyncio.wait_for(admitting, 5)
    adding = asyncio.create_task(admin.add("alpha", "/x"))
    await asyncio.sleep(0.1)
    add = serve_frontend.read_frame(theirs)
    theirs.sendall(serve_frontend.frame([("adapters", add[1], lora_admin.NameTaken("taken"))]))
    with pytest.raises(lora_admin.NameTaken):
      await asyncio.wait_for(adding, 5)
    adding = asyncio.create_task(admin.add("beta", "/x"))
    await asyncio.sleep(0.1)
    theirs.close()
    with pytest.raises(api.ApiError) as gone:
      await asyncio.wait_for(adding, 5)
    await following
    return [submit, echo.value, unknown.value, add, gone.value]

  submit, echo, unknown, add, gone = asyncio.run(ask())
  assert submit[0] == "submit" and submit[6] == "alpha"
  assert echo.status == 400 and "base model only" in str(echo.body())
  assert unknown.status == 404 and unknown.body()["error"]["code"] == "model_not_found"
  assert list(server.limits.adapter_names()) == ["alpha", "kappa"] and admin.names() == ("alpha", "kappa")
  assert add == ("adapters", 0, "add", ("alpha", "/x"))
  assert gone.status == 503 and gone.body()["error"]["code"] == "engine_gone"


@pytest.mark.slow  # two servers with LoRA adapter tables (JAX start-up and compiles each)
def test_lora_adapters_through_two_front_ends_answer_as_the_one_process_server(endless_tokenizer, tmp_path):
  """Two front ends: a request per adapter (the start-up ones and one added while serving) gets the one-process
  server's greedy text; an adapter added through one front end is listed and usable through the other (the
  other stopped with SIGSTOP while one answers: both accept on the one socket), 409 to remove while a stream
  decodes with it, removable after, then 404; an unknown model is the one-process 404; 401 without the key."""
  from tests.inference.test_lora_adapters import ADAPTERS, write_adapter

  model = {k: v for k, v in KEYS.items() if not k.startswith(("serve_", "kv_"))}
  for i, (name, rank, alpha, targets) in enumerate(ADAPTERS):
    write_adapter(tmp_path / name, rank, alpha, targets, seed=30 + i, **model)
  # A long dense cache: a stream far longer than the test holds its adapter (slower steps too).
  keys = dict(serve_lora_adapters=",".join(f"{n}={tmp_path / n}" for n, *_ in ADAPTERS[:2]), serve_lora_slots=3,
              serve_lora_max_rank=4, max_target_length=32768, serve_max_tokens=32000)
  auth = {"Authorization": f"Bearer {KEY}"}
  kappa = {"name": "kappa", "path": str(tmp_path / "kappa")}

  def post(server, route, body, **kw):  # a new connection each time: it reaches whichever front end runs
    return httpx.post(f"{server.url}{route}", json=body, timeout=120, **{"headers": auth, **kw})

  def texts(server) -> list[str]:
    return [post(server, "/v1/completions", {"model": pick, "prompt": p, "max_tokens": 8, "temperature": 0}
                 ).json()["choices"][0]["text"] for pick in ("tiny", "alpha", "beta", "kappa") for p in PROMPTS[:2]]

  one = CliServer(endless_tokenizer, 0, **keys)
  try:
    assert post(one, "/v1/admin/lora_adapters", kappa).status_code == 200
    expected = texts(one)
    unknown = post(one, "/v1/completions", {"model": "delta", "prompt": "to be", "max_tokens": 2}).json()
  finally:
    one.stop()
  assert len(set(expected)) > 2  # the adapters change the text

  server = CliServer(endless_tokenizer, 2, **keys)
  first, second = server.front_ends()
  try:
    models = httpx.get(f"{server.url}/v1/models", headers=auth, timeout=60).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "alpha", "beta"]
    assert post(server, "/v1/admin/lora_adapters", kappa, headers={}).status_code == 401
    os.kill(second, signal.SIGSTOP)
    added = post(server, "/v1/admin/lora_adapters", kappa)  # through the first front end
    assert added.status_code == 200 and added.json()["row"] == 3, added.text
    os.kill(second, signal.SIGCONT)
    os.kill(first, signal.SIGSTOP)  # from here on, the second answers
    models = httpx.get(f"{server.url}/v1/models", headers=auth, timeout=60).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "alpha", "beta", "kappa"]
    assert texts(server) == expected
    assert post(server, "/v1/completions", {"model": "delta", "prompt": "to be", "max_tokens": 2}).json() == unknown
    body = {"model": "kappa", "prompt": PROMPTS[0], "max_tokens": 32000, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth, timeout=60) as stream:
      assert next(stream.iter_lines()).startswith("data: ")
      busy = httpx.delete(f"{server.url}/v1/admin/lora_adapters/kappa", headers=auth, timeout=60)
      assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_busy", busy.text
    deadline = time.monotonic() + 20  # the stream's job is cancelled within a second or so: the adapter is free
    while (removed := httpx.delete(f"{server.url}/v1/admin/lora_adapters/kappa", headers=auth,
                                   timeout=60)).status_code == 409:
      assert time.monotonic() < deadline, removed.text
      time.sleep(0.2)
    assert removed.status_code == 200 and removed.json()["deleted"], removed.text
    gone = post(server, "/v1/completions", {"model": "kappa", "prompt": "to be", "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
  finally:
    for pid in (first, second):
      os.kill(pid, signal.SIGCONT)
    assert server.stop() == 0


def test_load_figures_asked_when_the_engine_goes_are_a_503_not_the_last_figures():
  """/health and /metrics of a front end whose engine's process goes while they wait for its figures: a 503
  engine_gone. Before, the question was ended as if answered and /health said "ok" with the last figures (a load
  balancer kept sending requests to a server that was gone)."""
  import asyncio
  import socket
  import types

  from MaxText.inference import openai_api as api
  from MaxText.inference import serve_frontend

  ours, theirs = socket.socketpair()
  server = serve_frontend.FrontendServer(types.SimpleNamespace(limits=None, request_timeout_seconds=10),
                                         types.SimpleNamespace())

  async def ask() -> api.ApiError:
    reader = await server.connect(ours)
    following = asyncio.create_task(server.read(reader))
    asking = asyncio.create_task(server.refresh())
    await asyncio.sleep(0.1)
    assert serve_frontend.read_frame(theirs) == ("load",)
    theirs.close()
    with pytest.raises(api.ApiError) as e:
      await asyncio.wait_for(asking, 5)
    await following
    return e.value

  error = asyncio.run(ask())
  assert error.status == 503 and error.body()["error"]["code"] == "engine_gone", error.body()


@pytest.mark.slow  # a server with room for long answers
@pytest.mark.parametrize("processes", [0, 1])
def test_sigterm_ends_open_requests_with_an_error_after_the_drain(endless_tokenizer, processes):
  """SIGTERM while a long stream and a long unstreamed request are open: the server (its front end, or in one process
  the engine's) lets them run serve_app.DRAIN_SECONDS, then ends the stream with an error event and [DONE] and the
  other with a 503 engine_gone (their jobs cancelled), and every process exits. Before, a front end waited until the
  engine's process killed it 10 s after the signal (the stream cut mid-answer, "incomplete chunked read"), and the
  one-process server waited for ever: uvicorn's graceful shutdown has no time limit."""
  from MaxText.inference import serve_app

  server = CliServer(endless_tokenizer, processes, max_target_length=32768, max_prefill_predict_length=32,
                     serve_max_tokens=32000, serve_max_slots=2)
  headers = {"Authorization": f"Bearer {KEY}"}
  body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 32000}
  unstreamed: list = []
  try:
    waiting = threading.Thread(target=lambda: unstreamed.append(
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)))
    waiting.start()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as stream:
      lines = stream.iter_lines()
      assert next(lines).startswith("data: ")
      deadline = time.monotonic() + 60
      while httpx.get(f"{server.url}/health", timeout=10).json()["slots_in_use"] < 2:  # both decoding
        assert time.monotonic() < deadline, "the unstreamed request did not start"
        time.sleep(0.1)
      front_ends = server.front_ends()
      server.process.send_signal(signal.SIGTERM)
      stopped = time.monotonic()
      tail: list[str] = []
      for line in lines:  # RemoteProtocolError before for a front end: the stream was cut
        if line:
          tail = [*tail[-1:], line]
        # Before, in one process: the stream went on until its 32000 tokens.
        assert time.monotonic() - stopped < serve_app.DRAIN_SECONDS + 30, "the stream outlived the drain"
    assert tail[-1] == "data: [DONE]", tail
    error = json.loads(tail[0][len("data: "):])["error"]
    assert error["code"] == "engine_gone" and "the server is stopping" in error["message"], error
    waiting.join(60)
    [answer] = unstreamed
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_gone", answer.text
    # One process: uvicorn re-raises the SIGTERM it caught once it has stopped.
    assert server.process.wait(60) in ((0, -signal.SIGTERM) if processes == 0 else (0,))
    for pid in front_ends:
      assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid
  finally:
    if server.process.poll() is None:
      server.process.kill()
