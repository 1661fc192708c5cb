"""Train a SentencePiece tokenizer on a corpus (local or gs://):

    python3 -m MaxText.train_tokenizer data_files=corpus.txt vocab_size=1024 output_path=tokenizer.model

`data_files` takes comma-separated files or globs: `.txt` files give one sentence per line,
`.json`/`.jsonl` files one document per line in the `train_data_columns` field (the key training
reads its text column from). The output is a `.model` file for `tokenizer_type=sentencepiece
tokenizer_path=...`, with ids 0 = <unk>, 1 = <s> (bos), 2 = </s> (eos). Both the corpus files and
`output_path` may be gs:// paths.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):  # `python3 MaxText/train_tokenizer.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText import startup
from MaxText.paths import storage
from MaxText.configuration import tool_args
from MaxText.errors import UserError, run_cli
from MaxText.input_pipeline.files import expand_files


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


def iterate_lines(paths: list[str], text_column: str, max_lines: int) -> Iterator[str]:
  """Non-empty lines of the corpus (the text field of JSON lines), at most `max_lines`."""
  count = 0
  for path in paths:
    is_json = path.endswith((".json", ".jsonl"))
    # utf-8-sig: a byte order mark is the file's, not the first line's text (nor JSON).
    with storage.open_file(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace") as f:
      for number, line in enumerate(f, 1):
        text = _json_text(path, number, line, text_column) if is_json and line.strip() else line.rstrip("\n")
        if not text.strip():
          continue
        yield text
        count += 1
        if count >= max_lines:
          return


def _json_text(path: str, number: int, line: str, column: str) -> str:
  """The `column` text of one JSON line ("" without it); one line naming the file and line for a line
  that is not a JSON object (a JSON array file, a line cut short) or a column that is not text."""
  try:
    record = json.loads(line)
  except (ValueError, RecursionError) as e:
    why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
    raise UserError(f"{path} line {number} is not a JSON record ({why}); .json and .jsonl files are read as one JSON "
                    "object per line") from None
  if not isinstance(record, dict):
    raise UserError(f"{path} line {number} is a JSON {type(record).__name__}, not an object; .json and .jsonl files "
                    "are read as one JSON object per line")
  text = record.get(column, "")
  if not isinstance(text, str):
    raise UserError(f"{path} line {number}: field {column!r} is a {type(text).__name__}, not text")
  return text


def train(paths: list[str], vocab_size: int, output: str, model_type: str = "bpe", text_column: str = "text",
          character_coverage: float = 1.0, max_lines: int = 10_000_000) -> int:
  """Trains and writes the model; returns the number of corpus lines used."""
  import sentencepiece as spm

  if vocab_size < 4:
    raise UserError(f"vocab_size must be at least 4 (3 special tokens and one more), got {vocab_size}")
  lines = list(iterate_lines(paths, text_column, max_lines))
  if not lines:
    raise UserError(f"the corpus {', '.join(paths)} holds no text")
  model = io.BytesIO()  # the trainer writes here, not to files: the output may be on gs://
  try:
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:  # e.g. a vocabulary larger than the corpus can fill
    raise UserError(f"SentencePiece training failed: {str(e).strip().splitlines()[-1]}") from None
  storage.write_bytes(output, model.getvalue())
  return len(lines)


TOOL = startup.Tool("train_tokenizer", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = _parse(argv)
  paths = expand_files("data_files", args.data_files)
  num_lines = train(paths, args.vocab_size, args.output_path, args.model_type, args.train_data_columns,
                    args.character_coverage, args.max_lines)
  print(f"train_tokenizer: wrote {args.output_path} ({args.vocab_size} tokens, {args.model_type}) "
        f"from {num_lines} lines of {len(paths)} file(s)")
  return 0


if __name__ == "__main__":
  run_cli(main)
