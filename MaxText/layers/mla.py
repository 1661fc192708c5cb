"""Multi-head latent attention (MLA; DeepSeek-V2/V3), selected by attention_type=mla.

Shape legend (extends layers/__init__.py): Q q_lora_rank, R kv_lora_rank, P qk_rope_head_dim,
C qk_nope_head_dim, V v_head_dim; each query/key head is [C + P] wide (head_dim), each value head V.

  queries: x·W_q (q_lora_rank = 0), or x·W_qa → RMSNorm → ·W_qb (the low-rank form);
           each head splits into a no-position part [C] and a rotated part [P].
  keys/values: x·W_kva = [latent (R) | shared rope key (P)]; the latent is RMSNorm'd and
           expanded per head by W_kvb into the no-position key [C] and the value [V]; the rope
           key is rotated once and shared by every head.
  scores: (q_nope·k_nope + q_rope·k_rope) · head_dim**-0.5, times DeepSeek's YaRN correction
           (embeddings.rope_softmax_scale).

Training runs the core attention through the ATTENTION_KERNELS of attention.py (the value heads
are zero-padded to head_dim for the fused kernels, which take one head width; dot_product takes
them as they are). Decoding caches only the normalised latent and the rotated rope key per token
(R + P numbers instead of N·(head_dim + V)) and attends in the absorbed form: W_kvb's key half is
folded into the queries and its value half applied after the attention, so the cache is never
expanded per head.

With index_topk > 0 (DeepSeek-V3.2's sparse attention) a lightning indexer (layers/indexer.py)
picks each query's index_topk keys and the attention sees only those (layers/sparse_attention.py,
its form from attention_kernels.sparse_kernel); decoding caches the indexer's key beside the
rope key (the cache's value array holds [rope key | indexer key], with an int8 scale each when
quantized: kv_cache.mla_row_groups). Training the indexer (indexer_loss_scaling_factor > 0,
indexer.py's "Training the indexer") sows its KL loss as `indexer_kl_sum` and `indexer_queries`
(the objective takes their ratio); with indexer_warmup the attention stays dense and the KL covers
every allowed key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.platform import sharding
from MaxText.layers import attention_kernels, context_parallel, kv_cache, masks, sparse_attention
from MaxText.layers.attention import ATTENTION_KERNELS, layer_window_size, select_kernel
from MaxText.layers import indexer
from MaxText.layers.indexer import LightningIndexer
from MaxText.layers.embeddings import apply_rope, rope_attention_scale, rope_inverse_frequencies, rope_softmax_scale
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import RMSNorm
from MaxText.configuration.model_config import ModelConfig

_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")



def _full_key(k_nope_BLNC: jax.Array, k_rope_BL1P: jax.Array, rope_shape: tuple[int, ...]) -> jax.Array:
  """Each head's key: its own no-position part and the shared rotated part, named key_proj as
  upstream's attention_mla.py names the whole key (not only the no-position part)."""
  rope_BLNP = jnp.broadcast_to(k_rope_BL1P, rope_shape).astype(k_nope_BLNC.dtype)
  return checkpoint_name(jnp.concatenate([k_nope_BLNC, rope_BLNP], axis=-1), "key_proj")


def _full_query(q_nope_BLNC: jax.Array, q_rope_BLNP: jax.Array) -> jax.Array:
  """Each head's scaled query, its no-position part and its rotated part, named query_proj as upstream's
  attention_mla.py names the query it hands the attention (not the up-projection's output)."""
  return checkpoint_name(jnp.concatenate([q_nope_BLNC, q_rope_BLNP.astype(q_nope_BLNC.dtype)], axis=-1), "query_proj")


