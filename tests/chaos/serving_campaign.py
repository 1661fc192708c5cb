"""A seeded fault campaign against a real server: MaxText.serve's app under uvicorn on 127.0.0.1
(a tiny random model, the paged KV cache with a small pool, few slots, an API key), hit
concurrently by a seeded mix of requests:

    python3 -m tests.chaos.serving_campaign --seed 0 --requests 1000 [--workers 12]

  well-formed  greedy completions and chat (streamed or not, n=2, stop strings, logprobs), seeded
               sampling, a prompt that needs 12 of the pool's 16 pages; some send `bearer` in
               lower case
  scoring      echo + max_tokens 0 + logprobs (what lm-eval sends for log-likelihoods)
  malformed    invalid or too-deep JSON, wrong types, integers beyond a float's range, unknown
               model, unsupported fields, values past the limits, a missing or wrong API key
  oversized    prompts longer than max_prefill_predict_length, bodies over serve_max_body_bytes
  disconnects  a stream dropped after a few chunks; a client that gives up while waiting

Checks: every well-formed request (scoring included) gets its single-request answer, computed
alone before the load: the same tokens and text exactly, log-probabilities within LOGPROB_TOLERANCE
(with prefix caching a prompt whose first pages are cached prefills only its tail, a differently
shaped float32 computation); every malformed or oversized one gets a 4xx JSON error; no 5xx
and no 503 (the workers never exceed slots + serve_max_queue); /health answers throughout; after
the load /health shows no slot in use, nothing queued, no page reserved and every page free.
Bounded: each request has a client timeout and the load a deadline.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
KEY = "chaos-key"
MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=272, max_target_length=48, max_prefill_predict_length=32,
             dtype="float32", print_config=False, tokenizer_type="huggingface", add_bos=False,
             kv_cache_layout="paged", kv_page_size=4, kv_num_pages=16)  # a third of 4 slots x 12 pages
LIMITS = dict(serve_max_slots=4, serve_max_queue=24, serve_max_tokens=16, serve_max_n=2, serve_max_body_bytes=4096,
              serve_model_name="tiny", serve_request_timeout_seconds=60)
TEXTS = ["the quick brown fox", "to be or not", "shall i compare thee", "a lazy dog", "you are helpful",
         "is that so", "continue this line", "that is the question"]
HUGE = "1" + "0" * 400  # a valid JSON integer beyond a float's range
REQUEST_TIMEOUT = 60.0
LOAD_DEADLINE = 240.0  # then the remaining requests are skipped (and reported)
WELL_FORMED = ("greedy", "sampled", "scoring")
LOGPROB_TOLERANCE = 1e-4
MIX = (("greedy", 40), ("sampled", 8), ("scoring", 12), ("malformed", 18), ("oversized", 7),
       ("disconnect-stream", 9), ("disconnect-waiting", 6))


@dataclasses.dataclass(frozen=True)
class Spec:
  kind: str
  path: str
  body: str
  stream: bool = False
  key: str | None = KEY
  scheme: str = "Bearer"
  chunks: int = 0  # disconnect-stream: chunks read before hanging up
  patience: float = 0.0  # disconnect-waiting: seconds before the client gives up


@dataclasses.dataclass
class Outcome:
  status: int  # 0: no answer (the client hung up or failed)
  answer: Any
  seconds: float
  error: str = ""


def _completion(prompt: Any, max_tokens: int, **extra: Any) -> str:
  return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra})


def well_formed_pool(rng: random.Random, long_ids: list[int]) -> list[Spec]:
  """The distinct well-formed requests the campaign repeats (each one's answer is taken alone first)."""
  pool = []
  for i, text in enumerate(TEXTS):
    stream = i % 2 == 1
    extra: dict[str, Any] = {"temperature": 0, "stream": stream}
    if i % 3 == 0:
      extra["n"] = 2
    if i % 4 == 2:
      extra["stop"] = ["e "]
    if i % 4 == 0 and not stream:
      extra["logprobs"] = 2
    pool.append(Spec("greedy", "/v1/completions", _completion(text, rng.randint(1, 16), **extra), stream=stream,
                     scheme="bearer" if i % 3 == 1 else "Bearer"))
  for text in ("to be or not", "is that so", "a lazy dog"):  # the chat template's markers take 26 tokens
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": 0,
                       "max_tokens": rng.randint(1, 12)})
    pool.append(Spec("greedy", "/v1/chat/completions", body))
  pool.append(Spec("greedy", "/v1/completions", _completion(long_ids, 16, temperature=0)))  # 12 of 16 pages
  for text in TEXTS[3:6]:
    pool.append(Spec("sampled", "/v1/completions", _completion(text, rng.randint(4, 16), temperature=1.0, top_p=0.9,
                                                               seed=rng.randint(0, 2**31), n=2)))
  for prompt in (TEXTS[0], TEXTS[2], long_ids):
    pool.append(Spec("scoring", "/v1/completions", _completion(prompt, 0, echo=True, logprobs=1)))
  return pool


