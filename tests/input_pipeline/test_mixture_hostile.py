"""data_mixture and dataset_type=stream as a hurried or hostile user meets them: source keys of
another type, names YAML did not read as text, weights past the float limit, one source named twice,
a hand-edited saved position, a source whose documents are all too short, and compressed shards.
Each is the right data or one line naming the culprit."""

from __future__ import annotations

import bz2
import copy
import gzip
import io
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import check_sources, create_data_iterator, streaming
from MaxText.input_pipeline.pipeline import HostShard
from MaxText.platform import sharding


def _values(spm_model: str, prepared: Path, mix: list[dict], **overrides) -> dict:
  values = dict(dataset_type="grain", tokenizer_path=spm_model, vocab_size=512, max_target_length=16,
                per_device_batch_size=1, print_config=False, data_prefetch_batches=0, data_mixture=mix)
  values.update(overrides)
  return values


def _web(prepared: Path, **keys) -> dict:
  return {"name": "web", "weight": 3, "grain_train_files": str(prepared / "arrayrecord" / "train.array_record"), **keys}


def _code(prepared: Path, **keys) -> dict:
  return {"name": "code", "weight": 1, "dataset_type": "hf", "hf_data_files": str(prepared / "jsonl" / "train.jsonl"),
          **keys}


def _iterator(values: dict):
  config = Config.for_testing(**values)
  check_sources(config.data)
  return create_data_iterator(config, sharding.create_mesh(config.mesh))


def _refusal(values: dict) -> str:
  with pytest.raises(ConfigError) as error:
    _iterator(values)
  message = str(error.value)
  assert "\n" not in message, message
  return message


# ---------------------------------------------------------------- the keys of a source

def test_a_list_of_files_for_a_source_is_one_line_saying_to_give_one_string(spm_model, prepared):
  """Was: AttributeError ('tuple' object has no attribute 'split') from the file list, with a traceback."""
  files = str(prepared / "arrayrecord" / "train.array_record")
  for key, mix in [("grain_train_files", _web(prepared, grain_train_files=[files, files])),
                   ("stream_train_files", _web(prepared, dataset_type="stream", stream_train_files=[files]))]:
    message = _refusal(_values(spm_model, prepared, [mix, _code(prepared)]))
    assert message.startswith(f"data_mixture source 'web' sets {key} to [") and "comma-separated" in message, message


def test_a_source_text_column_given_as_one_string_is_that_column(spm_model, prepared, tmp_path):
  """Was: 'train_data_columns must name exactly one text column, got ['c', 'o', 'n', ...]' (the run's own key
  takes one string)."""
  content = tmp_path / "content.jsonl"
  content.write_text("".join(json.dumps({"content": f"doc {i} alpha bravo"}) + "\n" for i in range(9)))
  mix = [_web(prepared), _code(prepared, hf_data_files=str(content), train_data_columns="content")]
  config = Config.for_testing(**_values(spm_model, prepared, mix))
  assert dict(config.data.data_mixture[1].keys)["train_data_columns"] == ("content",)
  data = _iterator(_values(spm_model, prepared, mix))
  for _ in range(6):
    next(data)
  assert data.total_tokens["code"] > 0


@pytest.mark.parametrize("name", [None, True, 1.5])
def test_a_name_yaml_did_not_read_as_text_is_refused(spm_model, prepared, name):
  """`name:` (null) and `name: yes` (true) were sources named 'None' and 'True'."""
  with pytest.raises(ConfigError, match=r"data_mixture source 1 needs a name of letters.*got " + repr(name)):
    Config.for_testing(**_values(spm_model, prepared, [_web(prepared, name=name), _code(prepared)]))


