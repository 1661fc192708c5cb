"""Train a SentencePiece tokenizer on a corpus (local or gs://):

    python3 -m MaxText.train_tokenizer data_files=corpus.txt vocab_size=1024 output_path=tokenizer.model

`data_files` takes comma-separated files or globs: `.txt` files give one sentence per line,
`.json`/`.jsonl` files one document per line in the `train_data_columns` field (the key training
reads its text column from), or a file's one JSON array of records (as training reads them); `.gz`, `.bz2` and `.xz`
files are read decompressed. The files must be UTF-8. The output is a `.model` file for `tokenizer_type=sentencepiece
tokenizer_path=...`, with ids 0 = <unk>, 1 = <s> (bos), 2 = </s> (eos). Both the corpus files and
`output_path` may be gs:// paths.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):  # `python3 MaxText/train_tokenizer.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText import json_text, startup
from MaxText.paths import storage
from MaxText.configuration import tool_args
from MaxText.errors import UserError, run_cli
from MaxText.input_pipeline.files import expand_files, format_suffix, open_plain, utf16_problem

# Formats training reads that are not lines of text: refused by name rather than trained on as bytes.
_NOT_TEXT = (".parquet", ".arrow", ".array_record", ".zst", ".zstd", ".lz4", ".tar", ".zip")


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.train_tokenizer", description=__doc__.split("\n\n")[0])
  parser.add_argument("--data_files", required=True, help="comma-separated .txt/.jsonl files or globs")
  parser.add_argument("--vocab_size", type=int, required=True, help="number of tokens, special ones included")
  parser.add_argument("--output_path", required=True, help="where to write the .model file (local or gs://)")
  parser.add_argument("--model_type", default="bpe", choices=("bpe", "unigram", "char", "word"))
  parser.add_argument("--train_data_columns", default="text", metavar="COLUMN",
                      help="the field holding the text in .json/.jsonl files")
  parser.add_argument("--character_coverage", type=float, default=1.0,
                      help="fraction of characters the vocabulary covers (lower for large alphabets)")
  parser.add_argument("--max_lines", type=int, default=10_000_000, help="read at most this many lines")
  # dataset_path is the tfds data directory to every other tool; --output and --text_column: as the
  # converters and training name the same things
  args = tool_args.parse_args(parser, argv[1:], renamed={"dataset_path": "data_files", "output": "output_path",
                                                          "text_column": "train_data_columns"})
  if "," in args.train_data_columns:
    raise UserError(f"train_data_columns names one field, got {args.train_data_columns!r}")
  return args


def _check_readable(path: str) -> None:
  suffix = format_suffix(path)
  if suffix in _NOT_TEXT or storage.name(path).lower().endswith(_NOT_TEXT):
    raise UserError(f"data_files: {path} is not a text file this tool reads (.txt, .json, .jsonl, optionally .gz, .bz2 "
                    "or .xz); export its text to .txt or .jsonl first")
  problem = utf16_problem(path)
  if problem is not None:
    raise UserError(f"data_files: {problem}")


def _text_lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number, line without its newline) of a UTF-8 file; one line naming a line that is not UTF-8."""
  with open_plain(path) as f:
    for number, raw in enumerate(f, 1):
      if number == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")  # the file's byte order mark, not text
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise UserError(f"data_files: {path} line {number} is not UTF-8 text (byte {e.start + 1} of the line); save "
                        "it as UTF-8") from None
      yield number, line.rstrip("\r\n")


