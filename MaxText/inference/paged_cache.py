"""The engine's paged KV cache (kv_cache_layout=paged): the host-side page allocator and the
model-wide pools (one paged_kv.PagedKVCache per layer, stacked like the dense caches).

Shape legend: T slots, P pages per layer, Z tokens per page, M pages per slot
(ceil(max_target_length / Z)), L padded prompt length.

The allocator's block table [T, M] is the truth; the engine hands it to every jitted step as an
argument (the same shape every time, so nothing recompiles) and `with_block_table` copies it
into each layer's cache. Every layer uses the same page numbers, so one table serves the model.

- `assign` (Engine.insert): the slot's old pages go back, then ceil(prompt / Z) pages.
- `grow` (before each Engine.generate): a slot whose pending token starts a new page gets one.
- `release` (Engine.release): the slot's pages go back to the free list.
Running out raises OutOfPages before anything changes, so the caller can release a slot and
retry; `engine.serve` instead admits a request only when the pages it will need are free.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.errors import UserError
from MaxText.inference import image_prompts, prefix_cache
from MaxText.inference.decode_state import Caches
from MaxText.layers import gated_deltanet, kv_cache, paged_kv
from MaxText.configuration.model_config import ModelConfig


class OutOfPages(UserError):
  """No free page for a prompt or a growing slot (nothing was changed)."""


def pages_per_slot(max_length: int, page_size: int) -> int:
  return math.ceil(max_length / page_size)


class _FreePages:
  """The free list: the pages handed back (the last one first), then the never-used ones lowest first, as a
  list of every page reversed would pop them; the never-used ones are a count, not a list (kv_num_pages=10**9
  made a Python list the host could not hold, and the process was killed)."""

  def __init__(self, num_pages: int):
    self._returned: list[int] = []
    self._next, self._end = 0, num_pages

  def __len__(self) -> int:
    return len(self._returned) + self._end - self._next

  def __iter__(self) -> Iterator[int]:  # the list's order: the never-used pages highest first, then those handed back
    yield from range(self._end - 1, self._next - 1, -1)
    yield from self._returned

  def __getitem__(self, index: slice) -> list[int]:
    return list(self)[index]

  def __eq__(self, other: object) -> bool:
    return list(self) == (list(other) if isinstance(other, (list, _FreePages)) else other)

  def append(self, page: int) -> None:
    self._returned.append(page)

  def pop(self) -> int:
    if self._returned:
      return self._returned.pop()
    if self._next >= self._end:
      raise IndexError("pop from an empty free list")
    self._next += 1
    return self._next - 1


class PageAllocator:
  """Free list and block table of one decode state's page pool (host side, numpy); with
  `prefix_caching`, full prompt pages are shared between slots by reference count
  (inference/prefix_cache.py)."""

  def __init__(self, num_pages: int, page_size: int, num_slots: int, max_length: int, prefix_caching: bool = False):
    self.num_pages, self.page_size, self.max_length = num_pages, page_size, max_length
    self.table = np.full((num_slots, pages_per_slot(max_length, page_size)), -1, np.int32)
    self.free = _FreePages(num_pages)
    self.refs = np.zeros(num_pages, np.int32)  # slots whose table names the page
    self.index = prefix_cache.PrefixIndex(page_size) if prefix_caching else None
    self.positions = np.zeros(num_slots, np.int64)  # where each slot's pending token is written
    self.active = np.zeros(num_slots, bool)
    # (prompt, salts, matched page count) -> how many of them a request may share; None: all. A model with
    # recurrent layers shares only up to a page boundary where it kept their states (state_snapshots.py).
    self.usable_pages: Callable[[Sequence[int], Mapping[int, bytes] | None, int], int] | None = None

  def _match(self, prompt: Sequence[int], prompt_length: int, salts: Mapping[int, bytes] | None = None,
             runs: Sequence[tuple[int, int]] = ()) -> list[int]:
    """The indexed pages a prompt may share: its leading full pages (one token always left to compute), never
    ending inside an image run, and only as many as `usable_pages` allows."""
    assert self.index is not None
    shared = self.index.match(prompt, (prompt_length - 1) // self.page_size, salts)
    shared = shared[:image_prompts.whole_runs_start(len(shared) * self.page_size, runs, self.page_size)
                    // self.page_size]
    if shared and self.usable_pages is not None:
      shared = shared[:self.usable_pages(prompt, salts, len(shared))]
    return shared

  def pages_for(self, tokens: int) -> int:
    """Pages that hold `tokens` cached tokens (capped at max_target_length)."""
    return math.ceil(min(tokens, self.max_length) / self.page_size)

  def held(self, slot: int) -> int:
    return int((self.table[slot] >= 0).sum())

  def shared_held(self, prompt: Sequence[int]) -> int:
    """Leading full pages of a text prompt that `assign` would share with a slot holding them now
    (admission counts such a page once; an unheld cached page is an allocation like a free one)."""
    if self.index is None or not prompt:
      return 0
    return sum(1 for page in self._match(prompt, len(prompt)) if self.refs[page] > 0)

  def committed(self, final_pages: Mapping[int, int]) -> int:
    """Pages held now, a shared one once, plus what each slot of `final_pages` (slot -> pages it
    holds at its end) will still take: what admission must keep free for the running requests."""
    return int((self.refs > 0).sum()) + sum(max(0, final - self.held(slot)) for slot, final in final_pages.items())

  def available(self) -> int:
    """Pages a slot can be given now: free ones and indexed ones nobody holds (evicted on demand)."""
    return len(self.free) + (self.index.parked if self.index is not None else 0)

  def assign(self, slot: int, prompt_length: int, active: bool = True, prompt: Sequence[int] | None = None,
             salts: Mapping[int, bytes] | None = None, runs: Sequence[tuple[int, int]] = ()) -> int:
    """Pages for a prompt of `prompt_length` tokens in `slot` (its previous pages freed first);
    returns how many leading prompt tokens are already cached (shared prefix pages, with
    prefix caching and the prompt's tokens given; at least one token is always left to compute).
    `active=False`: the prompt is still being prefilled in chunks; `activate` once it is cached.
    An image prompt gives its pages' `salts` and image `runs`: no shared prefix ends inside a run."""
    shared = self._match(prompt, prompt_length, salts, runs) if self.index is not None and prompt is not None else []
    need = self.pages_for(prompt_length) - len(shared)
    releasable = sum(1 for p in self.table[slot] if p >= 0 and self.refs[p] == 1)
    parked_shared = sum(1 for p in shared if self.index is not None and self.index.is_parked(p))
    if need > self.available() - parked_shared + releasable:
      raise OutOfPages(f"out of KV pages: a prompt of {prompt_length} tokens needs {need} pages of {self.page_size} "
                       f"tokens, {self.available()} are free of kv_num_pages={self.num_pages}; release a slot "
                       "first or raise kv_num_pages")
    self.release(slot)
    for index, page in enumerate(shared):
      self._hold(slot, index, page)
    for index in range(len(shared), len(shared) + need):
      self._hold(slot, index, self._take())
    self.positions[slot], self.active[slot] = prompt_length, active
    return len(shared) * self.page_size

  def extend(self, slot: int, length: int) -> int:
    """A slot that stopped generating (`active` False) grows to hold `length` tokens: its pages stay and
    new ones are taken for the rest. Returns where prefilling the new tokens starts: the position of
    its pending token (sampled, not yet cached); `activate` once they are cached."""
    start = int(self.positions[slot])
    if self.active[slot] or not start < length <= self.max_length:
      raise ValueError(f"slot {slot} (active={bool(self.active[slot])}, at {start}) cannot be extended to {length}")
    missing = [index for index in range(self.pages_for(length)) if self.table[slot, index] < 0]
    if len(missing) > self.available():
      raise OutOfPages(f"out of KV pages: {length} tokens need {len(missing)} more pages of {self.page_size} tokens, "
                       f"{self.available()} are free of kv_num_pages={self.num_pages}; raise kv_num_pages")
    for index in missing:
      self._hold(slot, index, self._take())
    self.positions[slot] = length
    return start

  def activate(self, slot: int, prompt: Sequence[int] | None = None, salts: Mapping[int, bytes] | None = None) -> None:
    """The slot's prompt is cached: it generates from the next step on, and with prefix caching
    its full pages are indexed for the requests after it."""
    self.active[slot] = True
    if self.index is not None and prompt is not None:
      self.index.register(prompt, [int(p) for p in self.table[slot]], salts)

  def generate_table(self) -> np.ndarray:
    """The block table a generate step sees: a slot still prefilling shows no pages, so the step
    (which advances every slot) writes nothing into the pages its prompt is filling."""
    return np.where(self.active[:, None], self.table, -1).astype(np.int32)

  def grow(self, ahead: int = 1, ends: np.ndarray | None = None) -> None:
    """Before a generate step: pages for every active slot's next `ahead` positions from its
    pending token's (1 for a generate step, k + 1 for a speculative round), up to max_length and,
    with `ends` [T], short of position ends[t] - 1 (a request's last token is never written)."""
    caps = np.full(len(self.positions), self.max_length, np.int64)
    if ends is not None:
      caps = np.minimum(caps, np.asarray(ends, np.int64) - 1)
    starting = [(int(slot), index) for slot in np.flatnonzero(self.active) if self.positions[slot] < caps[slot]
                for index in range(int(self.positions[slot]) // self.page_size,
                                   (min(int(self.positions[slot]) + ahead, int(caps[slot])) - 1) // self.page_size + 1)
                if self.table[slot, index] < 0]
    if len(starting) > self.available():
      raise OutOfPages(f"out of KV pages: {len(starting)} slots need a new page, {self.available()} are free of "
                       f"kv_num_pages={self.num_pages}; release a slot first or raise kv_num_pages")
    for slot, index in starting:
      self._hold(slot, index, self._take())

  def advance(self, steps: int | np.ndarray = 1) -> None:
    """After a generate step: every active slot cached one more token (or, a speculative round,
    each its own number: `steps` [T])."""
    self.positions[self.active] += np.broadcast_to(np.asarray(steps, np.int64), self.positions.shape)[self.active]

  def release(self, slot: int) -> None:
    """The slot's pages: each one nobody else holds goes back to the free list, or, indexed, is
    kept for a later prompt with the same prefix."""
    for page in (int(p) for p in self.table[slot][::-1] if p >= 0):
      self.refs[page] -= 1
      if self.refs[page] == 0:
        if self.index is not None and self.index.holds(page):
          self.index.park(page)
        else:
          self.free.append(page)
    self.table[slot] = -1
    self.positions[slot], self.active[slot] = 0, False

  def stats(self) -> dict[str, int]:
    available = self.available()
    return {"pages_total": self.num_pages, "pages_free": available, "pages_used": self.num_pages - available,
            "pages_cached": self.index.parked if self.index is not None else 0, "page_size": self.page_size}

  def _take(self) -> int:
    if self.free:
      return self.free.pop()
    assert self.index is not None and self.index.parked, "callers check available() first"
    return self.index.evict()

  def _hold(self, slot: int, index: int, page: int) -> None:
    if self.index is not None:
      self.index.unpark(page)
    self.refs[page] += 1
    self.table[slot, index] = page


def admission_pages(pages: PageAllocator, reserved: Mapping[int, int], prompt: Sequence[int], need: int,
                    text_only: bool) -> int:
  """Pages the running requests (`reserved`: slot -> pages held at its end) and a new one needing
  `need` pages commit, prefix pages shared with a running request counted once (an image prompt's
  sharing is not predicted: it counts whole)."""
  return pages.committed(reserved) + need - (pages.shared_held(prompt) if text_only else 0)


def layer_pool(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, quantized: bool
               ) -> paged_kv.PagedKVCache:
  """One layer's empty pool; MLA pages its compressed cache (latents and rope keys, K = 1)."""
  per_slot = pages_per_slot(cfg.max_target_length, page_size)
  dtype = jnp.dtype(cfg.dtype)
  if cfg.attn.attention_type != "mla":
    return paged_kv.empty_pool(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, num_slots, per_slot,
                               quantized)
  latent = paged_kv.empty_pool(num_pages, page_size, 1, cfg.mla.kv_lora_rank, dtype, num_slots, per_slot, quantized)
  groups = kv_cache.mla_row_groups(cfg)  # rope key (and indexer key): a scale each
  rope = paged_kv.empty_pool(num_pages, page_size, 1, sum(groups), dtype, num_slots, per_slot, quantized, len(groups))
  return paged_kv.PagedKVCache(latent.key_KPZH, rope.value_KPZH, latent.block_table_BM, latent.key_scale_KPZ1,
                               rope.value_scale_KPZU)


def model_pools(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, quantized: bool) -> Any:
  """Every layer's pool, in the structure of kv_cache.model_caches."""
  # A Gated DeltaNet layer's state is fixed-size per slot: slot state, not pages.
  return kv_cache.layer_caches(cfg, lambda own: gated_deltanet.empty_state(own, num_slots) if kv_cache.is_linear(own)
                               else layer_pool(own, num_pages, page_size, num_slots, quantized))


def model_pool_names(cfg: ModelConfig, quantized: bool) -> Any:
  one = paged_kv.empty_pool(1, 1, 1, 1, jnp.float32, 1, 1, quantized)
  return kv_cache.layer_cache_names(cfg, paged_kv.logical_names(one, stacked=cfg.scan_layers))


def is_pool(x: object) -> bool:
  return isinstance(x, paged_kv.PagedKVCache)


def with_block_table(pools: Caches, table_TM: jax.Array) -> Caches:
  """Every layer's cache with a block table (broadcast over a stacked layer dim): the allocator's
  [T, M] for a generate step, or one slot's row [1, M] for a prefill chunk."""
  def put(cache: Any) -> Any:
    if not is_pool(cache):  # a Gated DeltaNet layer's state array: no pages
      return cache
    leading = cache.block_table_BM.shape[:-2]
    return dataclasses.replace(cache, block_table_BM=jnp.broadcast_to(table_TM, leading + table_TM.shape))

  return jax.tree.map(put, pools, is_leaf=is_pool)


def insert_prefix(pools: Caches, prefix_caches: Caches, row: jax.Array, slot: jax.Array, table_row_M: jax.Array,
                  stacked: bool) -> Any:
  """The pools with prompt `row` of the prefill's dense caches (length L) copied into the pages
  of `table_row_M` (stored values as they are: int8 stays int8); entries without a page dropped.
  A Gated DeltaNet layer's state (slot state, no pages) is copied from `row` into `slot`."""

  def one_layer(pool: paged_kv.PagedKVCache, cache: kv_cache.KVCache) -> paged_kv.PagedKVCache:
    length = cache.length
    page_1L, offset_1L = paged_kv.page_addresses(table_row_M[None], jnp.arange(length)[None],
                                                 pool.key_KPZH.shape[1], pool.page_size)

    def put(pool_leaf: jax.Array, cache_leaf: jax.Array) -> jax.Array:  # the prompt's tokens [1, L, K, X]
      return paged_kv.scatter(pool_leaf, jax.lax.dynamic_slice_in_dim(cache_leaf, row, 1, axis=0), page_1L,
                              offset_1L)

    return dataclasses.replace(pool, **{name: put(getattr(pool, name), dense)
                           for name, dense in zip(_FIELDS, cache.tokens()) if dense is not None})

  layer = jax.vmap(one_layer) if stacked else one_layer
  batch_axis = 1 if stacked else 0

  def one(pool: Any, cache: Any) -> Any:
    if is_pool(pool):
      return layer(pool, cache)
    return put_slot(pool, jax.lax.dynamic_slice_in_dim(cache, row, 1, axis=batch_axis), slot, stacked)
  return jax.tree.map(one, pools, prefix_caches, is_leaf=is_pool)


def put_slot(state: jax.Array, rows_1: jax.Array, slot: jax.Array, stacked: bool) -> jax.Array:
  """`state` (a slot-state array [T, ...], [layers, T, ...] when stacked) with slot `slot` set to `rows_1`."""
  start: list[Any] = [0] * state.ndim
  start[1 if stacked else 0] = slot
  return jax.lax.dynamic_update_slice(state, rows_1.astype(state.dtype), start)


def slot_states(caches: Caches, slot: jax.Array, stacked: bool) -> Caches:
  """`caches` with each slot-state array (a Gated DeltaNet layer's) cut to slot `slot` (batch 1); pools as they are."""
  return jax.tree.map(lambda c: c if is_pool(c) else jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=1 if stacked else 0),
                      caches, is_leaf=is_pool)


def with_slot_states(caches: Caches, one_slot: Caches, slot: jax.Array, stacked: bool) -> Caches:
  """`caches` (all slots) with `slot_states`' slot `slot` put back from `one_slot`; pools from `one_slot`."""
  return jax.tree.map(lambda big, one: one if is_pool(one) else put_slot(big, one, slot, stacked), caches, one_slot,
                      is_leaf=is_pool)


def rows_states(caches: Caches, slots_B: jax.Array, stacked: bool) -> Caches:
  """`caches` with each slot-state array cut to the slots of `slots_B` (batch B; a slot out of range reads
  the last one, its row's updates dropped by `with_rows_states`); pools as they are."""
  return jax.tree.map(lambda c: c if is_pool(c) else jnp.take(c, slots_B, axis=1 if stacked else 0, mode="clip"),
                      caches, is_leaf=is_pool)


def with_rows_states(caches: Caches, rows: Caches, slots_B: jax.Array, stacked: bool) -> Caches:
  """`caches` (all slots) with `rows_states`' rows put back into their slots (rows of slots out of range
  dropped); pools from `rows`."""
  def put(big: Any, new: Any) -> Any:
    if is_pool(new):
      return new
    index = (slice(None), slots_B) if stacked else (slots_B,)
    return big.at[index].set(new.astype(big.dtype), mode="drop")
  return jax.tree.map(put, caches, rows, is_leaf=is_pool)


def keep_inactive_states(new: Caches, old: Caches, active_T: jax.Array, stacked: bool) -> Caches:
  """`new` caches with each slot-state array's inactive slots (no pages in the step's table: free, or a
  prompt still being prefilled in chunks) kept as in `old`: a generate step advances every slot."""
  def keep(n: Any, o: Any) -> Any:
    if is_pool(n):
      return n
    shape = [1] * n.ndim
    shape[1 if stacked else 0] = -1
    return jnp.where(active_T.reshape(shape), n, o)
  return jax.tree.map(keep, new, old, is_leaf=is_pool)


_FIELDS = ("key_KPZH", "value_KPZH", "key_scale_KPZ1", "value_scale_KPZU")  # in KVCache.tokens' order


def cache_bytes(caches: Caches) -> int:
  """Bytes of the cache arrays (block tables included)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
