"""Turn a local text corpus into train/eval splits for each real dataset_type:

    python3 -m MaxText.input_pipeline.prepare_data --input corpus.txt --output_dir DIR \\
        [--formats jsonl,arrayrecord,tfds] [--eval_fraction 0.1] [--split_by paragraph|line]

writes
    DIR/jsonl/{train,validation}.jsonl              dataset_type=hf hf_data_files=... hf_eval_files=...
    DIR/arrayrecord/{train,validation}.array_record dataset_type=grain grain_train_files=... grain_eval_files=...
    DIR/tfds/local_text/<name>/1.0.0/               dataset_type=tfds dataset_path=DIR/tfds dataset_name=local_text/<name>
Documents are paragraphs (text between blank lines) or lines; the eval split is the corpus's
last `eval_fraction` of documents, a contiguous held-out stretch rather than a random sample, so
no scene is half in train and half in eval.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
  sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from MaxText.errors import UserError, run_cli

SPLITS = ("train", "validation")
FORMATS = ("jsonl", "arrayrecord", "tfds")


def split_documents(text: str, split_by: str) -> list[str]:
  pieces = re.split(r"\n\s*\n", text) if split_by == "paragraph" else text.splitlines()
  return [p.strip() for p in pieces if p.strip()]


def train_eval_split(documents: list[str], eval_fraction: float) -> dict[str, list[str]]:
  num_eval = int(round(len(documents) * eval_fraction))
  if not 0 < num_eval < len(documents):
    raise UserError(f"--eval_fraction {eval_fraction} of {len(documents)} documents leaves an empty split")
  return {"train": documents[:-num_eval], "validation": documents[-num_eval:]}


def write_jsonl(path: Path, documents: list[str]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for doc in documents:
      f.write(json.dumps({"text": doc}) + "\n")


def write_arrayrecord(path: Path, documents: list[str]) -> None:
  """One JSON record per document; group_size:1 keeps every record individually addressable."""
  from array_record.python.array_record_module import ArrayRecordWriter

  path.parent.mkdir(parents=True, exist_ok=True)
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for doc in documents:
    writer.write(json.dumps({"text": doc}).encode("utf-8"))
  writer.close()


def write_tfds(data_dir: Path, name: str, jsonl_dir: Path) -> str:
  """Prepares a TFDS dataset `local_text/<name>` from the JSONL splits; returns its dataset_name."""
  from MaxText.input_pipeline.tfds_builder import prepare

  return prepare(str(data_dir), name, str(jsonl_dir))


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.input_pipeline.prepare_data",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--input", required=True, help="a UTF-8 text file")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {', '.join(FORMATS)}")
  parser.add_argument("--eval_fraction", type=float, default=0.1)
  parser.add_argument("--split_by", default="paragraph", choices=("paragraph", "line"))
  parser.add_argument("--name", default="", help="TFDS config name (default: the input file's stem)")
  return parser.parse_args(argv[1:])


def main(argv: list[str]) -> int:
  args = _parse(argv)
  formats = [f.strip() for f in args.formats.split(",") if f.strip()]
  unknown = sorted(set(formats) - set(FORMATS))
  if unknown:
    raise UserError(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
  source = Path(args.input)
  if not source.is_file():
    raise UserError(f"--input {source} does not exist")
  splits = train_eval_split(split_documents(source.read_text(encoding="utf-8"), args.split_by), args.eval_fraction)
  out = Path(args.output_dir)
  jsonl_dir = out / "jsonl"
  for split in SPLITS:  # the TFDS builder reads these too
    write_jsonl(jsonl_dir / f"{split}.jsonl", splits[split])
  if "arrayrecord" in formats:
    for split in SPLITS:
      write_arrayrecord(out / "arrayrecord" / f"{split}.array_record", splits[split])
  if "tfds" in formats:
    dataset_name = write_tfds(out / "tfds", args.name or source.stem, jsonl_dir)
    print(f"prepare_data: tfds dataset_name={dataset_name} dataset_path={out / 'tfds'}")
  counts = ", ".join(f"{split} {len(splits[split])}" for split in SPLITS)
  print(f"prepare_data: {counts} documents ({args.split_by}s) of {source} in {', '.join(formats)} under {out}")
  return 0


if __name__ == "__main__":
  run_cli(main)
