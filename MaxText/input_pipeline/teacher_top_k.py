"""A teacher's top-k next-token log-probabilities precomputed to files (generate_teacher_top_k.py)
and read beside the batches they were computed on (objective=distill with distill_top_k_path).

    DIR/manifest.json                  k, the data keys, the batch layout, batches per split
    DIR/<split>/shard-<i>/part-<j>.npy  one data shard's rows (i: HostShard.index), BATCHES_PER_PART
                                       batches per part, row r of batch b at record b * rows + r

A record holds one packed row: the teacher's top-k token ids (int32 [L, k]) and their log-probs
(float32 [L, k], at temperature 1, sorted high to low), and a hash of the row's five token fields.
Float32 keeps the loss equal to the on-the-fly one (bfloat16 would round each log-prob to three
digits), and with int32 ids beside them bfloat16 would save only a quarter of the file. Temperature
1 serves any distill_temperature: over the top k, softmax(log p / τ) is the teacher's distribution at
τ renormalised over them, which is what the loss uses (distill_loss.py).

Fixed-size records make a batch's rows one slice of a memory-mapped file: the reader needs only the
number of batches handed out, which joins the data position in checkpoints, so a resumed run reads
the same records. Each row's hash is checked against the student's batch: files written from other
data stop the run in one line, however they came to differ.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import tokenize
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

from MaxText.configuration import run_record
from MaxText.configuration.config_fields import DATA_POSITION, FIXED, keys_where
from MaxText.configuration.data_config import DataConfig
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline.batch_spec import FIELDS, TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS
from MaxText.input_pipeline.pipeline import HostShard, host_shard
from MaxText.paths import storage
from MaxText.platform.sharding import for_rank

if TYPE_CHECKING:
  from MaxText.configuration.config import Config

FORMAT = 1
MANIFEST = "manifest.json"
BATCHES_PER_PART = 64
TRAIN, EVAL = "train", "eval"
STATE_KEY = "teacher_top_k_batches"  # beside the data position in a checkpoint
# The keys whose values decide the batches (those a resume must keep for its data position), and
# the synthetic generator's two.
DATA_KEYS = keys_where((DataConfig,), FIXED, DATA_POSITION) + ("vocab_size", "synthetic_max_stride")


def record_dtype(length: int, k: int) -> np.dtype[Any]:
  return np.dtype([("indices", np.int32, (length, k)), ("logps", np.float32, (length, k)), ("row_hash", np.uint64)])


def data_keys(data: DataConfig) -> dict[str, Any]:
  """The batch-deciding keys as JSON values (a mixture's sources as their spelling)."""
  return {name: json.loads(json.dumps(getattr(data, name), default=str)) for name in DATA_KEYS}


def host_rows(array: jax.Array, shard: HostShard) -> np.ndarray:
  """This process's rows [shard.rows, ...] of a global array sharded over its rows."""
  out: np.ndarray | None = None
  first = shard.index * shard.rows
  for piece in array.addressable_shards:
    start, stop, _ = piece.index[0].indices(array.shape[0]) if piece.index else (0, array.shape[0], 1)
    data = np.asarray(piece.data)
    if out is None:
      out = np.zeros((shard.rows, *array.shape[1:]), data.dtype)
    out[start - first:stop - first] = data
  assert out is not None, "an array with no rows on this process"
  return out


def row_hashes(batch: Mapping[str, np.ndarray]) -> np.ndarray:
  """One 64-bit hash per row of the five token fields ([rows, L] each)."""
  rows = np.stack([np.ascontiguousarray(batch[name], np.int32) for name in FIELDS], axis=1)  # [rows, 5, L]
  return np.array([int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") for row in rows],
                  np.uint64)


def _part_path(directory: str, split: str, shard_index: int, part: int) -> str:
  return os.path.join(directory, split, f"shard-{shard_index}", f"part-{part:05d}.npy")


class Writer:
  """Writes one split of one data shard, batch by batch (this process's rows)."""

  def __init__(self, directory: str, split: str, shard: HostShard, length: int, k: int, num_batches: int):
    self.directory, self.split, self.shard, self.num_batches = directory, split, shard, num_batches
    self._dtype = record_dtype(length, k)
    self._batch = 0
    self._part: np.memmap[Any, Any] | None = None
    self._part_path = ""

  def add(self, batch: Mapping[str, np.ndarray], indices: np.ndarray, logps: np.ndarray) -> None:
    """This shard's rows of one batch: its token fields and the teacher's top k ([rows, L, k])."""
    part, within = divmod(self._batch, BATCHES_PER_PART)
    if within == 0:
      self._close_part()
      count = min(BATCHES_PER_PART, self.num_batches - self._batch) * self.shard.rows
      self._part_path = _part_path(self.directory, self.split, self.shard.index, part)
      os.makedirs(os.path.dirname(self._part_path), exist_ok=True)
      self._part = np.lib.format.open_memmap(self._part_path + ".tmp", mode="w+", dtype=self._dtype, shape=(count,))
    assert self._part is not None
    rows = slice(within * self.shard.rows, (within + 1) * self.shard.rows)
    self._part["indices"][rows], self._part["logps"][rows] = indices, logps
    self._part["row_hash"][rows] = row_hashes(batch)
    self._batch += 1

  def _close_part(self) -> None:
    if self._part is not None:
      self._part.flush()
      del self._part
      self._part = None
      os.replace(self._part_path + ".tmp", self._part_path)  # a part is whole or absent

  def close(self) -> None:
    assert self._batch == self.num_batches, (self._batch, self.num_batches)
    self._close_part()


def write_manifest(directory: str, data: DataConfig, k: int, num_data_shards: int, rows: int,
                   batches: Mapping[str, int], teacher: str) -> None:
  manifest = {"format": FORMAT, "top_k": k, "logps_dtype": "float32", "temperature": 1.0, "teacher": teacher,
              "num_data_shards": num_data_shards, "rows_per_shard": rows, "batches_per_part": BATCHES_PER_PART,
              "batches": dict(batches), "data": data_keys(data)}
  storage.write_text(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1) + "\n")


def _refuse(directory: str, why: str) -> UserError:
  return UserError(f"distill_top_k_path {directory}: {why}")


def read_manifest(directory: str) -> dict[str, Any]:
  path = os.path.join(directory, MANIFEST)
  if storage.is_remote(directory):
    raise ConfigError(f"distill_top_k_path={directory}: the top-k files are memory-mapped, so they must be on a "
                      "local (or gcsfuse-mounted) file system; copy them to local disk and point the key there")
  if not os.path.exists(path):
    raise _refuse(directory, f"has no {MANIFEST}; write it with python3 -m MaxText.generate_teacher_top_k")
  try:
    manifest: dict[str, Any] = json.loads(storage.read_text(path))
  except (ValueError, RecursionError) as e:  # JSONDecodeError; UnicodeDecodeError: bytes that are not text
    reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 text" \
        if isinstance(e, UnicodeDecodeError) else "nested too deeply"
    raise _refuse(directory, f"{MANIFEST} is not JSON ({reason}); write the files again") from None
  if not isinstance(manifest, dict):
    raise _refuse(directory, f"{MANIFEST} holds a JSON {type(manifest).__name__}, not this writer's object; write the "
                  "files again")
  if manifest.get("format") != FORMAT:
    raise _refuse(directory, f"{MANIFEST} has format {manifest.get('format')}, this reader {FORMAT}; write them again")
  for name, problem in _manifest_problems(manifest):
    raise _refuse(directory, f"{MANIFEST} has {name}={manifest.get(name)!r}, {problem}; write the files again")
  return manifest


def _whole(value: object, least: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _manifest_problems(manifest: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
  """The fields the reader uses that are absent or not what the writer writes (an edited or foreign file)."""
  for name in ("top_k", "num_data_shards", "batches_per_part"):
    if not _whole(manifest.get(name), 1):
      yield name, "not a whole number >= 1"
  if not isinstance(manifest.get("data"), dict):
    yield "data", "not an object of data keys"
  batches = manifest.get("batches")
  if not isinstance(batches, dict) or not all(_whole(count, 0) for count in batches.values()):
    yield "batches", "not an object of batch counts per split"


def check_manifest(directory: str, manifest: Mapping[str, Any], data: DataConfig, k: int,
                   num_data_shards: int, split: str, batches_needed: int) -> None:
  """One line for files that do not fit the run: another k, data (tokenizer, vocabulary, sequence
  length, dataset, order), batch layout, or fewer batches than it reads."""
  if manifest["top_k"] > data.vocab_size:  # no writer's: and numpy cannot lay out a record of an absurd k (a traceback)
    raise _refuse(directory, f"holds the teacher's top {manifest['top_k']}, more tokens than vocab_size="
                  f"{data.vocab_size}; the files are damaged or not this writer's, write them again")
  if k > manifest["top_k"]:  # a smaller k reads the first k of each sorted record: the same top k
    raise _refuse(directory, f"holds the teacher's top {manifest['top_k']}, this run has distill_top_k={k}; set "
                  f"distill_top_k<={manifest['top_k']} or write the files again with k={k}")
  ours = data_keys(data)
  for name, theirs in manifest["data"].items():
    if ours.get(name, theirs) != theirs and not run_record.same_path(name, theirs, ours[name]):
      raise _refuse(directory, f"was written for {name}={theirs!r}, this run has {name}={ours[name]!r}: its top-k "
                    "belong to other batches; write them again with this run's data keys")
  if manifest["num_data_shards"] != num_data_shards:
    raise _refuse(directory, f"was written by {manifest['num_data_shards']} data shard(s) (processes holding distinct "
                  f"rows), this run has {num_data_shards}, which reads other batches; write them on this run's layout")
  have = int(manifest["batches"].get(split, 0))
  if have < batches_needed:
    what = "steps" if split == TRAIN else "eval_steps"
    raise _refuse(directory, f"holds {have} {split} batches, fewer than the {batches_needed} this run reads "
                  f"({what}); write them again with at least that many")


class TopKFiles:
  """One split of one data shard: batch number → its rows' (indices, logps, row hashes)."""

  def __init__(self, directory: str, manifest: Mapping[str, Any], split: str, shard: HostShard, length: int):
    self.directory, self.split, self.shard = directory, split, shard
    self.num_batches = int(manifest["batches"][split])
    self._per_part = int(manifest["batches_per_part"])
    dtype = record_dtype(length, int(manifest["top_k"]))
    self._parts: list[np.memmap[Any, Any]] = []
    for part in range(-(-self.num_batches // self._per_part)):
      path = _part_path(directory, split, shard.index, part)
      records = min(self._per_part, self.num_batches - part * self._per_part) * shard.rows
      if not os.path.exists(path):
        raise _refuse(directory, f"{path} is missing; write the files again")
      try:
        data = np.load(path, mmap_mode="r")
      # EOFError: an empty file (numpy finds no header); TokenError, SyntaxError: a damaged header (numpy reads it as
      # Python, and its errors were tracebacks)
      except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _refuse(directory, f"{path} is truncated or damaged ({reason}); write the files again") from None
      if data.dtype != dtype or data.shape != (records,):
        # The shape whole: a 0-d array has no record count (was: an IndexError traceback).
        raise _refuse(directory, f"{path} holds an array of shape {data.shape} of {data.dtype}, not ({records},) of "
                      f"{dtype}; write the files again")
      self._parts.append(data)
    self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="teacher-top-k")
    self._ahead: tuple[int, concurrent.futures.Future[np.ndarray]] | None = None

  def batch(self, number: int) -> np.ndarray:
    """Batch `number`'s records; the next batch's are read ahead on a thread meanwhile."""
    ahead, self._ahead = self._ahead, None
    records = ahead[1].result() if ahead is not None and ahead[0] == number else self._read(number)
    if number + 1 < self.num_batches:
      self._ahead = (number + 1, self._reader.submit(self._read, number + 1))
    return records

  def _read(self, number: int) -> np.ndarray:
    if number >= self.num_batches:
      raise _refuse(self.directory, f"holds {self.num_batches} {self.split} batches; the run asks for batch "
                    f"{number + 1}: write them again with more steps")
    part, within = divmod(number, self._per_part)
    rows = self.shard.rows
    return np.array(self._parts[part][within * rows:(within + 1) * rows])


@dataclasses.dataclass
class TopKBatches:
  """Another iterator's batches with the teacher's top k of each row read from the files: fields
  teacher_top_k_indices and teacher_top_k_logps [B, L, k]. The number of batches handed out joins
  the inner iterator's checkpointed position."""

  inner: Any  # an input_pipeline.BatchIterator
  files: TopKFiles
  sharding: NamedSharding
  k: int
  vocab_size: int
  batches: int = 0

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self.inner)
    records = self.files.batch(self.batches)
    mine = {name: host_rows(batch[name], self.files.shard) for name in FIELDS}
    mismatched = np.flatnonzero(records["row_hash"] != row_hashes(mine))
    if mismatched.size:
      row = self.files.shard.index * self.files.shard.rows + int(mismatched[0])
      raise _refuse(self.files.directory, f"{self.files.split} batch {self.batches + 1}, row {row}: the tokens "
                    "differ from those the teacher's top k were computed on (other data files, shuffling or "
                    "tokenizer); write the files again from this run's data")
    self._check_values(records["indices"], records["logps"])
    indices, logps = records["indices"][..., :self.k], records["logps"][..., :self.k]
    self.batches += 1
    shape, rank3 = (*batch["inputs"].shape, self.k), for_rank(self.sharding, 3)
    return {**batch, **{name: jax.make_array_from_process_local_data(rank3, values, shape)
                        for name, values in ((TEACHER_TOP_K_INDICES, indices), (TEACHER_TOP_K_LOGPS, logps))}}

  def _check_values(self, indices: np.ndarray, logps: np.ndarray) -> None:
    """The row hash covers the student's tokens, not the teacher's side: an id outside the vocabulary
    made the loss NaN (the step skipped as non-finite) or, negative, silently picked a token counted
    from the end; a non-finite log-prob made the loss NaN. (Finite ones need not be normalised: the
    loss renormalises them over the k.) Checked on the whole record, of the files' k."""
    bad = (indices < 0) | (indices >= self.vocab_size) | ~np.isfinite(logps)
    if bad.any():
      row, position, rank = (int(i) for i in np.argwhere(bad)[0])
      what = (f"token id {int(indices[row, position, rank])} outside the vocabulary [0, {self.vocab_size})"
              if not 0 <= indices[row, position, rank] < self.vocab_size
              else f"log-prob {float(logps[row, position, rank])}")
      self._refuse_at(row, position, f"{what} is not a teacher's top k")
    # The writer's records are sorted high to low with distinct ids. Unsorted, a distill_top_k below the
    # files' read other tokens than the teacher's top k; a repeated id counted its probability twice.
    unsorted = np.diff(logps, axis=-1) > 0
    ranked = np.sort(indices[..., :self.k], axis=-1)
    repeated = ranked[..., 1:] == ranked[..., :-1]
    for bad, what in ((unsorted, "the log-probs are not sorted high to low"), (repeated, "a token id repeats")):
      if bad.any():
        row, position, _ = (int(i) for i in np.argwhere(bad)[0])
        self._refuse_at(row, position, f"{what}, which no teacher's top k does")

  def _refuse_at(self, row: int, position: int, what: str) -> None:
    row += self.files.shard.index * self.files.shard.rows
    raise _refuse(self.files.directory, f"{self.files.split} batch {self.batches + 1}, row {row}, position "
                  f"{position}: {what}; the files are damaged or not this writer's, write them again")

  def reset(self) -> "TopKBatches":
    self.inner.reset()
    self.batches = 0
    return self

  def peek(self) -> None:
    if hasattr(self.inner, "peek"):
      self.inner.peek()

  def get_state(self) -> dict[str, Any]:
    return {**self.inner.get_state(), STATE_KEY: self.batches}

  def set_state(self, state: dict[str, Any]) -> None:
    if STATE_KEY not in state:
      raise ConfigError("the checkpoint's data position was saved by a run that did not read distill_top_k_path, so "
                        "which precomputed batch comes next is unknown; resume without distill_top_k_path")
    self.inner.set_state({name: value for name, value in state.items() if name != STATE_KEY})
    self.batches = int(state[STATE_KEY])

  def host_metrics(self) -> dict[str, float]:
    report = getattr(self.inner, "host_metrics", None)
    return report() if report is not None else {}

  def describe_next_position(self) -> str:
    describe = getattr(self.inner, "describe_next_position", None)
    where = describe() if describe is not None else "the data"
    return f"{where}, teacher top-k batch {self.batches + 1}"

  def close(self) -> None:
    close = getattr(self.inner, "close", None)
    if close is not None:
      close()


def open_batches(config: Config, inner: Any, sharding: NamedSharding, train: bool) -> TopKBatches:
  """`inner`'s batches (the train or eval split) with the teacher's top k from distill_top_k_path;
  one line when the files do not fit the run."""
  cfg, directory = config.data, config.distill.distill_top_k_path
  shard = host_shard(sharding, cfg.global_batch_size, cfg.max_target_length)
  manifest = read_manifest(directory)
  split, needed = (TRAIN, config.run.steps) if train else (EVAL, cfg.eval_steps)
  check_manifest(directory, manifest, cfg, config.distill.distill_top_k, shard.count, split, needed)
  files = TopKFiles(directory, manifest, split, shard, cfg.max_target_length)
  return TopKBatches(inner, files, sharding, config.distill.distill_top_k, config.model.vocab_size)