def malformed(rng: random.Random) -> Spec:
  c = "/v1/completions"
  bodies = [
      '{"model": "tiny", "prompt": "the", ', '[1, 2, 3]', "[" * 2000,
      '{"model": "/etc/passwd", "prompt": "the"}', f'{{"model": "tiny", "prompt": "the", "temperature": {HUGE}}}',
      f'{{"model": "tiny", "prompt": "the", "top_p": {HUGE}}}', f'{{"model": "tiny", "prompt": "the", "n": {HUGE}}}',
      f'{{"model": "tiny", "prompt": "the", "max_tokens": {HUGE}}}', '{"model": "tiny", "prompt": "the", "max_tokens": -3}',
      '{"model": "tiny", "prompt": "the", "max_tokens": 17}', '{"model": "tiny", "prompt": "the", "n": 3}',
      '{"model": "tiny", "prompt": "the", "temperature": "hot"}', '{"model": "tiny", "prompt": "the", "temperature": 1e999}',
      '{"model": "tiny", "prompt": "the", "stop": ["a", "b", "c", "d", "e"]}', '{"model": "tiny", "prompt": ""}',
      '{"model": "tiny", "prompt": [99999]}', '{"model": "tiny", "prompt": "the", "logit_bias": {"1": 5}}',
      '{"model": "tiny", "prompt": "the", "max_tokens": 0}', '{"model": "tiny", "prompt": {"text": "the"}}',
  ]
  choice = rng.randrange(len(bodies) + 3)
  if choice == len(bodies):
    return Spec("malformed", c, _completion("the", 4), key=None)
  if choice == len(bodies) + 1:
    return Spec("malformed", c, _completion("the", 4), key="wrong")
  if choice == len(bodies) + 2:
    return Spec("malformed", "/v1/chat/completions", '{"model": "tiny", "messages": "hello"}')
  return Spec("malformed", c, bodies[choice])


def oversized(rng: random.Random) -> Spec:
  if rng.random() < 0.5:
    return Spec("oversized", "/v1/completions", _completion("the quick brown fox " * rng.randint(9, 40), 4))
  return Spec("oversized", "/v1/completions", _completion("x" * rng.randint(4100, 20000), 4))


def plan(seed: int, count: int, long_ids: list[int]) -> tuple[list[Spec], list[Spec]]:
  """The seeded request list and the well-formed pool it draws from."""
  rng = random.Random(seed)
  pool = well_formed_pool(rng, long_ids)
  kinds, weights = zip(*MIX)
  specs = []
  for kind in rng.choices(kinds, weights, k=count):
    if kind in WELL_FORMED:
      specs.append(rng.choice([s for s in pool if s.kind == kind]))
    elif kind == "malformed":
      specs.append(malformed(rng))
    elif kind == "oversized":
      specs.append(oversized(rng))
    elif kind == "disconnect-stream":
      body = _completion(rng.choice(TEXTS), 16, temperature=0, stream=True)
      specs.append(Spec(kind, "/v1/completions", body, stream=True, chunks=rng.randint(0, 4)))
    else:
      body = _completion(rng.choice(TEXTS), 16, temperature=0)
      specs.append(Spec(kind, "/v1/completions", body, patience=rng.uniform(0.005, 0.3)))
  return specs, pool


