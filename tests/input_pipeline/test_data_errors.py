"""Each user error of the data keys and datasets ends in one clear ConfigError, before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import check_sources, create_data_iterator, create_eval_iterator


def _grain(spm_model: str, prepared: Path, **overrides) -> dict:
  values = dict(dataset_type="grain", tokenizer_path=spm_model, vocab_size=512, max_target_length=16,
                per_device_batch_size=1, print_config=False,
                grain_train_files=str(prepared / "arrayrecord" / "train.array_record"))
  values.update(overrides)
  return values


def _open(values: dict, evaluation: bool = False):
  config = Config.for_testing(**values)
  mesh = sharding.create_mesh(config.mesh)
  return create_eval_iterator(config, mesh) if evaluation else create_data_iterator(config, mesh)


@pytest.mark.parametrize("overrides, message", [
    (dict(dataset_type="c4"), "dataset_type must be one of synthetic, tfds, hf, grain"),
    (dict(tokenizer_path="/nonexistent/tok.model"), "tokenizer_path /nonexistent/tok.model does not exist"),
    (dict(vocab_size=256), "has 512 tokens, more than vocab_size=256; set vocab_size >= 512"),
    (dict(grain_train_files="/nonexistent/*.array_record"), "grain_train_files: no file matches"),
    (dict(eval_interval=10), "needs grain_eval_files"),
    (dict(train_data_columns=["text", "title"]), "exactly one text column"),
    (dict(dataset_type="tfds"), "dataset_type=tfds needs dataset_name"),
    (dict(dataset_type="tfds", dataset_name="x", dataset_path="/nonexistent"), "is not a directory"),
    (dict(dataset_type="hf"), "dataset_type=hf needs hf_path or hf_data_files"),
    (dict(dataset_type="hf", hf_data_files="/nonexistent.jsonl"), "hf_data_files: no file matches"),
    (dict(max_target_length=1), "max_target_length must be >= 2"),
])
def test_config_errors(spm_model, prepared, overrides, message):
  """Key errors from validation, file and tokenizer errors from check_sources (train.py calls it
  before building any state)."""
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    check_sources(Config.for_testing(**_grain(spm_model, prepared, **overrides)).data)


def test_empty_dataset(spm_model, prepared, tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter

  empty = tmp_path / "empty.array_record"
  ArrayRecordWriter(str(empty), "group_size:1").close()
  with pytest.raises(ConfigError, match="the train data .* is empty"):
    _open(_grain(spm_model, prepared, grain_train_files=str(empty)))


def test_fewer_records_than_hosts_is_explained():
  from MaxText.input_pipeline import pipeline

  with pytest.raises(ConfigError, match="has 1 records, fewer than the 2 data shards"):
    pipeline.document_dataset(["one"], pipeline.HostShard(0, 2, 4), list, "text", None, True, "the train data")


def test_missing_text_column(spm_model, prepared):
  data = _open(_grain(spm_model, prepared, train_data_columns=["body"], data_prefetch_batches=0))
  with pytest.raises(ConfigError, match="records have no column 'body' \\(they have text\\)"):
    next(data)


def test_split_that_does_not_exist_tfds(spm_model, prepared):
  values = _grain(spm_model, prepared, dataset_type="tfds", dataset_path=str(prepared / "tfds"),
                  dataset_name="local_text/corpus", eval_split="test", eval_interval=5)
  with pytest.raises(ConfigError, match="split 'test' does not exist in tfds dataset 'local_text/corpus'; "
                                        "it has (train, validation|validation, train)"):
    _open(values, evaluation=True)
  with pytest.raises(ConfigError, match="tfds dataset 'local_text/other' not found under dataset_path"):
    _open(dict(values, dataset_name="local_text/other"))


def test_split_that_does_not_exist_hf(spm_model, prepared, tmp_path):
  import datasets

  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c", "d e f"]})}).save_to_disk(
      str(tmp_path / "saved"))
  values = _grain(spm_model, prepared, dataset_type="hf", hf_path=str(tmp_path / "saved"), eval_interval=5)
  assert len(next(_open(values))["inputs"]) == 8  # the train split reads
  with pytest.raises(ConfigError, match="split 'validation' does not exist in .*saved; it has train"):
    _open(values, evaluation=True)


def test_hub_dataset_is_never_downloaded(spm_model, prepared):
  values = _grain(spm_model, prepared, dataset_type="hf", hf_path="someone/not_cached_here")
  with pytest.raises(ConfigError, match="is not available offline"):
    _open(values)


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("empty.json", ""), ("blank.jsonl", "\n \n"),
                                           ("empty.txt", ""),
                                           # were: 'hf dataset ...: Instruction "train" corresponds to no data!'
                                           ("empty_array.json", "[]"), ("empty_array_lines.json", "\ufeff[\n ]\n"),
                                           ("no_rows.parquet", None)])
def test_an_empty_hf_file_is_named_as_empty(spm_model, prepared, tmp_path, name, content):
  if content is None:  # a parquet file of no rows (was: "datasets cannot read them as parquet (ArrowInvalid: ...")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(tmp_path / name))
  else:
    (tmp_path / name).write_text(content)
  with pytest.raises(ConfigError) as error:
    _open(_grain(spm_model, prepared, dataset_type="hf", hf_data_files=str(tmp_path / name)))
  assert f"{tmp_path / name}) is empty" in str(error.value), str(error.value)


def test_hf_json_records_that_are_all_empty_objects_are_named(tmp_path):
  """Was: 'hf dataset ...: Instruction "train" corresponds to no data!' for a file of 3 records."""
  from MaxText.input_pipeline import hf

  (tmp_path / "objects.jsonl").write_text("{}\n{}\n{}\n")
  with pytest.raises(ConfigError) as error:
    hf.open_split("", str(tmp_path / "objects.jsonl"), "train", "hf_data_files")
  assert str(error.value) == (f"hf_data_files {tmp_path / 'objects.jsonl'}: every record is an empty JSON object "
                              "({}): there is no field to read; give each record its fields"), str(error.value)


def test_a_field_of_another_type_in_another_file_says_to_give_it_one_type(tmp_path):
  """A string prompt in one file and a list of messages in another: datasets' cast error alone did not say
  what to change."""
  from MaxText.input_pipeline import hf

  (tmp_path / "a.jsonl").write_text('{"prompt": "hi", "completion": "there"}\n')
  (tmp_path / "b.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}], '
                                    '"completion": [{"role": "assistant", "content": "x"}]}\n')
  with pytest.raises(ConfigError, match=r"datasets cannot read them as json \(TypeError: Couldn't cast .*\); a field "
                                        r"has values of different types across the files .*: give each field one "
                                        r"type in every file$"):
    hf.open_split("", str(tmp_path / "*.jsonl"), "train", "hf_data_files")


@pytest.mark.parametrize("name, content, problem", [
    ("nulls.jsonl", 'null\n{"text": "a"}\n', "nulls.jsonl line 1: a JSON null, not an object (one record per line)"),
    ("spaced.jsonl", '\n  null  \n{"text": "a"}\n', "spaced.jsonl line 2: a JSON null, not an object"),
    ("bom.jsonl", '\ufeffnull\n', "bom.jsonl line 1: a JSON null, not an object"),
    ("nulls.json", '[null, {"text": "a"}]', "nulls.json record 1 of its array is a JSON null, not an object"),
], ids=["first-line", "after-blank-lines", "after-a-bom", "json-array"])
def test_a_json_file_whose_first_record_is_null_is_named(tmp_path, name, content, problem):
  """pyarrow's JSON reader, under datasets, ended the process with a segmentation fault (exit 139, no line). Run
  in a process of its own, so that a return of the crash fails this test, not the session."""
  import subprocess
  import sys

  (tmp_path / name).write_text(content)
  code = ("import sys\nfrom MaxText.errors import ConfigError\nfrom MaxText.input_pipeline import hf\n"
          "try:\n  hf.open_split('', sys.argv[1], 'train', 'hf_data_files')\n"
          "except ConfigError as e:\n  print(e)\n  sys.exit(2)\n")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], cwd=Path(__file__).resolve().parents[2],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert proc.stdout.startswith(f"hf_data_files: {tmp_path}/{problem}") and "; fix or remove that record" in \
      proc.stdout, proc.stdout


def test_a_json_string_that_is_not_utf8_is_named_by_file_and_line(spm_model, prepared, tmp_path):
  """datasets' JSON reader keeps a string's bytes unchecked; reading the record raised UnicodeDecodeError as a
  traceback."""
  lines = [b'{"text": "first record"}', b'{"text": "caf\xe9"}', b'{"text": "third record"}']
  (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  with pytest.raises(UserError) as error:
    iterator = _open(_grain(spm_model, prepared, dataset_type="hf", hf_data_files=str(tmp_path / "latin1.jsonl"),
                            enable_data_shuffling=False, data_prefetch_batches=0))
    for _ in range(3):
      next(iterator)
  assert str(error.value) == (f"{tmp_path / 'latin1.jsonl'} line 2: holds text that is not UTF-8 (a byte 0xe9 in one "
                              "of its strings); save the file as UTF-8 or remove that record"), str(error.value)


def test_an_empty_grpo_prompt_file_is_named_as_empty(tiny_overrides, tmp_path):
  from MaxText.input_pipeline import chat
  from MaxText.rl import prompts
  from tests.input_pipeline.sft_fixtures import write_tokenizer

  tokenizer = write_tokenizer(tmp_path / "tokenizer", None)
  (tmp_path / "prompts.jsonl").write_text("")
  config = Config.for_testing(**{**tiny_overrides, "objective": "grpo", "dataset_type": "hf", "tokenizer_path": str(
      tokenizer), "tokenizer_type": "huggingface", "hf_data_files": str(tmp_path / "prompts.jsonl"), "vocab_size": 320,
      "reward_functions": "exact_match", "num_generations": 4, "max_prefill_predict_length": 8,
      "max_completion_length": 6, "max_target_length": 16, "eval_interval": -1})
  with pytest.raises(UserError) as error:
    prompts.PromptSet(config, chat.load_chat_tokenizer(str(tokenizer), require_template=False))
  assert f"{tmp_path / 'prompts.jsonl'}" in str(error.value) and "is empty" in str(error.value), str(error.value)


def test_a_byte_order_mark_is_not_text(spm_model, prepared, tmp_path):
  """hf reads a .txt file's lines as documents; the BOM before the first is the file's, not the text's."""
  from MaxText.input_pipeline import hf

  (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfline one\nline two\n")
  dataset, _ = hf.open_split("", str(tmp_path / "bom.txt"), "train", "hf_data_files")
  assert dataset["text"] == ["line one", "line two"]


def test_a_damaged_arrayrecord_file_is_named(spm_model, prepared, tmp_path):
  import shutil

  shutil.copy(prepared / "arrayrecord" / "train.array_record", tmp_path / "a.array_record")
  (tmp_path / "b.array_record").write_bytes(b"\xff" * 300)
  with pytest.raises(ConfigError) as error:
    _open(_grain(spm_model, prepared, grain_train_files=str(tmp_path / "*.array_record")))
  assert f"{tmp_path / 'b.array_record'} is not a readable ArrayRecord file" in str(error.value), str(error.value)


@pytest.mark.parametrize("damaged", ["dataset_info.json", "local_text-train.array_record-00000-of-00001"])
def test_a_damaged_tfds_file_is_named(spm_model, prepared, tmp_path, damaged):
  import shutil

  shutil.copytree(prepared / "tfds", tmp_path / "tfds")
  path = next((tmp_path / "tfds").rglob(damaged))
  path.write_bytes(path.read_bytes()[:200])
  with pytest.raises(UserError) as error:
    next(_open(_grain(spm_model, prepared, dataset_type="tfds", dataset_path=str(tmp_path / "tfds"),
                      dataset_name="local_text/corpus")))
  assert str(path) in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_prepare_data_reads_a_bom_as_the_files_and_names_bytes_that_are_not_utf8(tmp_path):
  """Was: the BOM kept at the start of the first document, and a UnicodeDecodeError traceback."""
  from MaxText.input_pipeline import prepare_data

  (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbffirst\n\nsecond\n")
  assert prepare_data.split_documents(prepare_data.read_corpus(str(tmp_path / "bom.txt")), "paragraph") == \
      ["first", "second"]
  (tmp_path / "latin1.txt").write_bytes("one\ntwo caf\xe9\n".encode("latin-1"))
  with pytest.raises(UserError) as raised:
    prepare_data.read_corpus(str(tmp_path / "latin1.txt"))
  assert str(raised.value).startswith(f"data_files: {tmp_path / 'latin1.txt'} is not UTF-8 text (byte 12, line 2)")


@pytest.mark.parametrize("name, content, problem", [
    ("deep.jsonl", '{"text": "a"}\n' + "[" * 100000 + "\n", "deep.jsonl line 2: not readable JSON (nested deeper"),
    ("deep.json", "[" * 100000, "deep.json is not readable JSON (nested deeper"),
], ids=["jsonl", "json-array"])
def test_hf_json_nested_past_the_parsers_limit_is_named(tmp_path, name, content, problem):
  """datasets refuses it; finding the line to name then raised RecursionError (a traceback)."""
  from MaxText.input_pipeline import hf

  (tmp_path / name).write_text(content)
  with pytest.raises(ConfigError) as error:
    hf.open_split("", str(tmp_path / name), "train", "hf_data_files")
  assert f"hf_data_files: {tmp_path}/{problem}" in str(error.value) and "\n" not in str(error.value), str(error.value)
