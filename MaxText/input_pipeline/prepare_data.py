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
no scene is half in train and half in eval. Files are written into a staging folder in DIR and moved
into place once all are complete, so a run stopped half way leaves the previous output whole. While they are
moved (or uploaded) DIR holds a marker prepare_data.incomplete-HOST-PID, and DIR/prepare_data.json lists the
finished files last: readers refuse a folder with a marker, or a file that differs from the list. DIR may
be gs://: everything is written locally, then uploaded (the ArrayRecord reader still needs those
files staged locally to train on them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):
  sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from MaxText import startup
from MaxText.paths import storage
from MaxText.configuration import tool_args
from MaxText.configuration.config_yaml import split_items
from MaxText.input_pipeline import files as files_lib
from MaxText.input_pipeline.files import expand_files, format_suffix, read_plain
from MaxText.errors import UserError, run_cli

SPLITS = ("train", "validation")
FORMATS = ("jsonl", "arrayrecord", "tfds")
# Record formats, not text: read as text their syntax would become the documents.
_RECORDS = (".json", ".jsonl", ".parquet", ".arrow", ".array_record", ".csv")


def read_corpus(path: str) -> str:
  """A data file's text: UTF-8, its byte order mark (if any) not part of the first document;
  a `.gz`, `.bz2` or `.xz` file decompressed, as train_tokenizer and training read it."""
  data = read_plain(path)
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
  if not documents:
    raise UserError("data_files hold no text (only blank lines); give files with text in them")
  if not math.isfinite(eval_fraction):  # nan would fail deep in round()
    raise UserError(f"eval_fraction={eval_fraction} is not a number; give a fraction such as 0.1")
  num_eval = int(round(len(documents) * eval_fraction))
  if not 0 < num_eval < len(documents):
    raise UserError(f"eval_fraction={eval_fraction} of {len(documents)} documents leaves an empty split; set it so "
                    "both train and validation get at least one document")
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


