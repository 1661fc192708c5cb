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

import concurrent.futures
import contextlib
import dataclasses
import io
import json
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np
import pyarrow.parquet as pq

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline.files import expand_files
from MaxText.input_pipeline.packing import Located
from MaxText.input_pipeline.pipeline import HostShard, record_text
from MaxText.paths import storage

ROW_BITS = 32  # rows of one shard file must stay below 2**32
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".array_record": "arrayrecord"}


def file_format(key: str, path: str) -> str:
  base = storage.name(path)
  for suffix, kind in FORMATS.items():
    if base.endswith(suffix):
      return kind
  raise ConfigError(f"{key}: {path} is not a shard file this reader knows (.parquet, .jsonl, .json, .array_record); "
                    "rename it or convert it")


@dataclasses.dataclass
class _Shard:
  """One opened shard file: its records by row and what to release when done with it."""
  path: str
  records: Sequence[Any]
  cleanup: contextlib.ExitStack

  def close(self) -> None:
    self.cleanup.close()


def _jsonl_records(data: bytes) -> list[bytes]:
  # Blank lines are skipped, as `datasets` does; each line is parsed when it is read.
  return [line for line in data.split(b"\n") if line.strip()]


def _open_shard(path: str) -> _Shard:
  """Fetches one shard (the read-ahead thread runs this for the next one)."""
  stack = contextlib.ExitStack()
  kind = file_format("stream files", path)
  if kind == "parquet":
    records: Sequence[Any] = pq.read_table(io.BytesIO(storage.read_bytes(path))).to_pylist()
  elif kind == "jsonl":
    records = _jsonl_records(storage.read_bytes(path))
  else:
    # ArrayRecord's reader opens local files only: a remote shard is downloaded, and removed when done.
    local = stack.enter_context(storage.local_copy(path))
    records = grain.sources.ArrayRecordDataSource([local])
  return _Shard(path, records, stack)


def _close_fetched(future: "concurrent.futures.Future[_Shard]") -> None:
  if future.exception() is None:
    future.result().close()


def _record(record: Any) -> Any:
  """A JSONL line as its JSON value (ArrayRecord bytes and parquet rows go to record_text as they are)."""
  if isinstance(record, bytes) and record[:1] in (b"{", b"\""):
    try:
      return json.loads(record)
    except json.JSONDecodeError as e:
      raise UserError(f"is not JSON ({e.msg} at column {e.colno})") from None
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
            yield Located((visit << ROW_BITS) | r, self._encoded(shard.path, r, records[r]))
        finally:
          shard.close()
        visit, row = visit + 1, 0
    finally:
      if ahead is not None:  # abandoned (a seek, the end of the run): release the shard fetched ahead
        ahead.add_done_callback(self._release)

  def _encoded(self, path: str, row: int, record: Any) -> Any:
    try:
      value = _record(record)
      return self._encode(value if self._column is None else record_text(value, self._column))
    except UserError as e:
      raise type(e)(f"{path} record {row + 1}: {e}") from None


def describe_position(index: int, stream: ShardStream) -> str:
  visit, row = index >> ROW_BITS, index & ((1 << ROW_BITS) - 1)
  return f"{stream.file_of_visit(visit) or 'the end'} row {row}"
