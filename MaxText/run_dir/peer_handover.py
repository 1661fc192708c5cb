"""The local tier's step for processes that lack it: their peers hand the regions over.

A process whose host was replaced, a slice that returns to an elastic run, or a host whose local
disk was wiped holds no copy of the newest local step that the others hold. When every region
such a process needs (its devices' shards under the current mesh) is held by some process that
has the step, the holders send those regions through the job's own collectives and every
process continues from that step, instead of all of them reading the older persistent tier.
Data-parallel replicas (an elastic run's slices) hold the same regions, so one surviving
replica is enough.

The plan needs no exchange of manifests: a process holds a step "whole" only when its files are
exactly the regions the current mesh gives it (`LocalTier.locate`), so every process can work
out from the shardings alone which regions each holder can send. The bytes travel as unsigned
integers (bit patterns, so -0.0 and NaN payloads arrive unchanged), one broadcast per sending
process in chunks of bounded size. Every process receives every broadcast (it is an all-reduce),
so a handover costs about one all-reduce of the regions sent: a resize's price, not a step's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.run_dir.local_checkpoints import MAX_STEPS_COMPARED, LocalTier, region_key

State = TypeVar("State")

_CHUNK_WORDS = 16 * 2**20  # 64 MiB of uint32 per broadcast: each local device holds a copy in flight

# Per leaf: process index -> the region keys (json of [[start, stop], ...]) its devices hold.
Needs = list[dict[int, list[str]]]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where the processes restore from: `step` of the local tier, held by `holders`; `lackers`
  receive the regions of `transfers` ((leaf, region key, sending process), in broadcast order)."""

  step: int
  holders: tuple[int, ...]
  lackers: tuple[int, ...] = ()
  transfers: tuple[tuple[int, str, int], ...] = ()

  def describe(self) -> str:
    """What the `state:` line adds after the tier's name ("" when every process held the step)."""
    if not self.lackers:
      return ""
    senders = sorted({source for _, _, source in self.transfers})
    return f"handed over to process(es) {_names(self.lackers)} by process(es) {_names(senders)}"


class HandoverFailed(Exception):
  """A holder could not read its regions; every process raises it together (`said_here`: this
  process was one of them and has printed its own line)."""

  def __init__(self, message: str, said_here: bool):
    super().__init__(message)
    self.said_here = said_here


def _names(indices: Iterable[int]) -> str:
  return ", ".join(map(str, indices))


def needs(abstract_state: object, shardings: object) -> Needs:
  """Per leaf, the distinct regions each process's devices hold under `shardings`."""
  out: Needs = []
  flat = jax.tree.leaves(abstract_state)
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  for leaf, sharding in zip(flat, flat_shardings):
    by_process: dict[int, list[str]] = {}
    for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
      key = region_key(index, tuple(leaf.shape))
      regions = by_process.setdefault(device.process_index, [])
      if key not in regions:
        regions.append(key)
    out.append(by_process)
  return out


def choose(held: list[list[int]], wanted: Needs, persistent_step: int | None) -> tuple[Plan | None, str]:
  """The newest local step every process can restore, newer than `persistent_step`: held by all,
  or by processes that together hold every region the others need. `held[p]`: the steps process
  p holds whole. Returns the plan (None: the persistent tier) and a line saying why a newer local
  step could not be used ("" when none was passed over)."""
  count = len(held)
  note = ""
  for step in sorted({s for steps in held for s in steps}, reverse=True):
    if persistent_step is not None and step <= persistent_step:
      break
    holders = tuple(p for p in range(count) if step in held[p])
    lackers = tuple(p for p in range(count) if p not in holders)
    if not lackers:
      return Plan(step, holders), note
    transfers, missing = _transfers(wanted, holders, lackers)
    if not missing:
      return Plan(step, holders, lackers, transfers), note
    note = note or (f"local checkpoint step {step} is held by process(es) {_names(holders)} only, which do not "
                    f"hold the regions process(es) {_names(missing)} need")
  return None, note


def _transfers(wanted: Needs, holders: tuple[int, ...], lackers: tuple[int, ...]
               ) -> tuple[tuple[tuple[int, str, int], ...], list[int]]:
  """The regions the lackers need, each from the first holder with it; and the lackers some of
  whose regions no holder has."""
  sent: dict[tuple[int, str], int] = {}
  missing: set[int] = set()
  for leaf, by_process in enumerate(wanted):
    for lacker in lackers:
      for key in by_process.get(lacker, []):
        if (leaf, key) in sent:
          continue
        source = next((h for h in holders if key in by_process.get(h, [])), None)
        if source is None:
          missing.add(lacker)
        else:
          sent[(leaf, key)] = source
  ordered = sorted(((leaf, key, source) for (leaf, key), source in sent.items()), key=lambda t: (t[2], t[0], t[1]))
  return tuple(ordered), sorted(missing)