def _check_args(args: argparse.Namespace, sources: list[str]) -> list[str]:
  """The formats to write, after refusing what would write the wrong thing or write somewhere unexpected."""
  if not args.output_path.strip():  # an empty path would write into the current directory
    raise UserError("output_path is empty; name the folder to write, e.g. output_path=data")
  formats = list(dict.fromkeys(split_items("formats", args.formats)))
  if not formats:
    raise UserError(f"formats is empty; name one or more of {', '.join(FORMATS)}")
  unknown = sorted(set(formats) - set(FORMATS))
  if unknown:
    raise UserError(f"formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
  seen: set[str] = set()
  for path in sources:
    if not storage.is_file(path):
      raise UserError(f"data_files: {path} is not a file")
    if format_suffix(path) in _RECORDS:
      raise UserError(f"data_files: {path} holds records, not plain text; train on it as it is (dataset_type=hf "
                      "hf_data_files=..., or dataset_type=stream) or export its text to a .txt file first")
    if storage.resolve(path) in seen:  # read twice, its documents could land in both train and validation
      raise UserError(f"data_files names {path} twice (a path and a glob matching it?); name each file once")
    seen.add(storage.resolve(path))
  return formats


_STAGING = ".prepare_data-partial-"  # + the writing process's id


def _publish(staging: str, out: str, tfds_name: str | None) -> None:
  """Moves the finished files from `staging` into `out`, each by one rename, after every one of them was
  written: an interrupted run leaves the previous output as it was, never half of a new one, and a
  TFDS dataset already there (which TFDS would reuse as is) is replaced by this corpus's."""
  moves = [storage.join(folder, f"{split}.{suffix}") for folder, suffix in (("jsonl", "jsonl"),
           ("arrayrecord", "array_record")) for split in SPLITS]
  if tfds_name is not None:
    moves.append(storage.join("tfds", "local_text", tfds_name))
  for item in moves:
    source, target = storage.join(staging, item), storage.join(out, item)
    if not storage.exists(source):
      continue
    storage.makedirs(storage.parent(target))
    if storage.is_dir(target):  # a directory cannot be renamed over: the old one goes first
      storage.remove_tree(target)
    storage.move(source, target)


def _remove_unrequested(out: str, formats: list[str]) -> list[str]:
  """Removes what an earlier run wrote in a format this run does not (its files would sit beside the new ones,
  from another corpus, looking current); returns those formats. Only this tool's own files: the two ArrayRecord
  splits, and the TFDS datasets of its `local_text` builder."""
  owned = {"arrayrecord": [storage.join("arrayrecord", f"{split}.array_record") for split in SPLITS],
           "tfds": [storage.join("tfds", "local_text")]}
  removed = []
  for kind, items in owned.items():
    found = [storage.join(out, item) for item in items if kind not in formats and storage.exists(storage.join(out, item))]
    for path in found:
      storage.remove_tree(path)
    folder = storage.join(out, kind)
    if found and not storage.is_remote(folder) and storage.is_dir(folder) and not storage.listdir(folder):
      storage.remove_tree(folder)
    removed += [kind] if found else []
  return removed


def _remove_stale_staging(out: str) -> None:
  """Removes the staging folders of runs that were killed (SIGTERM, SIGKILL) before they could; a run still
  writing here is refused, as two runs publishing at once would mix their files."""
  if not storage.is_dir(out):
    return
  for entry in storage.listdir(out):
    pid = entry.removeprefix(_STAGING)
    if entry.startswith(_STAGING) and pid.isdigit():
      if _alive(int(pid)):
        raise _another_run(out, int(pid))
      storage.remove_tree(storage.join(out, entry))


def _another_run(out: str, pid: int) -> UserError:
  return UserError(f"output_path={out}: another prepare_data (process {pid}) is writing there now; wait for it to "
                   "finish, or give another output_path")


_HOST = socket.gethostname()


def _marker_writer(marker: str) -> tuple[str, int] | None:
  """(host, pid) of the run that wrote a marker."""
  host, _, pid = storage.name(marker).removeprefix(files_lib.PREPARED_WRITING).rpartition("-")
  return (host, int(pid)) if pid.isdigit() else None


def _start_publishing(out_dir: str) -> str:
  """Marks `out_dir` as being written (readers refuse it until _finish_publishing) and drops the previous
  manifest; returns the marker. Refuses when another run on this host is publishing there."""
  marker = storage.join(out_dir, f"{files_lib.PREPARED_WRITING}{_HOST}-{os.getpid()}")
  storage.write_text(marker, "prepare_data is moving its files into this folder; until it removes this file, the "
                     "folder may hold a mix of two corpora. Rerun prepare_data if no run is writing.\n")
  for other in storage.glob(storage.join(out_dir, files_lib.PREPARED_WRITING + "*")):
    writer = _marker_writer(other)
    if other != marker and writer is not None and writer[0] == _HOST and _alive(writer[1]):
      storage.remove_tree(marker)
      raise _another_run(out_dir, writer[1])
  storage.remove_tree(storage.join(out_dir, files_lib.PREPARED_MANIFEST))
  return marker


def _manifest(out: str, tfds_name: str | None) -> dict[str, str]:
  """Every file this run put in `out` (local), by its path there, with its content_key."""
  items = [f"{folder}/{split}.{suffix}" for folder, suffix in (("jsonl", "jsonl"), ("arrayrecord", "array_record"))
           for split in SPLITS]
  if tfds_name is not None:
    items += sorted(_files_under(out, f"tfds/local_text/{tfds_name}"))
  return {item: files_lib.content_key(storage.join(out, *item.split("/"))) for item in items
          if storage.is_file(storage.join(out, *item.split("/")))}


def _files_under(out: str, folder: str) -> list[str]:
  """Every file below `out`/`folder`, as its "/"-joined path from `out`."""
  path = storage.join(out, *folder.split("/"))
  if not storage.is_dir(path):
    return []
  found = []
  for entry in storage.listdir(path):
    inner = f"{folder}/{entry.rstrip('/')}"
    found += _files_under(out, inner) if storage.is_dir(storage.join(out, *inner.split("/"))) else [inner]
  return found


def _finish_publishing(out_dir: str, written: dict[str, str], marker: str) -> None:
  """Writes the manifest, then removes the markers: this run's, and those of runs killed before they could (the
  output is now wholly this run's); a run on this host still writing keeps its own."""
  storage.write_text(storage.join(out_dir, files_lib.PREPARED_MANIFEST), json.dumps({"files": written}, indent=1))
  for other in storage.glob(storage.join(out_dir, files_lib.PREPARED_WRITING + "*")):
    writer = _marker_writer(other)
    if other == marker or writer is None or writer[0] != _HOST or not _alive(writer[1]):
      storage.remove_tree(other)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def main(argv: list[str]) -> int:
  startup.start(TOOL, argv)
  args = _parse(argv)
  sources, out_dir = expand_files("data_files", args.data_files), args.output_path
  formats = _check_args(args, sources)
  documents = [doc for path in sources for doc in split_documents(read_corpus(path), args.split_by)]
  splits = train_eval_split(documents, args.eval_fraction)
  source = sources[0] if len(sources) == 1 else f"{len(sources)} files ({sources[0]}, ...)"
  tfds_name = (args.name or _stem(sources[0])) if "tfds" in formats else None
  with storage.local_output(out_dir) as out:  # uploaded at the end when out_dir is gs://
    # everything is written beside the output first and moved in when complete (_publish)
    staging = storage.join(out, f"{_STAGING}{os.getpid()}")
    _remove_stale_staging(out)
    try:
      jsonl_dir = storage.join(staging, "jsonl")
      for split in SPLITS:  # the TFDS builder reads these too
        write_jsonl(storage.join(jsonl_dir, f"{split}.jsonl"), splits[split])
      if "arrayrecord" in formats:
        for split in SPLITS:
          write_arrayrecord(storage.join(staging, "arrayrecord", f"{split}.array_record"), splits[split])
      if tfds_name is not None:
        dataset_name = write_tfds(storage.join(staging, "tfds"), tfds_name, jsonl_dir)
      # from here until _finish_publishing (after a gs:// upload) readers refuse the folder: a run killed while
      # moving or uploading files leaves a mix of two corpora
      marker = _start_publishing(out_dir)
      _publish(staging, out, tfds_name)
      written = _manifest(out, tfds_name)
    finally:  # an error or Ctrl-C: no leftover staging folder
      storage.remove_tree(staging)
  removed = _remove_unrequested(out_dir, formats)  # after the new output is in place
  _finish_publishing(out_dir, written, marker)
  if removed:
    print(f"prepare_data: removed the {' and '.join(removed)} output of an earlier run from {out_dir} (not in "
          f"formats={','.join(formats)})")
  if tfds_name is not None:
    print(f"prepare_data: tfds dataset_name={dataset_name} dataset_path={storage.join(out_dir, 'tfds')}")
  counts = ", ".join(f"{split} {len(splits[split])}" for split in SPLITS)
  print(f"prepare_data: {counts} documents ({args.split_by}s) of {source} in {', '.join(formats)} under {out_dir}")
  return 0


if __name__ == "__main__":
  run_cli(main)
