"""Data files as hurried or hostile users hand them over (compressed, UTF-16, Latin-1, lone surrogates,
binary columns, a directory, mixed formats): each reads as the file holds it or stops with one line
naming the file (and line where cheap) and what to do."""

from __future__ import annotations

import bz2
import gzip
import lzma

import numpy as np
import pytest

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import hf, pipeline, streaming


def _open(path) -> list:
  dataset, _ = hf.open_split("", str(path), "train", "hf_data_files")
  return dataset["text"]


def _refusal(path) -> str:
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(path), "train", "hf_data_files")
  message = str(raised.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("name, compress", [("a.jsonl.gz", gzip.compress), ("a.json.bz2", bz2.compress),
                                            ("a.txt.xz", lzma.compress), ("A.JSONL.GZ", gzip.compress)])
def test_compressed_files_are_read_by_the_format_under_the_compression(tmp_path, name, compress):
  """Was: 'cannot tell the format of hf data files with suffixes ['.gz']' though datasets reads them."""
  content = b"first doc\nsecond doc\n" if ".txt" in name else b'{"text": "first doc"}\n{"text": "second doc"}\n'
  (tmp_path / name).write_bytes(compress(content))
  assert _open(tmp_path / name) == ["first doc", "second doc"]


def test_a_compressed_file_with_no_records_is_named_as_empty_and_its_bad_line_by_number(tmp_path):
  from MaxText.input_pipeline import json_records

  (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n'))
  (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b"\n\n"))
  assert _open(tmp_path / "*.jsonl.gz") == ["a"]
  (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n[1]\n'))
  assert json_records.first_problem(str(tmp_path / "c.jsonl.gz")) == \
      "line 2: a JSON array, not an object (one record per line)"


def test_a_zstd_file_is_refused_with_what_to_do(tmp_path):
  (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
  assert _refusal(tmp_path / "a.jsonl.zst") == (
      f"{tmp_path / 'a.jsonl.zst'} is compressed with a codec datasets cannot read here; decompress it, or compress "
      "it with gzip, bz2 or xz (.gz, .bz2, .xz)")


@pytest.mark.parametrize("name", ["b.jsonl", "b.json", "b.txt"])
@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
def test_a_utf16_file_is_named_as_utf16(tmp_path, name, codec):
  """Was: 'line 2: not UTF-8 text (byte 35)' (JSON) or a datasets UnicodeDecodeError naming only the glob (text)."""
  good, bad = ("a.txt", "\ufeffhello\n") if name.endswith(".txt") else ("a" + name[1:], '\ufeff{"text": "hello"}\n')
  (tmp_path / good).write_text("fine\n" if good.endswith(".txt") else '{"text": "fine"}\n')
  (tmp_path / name).write_bytes(bad.encode(codec))
  pattern = tmp_path / ("*" + name[1:])
  assert _refusal(pattern) == (f"hf_data_files: {tmp_path / name} is UTF-16 text (it starts with a UTF-16 byte order "
                               "mark), not UTF-8; save it as UTF-8")


def test_a_text_file_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
  """Was: 'hf_data_files <glob>: datasets cannot read them as text (UnicodeDecodeError: ...)', no file named."""
  (tmp_path / "a.txt").write_text("fine\n")
  (tmp_path / "b.txt").write_bytes(b"one\ntwo\ncaf\xe9\n")
  assert _refusal(tmp_path / "*.txt") == (f"hf_data_files: {tmp_path / 'b.txt'} line 3 is not UTF-8 text (byte 4 of "
                                          "the line); save it as UTF-8")


@pytest.mark.parametrize("content, where", [
    (b'{"text": "a"}\n{"text": "b"}\n{"text": "x\\udc00"}\n', "line 3:"),
    (b'[{"text": "a"}, {"text": "left \\ud800 right"}]', "record 2 of its array"),
    (b'\xef\xbb\xbf [{"text": "a"},\n {"text": "\\ud83d\\ude00 paired"}, {"text": "\\udfff"}]',
     "record 3 of its array"),
], ids=["jsonl", "json-array", "json-array-after-a-bom"])
def test_a_lone_surrogate_escape_is_named_by_file_and_record(tmp_path, content, where):
  """pyarrow refuses it in JSON lines; the line was 'datasets cannot read them as json (ArrowInvalid: ... in row 2)'
  for the glob. In a JSON array datasets' parser dropped it: "left \\ud800 right" trained as "left  right"."""
  (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
  (tmp_path / "b.jsonl").write_bytes(content)
  assert _refusal(tmp_path / "*.jsonl") == (
      f"hf_data_files: {tmp_path / 'b.jsonl'} {where} holds an unpaired UTF-16 surrogate escape (\\ud800 to \\udfff "
      "without its pair), which is not text; fix or remove that record")


def test_a_json_array_file_is_read_whole_for_its_check_only_when_datasets_parses_it(tmp_path, monkeypatch):
  """The lone-surrogate check read every JSON array file whole at every start, also once datasets' cache held it."""
  (tmp_path / "a.json").write_text('[{"text": "\\ud83d\\ude00 paired"}, {"text": "b"}]')
  read: list[str] = []
  read_plain = hf.data_files_lib.read_plain
  monkeypatch.setattr(hf.data_files_lib, "read_plain", lambda path: read.append(path) or read_plain(path))
  assert _open(tmp_path / "a.json") == ["\U0001f600 paired", "b"] and read == [str(tmp_path / "a.json")]
  assert _open(tmp_path / "a.json") == ["\U0001f600 paired", "b"] and len(read) == 1  # from datasets' cache


def test_a_raw_control_character_in_json_is_worded_once(tmp_path):
  """Was: 'not valid JSON (Invalid control character at at column 13)'."""
  (tmp_path / "a.jsonl").write_bytes(b'{"text": "he\x01llo"}\n')
  assert "(Invalid control character at column 13)" in _refusal(tmp_path / "a.jsonl")
  stream = streaming.ShardStream("stream_train_files", str(tmp_path / "a.jsonl"), pipeline.HostShard(0, 1, 1),
                                 lambda text: text, "text", None, False, "the train data")
  with pytest.raises(UserError, match=r"line 1: not valid JSON \(Invalid control character at column 13\)"):
    list(stream.read_from(0))


def test_a_utf16_stream_shard_is_named_as_utf16(tmp_path):
  """json.loads guessed UTF-16 for the first line; the stray byte after it was 'line 2: not valid JSON'."""
  (tmp_path / "a.jsonl").write_bytes('\ufeff{"text": "hello"}\n{"text": "world"}\n'.encode("utf-16-le"))
  stream = streaming.ShardStream("stream_train_files", str(tmp_path / "a.jsonl"), pipeline.HostShard(0, 1, 1),
                                 lambda text: text, "text", None, False, "the train data")
  with pytest.raises(UserError) as raised:
    list(stream.read_from(0))
  assert str(raised.value).endswith(f"{tmp_path / 'a.jsonl'} is UTF-16 text (it starts with a UTF-16 byte order "
                                    "mark), not UTF-8; save it as UTF-8"), str(raised.value)


def test_mixed_formats_name_a_file_of_each(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
  (tmp_path / "b.parquet").write_bytes(b"PAR1")
  assert _refusal(tmp_path / "*") == (
      f"the hf data files mix formats ({tmp_path / 'a.jsonl'} is json, {tmp_path / 'b.parquet'} is parquet); datasets "
      "reads one format per key: convert them to one format, or make each format a source of data_mixture")


def test_a_directory_is_named_as_one(tmp_path):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "a.jsonl").write_text('{"text": "a"}\n')
  assert _refusal(tmp_path / "data") == (f"hf_data_files: {tmp_path / 'data'} is a directory; name its files, e.g. "
                                         f"{tmp_path / 'data' / '*.jsonl'}")


def test_a_binary_column_that_is_not_utf8_is_refused_not_replaced(tmp_path):
  """Was: 'caf\\xe9' trained as 'caf\\ufffd' (errors='replace'), silently."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": pa.array([b"bin ok", b"caf\xe9"], pa.binary())}), str(tmp_path / "a.parquet"))
  source, _ = hf.open_split("", str(tmp_path / "a.parquet"), "train", "hf_data_files")
  assert pipeline.record_text(source[0], "text") == "bin ok"
  with pytest.raises(UserError, match=r"^column 'text' holds bytes that are not UTF-8 text \(byte 4: 0xe9\); save it "
                                      r"as UTF-8 or remove that record$"):
    pipeline.record_text(source[1], "text")
  with pytest.raises(UserError, match=r"^the record holds bytes that are not UTF-8 text \(byte 2: 0xff\)"):
    pipeline.record_text(b"a\xffb", "text")  # a raw ArrayRecord record


def test_a_missing_field_is_named_as_possibly_missing(tmp_path):
  """datasets fills a field a record lacks with null: 'is null' alone sent the user looking for a null."""
  (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
  source, _ = hf.open_split("", str(tmp_path / "a.jsonl"), "train", "hf_data_files")
  with pytest.raises(UserError, match=r"^column 'text' is null or missing, not text; fix or remove that record$"):
    pipeline.record_text(source[1], "text")


def _write_texts(path, values: list) -> None:
  import json

  import pyarrow as pa
  import pyarrow.parquet as pq

  if path.suffix == ".parquet":
    pq.write_table(pa.table({"text": values, "id": list(range(len(values)))}), str(path))
  else:
    path.write_text("".join(json.dumps({"text": v, "id": i}) + "\n" for i, v in enumerate(values)))


@pytest.mark.parametrize("suffix, problem", [
    (".parquet", "column 'text' is int64 in this parquet file, not text (string); store it as strings, or name the "
                 "text column in train_data_columns"),
    (".jsonl", "line 1: column 'text' is a JSON number, not text; fix or remove that record"),
], ids=["parquet", "jsonl"])
@pytest.mark.parametrize("numbers_first", [False, True], ids=["strings-first", "numbers-first"])
def test_a_file_whose_text_column_is_numbers_is_named_not_cast(spm_model, tmp_path, suffix, problem, numbers_first):
  """datasets types the table by the first file and casts the others to it: the numbers were trained as "1", "2"
  after a file of strings, and before one the line was "datasets cannot read them as ... (ArrowInvalid: Failed to
  parse string: 'to be' as a scalar of type int64)". Other columns may differ (the id column is int in both)."""
  from MaxText.configuration.config import Config
  from MaxText.input_pipeline import create_data_iterator
  from MaxText.platform import sharding

  numbers = tmp_path / f"{'a' if numbers_first else 'b'}{suffix}"
  _write_texts(tmp_path / f"{'b' if numbers_first else 'a'}{suffix}", ["to be or not", "that is the question"])
  _write_texts(numbers, [1, 2, 3])
  config = Config.for_testing(dataset_type="hf", hf_data_files=str(tmp_path / f"*{suffix}"), tokenizer_path=spm_model,
                              vocab_size=512, max_target_length=32, per_device_batch_size=1, print_config=False,
                              enable_data_shuffling=False, data_prefetch_batches=0)
  with pytest.raises(ConfigError) as raised:
    next(create_data_iterator(config, sharding.create_mesh(config.mesh)))
  assert str(raised.value) == f"hf_data_files: {numbers}{':' if suffix == '.parquet' else ''} {problem}"


@pytest.mark.parametrize("value, kind", [(7, "a JSON number"), ([1, 2], "a JSON array"), ({"a": 1}, "a JSON object"),
                                         (True, "a JSON boolean")], ids=["number", "array", "object", "boolean"])
@pytest.mark.parametrize("late", [False, True], ids=["first-chunk", "past-10MB"])
def test_a_jsonl_text_value_that_is_not_a_string_is_named_by_line_wherever_it_is(tmp_path, value, kind, late):
  """datasets types a JSON column by its first 10 MB and casts later chunks to it: past them, 7 trained as "7" and
  {"a": 1} as '{"a":1}', and every string of that chunk JSON-quoted ('"text 0"'). Within the first chunk it was refused
  only once training reached the record."""
  import json

  count = 11_000 if late else 3  # 1 kB records: past datasets' first 10 MB chunk
  lines = [json.dumps({"text": f"text {i} " + "x" * 1000}) for i in range(count)]
  (tmp_path / "a.jsonl").write_text("\n".join([*lines, json.dumps({"text": value}), '{"text": "after"}']) + "\n")
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(tmp_path / "a.jsonl"), "train", "hf_data_files", "text")
  assert str(raised.value) == (f"hf_data_files: {tmp_path / 'a.jsonl'} line {count + 1}: column 'text' is {kind}, not "
                               "text; fix or remove that record")


@pytest.mark.parametrize("records, problem", [
    ([{"text": 5}, {"text": "b"}], "record 1 of its array: column 'text' is a JSON number, not text; fix or remove "
                                   "that record"),
    ([{"text": "a"}, {"text": ["b"]}], "record 2 of its array: column 'text' is a JSON array, not text; fix or "
                                       "remove that record"),
], ids=["first", "second"])
def test_a_json_array_file_text_column_is_checked_as_jsonl_is(tmp_path, records, problem):
  """A file of one JSON array was not looked at before datasets read it: its numbers were refused (without the file)
  only once training reached them."""
  import json

  (tmp_path / "a.json").write_text(json.dumps(records))
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(tmp_path / "a.json"), "train", "hf_data_files", "text")
  assert str(raised.value) == f"hf_data_files: {tmp_path / 'a.json'} {problem}"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_text_column_no_record_has_is_named_with_the_files(tmp_path, suffix):
  """Was 'records have no column ...' without the files, once training read the first record."""
  body = '[{"body": "a"}, {"body": "b"}]' if suffix == ".json" else '{"body": "a"}\n{"body": "b"}\n'
  (tmp_path / f"a{suffix}").write_text(body)
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(tmp_path / f"a{suffix}"), "train", "hf_data_files", "text")
  assert str(raised.value) == (f"hf_data_files {tmp_path / f'a{suffix}'}: records have no column 'text' (they have "
                               "body); set train_data_columns")


