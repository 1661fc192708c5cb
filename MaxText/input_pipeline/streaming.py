"""dataset_type=stream: shard files (parquet, JSONL, ArrayRecord; local or gs://) read one shard at
a time through the storage layer, the next shard fetched by a background thread while this one
is consumed. Nothing is copied ahead beyond that one shard.

Each data shard (process holding distinct rows) reads every `count`-th file; with shuffling the
order of its files is redrawn every epoch from the seed. A document's index, the pipeline's
resumable position, is `visit << 32 | row`: the how-many-th file this shard has opened (over
all epochs) and the row inside it, so a restart opens that one file and skips to the row, never
touching the files finished before it.
"""

from __future__ import annotations

import bz2
import concurrent.futures
import contextlib
import dataclasses
import gzip
import io
import json
import lzma
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from MaxText.errors import ConfigError, UserError
from MaxText import json_text
from MaxText.input_pipeline.files import COMPRESSIONS, UNSUPPORTED_COMPRESSIONS, compression, expand_files
from MaxText.input_pipeline.packing import Located
from MaxText.input_pipeline.json_records import json_kind
from MaxText.input_pipeline.pipeline import BOM, HostShard, Unreadable, record_text
from MaxText.paths import storage

ROW_BITS = 32  # rows of one shard file must stay below 2**32
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".array_record": "arrayrecord"}


def file_format(key: str, path: str) -> str:
  base = storage.name(path)
  if base.lower().endswith(UNSUPPORTED_COMPRESSIONS):
    raise ConfigError(f"{key}: {path} is compressed with a codec this reader cannot read; decompress it, or compress "
                      f"it with gzip, bz2 or xz ({', '.join(COMPRESSIONS)})")
  codec = compression(path)
  if codec is not None:  # as dataset_type=hf reads it: the format is the suffix under the compression's
    base = base.rsplit(".", 1)[0]
  for suffix, kind in FORMATS.items():
    if base.endswith(suffix):
      if codec is not None and kind == "arrayrecord":  # its reader opens the file itself, by chunks
        raise ConfigError(f"{key}: {path} is an ArrayRecord file compressed with {codec}; decompress it (ArrayRecord "
                          "compresses its own chunks)")
      return kind
  raise ConfigError(f"{key}: {path} is not a shard file this reader knows (.parquet, .jsonl, .json, .array_record, "
                    f"each also compressed as {', '.join(COMPRESSIONS)}); rename it or convert it")


def _decompressed(path: str, data: bytes) -> bytes:
  """A shard's bytes, decompressed when its name says it is compressed (the shard is held whole anyway)."""
  codec = compression(path)
  if codec is None:
    return data
  try:
    decompress = {"gzip": gzip.decompress, "bz2": bz2.decompress}.get(codec, lzma.decompress)
    return decompress(data)
  except (OSError, EOFError, ValueError, lzma.LZMAError) as e:  # a truncated or mislabelled file
    raise UserError(f"{path} is not a readable {codec} file ({str(e) or type(e).__name__}); replace or remove it, or "
                    "rename it if it is not compressed") from None


@dataclasses.dataclass
class _Shard:
  """One opened shard file: its records by row and what to release when done with it."""
  path: str
  records: Sequence[Any]
  cleanup: contextlib.ExitStack
  lines: Sequence[int] | None = None  # JSONL: each record's line in the file (records skip blank lines)
  json: bool = False  # records are JSON text (a JSONL line) or values parsed from a JSON array

  def close(self) -> None:
    self.cleanup.close()

  def where(self, row: int) -> str:
    return f"{self.path} line {self.lines[row]}" if self.lines is not None else f"{self.path} record {row + 1}"


def _json_shard(path: str, data: bytes, stack: contextlib.ExitStack) -> _Shard:
  """A .jsonl/.json shard: one JSON record per non-blank line (each parsed when it is read), or, as
  `datasets` reads a file starting with `[`, one JSON array of records. A leading BOM is the file's."""
  if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # json.loads would guess UTF-16 per line, and lines split mid-character
    raise UserError(f"{path} is UTF-16 text (it starts with a UTF-16 byte order mark), not UTF-8; save it as UTF-8")
  data = data.removeprefix(BOM)
  if data.lstrip()[:1] == b"[":
    try:
      values = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      where = f"line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else f"byte {e.start + 1}"
      raise UserError(f"{path} is a JSON array (it starts with '[') but not valid JSON ({_reason(e)} at {where}); "
                      "fix it, or write one JSON record per line") from None
    except RecursionError:
      raise UserError(f"{path} is a JSON array (it starts with '[') nested deeper than JSON can be read; fix it, or "
                      "write one JSON record per line") from None
    return _Shard(path, values, stack, json=True)
  records, lines = [], []
  for number, line in enumerate(data.split(b"\n"), 1):
    if line.strip():  # blank lines are skipped, as `datasets` does
      records.append(line)
      lines.append(number)
  return _Shard(path, records, stack, lines=lines, json=True)


def _parquet_rows(path: str, data: bytes) -> list[Any]:
  try:
    return pq.read_table(io.BytesIO(data)).to_pylist()
  except (pa.ArrowException, OSError) as e:  # a bad footer, a truncated page, not parquet at all
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    raise UserError(f"{path} is not a readable parquet file ({reason}); replace or remove it") from None


def _open_shard(path: str) -> _Shard:
  """Fetches one shard (the read-ahead thread runs this for the next one). A file listed at start-up
  and gone (or unreadable) when its turn comes is one line: the run cannot go on without it."""
  try:
    return _fetch_shard(path)
  except OSError as e:
    raise UserError(f"{path} cannot be read ({type(e).__name__}: {e.strerror or e}); it was one of the shard files "
                    "when the run started: restore it and resume from the last checkpoint") from None


