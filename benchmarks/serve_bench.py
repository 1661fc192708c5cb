"""The OpenAI-compatible server under load on CPU: output tokens/s, time to first token (TTFT) and
inter-token latency (ITL) p50/p99 against the number of concurrent clients, and KV cache memory.

    nice -n 5 python3 benchmarks/serve_bench.py [concurrency=1,4,16] [requests_per_client=4]
        [max_tokens=32] [serve_max_slots=16] [base_emb_dim=256] [base_num_decoder_layers=4]
        [caches=dense,paged] [kv_page_size=16] [kv_num_pages=0] [prefill_chunk_sizes=0,64] [long_prompt=0]
        [shared_prefix=0] [prefix_caching=true,false] [speculative_tokens=0,4] [draft=small|self]
        [decode_steps_per_call=1,8] [step_reference=true] [serve_http_processes=0,1] [scheduler_alone=true]

A small random-init model (greedy, no end-of-sequence token, so every request makes max_tokens
tokens) is served in this process on 127.0.0.1 through the real app (uvicorn, the scheduler
thread); asyncio clients, in a process of their own (their CPU is not the server's), each on one
keep-alive connection read by a few lines of asyncio (an HTTP library's per-chunk work would take
the server's CPU on a small machine), stream `/v1/completions` with token-id prompts of mixed lengths and
`logprobs: 0`, which lists each token of a server-sent event (the tokens that reached the stream
together share one), stamped at its event's arrival: TTFT is send → first token, ITL the gaps
between a request's later tokens. Compilation happens in a warm-up round, untimed.
long_prompt=N adds a mixed load: while the clients stream, one more client sends prompts of N
tokens (one new token each) back to back; the table then reports the short streams' latencies,
which a long prefill stalls unless it is chunked (prefill_chunk_sizes, paged layout only).
shared_prefix=N starts every prompt with the same N tokens (a system prompt), and runs the
measured load once untimed first; prefix_caching serves the paged layout with prefix caching
on and/or off, and the memory line reports the most pages in use at once.
speculative_tokens=0,4 serves each layout without and with speculative decoding (k draft tokens
per round); draft=small is a 1-layer model of half the width, draft=self the target's own
architecture, whose random initialisation is the target's (an acceptance-rate-1 upper bound on
what a perfect draft could give, paying for a full-size draft). With random weights a small
draft's acceptance rate says nothing about a trained one; the line after each table prints it.
decode_steps_per_call=1,8 serves each layout with each value (decode steps per device call).
With step_reference=true the table gains ITL mean: each request's (last token - first token) /
(tokens - 1), averaged (with several steps per call a call's tokens arrive together, so the median
gap says little); it also times the same model's jitted decode step alone (1 slot, one call per
step, the host reading the tokens only at the end, as decode.py does) and prints `RESULT host ...`:
the 1-client mean ITL over that step time, and the most clients' output tokens/s over 1 client's.
serve_http_processes=0,1 serves each configuration with HTTP in the engine's process (0) and in that
many front-end processes of its own (inference/serve_processes.py), in turn. After each table a line
gives the CPU time per output token over its timed rounds of the server's process (the engine, and
with serve_http_processes=0 the HTTP too) and of the front-end processes together (less noisy than
the rates on a loaded machine).
scheduler_alone=true measures the scheduler without HTTP instead: requests_per_client x 8 jobs submitted
1 and then 8 at a time, tokens/s and the CPU per token of the scheduler thread (from its schedstat)
and of the whole process (that thread, XLA's threads, the submitting one), per configuration.
Prints a Markdown table (getting_started/Serving.md holds the measured one).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.errors import UserError  # noqa: E402
from benchmarks import bench_args  # noqa: E402


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"emb": "base_emb_dim", "layers": "base_num_decoder_layers", "vocab": "vocab_size",
           "page_size": "kv_page_size", "pages": "kv_num_pages", "slots": "serve_max_slots"}


def _tokenizer(directory: Path, vocab_size: int) -> Path:
  """A byte-level BPE tokenizer with no end-of-sequence token (requests then run to max_tokens)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  words = "the quick brown fox jumps over a lazy dog to be or not that is the question".split()
  tokenizer.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 8,
                                trainers.BpeTrainer(vocab_size=vocab_size,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  # The corpus runs out of merges before vocab_size: filler tokens make every id the clients draw,
  # [3, vocab_size), one the tokenizer has (the server refuses prompt ids past the tokenizer's vocabulary).
  tokenizer.add_tokens([f"<fill{i}>" for i in range(vocab_size - tokenizer.get_vocab_size())])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text("{}")
  return directory


def _percentile(values: list[float], q: float) -> float:
  import numpy as np

  return float(np.percentile(values, q)) if values else float("nan")


class _Connection:
  """One keep-alive HTTP/1.1 connection of a client: a POST whose answer (chunked, as the server
  streams) is read line by line. A few lines over asyncio's streams: the clients' process shares
  the machine with the server, and an HTTP library's own per-chunk work would be measured as the
  server's lost CPU."""

  def __init__(self, url: str):
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    self.host, self.port, self.path = parts.hostname, parts.port, parts.path
    self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

  async def post_lines(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """The answer's body lines (bytes, without their line ends) as they arrive."""
    if self._streams is None:
      self._streams = await asyncio.open_connection(self.host, self.port)
    reader, writer = self._streams
    payload = json.dumps(body).encode()
    writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
      name, _, value = line.decode("latin-1").partition(":")
      headers[name.strip().lower()] = value.strip()
    assert status.split()[1:2] == [b"200"], (status, headers)
    assert headers.get("transfer-encoding") == "chunked", headers
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
      pending += (await reader.readexactly(size + 2))[:-2]
      *lines, pending = pending.split(b"\n")
      for line in lines:
        yield line
    await reader.readline()  # the empty trailer
    if pending:
      yield pending

  def close(self) -> None:
    if self._streams is not None:
      self._streams[1].close()


async def _one(connection: _Connection, prompt: list[int], max_tokens: int, times: dict) -> None:
  body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "logprobs": 0}
  start = time.perf_counter()
  stamps: list[float] = []
  async for line in connection.post_lines(body):
    if line.startswith(b"data: ") and line != b"data: [DONE]":
      chunk = json.loads(line[len(b"data: "):])
      stamps.extend([time.perf_counter()] * len((chunk["choices"][0].get("logprobs") or {}).get("tokens", [])))
  times["ttft"].append(stamps[0] - start)
  times["itl"].extend(b - a for a, b in zip(stamps, stamps[1:]))
  if len(stamps) > 1:
    times.setdefault("itl_mean", []).append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
  times["tokens"] += len(stamps)


async def _round(url: str, concurrency: int, num_requests: int, max_tokens: int, prompt_lengths: list[int],
                 vocab: int, long_prompt: int = 0, shared_prefix: int = 0) -> dict:
  import numpy as np

  rng = np.random.default_rng(concurrency)
  prefix = [int(t) for t in np.random.default_rng(12345).integers(3, vocab, shared_prefix)]
  prompts = [prefix + [int(t) for t in rng.integers(3, vocab, prompt_lengths[i % len(prompt_lengths)])]
             for i in range(num_requests)]
  times: dict = {"ttft": [], "itl": [], "tokens": 0}
  connections = [_Connection(url) for _ in range(concurrency + 1)]
  queue = list(reversed(prompts))
  finished = asyncio.Event()

  async def client(connection: _Connection) -> None:  # one request at a time, as many clients as `concurrency`
    while queue:
      await _one(connection, queue.pop(), max_tokens, times)

  async def long_prompts(connection: _Connection) -> None:  # their own times are not counted
    other: dict = {"ttft": [], "itl": [], "tokens": 0}
    while not finished.is_set():
      await _one(connection, [int(t) for t in rng.integers(3, vocab, long_prompt)], 1, other)

  async def short_ones() -> None:
    await asyncio.gather(*[client(c) for c in connections[:concurrency]])
    finished.set()

  start = time.perf_counter()
  await asyncio.gather(short_ones(), *([long_prompts(connections[-1])] if long_prompt else []))
  times["wall"] = time.perf_counter() - start
  for connection in connections:
    connection.close()
  return times


def _round_here(*args: Any) -> dict:
  return asyncio.run(_round(*args))


class Clients:
  """The clients' rounds run in one spawned process (started once, nothing of the server's imported there)."""

  def __init__(self) -> None:
    self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

  def round(self, *args: Any) -> dict:
    """`_round`'s times for these arguments, measured in the clients' process."""
    return self._pool.submit(_round_here, *args).result()

  def close(self) -> None:
    self._pool.shutdown()


def _compile_prefills(scheduler: Any, vocab: int, prompt_length: int) -> None:
  """Compiles the prefill of each number of requests the scheduler may admit in one loop (a power of
  two up to the slots): that many jobs submitted at once, waited for."""
  import numpy as np

  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  rng, rows = np.random.default_rng(7), 1
  while True:
    done = threading.Semaphore(0)
    scheduler.submit([sched.Job(0, [int(t) for t in rng.integers(3, vocab, prompt_length)], 2, RowParams(),
                                lambda event: done.release() if isinstance(event, sched.Done) else None)
                      for _ in range(rows)])
    for _ in range(rows):
      done.acquire()
    if rows >= scheduler.engine.num_slots:
      return
    rows = min(2 * rows, scheduler.engine.num_slots)


def start_server(config: Any) -> tuple[Any, Any, threading.Thread, str]:
  """MaxText.serve's app for `config` on one device under uvicorn on a free 127.0.0.1 port, no API key:
  (server, uvicorn server, its thread, the completions URL). Stop: uv.should_exit, join, scheduler.stop()."""
  import jax
  import numpy as np
  import uvicorn
  from jax.sharding import Mesh

  from MaxText.configuration.config_groups import MESH_AXES
  from MaxText.serve import build_app, build_server

  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
  server = build_server(config, mesh=mesh)
  if config.decode.serve_http_processes:
    return _start_front_ends(config, server)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  uv = uvicorn.Server(uvicorn.Config(build_app(server, api_key=""), host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  while not uv.started:
    time.sleep(0.05)
  return server, uv, thread, f"http://127.0.0.1:{port}/v1/completions"


class _FrontEndsRunning:
  """Stands in for start_server's uvicorn server and thread when HTTP runs in front-end processes."""

  def __init__(self, front_ends: Any):
    self.front_ends, self.should_exit = front_ends, False

  def join(self, timeout: float) -> None:
    self.front_ends.stop()


def _start_front_ends(config: Any, server: Any) -> tuple[Any, Any, Any, str]:
  """start_server's answer with config.decode.serve_http_processes front-end processes on a free port."""
  import httpx

  from MaxText import serve
  from MaxText.inference import serve_frontend, serve_processes

  d = config.decode
  sock = serve.listen("127.0.0.1", 0)
  spec = serve_frontend.FrontSpec(serve.codec_spec(config), server.limits, d.serve_request_timeout_seconds,
                                  d.serve_max_body_bytes)
  running = _FrontEndsRunning(serve_processes.FrontEnds(server.scheduler, server.codec.grammars, sock, spec,
                                                        d.serve_http_processes))
  url = serve.address("127.0.0.1", sock)
  deadline = time.monotonic() + 120
  while True:
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        break
    except httpx.TransportError:
      assert time.monotonic() < deadline, "the front-end processes did not start"
      time.sleep(0.1)
  return server, running, running, f"{url}/v1/completions"


def _draft_keys(args, speculative: int) -> dict[str, Any]:
  """The speculative keys of the served config: draft=small or self (see the docstring)."""
  if not speculative:
    return {}
  emb, layers, heads = ((args.base_emb_dim // 2, 1, 2) if args.draft == "small"
                        else (args.base_emb_dim, args.base_num_decoder_layers, 4))
  return dict(speculative_tokens=speculative, draft_model_name="default",
              draft_overrides=f"base_emb_dim={emb},base_num_query_heads={heads},base_num_kv_heads={heads},"
                              f"head_dim={emb // heads},base_mlp_dim={4 * emb},base_num_decoder_layers={layers},"
                              f"vocab_size={args.vocab_size}")


def _serve_layout(args, clients: Clients, layout: str, prompt_lengths: list[int], max_target: int, tokenizer: Path,
                  chunk: int = 0, prefix_caching: bool = False, speculative: int = 0, steps_per_call: int = 1,
                  http_processes: int = 0) -> None:
  """The table for one KV cache layout, then its memory: what the cache allocates and, paged, the
  most pages in use at once (polled while the clients run)."""
  import jax
  import numpy as np

  from MaxText.configuration.config import Config

  keys = dict(
      base_emb_dim=args.base_emb_dim, base_num_query_heads=4, base_num_kv_heads=4, head_dim=args.base_emb_dim // 4,
      base_mlp_dim=4 * args.base_emb_dim, base_num_decoder_layers=args.base_num_decoder_layers,
      vocab_size=args.vocab_size,
      max_target_length=max_target,
      max_prefill_predict_length=max([n + args.shared_prefix for n in prompt_lengths] + [args.long_prompt]),
      dtype="float32", prefill_chunk_size=chunk, prefix_caching=prefix_caching,
      print_config=False, tokenizer_type="huggingface", tokenizer_path=str(tokenizer), add_bos=False,
      serve_max_slots=args.serve_max_slots, serve_max_queue=1024, serve_max_tokens=args.max_tokens,
      serve_model_name="bench", kv_cache_layout=layout, kv_page_size=args.kv_page_size,
      kv_num_pages=args.kv_num_pages if layout == "paged" else 0,
      **_draft_keys(args, speculative))
  config = Config.for_testing(**keys, **({"decode_steps_per_call": steps_per_call} if steps_per_call > 1 else {}),
                              **({"serve_http_processes": http_processes} if http_processes else {}))
  if args.scheduler_alone:
    _scheduler_alone(args, config, prompt_lengths)
    return
  server, uv, thread, url = start_server(config)
  engine = server.scheduler.engine
  # Compiles every step (its prompts have no shared prefix: nothing of the measured load is cached yet).
  clients.round(url, 2, 2, 4, prompt_lengths, args.vocab_size, args.long_prompt)
  _compile_prefills(server.scheduler, args.vocab_size, max(prompt_lengths))
  most = max(args.concurrency)  # and a first round at the most clients, untimed
  clients.round(url, most, most, 4, prompt_lengths, args.vocab_size, args.long_prompt)
  gc.freeze()  # as MaxText.serve does once the server is built (unfrozen when this layout's server stops)
  if args.shared_prefix:  # the measured load once, untimed: its prefill shapes compile, and the steady
    # state of a shared system prompt (already cached, with prefix caching) is what gets measured
    for concurrency in args.concurrency:
      clients.round(url, concurrency, concurrency * args.requests_per_client, args.max_tokens, prompt_lengths,
                    args.vocab_size, args.long_prompt, args.shared_prefix)
  peak = {"pages": 0}
  polling = threading.Event()

  def poll() -> None:
    while not polling.wait(0.005):
      peak["pages"] = max(peak["pages"], int(engine.cache_stats()["pages_used"]))

  poller = threading.Thread(target=poll, daemon=True)
  poller.start()
  mixed = f"; beside them, prompts of {args.long_prompt} tokens back to back" if args.long_prompt else ""
  shared = f"; every prompt starts with the same {args.shared_prefix} tokens" if args.shared_prefix else ""
  mixed += shared
  if speculative:
    mixed += f"; speculative_tokens={speculative}, draft {args.draft}"
  if steps_per_call > 1:
    mixed += f"; decode_steps_per_call={steps_per_call}"
  if http_processes:
    mixed += f"; serve_http_processes={http_processes}"
  before = server.scheduler.load()
  print(f"\n{layout} KV cache, prefill_chunk_size={chunk}{', prefix_caching' if prefix_caching else ''}; "
        f"model: emb {args.base_emb_dim}, {args.base_num_decoder_layers} layers, vocab "
        f"{args.vocab_size}; {args.serve_max_slots} slots; prompts of {args.prompt_lengths} tokens; {args.max_tokens} new tokens "
        f"each{mixed}; {jax.devices()[0].platform}")
  mean_column = args.step_reference  # the tables quoted without it keep their columns
  print("| clients | requests | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |"
        + (" ITL mean (ms) |" if mean_column else ""))
  print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if mean_column else ""))
  rates: dict[int, float] = {}
  front_ends = [p.pid for p in uv.front_ends.processes] if http_processes else []
  cpu_before, timed_tokens = _cpu_seconds(front_ends), 0
  for concurrency in args.concurrency:
    n = concurrency * args.requests_per_client
    t = clients.round(url, concurrency, n, args.max_tokens, prompt_lengths, args.vocab_size, args.long_prompt,
                      args.shared_prefix)
    assert t["tokens"] == n * args.max_tokens, (t["tokens"], n * args.max_tokens)
    print(f"| {concurrency} | {n} | {t['tokens'] / t['wall']:.0f} | {_percentile(t['ttft'], 50) * 1e3:.1f} | "
          f"{_percentile(t['ttft'], 99) * 1e3:.1f} | {_percentile(t['itl'], 50) * 1e3:.1f} | "
          f"{_percentile(t['itl'], 99) * 1e3:.1f} |"
          + (f" {float(np.mean(t.get('itl_mean', [np.nan]))) * 1e3:.2f} |" if mean_column else ""), flush=True)
    rates[concurrency] = t["tokens"] / t["wall"]
    timed_tokens += t["tokens"]
    if concurrency == 1:
      one_client_itl = float(np.mean(t.get("itl_mean", [np.nan])))
  cpu_after = _cpu_seconds(front_ends)
  print(f"CPU per token over the timed rounds' {timed_tokens} tokens: server process "
        f"{(cpu_after[0] - cpu_before[0]) / timed_tokens * 1e3:.4f} ms"
        + (f", front-end processes {(cpu_after[1] - cpu_before[1]) / timed_tokens * 1e3:.4f} ms" if front_ends else ""))
  polling.set()
  poller.join()
  if speculative:
    after = server.scheduler.load()
    proposed = after["speculative_proposed"] - before["speculative_proposed"]
    accepted = after["speculative_accepted"] - before["speculative_accepted"]
    print(f"speculative: {accepted} of {proposed} draft tokens accepted (acceptance rate "
          f"{accepted / max(proposed, 1):.2f}); {after['steps'] - before['steps']} rounds")
  stats = engine.cache_stats()
  allocated = stats["cache_bytes"] / 2**20
  if layout == "dense":  # every slot holds max_target_length tokens whatever its request needs
    live = args.serve_max_slots * (float(np.mean(prompt_lengths)) + args.max_tokens)
    print(f"dense KV cache: {allocated:.2f} MiB for {args.serve_max_slots} slots x {max_target} tokens; the workload's live "
          f"tokens at full occupancy ({live:.0f}) need {live / (args.serve_max_slots * max_target) * allocated:.2f} MiB")
  else:  # the pool's pages are handed out as tokens arrive: the peak in use is what the workload cost
    per_page = allocated / stats["pages_total"]
    print(f"paged KV cache: pool of {stats['pages_total']} pages of {stats['page_size']} tokens ({allocated:.2f} MiB); "
          f"at most {peak['pages']} pages in use at once ({peak['pages'] * per_page:.2f} MiB); "
          f"{stats['pages_used']} in use after the last request")
  uv.should_exit = True
  thread.join(30)
  server.scheduler.stop()
  gc.unfreeze()
  if args.step_reference and 1 in rates:
    step_ms = _step_ms(Config.for_testing(**{k: v for k, v in keys.items() if not k.startswith(("speculative",
                                                                                                   "draft_"))}))
    most = max(rates)
    split = f" serve_http_processes={http_processes}" if http_processes else ""
    print(f"RESULT host layout={layout} decode_steps_per_call={steps_per_call}{split} "
          f"itl_mean_ms={one_client_itl * 1e3:.3f} step_ms={step_ms:.3f} "
          f"itl_over_step={one_client_itl * 1e3 / step_ms:.2f} clients={most} "
          f"tokens_per_s_over_1_client={rates[most] / rates[1]:.2f}", flush=True)


def _scheduler_alone(args: Any, config: Any, prompt_lengths: list[int]) -> None:
  """The scheduler without HTTP: requests_per_client x 8 jobs (greedy, max_tokens each), submitted
  1 and then 8 at a time, each its own submit; prints tokens/s and the CPU per token of the scheduler
  thread and of the whole process (the thread, XLA's threads, this one waiting)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from MaxText.configuration.config_groups import MESH_AXES
  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams
  from MaxText.serve import build_server

  server = build_server(config, mesh=Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES))
  scheduler, rng = server.scheduler, np.random.default_rng(3)
  tid = scheduler._thread.native_id  # noqa: SLF001 - the thread whose CPU is measured

  def thread_cpu() -> float:  # schedstat's first field: ns on a CPU (stat's ticks are 10 ms)
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9

  def run(together: int, jobs: int) -> tuple[float, float, float, int]:
    done, tokens = threading.Semaphore(0), [0]

    def emit(event: Any) -> None:
      if isinstance(event, sched.Done):
        done.release()
      elif isinstance(event, sched.Tokens):
        tokens[0] += len(event.tokens)

    wall, own, thread = time.perf_counter(), os.times(), thread_cpu()
    for start in range(0, jobs, together):
      for i in range(start, min(start + together, jobs)):
        prompt = [int(t) for t in rng.integers(3, args.vocab_size, prompt_lengths[i % len(prompt_lengths)])]
        # No top alternatives, as the HTTP rounds' requests (logprobs: 0).
        scheduler.submit([sched.Job(0, prompt, args.max_tokens, RowParams(), emit, top_logprobs=False)])
      for _ in range(start, min(start + together, jobs)):
        done.acquire()
    end = os.times()
    return (time.perf_counter() - wall, thread_cpu() - thread, end.user + end.system - own.user - own.system,
            tokens[0])

  _compile_prefills(scheduler, args.vocab_size, max(prompt_lengths))
  run(1, 2 * len(prompt_lengths))  # compiles every prompt length's prefill and the steps
  run(8, 16)
  jobs = 8 * args.requests_per_client
  print(f"\nscheduler alone: {jobs} jobs of {args.max_tokens} tokens, {args.serve_max_slots} slots, "
        f"decode_steps_per_call={config.decode.decode_steps_per_call}")
  print("| jobs at a time | tokens/s | scheduler thread CPU / token (ms) | process CPU / token (ms) |")
  print("| ---: | ---: | ---: | ---: |")
  for together in (1, 8):
    wall, thread, process, tokens = run(together, jobs)
    print(f"| {together} | {tokens / wall:.0f} | {thread / tokens * 1e3:.4f} | {process / tokens * 1e3:.4f} |",
          flush=True)
  scheduler.stop()


def _cpu_seconds(pids: list[int]) -> tuple[float, float]:
  """CPU seconds (user + system) of this process (the server's engine, its threads) and of `pids` together."""
  tick = os.sysconf("SC_CLK_TCK")
  others = 0.0
  for pid in pids:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    others += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
  own = os.times()
  return own.user + own.system, others


def _step_ms(config: Any) -> float:
  """ms per token of `config`'s (one step per call, no draft) jitted decode step alone: 1 slot, the
  tokens read back once at the end (decode.py's generate loop)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from MaxText.configuration.config_groups import MESH_AXES
  from MaxText.inference.engine import Engine

  engine = Engine(config, num_slots=1, mesh=Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)),
                                                 MESH_AXES))
  params = engine.load_params()
  state = engine.insert(engine.prefill(params, [[5, 6, 7]]), engine.init_decode_state(), 0)
  steps = config.model.max_target_length - 8
  best = float("inf")
  for _ in range(3):  # the first round compiles
    state = engine.insert(engine.prefill(params, [[5, 6, 7]]), state, 0)
    start, tokens = time.perf_counter(), []
    for _ in range(steps):
      state, emitted = engine.decode_step(params, state)
      tokens.append(emitted.tokens)
    jax.block_until_ready(tokens)
    best = min(best, (time.perf_counter() - start) / steps * 1e3)
  return best


def _switches(key: str, text: str) -> list[bool]:
  values = []
  for item in bench_args.items(key, text):
    if item.lower() not in ("true", "false"):
      raise UserError(f"{key}: {item!r} is not true or false; give true, false or a list of them")
    values.append(item.lower() == "true")
  return values


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The arguments, every list read and checked: nothing is served with a bad one."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--concurrency", default="1,4,16")
  parser.add_argument("--requests_per_client", type=int, default=4)
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--prompt_lengths", default="8,24,48,16")
  parser.add_argument("--serve_max_slots", type=int, default=16)
  parser.add_argument("--base_emb_dim", type=int, default=256)
  parser.add_argument("--base_num_decoder_layers", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=512)
  parser.add_argument("--caches", default="dense,paged", help="KV cache layouts to serve with, in turn")
  parser.add_argument("--kv_page_size", type=int, default=16)
  parser.add_argument("--kv_num_pages", type=int, default=0, help="paged pool size (0: the dense capacity)")
  parser.add_argument("--prefill_chunk_sizes", default="0", help="paged: prefill_chunk_size values to serve with")
  parser.add_argument("--long_prompt", type=int, default=0, help="tokens of the mixed load's long prompts (0: none)")
  parser.add_argument("--shared_prefix", type=int, default=0, help="tokens every prompt starts with (0: none)")
  parser.add_argument("--prefix_caching", default="false", help="paged: prefix_caching values to serve with")
  parser.add_argument("--speculative_tokens", default="0", help="speculative_tokens values to serve with (0: off)")
  parser.add_argument("--draft", default="small", choices=("small", "self"), help="the speculative draft")
  parser.add_argument("--decode_steps_per_call", default="1", help="decode_steps_per_call values to serve with")
  parser.add_argument("--serve_http_processes", default="0", help="serve_http_processes values to serve with")
  parser.add_argument("--step_reference", default="false", help="true: also time the jitted step alone (RESULT host)")
  parser.add_argument("--scheduler_alone", default="false", help="true: the scheduler without HTTP (1 and 8 jobs "
                      "at a time, requests_per_client x 8 jobs), its thread's and the process's CPU per token")
  args = tool_args.parse_args(parser, argv, renamed=RENAMED)
  for key in ("scheduler_alone", "step_reference"):
    value = _switches(key, getattr(args, key))
    if len(value) != 1:
      raise UserError(f"{key} takes one value, true or false")
    setattr(args, key, value[0])
  args.concurrency = bench_args.numbers("concurrency", args.concurrency, "1,4,16")
  # prompt_lengths stays as typed: the table's heading quotes it
  args.prompt_token_lengths = bench_args.numbers("prompt_lengths", args.prompt_lengths, "8,24")
  from MaxText.configuration.decode_config import KV_CACHE_LAYOUTS  # noqa: PLC0415
  args.caches = bench_args.names("caches", args.caches, KV_CACHE_LAYOUTS)
  args.prefill_chunk_sizes = bench_args.numbers("prefill_chunk_sizes", args.prefill_chunk_sizes, "0,64", minimum=0)
  args.prefix_caching = _switches("prefix_caching", args.prefix_caching)
  args.speculative_tokens = bench_args.numbers("speculative_tokens", args.speculative_tokens, "0,3", minimum=0)
  args.decode_steps_per_call = bench_args.numbers("decode_steps_per_call", args.decode_steps_per_call, "1,4")
  args.serve_http_processes = bench_args.numbers("serve_http_processes", args.serve_http_processes, "0,2", minimum=0)
  for key in ("requests_per_client", "max_tokens", "serve_max_slots", "base_emb_dim", "base_num_decoder_layers",
              "vocab_size", "kv_page_size"):
    bench_args.at_least(key, getattr(args, key), 1)
  for key in ("kv_num_pages", "long_prompt", "shared_prefix"):
    bench_args.at_least(key, getattr(args, key), 0)
  return args


def main() -> None:
  args = parse(None)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  prompt_lengths = args.prompt_token_lengths
  max_target = max([n + args.shared_prefix for n in prompt_lengths] + [args.long_prompt]) + args.max_tokens
  tokenizer = _tokenizer(Path(tempfile.mkdtemp()) / "tok", args.vocab_size)
  clients = Clients()
  try:
    _serve_layouts(args, clients, prompt_lengths, max_target, tokenizer)
  finally:
    clients.close()


def _serve_layouts(args, clients: Clients, prompt_lengths: list[int], max_target: int, tokenizer: Path) -> None:
  for layout in args.caches:
    for chunk in args.prefill_chunk_sizes if layout == "paged" else [0]:
      for caching in args.prefix_caching if layout == "paged" \
          else [False]:
        for speculative in args.speculative_tokens:
          for steps_per_call in args.decode_steps_per_call:
            for http_processes in args.serve_http_processes:
              _serve_layout(args, clients, layout, prompt_lengths, max_target, tokenizer, chunk, caching,
                            speculative, steps_per_call, http_processes)


if __name__ == "__main__":
  bench_args.run(main)