def test_what_trains_from_a_gzipped_bom_crlf_file_is_its_text(spm_model, tmp_path):
  """The rows of a batch, decoded, are the file's documents: no BOM, no CR, nothing from the compression."""
  from MaxText.configuration.config import Config
  from MaxText.input_pipeline import create_data_iterator
  from MaxText.input_pipeline.tokenizer import load_tokenizer
  from MaxText.platform import sharding

  texts = ["First Citizen: before we proceed", "hear me speak", "All: speak, speak"]
  body = "\r\n".join('{"text": "%s"}' % t for t in texts).encode()  # no newline after the last line
  (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + body))
  config = Config.for_testing(dataset_type="hf", hf_data_files=str(tmp_path / "a.jsonl.gz"), tokenizer_path=spm_model,
                              vocab_size=512, max_target_length=32, per_device_batch_size=1, print_config=False,
                              enable_data_shuffling=False, data_prefetch_batches=0, packing=False)
  batch = next(create_data_iterator(config, sharding.create_mesh(config.mesh)))
  tokenizer = load_tokenizer("sentencepiece", spm_model)
  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  segments = np.asarray(batch["targets_segmentation"])
  for row in range(3):
    tokens = [int(t) for t in inputs[row][segments[row] > 0]] + [int(targets[row][segments[row] > 0][-1])]
    assert tokenizer.decode(tokens) == texts[row]


