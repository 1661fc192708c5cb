"""The attention mask and grouped-query head grouping, shared by every attention kernel.

One rule everywhere: the query at position p sees the key at position s iff s <= p (causal),
p - s < window (a sliding window of `window` tokens: this one and window - 1 before it) and
both carry the same segment id (packed documents never see each other). A chunked layer
(Llama 4) adds p // chunk == s // chunk: the sequence is cut into fixed chunks of `chunk`
positions and a query sees only its own chunk's past (not a sliding window: the first token
of a chunk sees only itself). Only dot_product and the KV-cache path take a chunk.
Image blocks (Gemma 3) relax causality: the tokens of one image (`image_blocks`, a run of
placeholder tokens) see each other both ways, still within the window and the segment; only
dot_product takes them.

- `allowed` builds it as a boolean array: dot_product and the flash reference (`self_mask`),
  the KV-cache decode path (`cache_mask`), cuDNN's mask argument, and each block of chunked
  flash (with the blocks' global positions, also under context parallelism).
- Splash and cuDNN take the static window as (left, right) bounds: `local_window_bounds`.
- `group_queries` / `merge_groups` are the one place query heads are grouped over key/value
  heads; `dense_attention` is the one materialised grouped-query attention.

Legend: B batch, L query positions, S key positions, N query heads, K key/value heads,
G = N // K query heads per key/value head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# A window: None (no window), a Python int, or a traced int32 scalar (mixed local/global scanned stack).
Window = int | jax.Array | None

# Large finite negative, not -inf, so a fully masked row (padding) softmaxes to finite values, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# "No window" is None; only a traced window, which cannot hold None, spells it NO_WINDOW.
# 2**30 rather than the int32 maximum so window arithmetic (p - window + 1) never overflows.
NO_WINDOW = 2**30


def is_static(window: Window) -> bool:
  """Whether the window is known at trace time (None or an int), not a traced scalar."""
  return window is None or isinstance(window, int)


def window_scalar(window: Window) -> jax.Array:
  """The window as an int32 scalar for traced arithmetic: None becomes NO_WINDOW."""
  if window is None:
    return jnp.int32(NO_WINDOW)
  return jnp.minimum(jnp.asarray(window, jnp.int32), NO_WINDOW)


def layer_window(is_local: jax.Array, size: int) -> jax.Array:
  """A traced layer's window: `size` on a local layer, NO_WINDOW on a global one."""
  return jnp.where(is_local, size, NO_WINDOW)


def is_windowed(window: jax.Array) -> jax.Array:
  """Traced: whether `window` (from `layer_window`) is a real window rather than NO_WINDOW."""
  return window < NO_WINDOW


def local_window_bounds(window: int) -> tuple[int, int]:
  """(keys before, keys after) a query sees, as splash's LocalMask and jax.nn's local_window_size take."""
  return window - 1, 0


