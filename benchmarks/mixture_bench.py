"""Batches per second of the data pipeline: one source against weighted mixtures, and streamed shards.

    python3 benchmarks/mixture_bench.py [batches=200] [max_target_length=512] [per_device_batch_size=4]
        [devices=8]

Prepares a corpus in a temporary directory (tinyshakespeare from ../shared/data when present, else
generated words), trains a small SentencePiece tokenizer on it, and times `batches` global
batches of each pipeline after a few warm-up ones, with the prefetch thread off so the figure is
the producer's own rate (what the prefetch thread has to keep ahead of the train step). Prints
one Markdown row per pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"length": "max_target_length", "per_device_batch": "per_device_batch_size"}


def _documents() -> list[str]:
  if SHAKESPEARE.is_file():
    return [p.strip() for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
  import numpy as np

  rng = np.random.default_rng(0)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  # Enough distinct words for a 1024-token tokenizer.
  words = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(3000)]
  return [" ".join(rng.choice(words, size=int(rng.integers(5, 200)))) for _ in range(8000)]


def _prepare(directory: Path) -> dict[str, str]:
  """The corpus as ArrayRecord, JSONL and parquet shards, and a tokenizer."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter

  from MaxText import train_tokenizer

  documents = _documents()
  (directory / "corpus.txt").write_text("\n".join(documents), encoding="utf-8")
  train_tokenizer.train([str(directory / "corpus.txt")], 1024, str(directory / "tok.model"))
  half = len(documents) // 2
  (directory / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[half:]))
  writer = ArrayRecordWriter(str(directory / "web.array_record"), "group_size:1")
  for document in documents[:half]:
    writer.write(json.dumps({"text": document}).encode())
  writer.close()
  (directory / "shards").mkdir()
  for i in range(8):
    pq.write_table(pa.table({"text": documents[i::8]}), str(directory / "shards" / f"part-{i}.parquet"))
  return {"tokenizer": str(directory / "tok.model"), "web": str(directory / "web.array_record"),
          "code": str(directory / "code.jsonl"), "shards": str(directory / "shards" / "*.parquet")}


def _rate(values: dict, batches: int) -> float:
  from MaxText.configuration.config import Config
  from MaxText.input_pipeline import create_data_iterator
  from MaxText.platform import sharding

  config = Config.for_testing(**values)
  data = create_data_iterator(config, sharding.create_mesh(config.mesh))
  for _ in range(5):
    next(data)
  start = time.perf_counter()
  for _ in range(batches):
    next(data)
  seconds = time.perf_counter() - start
  getattr(data, "close", lambda: None)()
  return batches / seconds


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--max_target_length", type=int, default=512)
  parser.add_argument("--per_device_batch_size", type=int, default=4)
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
  args = tool_args.parse_args(parser, argv, renamed=RENAMED)
  for key in ("batches", "max_target_length", "per_device_batch_size", "devices"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

  with tempfile.TemporaryDirectory(prefix="mixture-bench-") as tmp:
    files = _prepare(Path(tmp))
    base = dict(tokenizer_path=files["tokenizer"], vocab_size=1024, max_target_length=args.max_target_length,
                per_device_batch_size=args.per_device_batch_size, print_config=False, data_prefetch_batches=0)
    web = dict(name="web", weight=3, grain_train_files=files["web"])
    code = dict(name="code", weight=1, dataset_type="hf", hf_data_files=files["code"])
    shards = dict(name="shards", weight=1, dataset_type="stream", stream_train_files=files["shards"])
    pipelines = [
        ("single source: grain", dict(dataset_type="grain", grain_train_files=files["web"])),
        ("single source: hf", dict(dataset_type="hf", hf_data_files=files["code"])),
        ("single source: stream (8 parquet shards)", dict(dataset_type="stream", stream_train_files=files["shards"])),
        ("mixture of 2: grain 3 + hf 1", dict(dataset_type="grain", data_mixture=[web, code])),
        ("mixture of 3: grain 3 + hf 1 + stream 1", dict(dataset_type="grain", data_mixture=[web, code, shards])),
    ]
    rows = args.per_device_batch_size * args.devices
    print(f"{args.batches} batches of {rows} x {args.max_target_length} tokens, prefetch off; {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    print("| pipeline | batches/s | relative to grain |")
    print("| --- | --- | --- |")
    reference = None
    for name, values in pipelines:
      rate = _rate({**base, **values}, args.batches)
      reference = reference or rate
      print(f"| {name} | {rate:.1f} | {rate / reference:.2f} |", flush=True)


if __name__ == "__main__":
  bench_args.run(main, with_argv=True)
