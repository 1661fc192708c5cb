"""Key/value cache for autoregressive decoding, and attention of new queries over it.

Shape legend: B batch (decode slots), L new tokens this call (the padded prompt in prefill,
1 in generate), S cache length, N query heads, K key/value heads, G = N / K, H head dim,
U int8 scales per value row (1 unless its parts are scaled apart, below).

Storage: keys [B, K, S, H], values [B, K, H, S] (int8 scales [B, K, S, 1] and [B, K, U, S]): the
layouts attention's two dots read their cache operand in (masks.cache_attention), so a decode step
reads the cache in place; stored [B, S, K, H], each step copied the whole cache of every layer into
those layouts first. `KVCache.tokens` gives the token-major [B, S, K, X] view (MLA, page inserts).

Layout rule: the token at absolute position p lives at cache index p. Prompts are right-padded,
so a row's padding sits after its last real token and is overwritten by the tokens generated
there; a query at position p sees only cache indices s <= p (and, in a sliding-window layer,
p - s < window; in a chunked layer, p // chunk == s // chunk), so padding and stale entries
past p are never attended. No separate padding mask is needed: the mask is masks.cache_mask.

`quantize_kvcache` stores keys and values as int8 with one float32 scale per token per head
(symmetric, scale = max|x| / 127 over the head dim), dequantized when read. A value row that holds
parts of differing magnitude has a scale per part (U of them, each over its own features: MLA's
rope key and DeepSeek-V3.2's indexer key, `mla_row_groups`); one shared scale would round the
smaller part to a few levels. Its writer and readers pass the parts' widths (`value_groups`).

kv_cache_layout=paged replaces each layer's KVCache by a page pool (layers/paged_kv.py); `write`
and `cached_attention` take either.

A Gated DeltaNet layer (Qwen3-Next's linear attention) caches no keys and values: its decode state
is a fixed-size gated_deltanet.LinearState per row, in the same place in the tree (both layouts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.typing import DTypeLike

from MaxText.platform import sharding
from MaxText.layers import attention_kernels, gated_deltanet, layer_shapes, masks, paged_kv
from MaxText.configuration.model_config import ModelConfig

KEY_NAMES = ("cache_batch", "cache_kv_heads", "cache_sequence", "cache_kv")
VALUE_NAMES = ("cache_batch", "cache_kv_heads", "cache_kv", "cache_sequence")
KEY_SCALE_NAMES = ("cache_batch", "cache_kv_heads", "cache_sequence", None)
VALUE_SCALE_NAMES = ("cache_batch", "cache_kv_heads", None, "cache_sequence")
Tree = TypeVar("Tree")  # a tree of caches (stacked per layer, or a list of layers)


@struct.dataclass
class KVCache:
  """One attention layer's cache (a plain pytree). Scales are None unless int8-quantized.

  Fields hold arrays; the same structure also carries their logical axis names or shardings
  (`cache_logical_names`), hence the loose field types.

  With `layer` set (a traced index), the arrays are every layer's, stacked ([layers, B, ...]), and
  this call reads and writes that layer's: the scanned stack carries the whole cache through its
  scan and writes it in place, where scanning over it would slice each layer out and stack it back
  (copies of the cache every step), as paged_kv.PagedKVCache does with its pools.
  """

  key_BKSH: Any
  value_BKHS: Any
  key_scale_BKS1: Any = None
  value_scale_BKUS: Any = None
  layer: Any = None

  @property
  def quantized(self) -> bool:
    return self.key_scale_BKS1 is not None

  @property
  def length(self) -> int:
    return int(self.key_BKSH.shape[-2])

  def this_layer(self) -> KVCache:
    """The unstacked view of `layer`'s arrays (itself when `layer` is None), read only."""
    if self.layer is None:
      return self
    take = lambda leaf: None if leaf is None else leaf[self.layer]  # noqa: E731
    return KVCache(take(self.key_BKSH), take(self.value_BKHS), take(self.key_scale_BKS1), take(self.value_scale_BKUS))

  def read(self, dtype: DTypeLike, value_groups: paged_kv.Groups = None) -> tuple[jax.Array, jax.Array]:
    """Keys [B, K, S, H] and values [B, K, H, S] in `dtype`, dequantized if stored as int8
    (`value_groups`: the widths each value scale covers, as written)."""
    view = self.this_layer()
    if not view.quantized:
      return view.key_BKSH.astype(dtype), view.value_BKHS.astype(dtype)
    value_scale = paged_kv.feature_scales(view.value_scale_BKUS, value_groups, -2)
    return (view.key_BKSH * view.key_scale_BKS1).astype(dtype), (view.value_BKHS * value_scale).astype(dtype)

  def tokens(self) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """The stored arrays token-major, as written: key and value [B, S, K, X], scales [B, S, K, 1]
    and [B, S, K, U] (None unless quantized). A view for XLA to fuse into its reader, not a copy of its own."""
    view = self.this_layer()
    if not view.quantized:
      return jnp.swapaxes(view.key_BKSH, 1, 2), jnp.moveaxis(view.value_BKHS, 3, 1), None, None
    return (jnp.swapaxes(view.key_BKSH, 1, 2), jnp.moveaxis(view.value_BKHS, 3, 1),
            jnp.swapaxes(view.key_scale_BKS1, 1, 2), jnp.moveaxis(view.value_scale_BKUS, 3, 1))

  def read_tokens(self, dtype: DTypeLike, value_groups: paged_kv.Groups = None) -> tuple[jax.Array, jax.Array]:
    """Keys and values [B, S, K, X] in `dtype`, dequantized if stored as int8 (`value_groups` as in `read`)."""
    key, value, key_scale, value_scale = self.tokens()
    if key_scale is None or value_scale is None:
      return key.astype(dtype), value.astype(dtype)
    value_scale = paged_kv.feature_scales(value_scale, value_groups, -1)
    return (key * key_scale).astype(dtype), (value * value_scale).astype(dtype)


