"""prepare_data and train_tokenizer as hurried or hostile users run them (an empty or wrong output_path,
a file named twice, a compressed corpus, a value out of range, a rerun, a run cut short): each writes what
was meant or stops with one line naming the argument, before anything is half written."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText import train_tokenizer
from MaxText.errors import UserError
from MaxText.input_pipeline import prepare_data

REPO = Path(__file__).resolve().parents[2]


def _corpus(path: Path, prefix: str, count: int) -> Path:
  path.write_text("\n\n".join(f"{prefix} document {i} with a few words." for i in range(count)) + "\n")
  return path


def _prepare(*args: str) -> int:
  return prepare_data.main(["prepare_data", *args])


def _refusal(run, *args: str) -> str:
  with pytest.raises(UserError) as raised:
    run(*args)
  message = str(raised.value)
  assert "\n" not in message, message
  return message


def _texts(path: Path) -> list[str]:
  return [json.loads(line)["text"] for line in path.read_text().splitlines()]


# ---- prepare_data ------------------------------------------------------------------------------------------


def test_prepare_data_refuses_an_empty_output_path_and_empty_formats(tmp_path, monkeypatch):
  """Were: output_path= wrote jsonl/ into the current directory, formats= wrote jsonl and said 'in  under', exit 0."""
  source = _corpus(tmp_path / "c.txt", "A", 10)
  monkeypatch.chdir(tmp_path)
  assert _refusal(_prepare, f"data_files={source}", "output_path=", "formats=jsonl") == (
      "output_path is empty; name the folder to write, e.g. output_path=data")
  assert _refusal(_prepare, f"data_files={source}", "output_path=out", "formats=") == (
      "formats is empty; name one or more of jsonl, arrayrecord, tfds")
  assert _refusal(_prepare, f"data_files={source}", "output_path=out", "formats=,") == (
      "formats has an empty item at position 1 of ',' (two commas in a row, or one first); remove the extra comma")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def test_prepare_data_eval_fraction_nan_is_one_line_not_a_traceback(tmp_path):
  """Was: ValueError: cannot convert float NaN to integer, a traceback and exit 1."""
  source = _corpus(tmp_path / "c.txt", "A", 10)
  proc = subprocess.run([sys.executable, "-m", "MaxText.input_pipeline.prepare_data", f"data_files={source}",
                         f"output_path={tmp_path / 'out'}", "formats=jsonl", "eval_fraction=nan"],
                        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == "error: eval_fraction=nan is not a number; give a fraction such as 0.1"
  assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_prepare_data_a_corpus_of_blank_lines_names_data_files(tmp_path):
  """Was: 'eval_fraction=0.1 of 0 documents leaves an empty split', blaming the wrong argument."""
  (tmp_path / "blank.txt").write_text("\n\n   \n\r\n\n")
  assert _refusal(_prepare, f"data_files={tmp_path / 'blank.txt'}", f"output_path={tmp_path / 'out'}") == (
      "data_files hold no text (only blank lines); give files with text in them")


def test_prepare_data_reads_a_gz_corpus_decompressed(tmp_path):
  """Was: 'c.txt.gz is not UTF-8 text (byte 2, line 1)', though train_tokenizer and training read it."""
  text = _corpus(tmp_path / "c.txt", "A", 10).read_bytes()
  (tmp_path / "c.txt.gz").write_bytes(gzip.compress(text))
  assert _prepare(f"data_files={tmp_path / 'c.txt.gz'}", f"output_path={tmp_path / 'out'}", "formats=jsonl") == 0
  assert _texts(tmp_path / "out" / "jsonl" / "train.jsonl")[0] == "A document 0 with a few words."


def test_prepare_data_refuses_a_file_named_twice(tmp_path):
  """Was: a path and a glob matching it read the file twice, so its documents were in train and validation too."""
  source = _corpus(tmp_path / "c.txt", "A", 10)
  assert _refusal(_prepare, f"data_files={source},{tmp_path / '*.txt'}", f"output_path={tmp_path / 'out'}") == (
      f"data_files names {source} twice (a path and a glob matching it?); name each file once")


def test_prepare_data_rerun_on_a_new_corpus_replaces_the_tfds_dataset(tmp_path):
  """Was: TFDS found its dataset already prepared and kept the first corpus's, while jsonl/ and the summary
  line had the second's."""
  import tensorflow_datasets as tfds

  out = tmp_path / "out"
  for prefix, count in (("A", 20), ("B", 8)):
    source = _corpus(tmp_path / f"{prefix}.txt", prefix, count)
    assert _prepare(f"data_files={source}", f"output_path={out}", "formats=jsonl,tfds", "name=mine",
                    "eval_fraction=0.25") == 0
  builder = tfds.builder("local_text/mine", data_dir=str(out / "tfds"))
  assert builder.info.splits["train"].num_examples == 6
  assert [r["text"] for r in builder.as_data_source()["validation"]] == [b"B document 6 with a few words.",
                                                                         b"B document 7 with a few words."]
  assert sorted(p.name for p in out.iterdir()) == ["jsonl", "prepare_data.json", "tfds"]  # no staging folder left


