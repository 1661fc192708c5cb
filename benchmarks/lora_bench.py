"""Many LoRA adapters at once on CPU: output tokens/s of the server's scheduler when every request
uses one adapter and when requests for 4 adapters share the batch, against the base model alone.

    nice -n 5 python3 benchmarks/lora_bench.py [serve_max_slots=8] [requests=16] [max_tokens=32]
        [prompt_length=16] [lora_rank=16] [base_emb_dim=256] [base_num_decoder_layers=4] [repeats=3]

A random-init model (greedy, float32) and 4 random PEFT adapters (rank lora_rank on every attention
and MLP projection, written by convert/peft_adapters.save) are served by the scheduler thread
(inference/scheduler.py, no HTTP): all `requests` jobs are submitted at once and timed until the last
one ends, after an untimed warm-up round (compilation). Rows: the plain engine (no adapter tables),
the table engine with every request on the base row, on one adapter, and on 4 adapters in turn
(each batch mixes them). Prints a Markdown table (getting_started/Serving.md holds the measured one).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments)
from benchmarks import bench_args  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapters(root: Path, keys: dict[str, Any], rank: int, count: int) -> list[Path]:
  """`count` random PEFT adapters of the model `keys` describe."""
  import jax
  import numpy as np

  from MaxText import models
  from MaxText.configuration.config import Config
  from MaxText.convert import peft_adapters
  from MaxText.training import lora

  config = Config.for_testing(**keys, lora_rank=rank, lora_alpha=2.0 * rank, lora_target_modules=",".join(TARGETS))
  abstract = models.build_model_spec(config.model).abstract_params
  out = []
  for i in range(count):
    rng = np.random.default_rng(i)
    params = jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(x.dtype), abstract)
    peft_adapters.save(str(root / f"a{i}"), lora.combine(*lora.split(params)), config.model)
    out.append(root / f"a{i}")
  return out


def _run(engine: Any, params: Any, rows: list[int], prompt_length: int, max_tokens: int) -> float:
  """Output tokens/s of len(rows) jobs (job i on adapter row rows[i]) submitted at once."""
  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  done = threading.Semaphore(0)

  def emit(event: sched.Event) -> None:
    if isinstance(event, sched.Done):
      done.release()

  scheduler = sched.Scheduler(engine, params, max_queue=len(rows)).start()
  jobs = [sched.Job(i, [(7 * i + j) % 500 + 1 for j in range(prompt_length)], max_tokens,
                    RowParams(adapter=row), emit) for i, row in enumerate(rows)]
  start = time.perf_counter()
  scheduler.submit(jobs)
  for _ in jobs:
    done.acquire()
  elapsed = time.perf_counter() - start
  scheduler.stop()
  return sum(job.generated for job in jobs) / elapsed


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--serve_max_slots", type=int, default=8)
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--prompt_length", type=int, default=16)
  parser.add_argument("--lora_rank", type=int, default=16)
  parser.add_argument("--base_emb_dim", type=int, default=256)
  parser.add_argument("--base_num_decoder_layers", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is reported")
  args = tool_args.parse_args(parser, None)
  for key in ("serve_max_slots", "requests", "max_tokens", "prompt_length", "lora_rank", "base_emb_dim",
              "base_num_decoder_layers", "repeats"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from MaxText.configuration.config import Config
  from MaxText.inference import lora_adapters
  from MaxText.inference.engine import Engine
  from MaxText.training import lora

  keys = dict(base_emb_dim=args.base_emb_dim, base_num_query_heads=4, base_num_kv_heads=4,
              base_mlp_dim=4 * args.base_emb_dim, base_num_decoder_layers=args.base_num_decoder_layers,
              head_dim=args.base_emb_dim // 4, vocab_size=512, dtype="float32", weight_dtype="float32",
              max_target_length=args.prompt_length + args.max_tokens + 1, max_prefill_predict_length=args.prompt_length,
              print_config=False)
  paths = _adapters(Path(tempfile.mkdtemp()), keys, args.lora_rank, 4)
  config = Config.for_testing(**keys, serve_max_slots=args.serve_max_slots,
                              serve_lora_adapters=",".join(f"a{i}={p}" for i, p in enumerate(paths)))
  engine, registry = lora_adapters.load_engine(config, args.serve_max_slots, "", "base")
  plain = Engine(Config.for_testing(**keys), num_slots=args.serve_max_slots)
  plain_params = lora.split(registry.params)[1]
  n = args.requests
  rows = [("plain engine (no adapter tables)", plain, plain_params, [0] * n, 0),
          ("adapter tables, base model only", engine, registry.params, [0] * n, 0),
          ("1 adapter", engine, registry.params, [1] * n, 1),
          ("4 adapters mixed", engine, registry.params, [1 + i % 4 for i in range(n)], 4)]
  print(f"model: emb {args.base_emb_dim}, {args.base_num_decoder_layers} layers, vocab 512, float32; "
        f"{args.serve_max_slots} slots; {n} requests of {args.prompt_length} prompt + {args.max_tokens} new tokens; "
        f"adapters of rank {args.lora_rank} on {', '.join(TARGETS)}; {jax.devices()[0].platform}")
  print("| batch | adapters in it | output tokens/s | vs the plain engine |")
  print("| --- | ---: | ---: | ---: |")
  reference = 0.0
  for name, eng, params, adapter_rows, count in rows:
    _run(eng, params, adapter_rows, args.prompt_length, args.max_tokens)  # warm-up: compiles
    best = max(_run(eng, params, adapter_rows, args.prompt_length, args.max_tokens) for _ in range(args.repeats))
    reference = reference or best
    print(f"| {name} | {count} | {best:.0f} | {best / reference:.2f}x |", flush=True)


if __name__ == "__main__":
  bench_args.run(main)
