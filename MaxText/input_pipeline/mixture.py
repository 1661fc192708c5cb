"""Batches drawn from several sources by weight (data_mixture): every row of the global batch
is given to a source by a draw seeded with (data_shuffle_seed, batch number), so the draw is
the same on every process and after a restart; each process then packs its own rows from its
own shard of each source, in order. A source's rows are whole packed rows of that source.

Position: the number of batches handed out and, per source, this shard's (document, pair
offset), saved in the checkpoint like a single source's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from MaxText.configuration.data_mixture import MixtureStage
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline.packing import DocumentCursor, Position, pack_batch
from MaxText.input_pipeline.pipeline import BatchIterator, HostShard

# Keeps the mixture's draws apart from other users of data_shuffle_seed (the document shuffle).
_DRAW_STREAM = 0x6D6978


@dataclasses.dataclass(frozen=True)
class OpenedSource:
  """One source as the mixture reads it: this shard's documents from an index on."""
  name: str
  read_from: Callable[[int], Iterator[Any]]
  max_empty_run: int
  describe: str
  size: str | None = None  # what its positions index (BatchIterator.source_size)


@dataclasses.dataclass(frozen=True)
class MixturePosition:
  batches: int  # batches handed out so far: the next batch's draw
  sources: tuple[Position, ...]


def weights_at(step: int, weights: Sequence[float], stages: Sequence[MixtureStage]) -> np.ndarray:
  """The sampling probabilities of the sources at `step`: the last stage begun, else `weights`."""
  current = tuple(weights)
  for stage in stages:
    if stage.step <= step:
      current = stage.weights
  array = np.asarray(current, np.float64)
  return array / array.sum()


def draw_sources(seed: int, batch: int, num_rows: int, probabilities: np.ndarray) -> np.ndarray:
  """Which source fills each row of the global batch `batch` (the same on every process)."""
  rng = np.random.default_rng([seed, _DRAW_STREAM, batch])
  return rng.choice(len(probabilities), size=num_rows, p=probabilities)