def _headers(spec: Spec) -> dict[str, str]:
  headers = {"content-type": "application/json"}
  if spec.key is not None:
    headers["authorization"] = f"{spec.scheme} {spec.key}"
  return headers


def _stream_answer(lines: Any) -> dict[str, Any]:
  """A stream's choices as (text, finish_reason) by index, and whether it ended with [DONE]."""
  texts: dict[int, str] = collections.defaultdict(str)
  finish: dict[int, Any] = {}
  errors, done = [], False
  for line in lines:
    if not line.startswith("data: "):
      continue
    data = line.removeprefix("data: ")
    if data == "[DONE]":
      done = True
      continue
    chunk = json.loads(data)
    if "error" in chunk:
      errors.append(chunk["error"])
      continue
    for choice in chunk["choices"]:
      piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
      texts[choice["index"]] += piece or ""
      if choice["finish_reason"] is not None:
        finish[choice["index"]] = choice["finish_reason"]
  return {"texts": dict(texts), "finish": finish, "errors": errors, "done": done}


def send(httpx: Any, client: Any, url: str, spec: Spec) -> Outcome:
  start = time.monotonic()
  try:
    if spec.kind == "disconnect-stream":
      with httpx.Client(timeout=REQUEST_TIMEOUT) as own:  # its own connection, closed mid-stream
        with own.stream("POST", url + spec.path, content=spec.body, headers=_headers(spec)) as response:
          lines = response.iter_lines()
          for _ in range(spec.chunks):
            next(lines, None)
          return Outcome(response.status_code, None, time.monotonic() - start)
    if spec.kind == "disconnect-waiting":
      with httpx.Client(timeout=spec.patience) as own:
        try:
          response = own.post(url + spec.path, content=spec.body, headers=_headers(spec))
          return Outcome(response.status_code, None, time.monotonic() - start)
        except httpx.TimeoutException:
          return Outcome(0, None, time.monotonic() - start)
    if spec.stream:
      with client.stream("POST", url + spec.path, content=spec.body, headers=_headers(spec)) as response:
        if response.status_code != 200:
          response.read()
          return Outcome(response.status_code, _json(response), time.monotonic() - start)
        return Outcome(200, _stream_answer(response.iter_lines()), time.monotonic() - start)
    response = client.post(url + spec.path, content=spec.body, headers=_headers(spec))
    answer = _json(response)
    if response.status_code == 200:
      answer = {"choices": answer["choices"], "usage": answer["usage"]}  # without the id and the time
    return Outcome(response.status_code, answer, time.monotonic() - start)
  except Exception as e:  # noqa: BLE001 - recorded as a failed request, checked by the caller
    return Outcome(0, None, time.monotonic() - start, f"{type(e).__name__}: {e}")


def same_answer(a: Any, b: Any) -> bool:
  """Equal structure, strings and integers; floats (the log-probabilities) within LOGPROB_TOLERANCE."""
  if isinstance(a, float) and isinstance(b, float):
    return abs(a - b) <= LOGPROB_TOLERANCE
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(same_answer(a[k], b[k]) for k in a)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(same_answer(x, y) for x, y in zip(a, b))
  return type(a) is type(b) and a == b


def _json(response: Any) -> Any:
  if not response.headers.get("content-type", "").startswith("application/json"):
    return {"not_json": response.text[:200]}
  return response.json()


