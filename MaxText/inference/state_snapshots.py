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
`RecurrentSnapshots` is the part the engine composes with its paged cache when prefix caching
meets a model with recurrent layers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from MaxText.configuration.model_config import ModelConfig
from MaxText.inference import image_prompts, paged_cache
from MaxText.inference.decode_state import Caches, DecodeState


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


def empty_pool(caches: Caches, capacity: int, stacked: bool) -> Caches:
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


def save(pool: Caches, caches: Caches, slot: jax.Array, row: jax.Array, stacked: bool) -> Caches:
  """`pool` with row `row` set to slot `slot`'s recurrent states in `caches`."""
  axis = _batch_axis(stacked)
  return jax.tree.map(lambda snapshots, x: None if snapshots is None else _copy_row(snapshots, x, slot, row, axis),
                      pool, caches, is_leaf=lambda x: x is None or paged_cache.is_pool(x))


def restore(caches: Caches, pool: Caches, slot: jax.Array, row: jax.Array, stacked: bool) -> Caches:
  """`caches` with slot `slot`'s recurrent states set to the snapshot in row `row`."""
  axis = _batch_axis(stacked)
  return jax.tree.map(lambda x, snapshots: x if snapshots is None else _copy_row(x, snapshots, row, slot, axis),
                      caches, pool, is_leaf=paged_cache.is_pool)


def has_recurrent_state(cfg: ModelConfig) -> bool:
  """Whether some layer of the model keeps a recurrent decode state (Gated DeltaNet) beside or instead of a KV cache."""
  return cfg.linear_attn.full_attention_interval > 1 or cfg.attn.attention_type == "gated_deltanet"


class RecurrentSnapshots:
  """Prefix caching's part for a model with recurrent layers (paged cache): the host index, the device pool,
  and what begin_prompt / prefill_chunk do with them. `pages` gives the decode state's allocator."""

  def __init__(self, capacity: int, pages: Callable[[], paged_cache.PageAllocator], abstract_caches: Caches,
               stacked: bool, state_shardings: DecodeState):
    self.capacity, self._pages = capacity, pages
    self.index = SnapshotIndex(capacity)
    self._restore_rows: dict[int, tuple[int, int]] = {}  # slot -> (where its prefill starts, snapshot row)
    self._pool = empty_pool(abstract_caches, capacity, stacked)
    self._save = jax.jit(functools.partial(save, stacked=stacked), donate_argnums=(0,))
    self._restore = jax.jit(lambda state, pool, slot, row: dataclasses.replace(
        state, caches=restore(state.caches, pool, slot, row, stacked)), donate_argnums=(0,),
        out_shardings=state_shardings)

  def reset(self) -> None:
    """A new decode state: the snapshots named pages of the old allocator's index."""
    self.index = SnapshotIndex(self.capacity)
    self._restore_rows.clear()

  def usable_pages(self, prompt: Sequence[int], salts: Mapping[int, bytes] | None, matched: int) -> int:
    """Of `matched` leading shared pages, how many end at a boundary whose recurrent states were kept."""
    pages = self._pages()
    assert pages.index is not None
    digests = pages.index.chain(prompt, matched, salts)
    return next((n for n in range(matched, 0, -1) if self.index.has(digests[n - 1])), 0)

  def forget(self, slot: int) -> None:
    """The slot no longer waits to restore a snapshot (restored, released or given another prompt)."""
    waiting = self._restore_rows.pop(slot, None)
    if waiting is not None:
      self.index.unpin(waiting[1])

  def begin(self, slot: int, prompt: Sequence[int], start: int, salts: Mapping[int, bytes] | None) -> None:
    """The slot's prompt shares `start` tokens' pages (only up to a boundary with a snapshot): its first chunk
    starts from that snapshot."""
    self.forget(slot)
    if start:
      row = self.index.lookup(self._digest(prompt, start, salts))
      assert row is not None
      self.index.pin(row)  # other prompts' chunks may not reuse it before this one's first chunk
      self._restore_rows[slot] = (start, row)

  def before_chunk(self, state: DecodeState, slot: int, prompt: Sequence[int], start: int, end: int,
                   runs: Sequence[tuple[int, int]]) -> tuple[DecodeState, int]:
    """(state with the shared prefix's recurrent states where the chunk starts from one, where the chunk ends:
    at the prompt's last page boundary when it crosses it, so the states there are kept for later prompts)."""
    waiting = self._restore_rows.get(slot)
    if waiting is not None and waiting[0] == start:
      state = self._restore(state, self._pool, jnp.int32(slot), jnp.int32(waiting[1]))
    self.forget(slot)
    return state, self.chunk_end(prompt, start, end, runs)

  def chunk_end(self, prompt: Sequence[int], start: int, end: int, runs: Sequence[tuple[int, int]]) -> int:
    """Where a chunk over prompt[start:end] ends: at the prompt's last page boundary when it crosses it."""
    page_size = self._pages().page_size
    boundary = len(prompt) // page_size * page_size
    if start < boundary < end and image_prompts.chunk_end(start, boundary, runs) > start:
      return image_prompts.chunk_end(start, boundary, runs)
    return end

  def after_chunk(self, caches: Caches, slot: int, prompt: Sequence[int], end: int,
                  salts: Mapping[int, bytes] | None) -> None:
    """A chunk ending on a page boundary: the slot's recurrent states there, kept."""
    if end % self._pages().page_size:
      return
    kept = self.index.reserve(self._digest(prompt, end, salts))
    if kept is not None:
      self._pool = self._save(self._pool, caches, jnp.int32(slot), jnp.int32(kept))

  def _digest(self, prompt: Sequence[int], end: int, salts: Mapping[int, bytes] | None) -> bytes:
    """The chain hash of the page that ends at token `end` (a page boundary) of `prompt`."""
    pages = self._pages()
    assert pages.index is not None
    return pages.index.chain(prompt, end // pages.page_size, salts)[-1]
