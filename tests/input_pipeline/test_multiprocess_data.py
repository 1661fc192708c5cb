"""A real two-process run (jax.distributed over 127.0.0.1 with gloo): each process reads its own
shard, builds its own rows, and the global batch is their concatenation."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from MaxText.input_pipeline import mixture, pipeline
from MaxText.input_pipeline.packing import DocumentCursor, pack_batch
from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer
from tests.conftest import REPO_ROOT

WORKER = Path(__file__).with_name("two_process_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _expected_rows(train_file: str, spm_model: str, shard: pipeline.HostShard) -> list[list[list[int]]]:
  """What one host should build, computed in this single process from the shard alone."""
  import grain

  encode = DocumentEncoder(load_tokenizer("sentencepiece", spm_model), True, True)
  source = grain.sources.ArrayRecordDataSource([train_file])
  dataset = pipeline.document_dataset(source, shard, encode, "text", shuffle_seed=0, repeat=True, what="train")
  cursor = DocumentCursor(pipeline.reader(dataset, 0), max_empty_run=len(source))
  return [pack_batch(cursor, shard.rows, 16, True)[0]["inputs"].tolist() for _ in range(3)]


def _run_two(tmp_path: Path, train_file: str, spm_model: str, *extra: str) -> list[dict]:
  port = _free_port()
  env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT)}
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), train_file, spm_model,
                             str(tmp_path / f"p{i}.json"), *extra], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  for i, proc in enumerate(procs):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"process {i}: {err[-3000:]}"
  return [json.loads((tmp_path / f"p{i}.json").read_text()) for i in (0, 1)]


@pytest.mark.slow  # two extra processes that import JAX and join over gloo: ~20 s on an idle machine
def test_two_real_processes_build_disjoint_halves_of_the_global_batch(tmp_path, spm_model, prepared):
  train_file = str(prepared / "arrayrecord" / "train.array_record")
  results = _run_two(tmp_path, train_file, spm_model)
  assert [r["shard"] for r in results] == [[0, 2, 4], [1, 2, 4]]
  assert results[0]["global"] == results[1]["global"]
  for i, result in enumerate(results):
    assert result["local"] == _expected_rows(train_file, spm_model, pipeline.HostShard(i, 2, 4))
    for step in range(3):
      assert np.array_equal(np.asarray(result["global"][step])[4 * i:4 * i + 4], result["local"][step])
  assert results[0]["local"] != results[1]["local"]
  # Every process's position is in the (identical) checkpointed state.
  assert results[0]["state"] == results[1]["state"] and set(results[0]["state"]["shards"]) == {"0", "1"}


@pytest.mark.slow  # two extra processes, as above
def test_two_real_processes_mix_sources_and_count_every_process_tokens(tmp_path, spm_model, prepared):
  train_file = str(prepared / "arrayrecord" / "train.array_record")
  mix = [{"name": "web", "weight": 1, "grain_train_files": train_file},
         {"name": "code", "weight": 1, "dataset_type": "hf", "hf_data_files": str(prepared / "jsonl" / "train.jsonl")}]
  results = _run_two(tmp_path, train_file, spm_model, json.dumps(mix))
  assert results[0]["global"] == results[1]["global"] and results[0]["local"] != results[1]["local"]
  assert results[0]["state"] == results[1]["state"] and set(results[0]["state"]["shards"]) == {"0", "1"}
  assert results[0]["tokens"] == results[1]["tokens"]
  for step in range(3):  # each source's tokens over both processes' rows, from the same draw
    drawn = mixture.draw_sources(0, step, 8, mixture.weights_at(step, (1, 1), ()))
    segments = np.asarray(results[0]["segments"][step])
    want = {name: int(np.count_nonzero(segments[drawn == k])) for k, name in enumerate(("web", "code"))}
    assert results[0]["tokens"][step] == want