def test_weights_whose_sum_overflows_are_refused(spm_model, prepared):
  """Was: 'ValueError: Probabilities do not sum to 1' from numpy at the first batch."""
  mix = [_web(prepared, weight=1e308), _code(prepared, weight=1e308)]
  with pytest.raises(ConfigError, match="data_mixture's weights sum past the largest float; they are relative"):
    Config.for_testing(**_values(spm_model, prepared, mix))
  schedule = [{"step": 5, "web": 1e308, "code": 1e308}]
  with pytest.raises(ConfigError, match="data_mixture_schedule step 5's weights sum past the largest float"):
    Config.for_testing(**_values(spm_model, prepared, [_web(prepared), _code(prepared)],
                                 data_mixture_schedule=schedule))


def test_two_sources_reading_the_same_data_are_refused(spm_model, prepared):
  """A copied entry renamed but not repointed read the same documents at the sum of the weights, silently."""
  copied = _web(prepared, name="books", weight=1, dataset_type="grain", train_data_columns=["text"])
  with pytest.raises(ConfigError, match="data_mixture sources 'web' and 'books' read the same data; make them one"):
    Config.for_testing(**_values(spm_model, prepared, [_web(prepared), _code(prepared), copied]))


# ---------------------------------------------------------------- a hand-edited saved position

@pytest.fixture(scope="module")
def saved_state(spm_model, prepared) -> dict:
  data = _iterator(_values(spm_model, prepared, [_web(prepared), _code(prepared)]))
  for _ in range(3):
    next(data)
  return json.loads(json.dumps(data.get_state()))


@pytest.mark.parametrize("where, value", [
    (("sources", "web", "index"), -5), (("sources", "web", "index"), 2.7), (("sources", "web", "index"), "2"),
    (("sources", "web", "index"), True), (("sources", "code", "offset"), -1), (("batches",), -3),
    (("batches",), 2.5)])
def test_a_hand_edited_position_is_named_as_damaged(spm_model, prepared, saved_state, where, value):
  """Was: a position taken as int() of anything (another document, silently) or, for a negative
  number, a ValueError from numpy or the packer at the first batch."""
  state = copy.deepcopy(saved_state)
  place = state["shards"]["0"]
  for step in where[:-1]:
    place = place[step]
  place[where[-1]] = value
  data = _iterator(_values(spm_model, prepared, [_web(prepared), _code(prepared)]))
  with pytest.raises(ConfigError, match="the checkpoint's data position of data shard 0 is damaged"):
    data.set_state(state)


@pytest.mark.parametrize("totals", [{"web": "many", "code": 1}, [1, 2], {"web": -5, "code": 1}])
def test_hand_edited_token_totals_are_named_as_damaged(spm_model, prepared, saved_state, totals):
  """Was: ValueError / AttributeError from int() and .get() with a traceback."""
  data = _iterator(_values(spm_model, prepared, [_web(prepared), _code(prepared)]))
  with pytest.raises(ConfigError, match="the checkpoint's data state is damaged: its total_tokens"):
    data.set_state({**saved_state, "total_tokens": totals})


# ---------------------------------------------------------------- reading

def test_a_source_whose_documents_all_give_nothing_is_named(spm_model, prepared, tmp_path):
  """The packer's 'N documents in a row give no (input, target) pair' did not say which source."""
  empty = tmp_path / "empty.jsonl"
  empty.write_text('{"text": ""}\n' * 3)
  data = _iterator(_values(spm_model, prepared, [_web(prepared), _code(prepared, hf_data_files=str(empty))],
                           add_bos=False, add_eos=False))
  with pytest.raises(UserError, match=r"^data_mixture source 'code': \d+ documents in a row give no"):
    for _ in range(8):
      next(data)


def _documents(path: Path) -> list:
  stream = streaming.ShardStream("stream_train_files", str(path), HostShard(0, 1, 1), lambda d: d, "text", None,
                                 False, "the train data")
  return [located.document for located in stream.read_from(0)]