class MixtureBatchIterator(BatchIterator):
  """Global batches whose rows come from `sources` with `weights` (changed by `stages` from their
  steps on). `host_metrics()` gives target tokens per source, over all processes, for the step's metrics.

  `shard_sources`: an elastic run's virtual data shards (pipeline.data_shards), each with its own
  opening of every source (in the order of `sources`), filling that shard's rows; by default this
  process's shard alone reads `sources`."""

  def __init__(self, sources: Sequence[OpenedSource], weights: Sequence[float], stages: Sequence[MixtureStage],
               seed: int, shard: HostShard, sharding: NamedSharding, global_batch: int, length: int, packing: bool,
               prefetch: int, pack: Callable[..., tuple[dict[str, np.ndarray], int]] = pack_batch,
               explain_empty: Callable[[], str | None] | None = None,
               shard_sources: Sequence[tuple[HostShard, Sequence[OpenedSource]]] | None = None):
    describe = "mixture of " + ", ".join(f"{s.name} ({s.describe})" for s in sources)
    shard_sources = list(shard_sources or [(shard, sources)])
    self.names = [s.name for s in sources]
    super().__init__(shard, sharding, global_batch, length, packing, prefetch, describe,
                     self._start(len(shard_sources)), [data_shard for data_shard, _ in shard_sources])
    self._weights, self._stages, self._seed, self._pack = tuple(weights), tuple(stages), seed, pack
    if all(s.size is not None for s in sources):
      self.source_size = {s.name: s.size for s in sources}
    self._cursors = [[DocumentCursor(s.read_from, s.max_empty_run, explain_empty=explain_empty) for s in opened]
                     for _, opened in shard_sources]
    self._batches = 0  # the next batch the producer makes
    self.total_tokens = dict.fromkeys(self.names, 0)  # target tokens per source handed out over the run
    self.last_tokens = dict.fromkeys(self.names, 0)

  def _start(self, count: int) -> tuple[MixturePosition, ...]:
    return tuple(MixturePosition(0, tuple(Position() for _ in self.names)) for _ in range(count))

  def _produce(self) -> tuple[dict[str, np.ndarray], tuple[MixturePosition, ...]]:
    probabilities = weights_at(self._batches, self._weights, self._stages)
    drawn = draw_sources(self._seed, self._batches, self.global_shape[0], probabilities)
    parts: list[dict[str, np.ndarray]] = []
    tokens = np.zeros(len(self.names), np.int64)
    for data_shard, cursors in zip(self.data_shards, self._cursors):
      mine = drawn[data_shard.index * data_shard.rows:(data_shard.index + 1) * data_shard.rows]
      rows: dict[str, np.ndarray] = {}
      for k, cursor in enumerate(cursors):
        picked = np.flatnonzero(mine == k)
        if not picked.size:
          continue
        try:
          part, _ = self._pack(cursor, picked.size, self._length, self._packing)
          cursor.settle()
        except UserError as e:  # e.g. a run of documents too short to train: which of the sources?
          if type(e) not in (UserError, ConfigError) or str(e).startswith("data_mixture source "):
            raise  # (a storage outage is the run's, not a source's)
          raise type(e)(f"data_mixture source {self.names[k]!r}: {e}") from None
        for name, values in part.items():
          if name not in rows:
            rows[name] = np.zeros((data_shard.rows, *values.shape[1:]), values.dtype)
          rows[name][picked] = values
        tokens[k] += int(np.count_nonzero(part["targets_segmentation"]))
      parts.append(rows)
    self._batches += 1
    position = tuple(MixturePosition(self._batches, tuple(c.position for c in cursors)) for cursors in self._cursors)
    batch = parts[0] if len(parts) == 1 else {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    mine = drawn[self.shard.index * self.shard.rows:(self.shard.index + 1) * self.shard.rows]
    return {**batch, "_num_real": np.asarray(self.shard.rows), "_tokens": tokens, "_source_of_row": mine}, position

  def __next__(self) -> dict[str, jax.Array]:
    batch = super().__next__()
    self.last_tokens = self._gather_tokens()
    for name, count in self.last_tokens.items():
      self.total_tokens[name] += count
    return batch

  def _gather_tokens(self) -> dict[str, int]:
    """Target tokens of each source in the batch just handed out, summed over the data shards
    (every process hands out every batch, so the gather lines up)."""
    mine = np.asarray(self.extras["_tokens"])
    if jax.process_count() > 1:
      rows = np.asarray(multihost_utils.process_allgather(np.concatenate([[self.shard.index], mine])))
      by_shard = {int(row[0]): row[1:] for row in rows.reshape(-1, len(mine) + 1)}  # replicas count once
      mine = np.sum(list(by_shard.values()), axis=0)
    return {name: int(count) for name, count in zip(self.names, mine)}

  def host_metrics(self) -> dict[str, float]:
    """The last batch's tokens per source and their totals over the run (the realised mixture)."""
    return {**{f"data/tokens/{name}": float(count) for name, count in self.last_tokens.items()},
            **{f"data/total_tokens/{name}": float(count) for name, count in self.total_tokens.items()}}

  def get_state(self) -> dict[str, Any]:
    return {**super().get_state(), "total_tokens": dict(self.total_tokens)}

  def set_state(self, state: dict[str, Any]) -> None:
    super().set_state(state)
    saved = state.get("total_tokens", {})
    try:
      self.total_tokens = {name: _count(saved.get(name, 0)) for name in self.names}
    except (AttributeError, ValueError):
      raise ConfigError(f"the checkpoint's data state is damaged: its total_tokens {saved!r} are not a whole number "
                        "per source; resume from another checkpoint step or delete this one") from None

  def describe_next_position(self) -> str:
    wheres = []
    for data_shard, position in zip(self.data_shards, self._position):
      where = ", ".join(f"{name} document {p.index} pair {p.offset}" for name, p in zip(self.names, position.sources))
      wheres.append(f"data shard {data_shard.index} of {data_shard.count}, batch {position.batches} ({where})")
    return "; ".join(wheres)

  def _restart(self, position: tuple[MixturePosition, ...] | None) -> None:
    position = position or self._start(len(self._cursors))
    self._batches = position[0].batches
    for cursors, shard_position in zip(self._cursors, position):
      for cursor, at in zip(cursors, shard_position.sources):
        cursor.seek(at)

  def _seek(self, position: tuple[MixturePosition, ...] | None) -> None:
    super()._seek(position or self._start(len(self._cursors)))

  def _split(self, position: tuple[MixturePosition, ...]) -> list[MixturePosition]:
    return list(position)

  def _join(self, positions: list[MixturePosition]) -> tuple[MixturePosition, ...]:
    if len({p.batches for p in positions}) > 1:
      raise ConfigError(f"the checkpoint's data position is damaged: data shards {[s.index for s in self.data_shards]} "
                        f"are at different batches {[p.batches for p in positions]}; resume from another checkpoint "
                        "step")
    return tuple(positions)

  def _position_ints(self, position: MixturePosition) -> list[int]:
    return [position.batches, *(x for p in position.sources for x in (p.index, p.offset))]

  def _shard_json(self, ints: list[int]) -> dict[str, Any]:
    sources = {name: {"index": ints[1 + 2 * k], "offset": ints[2 + 2 * k]} for k, name in enumerate(self.names)}
    return {"batches": ints[0], "sources": sources}

  def _position_of(self, shard_json: dict[str, Any]) -> MixturePosition:
    saved = shard_json.get("sources")
    if not isinstance(saved, dict) or sorted(saved) != sorted(self.names):
      had = sorted(saved) if isinstance(saved, dict) else "a single source"
      raise ConfigError(f"the checkpoint's data position is for {had}; this run mixes {sorted(self.names)}: "
                        "resume with the data_mixture it was saved with")
    # int() would take "7", 2.5 or true from a hand-edited state and seek somewhere else; a negative
    # number would fail inside the draw or the packer instead (set_state names the shard as damaged).
    return MixturePosition(_count(shard_json["batches"]),
                           tuple(Position(_count(saved[n]["index"]), _count(saved[n]["offset"])) for n in self.names))


def _count(value: object) -> int:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0):
    raise ValueError(f"{value!r} is not a whole number >= 0")
  return int(value)
