"""Turn a text corpus (local or gs://) into train/eval splits for each real dataset_type:

    python3 -m MaxText.input_pipeline.prepare_data data_files=corpus.txt output_path=DIR \\
        [formats=jsonl,arrayrecord,tfds] [eval_fraction=0.1] [split_by=paragraph|line]

writes
    DIR/jsonl/{train,validation}.jsonl              dataset_type=hf hf_data_files=... hf_eval_files=...
    DIR/arrayrecord/{train,validation}.array_record dataset_type=grain grain_train_files=... grain_eval_files=...
    DIR/tfds/local_text/<name>/1.0.0/               dataset_type=tfds dataset_path=DIR/tfds dataset_name=local_text/<name>
data_files takes comma-separated files or globs, read in order as one corpus (each file's documents
after the previous file's). Documents are paragraphs (text between blank lines) or lines; the eval split is the corpus's
last `eval_fraction` of documents, a contiguous held-out stretch rather than a random sample, so
no scene is half in train and half in eval. DIR may be gs://: everything is written locally, then
uploaded (the ArrayRecord reader still needs those files staged locally to train on them).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
  sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from MaxText import startup
from MaxText.paths import storage
from MaxText.configuration import tool_args
from MaxText.input_pipeline.files import expand_files
from MaxText.errors import UserError, run_cli

SPLITS = ("train", "validation")
FORMATS = ("jsonl", "arrayrecord", "tfds")


def read_corpus(path: str) -> str:
  """A data file's text: UTF-8, its byte order mark (if any) not part of the first document."""
  data = storage.read_bytes(path)
  try:
    return data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise UserError(f"data_files: {path} is not UTF-8 text (byte {e.start + 1}, line {line}); convert it to UTF-8 "
                    "first (e.g. iconv -f latin1 -t utf-8)") from None


def split_documents(text: str, split_by: str) -> list[str]:
  pieces = re.split(r"\n\s*\n", text) if split_by == "paragraph" else text.splitlines()
  return [p.strip() for p in pieces if p.strip()]


def train_eval_split(documents: list[str], eval_fraction: float) -> dict[str, list[str]]:
  num_eval = int(round(len(documents) * eval_fraction))
  if not 0 < num_eval < len(documents):
    raise UserError(f"eval_fraction={eval_fraction} of {len(documents)} documents leaves an empty split")
  return {"train": documents[:-num_eval], "validation": documents[-num_eval:]}


def write_jsonl(path: str, documents: list[str]) -> None:
  storage.write_text(path, "".join(json.dumps({"text": doc}) + "\n" for doc in documents))


def write_arrayrecord(path: str, documents: list[str]) -> None:
  """One JSON record per document; group_size:1 keeps every record individually addressable.
  `path` is local (the writer cannot write to a bucket)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  storage.makedirs(storage.parent(path))
  writer = ArrayRecordWriter(path, "group_size:1")
  for doc in documents:
    writer.write(json.dumps({"text": doc}).encode("utf-8"))
  writer.close()


def write_tfds(data_dir: str, name: str, jsonl_dir: str) -> str:
  """Prepares a TFDS dataset `local_text/<name>` from the JSONL splits; returns its dataset_name."""
  from MaxText.input_pipeline.tfds_builder import prepare

  return prepare(data_dir, name, jsonl_dir)


def _stem(path: str) -> str:
  base = storage.name(path)
  return base.rsplit(".", 1)[0] if "." in base.lstrip(".") else base


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.input_pipeline.prepare_data",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--data_files", required=True,
                      help="comma-separated UTF-8 text files or globs (local or gs://), read in order as one corpus")
  parser.add_argument("--output_path", required=True, help="the folder to write (local or gs://)")
  parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {', '.join(FORMATS)}")
  parser.add_argument("--eval_fraction", type=float, default=0.1)
  parser.add_argument("--split_by", default="paragraph", choices=("paragraph", "line"))
  parser.add_argument("--name", default="", help="TFDS config name (default: the first file's stem)")
  # the old spellings --input and --output_dir (as every --flag, they still work with a warning)
  return tool_args.parse_args(parser, argv[1:], renamed={"input": "data_files", "output_dir": "output_path"})


TOOL = startup.Tool("prepare_data", builds_config=False)


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = _parse(argv)
  formats = [f.strip() for f in args.formats.split(",") if f.strip()]
  unknown = sorted(set(formats) - set(FORMATS))
  if unknown:
    raise UserError(f"formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
  sources, out_dir = expand_files("data_files", args.data_files), args.output_path
  for path in sources:
    if not storage.is_file(path):
      raise UserError(f"data_files: {path} is not a file")
  documents = [doc for path in sources for doc in split_documents(read_corpus(path), args.split_by)]
  splits = train_eval_split(documents, args.eval_fraction)
  source = sources[0] if len(sources) == 1 else f"{len(sources)} files ({sources[0]}, ...)"
  with storage.local_output(out_dir) as out:  # uploaded at the end when out_dir is gs://
    jsonl_dir = storage.join(out, "jsonl")
    for split in SPLITS:  # the TFDS builder reads these too
      write_jsonl(storage.join(jsonl_dir, f"{split}.jsonl"), splits[split])
    if "arrayrecord" in formats:
      for split in SPLITS:
        write_arrayrecord(storage.join(out, "arrayrecord", f"{split}.array_record"), splits[split])
    if "tfds" in formats:
      dataset_name = write_tfds(storage.join(out, "tfds"), args.name or _stem(sources[0]), jsonl_dir)
  if "tfds" in formats:
    print(f"prepare_data: tfds dataset_name={dataset_name} dataset_path={storage.join(out_dir, 'tfds')}")
  counts = ", ".join(f"{split} {len(splits[split])}" for split in SPLITS)
  print(f"prepare_data: {counts} documents ({args.split_by}s) of {source} in {', '.join(formats)} under {out_dir}")
  return 0


if __name__ == "__main__":
  run_cli(main)
