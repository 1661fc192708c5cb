"""dataset_type=stream: parquet, JSONL and ArrayRecord shards read one at a time (local and from the
GCS server on 127.0.0.1), the next shard read ahead, a restart that opens only the unfinished
shard and continues bit for bit, and one line for each bad input."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import create_data_iterator, create_eval_iterator, streaming
from MaxText.input_pipeline.pipeline import HostShard
from MaxText.paths import storage
from MaxText.platform import sharding
from tests.input_pipeline.data_fixtures import numbered_documents

LENGTH = 16
NUM_SHARDS, PER_SHARD = 4, 12
SUFFIXES = ("parquet", "jsonl", "array_record")


def write_shards(directory: Path, documents: list[str], per_shard: int = PER_SHARD) -> None:
  """The documents in order as shard-NNN.{parquet,jsonl,array_record}, `per_shard` to a file."""
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(0, len(documents), per_shard):
    part, stem = documents[i:i + per_shard], directory / f"shard-{i // per_shard:03d}"
    pq.write_table(pa.table({"text": part}), f"{stem}.parquet")
    Path(f"{stem}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    writer = ArrayRecordWriter(f"{stem}.array_record", "group_size:1")
    for text in part:
      writer.write(json.dumps({"text": text}).encode())
    writer.close()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
  directory = tmp_path_factory.mktemp("shards")
  write_shards(directory, numbered_documents(NUM_SHARDS * PER_SHARD))
  return directory


def _values(spm_model: str, **overrides) -> dict:
  values = dict(dataset_type="stream", tokenizer_path=spm_model, vocab_size=512, max_target_length=LENGTH,
                per_device_batch_size=1, print_config=False, data_prefetch_batches=0)
  values.update(overrides)
  return values


def _iterator(values: dict):
  config = Config.for_testing(**values)
  return create_data_iterator(config, sharding.create_mesh(config.mesh))


def _take(iterator, n: int) -> list[dict[str, np.ndarray]]:
  return [{k: np.asarray(jax.device_get(v)) for k, v in next(iterator).items()} for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
  assert len(a) == len(b)
  for i, (x, y) in enumerate(zip(a, b)):
    for name in x:
      np.testing.assert_array_equal(x[name], y[name], err_msg=f"batch {i} {name}")


@pytest.fixture
def opened(monkeypatch) -> list[str]:
  """The shard files the stream fetches, in order."""
  paths: list[str] = []
  lock, real = threading.Lock(), streaming._open_shard

  def recording(path: str):
    with lock:
      paths.append(storage.name(path))
    return real(path)

  monkeypatch.setattr(streaming, "_open_shard", recording)
  return paths


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_shards_give_the_batches_of_the_same_documents_in_one_file(spm_model, shards, tmp_path, suffix):
  whole = tmp_path / "whole.jsonl"
  whole.write_text("".join(json.dumps({"text": t}) + "\n" for t in numbered_documents(NUM_SHARDS * PER_SHARD)))
  single = _iterator(_values(spm_model, dataset_type="hf", hf_data_files=str(whole), enable_data_shuffling=False))
  streamed = _iterator(_values(spm_model, stream_train_files=str(shards / f"*.{suffix}"), enable_data_shuffling=False))
  _assert_same(_take(streamed, 12), _take(single, 12))


def test_one_shard_is_read_at_a_time_with_the_next_read_ahead(spm_model, shards, opened):
  data = _iterator(_values(spm_model, stream_train_files=str(shards / "*.parquet"), enable_data_shuffling=False))
  next(data)
  deadline = time.time() + 30
  while len(opened) < 2 and time.time() < deadline:
    time.sleep(0.01)
  assert opened == ["shard-000.parquet", "shard-001.parquet"]  # the first, and the next one ahead; no more


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_restart_mid_shard_opens_only_that_shard_and_continues_exactly(spm_model, shards, opened, suffix,
                                                                         monkeypatch):
  values = _values(spm_model, stream_train_files=str(shards / f"*.{suffix}"), data_prefetch_batches=2)
  data = _iterator(values)
  while (data.get_state()["shards"]["0"]["index"] >> streaming.ROW_BITS) < 2:  # into the third file visited
    next(data)
  state = json.loads(json.dumps(data.get_state()))
  expected = _take(data, 20)  # on into the reshuffled second epoch
  data.close()
  visit, row = divmod(state["shards"]["0"]["index"], 1 << streaming.ROW_BITS)
  assert 0 < row < PER_SHARD or state["shards"]["0"]["offset"] > 0, state  # mid-shard
  stream = streaming.ShardStream("k", str(shards / f"*.{suffix}"), data.shard, str, "text", 0, True, "w")
  unfinished = storage.name(stream.file_of_visit(visit) or "")
  # The resumed stream's own fetches: the closed one's read-ahead may still land (beside the full test run it did,
  # on the file the resumed stream opens first).
  threads_before = {t.ident for t in threading.enumerate()}
  fetched: list[str] = []
  recording = streaming._open_shard

  def resumed_fetch(path: str):
    if threading.get_ident() not in threads_before:
      fetched.append(storage.name(path))
    return recording(path)

  monkeypatch.setattr(streaming, "_open_shard", resumed_fetch)
  resumed = _iterator(values)
  resumed.set_state(state)
  first = _take(resumed, 1)
  assert fetched[0] == unfinished and len(set(fetched[:2])) == len(fetched[:2]), fetched
  _assert_same(first + _take(resumed, 19), expected)
  resumed.close()


def test_streaming_from_gcs_killed_mid_shard_continues_exactly(spm_model, shards, gcs, gcs_bucket):
  for path in sorted(shards.glob("*.parquet")):
    storage.write_bytes(f"{gcs_bucket}/corpus/{path.name}", path.read_bytes())
  values = _values(spm_model, stream_train_files=f"{gcs_bucket}/corpus/*.parquet", data_prefetch_batches=2)
  uninterrupted = _iterator(values)
  expected = _take(uninterrupted, 30)
  uninterrupted.close()
  killed = _iterator(values)
  _take(killed, 7)
  state = json.loads(json.dumps(killed.get_state()))
  assert state["shards"]["0"]["index"] & ((1 << streaming.ROW_BITS) - 1) or state["shards"]["0"]["offset"]
  killed.close()  # what a SIGKILL leaves: the checkpoint's state and nothing else
  del killed
  rerun = _iterator(values)
  rerun.set_state(state)
  _assert_same(_take(rerun, 23), expected[7:])
  rerun.close()


def test_hosts_read_their_own_files(spm_model, shards):
  files = [streaming.ShardStream("k", str(shards / "*.jsonl"), HostShard(i, 2, 4), str, "text", None, True, "w").files
           for i in (0, 1)]
  assert [[storage.name(f) for f in fs] for fs in files] == [["shard-000.jsonl", "shard-002.jsonl"],
                                                              ["shard-001.jsonl", "shard-003.jsonl"]]
  with pytest.raises(ConfigError, match="has 4 shard file.*fewer than the 5 data shards"):
    streaming.ShardStream("k", str(shards / "*.jsonl"), HostShard(0, 5, 1), str, "text", None, True, "w")


def test_bad_shards_are_one_line_each(spm_model, tmp_path):
  (tmp_path / "a.csv").write_text("text\nx\n")
  with pytest.raises(ConfigError, match=r"stream_train_files: .*a.csv is not a shard file this reader knows"):
    _iterator(_values(spm_model, stream_train_files=str(tmp_path / "a.csv")))
  with pytest.raises(ConfigError, match="stream_train_files: no file matches"):
    _iterator(_values(spm_model, stream_train_files=str(tmp_path / "none*.jsonl")))
  with pytest.raises(ConfigError, match="dataset_type=stream needs stream_train_files"):
    Config.for_testing(**_values(spm_model))
  (tmp_path / "e1.jsonl").write_text("")
  (tmp_path / "e2.jsonl").write_text("\n")
  with pytest.raises(ConfigError, match=r"the train data \(stream .*\) is empty: its 2 shard file\(s\) hold no records"):
    _take(_iterator(_values(spm_model, stream_train_files=str(tmp_path / "e*.jsonl"))), 1)
  (tmp_path / "bad.jsonl").write_text('{"text": "fine words here"}\n{"text": broken\n')
  with pytest.raises(UserError, match=r"bad.jsonl line 2: not valid JSON") as error:
    _take(_iterator(_values(spm_model, stream_train_files=str(tmp_path / "bad.jsonl"))), 2)
  assert "\n" not in str(error.value)


def test_eval_reads_the_shards_once_then_pads_and_reset_starts_over(spm_model, shards):
  config = Config.for_testing(**_values(spm_model, stream_train_files=str(shards / "*.jsonl"), eval_interval=5,
                                        stream_eval_files=str(shards / "shard-00[01].jsonl")))
  evaluation = create_eval_iterator(config, sharding.create_mesh(config.mesh))
  first = _take(evaluation, 40)
  real = [b for b in first if b["targets_segmentation"].any()]
  assert 0 < len(real) < 40 and not first[-1]["targets_segmentation"].any()  # ran out, then padding
  evaluation.reset()
  _assert_same(_take(evaluation, len(real)), real)


def test_a_stream_in_a_mixture_resumes_exactly(spm_model, shards, prepared):
  values = _values(spm_model, dataset_type="grain", data_prefetch_batches=2, data_mixture=[
      {"name": "books", "weight": 1, "grain_train_files": str(prepared / "arrayrecord" / "train.array_record")},
      {"name": "shards", "weight": 2, "dataset_type": "stream", "stream_train_files": str(shards / "*.parquet")}])
  data = _iterator(values)
  _take(data, 6)
  state = json.loads(json.dumps(data.get_state()))
  expected = _take(data, 10)
  data.close()
  resumed = _iterator(values)
  resumed.set_state(state)
  _assert_same(_take(resumed, 10), expected)
  resumed.close()


def _documents(path: Path, column: str | None = "text") -> list:
  """Every document of one shard file as the stream hands it to the encoder (no tokenizer)."""
  stream = streaming.ShardStream("stream_train_files", str(path), HostShard(0, 1, 1), lambda d: d, column, None,
                                 False, "the train data")
  return [located.document for located in stream.read_from(0)]


def _one_line_error(path: Path) -> str:
  with pytest.raises(UserError) as error:
    _documents(path)
  message = str(error.value)
  assert str(path) in message and "\n" not in message, message
  return message


def test_every_line_of_a_json_shard_is_a_json_record(tmp_path):
  ok = tmp_path / "ok.jsonl"  # a BOM, an indented record, a blank line, CRLF, a JSON string record
  ok.write_bytes(b'\xef\xbb\xbf{"text": "first doc"}\r\n   {"text": "indented"}\n\n\t"a string"\n')
  assert _documents(ok) == ["first doc", "indented", "a string"]
  for name, lines, problem in [
      ("garbage.jsonl", b'{"text": "fine"}\nthis is not json\n', "line 2: not valid JSON"),
      ("number.jsonl", b'{"text": "fine"}\n\n42\n', "line 3: a JSON number, not an object"),
      ("truncated.jsonl", b'{"text": "fine"}\n{"text": "cut her', "line 2: not valid JSON"),
      ("binary.jsonl", b'{"text": "fine"}\n\xff\xfe\x00garbage\n', "line 2: not"),
      ("null.jsonl", b'{"text": "fine"}\n{"text": null}\n', "line 2: column 'text' is null"),
      ("list.jsonl", b'{"text": ["a", "b"]}\n', "line 1: column 'text' is a JSON array, not text"),
      # json decodes it into a str no tokenizer takes (was a RuntimeError / TypeError from the tokenizer)
      ("surrogate.jsonl", b'{"text": "fine"}\n{"text": "a \\ud800 b"}\n', "line 2: holds an unpaired UTF-16 surrogate")]:
    (tmp_path / name).write_bytes(lines)
    assert problem in _one_line_error(tmp_path / name), name


def test_a_json_array_shard_is_read_as_its_records_as_hf_reads_it(tmp_path):
  array = tmp_path / "pretty.json"
  array.write_text('[\n  {"text": "one"},\n  {"text": "two"}\n]\n')
  assert _documents(array) == ["one", "two"]
  (tmp_path / "cut.json").write_text('[\n  {"text": "one"},\n  {"text": "tw')
  assert "is a JSON array (it starts with '[') but not valid JSON" in _one_line_error(tmp_path / "cut.json")
  (tmp_path / "numbers.json").write_text('[{"text": "one"}, 7]')
  assert "record 2: a JSON number, not an object" in _one_line_error(tmp_path / "numbers.json")


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty", "jsonl"])
def test_a_corrupt_parquet_shard_is_one_line_naming_it(tmp_path, content):
  good = tmp_path / "good.parquet"
  pq.write_table(pa.table({"text": numbered_documents(20)}), good)
  data = {"garbage": bytes(range(256)) * 4, "truncated": good.read_bytes()[:-30], "empty": b"",
          "jsonl": b'{"text": "not parquet"}\n'}[content]
  bad = tmp_path / "bad.parquet"
  bad.write_bytes(data)
  assert "is not a readable parquet file" in _one_line_error(bad)


def test_a_damaged_arrayrecord_shard_is_one_line_naming_it(tmp_path, shards):
  bad = tmp_path / "bad.array_record"
  bad.write_bytes((shards / "shard-000.array_record").read_bytes()[:-100])
  assert "is not a readable ArrayRecord file" in _one_line_error(bad)


def test_json_nested_past_the_parsers_limit_is_one_line_naming_the_record(tmp_path):
  """Was: RecursionError with a traceback, from a JSONL line and from a JSON array shard."""
  (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100000 + "\n")
  assert "line 2: not readable JSON (nested deeper than JSON can be read)" in _one_line_error(tmp_path / "deep.jsonl")
  (tmp_path / "deep.json").write_text("[" * 100000)
  assert "nested deeper than JSON can be read" in _one_line_error(tmp_path / "deep.json")


def test_a_shard_file_gone_when_its_turn_comes_is_one_line_naming_it(tmp_path):
  """A file listed at start-up and deleted (or replaced by a folder) before the stream reached it was a
  FileNotFoundError / IsADirectoryError traceback from the read-ahead thread."""
  for gone in ("deleted", "a folder"):
    directory = tmp_path / gone
    directory.mkdir()
    for i in range(3):
      (directory / f"s{i}.jsonl").write_text("".join(json.dumps({"text": f"doc {i} {j}"}) + "\n" for j in range(3)))
    stream = streaming.ShardStream("stream_train_files", str(directory / "*.jsonl"), HostShard(0, 1, 1), lambda d: d,
                                   "text", None, True, "the train data")
    documents = stream.read_from(0)
    assert next(documents).document == "doc 0 0"  # s1 is read ahead now; s2 is opened when s1 is reached
    (directory / "s2.jsonl").unlink()
    if gone == "a folder":
      (directory / "s2.jsonl").mkdir()
    with pytest.raises(UserError) as error:
      for _ in range(9):
        next(documents)
    message = str(error.value)
    assert message.startswith(f"{directory / 's2.jsonl'} cannot be read (") and "restore it" in message \
        and "\n" not in message, message


@pytest.mark.parametrize("kind", ["stream", "hf"])
def test_a_resume_whose_glob_matches_other_files_says_so(spm_model, tmp_path, capsys, kind):
  """A shard added under the same glob (the key's text unchanged) moved the saved position into other documents
  with no word: a stream's file index, an hf position's record index over the files put together."""
  directory = tmp_path / "data"
  write_shards(directory, numbered_documents(2 * PER_SHARD))
  files = str(directory / "shard-*.jsonl")
  key = {"stream": dict(dataset_type="stream", stream_train_files=files),
         "hf": dict(dataset_type="hf", hf_path="json", hf_data_files=files)}[kind]
  values = _values(spm_model, **key)
  first = _iterator(values)
  _take(first, 2)
  state = first.get_state()
  first.close()
  same = _iterator(values)
  same.set_state(state)
  same.close()
  assert "warning" not in capsys.readouterr().out
  (directory / "shard-000a.jsonl").write_text(json.dumps({"text": "a new document"}) + "\n")
  resumed = _iterator(values)
  resumed.set_state(state)
  resumed.close()
  size = {"stream": ("2 file(s)", "3 file(s)"), "hf": (f"{2 * PER_SHARD} record(s)", f"{2 * PER_SHARD + 1} record(s)")}
  saved, now = size[kind]
  out = capsys.readouterr().out
  assert f"warning: the checkpoint's data position was saved over {saved} of " in out, out
  assert f"which now holds {now}: the same position reads other documents" in out, out
