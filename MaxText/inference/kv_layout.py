"""The engine's KV cache as one interface with two layouts (kv_cache_layout): `DenseLayout` keeps
[T, S] per layer and slot, `PagedLayout` a pool of pages per layer with a host-side allocator
(inference/paged_cache.py). `make` is the one place that picks a layout; the engine and the
speculative decoders call the interface and never ask which layout it is.

Shape legend (as engine.py): T slots, S max_target_length, M pages per slot.

Host side: `admit` before an insert (paged: the prompt's pages), `step_table` before a step (paged:
pages for each active slot's next positions, the block table the jitted step takes), `advance`
after it, `release` when a request ends. Traced side (inside the engine's jitted bodies):
`empty_caches`, `insert` (a prefill row into a slot), `with_table` and `keep_inactive` around a step.
Prompts prefilled straight into pages (chunked prefill, prefix caching) need `prompt_pages`, which
only the paged layout has; the dense one refuses in one line.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.configuration.decode_config import DecodeConfig
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import UserError
from MaxText.inference import paged_cache
from MaxText.inference.decode_state import Caches
from MaxText.layers import kv_cache


class KVLayout(abc.ABC):
  """The interface: one implementation per layout."""

  name: str
  prefix_caching = False  # full prompt pages shared between requests
  prefills_into_pages = False  # prompts go in through begin_prompt / prefill_chunk

  def __init__(self, cfg: ModelConfig, num_slots: int, quantized: bool):
    self.cfg, self.num_slots, self.quantized = cfg, num_slots, quantized
    # (prompt, salts, matched pages) -> how many a request may share (state_snapshots.py); set by the engine.
    self.usable_pages: Callable[[Sequence[int], Mapping[int, bytes] | None, int], int] | None = None

  @abc.abstractmethod
  def reset(self) -> None:
    """A new decode state: nothing held."""

  @abc.abstractmethod
  def admit(self, slot: int, lengths_B: jax.Array | np.ndarray, row: int) -> np.ndarray | None:
    """Before an insert of prompt `row` (of a prefill's rows of `lengths_B` tokens) into `slot`: the
    insert's extra argument (host values: a jitted call takes them without a dispatch of their own)."""

  @abc.abstractmethod
  def abstract_table(self, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct | None:
    """step_table's block table as a shape laid out by `sharding` (None: none), for an ahead-of-time compile."""

  @abc.abstractmethod
  def step_table(self, ahead: int = 1, ends: np.ndarray | None = None) -> np.ndarray | None:
    """Before a step writing each active slot's next `ahead` positions (with `ends` [T]: short of
    position ends[t] - 1, where a request stops): the block table it takes."""

  @abc.abstractmethod
  def advance(self, steps: int | np.ndarray = 1) -> None:
    """After a step: each active slot cached `steps` more tokens."""

  @abc.abstractmethod
  def release(self, slot: int) -> None:
    """The slot's request is done."""

  @abc.abstractmethod
  def active_slots(self) -> np.ndarray:
    """The slots a step generates for."""

  @abc.abstractmethod
  def held(self, slot: int) -> int:
    """Pages the slot holds."""

  @abc.abstractmethod
  def prefilling(self, slot: int) -> bool:
    """Whether the slot's prompt is still being prefilled into its pages."""

  @abc.abstractmethod
  def pages_needed(self, num_tokens: int) -> int: ...

  @abc.abstractmethod
  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool
                      ) -> int: ...

  @abc.abstractmethod
  def stats(self) -> dict[str, int]: ...

  @abc.abstractmethod
  def prompt_pages(self) -> paged_cache.PageAllocator:
    """The allocator that prompts prefilled into pages (begin_prompt, prefill_chunk) take pages from."""

  @property
  @abc.abstractmethod
  def pages(self) -> paged_cache.PageAllocator | None:
    """The page allocator (None: no pages)."""

  @abc.abstractmethod
  def empty_caches(self) -> Caches:
    """Every layer's empty cache for all slots (traced)."""

  @abc.abstractmethod
  def logical_names(self) -> Any: ...

  @abc.abstractmethod
  def insert(self, caches: Caches, prefix_caches: Caches, slot: jax.Array, row: jax.Array,
             admitted: jax.Array | None) -> Caches:
    """`caches` with prompt `row` of a prefill's caches (length L) in `slot` (traced)."""

  @abc.abstractmethod
  def with_table(self, caches: Caches, table_TM: jax.Array | None) -> Caches:
    """The caches a step attends over (traced)."""

  @abc.abstractmethod
  def keep_inactive(self, new: Caches, old: Caches, table_TM: jax.Array | None) -> Caches:
    """`new` after a step, with what the step must not change in slots without pages kept from `old` (traced)."""


class DenseLayout(KVLayout):
  """kv_cache_layout=dense: every slot owns max_target_length positions of every layer."""

  name = "dense"

  # ---------------------------------------------------------------- host side
  def reset(self) -> None:
    pass

  def admit(self, slot: int, lengths_B: jax.Array | np.ndarray, row: int) -> np.ndarray | None:
    return None  # nothing to read: the lengths stay on the device

  def abstract_table(self, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct | None:
    return None

  def step_table(self, ahead: int = 1, ends: np.ndarray | None = None) -> np.ndarray | None:
    return None

  def advance(self, steps: int | np.ndarray = 1) -> None:
    pass

  def release(self, slot: int) -> None:
    pass

  def active_slots(self) -> np.ndarray:
    """The slots a step generates for (dense: every slot, free or not)."""
    return np.ones(self.num_slots, bool)

  def held(self, slot: int) -> int:
    return 0

  def prefilling(self, slot: int) -> bool:
    return False

  def pages_needed(self, num_tokens: int) -> int:
    return 0

  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool) -> int:
    return 0

  def stats(self) -> dict[str, int]:
    return {"pages_total": 0, "pages_free": 0, "pages_used": 0}

  def prompt_pages(self) -> paged_cache.PageAllocator:
    raise UserError("chunked prefill needs kv_cache_layout=paged")

  @property
  def pages(self) -> paged_cache.PageAllocator | None:
    return None

  # ---------------------------------------------------------------- traced side
  def empty_caches(self) -> Caches:
    return kv_cache.model_caches(self.cfg, self.num_slots, self.cfg.max_target_length, self.quantized)

  def logical_names(self) -> Any:
    return kv_cache.model_cache_names(self.cfg, self.quantized)

  def insert(self, caches: Caches, prefix_caches: Caches, slot: jax.Array, row: jax.Array,
             admitted: jax.Array | None) -> Caches:
    batch_axis = 1 if self.cfg.scan_layers else 0  # stacked caches carry a leading layer dim

    def put(big: jax.Array, small: jax.Array) -> jax.Array:
      one_row = jax.lax.dynamic_slice_in_dim(small, row, 1, axis=batch_axis)
      start: list[Any] = [0] * big.ndim
      start[batch_axis] = slot
      return jax.lax.dynamic_update_slice(big, one_row.astype(big.dtype), start)

    return jax.tree.map(put, caches, prefix_caches)

  def with_table(self, caches: Caches, table_TM: jax.Array | None) -> Caches:
    return caches

  def keep_inactive(self, new: Caches, old: Caches, table_TM: jax.Array | None) -> Caches:
    return new


class PagedLayout(KVLayout):
  """kv_cache_layout=paged: one allocator per decode state (the engine's last init_decode_state)."""

  name = "paged"

  def __init__(self, cfg: ModelConfig, num_slots: int, quantized: bool, page_size: int, num_pages: int,
               prefix_caching: bool, prefill_chunk_size: int):
    super().__init__(cfg, num_slots, quantized)
    self.page_size, self.prefix_caching = page_size, prefix_caching
    # In chunks, or in one piece after the pages a cached prefix already holds.
    self.prefills_into_pages = prefill_chunk_size > 0 or prefix_caching
    per_slot = paged_cache.pages_per_slot(cfg.max_target_length, page_size)
    self.num_pages = num_pages or num_slots * per_slot
    if self.num_pages < per_slot:
      raise UserError(f"kv_num_pages={self.num_pages} cannot hold one request at max_target_length="
                      f"{cfg.max_target_length} ({per_slot} pages of kv_page_size={page_size}); "
                      f"set kv_num_pages >= {per_slot} (0 = {num_slots * per_slot}, the dense capacity)")
    self._pages = self._new_allocator()

  def _new_allocator(self) -> paged_cache.PageAllocator:
    pages = paged_cache.PageAllocator(self.num_pages, self.page_size, self.num_slots, self.cfg.max_target_length,
                                      self.prefix_caching)
    pages.usable_pages = self.usable_pages
    return pages

  def reset(self) -> None:
    self._pages = self._new_allocator()

  def admit(self, slot: int, lengths_B: jax.Array | np.ndarray, row: int) -> np.ndarray | None:
    # One read of the lengths for all rows (jax keeps an array's host copy), no slicing op on the device.
    self._pages.assign(slot, int(np.asarray(lengths_B)[row]))  # OutOfPages leaves everything as it was
    return self._pages.table[slot].copy()

  def abstract_table(self, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct | None:
    return jax.ShapeDtypeStruct(self._pages.table.shape, jnp.int32, sharding=sharding)

  def step_table(self, ahead: int = 1, ends: np.ndarray | None = None) -> np.ndarray | None:
    self._pages.grow(ahead, ends)
    return self._pages.generate_table()

  def advance(self, steps: int | np.ndarray = 1) -> None:
    self._pages.advance(steps)

  def release(self, slot: int) -> None:
    self._pages.release(slot)

  def active_slots(self) -> np.ndarray:
    return self._pages.active

  def held(self, slot: int) -> int:
    return self._pages.held(slot)

  def prefilling(self, slot: int) -> bool:
    return not self._pages.active[slot]

  def pages_needed(self, num_tokens: int) -> int:
    return self._pages.pages_for(num_tokens)

  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool) -> int:
    return paged_cache.admission_pages(self._pages, reserved, prompt, need, text_only)

  def stats(self) -> dict[str, int]:
    return self._pages.stats()

  def prompt_pages(self) -> paged_cache.PageAllocator:
    return self._pages

  @property
  def pages(self) -> paged_cache.PageAllocator | None:
    return self._pages

  def empty_caches(self) -> Caches:
    return paged_cache.model_pools(self.cfg, self.num_pages, self.page_size, self.num_slots, self.quantized)

  def logical_names(self) -> Any:
    return paged_cache.model_pool_names(self.cfg, self.quantized)

  def insert(self, caches: Caches, prefix_caches: Caches, slot: jax.Array, row: jax.Array,
             admitted: jax.Array | None) -> Caches:
    assert admitted is not None  # the prompt's page row (admit)
    return paged_cache.insert_prefix(caches, prefix_caches, row, slot, admitted, self.cfg.scan_layers)

  def with_table(self, caches: Caches, table_TM: jax.Array | None) -> Caches:
    assert table_TM is not None
    return paged_cache.with_block_table(caches, table_TM)

  def keep_inactive(self, new: Caches, old: Caches, table_TM: jax.Array | None) -> Caches:
    # A step advances every slot: a recurrent state of a slot without pages (free, or still prefilling) stays.
    assert table_TM is not None
    return paged_cache.keep_inactive_states(new, old, table_TM[:, 0] >= 0, self.cfg.scan_layers)


def make(cfg: ModelConfig, decode: DecodeConfig, num_slots: int, prefix_caching: bool) -> KVLayout:
  """The layout kv_cache_layout names (`prefix_caching`: the engine's own setting, paged only)."""
  if decode.kv_cache_layout == "paged":
    return PagedLayout(cfg, num_slots, decode.quantize_kvcache, decode.kv_page_size, decode.kv_num_pages,
                       prefix_caching, decode.prefill_chunk_size)
  return DenseLayout(cfg, num_slots, decode.quantize_kvcache)