def plan(tier: LocalTier, abstract_state: object, shardings: object, persistent_step: int | None
         ) -> tuple[Plan | None, str]:
  """`choose` over every process's local steps (collective: one all-gather)."""
  mine = tier.held_steps(shardings, abstract_state)
  padded = np.full(MAX_STEPS_COMPARED, -1, np.int64)
  padded[:len(mine)] = mine
  everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)
  held = [[int(s) for s in row if s >= 0] for row in everyone]
  return choose(held, needs(abstract_state, shardings), persistent_step)


def restore(tier: LocalTier, chosen: Plan, abstract_state: State, shardings: State
            ) -> tuple[State, Any, dict[str, Any]]:
  """(state, data state, meta) of `chosen.step` on every process (collective); HandoverFailed on
  every process when a holder could not read its regions."""
  me = jax.process_index()
  regions: list[dict[str, np.ndarray]] = []
  extra: tuple[Any, dict[str, Any]] = (None, {})
  error = ""
  if me in chosen.holders:
    try:
      regions, data_state, meta = tier.read_regions(chosen.step, abstract_state, shardings)
      extra = (data_state, meta)
    except Exception as e:  # noqa: BLE001 - a damaged copy: every process falls back together
      error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
      print(f"warning: local checkpoint step {chosen.step} on process {me} is unreadable ({error}); using the "
            "persistent tier", flush=True)
  failed = np.asarray(multihost_utils.process_allgather(np.int32(bool(error)))).reshape(-1)
  if failed.any():
    raise HandoverFailed(f"local checkpoint step {chosen.step} is unreadable on process(es) "
                         f"{_names(np.flatnonzero(failed).tolist())}", bool(error))
  leaves = jax.tree.leaves(abstract_state)
  received = _send(chosen, regions, [np.dtype(leaf.dtype) for leaf in leaves], me in chosen.lackers)
  if me in chosen.lackers:
    regions = received
  data_state, meta = json.loads(_broadcast_bytes(json.dumps(extra).encode(), me == chosen.holders[0]).decode())
  return _assemble(abstract_state, shardings, regions), data_state, meta or {}


def _region_shape(key: str) -> tuple[int, ...]:
  return tuple(stop - start for start, stop in json.loads(key))


def _send(chosen: Plan, mine: list[dict[str, np.ndarray]], dtypes: list[np.dtype[Any]], keep: bool
          ) -> list[dict[str, np.ndarray]]:
  """Every transfer's region, one broadcast (in chunks) per sending process; kept when `keep`."""
  out: list[dict[str, np.ndarray]] = [{} for _ in dtypes]
  me = jax.process_index()
  for source in sorted({s for _, _, s in chosen.transfers}):
    items = [(leaf, key) for leaf, key, s in chosen.transfers if s == source]
    sizes = [int(np.prod(_region_shape(key))) * dtypes[leaf].itemsize for leaf, key in items]
    payload = (b"".join(np.ascontiguousarray(mine[leaf][key]).tobytes() for leaf, key in items)
               if me == source else b"")
    got = _broadcast_bytes(payload, me == source, sum(sizes))
    if not keep:
      continue
    offset = 0
    for (leaf, key), size in zip(items, sizes):
      region = np.frombuffer(got[offset:offset + size], dtype=dtypes[leaf]).reshape(_region_shape(key))
      out[leaf][key] = region
      offset += size
  return out


def _broadcast_bytes(payload: bytes, is_source: bool, size: int | None = None) -> bytes:
  """`payload` of the source process on every process, as uint32 words (bit-exact); `size`, when
  every process knows it, saves broadcasting the length first."""
  if size is None:
    size = int(multihost_utils.broadcast_one_to_all(np.asarray([len(payload)], np.int32), is_source=is_source)[0])
  words = np.zeros((size + 3) // 4, np.uint32)
  if is_source:
    words.view(np.uint8)[:size] = np.frombuffer(payload, np.uint8)
  out = np.empty_like(words)
  for start in range(0, len(words), _CHUNK_WORDS):
    chunk = words[start:start + _CHUNK_WORDS]
    out[start:start + len(chunk)] = multihost_utils.broadcast_one_to_all(chunk, is_source=is_source)
  return out.view(np.uint8)[:size].tobytes()


def _assemble(abstract_state: State, shardings: State, regions: list[dict[str, np.ndarray]]) -> State:
  flat, treedef = jax.tree.flatten(abstract_state)
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  arrays = []
  for leaf, sharding, by_key in zip(flat, flat_shardings, regions):
    pieces = [jax.device_put(by_key[region_key(index, tuple(leaf.shape))], device)
              for device, index in sharding.addressable_devices_indices_map(tuple(leaf.shape)).items()]
    arrays.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, pieces))
  return jax.tree.unflatten(treedef, arrays)