def empty_cache(batch: int, length: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike,
                quantized: bool = False, value_scales: int = 1) -> KVCache:
  """An empty cache; int8 with `value_scales` scales per value row (U) when quantized."""
  key, value = (batch, num_kv_heads, length, head_dim), (batch, num_kv_heads, head_dim, length)
  if not quantized:
    return KVCache(jnp.zeros(key, dtype), jnp.zeros(value, dtype))
  return KVCache(jnp.zeros(key, jnp.int8), jnp.zeros(value, jnp.int8), jnp.zeros(key[:3] + (1,), jnp.float32),
                 jnp.zeros((batch, num_kv_heads, value_scales, length), jnp.float32))


def cache_logical_names(cache: KVCache, stacked: bool) -> KVCache:
  """Logical axis names of each leaf (a leading unsharded layer dim when stacked for scan)."""
  prefix = ("cache_layers",) if stacked else ()
  layer = None if cache.layer is None else ()
  if not cache.quantized:
    return KVCache(prefix + KEY_NAMES, prefix + VALUE_NAMES, layer=layer)
  return KVCache(prefix + KEY_NAMES, prefix + VALUE_NAMES, prefix + KEY_SCALE_NAMES, prefix + VALUE_SCALE_NAMES,
                 layer)


def with_layer(caches: Tree, layer: jax.Array | None) -> Tree:
  """`caches` (stacked over layers) with every KVCache and page pool in it set to read and write
  `layer` (None: the whole stack again, as a scan carries it)."""
  return jax.tree.map(lambda c: dataclasses.replace(c, layer=layer) if _is_layer_cache(c) else c, caches,
                      is_leaf=_is_layer_cache)


def holds_layer_caches(caches: object) -> bool:
  """Whether `caches` holds a KVCache or a page pool (not only recurrent states)."""
  return any(_is_layer_cache(c) for c in jax.tree.leaves(caches, is_leaf=_is_layer_cache))


def _is_layer_cache(c: object) -> bool:
  return isinstance(c, (KVCache, paged_kv.PagedKVCache))


def quantize_int8(x_BLKH: jax.Array, groups: paged_kv.Groups = None) -> tuple[jax.Array, jax.Array]:
  """Symmetric per-token-per-head int8: (values, float32 scales [B, L, K, 1]); with `groups` (widths
  summing to H), a scale per group of consecutive features ([B, L, K, U])."""
  x = x_BLKH.astype(jnp.float32)
  if groups is None:
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
  else:
    parts = jnp.split(x, np.cumsum(groups)[:-1].tolist(), axis=-1)
    scale = jnp.concatenate([jnp.max(jnp.abs(part), axis=-1, keepdims=True) for part in parts], axis=-1) / 127.0
  safe = paged_kv.feature_scales(jnp.where(scale == 0, 1.0, scale), groups, -1)
  return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def _scatter(buffer: jax.Array, update_BLKX: jax.Array, positions_BL: jax.Array, sequence_axis: int,
             layer: jax.Array | None) -> jax.Array:
  """buffer [B, K, S, X] or [B, K, X, S] (`sequence_axis` 2 or 3; with `layer`, stacked over layers
  and that layer's written) with update[b, l] stored at sequence index positions[b, l]; positions
  past the end are dropped."""
  rows_BL = jnp.broadcast_to(jnp.arange(positions_BL.shape[0])[:, None], positions_BL.shape)
  # The advanced indices are split by slices, so numpy's rule puts their [B, L] dims first: the
  # update is [B, L, K, X] as given, for either layout.
  lead = (rows_BL,) if layer is None else (layer, rows_BL)
  index = lead + (slice(None),) * (sequence_axis - 1) + (positions_BL,)
  return buffer.at[index].set(update_BLKX.astype(buffer.dtype), mode="drop")