def _fetch_shard(path: str) -> _Shard:
  stack = contextlib.ExitStack()
  kind = file_format("stream files", path)
  if kind == "parquet":
    return _Shard(path, _parquet_rows(path, _decompressed(path, storage.read_bytes(path))), stack)
  if kind == "jsonl":
    return _json_shard(path, _decompressed(path, storage.read_bytes(path)), stack)
  # ArrayRecord's reader opens local files only: a remote shard is downloaded, and removed when done.
  local = stack.enter_context(storage.local_copy(path))
  try:
    records = grain.sources.ArrayRecordDataSource([local])
  except (RuntimeError, ValueError, OSError) as e:
    stack.close()
    reason = (str(e).splitlines() or [""])[0] or type(e).__name__
    raise UserError(f"{path} is not a readable ArrayRecord file ({reason}); replace or remove it") from None
  return _Shard(path, records, stack)


def _close_fetched(future: "concurrent.futures.Future[_Shard]") -> None:
  if future.exception() is None:
    future.result().close()


def _reason(error: Exception) -> str:
  # some of json's messages end in "at" themselves ("Invalid control character at")
  return error.msg.removesuffix(" at") if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"


def _json_record(record: object) -> object:
  """A JSONL line (bytes) or an element of a JSON array as the record it must be: an object, or a
  string holding the text itself."""
  escaped = not isinstance(record, bytes) or b"\\u" in record  # (an array's elements: their text is gone)
  if isinstance(record, bytes):
    try:
      record = json.loads(record)  # surrounding whitespace (an indented record, a CR) is allowed
    except json.JSONDecodeError as e:
      raise UserError(f"not valid JSON ({_reason(e)} at column {e.colno}); fix or remove that record") from None
    except UnicodeDecodeError as e:
      raise UserError(f"not valid JSON (not UTF-8 text at byte {e.start + 1}); fix or remove that record") from None
    except RecursionError:
      raise UserError("not readable JSON (nested deeper than JSON can be read); fix or remove that record") from None
  if not isinstance(record, (dict, str)):
    raise UserError(f"{json_kind(record)}, not an object (one record per line, or an array of objects); "
                    "fix or remove that record")
  if escaped and json_text.has_unpaired_surrogate(record):
    raise UserError(f"{json_text.UNPAIRED_SURROGATE}; fix or remove that record")
  return record


class ShardStream:
  """This data shard's files as an endless (train) or one-pass (eval) run of encoded documents,
  each wrapped as `Located(index, document)` so the cursor keeps the stream's own index."""

  def __init__(self, key: str, value: str, shard: HostShard, encode: Callable[[Any], Any], column: str | None,
               shuffle_seed: int | None, repeat: bool, what: str):
    files = expand_files(key, value)
    for path in files:
      file_format(key, path)
    if len(files) < shard.count:
      raise ConfigError(f"{what} has {len(files)} shard file(s), fewer than the {shard.count} data shards (one per "
                        "process holding distinct rows); split it into at least that many files")
    self.files = files[shard.index::shard.count]
    self.num_files_total = len(files)
    self._encode, self._column, self._seed, self._repeat, self.what = encode, column, shuffle_seed, repeat, what
    # One fetch at a time, ahead of the reader; a daemon-free pool is fine: a fetch is bounded by storage_retry.
    self._fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read-ahead")
    self._release = _close_fetched  # held here: a generator closed at interpreter exit outlives the module's globals

  def file_of_visit(self, visit: int) -> str | None:
    """The file opened on the `visit`-th visit (None past the end of one-pass data)."""
    epoch, within = divmod(visit, len(self.files))
    if epoch and not self._repeat:
      return None
    if self._seed is None:
      return self.files[within]
    order = np.random.default_rng([self._seed, epoch]).permutation(len(self.files))
    return self.files[int(order[within])]

  def read_from(self, index: int) -> Iterator[Located]:
    """Documents from `index` on: the file of its visit, from its row."""
    visit, row = index >> ROW_BITS, index & ((1 << ROW_BITS) - 1)
    path = self.file_of_visit(visit)
    ahead = None if path is None else self._fetcher.submit(_open_shard, path)
    empty_visits = 0
    try:
      while ahead is not None:
        shard = ahead.result()
        following = self.file_of_visit(visit + 1)
        ahead = None if following is None else self._fetcher.submit(_open_shard, following)
        try:
          records = shard.records
          if len(records) >= 1 << ROW_BITS:
            raise ConfigError(f"{shard.path} holds {len(records)} records; split it into files of under 2**32")
          empty_visits = 0 if len(records) else empty_visits + 1
          if empty_visits >= len(self.files):
            raise ConfigError(f"{self.what} is empty: its {len(self.files)} shard file(s) hold no records")
          for r in range(row, len(records)):
            yield Located((visit << ROW_BITS) | r, self._encoded(shard, r))
        finally:
          shard.close()
        visit, row = visit + 1, 0
    finally:
      if ahead is not None:  # abandoned (a seek, the end of the run): release the shard fetched ahead
        ahead.add_done_callback(self._release)

  def _encoded(self, shard: _Shard, row: int) -> Any:
    try:
      try:
        record = shard.records[row]
      except RuntimeError as e:  # the ArrayRecord reader's: a damaged chunk, found only when it is read
        raise Unreadable(e).error() from None
      value = _json_record(record) if shard.json else record
      return self._encode(value if self._column is None else record_text(value, self._column))
    except UserError as e:
      raise type(e)(f"{shard.where(row)}: {e}") from None


def describe_position(index: int, stream: ShardStream) -> str:
  visit, row = index >> ROW_BITS, index & ((1 << ROW_BITS) - 1)
  return f"{stream.file_of_visit(visit) or 'the end'} row {row}"