class MultiHeadLatentAttention(nnx.Module):
  """Same call as attention.Attention: x [B, L, D] → [B, L, D]; with a decode cache, (output, cache)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n = cfg.emb_dim, cfg.num_query_heads
    qk, rope, v = cfg.head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    dense = functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                              rngs=rngs)
    norm = functools.partial(RMSNorm, epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
                             weight_dtype=jnp.dtype(cfg.weight_dtype))
    # A rank is replicated where it is the output (the input is the fsdp-sharded model width) and
    # named "embed" where it is the input, so the up-projections are fsdp-sharded like the rest.
    if cfg.mla.q_lora_rank > 0:
      self.wq_a = dense((d,), (cfg.mla.q_lora_rank,), ("embed", None), tag="query_wa_proj",
                        **cfg.lora.adapter("q_a_proj"))
      self.q_norm = norm(cfg.mla.q_lora_rank)
      self.wq_b = dense((cfg.mla.q_lora_rank,), (n, qk), ("embed", "heads", "kv"), **cfg.lora.adapter("q_b_proj"))
    else:
      self.query = dense((d,), (n, qk), ("embed", "heads", "kv"), **cfg.lora.adapter("q_proj"))
    self.wkv_a = dense((d,), (cfg.mla.kv_lora_rank + rope,), ("embed", None), tag="kv_wa_proj",
                       **cfg.lora.adapter("kv_a_proj_with_mqa"))
    self.kv_norm = norm(cfg.mla.kv_lora_rank)
    # Its keys and values are named after the split (key_proj, value_proj), and the queries after RoPE and
    # the scale (query_proj, _full_query), as remat placements.
    self.wkv_b = dense((cfg.mla.kv_lora_rank,), (n, cfg.mla.qk_nope_head_dim + v), ("embed", "heads", "kv"),
                       **cfg.lora.adapter("kv_b_proj"))
    self.out = dense((n, v), (d,), ("heads", "kv", "embed"), tag="out_proj", **cfg.lora.adapter("o_proj"))
    if cfg.mla.index_topk > 0:
      self.indexer = LightningIndexer(cfg, rngs=rngs)
    self.cfg = cfg
    self.kernel_name = select_kernel(cfg.attn.attention)
    self.kernel = ATTENTION_KERNELS[self.kernel_name](cfg)
    self.query_scale = qk ** -0.5 * rope_softmax_scale(cfg.rope)

  def _rope(self, x_BLNP: jax.Array, positions_BL: jax.Array) -> jax.Array:
    cfg = self.cfg
    return apply_rope(x_BLNP, positions_BL, rope_inverse_frequencies(cfg.rope, cfg.mla.qk_rope_head_dim),
                      cfg.rope.rope_interleaved, rope_attention_scale(cfg.rope))

  def _queries(self, x_BLD: jax.Array, q_latent_BLQ: jax.Array | None, positions_BL: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """(no-position part [B, L, N, C], rotated part [B, L, N, P]), both already scaled."""
    cfg = self.cfg
    q_BLNH = self.query(x_BLD) if q_latent_BLQ is None else self.wq_b(q_latent_BLQ)
    q_BLNH = sharding.constrain(q_BLNH * jnp.asarray(self.query_scale, q_BLNH.dtype), _HEADS)
    nope = cfg.mla.qk_nope_head_dim
    return q_BLNH[..., :nope], self._rope(q_BLNH[..., nope:], positions_BL)

  def _latent(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(normalised latent [B, L, R], rotated shared rope key [B, L, 1, P]): what decoding caches."""
    kv_BLr = self.wkv_a(x_BLD)
    rank = self.cfg.mla.kv_lora_rank
    return (checkpoint_name(self.kv_norm(kv_BLr[..., :rank]), "mla_kv"),
            self._rope(kv_BLr[:, :, None, rank:], positions_BL))

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               layer_index: int | jax.Array = 0, cache: kv_cache.KVCache | None = None
               ) -> jax.Array | tuple[jax.Array, kv_cache.KVCache]:
    cfg = self.cfg
    q_latent_BLQ = checkpoint_name(self.q_norm(self.wq_a(x_BLD)), "mla_q") if cfg.mla.q_lora_rank > 0 else None
    q_nope_BLNC, q_rope_BLNP = self._queries(x_BLD, q_latent_BLQ, positions_BL)
    latent_BLR, k_rope_BL1P = self._latent(x_BLD, positions_BL)
    index = None
    if cfg.mla.index_topk > 0:
      assert q_latent_BLQ is not None  # config validation: the indexer needs q_lora_rank > 0
      index = (*self.indexer.queries(x_BLD, q_latent_BLQ, positions_BL), self.indexer.keys(x_BLD, positions_BL))
    if cache is not None:
      return self._decode(q_nope_BLNC, q_rope_BLNP, latent_BLR, k_rope_BL1P, positions_BL, layer_index, cache, index)
    if index is not None and not cfg.mla.indexer_warmup:
      # In natural order even when the batch is load-balanced: the masks count positions by array
      # index, and the top-k breaks ties between equal scores by it.
      def sparse(q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, segments: jax.Array,
                 *index_parts: jax.Array) -> jax.Array:
        parts = tuple(index_parts)
        return self._sparse(q_nope, q_rope, latent, k_rope, segments, (parts[0], parts[1], parts[2]))

      return context_parallel.in_natural_order(cfg.attn, sparse, q_nope_BLNC, q_rope_BLNP, latent_BLR, k_rope_BL1P,
                                               segment_ids_BL, *index)
    kv_BLNX = self.wkv_b(latent_BLR)
    k_nope_BLNC = kv_BLNX[..., :cfg.mla.qk_nope_head_dim]
    v_BLNV = checkpoint_name(kv_BLNX[..., cfg.mla.qk_nope_head_dim:], "value_proj")
    k_BLNH = _full_key(k_nope_BLNC, k_rope_BL1P, q_rope_BLNP.shape)
    q_BLNH = _full_query(q_nope_BLNC, q_rope_BLNP)
    k_BLNH, v_BLNV = sharding.constrain(k_BLNH, _HEADS), sharding.constrain(v_BLNV, _HEADS)
    width = v_BLNV.shape[-1]
    if self.kernel_name != "dot_product" and width != q_BLNH.shape[-1]:  # fused kernels: one head width
      v_BLNV = jnp.pad(v_BLNV, ((0, 0), (0, 0), (0, 0), (0, q_BLNH.shape[-1] - width)))
    out_BLNV = self.kernel(q_BLNH, k_BLNH, v_BLNV, segment_ids_BL, layer_window_size(cfg.attn, layer_index),
                           cfg.attn.attn_logits_soft_cap)[..., :width]
    if index is not None:  # the dense warm-up: the indexer learns the dense attention over every allowed key
      allowed_BLS = context_parallel.sequence_self_mask(cfg.attn, segment_ids_BL)  # the batch may be load-balanced
      target_BLS = indexer.head_mean_probs(q_BLNH, k_BLNH, allowed_BLS, cfg.attn.attn_logits_soft_cap)
      self._sow_indexer_loss(*indexer.indexer_kl(target_BLS, indexer.index_scores(*index), allowed_BLS))
    return self.out(checkpoint_name(sharding.constrain(out_BLNV, _HEADS), "attention_out"))

  def _sow_indexer_loss(self, kl_sum: jax.Array, queries: jax.Array) -> None:
    """The indexer's KL summed over this layer's queries, and their count (the objective's mean is the ratio)."""
    self.sow(nnx.Intermediate, "indexer_kl_sum", kl_sum)
    self.sow(nnx.Intermediate, "indexer_queries", queries)

  def _absorbed(self, q_nope_BLNC: jax.Array, q_rope_BLNP: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(absorbed queries [B, L, N, R + P], W_kvb's value half [R, N, V])."""
    cfg = self.cfg
    w_kvb_RNX = self.wkv_b.merged_kernel().astype(q_nope_BLNC.dtype)  # its LoRA adapter (kv_b_proj) included
    w_k_RNC, w_v_RNV = w_kvb_RNX[..., :cfg.mla.qk_nope_head_dim], w_kvb_RNX[..., cfg.mla.qk_nope_head_dim:]
    # q_nope·(latent·W_k) = (q_nope·W_kᵀ)·latent: one [R]-wide query per head against the shared latent.
    q_latent_BLNR = jnp.einsum("blnc,rnc->blnr", q_nope_BLNC, w_k_RNC)
    return jnp.concatenate([q_latent_BLNR, q_rope_BLNP.astype(q_latent_BLNR.dtype)], axis=-1), w_v_RNV

  def _sparse(self, q_nope_BLNC: jax.Array, q_rope_BLNP: jax.Array, latent_BLR: jax.Array, k_rope_BL1P: jax.Array,
              segment_ids_BL: jax.Array, index: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """Training / prefill with DeepSeek Sparse Attention, in the form the kernel table picks."""
    cfg = self.cfg
    length, topk = latent_BLR.shape[1], cfg.mla.index_topk
    if attention_kernels.sparse_kernel(length, topk) == "masked":
      kv_BLNX = self.wkv_b(latent_BLR)
      nope = cfg.mla.qk_nope_head_dim
      v_BLNV = checkpoint_name(kv_BLNX[..., nope:], "value_proj")
      k_BLNH = _full_key(kv_BLNX[..., :nope], k_rope_BL1P, q_rope_BLNP.shape)
      q_BLNH = _full_query(q_nope_BLNC, q_rope_BLNP)
      args = (sharding.constrain(q_BLNH, _HEADS), sharding.constrain(k_BLNH, _HEADS),
              sharding.constrain(v_BLNV, _HEADS), masks.self_mask(segment_ids_BL), *index, topk,
              cfg.attn.attn_logits_soft_cap)
      if cfg.mla.indexer_loss_scaling_factor > 0:
        out_BLNV, kl_sum, queries = sparse_attention.masked_attention_kl(*args)
        self._sow_indexer_loss(kl_sum, queries)
      else:
        out_BLNV = sparse_attention.masked_attention(*args)
      return self.out(checkpoint_name(sharding.constrain(out_BLNV, _HEADS), "attention_out"))
    q_BLNH = _full_query(q_nope_BLNC, q_rope_BLNP)  # named as on the other paths, then split again
    nope = cfg.mla.qk_nope_head_dim
    q_BLNX, w_v_RNV = self._absorbed(q_BLNH[..., :nope], q_BLNH[..., nope:])
    keys_BLX = jnp.concatenate([latent_BLR, k_rope_BL1P[:, :, 0].astype(latent_BLR.dtype)], axis=-1)
    positions_1L = jnp.arange(length)[None]
    gathered_args = (q_BLNX, keys_BLX, latent_BLR, positions_1L, positions_1L, segment_ids_BL, segment_ids_BL,
                     *index, topk, cfg.attn.attn_logits_soft_cap)
    if cfg.mla.indexer_loss_scaling_factor > 0:
      out_latent_BLNR, kl_sum, queries = sparse_attention.gathered_attention_kl(*gathered_args)
      self._sow_indexer_loss(kl_sum, queries)
    else:
      out_latent_BLNR = sparse_attention.gathered_attention(*gathered_args)
    out_BLNV = jnp.einsum("blnr,rnv->blnv", out_latent_BLNR, w_v_RNV)
    return self.out(checkpoint_name(sharding.constrain(out_BLNV, _HEADS), "attention_out"))

  def _decode(self, q_nope_BLNC: jax.Array, q_rope_BLNP: jax.Array, latent_BLR: jax.Array, k_rope_BL1P: jax.Array,
              positions_BL: jax.Array, layer_index: int | jax.Array, cache: kv_cache.KVCache,
              index: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> tuple[jax.Array, kv_cache.KVCache]:
    """Absorbed attention over the compressed cache read in its stored layouts: latents [B, 1, S, R] as
    its keys, then [B, 1, Y, S] holding the rotated rope keys [P], followed by the indexer's keys [J]
    with index_topk > 0 (cached under indexer_warmup too, whose attention is dense). The latents and rope keys
    are scored by two dots, never concatenated."""
    cfg = self.cfg
    rope = cfg.mla.qk_rope_head_dim
    cached_BL1Y = k_rope_BL1P if index is None else jnp.concatenate(
        [k_rope_BL1P, index[2][:, :, None, :].astype(k_rope_BL1P.dtype)], axis=-1)
    groups = kv_cache.mla_row_groups(cfg)  # int8: the rope and indexer keys each scaled on their own
    cache = kv_cache.write(cache, latent_BLR[:, :, None, :], cached_BL1Y, positions_BL, groups)
    q_BLNX, w_v_RNV = self._absorbed(q_nope_BLNC, q_rope_BLNP)
    window = layer_window_size(cfg.attn, layer_index)
    latent_B1SR, rows_B1YS = cache.read(q_nope_BLNC.dtype, groups)
    rope_B1PS, length = rows_B1YS[:, :, :rope], latent_B1SR.shape[2]
    soft_cap = cfg.attn.attn_logits_soft_cap
    if index is None or cfg.mla.indexer_warmup:  # the warm-up's attention stays dense, as in its forward
      out_latent_BLNR = masks.latent_cache_attention(q_BLNX, latent_B1SR, rope_B1PS,
                                                     masks.cache_mask(positions_BL, length, window), soft_cap)
    else:
      q_index_BLIJ, w_BLI, _ = index
      index_keys_BSJ = jnp.swapaxes(rows_B1YS[:, 0, rope:], 1, 2)  # a view: the indexer's dot reads [J, S] in place
      topk = cfg.mla.index_topk
      if attention_kernels.sparse_kernel(length, topk) == "masked":
        out_latent_BLNR = sparse_attention.masked_cache_attention(
            q_BLNX, latent_B1SR, rope_B1PS, masks.cache_mask(positions_BL, length, window), q_index_BLIJ, w_BLI,
            index_keys_BSJ, topk, soft_cap)
      else:
        out_latent_BLNR = sparse_attention.gathered_cache_attention(
            q_BLNX, latent_B1SR[:, 0], rope_B1PS[:, 0], positions_BL, q_index_BLIJ, w_BLI, index_keys_BSJ, topk,
            soft_cap)
    out_BLNV = jnp.einsum("blnr,rnv->blnv", out_latent_BLNR, w_v_RNV)
    return self.out(sharding.constrain(out_BLNV, _HEADS)), cache