def _json_array_texts(path: str, text_column: str) -> Iterator[tuple[int, str | None]] | None:
  """(record number, text) of a file holding one JSON array of records (as training reads a .json or
  .jsonl file starting with `[`), or None when the file does not start with `[`."""
  with open_plain(path) as f:
    head = f.read(1 << 12).removeprefix(b"\xef\xbb\xbf")
    while head.isspace() and (more := f.read(1 << 16)):
      head = more
    if head.lstrip()[:1] != b"[":
      return None
    data = head + f.read()  # leading whitespace skipped above is not part of the JSON
  try:
    records = json.loads(data)
  except (ValueError, RecursionError) as e:
    why = f"{e.msg} at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else (
        "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "nested too deeply")
    raise UserError(f"{path} starts with '[' but is not one readable JSON array ({why}); fix it, or write one "
                    "JSON object per line") from None
  return ((n, _record_text(path, f"record {n} of its array", record, text_column))
          for n, record in enumerate(records, 1))


def iterate_lines(paths: list[str], text_column: str, max_lines: int) -> Iterator[str]:
  """Non-empty lines of the corpus (the text field of JSON lines), at most `max_lines`."""
  count, json_records, with_column = 0, 0, 0
  for path in paths:
    _check_readable(path)
    is_json = format_suffix(path) in (".json", ".jsonl")
    lines = _json_array_texts(path, text_column) if is_json else None
    if lines is None:
      lines = ((n, _json_text(path, n, line, text_column) if is_json else line)
               for n, line in _text_lines(path) if line.strip() or not is_json)
    for _, text in lines:
      if is_json:
        json_records += 1
        with_column += text is not None
      if text is None or not text.strip():
        continue
      yield text
      count += 1
      if count >= max_lines:
        return
  if json_records and not with_column:
    raise UserError(f"no JSON record of {', '.join(paths)} has a field {text_column!r}; set train_data_columns to the "
                    "field that holds the text")


def _json_text(path: str, number: int, line: str, column: str) -> str | None:
  """The `column` text of one JSON line (None without it); one line naming the file and line for a line
  that is not a JSON object (a JSON array file, a line cut short) or a column that is not text."""
  try:
    record = json.loads(line)
  except (ValueError, RecursionError) as e:
    why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
    raise UserError(f"{path} line {number} is not a JSON record ({why}); .json and .jsonl files are read as one JSON "
                    "object per line") from None
  return _record_text(path, f"line {number}", record, column)


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _record_text(path: str, where: str, record: object, column: str) -> str | None:
  """The `column` text of one parsed record (None without it, or null as datasets reads a missing field)."""
  if not isinstance(record, dict):
    raise UserError(f"{path} {where} is {_JSON_KINDS.get(type(record), 'a JSON value')}, not a JSON object; .json "
                    "and .jsonl files are read as one JSON object per line (or one JSON array of them)")
  text = record.get(column)
  if text is not None and not isinstance(text, str):
    raise UserError(f"{path} {where}: field {column!r} is {_JSON_KINDS.get(type(text), 'a JSON value')}, not text")
  if text is not None and json_text.has_unpaired_surrogate(text):
    raise UserError(f"{path} {where}: field {column!r} {json_text.UNPAIRED_SURROGATE}; fix or remove that record")
  return text


def _check_output(output: str, paths: list[str]) -> None:
  """Refuses, before the corpus is read, an output_path the model cannot be written to as meant."""
  if not output.strip():
    raise UserError("output_path is empty; name the .model file to write, e.g. output_path=tokenizer.model")
  if output.endswith("/") or storage.is_dir(output):
    raise UserError(f"output_path={output} is a folder; name the .model file to write in it, e.g. "
                    f"{storage.join(output, 'tokenizer.model')}")
  for path in paths:
    if storage.same_file(output, path):  # the model would replace the corpus it was trained on
      raise UserError(f"output_path={output} is one of the data_files; name a new .model file")