def allowed(q_pos_BL: jax.Array, k_pos_BS: jax.Array, q_seg_BL: jax.Array | None = None,
            k_seg_BS: jax.Array | None = None, window: Window = None, chunk: Window = None,
            q_block_BL: jax.Array | None = None, k_block_BS: jax.Array | None = None) -> jax.Array:
  """[B, L, S] boolean: causal (or, given both image block ids, in the same image block > 0),
  within `window` (of the keys before the query; later keys of its image are always in it), in the
  same `chunk` of positions (None = no chunking; a traced one spells that NO_WINDOW) and, given both
  segment ids, in the same segment.

  Positions may have batch 1 (shared by every row); all broadcasting is within equal ranks.
  """
  offset_BLS = q_pos_BL[:, :, None] - k_pos_BS[:, None, :]
  ok_BLS = offset_BLS >= 0
  if q_block_BL is not None and k_block_BS is not None:
    same_image_BLS = (q_block_BL[:, :, None] == k_block_BS[:, None, :]) & (q_block_BL[:, :, None] > 0)
    ok_BLS = ok_BLS | same_image_BLS
  if window is not None:
    ok_BLS = ok_BLS & (offset_BLS < window)
  if chunk is not None:
    ok_BLS = ok_BLS & (q_pos_BL[:, :, None] // chunk == k_pos_BS[:, None, :] // chunk)
  if q_seg_BL is not None and k_seg_BS is not None:
    ok_BLS = ok_BLS & (q_seg_BL[:, :, None] == k_seg_BS[:, None, :])
  return ok_BLS


def self_mask(segment_ids_BL: jax.Array, window: Window = None, chunk: Window = None,
              positions_BL: jax.Array | None = None, image_blocks_BL: jax.Array | None = None) -> jax.Array:
  """[B, L, L] self-attention mask of a (packed) training sequence at positions 0 .. L - 1.
  Chunks are cut at the tokens' `positions_BL` when given (each packed document's own), else
  at 0 .. L - 1; within one document the two orders agree, so causality is unchanged.
  `image_blocks_BL` (from `image_blocks`): each image's tokens also see its later tokens."""
  positions_1L = jnp.arange(segment_ids_BL.shape[1])[None]
  ok_BLL = allowed(positions_1L, positions_1L, segment_ids_BL, segment_ids_BL, window,
                   q_block_BL=image_blocks_BL, k_block_BS=image_blocks_BL)
  if chunk is None:
    return ok_BLL
  chunk_pos_BL = positions_1L if positions_BL is None else positions_BL
  return ok_BLL & (chunk_pos_BL[:, :, None] // chunk == chunk_pos_BL[:, None, :] // chunk)


def image_blocks(tokens_BL: jax.Array, image_token_id: int) -> jax.Array:
  """int32 [B, L]: 0 on text, k on the tokens of a row's k-th run of `image_token_id` (one image's
  soft tokens: the chat template puts begin/end-of-image tokens around each run)."""
  is_image_BL = tokens_BL == image_token_id
  starts_BL = is_image_BL & ~jnp.pad(is_image_BL, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(is_image_BL, jnp.cumsum(starts_BL, axis=1, dtype=jnp.int32), 0)


def cache_mask(positions_BL: jax.Array, cache_length: int, window: Window = None,
               chunk: Window = None, image_blocks_BL: jax.Array | None = None) -> jax.Array:
  """[B, L, S] mask of new queries over a KV cache (index = position), which needs no segment
  ids: entries past a query's position (padding, stale tokens) are hidden as future.
  `image_blocks_BL` (`image_blocks` of this call's tokens; each image whole within the call): an
  image's tokens also see the cache entries of its later tokens, which this call writes."""
  k_pos_1S = jnp.arange(cache_length)[None]
  if image_blocks_BL is None:
    return allowed(positions_BL, k_pos_1S, window=window, chunk=chunk)
  # Each key position gets the block id of the token this call writes there (0: none or text).
  rows_BL = jnp.broadcast_to(jnp.arange(positions_BL.shape[0])[:, None], positions_BL.shape)
  k_block_BS = jnp.zeros((positions_BL.shape[0], cache_length), jnp.int32).at[rows_BL, positions_BL].set(
      image_blocks_BL, mode="drop")
  return allowed(positions_BL, k_pos_1S, window=window, chunk=chunk, q_block_BL=image_blocks_BL, k_block_BS=k_block_BS)


def group_queries(q_BLNH: jax.Array, num_kv: int) -> jax.Array:
  """[B, L, N, H] -> [B, L, K, G, H]: query heads k * G .. k * G + G - 1 share key/value head k."""
  batch, length, num_q, head_dim = q_BLNH.shape
  return q_BLNH.reshape(batch, length, num_kv, num_q // num_kv, head_dim)


def merge_groups(x_BLKGH: jax.Array) -> jax.Array:
  """[B, L, K, G, H] -> [B, L, N, H], the inverse of `group_queries`."""
  batch, length, num_kv, group, head_dim = x_BLKGH.shape
  return x_BLKGH.reshape(batch, length, num_kv * group, head_dim)


def dense_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, allowed_BLS: jax.Array,
                    soft_cap: float = 0.0, sinks_N: jax.Array | None = None) -> jax.Array:
  """Materialised grouped-query attention of pre-scaled queries; softmax in float32.
  `soft_cap` > 0 squashes scores to cap * tanh(score / cap) before masking (Gemma 2).
  `sinks_N`: one learned logit per query head that joins every row's softmax as an extra key
  with no value (GPT-OSS): it only takes probability mass away from the real keys."""
  num_kv = k_BSKH.shape[2]
  q_BLKGH = group_queries(q_BLNH, num_kv)
  logits_BKGLS = jnp.einsum("blkgh,bskh->bkgls", q_BLKGH, k_BSKH, preferred_element_type=jnp.float32)
  probs_BKGLS = _probabilities(logits_BKGLS, allowed_BLS, soft_cap, sinks_N, v_BSKH.dtype)
  return merge_groups(jnp.einsum("bkgls,bskh->blkgh", probs_BKGLS, v_BSKH))


def cache_attention(q_BLNH: jax.Array, k_BKSH: jax.Array, v_BKHS: jax.Array, allowed_BLS: jax.Array,
                    soft_cap: float = 0.0, sinks_N: jax.Array | None = None) -> jax.Array:
  """`dense_attention` over keys [B, K, S, H] and values [B, K, H, S]: the layouts its two dots
  read their cache operand in (batch and kv head leading, the contracted axis last), so a KV cache
  stored so (layers/kv_cache.py) is read in place, where [B, S, K, H] is transposed first. Same
  dots, so the same results bit for bit."""
  num_kv = k_BKSH.shape[1]
  q_BLKGH = group_queries(q_BLNH, num_kv)
  logits_BKGLS = jnp.einsum("blkgh,bksh->bkgls", q_BLKGH, k_BKSH, preferred_element_type=jnp.float32)
  probs_BKGLS = _probabilities(logits_BKGLS, allowed_BLS, soft_cap, sinks_N, v_BKHS.dtype)
  return merge_groups(jnp.einsum("bkgls,bkhs->blkgh", probs_BKGLS, v_BKHS))


def latent_cache_attention(q_BLNX: jax.Array, latent_BKSR: jax.Array, rope_BKPS: jax.Array, allowed_BLS: jax.Array,
                           soft_cap: float = 0.0) -> jax.Array:
  """MLA's absorbed attention over its compressed cache read in place (K = 1): queries [B, L, N, R + P]
  score the latents [B, K, S, R] and the rotated rope keys [B, K, P, S] in two dots summed in float32,
  and the latents are the values. Concatenating the two into [S, R + P] keys first would copy the
  layer's whole cache every step."""
  rank = latent_BKSR.shape[-1]
  q_BLKGX = group_queries(q_BLNX, latent_BKSR.shape[1])
  logits_BKGLS = (jnp.einsum("blkgr,bksr->bkgls", q_BLKGX[..., :rank], latent_BKSR, preferred_element_type=jnp.float32)
                  + jnp.einsum("blkgp,bkps->bkgls", q_BLKGX[..., rank:], rope_BKPS, preferred_element_type=jnp.float32))
  probs_BKGLS = _probabilities(logits_BKGLS, allowed_BLS, soft_cap, None, latent_BKSR.dtype)
  return merge_groups(jnp.einsum("bkgls,bksr->blkgr", probs_BKGLS, latent_BKSR))


def _probabilities(logits_BKGLS: jax.Array, allowed_BLS: jax.Array, soft_cap: float, sinks_N: jax.Array | None,
                   dtype: DTypeLike) -> jax.Array:
  """The attention weights of float32 scores: soft cap, mask, softmax (with sinks), in `dtype`."""
  if soft_cap > 0:
    logits_BKGLS = soft_cap * jnp.tanh(logits_BKGLS / soft_cap)
  logits_BKGLS = jnp.where(allowed_BLS[:, None, None], logits_BKGLS, MASK_VALUE)
  if sinks_N is None:
    return jax.nn.softmax(logits_BKGLS, axis=-1).astype(dtype)
  num_kv = logits_BKGLS.shape[1]
  sink_BKGL1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, num_kv, -1, 1, 1),
                                logits_BKGLS.shape[:-1] + (1,))
  return jax.nn.softmax(jnp.concatenate([logits_BKGLS, sink_BKGL1], axis=-1), axis=-1)[..., :-1].astype(dtype)


def top_k_keys(scores_BLS: jax.Array, allowed_BLS: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """DeepSeek Sparse Attention's choice: each query's `k` allowed keys of highest score, as
  (key indices [B, L, k'] int32, whether each is allowed [B, L, k']) with k' = min(k, S). A query
  with fewer than k allowed keys gets some disallowed ones, flagged False (they stay masked).
  Equal scores go lowest key position first (jax.lax.top_k's order). The indexer's ReLU makes
  exact-zero ties common with few index heads, and torch.topk leaves their order open."""
  masked_BLS = jnp.where(allowed_BLS, scores_BLS.astype(jnp.float32), -jnp.inf)
  values_BLk, indices_BLk = jax.lax.top_k(masked_BLS, min(k, scores_BLS.shape[-1]))
  return indices_BLk.astype(jnp.int32), values_BLk > -jnp.inf


def top_k_mask(scores_BLS: jax.Array, allowed_BLS: jax.Array, k: int) -> jax.Array:
  """[B, L, S] boolean: `allowed_BLS` narrowed to each query's `top_k_keys` (the dense form of the
  sparse mask, for attention that scores every key and masks the rest)."""
  indices_BLk, valid_BLk = top_k_keys(scores_BLS, allowed_BLS, k)
  batch, length, _ = indices_BLk.shape
  rows_BLk = jnp.arange(batch)[:, None, None]
  cols_BLk = jnp.arange(length)[None, :, None]
  chosen_BLS = jnp.zeros(scores_BLS.shape, bool).at[rows_BLk, cols_BLk, indices_BLk].max(valid_BLk)
  return chosen_BLS & allowed_BLS
