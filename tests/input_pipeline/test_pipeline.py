"""The real-data pipeline: per-host shards, the three dataset_types agreeing, resumption across
the prefetch thread, eval reset and exhaustion."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.input_pipeline import create_data_iterator, create_eval_iterator, pipeline
from MaxText.input_pipeline.batch_spec import batch_spec
from MaxText.input_pipeline.packing import DocumentCursor, pack_batch
from tests.input_pipeline.data_fixtures import NUM_DOCS, doc_id_encoder, numbered_documents, read_jsonl

LENGTH = 16


def _config(spm_model: str, prepared: Path, kind: str = "grain", **overrides) -> Config:
  sources = {
      "grain": dict(grain_train_files=str(prepared / "arrayrecord" / "train.array_record"),
                    grain_eval_files=str(prepared / "arrayrecord" / "validation.array_record")),
      "hf": dict(hf_data_files=str(prepared / "jsonl" / "train.jsonl"),
                 hf_eval_files=str(prepared / "jsonl" / "validation.jsonl")),
      "tfds": dict(dataset_path=str(prepared / "tfds"), dataset_name="local_text/corpus"),
  }[kind]
  values = dict(dataset_type=kind, tokenizer_path=spm_model, vocab_size=512, max_target_length=LENGTH,
                per_device_batch_size=1, print_config=False, eval_interval=2, **sources)
  values.update(overrides)
  return Config.for_testing(**values)


def _host(batch: dict) -> dict[str, np.ndarray]:
  return {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}


def _take(iterator, n: int) -> list[dict[str, np.ndarray]]:
  return [_host(next(iterator)) for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
  assert len(a) == len(b)
  for i, (x, y) in enumerate(zip(a, b)):
    for name in x:
      np.testing.assert_array_equal(x[name], y[name], err_msg=f"batch {i} {name}")


# ---------------------------------------------------------------- hosts and shards

def test_two_processes_hold_disjoint_halves_of_the_batch(spm_model, prepared):
  config = _config(spm_model, prepared)
  mesh = sharding.create_mesh(config.mesh)
  batch_sharding = sharding.batch_sharding(mesh, config.mesh.data_sharding)
  fake_process = lambda device: int(device.id >= 4)  # noqa: E731 - devices 0-3 on host 0, 4-7 on host 1
  shards = [pipeline.host_shard(batch_sharding, 8, LENGTH, p, fake_process) for p in (0, 1)]
  assert shards == [pipeline.HostShard(0, 2, 4), pipeline.HostShard(1, 2, 4)]


def test_processes_holding_the_same_rows_read_the_same_shard(spm_model, prepared):
  # Tensor parallelism over the two (simulated) processes: both hold all 4 data rows.
  config = _config(spm_model, prepared, ici_fsdp_parallelism=4, ici_tensor_parallelism=2, data_sharding=["fsdp"])
  mesh = sharding.create_mesh(config.mesh)
  batch_sharding = sharding.batch_sharding(mesh, config.mesh.data_sharding)
  by_tensor_axis = {d.id: i for i, d in enumerate(mesh.devices.reshape(4, 2)[:, 1])}  # host = tensor index
  process_of = lambda device: 1 if device.id in by_tensor_axis else 0  # noqa: E731
  shards = [pipeline.host_shard(batch_sharding, 8, LENGTH, p, process_of) for p in (0, 1)]
  assert shards[0] == shards[1] == pipeline.HostShard(0, 1, 8)


def _documents_seen(shard: pipeline.HostShard, num_batches: int, docs: list[str]) -> set[int]:
  dataset = pipeline.document_dataset(docs, shard, doc_id_encoder, "text", shuffle_seed=3, repeat=True, what="t")
  cursor = DocumentCursor(pipeline.reader(dataset, num_threads=0), max_empty_run=len(docs))
  seen: set[int] = set()
  for _ in range(num_batches):
    batch, _ = pack_batch(cursor, shard.rows, LENGTH, packing=True)
    seen |= {int(t) - 10 for t in batch["inputs"][batch["inputs_segmentation"] > 0]}
  return seen


def test_simulated_hosts_read_disjoint_documents_that_cover_the_data():
  docs = numbered_documents()
  # Few enough batches that neither host finishes its first epoch.
  seen = [_documents_seen(pipeline.HostShard(i, 2, 4), 2, docs) for i in (0, 1)]
  assert seen[0] and seen[1] and not seen[0] & seen[1]
  assert all(d % 2 == i for i in (0, 1) for d in seen[i])  # host i reads records i, i+2, ...
  whole_epochs = [_documents_seen(pipeline.HostShard(i, 2, 4), 40, docs) for i in (0, 1)]
  assert whole_epochs[0] | whole_epochs[1] == set(range(NUM_DOCS))


def test_record_text_reads_json_objects_strings_and_raw_bytes():
  assert pipeline.record_text(b'{"text": "a b", "id": 1}', "text") == "a b"
  assert pipeline.record_text(b'"quoted"', "text") == "quoted"
  assert pipeline.record_text(b"plain words", "text") == "plain words"
  assert pipeline.record_text({"body": b"bytes"}, "body") == "bytes"
  assert pipeline.record_text(b'\xef\xbb\xbf{"text": "after a BOM"}', "text") == "after a BOM"
  deep = b'{"a": ' * 100000  # JSON-like text nested past json's limit is raw text, as other non-JSON (was RecursionError)
  assert pipeline.record_text(deep, "text") == deep.decode()
  with pytest.raises(UserError, match="holds an unpaired UTF-16 surrogate escape"):  # was the tokenizer's TypeError
    pipeline.record_text(b'{"text": "a \\udc80 b"}', "text")
  assert pipeline.record_text(b'{"text": "a \\ud83d\\ude00 b"}', "text") == "a \U0001f600 b"  # a pair is text


@pytest.mark.parametrize("value, what", [(None, "is null or missing"), (3, "is a JSON number"), (["a"], "is a JSON array"),
                                         ({"a": 1}, "is a JSON object")])
def test_record_text_refuses_a_column_that_is_not_text(value, what):
  with pytest.raises(UserError, match=f"column 'text' {what}, not text"):
    pipeline.record_text({"text": value}, "text")
  with pytest.raises(UserError, match=f"column 'text' {what}, not text"):
    pipeline.record_text(json.dumps({"text": value}).encode(), "text")


# ---------------------------------------------------------------- formats

def test_hf_and_grain_give_identical_batches_and_tfds_the_same_documents(spm_model, prepared):
  mesh = sharding.create_mesh(_config(spm_model, prepared).mesh)
  batches = {kind: _take(create_data_iterator(_config(spm_model, prepared, kind, enable_data_shuffling=False),
                                              mesh), 6) for kind in ("hf", "grain", "tfds")}
  _assert_same(batches["hf"], batches["grain"])
  for kind in ("hf", "tfds"):
    for name in ("inputs", "targets", "inputs_segmentation", "inputs_position"):
      assert batches[kind][0][name].shape == (8, LENGTH) and batches[kind][0][name].dtype == np.int32

  def first_epoch_rows(kind: str) -> list[tuple[int, ...]]:
    # One document per row, so the first 36 rows are the 36 train documents, in each source's order.
    config = _config(spm_model, prepared, kind, enable_data_shuffling=False, packing=False, max_target_length=64)
    rows = np.concatenate([b["inputs"] for b in _take(create_data_iterator(config, mesh), 5)])[:36]
    return sorted(tuple(r) for r in rows.tolist())

  # TFDS shuffles records when it prepares them, so only the first epoch's contents agree.
  assert len(read_jsonl(prepared / "jsonl" / "train.jsonl")) == 36
  assert first_epoch_rows("grain") == first_epoch_rows("tfds")


def _layout(batch: dict) -> dict:
  return {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in batch.items()}


@pytest.mark.parametrize("kind", ["grain", "hf", "tfds", "synthetic"])
def test_every_iterator_yields_the_declared_batch_spec(spm_model, prepared, kind):
  """AOT compiles the step for `batch_spec` without reading data; the batches must match it."""
  config = _config(spm_model, prepared, kind if kind != "synthetic" else "grain",
                   **({"dataset_type": "synthetic"} if kind == "synthetic" else {}))
  mesh = sharding.create_mesh(config.mesh)
  data, evaluation = create_data_iterator(config, mesh), create_eval_iterator(config, mesh)
  want = _layout(batch_spec(config.data))
  assert _layout(next(data)) == want and _layout(next(evaluation)) == want
  for iterator in (data, evaluation):
    getattr(iterator, "close", lambda: None)()


# ---------------------------------------------------------------- resumption

@pytest.mark.parametrize("prefetch", [0, 3])
def test_restored_state_gives_the_same_batches(spm_model, prepared, prefetch):
  config = _config(spm_model, prepared, data_prefetch_batches=prefetch, grain_worker_count=2)
  mesh = sharding.create_mesh(config.mesh)
  data = create_data_iterator(config, mesh)
  _take(data, 3)
  state = data.get_state()  # with prefetch the thread is batches ahead by now; the state must not be
  expected = _take(data, 25)  # past the end of the first epoch: the reshuffled second one too
  data.close()
  resumed = create_data_iterator(config, mesh)
  resumed.set_state(state)
  _assert_same(_take(resumed, 25), expected)
  resumed.close()


def test_state_counts_consumed_batches_not_prefetched_ones(spm_model, prepared):
  mesh = sharding.create_mesh(_config(spm_model, prepared).mesh)
  eager = create_data_iterator(_config(spm_model, prepared, data_prefetch_batches=0), mesh)
  ahead = create_data_iterator(_config(spm_model, prepared, data_prefetch_batches=4), mesh)
  states, starts = [], []
  for _ in range(3):
    starts.append((eager.describe_next_position(), ahead.describe_next_position()))
    next(eager), next(ahead)
    states.append((eager.get_state()["shards"], ahead.get_state()["shards"]))
  assert all(a == b for a, b in states) and states[0][0] != states[-1][0]
  # A skipped batch is named by where it starts: the position the previous batch left.
  assert all(a == b for a, b in starts) and starts[0][0] == "data shard 0 of 1, from document 0, token pair 0"
  shard = states[0][0]["0"]
  assert starts[1][0] == f"data shard 0 of 1, from document {shard['index']}, token pair {shard['offset']}"
  ahead.close()


def test_data_state_mismatch_is_refused(spm_model, prepared):
  mesh = sharding.create_mesh(_config(spm_model, prepared).mesh)
  state = create_data_iterator(_config(spm_model, prepared), mesh).get_state()
  longer = create_data_iterator(_config(spm_model, prepared, max_target_length=2 * LENGTH), mesh)
  with pytest.raises(Exception, match="max_target_length 16 .* this run has 8 x 32"):
    longer.set_state(state)
  with pytest.raises(Exception, match="written by another dataset_type"):
    longer.set_state({"step": 4})


# ---------------------------------------------------------------- eval

def test_eval_reset_repeats_and_exhaustion_pads(spm_model, prepared):
  config = _config(spm_model, prepared, packing=False)
  evaluation = create_eval_iterator(config, sharding.create_mesh(config.mesh))
  first = _take(evaluation.reset(), 3)
  _assert_same(_take(evaluation.reset(), 3), first)
  # 12 eval documents, 8 rows a batch, one document a row: batch 2 holds 4, batch 3 none.
  assert [int((b["targets_segmentation"] > 0).any(axis=1).sum()) for b in first] == [8, 4, 0]
  assert evaluation.rows_with_data == 0


def test_no_eval_source_without_eval_interval(spm_model, prepared):
  config = _config(spm_model, prepared, eval_interval=-1, grain_eval_files="")
  assert create_eval_iterator(config, sharding.create_mesh(config.mesh)) is None
