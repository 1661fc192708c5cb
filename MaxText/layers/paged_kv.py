"""Paged key/value cache of one attention layer, and attention of new queries over its pages.

Shape legend (extends kv_cache.py): P pages in the pool, Z tokens per page (kv_page_size),
M pages per slot (ceil(max_target_length / Z)); K kv heads, H head dim, B slots, U int8 scales per
value row (kv_cache.py).

The pool is [K, P, Z, H] (heads first: the layout of JAX's Pallas TPU paged-attention kernel,
so the TPU path reads the pool as it is stored). A slot's block table row [M] names the page
holding its positions m*Z .. m*Z + Z - 1, or -1 where no page is allocated. The token at position
p of slot b lives at pool[:, table[b, p // Z], p % Z]. Writes to a position without a page are
dropped (empty slots keep stepping in the batched decode); reads of unallocated entries return
page 0's data, which the position mask hides (a query at p sees only positions <= p, all of
which have pages). The host-side allocator that fills the table: inference/paged_cache.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from MaxText.platform import sharding
from MaxText.layers import masks

POOL_NAMES = ("cache_kv_heads", None, None, "cache_kv")  # pages are not sharded: any slot may hold any page
POOL_SCALE_NAMES = ("cache_kv_heads", None, None, None)
TABLE_NAMES = (None, None)
Tree = TypeVar("Tree")  # a tree of caches (stacked per layer, or a list of layers)
Groups = tuple[int, ...] | None  # the feature widths of a row's int8 scales (None: one scale per row)


@struct.dataclass
class PagedKVCache:
  """One layer's page pool and the slots' block tables (a plain pytree). Scales are None unless
  int8-quantized. MLA stores its latents in `key` and its rope keys in `value` (K = 1), with
  DeepSeek-V3.2's indexer keys after them, each part scaled on its own (U = 2).

  With `layer` set (a traced index), the leaves are every layer's, stacked ([layers, K, P, Z, H]),
  and this call reads and writes that layer's: the scanned stack carries the whole pool through
  its scan and updates it in place, where slicing a layer out and back in would copy the pool."""

  key_KPZH: Any
  value_KPZH: Any
  block_table_BM: Any
  key_scale_KPZ1: Any = None
  value_scale_KPZU: Any = None
  layer: Any = None

  @property
  def quantized(self) -> bool:
    return self.key_scale_KPZ1 is not None

  @property
  def page_size(self) -> int:
    return int(self.key_KPZH.shape[-2])

  @property
  def num_pages(self) -> int:
    return int(self.key_KPZH.shape[-3])

  def this_layer(self) -> PagedKVCache:
    """The unstacked view of `layer`'s arrays (itself when `layer` is None). Read only: XLA fuses
    the slice into the gather that reads it, so no layer's pool is copied."""
    if self.layer is None:
      return self
    take = lambda leaf: None if leaf is None else leaf[self.layer]  # noqa: E731
    return PagedKVCache(take(self.key_KPZH), take(self.value_KPZH), take(self.block_table_BM),
                        take(self.key_scale_KPZ1), take(self.value_scale_KPZU))

  def read(self, dtype: DTypeLike, value_groups: Groups = None) -> tuple[jax.Array, jax.Array]:
    """Each slot's keys [B, K, M * Z, H] and values [B, K, H, M * Z] gathered (index = position)
    in the layouts of kv_cache.KVCache.read, dequantized if stored as int8 (`value_groups`: the
    widths each value scale covers, as written): the reference path, any platform. The gather
    writes them so; no copy of them follows."""
    return self._read(dtype, gather_keys, gather_values, -2, value_groups)

  def read_tokens(self, dtype: DTypeLike, value_groups: Groups = None) -> tuple[jax.Array, jax.Array]:
    """Each slot's keys and values gathered into [B, M * Z, K, X] (index = position), dequantized if
    stored as int8 (kv_cache.KVCache.read_tokens)."""
    return self._read(dtype, gather, gather, -1, value_groups)

  def _read(self, dtype: DTypeLike, keys: Any, values: Any, value_axis: int,
            value_groups: Groups) -> tuple[jax.Array, jax.Array]:
    view = self.this_layer()
    table = view.block_table_BM
    key, value = keys(view.key_KPZH, table), values(view.value_KPZH, table)
    if not view.quantized:
      return key.astype(dtype), value.astype(dtype)
    value_scale = feature_scales(values(view.value_scale_KPZU, table), value_groups, value_axis)
    return (key * keys(view.key_scale_KPZ1, table)).astype(dtype), (value * value_scale).astype(dtype)


