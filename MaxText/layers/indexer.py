"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2; index_topk > 0 on attention_type=mla).

Shape legend (extends layers/mla.py): I index_n_heads, J index_head_dim, S key positions.

  queries: the MLA query latent (after its RMSNorm) · W_qb → [I, J] per token;
  key: x · W_k → LayerNorm → [J], one per token, shared by every indexer head;
  both rotate their first qk_rope_head_dim features (halves layout, whatever the MLA's own
           rope_interleaved) with the model's RoPE.
  score(t, s) = Σ_i w_i(t) · relu(q_i(t)·k(s) · J**-0.5), w(t) = x(t) · W_w · I**-0.5.
DeepSeek's reference also multiplies q and k by a normalised Hadamard matrix before scoring (for
its FP8 kernel). The matrix is orthogonal, so q·k is unchanged and it is left out (as HF does).

Each query then attends only to its index_topk allowed keys of highest score
(masks.top_k_keys). The choice is discrete, so the language-model loss sends the indexer no
gradient, and its inputs are cut from the gradient (stop_gradient on x and the query latent).
Decoding caches the rotated key per token beside MLA's rope key (kv_cache.layer_cache).

Training the indexer (DeepSeek-V3.2's two stages; indexer_loss_scaling_factor > 0): for each query
t the target is the main attention's distribution p(t, ·), its probabilities summed over the heads
and L1-normalised (= their mean over heads), and the indexer's is q(t, ·) = softmax of its scores;
the loss is KL(p ‖ q) = Σ_s p log(p / q), a mean over the queries and the layers.
  * dense warm-up (indexer_warmup): attention stays dense, the KL runs over every allowed (causal,
    same-document) key, and only the indexer trains (training/lora.partition_for freezes the rest);
  * sparse stage: attention over the top-k keys, the KL over each query's top-k set only (both
    distributions renormalised over it). The target is held constant and the indexer's inputs
    are detached, so its loss reaches only its own weights and the LM loss only the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.masks import MASK_VALUE
from MaxText.layers.embeddings import apply_rope, rope_attention_scale, rope_inverse_frequencies
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import LayerNorm

# The published checkpoints fix the key norm's epsilon; it is not a config field.
_KEY_NORM_EPSILON = 1e-6


class LightningIndexer(nnx.Module):
  """Scores every (query, key) pair for the top-k choice: `keys` per token, `scores` against them."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    heads, width = cfg.mla.index_n_heads, cfg.mla.index_head_dim
    dense = functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                              rngs=rngs)
    self.wq_b = dense((cfg.mla.q_lora_rank,), (heads, width), ("embed", "heads", "kv"))
    self.wk = dense((cfg.emb_dim,), (width,), ("embed", None))
    self.k_norm = LayerNorm(width, epsilon=_KEY_NORM_EPSILON, dtype=jnp.dtype(cfg.dtype),
                            weight_dtype=jnp.dtype(cfg.weight_dtype))
    # The head weights stay in float (HF keeps this projection in float32 too): they scale sums of scores.
    self.weights_proj = dense((cfg.emb_dim,), (heads,), ("embed", None), quantize=False)
    self.cfg = cfg

  def _rope(self, x_BLNJ: jax.Array, positions_BL: jax.Array) -> jax.Array:
    cfg = self.cfg
    rope = cfg.mla.qk_rope_head_dim
    rotated = apply_rope(x_BLNJ[..., :rope], positions_BL, rope_inverse_frequencies(cfg.rope, rope), False,
                         rope_attention_scale(cfg.rope))
    return jnp.concatenate([rotated.astype(x_BLNJ.dtype), x_BLNJ[..., rope:]], axis=-1)

  def keys(self, x_BLD: jax.Array, positions_BL: jax.Array) -> jax.Array:
    """The rotated key of each token [B, L, J] (what decoding caches)."""
    k_BLJ = self.k_norm(self.wk(jax.lax.stop_gradient(x_BLD)))
    return self._rope(k_BLJ[:, :, None, :], positions_BL)[:, :, 0, :]

  def queries(self, x_BLD: jax.Array, q_latent_BLQ: jax.Array, positions_BL: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """(rotated queries [B, L, I, J], head weights [B, L, I] float32 with both scales folded in:
    relu(c·s) = c·relu(s) for c > 0)."""
    x_BLD, q_latent_BLQ = jax.lax.stop_gradient(x_BLD), jax.lax.stop_gradient(q_latent_BLQ)
    heads, width = self.cfg.mla.index_n_heads, self.cfg.mla.index_head_dim
    q_BLIJ = self._rope(self.wq_b(q_latent_BLQ), positions_BL)
    w_BLI = self.weights_proj(x_BLD).astype(jnp.float32) * (heads ** -0.5 * width ** -0.5)
    return q_BLIJ, w_BLI


def index_scores(q_BLIJ: jax.Array, w_BLI: jax.Array, keys_BSJ: jax.Array) -> jax.Array:
  """float32 [B, L, S]: each query's index score of each key (unmasked), Σ_i w_i · relu(q_i·k)."""
  dots_BLIS = jnp.einsum("blij,bsj->blis", q_BLIJ, keys_BSJ.astype(q_BLIJ.dtype), preferred_element_type=jnp.float32)
  return jnp.einsum("bli,blis->bls", w_BLI, jax.nn.relu(dots_BLIS))


