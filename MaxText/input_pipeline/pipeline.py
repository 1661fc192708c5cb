"""The shared back half of the tfds, hf and grain pipelines: records → tokens → packed rows →
this host's part of the global batch, prepared ahead in a background thread.

    source (random access) ─► Grain MapDataset: this host's shard, shuffled per epoch, repeated,
        tokenised ─► DocumentCursor ─► pack_batch ─► prefetch thread ─► make_array_from_process_local_data

Each process reads a disjoint shard of the records (every `num_shards`-th one) and builds only
the rows its devices hold. Processes whose devices hold the same rows (batch replicated over a
mesh axis that is not in data_sharding) read the same shard, so their rows agree.

State: the (document index, pair offset) where this shard's next row starts, after exactly the
batches handed out so far (prefetched batches do not count). Checkpoints store one JSON dict
holding every shard's position.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import queue
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from MaxText.errors import ConfigError, UserError
from MaxText import json_text
from MaxText.input_pipeline.json_records import json_kind
from MaxText.input_pipeline.packing import DocumentCursor, Position, pack_batch
from MaxText.platform.sharding import for_rank

STATE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class HostShard:
  """Which rows of the global batch this process builds and which slice of the data it reads."""

  index: int  # data shard read by this process
  count: int  # number of distinct data shards (processes that hold different rows)
  rows: int  # rows of the global batch this process builds (= global batch / count)


def host_shard(sharding: NamedSharding, global_batch: int, length: int, process_index: int | None = None,
               process_of: Callable[[Any], int] | None = None) -> HostShard:
  """The rows of a [global_batch, length] array that `process_index`'s devices hold, as a shard.

  `process_of` maps a device to its process (tests use it to simulate several processes on one).
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_of = process_of or (lambda d: d.process_index)
  row_sets = set()
  for device, index in sharding.devices_indices_map((global_batch, length)).items():
    if process_of(device) == process_index:
      row_sets.add(index[0].indices(global_batch)[:2])
  if not row_sets:
    raise ConfigError(f"process {process_index} holds no device of the batch sharding")
  start, stop = min(r[0] for r in row_sets), max(r[1] for r in row_sets)
  rows = stop - start
  covered = sum(b - a for a, b in row_sets)
  if covered != rows or start % rows or global_batch % rows:
    raise ConfigError(f"process {process_index} holds rows {sorted(row_sets)} of the global batch of {global_batch}, "
                      "not one contiguous block; use a mesh whose data_sharding axes keep each process's devices together")
  return HostShard(index=start // rows, count=global_batch // rows, rows=rows)


def data_shards(shard: HostShard, per_process: int) -> list[HostShard]:
  """The data shards this process reads, in the order of its rows: its own, or for an elastic run
  `per_process` (its gradient-accumulation steps) virtual shards of one micro-batch's rows each.
  Virtual shards are numbered over the whole job and their count (processes x micro-batches) is
  the same on every slice count, so a resize hands each one's records and position on unchanged
  and the global batch is the same array (row r: shard r // rows, that shard's row r % rows)."""
  if per_process == 1:
    return [shard]
  if shard.rows % per_process:
    raise ConfigError(f"process {shard.index} holds {shard.rows} rows of the global batch, which gradient_accumulation_"
                      f"steps={per_process} does not split into micro-batches of whole rows; set per_device_batch_size "
                      "so each process's rows are a multiple of it")
  rows = shard.rows // per_process
  return [HostShard(shard.index * per_process + k, shard.count * per_process, rows) for k in range(per_process)]


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark: part of the file, never of the text


def record_text(record: object, column: str) -> str:
  """The document text of one record: a dict (HF, TFDS, parsed JSON) or bytes holding JSON or raw
  UTF-8 (ArrayRecord). A column that is not text (null, a number, a list) is refused, not trained
  as its Python spelling."""
  if isinstance(record, (bytes, bytearray)):
    text = _utf8(bytes(record).removeprefix(BOM), "the record")
    if text[:1] in ('{', '"'):
      try:
        record = json.loads(text)
      except (json.JSONDecodeError, RecursionError):  # raw text that starts like JSON (or nests past its limit)
        return text
      if "\\u" in text and json_text.has_unpaired_surrogate(record):
        raise UserError(f"the record {json_text.UNPAIRED_SURROGATE}; fix or remove it")
      if isinstance(record, str):
        return record
    else:
      return text
  if isinstance(record, dict):
    if column not in record:
      raise ConfigError(f"records have no column {column!r} (they have {', '.join(map(str, record))}); "
                        "set train_data_columns")
    value = record[column]
    if isinstance(value, (bytes, bytearray)):
      return _utf8(bytes(value), f"column {column!r}")
    if not isinstance(value, str):
      # datasets reads a field a record lacks (and other records hold) as null
      absent = " or missing" if value is None else ""
      raise UserError(f"column {column!r} is {json_kind(value)}{absent}, not text; fix or remove that record")
    return value
  return str(record)


def _utf8(data: bytes, what: str) -> str:
  """`data` as text; bytes that are not UTF-8 are refused, not trained as replacement characters."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{what} holds bytes that are not UTF-8 text (byte {e.start + 1}: 0x{data[e.start]:02x}); save "
                    "it as UTF-8 or remove that record") from None


class _Numbered:
  """`source` as (index, record) pairs: a record's own index survives sharding and shuffling, so
  a record the encoder refuses can be named."""

  def __init__(self, source: Sequence[Any]):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> tuple[int, Any]:
    try:
      return index, self.source[index]
    # RuntimeError: the ArrayRecord reader's, on a damaged chunk; UnicodeDecodeError: a string of a JSON file that
    # is not UTF-8 (datasets' JSON reader stores its bytes unchecked; they are decoded when the record is read).
    except (RuntimeError, UnicodeDecodeError, UserError) as e:
      return index, Unreadable(e)


class Unreadable:
  """A record its reader failed on; the encoder's wrapper raises it as a UserError naming the record."""

  def __init__(self, error: Exception):
    self._error = error

  def error(self) -> UserError:
    if isinstance(self._error, UserError):
      return self._error
    if isinstance(self._error, UnicodeDecodeError):
      byte = bytes(self._error.object[self._error.start:self._error.start + 1]).hex()
      return UserError(f"holds text that is not UTF-8 (a byte 0x{byte} in one of its strings); save the file as UTF-8 "
                       "or remove that record")
    reason = (str(self._error).splitlines() or [""])[0] or type(self._error).__name__
    return UserError(f"cannot be read ({reason}); the file holding it is damaged: replace or remove it")


def document_dataset(source: Sequence[Any], shard: HostShard, encode: Callable[[Any], Any], column: str | None,
                     shuffle_seed: int | None, repeat: bool, what: str,
                     locate: Callable[[int], str] | None = None) -> Any:
  """Grain MapDataset of documents (token lists, or [2, n] tokens and weights): this shard's records,
  shuffled per epoch and repeated if asked. `encode` gets the text of `column`, or the whole
  record when column is None (fine-tuning records). A UserError from `encode` is raised again
  naming the record: `locate(index)` (e.g. a file and line), else its index in `what`."""
  import grain

  def encode_numbered(numbered: tuple[int, Any]) -> Any:
    index, record = numbered
    try:
      if isinstance(record, Unreadable):
        raise record.error()
      return encode(record if column is None else record_text(record, column))
    except UserError as e:
      where = locate(index) if locate is not None else f"record {index + 1} of {what}"
      raise type(e)(f"{where}: {e}") from None

  num_records = len(source)
  if num_records == 0:
    raise ConfigError(f"{what} is empty")
  if num_records < shard.count:
    raise ConfigError(f"{what} has {num_records} records, fewer than the {shard.count} data shards (one per "
                      "process holding distinct rows); every process needs at least one")
  dataset = grain.MapDataset.source(_Numbered(source))[shard.index::shard.count]
  if shuffle_seed is not None:
    dataset = dataset.shuffle(seed=shuffle_seed)
  if repeat:
    dataset = dataset.repeat()  # grain reshuffles every epoch of a shuffled dataset
  return dataset.map(encode_numbered)


def reader(dataset: Any, num_threads: int) -> Callable[[int], Iterator[list[int]]]:
  """index → iterator over documents index, index+1, ...; with threads, Grain reads ahead in parallel."""
  import grain

  def read_from(index: int) -> Iterator[list[int]]:
    rest = dataset[index:]
    if num_threads > 0:
      options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
      return iter(rest.to_iter_dataset(options))
    return (rest[i] for i in range(len(rest)))

  return read_from


_LIVE_PREFETCHERS: "weakref.WeakSet[_Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_prefetchers() -> None:
  # A daemon thread still inside a native reader while the interpreter tears down aborts the process.
  for prefetcher in list(_LIVE_PREFETCHERS):
    prefetcher.close()


class _Prefetcher:
  """A daemon thread that keeps up to `depth` (host batch, position after it) pairs ready."""

  def __init__(self, produce: Callable[[], tuple[dict[str, np.ndarray], Any]], depth: int):
    self._produce = produce
    self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
    self._thread.start()
    _LIVE_PREFETCHERS.add(self)

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        item: Any = self._produce()
      except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
        item = e
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if isinstance(item, BaseException):
        return

  def get(self) -> tuple[dict[str, np.ndarray], Any]:
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join()


class BatchIterator:
  """Global [B, L] int32 batches sharded by `sharding`; `get_state`/`set_state`/`reset` as the
  trainer, the checkpoint hook and the eval hook expect. A subclass makes this host's rows and
  says what its position is: a list of ints per data shard (gathered from every process) and
  its JSON form. Host-side values a subclass adds to a batch under names starting with `_` are
  kept aside as `extras` of the batch last handed out.

  `data_shards` (default: `shard` alone) are the shards whose positions this process keeps; a
  subclass that reads several (data_shards()) splits its position into theirs (`_split`/`_join`)."""

  def __init__(self, shard: HostShard, sharding: NamedSharding, global_batch: int, length: int, packing: bool,
               prefetch: int, describe: str, position: Any, data_shards: Sequence[HostShard] | None = None):
    self.shard, self.sharding, self.describe = shard, sharding, describe
    self.data_shards = list(data_shards or [shard])
    self.global_shape = (global_batch, length)
    self._length, self._packing, self._prefetch_depth = length, packing, prefetch
    self._position = position  # where the next handed-out batch starts
    self._prefetcher: _Prefetcher | None = None
    self._peeked: tuple[dict[str, np.ndarray], Any] | None = None  # read by peek(), not yet handed out
    self.rows_with_data = 0  # rows of the last batch that hold any data (eval data can run out)
    self.extras: dict[str, np.ndarray] = {}
    # What a position indexes ("12 file(s)", "4800 record(s)"; per source for a mixture), saved with it: under the
    # same key a glob can match other files at a resume, and the same position then reads other documents.
    self.source_size: Any = None

  # What a subclass provides.
  def _produce(self) -> tuple[dict[str, np.ndarray], Any]:
    """This host's rows of the next batch (with `_num_real`) and the position after it."""
    raise NotImplementedError

  def _restart(self, position: Any) -> None:
    """Reads on from `position` (None: the start)."""
    raise NotImplementedError

  def _position_ints(self, position: Any) -> list[int]:
    raise NotImplementedError

  def _shard_json(self, ints: list[int]) -> dict[str, Any]:
    raise NotImplementedError

  def _position_of(self, shard_json: dict[str, Any]) -> Any:
    raise NotImplementedError

  def _split(self, position: Any) -> list[Any]:
    """The position of each of `data_shards`."""
    return [position]

  def _join(self, positions: list[Any]) -> Any:
    return positions[0]

  def __iter__(self) -> "BatchIterator":
    return self

  def _next_host_batch(self) -> tuple[dict[str, np.ndarray], Any]:
    if self._peeked is not None:
      item, self._peeked = self._peeked, None
      return item
    if self._prefetch_depth == 0:
      return self._produce()
    if self._prefetcher is None:
      self._prefetcher = _Prefetcher(self._produce, self._prefetch_depth)
    return self._prefetcher.get()

  def peek(self) -> None:
    """Reads the next batch now (the next `next` returns it): bad data then stops a run before it
    writes anything to its directory."""
    if self._peeked is None:
      self._peeked = self._next_host_batch()

  def next_host_rows(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch, handed out (the position moves past them)."""
    host_batch, position = self._next_host_batch()
    self._position = position
    self.extras = {name: host_batch.pop(name) for name in [n for n in host_batch if n.startswith("_")]}
    self.rows_with_data = int(self.extras["_num_real"])
    return host_batch

  def __next__(self) -> dict[str, jax.Array]:
    host_batch = self.next_host_rows()
    # Rows split like `sharding` whatever a field's rank (pixel_values: [B, M, 3, R, R]).
    return {name: jax.make_array_from_process_local_data(
        for_rank(self.sharding, rows.ndim), rows, self.global_shape[:1] + rows.shape[1:])
            for name, rows in host_batch.items()}

  def _seek(self, position: Any) -> None:
    self.close()
    self._peeked = None
    self._restart(position)
    self._position = position

  def reset(self) -> "BatchIterator":
    """Back to the first batch (every evaluation reads the same batches)."""
    self._seek(None)
    return self

  def close(self) -> None:
    if self._prefetcher is not None:
      self._prefetcher.close()
      self._prefetcher = None

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position after the batches handed out so far, of every shard.

    With several processes this gathers every process's position, so every process must call it
    at the same step (the checkpoint hook does)."""
    mine = np.array([x for shard, position in zip(self.data_shards, self._split(self._position))
                     for x in (shard.index, *self._position_ints(position))], np.int64)
    width = len(mine) // len(self.data_shards)  # a shard's index and its position's ints
    if jax.process_count() > 1:
      mine = np.asarray(multihost_utils.process_allgather(mine))
    rows = mine.reshape(-1, width)
    shards = {str(int(row[0])): self._shard_json([int(x) for x in row[1:]]) for row in rows}
    state = {"format": STATE_FORMAT, "source": self.describe, "num_shards": self.data_shards[0].count,
             "global_batch_size": self.global_shape[0], "max_target_length": self._length, "shards": shards}
    return state if self.source_size is None else {**state, "source_size": self.source_size}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues after the batches `state` describes; refuses a state from another data layout."""
    if "shards" not in state:
      raise ConfigError(f"the checkpoint's data state {state} was written by another dataset_type; "
                        f"it cannot position {self.describe}")
    saved = (state.get("global_batch_size"), state.get("max_target_length"), state.get("num_shards"))
    count = self.data_shards[0].count
    wanted = (self.global_shape[0], self._length, count)
    if saved != wanted:
      virtual = (f" ({count // len(self.data_shards)} process(es) x {len(self.data_shards)} micro-batches: an elastic "
                 "run's virtual data shards)" if len(self.data_shards) > 1 else "")
      raise ConfigError(f"the checkpoint's data position is for global batch {saved[0]} x max_target_length "
                        f"{saved[1]} over {saved[2]} data shard(s); this run has {wanted[0]} x {wanted[1]} over "
                        f"{wanted[2]}{virtual}: the same position would not give the same batches")
    if state.get("source") != self.describe:
      print(f"warning: the checkpoint's data position was saved for {state.get('source')}, "
            f"now reading {self.describe}", flush=True)
    elif "source_size" in state and self.source_size is not None and state["source_size"] != self.source_size:
      print(f"warning: the checkpoint's data position was saved over {_sizes(state['source_size'])} of "
            f"{self.describe}, which now holds {_sizes(self.source_size)}: the same position reads other documents "
            "than the run would have read on (files added, removed or rewritten); resume with the files it was "
            "saved with to read on exactly", flush=True)
    shards = state["shards"]
    if not isinstance(shards, dict) or sorted(shards, key=str) != sorted(map(str, range(count))):
      had = ", ".join(sorted(map(str, shards), key=lambda k: (len(k), k))) if isinstance(shards, dict) else repr(shards)
      raise ConfigError(f"the checkpoint's data position is damaged: it holds data shard(s) [{had}] instead of 0.."
                        f"{count - 1}; resume from another checkpoint step or delete this one")
    positions = []
    for shard in self.data_shards:
      try:
        positions.append(self._position_of(shards[str(shard.index)]))
      except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"the checkpoint's data position of data shard {shard.index} is damaged "
                          f"({shards[str(shard.index)]!r}); resume from another checkpoint step or delete this "
                          "one") from None
    self._seek(self._join(positions))


def _sizes(size: Any) -> str:
  """A saved source_size as text: one source's, or a mixture's per source."""
  if isinstance(size, dict):
    return ", ".join(f"{name}: {value}" for name, value in size.items())
  return str(size)


class PackedBatchIterator(BatchIterator):
  """Document cursors packed into rows by `pack` (packing.pack_batch; preference.pack_preference_batch
  for DPO's pairs): one per data shard this process reads (`read_from`, in the order of
  `data_shards`), each filling its shard's rows. Its position is the cursors'."""

  def __init__(self, read_from: Sequence[Callable[[int], Iterator[Any]]], shard: HostShard, sharding: NamedSharding,
               global_batch: int, length: int, packing: bool, prefetch: int, max_empty_run: int, describe: str,
               pack: Callable[..., tuple[dict[str, np.ndarray], int]] = pack_batch,
               explain_empty: Callable[[], str | None] | None = None,
               describe_index: Sequence[Callable[[int], str] | None] | None = None,
               data_shards: Sequence[HostShard] | None = None, source_size: str | None = None):
    shards = list(data_shards or [shard])
    if len(read_from) != len(shards):
      raise ValueError(f"{len(read_from)} readers for {len(shards)} data shards")
    super().__init__(shard, sharding, global_batch, length, packing, prefetch, describe, self._start(len(shards)),
                     shards)
    self._pack, self.source_size = pack, source_size
    self._describe_index = list(describe_index or [None] * len(shards))
    self._cursors = [DocumentCursor(r, max_empty_run, explain_empty=explain_empty) for r in read_from]

  @staticmethod
  def _start(count: int) -> tuple[Position, ...]:
    return tuple(Position() for _ in range(count))

  def _produce(self) -> tuple[dict[str, np.ndarray], tuple[Position, ...]]:
    parts, num_real = [], 0
    for shard, cursor in zip(self.data_shards, self._cursors):
      part, real = self._pack(cursor, shard.rows, self._length, self._packing)
      cursor.settle()
      parts.append(part)
      num_real += real
    batch = parts[0] if len(parts) == 1 else {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    return {**batch, "_num_real": np.asarray(num_real)}, tuple(c.position for c in self._cursors)

  def describe_next_position(self) -> str:
    """Where the next batch starts in this host's shard(s) (a skipped batch is named by it)."""
    wheres = []
    for shard, describe_index, position in zip(self.data_shards, self._describe_index, self._position):
      where = describe_index(position.index) if describe_index is not None else f"document {position.index}"
      wheres.append(f"data shard {shard.index} of {shard.count}, from {where}, token pair {position.offset}")
    return "; ".join(wheres)

  def _restart(self, position: tuple[Position, ...] | None) -> None:
    for cursor, at in zip(self._cursors, position or self._start(len(self._cursors))):
      cursor.seek(at)

  def _seek(self, position: tuple[Position, ...] | None) -> None:
    super()._seek(position or self._start(len(self._cursors)))

  def _split(self, position: tuple[Position, ...]) -> list[Position]:
    return list(position)

  def _join(self, positions: list[Position]) -> tuple[Position, ...]:
    return tuple(positions)

  def _position_ints(self, position: Position) -> list[int]:
    return [position.index, position.offset]

  def _shard_json(self, ints: list[int]) -> dict[str, Any]:
    return {"index": ints[0], "offset": ints[1]}

  def _position_of(self, shard_json: dict[str, Any]) -> Position:
    if "index" not in shard_json and "sources" in shard_json:
      raise ConfigError(f"the checkpoint's data position is a mixture's ({', '.join(shard_json.get('sources', {}))}); "
                        "this run reads one source: resume with the data_mixture it was saved with")
    index, offset = shard_json["index"], shard_json["offset"]
    if not (isinstance(index, (int, np.integer)) and isinstance(offset, (int, np.integer)) and min(index, offset) >= 0):
      raise ValueError("not two whole numbers >= 0")
    return Position(int(index), int(offset))