class LiveServer:
  """build_server + build_app under uvicorn on 127.0.0.1, on a thread of this process."""

  def __init__(self, tmp: Path):
    import uvicorn

    sys.path.insert(0, str(TESTS / "input_pipeline"))
    sys.path.insert(0, str(TESTS / "inference"))
    from decode_test_utils import one_device_mesh
    from sft_fixtures import CHATML, write_tokenizer, without_markers

    from MaxText.configuration.config import Config
    from MaxText.serve import build_app, build_server

    tokenizer = write_tokenizer(tmp / "tok", without_markers(CHATML))
    self.server = build_server(Config.for_testing(**MODEL, **LIMITS, tokenizer_path=str(tokenizer)),
                               mesh=one_device_mesh())
    app = build_app(self.server, api_key=KEY, max_body_bytes=LIMITS["serve_max_body_bytes"])
    self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    self.thread = threading.Thread(target=self.uv.run, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 120
    while not self.uv.started:
      if time.monotonic() > deadline or not self.thread.is_alive():
        raise RuntimeError("the server did not start")
      time.sleep(0.05)
    self.url = f"http://127.0.0.1:{self.uv.servers[0].sockets[0].getsockname()[1]}"

  def close(self) -> None:
    self.uv.should_exit = True
    self.thread.join(30)
    self.server.scheduler.stop()


class HealthProbe:
  """GET /health every `period` seconds on its own thread: failures and the slowest answer."""

  def __init__(self, httpx: Any, url: str, period: float = 0.25):
    self.httpx, self.url, self.period = httpx, url, period
    self.answers, self.failures, self.slowest = 0, [], 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    with self.httpx.Client(timeout=10) as client:
      while not self._stop.wait(self.period):
        start = time.monotonic()
        try:
          ok = client.get(self.url + "/health").json()["status"] == "ok"
        except Exception as e:  # noqa: BLE001 - a failed probe is what this counts
          ok, e_text = False, f"{type(e).__name__}: {e}"
        else:
          e_text = "" if ok else "status not ok"
        self.slowest = max(self.slowest, time.monotonic() - start)
        if ok:
          self.answers += 1
        else:
          self.failures.append(e_text)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(30)


def wait_idle(httpx: Any, url: str, timeout: float = 60.0) -> dict[str, Any]:
  """/health once nothing is in flight and every page is back (or as it is at the deadline)."""
  deadline = time.monotonic() + timeout
  while True:
    health = httpx.get(url + "/health", timeout=10).json()
    idle = (health["slots_in_use"] == 0 and health["queue_length"] == 0 and health["pages_reserved"] == 0
            and health["pages_free"] == health["pages_total"])
    if idle or time.monotonic() > deadline:
      return health
    time.sleep(0.1)


def _expected_status(spec: Spec, outcome: Outcome) -> str:
  """'' when the outcome is what the request's kind must get, else what is wrong."""
  if spec.kind in ("malformed", "oversized"):
    error = outcome.answer.get("error") if isinstance(outcome.answer, dict) else None
    if not 400 <= outcome.status < 500 or not isinstance(error, dict) or not error.get("message"):
      return f"wanted a 4xx JSON error, got {outcome.status} {str(outcome.answer)[:200]} {outcome.error}"
    return ""
  if spec.kind == "disconnect-stream":
    return "" if outcome.status == 200 else f"stream answered {outcome.status} {outcome.error}"
  if spec.kind == "disconnect-waiting":
    return "" if outcome.status in (0, 200) and not outcome.error else f"got {outcome.status} {outcome.error}"
  return "" if outcome.status == 200 else f"got {outcome.status} {str(outcome.answer)[:200]} {outcome.error}"


def run(seed: int = 0, requests: int = 1000, workers: int = 12, verbose: bool = True) -> dict[str, Any]:
  try:  # the openai client's HTTP library (httpx2 in openai 3.x, httpx before)
    import httpx2 as httpx
  except ImportError:
    import httpx

  with tempfile.TemporaryDirectory(prefix="serving-chaos-") as tmp:
    live = LiveServer(Path(tmp))
    try:
      long_ids = (live.server.codec.encode("the quick brown fox jumps over a lazy dog ") * 8)[:32]
      specs, pool = plan(seed, requests, long_ids)
      with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        alone = {spec: send(httpx, client, live.url, spec) for spec in pool}  # the single-request answers
      bad_reference = [f"{s.body[:80]}: {o.status} {o.error}" for s, o in alone.items() if o.status != 200]
      probe = HealthProbe(httpx, live.url)
      start = time.monotonic()
      local = threading.local()

      def one(spec: Spec) -> tuple[Spec, Outcome]:
        if not hasattr(local, "client"):
          local.client = httpx.Client(timeout=REQUEST_TIMEOUT)
        if time.monotonic() - start > LOAD_DEADLINE:
          return spec, Outcome(0, None, 0.0, "skipped: past the campaign's deadline")
        return spec, send(httpx, local.client, live.url, spec)

      with ThreadPoolExecutor(workers) as executor:
        results = list(executor.map(one, specs))
      elapsed = time.monotonic() - start
      after = wait_idle(httpx, live.url)
      probe.stop()
      final = send(httpx, httpx.Client(timeout=REQUEST_TIMEOUT), live.url, pool[0])
    finally:
      live.close()

  kinds = collections.Counter(spec.kind for spec in specs)
  unexpected = [f"{spec.kind} {spec.body[:80]!r}: {why}" for spec, outcome in results
                if (why := _expected_status(spec, outcome))]
  mismatches = [f"{spec.kind} {spec.body[:80]!r}" for spec, outcome in results
                if spec.kind in WELL_FORMED and outcome.status == 200 and not same_answer(outcome.answer, alone[spec].answer)]
  if not same_answer(final.answer, alone[pool[0]].answer):
    mismatches.append("the request after the load")
  well_formed = [outcome for spec, outcome in results if spec.kind in WELL_FORMED]
  equal = sum(outcome.status == 200 and same_answer(outcome.answer, alone[spec].answer) for spec, outcome in results
              if spec.kind in WELL_FORMED)
  figures = {
      "seed": seed, "requests": requests, "workers": workers, "elapsed_s": round(elapsed, 1), "kinds": dict(kinds),
      "well_formed": len(well_formed), "equal_to_alone": equal,
      "mismatches": mismatches, "unexpected": unexpected, "bad_reference": bad_reference,
      "max_latency_s": round(max((o.seconds for o in well_formed), default=0.0), 2),
      "health_probes": probe.answers, "health_failures": probe.failures,
      "health_slowest_s": round(probe.slowest, 3), "after": after,
  }
  if verbose:
    faults = ", ".join(f"{k} {kinds[k]}" for k, _ in MIX if k not in ("greedy", "sampled"))
    print(f"serving chaos: seed {seed}, {requests} requests ({workers} concurrent) in {elapsed:.0f} s; "
          f"{figures['equal_to_alone']}/{len(well_formed)} well-formed equal to their single-request answers; "
          f"faults: {faults}; {len(unexpected)} unexpected statuses; max latency {figures['max_latency_s']} s; "
          f"/health answered {probe.answers} probes ({len(probe.failures)} failed, slowest "
          f"{figures['health_slowest_s']} s); after: {after['slots_in_use']} slots in use, {after['queue_length']} "
          f"queued, {after['pages_reserved']} pages reserved, {after['pages_free']}/{after['pages_total']} free",
          flush=True)
  return figures


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--requests", type=int, default=1000)
  parser.add_argument("--workers", type=int, default=12)
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  figures = run(args.seed, args.requests, args.workers)
  print(json.dumps(figures, indent=1))
  sys.exit(1 if figures["mismatches"] or figures["unexpected"] or figures["health_failures"]
           or figures["bad_reference"] else 0)


if __name__ == "__main__":
  main()