def train(paths: list[str], vocab_size: int, output: str, model_type: str = "bpe", text_column: str = "text",
          character_coverage: float = 1.0, max_lines: int = 10_000_000) -> int:
  """Trains and writes the model; returns the number of corpus lines used."""
  import sentencepiece as spm

  if vocab_size < 4:
    raise UserError(f"vocab_size must be at least 4 (3 special tokens and one more), got {vocab_size}")
  if max_lines < 1:
    raise UserError(f"max_lines must be at least 1, got {max_lines}")
  if not 0.98 <= character_coverage <= 1.0:  # SentencePiece's own bounds, checked before reading the corpus
    raise UserError(f"character_coverage must be between 0.98 and 1, got {character_coverage}")
  _check_output(output, paths)
  lines = list(iterate_lines(paths, text_column, max_lines))
  if not lines:
    raise UserError(f"the corpus {', '.join(paths)} holds no text")
  # SentencePiece skips, without a word, every line longer than max_sentence_length bytes (4192 unless set)
  longest = max(len(line.encode("utf-8")) for line in lines)
  model = io.BytesIO()  # the trainer writes here, not to files: the output may be on gs://
  try:
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=min(max(longest, 4192), 2**31 - 1), num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:  # e.g. a vocabulary larger than the corpus can fill
    reason = str(e).strip().splitlines()[-1]
    most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", reason)
    if most:
      raise UserError(f"vocab_size={vocab_size} is more than this corpus ({len(lines)} non-empty line(s)) can "
                      f"fill (at most {most.group(1)} with model_type={model_type}); set vocab_size <= "
                      f"{most.group(1)} or give a larger corpus") from None
    # SentencePiece's own wording names its --character_coverage flag and neither number's meaning
    least = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason)
    if least:
      raise UserError(_too_few(vocab_size, int(least.group(1)), model_type, character_coverage)) from None
    raise UserError(f"SentencePiece training failed: {reason}") from None
  if model_type == "char":
    _check_char_model(model.getvalue(), lines, vocab_size, character_coverage)
  storage.write_bytes(output, model.getvalue())
  return len(lines)


def _too_few(vocab_size: int, needed: int, model_type: str, character_coverage: float) -> str:
  return (f"vocab_size={vocab_size} is fewer than the {needed} tokens model_type={model_type} needs for this corpus "
          f"(its characters at character_coverage={character_coverage}, and 3 special tokens); set vocab_size >= "
          f"{needed}, or lower character_coverage (not below 0.98) to leave its rarest characters out")


def _check_char_model(model: bytes, lines: list[str], vocab_size: int, character_coverage: float) -> None:
  """A char model gets no error from SentencePiece when vocab_size cannot hold the corpus's characters: it keeps the
  most frequent and the others become <unk> (which character_coverage allows only for its rarest share)."""
  import collections

  import sentencepiece as spm

  processor = spm.SentencePieceProcessor(model_proto=model)
  counts = collections.Counter(ch for line in lines for ch in line if not ch.isspace())
  dropped = sum(n for ch, n in counts.items() if processor.unk_id() in processor.encode(ch))
  if dropped > (1.0 - character_coverage) * sum(counts.values()):
    spaces = any(ch.isspace() for line in lines for ch in line)
    raise UserError(_too_few(vocab_size, len(counts) + int(spaces) + 3, "char", character_coverage))


def piece_count(path: str) -> int:
  """The number of tokens of a written model (a char model's can be fewer than vocab_size: one per character)."""
  import sentencepiece as spm

  return spm.SentencePieceProcessor(model_proto=storage.read_bytes(path)).get_piece_size()


TOOL = startup.Tool("train_tokenizer", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = _parse(argv)
  paths = expand_files("data_files", args.data_files)
  num_lines = train(paths, args.vocab_size, args.output_path, args.model_type, args.train_data_columns,
                    args.character_coverage, args.max_lines)
  pieces = piece_count(args.output_path)
  fewer = f" of vocab_size={args.vocab_size}: every character of the corpus" if pieces < args.vocab_size else ""
  print(f"train_tokenizer: wrote {args.output_path} ({pieces} tokens{fewer}, {args.model_type}) "
        f"from {num_lines} lines of {len(paths)} file(s)")
  return 0


if __name__ == "__main__":
  run_cli(main)
