"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2; index_topk > 0 on attention_type=mla).

Shape legend (extends layers/mla.py): I index_n_heads, J index_head_dim, S key positions.

  queries: the MLA query latent (after its RMSNorm) · W_qb → [I, J] per token;
  key: x · W_k → LayerNorm → [J], one per token, shared by every indexer head;
  both rotate their first qk_rope_head_dim features (halves layout, whatever the MLA's own
           rope_interleaved) with the model's RoPE.
  score(t, s) = Σ_i w_i(t) · relu(q_i(t)·k(s) · J**-0.5), w(t) = x(t) · W_w · I**-0.5.

Each query then attends only to its index_topk allowed keys of highest score
(masks.top_k_keys). The choice is discrete, so the language-model loss sends the indexer no
gradient; its inputs are cut from the gradient so training does not differentiate it at all.
Decoding caches the rotated key per token beside MLA's rope key (kv_cache.layer_cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.configuration.model_config import ModelConfig
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
