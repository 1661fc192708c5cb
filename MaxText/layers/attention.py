"""Grouped-query self-attention with RoPE and causal + document (segment) masking.

Kernels are looked up by name in ATTENTION_KERNELS so flash / cuDNN / splash
implementations can be added without touching the layer.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText import sharding
from MaxText.config_groups import ModelConfig
from MaxText.layers.embeddings import apply_rope
from MaxText.layers.linears import DenseGeneral

# Large finite negative (not -inf) so fully masked rows (padding) stay NaN-free.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids_BL: jax.Array) -> jax.Array:
  """[B, 1, 1, L, S] boolean: key s is visible to query l (causal, same document)."""
  length = segment_ids_BL.shape[1]
  causal_LS = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
  same_segment_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
  return (causal_LS[None] & same_segment_BLS)[:, None, None]


def dot_product_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                          segment_ids_BL: jax.Array) -> jax.Array:
  """Plain XLA attention; softmax in float32. Queries must already be scaled."""
  batch, length, num_q, head_dim = q_BLNH.shape
  num_kv = k_BSKH.shape[2]
  q_BLKGH = q_BLNH.reshape(batch, length, num_kv, num_q // num_kv, head_dim)
  logits_BKGLS = jnp.einsum("blkgh,bskh->bkgls", q_BLKGH, k_BSKH, preferred_element_type=jnp.float32)
  logits_BKGLS = jnp.where(attention_mask(segment_ids_BL), logits_BKGLS, _MASK_VALUE)
  probs_BKGLS = jax.nn.softmax(logits_BKGLS, axis=-1).astype(v_BSKH.dtype)
  out_BLKGH = jnp.einsum("bkgls,bskh->blkgh", probs_BKGLS, v_BSKH)
  return out_BLKGH.reshape(batch, length, num_q, head_dim)


AttentionKernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
ATTENTION_KERNELS: dict[str, AttentionKernel] = {"dot_product": dot_product_attention}


def select_kernel(name: str, platform: str | None = None) -> str:
  """Resolves `autoselected` to the best kernel available; only dot_product exists so far."""
  del platform  # Every platform uses dot_product until fused kernels land.
  return "dot_product" if name == "autoselected" else name


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    dense = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    self.query = DenseGeneral((d,), (n, h), ("embed", "heads", "kv"), tag="query_proj", **dense)
    self.key = DenseGeneral((d,), (k, h), ("embed", "kv_heads", "kv"), tag="key_proj", **dense)
    self.value = DenseGeneral((d,), (k, h), ("embed", "kv_heads", "kv"), tag="value_proj", **dense)
    self.out = DenseGeneral((n, h), (d,), ("heads", "kv", "embed"), tag="out_proj", **dense)
    self.cfg = cfg
    self.kernel = ATTENTION_KERNELS[select_kernel(cfg.attention)]

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array) -> jax.Array:
    cfg = self.cfg
    heads_names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
    kv_names = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
    q_BLNH = apply_rope(self.query(x_BLD), positions_BL, cfg.rope_min_timescale, cfg.rope_max_timescale)
    k_BSKH = apply_rope(self.key(x_BLD), positions_BL, cfg.rope_min_timescale, cfg.rope_max_timescale)
    q_BLNH = sharding.constrain(q_BLNH * cfg.head_dim**-0.5, heads_names)
    k_BSKH = sharding.constrain(k_BSKH, kv_names)
    v_BSKH = sharding.constrain(self.value(x_BLD), kv_names)
    out_BLNH = sharding.constrain(self.kernel(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL), heads_names)
    return self.out(out_BLNH)