def feature_scales(scales: jax.Array, groups: Groups, axis: int) -> jax.Array:
  """int8 scales with one entry per group of consecutive features along `axis` (the group
  widths; None: one scale for all, left to broadcast) repeated to one per feature."""
  if groups is None:
    return scales
  return jnp.repeat(scales, np.asarray(groups), axis=axis, total_repeat_length=sum(groups))


def empty_pool(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike, num_slots: int,
               pages_per_slot: int, quantized: bool = False, value_scales: int = 1) -> PagedKVCache:
  """An empty pool; int8 with `value_scales` scales per value row (U) when quantized."""
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  table = jnp.full((num_slots, pages_per_slot), -1, jnp.int32)
  if not quantized:
    return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), table)
  return PagedKVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), table,
                      jnp.zeros(shape[:3] + (1,), jnp.float32), jnp.zeros(shape[:3] + (value_scales,), jnp.float32))


def logical_names(cache: PagedKVCache, stacked: bool) -> PagedKVCache:
  """Logical axis names of each leaf (a leading unsharded layer dim when stacked for scan)."""
  prefix = ("cache_layers",) if stacked else ()
  scale_names = None if not cache.quantized else prefix + POOL_SCALE_NAMES
  return PagedKVCache(prefix + POOL_NAMES, prefix + POOL_NAMES, prefix + TABLE_NAMES, scale_names, scale_names,
                      None if cache.layer is None else ())


def with_layer(caches: Tree, layer: jax.Array | None) -> Tree:
  """`caches` (stacked over layers) with every PagedKVCache in it set to read and write `layer`
  (None: the whole stack again, as a scan carries it)."""
  return jax.tree.map(lambda c: dataclasses.replace(c, layer=layer) if isinstance(c, PagedKVCache) else c,
                      caches, is_leaf=lambda c: isinstance(c, PagedKVCache))


def holds_pages(caches: object) -> bool:
  return any(isinstance(c, PagedKVCache) for c in jax.tree.leaves(caches, is_leaf=lambda c: isinstance(c, PagedKVCache)))


def gather(pool_KPZX: jax.Array, table_BM: jax.Array) -> jax.Array:
  """[B, M * Z, K, X]: each slot's pages in position order (unallocated entries read page 0)."""
  pages_KBMZX = pool_KPZX[:, jnp.maximum(table_BM, 0)]
  num_kv, batch, pages, page_size, width = pages_KBMZX.shape
  return pages_KBMZX.transpose(1, 2, 3, 0, 4).reshape(batch, pages * page_size, num_kv, width)


def gather_keys(pool_KPZX: jax.Array, table_BM: jax.Array) -> jax.Array:
  """[B, K, M * Z, X]: each slot's pages in position order, kv heads before positions."""
  pages_BKMZX = jnp.swapaxes(pool_KPZX[:, jnp.maximum(table_BM, 0)], 0, 1)
  batch, num_kv, pages, page_size, width = pages_BKMZX.shape
  return pages_BKMZX.reshape(batch, num_kv, pages * page_size, width)


def gather_values(pool_KPZX: jax.Array, table_BM: jax.Array) -> jax.Array:
  """[B, K, X, M * Z]: each slot's pages in position order, positions last."""
  pages_BKXMZ = pool_KPZX[:, jnp.maximum(table_BM, 0)].transpose(1, 0, 4, 2, 3)
  batch, num_kv, width, pages, page_size = pages_BKXMZ.shape
  return pages_BKXMZ.reshape(batch, num_kv, width, pages * page_size)


