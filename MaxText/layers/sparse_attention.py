"""DeepSeek Sparse Attention over MLA's keys: each query attends to its index_topk allowed keys of
highest index score (layers/indexer.py, masks.top_k_keys). Two forms, chosen by
attention_kernels.sparse_kernel:

- `masked`: the index scores of every (query, key) pair, the top-k as a [B, L, S] mask, and the
  ordinary materialised attention under it (masks.dense_attention). Exact and simple; it computes
  every score, so it is no faster than dense attention (the short-sequence and reference form).
- `gathered`: per block of queries, the index scores of the block against every key, then each
  query's top-k keys gathered from the shared [latent | rope key] rows and attended in MLA's
  absorbed form (one [R + P]-wide key per token, shared by the heads). Only the indexer is
  quadratic; the attention itself costs index_topk keys per query, whatever the length.

Each form also has a `_kl` variant for training the indexer (indexer.py, "Training the indexer"):
the same output plus the sum over queries of the KL from the attention's distribution over each
query's top-k keys (its heads' probabilities averaged) to the indexer's softmax over those keys,
and the number of queries. The gathered form takes the target from the probabilities the block
already holds ([B, Lb, N, T]); the masked form recomputes its scores one head at a time.

Decoding has a `_cache` variant of each form over MLA's compressed cache read where it is stored
(layers/kv_cache.py: latents [B, 1, S, R], rope keys [B, 1, P, S]): the latents and the rope keys
are scored in two dots summed in float32 (masks.latent_cache_attention), the gathered form gathering
only each query's top-k of both. Concatenating them into [S, R + P] keys first would copy the
layer's whole cache every step.

Shape legend (extends layers/mla.py and indexer.py): X = R + P (an absorbed query or key row),
T index_topk, Lb a block of queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import masks
from MaxText.layers.indexer import head_mean_probs, index_scores, indexer_kl

# Queries per block of the gathered form: bounds its [B, Lb, S] index scores and [B, Lb, T, X] gathered keys.
QUERY_BLOCK = 256
# The block's top-k choice, kept from its forward pass for its backward (see _gathered).
TOPK_NAME = "sparse_topk"


def masked_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, allowed_BLS: jax.Array,
                     q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                     soft_cap: float = 0.0) -> jax.Array:
  """Attention of pre-scaled queries under `allowed_BLS` narrowed to each query's top-k keys."""
  scores_BLS = index_scores(q_index_BLIJ, w_BLI, index_keys_BSJ)
  return masks.dense_attention(q_BLNH, k_BSKH, v_BSKH, masks.top_k_mask(scores_BLS, allowed_BLS, topk), soft_cap)