def indexer_kl(target_BLS: jax.Array, scores_BLS: jax.Array, allowed_BLS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(Σ over queries of KL(target ‖ softmax(scores)) over each query's allowed keys, the number of
  queries with any allowed key), both float32 scalars. `target_BLS` (rows summing to 1 over the
  allowed keys, 0 elsewhere) is held constant: the gradient reaches only the scores."""
  target_BLS = jax.lax.stop_gradient(target_BLS.astype(jnp.float32))
  logits_BLS = jnp.where(allowed_BLS, scores_BLS.astype(jnp.float32), MASK_VALUE)
  any_BL = jnp.any(allowed_BLS, axis=-1)
  log_q_BLS = jax.nn.log_softmax(jnp.where(any_BL[..., None], logits_BLS, 0.0), axis=-1)
  used_BLS = allowed_BLS & (target_BLS > 0)
  safe_p_BLS = jnp.where(used_BLS, target_BLS, 1.0)
  terms_BLS = jnp.where(used_BLS, target_BLS * (jnp.log(safe_p_BLS) - jnp.where(used_BLS, log_q_BLS, 0.0)), 0.0)
  return jnp.sum(terms_BLS), jnp.sum(any_BL.astype(jnp.float32))


def head_mean_probs(q_BLNH: jax.Array, k_BSNH: jax.Array, allowed_BLS: jax.Array, soft_cap: float = 0.0) -> jax.Array:
  """float32 [B, L, S], no gradient: the main attention's probabilities (pre-scaled queries, one
  key per head) under `allowed_BLS`, summed over the heads and L1-normalised (rows with no allowed
  key are 0). Cost: the scores' QKᵀ once more (the attention kernels do not hand out their
  probabilities), one head at a time, so it holds the [B, L, S] sum and one head's [B, L, S]
  probabilities, never [B, N, L, S]."""
  q_NBLH = jnp.moveaxis(jax.lax.stop_gradient(q_BLNH), 2, 0)
  k_NBSH = jnp.moveaxis(jax.lax.stop_gradient(k_BSNH).astype(q_BLNH.dtype), 2, 0)

  def add_head(total_BLS: jax.Array, qk: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    logits_BLS = jnp.einsum("blh,bsh->bls", qk[0], qk[1], preferred_element_type=jnp.float32)
    if soft_cap > 0:
      logits_BLS = soft_cap * jnp.tanh(logits_BLS / soft_cap)
    probs_BLS = jax.nn.softmax(jnp.where(allowed_BLS, logits_BLS, MASK_VALUE), axis=-1)
    return total_BLS + jnp.where(allowed_BLS, probs_BLS, 0.0), None

  total_BLS, _ = jax.lax.scan(add_head, jnp.zeros(allowed_BLS.shape, jnp.float32), (q_NBLH, k_NBSH))
  return total_BLS / q_BLNH.shape[2]
