"""The OpenAI-compatible server under load on CPU: output tokens/s, time to first token (TTFT) and
inter-token latency (ITL) p50/p99 against the number of concurrent clients, and KV cache memory.

    nice -n 5 python3 benchmarks/serve_bench.py [--concurrency 1,4,16] [--requests_per_client 4]
        [--max_tokens 32] [--slots 16] [--emb 256] [--layers 4]

A small random-init model (greedy, no end-of-sequence token, so every request makes max_tokens
tokens) is served in this process on 127.0.0.1 through the real app (uvicorn, the scheduler
thread); asyncio clients stream `/v1/completions` with token-id prompts of mixed lengths and
`logprobs: 0`, which makes one server-sent event per token: TTFT is send → first token's event,
ITL the gaps between a request's later events. Compilation happens in a warm-up round, untimed.
Prints a Markdown table (getting_started/Serving.md holds the measured one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text("{}")
  return directory


def _percentile(values: list[float], q: float) -> float:
  import numpy as np

  return float(np.percentile(values, q)) if values else float("nan")


async def _one(client, url: str, prompt: list[int], max_tokens: int, times: dict) -> None:
  body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "logprobs": 0}
  start = time.perf_counter()
  stamps = []
  async with client.stream("POST", url, json=body) as response:
    assert response.status_code == 200, await response.aread()
    async for line in response.aiter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        chunk = json.loads(line[len("data: "):])
        stamps.extend([time.perf_counter()] * len((chunk["choices"][0].get("logprobs") or {}).get("tokens", [])))
  times["ttft"].append(stamps[0] - start)
  times["itl"].extend(b - a for a, b in zip(stamps, stamps[1:]))
  times["tokens"] += len(stamps)


async def _round(url: str, concurrency: int, num_requests: int, max_tokens: int, prompt_lengths: list[int],
                 vocab: int) -> dict:
  try:
    import httpx2 as httpx
  except ImportError:
    import httpx
  import numpy as np

  rng = np.random.default_rng(concurrency)
  prompts = [[int(t) for t in rng.integers(3, vocab, prompt_lengths[i % len(prompt_lengths)])]
             for i in range(num_requests)]
  times: dict = {"ttft": [], "itl": [], "tokens": 0}
  gate = asyncio.Semaphore(concurrency)
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:

    async def guarded(prompt):
      async with gate:
        await _one(client, url, prompt, max_tokens, times)

    start = time.perf_counter()
    await asyncio.gather(*[guarded(p) for p in prompts])
    times["wall"] = time.perf_counter() - start
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--concurrency", default="1,4,16")
  parser.add_argument("--requests_per_client", type=int, default=4)
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--prompt_lengths", default="8,24,48,16")
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--emb", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=512)
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import numpy as np
  import uvicorn
  from jax.sharding import Mesh

  from MaxText.config import Config
  from MaxText.config_groups import MESH_AXES
  from MaxText.serve import build_app, build_server

  prompt_lengths = [int(x) for x in args.prompt_lengths.split(",")]
  max_target = max(prompt_lengths) + args.max_tokens
  tokenizer = _tokenizer(Path(tempfile.mkdtemp()) / "tok", args.vocab)
  config = Config.for_testing(
      base_emb_dim=args.emb, base_num_query_heads=4, base_num_kv_heads=4, head_dim=args.emb // 4,
      base_mlp_dim=4 * args.emb, base_num_decoder_layers=args.layers, vocab_size=args.vocab,
      max_target_length=max_target, max_prefill_predict_length=max(prompt_lengths), dtype="float32",
      print_config=False, tokenizer_type="huggingface", tokenizer_path=str(tokenizer), add_bos=False,
      serve_max_slots=args.slots, serve_max_queue=1024, serve_max_tokens=args.max_tokens, serve_model_name="bench")
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
  server = build_server(config, mesh=mesh)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  uv = uvicorn.Server(uvicorn.Config(build_app(server, api_key=""), host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  while not uv.started:
    time.sleep(0.05)
  url = f"http://127.0.0.1:{port}/v1/completions"
  asyncio.run(_round(url, 2, 2, 4, prompt_lengths, args.vocab))  # compiles prefill, insert and the step

  print(f"model: emb {args.emb}, {args.layers} layers, vocab {args.vocab}; {args.slots} slots; "
        f"prompts of {args.prompt_lengths} tokens; {args.max_tokens} new tokens each; {jax.devices()[0].platform}")
  print("| clients | requests | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
  print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for concurrency in [int(c) for c in args.concurrency.split(",")]:
    n = concurrency * args.requests_per_client
    t = asyncio.run(_round(url, concurrency, n, args.max_tokens, prompt_lengths, args.vocab))
    assert t["tokens"] == n * args.max_tokens, (t["tokens"], n * args.max_tokens)
    print(f"| {concurrency} | {n} | {t['tokens'] / t['wall']:.0f} | {_percentile(t['ttft'], 50) * 1e3:.1f} | "
          f"{_percentile(t['ttft'], 99) * 1e3:.1f} | {_percentile(t['itl'], 50) * 1e3:.1f} | "
          f"{_percentile(t['itl'], 99) * 1e3:.1f} |", flush=True)

  # ---------------------------------------------------------------- KV cache memory
  # The dense cache holds slots x max_target_length tokens whatever the requests need; the
  # tokens the mixed workload actually caches at full occupancy are prompt + generated per slot.
  # (A paged cache's row, its pages in use at the peak, goes here beside the dense one.)
  state = server.scheduler.engine.init_decode_state()
  dense = sum(x.nbytes for x in jax.tree.leaves(state.caches))
  per_token = dense / (args.slots * max_target)
  live = args.slots * (float(np.mean(prompt_lengths)) + args.max_tokens)
  print(f"\ndense KV cache: {dense / 2**20:.2f} MiB for {args.slots} slots x {max_target} tokens; the workload's "
        f"live tokens at full occupancy ({live:.0f}) need {live * per_token / 2**20:.2f} MiB")
  uv.should_exit = True
  thread.join(30)
  server.scheduler.stop()


if __name__ == "__main__":
  main()