def test_prepare_data_cut_short_leaves_the_previous_output_whole(tmp_path, monkeypatch):
  """Was: a run stopped while writing ArrayRecord left the new corpus's jsonl/ beside the old corpus's
  arrayrecord/, an output that looks complete."""
  out = tmp_path / "out"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}",
                  "formats=jsonl,arrayrecord") == 0
  before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

  def interrupted(path: str, documents: list[str]) -> None:
    raise KeyboardInterrupt

  monkeypatch.setattr(prepare_data, "write_arrayrecord", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _prepare(f"data_files={_corpus(tmp_path / 'B.txt', 'B', 8)}", f"output_path={out}", "formats=jsonl,arrayrecord")
  assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_prepare_data_rerun_with_fewer_formats_removes_the_earlier_runs_other_formats(tmp_path, capsys):
  """Was: arrayrecord/ and tfds/ of corpus A stayed beside corpus B's jsonl/, looking current."""
  out = tmp_path / "out"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}", "name=mine") == 0
  assert sorted(p.name for p in out.iterdir()) == ["arrayrecord", "jsonl", "prepare_data.json", "tfds"]
  (out / "notes.txt").write_text("mine")  # not this tool's: kept
  capsys.readouterr()
  assert _prepare(f"data_files={_corpus(tmp_path / 'B.txt', 'B', 8)}", f"output_path={out}", "formats=jsonl") == 0
  assert sorted(p.name for p in out.iterdir()) == ["jsonl", "notes.txt", "prepare_data.json"]
  assert _texts(out / "jsonl" / "validation.jsonl") == ["B document 7 with a few words."]
  assert f"prepare_data: removed the arrayrecord and tfds output of an earlier run from {out} (not in formats=jsonl)" \
      in capsys.readouterr().out


# ---- train_tokenizer ---------------------------------------------------------------------------------------


def _train(*args: str) -> int:
  return train_tokenizer.main(["train_tokenizer", *args])


def test_train_tokenizer_refuses_to_write_over_its_corpus(tmp_path):
  """Was: output_path naming a data file replaced the corpus with the model, exit 0."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"line {i} of words\n" for i in range(200)))
  text = corpus.read_text()
  assert _refusal(_train, f"data_files={corpus}", "vocab_size=40", f"output_path={tmp_path}/./corpus.txt") == (
      f"output_path={tmp_path}/./corpus.txt is one of the data_files; name a new .model file")
  assert corpus.read_text() == text


def test_train_tokenizer_output_path_empty_or_a_folder_is_refused_before_training(tmp_path):
  """Were: 'newdir/' wrote a file named newdir; an empty path or a folder failed only after training with
  'cannot write DIR: it is a folder'."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"line {i} of words\n" for i in range(200)))
  assert _refusal(_train, f"data_files={corpus}", "vocab_size=40", "output_path=") == (
      "output_path is empty; name the .model file to write, e.g. output_path=tokenizer.model")
  for folder in (f"{tmp_path}/newdir/", str(tmp_path)):
    assert _refusal(_train, f"data_files={corpus}", "vocab_size=40", f"output_path={folder}").startswith(
        f"output_path={folder} is a folder; name the .model file to write in it, e.g. ")
  assert not (tmp_path / "newdir").exists()