# ---- train_tokenizer ---------------------------------------------------------------------------------------


def _lines(path, column: str = "text") -> list[str]:
  from MaxText import train_tokenizer

  return list(train_tokenizer.iterate_lines([str(path)], column, 100))


def _tokenizer_refusal(path, column: str = "text") -> str:
  with pytest.raises(UserError) as raised:
    _lines(path, column)
  assert "\n" not in str(raised.value), str(raised.value)
  return str(raised.value)


def test_train_tokenizer_refuses_text_that_is_not_utf8_by_file_and_line(tmp_path):
  """Was: the bytes trained as U+FFFD (errors='replace'), exit 0."""
  (tmp_path / "latin1.txt").write_bytes(b"fine\ncaf\xe9 au lait\n")
  assert _tokenizer_refusal(tmp_path / "latin1.txt") == (
      f"data_files: {tmp_path / 'latin1.txt'} line 2 is not UTF-8 text (byte 4 of the line); save it as UTF-8")
  (tmp_path / "utf16.txt").write_bytes("\ufeffhello\n".encode("utf-16-le"))
  assert _tokenizer_refusal(tmp_path / "utf16.txt") == (
      f"data_files: {tmp_path / 'utf16.txt'} is UTF-16 text (it starts with a UTF-16 byte order mark), not UTF-8; "
      "save it as UTF-8")


