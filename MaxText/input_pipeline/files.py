"""Comma-separated file lists with globs, as the data keys take them."""

from __future__ import annotations

import hashlib
import json
import os
from typing import IO, cast

from MaxText.configuration.config_yaml import split_items
from MaxText.paths import storage
from MaxText.errors import ConfigError

# Keys whose reader opens files by local path only: ArrayRecord's C++ reader cannot open gs://
# (it stalls there instead of failing), so such values are refused before anything is opened.
_LOCAL_ONLY_KEYS = ("grain_train_files", "grain_eval_files")


def expand_files(key: str, value: str) -> list[str]:
  """Every file named by `value` (comma-separated paths or globs, local or gs://), sorted within
  each pattern; a pattern that matches no file is an error."""
  patterns = split_items(key, value)
  if not patterns:
    raise ConfigError(f"{key} is empty")
  files: list[str] = []
  for pattern in patterns:
    if storage.is_remote(pattern) and key in _LOCAL_ONLY_KEYS:
      raise ConfigError(f"{key}={pattern}: ArrayRecord files cannot be read from a bucket directly (the reader opens "
                        "local files only); mount the bucket with gcsfuse or copy the files to local disk "
                        "(gcloud storage cp) and point the key at the local path")
    matched = storage.glob(pattern)
    if not matched:
      if storage.is_dir(pattern):
        raise ConfigError(f"{key}: {pattern} is a directory; name its files, e.g. {storage.join(pattern, '*.jsonl')}")
      raise ConfigError(f"{key}: no file matches {pattern!r}")
    files.extend(matched)
  refuse_unfinished_output(key, files)
  return files


# prepare_data's output folder: a marker per writing run, present while it moves files into place (a run killed then
# leaves it), and a manifest of the files written last, with each one's content_key.
PREPARED_MANIFEST = "prepare_data.json"
PREPARED_WRITING = "prepare_data.incomplete-"  # + host-pid
PREPARED_FOLDERS = ("jsonl", "arrayrecord", "tfds")


def check_prepared(key: str, folder: str, files: list[str] | None = None) -> None:
  """Refuses files of prepare_data's output `folder` while a run is writing it or after one was stopped half way,
  and (of `files`, else of its tfds/ folder) one that is not what the last complete run wrote."""
  writing = storage.glob(storage.join(folder, PREPARED_WRITING + "*"))
  if writing:
    raise ConfigError(f"{key}: {folder} is incomplete: a prepare_data run is writing it or was stopped before it "
                      f"finished ({writing[0]}); wait for that run, or rerun prepare_data with output_path={folder}")
  manifest = storage.join(folder, PREPARED_MANIFEST)
  if not storage.is_file(manifest):
    return  # not prepare_data's output (or from before the manifest)
  try:
    written = json.loads(storage.read_text(manifest))["files"]
  except (ValueError, KeyError, TypeError):
    raise ConfigError(f"{key}: {manifest} is damaged; rerun prepare_data with output_path={folder}") from None
  # the files refuse_unfinished_output passes lie directly in jsonl/ or arrayrecord/
  items = [(f"{storage.name(storage.parent(path))}/{storage.name(path)}", path) for path in files] \
      if files is not None else [(item, storage.join(folder, *item.split("/"))) for item in written
                                 if item.startswith("tfds/")]
  for item, path in items:
    if item in written and (not storage.is_file(path) or content_key(path) != written[item]):
      raise ConfigError(f"{key}: {path} is not the file prepare_data wrote (it differs from {manifest}: another run "
                        f"wrote over it, or it was edited); rerun prepare_data with output_path={folder}, or remove "
                        f"{manifest} to use the files as they are")


def refuse_unfinished_output(key: str, files: list[str]) -> None:
  """check_prepared for the files that lie in a prepare_data output's jsonl/ or arrayrecord/ folder."""
  folders: dict[str, list[str]] = {}
  for path in files:
    if storage.name(storage.parent(path)) in PREPARED_FOLDERS[:2]:
      folders.setdefault(storage.parent(storage.parent(path)), []).append(path)
  for folder, inside in folders.items():
    check_prepared(key, folder, inside)


# Compressed data files `datasets` reads through fsspec, by their last suffix (`train.jsonl.gz`): the
# format is the suffix before it. Only the codecs Python itself has (zstd and lz4 need extra packages).
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz"}
UNSUPPORTED_COMPRESSIONS = (".zst", ".zstd", ".lz4")


def compression(path: str) -> str | None:
  """The compression a file's name says it has (gzip, bz2, xz), else None."""
  base = storage.name(path).lower()
  return next((kind for suffix, kind in COMPRESSIONS.items() if base.endswith(suffix)), None)


def format_suffix(path: str) -> str:
  """A file's format suffix, lower case: `.jsonl` of train.jsonl.gz (the one under a compression suffix); ""
  without one."""
  base = storage.name(path).lower()
  if compression(path) is not None:
    base = base.rsplit(".", 1)[0]
  return "." + base.rsplit(".", 1)[1] if "." in base.lstrip(".") else ""


def open_plain(path: str) -> IO[bytes]:
  """A binary file object of `path`'s content, decompressed when its name says it is compressed."""
  raw = storage.open_file(path, "rb")
  kind = compression(path)
  if kind == "gzip":
    import gzip

    return cast(IO[bytes], gzip.GzipFile(fileobj=raw))
  if kind == "bz2":
    import bz2

    return cast(IO[bytes], bz2.BZ2File(raw))
  if kind == "xz":
    import lzma

    return cast(IO[bytes], lzma.LZMAFile(raw))
  return raw


def read_plain(path: str) -> bytes:
  with open_plain(path) as f:
    return f.read()


def utf16_problem(path: str) -> str | None:
  """'<path> is UTF-16 text ...' when the file starts with a UTF-16 byte order mark, else None."""
  with open_plain(path) as f:
    head = f.read(2)
  if head in (b"\xff\xfe", b"\xfe\xff"):
    return f"{path} is UTF-16 text (it starts with a UTF-16 byte order mark), not UTF-8; save it as UTF-8"
  return None


def first_non_utf8(path: str) -> str | None:
  """'<path> line N is not UTF-8 text (byte B ...); save it as UTF-8' for the first line of `path` that is
  not UTF-8 (a leading byte order mark is allowed), or None. Reads the file: for error messages only."""
  problem = utf16_problem(path)
  if problem is not None:
    return problem
  with open_plain(path) as f:
    for number, line in enumerate(f, 1):
      try:
        (line.removeprefix(b"\xef\xbb\xbf") if number == 1 else line).decode("utf-8")
      except UnicodeDecodeError as e:
        return f"{path} line {number} is not UTF-8 text (byte {e.start + 1} of the line); save it as UTF-8"
  return None


_EDGE = 1 << 16  # bytes hashed at each end of a file by content_key: a glob of thousands of shards is keyed at every start


def content_key(path: str) -> str:
  """A cheap key of a file's content: its size and a hash of its first and last 64 KiB (a gigabyte file is keyed at
  every start, so not a full hash: an edit of the middle alone that keeps the size goes unseen here)."""
  digest = hashlib.sha256()
  with storage.open_file(path, "rb") as f:
    head = f.read(_EDGE)
    digest.update(head)
    end = len(head)
    if end == _EDGE:
      end = f.seek(0, os.SEEK_END)
      f.seek(max(_EDGE, end - _EDGE))
      digest.update(f.read())
  return f"{end}-{digest.hexdigest()[:32]}"