@overload
def write(cache: KVCache, k_BLKH: jax.Array, v_BLKH: jax.Array, positions_BL: jax.Array,
          value_groups: paged_kv.Groups = None) -> KVCache: ...
@overload
def write(cache: paged_kv.PagedKVCache, k_BLKH: jax.Array, v_BLKH: jax.Array,
          positions_BL: jax.Array, value_groups: paged_kv.Groups = None) -> paged_kv.PagedKVCache: ...
def write(cache: KVCache | paged_kv.PagedKVCache, k_BLKH: jax.Array, v_BLKH: jax.Array,
          positions_BL: jax.Array, value_groups: paged_kv.Groups = None) -> KVCache | paged_kv.PagedKVCache:
  """The cache (a KVCache or a paged_kv.PagedKVCache) with each new key/value stored at its
  token's absolute position (int8: a value scale per group of `value_groups` widths, the cache's U)."""
  if isinstance(cache, paged_kv.PagedKVCache):
    if not cache.quantized:
      return paged_kv.store(cache, k_BLKH, v_BLKH, None, None, positions_BL)
    (k_q, k_scale), (v_q, v_scale) = quantize_int8(k_BLKH), quantize_int8(v_BLKH, value_groups)
    return paged_kv.store(cache, k_q, v_q, k_scale, v_scale, positions_BL)
  if cache.quantized:
    (k_q, k_scale), (v_q, v_scale) = quantize_int8(k_BLKH), quantize_int8(v_BLKH, value_groups)
    updates: tuple[jax.Array | None, ...] = (k_q, v_q, k_scale, v_scale)
  else:
    updates = (k_BLKH, v_BLKH, None, None)
  fields = dict(zip(_ARRAY_FIELDS, updates))
  names = cache_logical_names(cache, stacked=cache.layer is not None)
  return dataclasses.replace(cache, **{
      field: sharding.constrain(
          _scatter(getattr(cache, field), update, positions_BL, _SEQUENCE_AXIS[field], cache.layer),
          getattr(names, field))
      for field, update in fields.items() if update is not None})


_ARRAY_FIELDS = ("key_BKSH", "value_BKHS", "key_scale_BKS1", "value_scale_BKUS")
_SEQUENCE_AXIS = {"key_BKSH": 2, "value_BKHS": 3, "key_scale_BKS1": 2, "value_scale_BKUS": 3}


def cached_attention(q_BLNH: jax.Array, cache: KVCache | paged_kv.PagedKVCache, positions_BL: jax.Array,
                     window_size: masks.Window = None, soft_cap: float = 0.0,
                     chunk_size: masks.Window = None, sinks_N: jax.Array | None = None,
                     image_blocks_BL: jax.Array | None = None) -> jax.Array:
  """Grouped-query attention of already-scaled queries over the whole cache (masks.cache_mask,
  with a prefill's image blocks), with the attention sinks of masks.dense_attention when given;
  over pages: attention_kernels.paged_attention."""
  if isinstance(cache, paged_kv.PagedKVCache):
    if image_blocks_BL is not None:  # only the reference takes a mask beyond causality
      return paged_kv.gathered_attention(q_BLNH, cache, positions_BL, window_size, soft_cap, chunk_size, sinks_N,
                                         image_blocks_BL)
    return attention_kernels.paged_attention(q_BLNH, cache, positions_BL, window_size, soft_cap, chunk_size, sinks_N)
  k_BKSH, v_BKHS = cache.read(q_BLNH.dtype)
  mask_BLS = masks.cache_mask(positions_BL, cache.length, window_size, chunk_size, image_blocks_BL)
  return masks.cache_attention(q_BLNH, k_BKSH, v_BKHS, mask_BLS, soft_cap, sinks_N)