def test_train_tokenizer_refuses_a_parquet_file_instead_of_training_on_its_bytes(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": ["hello world"] * 10}), str(tmp_path / "a.parquet"))
  assert _tokenizer_refusal(tmp_path / "a.parquet") == (
      f"data_files: {tmp_path / 'a.parquet'} is not a text file this tool reads (.txt, .json, .jsonl, optionally .gz, "
      ".bz2 or .xz); export its text to .txt or .jsonl first")


def test_train_tokenizer_reads_what_training_reads(tmp_path):
  """A file of one JSON array (was refused at line 1), compressed files (were trained on as bytes), CRLF line
  ends and a last line without a newline."""
  for name in ("array.json", "array.jsonl"):
    (tmp_path / name).write_text('\ufeff[\n  {"text": "first"},\n  {"text": "second"}, {"id": 3}\n]\n')
    assert _lines(tmp_path / name) == ["first", "second"]
  (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped"}\r\n{"text": "two"}'))
  assert _lines(tmp_path / "a.jsonl.gz") == ["zipped", "two"]
  (tmp_path / "a.txt.bz2").write_bytes(bz2.compress(b"one\r\n\r\ntwo"))
  assert _lines(tmp_path / "a.txt.bz2") == ["one", "two"]


def test_train_tokenizer_names_a_field_no_record_has_and_a_lone_surrogate(tmp_path):
  """Were: 'the corpus ... holds no text' and a SentencePiece failure on the surrogate."""
  (tmp_path / "a.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
  assert _tokenizer_refusal(tmp_path / "a.jsonl") == (
      f"no JSON record of {tmp_path / 'a.jsonl'} has a field 'text'; set train_data_columns to the field that holds "
      "the text")
  assert _lines(tmp_path / "a.jsonl", "body") == ["x", "y"]
  (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": null}\n{"text": "a\\ud800"}\n')
  assert _tokenizer_refusal(tmp_path / "b.jsonl").startswith(
      f"{tmp_path / 'b.jsonl'} line 3: field 'text' holds an unpaired UTF-16 surrogate escape")


def test_train_tokenizer_vocab_larger_than_the_corpus_says_what_to_set(tmp_path):
  """Was: 'SentencePiece training failed: INTERNAL: src/trainer_interface.cc(...) [...] Vocabulary size too high'."""
  from MaxText import train_tokenizer

  (tmp_path / "small.txt").write_text("hello world\n")
  with pytest.raises(UserError, match=r"^vocab_size=5000 is more than this corpus \(1 non-empty line\(s\)\) can fill "
                                      r"\(at most \d+ with model_type=bpe\); set vocab_size <= \d+ or give a larger "
                                      r"corpus$"):
    train_tokenizer.train([str(tmp_path / "small.txt")], 5000, str(tmp_path / "out.model"))
  assert not (tmp_path / "out.model").exists()