def page_addresses(table_BM: jax.Array, positions_BL: jax.Array, num_pages: int,
                   page_size: int) -> tuple[jax.Array, jax.Array]:
  """([B, L] page, [B, L] offset in the page) of each position; page P (out of range: the write
  is dropped) where the slot has no page for it."""
  page_index_BL = positions_BL // page_size
  in_table = (page_index_BL >= 0) & (page_index_BL < table_BM.shape[1])
  page_BL = jnp.take_along_axis(table_BM, jnp.clip(page_index_BL, 0, table_BM.shape[1] - 1), axis=1)
  return jnp.where(in_table & (page_BL >= 0), page_BL, num_pages), positions_BL % page_size


def scatter(pool_KPZX: jax.Array, update_BLKX: jax.Array, page_BL: jax.Array, offset_BL: jax.Array,
            layer: jax.Array | None = None) -> jax.Array:
  """pool with update[b, l] stored at (page[b, l], offset[b, l]) (out-of-range pages dropped); with
  `layer`, the pool is stacked over layers and that layer's entries are written.

  Addressed by (page, offset) on the pool as stored, never through a flattened view: with one
  token to write (one slot decoding) XLA turns the scatter into a dynamic-update-slice, and on a
  reshaped pool it then copies the whole pool every step, so the step's cost would follow the
  pool's size instead of the tokens written and read (`tests/inference/test_paged_cache.py`
  checks the compiled step holds no pool-sized copy)."""
  if layer is None:
    update_KBLX = update_BLKX.transpose(2, 0, 1, 3).astype(pool_KPZX.dtype)
    return pool_KPZX.at[:, page_BL, offset_BL].set(update_KBLX, mode="drop")
  # [layer, :, page, offset]: the advanced indices are split by a slice, so numpy's rule puts
  # their [B, L] dims first and the update is [B, L, K, X] as given.
  return pool_KPZX.at[layer, :, page_BL, offset_BL].set(update_BLKX.astype(pool_KPZX.dtype), mode="drop")


def store(cache: PagedKVCache, k_BLKH: jax.Array, v_BLKH: jax.Array, k_scale_BLK1: jax.Array | None,
          v_scale_BLKU: jax.Array | None, positions_BL: jax.Array) -> PagedKVCache:
  """The cache with each new key/value (already int8 with its scales when quantized) stored at
  its slot's page for its position (in `layer`'s pool when set)."""
  table_BM = cache.block_table_BM if cache.layer is None else cache.block_table_BM[cache.layer]
  page_BL, offset_BL = page_addresses(table_BM, positions_BL, cache.num_pages, cache.page_size)
  put = lambda pool, update: None if update is None else scatter(pool, update, page_BL, offset_BL,  # noqa: E731
                                                                 cache.layer)
  new = PagedKVCache(put(cache.key_KPZH, k_BLKH), put(cache.value_KPZH, v_BLKH), cache.block_table_BM,
                     put(cache.key_scale_KPZ1, k_scale_BLK1), put(cache.value_scale_KPZU, v_scale_BLKU), cache.layer)
  names = logical_names(new, stacked=cache.layer is not None)
  return dataclasses.replace(new, **{field: sharding.constrain(getattr(new, field), getattr(names, field))
                                     for field in _ARRAY_FIELDS if getattr(new, field) is not None})


_ARRAY_FIELDS = ("key_KPZH", "value_KPZH", "block_table_BM", "key_scale_KPZ1", "value_scale_KPZU")


def pallas_kernel_applies(cache: PagedKVCache, q_BLNH: jax.Array, window_size: masks.Window,
                          chunk_size: masks.Window, sinks_N: jax.Array | None) -> bool:
  """Whether the Pallas TPU paged-attention kernel (on TPU: attention_kernels.PAGED) computes this
  call: one new token per slot (a generate step), full causal attention (it has no window, chunk
  or sink), and a head dim its blocks tile (Mosaic wants the last block dim a multiple of 128; 64
  does not lower)."""
  head_dim = cache.key_KPZH.shape[-1]
  return (q_BLNH.shape[1] == 1 and window_size is None and chunk_size is None and sinks_N is None
          and q_BLNH.shape[-1] == head_dim and head_dim % 128 == 0)


