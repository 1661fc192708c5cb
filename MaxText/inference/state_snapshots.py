"""Prefix caching for recurrent decode states (Gated DeltaNet layers: Qwen3-Next, Qwen3.5).

A shared prefix page gives a later request the keys and values of its tokens, but a recurrent layer
keeps no per-token record: its state after the prefix is one array per slot. So the engine keeps
snapshots of a slot's recurrent states, taken where a prefill chunk ends on a page boundary and named
by the chain hash of the page that ends there (inference/prefix_cache.py: the hash covers every
token up to it). A request may share leading pages only up to a boundary with a snapshot; its
prefill then starts there from the snapshot's states instead of zeros. Snapshots live in a device
pool of `prefix_state_snapshots` rows per state array, reused least recently used first.

Host side: `SnapshotIndex` (digest -> pool row). Device side: `empty_pool`, `save` and `restore`,
pure functions of the caches tree, where every leaf that is not a page pool is slot state.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp

from MaxText.inference import paged_cache


class SnapshotIndex:
  """Chain hash of a page boundary -> the pool row holding the recurrent states there (LRU reuse)."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._row_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recently used first
    self._pinned: collections.Counter[int] = collections.Counter()  # rows a prompt will restore: never reused

  def has(self, digest: bytes) -> bool:
    return digest in self._row_of

  def lookup(self, digest: bytes) -> int | None:
    row = self._row_of.get(digest)
    if row is not None:
      self._row_of.move_to_end(digest)
    return row

  def reserve(self, digest: bytes) -> int | None:
    """The row to write the states at `digest` into: its own if it has one, else a free or the least recently
    used unpinned row (whose boundary is forgotten); None when every row is pinned."""
    row = self.lookup(digest)
    if row is not None:
      return row
    if len(self._row_of) < self.capacity:
      row = len(self._row_of)
    else:
      oldest = next((d for d, r in self._row_of.items() if not self._pinned[r]), None)
      if oldest is None:
        return None
      row = self._row_of.pop(oldest)
    self._row_of[digest] = row
    return row

  def pin(self, row: int) -> None:
    """A prompt will restore `row`: it is not reused until `unpin`."""
    self._pinned[row] += 1

  def unpin(self, row: int) -> None:
    self._pinned[row] -= 1

  def __len__(self) -> int:
    return len(self._row_of)


def _batch_axis(stacked: bool) -> int:
  return 1 if stacked else 0  # scanned layers stack their states on a leading layer dimension


def empty_pool(caches: Any, capacity: int, stacked: bool) -> Any:
  """Zero snapshot rows for every slot-state array of `caches` (abstract or real); None for page pools."""
  axis = _batch_axis(stacked)

  def rows(x: Any) -> Any:
    if paged_cache.is_pool(x):
      return None
    shape = list(x.shape)
    shape[axis] = capacity
    return jnp.zeros(shape, x.dtype)

  return jax.tree.map(rows, caches, is_leaf=paged_cache.is_pool)


def _copy_row(dst: jax.Array, src: jax.Array, src_row: jax.Array, dst_row: jax.Array, axis: int) -> jax.Array:
  one = jax.lax.dynamic_slice_in_dim(src, src_row, 1, axis=axis)
  return jax.lax.dynamic_update_slice_in_dim(dst, one.astype(dst.dtype), dst_row, axis=axis)


def save(pool: Any, caches: Any, slot: jax.Array, row: jax.Array, stacked: bool) -> Any:
  """`pool` with row `row` set to slot `slot`'s recurrent states in `caches`."""
  axis = _batch_axis(stacked)
  return jax.tree.map(lambda snapshots, x: None if snapshots is None else _copy_row(snapshots, x, slot, row, axis),
                      pool, caches, is_leaf=lambda x: x is None or paged_cache.is_pool(x))


def restore(caches: Any, pool: Any, slot: jax.Array, row: jax.Array, stacked: bool) -> Any:
  """`caches` with slot `slot`'s recurrent states set to the snapshot in row `row`."""
  axis = _batch_axis(stacked)
  return jax.tree.map(lambda x, snapshots: x if snapshots is None else _copy_row(x, snapshots, row, slot, axis),
                      caches, pool, is_leaf=paged_cache.is_pool)