def test_compressed_shards_are_read_by_the_format_under_the_compression(tmp_path):
  """Were refused with 'not a shard file this reader knows ... rename it' (dataset_type=hf reads them)."""
  lines = b'\xef\xbb\xbf{"text": "one"}\r\n{"text": "two"}\r\n'
  table = io.BytesIO()
  pq.write_table(pa.table({"text": ["one", "two"]}), table)
  for name, data in [("a.jsonl.gz", gzip.compress(lines)), ("b.jsonl.bz2", bz2.compress(lines)),
                     ("c.json.xz", lzma.compress(b'[{"text": "one"}, {"text": "two"}]')),
                     ("d.parquet.gz", gzip.compress(table.getvalue()))]:
    (tmp_path / name).write_bytes(data)
    assert _documents(tmp_path / name) == ["one", "two"], name


def test_a_compressed_shard_the_stream_cannot_read_is_one_line_naming_it(tmp_path):
  (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
  with pytest.raises(ConfigError, match=r"a.jsonl.zst is compressed with a codec this reader cannot read; decompress"):
    _documents(tmp_path / "a.jsonl.zst")
  (tmp_path / "a.array_record.gz").write_bytes(gzip.compress(b"x"))
  with pytest.raises(ConfigError, match=r"a.array_record.gz is an ArrayRecord file compressed with gzip; decompress"):
    _documents(tmp_path / "a.array_record.gz")
  (tmp_path / "plain.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
  with pytest.raises(UserError, match=r"plain.jsonl.gz is not a readable gzip file \(.*\); replace or remove it"):
    _documents(tmp_path / "plain.jsonl.gz")


@pytest.mark.parametrize("schedule, steps, lines", [
    # A stage at or past steps: its weights never draw a batch (the batch of step N+1 is the first a stage at N draws).
    ([{"step": 10, "web": 1, "code": 1}], 10,
     ["warning: data_mixture_schedule's stage(s) at step 10 begin at or after steps=10: they change no weight in this "
      "run"]),
    # code's weight is 0 from step 0 on, and the stage that would read it comes after the run.
    ([{"step": 0, "web": 1}, {"step": 50, "code": 1}], 20,
     ["warning: data_mixture_schedule's stage(s) at step 50 begin at or after steps=20: they change no weight in this "
      "run", "warning: data_mixture source(s) 'code' have weight 0 throughout this run's 20 steps: they are opened and "
      "checked but never read"]),
    ([{"step": 5, "web": 1}], 20, []),  # code is read for the first 5 steps
])
def test_a_schedule_stage_or_a_source_that_changes_nothing_in_this_run_says_so(spm_model, prepared, capsys, schedule,
                                                                                 steps, lines):
  """A stage at or past `steps`, or a source at weight 0 in every stage that applies, read as if it took effect."""
  from MaxText.configuration import config_fields

  config_fields.WARNED.clear()
  Config.for_testing(**_values(spm_model, prepared, [_web(prepared), _code(prepared)], steps=steps,
                               data_mixture_schedule=schedule))
  assert [line for line in capsys.readouterr().err.splitlines() if "data_mixture" in line] == lines


def test_a_source_naming_the_runs_tokenizer_another_way_is_the_same_tokenizer(spm_model, prepared, tmp_path,
                                                                               monkeypatch):
  """A source repeating the run's tokenizer_path as ./tok.model, or its absolute path for a relative one, was
  refused as another tokenizer; another file still is."""
  monkeypatch.chdir(Path(spm_model).parent)
  relative = Path(spm_model).name
  for run_path, source_path in ((relative, f"./{relative}"), (relative, spm_model), (spm_model, relative)):
    Config.for_testing(**_values(run_path, prepared, [_web(prepared, tokenizer_path=source_path), _code(prepared)]))
  with pytest.raises(ConfigError, match="sets tokenizer_path='other.model' but the run uses"):
    Config.for_testing(**_values(spm_model, prepared, [_web(prepared, tokenizer_path="other.model"), _code(prepared)]))