def tpu_paged_attention(q_BLNH: jax.Array, cache: PagedKVCache, positions_BL: jax.Array,
                        soft_cap: float) -> jax.Array:
  """The Pallas TPU kernel (jax.experimental.pallas.ops.tpu.paged_attention) over the pool as
  stored; it attends to the first `lengths` tokens of each slot's pages. Mosaic kernels are not
  partitioned by XLA, so it runs per device under shard_map: kv heads (and their query-head
  groups) split as the pool is, the pages, block table and slots whole on every device."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel
  from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils

  # A scanned stack's layer is sliced out for the kernel, which reads a pool as stored: a copy
  # of the layer's pool per step, which unrolled layers (scan_layers=False) do not make.
  cache = cache.this_layer()
  pages_per_slot = cache.block_table_BM.shape[1]
  lengths_B = jnp.clip(positions_BL[:, 0] + 1, 1, pages_per_slot * cache.page_size).astype(jnp.int32)
  block = max(b for b in (8, 4, 2, 1) if pages_per_slot % b == 0)
  pools = [cache.key_KPZH, cache.value_KPZH] + ([cache.key_scale_KPZ1, cache.value_scale_KPZU] if cache.quantized
                                                else [])

  def per_device(q_BNH: jax.Array, lengths_B: jax.Array, table_BM: jax.Array, *pools: jax.Array) -> jax.Array:
    keys: jax.Array | quantization_utils.QuantizedTensor = pools[0]
    values: jax.Array | quantization_utils.QuantizedTensor = pools[1]
    if len(pools) == 4:  # the kernel dequantizes as int8 * h / MAX_INT8; ours is int8 * scale
      keys = quantization_utils.QuantizedTensor(pools[0], pools[2] * quantization_utils.MAX_INT8)
      values = quantization_utils.QuantizedTensor(pools[1], pools[3] * quantization_utils.MAX_INT8)
    return kernel(q_BNH, keys, values, lengths_B, jnp.maximum(table_BM, 0),  # unallocated: page 0, never read
                  attn_logits_soft_cap=soft_cap if soft_cap > 0 else None, pages_per_compute_block=block)

  args = (q_BLNH[:, 0], lengths_B, cache.block_table_BM, *pools)
  context = sharding.current_activation_context()
  if context is None:
    out_BNH = per_device(*args)
  else:
    mesh, rules = context
    heads = sharding.logical_to_mesh_spec(POOL_NAMES, rules, mesh, cache.key_KPZH.shape)[0]
    q_spec, pool_spec = PartitionSpec(None, heads, None), PartitionSpec(heads, None, None, None)
    out_BNH = jax.shard_map(per_device, mesh=mesh, in_specs=(q_spec, PartitionSpec(), PartitionSpec(),
                                                             *[pool_spec] * len(pools)),
                            out_specs=q_spec, check_vma=False)(*args)
  return out_BNH[:, None].astype(q_BLNH.dtype)


def gathered_attention(q_BLNH: jax.Array, cache: PagedKVCache, positions_BL: jax.Array,
                       window_size: masks.Window = None, soft_cap: float = 0.0, chunk_size: masks.Window = None,
                       sinks_N: jax.Array | None = None, image_blocks_BL: jax.Array | None = None) -> jax.Array:
  """kv_cache.cached_attention over pages, the reference on any platform: every slot's pages
  gathered into position order, then the dense cache's masked attention."""
  k_BKSH, v_BKHS = cache.read(q_BLNH.dtype)
  mask_BLS = masks.cache_mask(positions_BL, k_BKSH.shape[2], window_size, chunk_size, image_blocks_BL)
  return masks.cache_attention(q_BLNH, k_BKSH, v_BKHS, mask_BLS, soft_cap, sinks_N)