def test_train_tokenizer_refuses_max_lines_and_character_coverage_out_of_range(tmp_path):
  """Were: max_lines=0 trained on one line; character_coverage=0.5 failed with
  'SentencePiece training failed: INTERNAL: src/trainer_interface.cc(94) [...]'."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"line {i} of words\n" for i in range(200)))
  common = (f"data_files={corpus}", "vocab_size=40", f"output_path={tmp_path / 't.model'}")
  assert _refusal(_train, *common, "max_lines=0") == "max_lines must be at least 1, got 0"
  assert _refusal(_train, *common, "character_coverage=0.5") == (
      "character_coverage must be between 0.98 and 1, got 0.5")
  assert not (tmp_path / "t.model").exists()


@pytest.mark.parametrize("model_type", ["bpe", "unigram", "char"])
def test_train_tokenizer_a_vocab_size_below_the_corpus_characters_names_our_arguments(tmp_path, model_type):
  """Was SentencePiece's 'INTERNAL: src/trainer_interface.cc(638) [...] Vocabulary size is smaller than
  required_chars. 8 vs 24. ... with --character_coverage option' (bpe, unigram), and for char no error at all: the
  model kept 8 characters and the rest of the text encoded as <unk>."""
  corpus = _corpus(tmp_path / "A.txt", "A", 20)
  needed = len(set(corpus.read_text()) - {"\n", " "}) + 1 + 3  # its characters, the word boundary, 3 special
  assert _refusal(_train, f"data_files={corpus}", "vocab_size=8", f"output_path={tmp_path / 'a.model'}",
                  f"model_type={model_type}") == (
      f"vocab_size=8 is fewer than the {needed} tokens model_type={model_type} needs for this corpus (its characters "
      f"at character_coverage=1.0, and 3 special tokens); set vocab_size >= {needed}, or lower character_coverage "
      "(not below 0.98) to leave its rarest characters out")
  assert not (tmp_path / "a.model").exists()


def test_train_tokenizer_says_how_many_tokens_a_char_model_has(tmp_path, capsys):
  """A char model has one token per character whatever vocab_size asks: the line said '(5000 tokens, char)'."""
  corpus = _corpus(tmp_path / "A.txt", "A", 20)
  assert _train(f"data_files={corpus}", "vocab_size=5000", f"output_path={tmp_path / 'a.model'}",
                "model_type=char") == 0
  pieces = train_tokenizer.piece_count(str(tmp_path / "a.model"))
  assert pieces < 5000 and f"({pieces} tokens of vocab_size=5000: every character of the corpus, char)" in \
      capsys.readouterr().out


def test_train_tokenizer_trains_on_lines_longer_than_sentencepieces_limit(tmp_path):
  """Was: SentencePiece skipped every line over 4192 bytes without a word, so text there never reached
  the vocabulary."""
  import sentencepiece as spm

  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"short line {i}\n" for i in range(100)) + "Qz " * 3000 + "\n")
  assert _train(f"data_files={corpus}", "vocab_size=30", f"output_path={tmp_path / 't.model'}") == 0
  model = spm.SentencePieceProcessor(model_file=str(tmp_path / "t.model"))
  assert model.piece_to_id("Q") != model.unk_id() and model.piece_to_id("z") != model.unk_id()


def test_prepare_data_killed_then_rerun_keeps_the_old_output_and_leaves_no_partial_folder(tmp_path):
  """Was: SIGTERM after jsonl/ was written left the new corpus's jsonl/ beside the old corpus's arrayrecord/
  (or a train.array_record cut short); a rerun clears the killed run's staging folder."""
  import signal
  import time

  out = tmp_path / "out"
  assert _prepare(f"data_files={_corpus(tmp_path / 'A.txt', 'A', 12)}", f"output_path={out}",
                  "formats=jsonl,arrayrecord") == 0
  before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
  # big enough that the run is still writing when it is stopped
  (tmp_path / "big.txt").write_text("\n\n".join(f"B {i} " + "word " * 50 for i in range(400_000)))
  proc = subprocess.Popen([sys.executable, "-m", "MaxText.input_pipeline.prepare_data",
                           f"data_files={tmp_path / 'big.txt'}", f"output_path={out}", "formats=jsonl,arrayrecord"],
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline:  # until the new train.jsonl is written
    if any(path.read_bytes()[:12] == b'{"text": "B ' for path in out.rglob("train.jsonl")):
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) != 0
  assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()
          if not p.relative_to(out).parts[0].startswith(".")} == before
  assert _prepare(f"data_files={tmp_path / 'A.txt'}", f"output_path={out}", "formats=jsonl") == 0
  assert sorted(p.name for p in out.iterdir()) == ["jsonl", "prepare_data.json"]  # no staging folder; arrayrecord/ was not asked for


def test_prepare_data_refuses_a_jsonl_file_instead_of_wrapping_its_syntax(tmp_path):
  """Was: each line of a .jsonl file became a document '{"text": "..."}', JSON syntax and all, exit 0."""
  (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
  assert _refusal(_prepare, f"data_files={tmp_path / 'c.jsonl'}", f"output_path={tmp_path / 'out'}",
                  "split_by=line") == (
      f"data_files: {tmp_path / 'c.jsonl'} holds records, not plain text; train on it as it is (dataset_type=hf "
      "hf_data_files=..., or dataset_type=stream) or export its text to a .txt file first")