def masked_attention_kl(q_BLNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, allowed_BLS: jax.Array,
                        q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                        soft_cap: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`masked_attention` (one key per query head) and the indexer's KL sum and query count over the top-k sets."""
  scores_BLS = index_scores(q_index_BLIJ, w_BLI, index_keys_BSJ)
  chosen_BLS = masks.top_k_mask(scores_BLS, allowed_BLS, topk)
  out = masks.dense_attention(q_BLNH, k_BSNH, v_BSNH, chosen_BLS, soft_cap)
  kl_sum, count = indexer_kl(head_mean_probs(q_BLNH, k_BSNH, chosen_BLS, soft_cap), scores_BLS, chosen_BLS)
  return out, kl_sum, count


def _gathered_block(q_BLNX: jax.Array, keys_BSX: jax.Array, values_BSR: jax.Array, rope_BPS: jax.Array | None,
                    allowed_BLS: jax.Array, q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array,
                    topk: int, soft_cap: float, kl: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  scores_BLS = index_scores(q_index_BLIJ, w_BLI, index_keys_BSJ)
  indices_BLT, valid_BLT = masks.top_k_keys(scores_BLS, allowed_BLS, topk)
  indices_BLT = checkpoint_name(indices_BLT, TOPK_NAME)
  valid_BLT = checkpoint_name(valid_BLT, TOPK_NAME)
  take = jax.vmap(lambda rows_SX, idx_LT: rows_SX[idx_LT])  # per batch row: [S, X], [L, T] -> [L, T, X]
  keys_BLTX, values_BLTR = take(keys_BSX, indices_BLT), take(values_BSR, indices_BLT)
  if rope_BPS is None:
    logits_BLNT = jnp.einsum("blnx,bltx->blnt", q_BLNX, keys_BLTX, preferred_element_type=jnp.float32)
  else:  # only the chosen columns of the rope keys, scored by a second dot: no [S, R + P] key is built
    width = keys_BSX.shape[-1]
    rope_BPLT = jax.vmap(lambda columns_PS, idx_LT: columns_PS[:, idx_LT])(rope_BPS, indices_BLT)
    logits_BLNT = (jnp.einsum("blnr,bltr->blnt", q_BLNX[..., :width], keys_BLTX, preferred_element_type=jnp.float32)
                   + jnp.einsum("blnp,bplt->blnt", q_BLNX[..., width:], rope_BPLT,
                                preferred_element_type=jnp.float32))
  if soft_cap > 0:
    logits_BLNT = soft_cap * jnp.tanh(logits_BLNT / soft_cap)
  logits_BLNT = jnp.where(valid_BLT[:, :, None, :], logits_BLNT, masks.MASK_VALUE)
  probs_BLNT = jax.nn.softmax(logits_BLNT, axis=-1)
  out_BLNR = jnp.einsum("blnt,bltr->blnr", probs_BLNT.astype(values_BSR.dtype), values_BLTR)
  if not kl:
    zero = jnp.zeros((), jnp.float32)
    return out_BLNR, zero, zero
  # The target from the probabilities this block already holds: the heads' mean over the top-k keys.
  target_BLT = jnp.where(valid_BLT, jnp.mean(probs_BLNT, axis=2), 0.0)
  chosen_scores_BLT = jnp.take_along_axis(scores_BLS, indices_BLT, axis=-1)
  kl_sum, count = indexer_kl(target_BLT, chosen_scores_BLT, valid_BLT)
  return out_BLNR, kl_sum, count


def gathered_attention(q_BLNX: jax.Array, keys_BSX: jax.Array, values_BSR: jax.Array, q_pos_BL: jax.Array,
                       k_pos_BS: jax.Array, q_seg_BL: jax.Array | None, k_seg_BS: jax.Array | None,
                       q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                       soft_cap: float = 0.0) -> jax.Array:
  """[B, L, N, R]: absorbed attention of pre-scaled queries over each one's top-k of the shared
  key rows (allowed: masks.allowed of the positions and segment ids), values the latents."""
  return _gathered(q_BLNX, keys_BSX, values_BSR, None, q_pos_BL, k_pos_BS, q_seg_BL, k_seg_BS, q_index_BLIJ, w_BLI,
                   index_keys_BSJ, topk, soft_cap, False)[0]


def gathered_attention_kl(q_BLNX: jax.Array, keys_BSX: jax.Array, values_BSR: jax.Array, q_pos_BL: jax.Array,
                          k_pos_BS: jax.Array, q_seg_BL: jax.Array | None, k_seg_BS: jax.Array | None,
                          q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                          soft_cap: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`gathered_attention` and the indexer's KL sum and query count over the top-k sets."""
  return _gathered(q_BLNX, keys_BSX, values_BSR, None, q_pos_BL, k_pos_BS, q_seg_BL, k_seg_BS, q_index_BLIJ, w_BLI,
                   index_keys_BSJ, topk, soft_cap, True)


def masked_cache_attention(q_BLNX: jax.Array, latent_BKSR: jax.Array, rope_BKPS: jax.Array, allowed_BLS: jax.Array,
                           q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                           soft_cap: float = 0.0) -> jax.Array:
  """`masked_attention` over MLA's compressed decode cache read in its stored layouts (K = 1): latents
  [B, K, S, R] and rope keys [B, K, P, S] scored as masks.latent_cache_attention does."""
  chosen_BLS = masks.top_k_mask(index_scores(q_index_BLIJ, w_BLI, index_keys_BSJ), allowed_BLS, topk)
  return masks.latent_cache_attention(q_BLNX, latent_BKSR, rope_BKPS, chosen_BLS, soft_cap)


def gathered_cache_attention(q_BLNX: jax.Array, latent_BSR: jax.Array, rope_BPS: jax.Array, q_pos_BL: jax.Array,
                             q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
                             soft_cap: float = 0.0) -> jax.Array:
  """`gathered_attention` over MLA's compressed decode cache (index = position) in its stored layouts:
  latents [B, S, R] (the keys' first R features and the values) and rope keys [B, P, S]. Each query
  gathers only its top-k latents and rope keys and scores the two in separate dots, summed in float32."""
  k_pos_1S = jnp.arange(latent_BSR.shape[1])[None]
  return _gathered(q_BLNX, latent_BSR, latent_BSR, rope_BPS, q_pos_BL, k_pos_1S, None, None, q_index_BLIJ, w_BLI,
                   index_keys_BSJ, topk, soft_cap, False)[0]


def _gathered(q_BLNX: jax.Array, keys_BSX: jax.Array, values_BSR: jax.Array, rope_BPS: jax.Array | None,
              q_pos_BL: jax.Array, k_pos_BS: jax.Array, q_seg_BL: jax.Array | None, k_seg_BS: jax.Array | None,
              q_index_BLIJ: jax.Array, w_BLI: jax.Array, index_keys_BSJ: jax.Array, topk: int,
              soft_cap: float, kl: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The gathered form, keys_BSX whole [S, X] rows, or with rope_BPS (decoding) the first features of
  each key, the rest stored position-last in rope_BPS and scored by a second dot."""
  length = q_BLNX.shape[1]
  block = QUERY_BLOCK if length > QUERY_BLOCK and length % QUERY_BLOCK == 0 else length

  def one_block(args: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    q_BLNX, q_pos_BL, q_seg_BL, q_index_BLIJ, w_BLI = args
    allowed_BLS = masks.allowed(q_pos_BL, k_pos_BS, q_seg_BL if k_seg_BS is not None else None, k_seg_BS)
    return _gathered_block(q_BLNX, keys_BSX, values_BSR, rope_BPS, allowed_BLS, q_index_BLIJ, w_BLI, index_keys_BSJ,
                           topk, soft_cap, kl)

  q_seg = q_seg_BL if q_seg_BL is not None else jnp.zeros(q_pos_BL.shape, jnp.int32)
  q_pos = jnp.broadcast_to(q_pos_BL, q_BLNX.shape[:2])
  args = (q_BLNX, q_pos, jnp.broadcast_to(q_seg, q_BLNX.shape[:2]), q_index_BLIJ, w_BLI)
  # Rematerialised per block: the backward pass recomputes each block's gathered rows, so the
  # training step never holds all queries' [T, X] rows at once. It keeps each query's top-k
  # indices ([B, L, T] int32, one element per gathered row of X) instead of sorting every row's scores again:
  # the top-k is the quadratic part, and its gradient is none (the choice is discrete).
  one_block = jax.checkpoint(one_block, policy=jax.checkpoint_policies.save_only_these_names(TOPK_NAME))
  if block == length:
    return one_block(args)
  # [B, L, ...] -> [L / Lb, B, Lb, ...], one block at a time, back to [B, L, N, R].
  blocked = tuple(jnp.moveaxis(a.reshape(a.shape[0], length // block, block, *a.shape[2:]), 1, 0) for a in args)
  out, kl_sums, counts = jax.lax.map(one_block, blocked)
  return (jnp.moveaxis(out, 0, 1).reshape(q_BLNX.shape[:3] + (values_BSR.shape[-1],)), jnp.sum(kl_sums),
          jnp.sum(counts))