def layer_cache(cfg: ModelConfig, batch: int, length: int, quantized: bool = False) -> KVCache:
  """One layer's empty cache. attention_type=mla caches its compressed form instead of keys and
  values (layers/mla.py): the key array holds the latents (K = 1, X = kv_lora_rank), the value
  array the rotated rope keys (X = qk_rope_head_dim, then the indexer's keys: `mla_row_groups`)."""
  if cfg.attn.attention_type != "mla":
    return empty_cache(batch, length, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype), quantized)
  latent = empty_cache(batch, length, 1, cfg.mla.kv_lora_rank, jnp.dtype(cfg.dtype), quantized)
  groups = mla_row_groups(cfg)
  rope = empty_cache(batch, length, 1, sum(groups), jnp.dtype(cfg.dtype), quantized, len(groups))
  return KVCache(latent.key_BKSH, rope.value_BKHS, latent.key_scale_BKS1, rope.value_scale_BKUS)


def mla_row_groups(cfg: ModelConfig) -> tuple[int, ...]:
  """The parts of MLA's second cache array per token, in order: the rope key, and with index_topk > 0
  the lightning indexer's key after it; each has an int8 scale of its own when quantized (U = their
  count), as their magnitudes are unrelated."""
  return (cfg.mla.qk_rope_head_dim,) + ((cfg.mla.index_head_dim,) if cfg.mla.index_topk > 0 else ())


def _stack_caches(cfg: ModelConfig, one: object, count: int) -> Any:
  if cfg.scan_layers:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), one)
  # A list, not a tuple: logical-name trees treat tuples as leaves.
  return [one for _ in range(count)]


def per_stack(cfg: ModelConfig, build: Callable[[ModelConfig, int], Any]) -> Any:
  """`build(the stack's configuration, number of layers)` for each layer stack: one for all decoder
  layers, or with a dense_layers stack (first_dense_layers, moe_layer_interval, full_attention_interval)
  {"dense_layers": ..., "layers": ...}."""
  if cfg.num_dense_layers == 0:
    return build(cfg, cfg.num_decoder_layers)
  return {"dense_layers": build(cfg.dense_stack_config(), cfg.num_dense_layers),
          "layers": build(cfg, cfg.num_moe_stack_layers)}


def is_linear(cfg: ModelConfig) -> bool:
  """A Gated DeltaNet layer's configuration: its decode state is a LinearState, not a KV cache."""
  return cfg.attn.attention_type == "gated_deltanet"


def _linear_names(stacked: bool) -> gated_deltanet.LinearState:
  prefix = ("cache_layers",) if stacked else ()
  return jax.tree.map(lambda names: prefix + names, gated_deltanet.state_names(), is_leaf=lambda x: isinstance(x, tuple))


def layer_caches(cfg: ModelConfig, build: Callable[[ModelConfig], Any]) -> Any:
  """Every layer's cache, `build(a layer's configuration)` (a Gated DeltaNet stack's config gives its
  LinearState), stacked over layers (scan_layers) or a list, per stack; a stack of differing layers
  (layers/layer_shapes.py) gets a list with each layer's own, None for a layer sharing another's."""
  if not cfg.layer_shapes.active:
    return per_stack(cfg, lambda own, count: _stack_caches(cfg, build(own), count))
  return [build(layer_shapes.layer_config(cfg, i)) if layer_shapes.has_own_kv(cfg, i) else None
          for i in range(cfg.num_decoder_layers)]


def layer_cache_names(cfg: ModelConfig, names: object) -> Any:
  """Logical names matching `layer_caches` (`names`: one attention layer's; a Gated DeltaNet
  stack gets its LinearState's)."""
  if not cfg.layer_shapes.active:
    def stack(own: ModelConfig, count: int) -> Any:
      one = _linear_names(cfg.scan_layers) if is_linear(own) else names
      return one if cfg.scan_layers else [one for _ in range(count)]
    return per_stack(cfg, stack)
  return [names if layer_shapes.has_own_kv(cfg, i) else None for i in range(cfg.num_decoder_layers)]


def model_caches(cfg: ModelConfig, batch: int, length: int, quantized: bool = False) -> Any:
  """Empty caches for every layer: one KVCache stacked over layers (scan_layers) or a list; with
  a dense_layers stack, {"dense_layers": its caches, "layers": the rest's}; see `layer_caches`."""
  return layer_caches(cfg, lambda own: gated_deltanet.empty_state(own, batch) if is_linear(own)
                      else layer_cache(own, batch, length, quantized))


def model_cache_names(cfg: ModelConfig, quantized: bool = False) -> Any:
  """Logical axis names matching `model_caches`."""
  return layer_cache_names(cfg, cache_logical_names(empty_cache(1, 1, 1, 1, jnp.float32, quantized),
                                                    stacked=cfg.scan_layers))
