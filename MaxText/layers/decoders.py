"""The shared decoder layer and its normalisation variants.

A model family (MaxText/families/) names the layer class it runs in its `Family` record (none: the
pre-norm `DecoderLayer`); the model builds that class and never switches on names. A family whose
layer differs from these keeps its class in its own module under families/.
"""

from __future__ import annotations

from typing import Protocol

import jax
from flax import nnx

from MaxText.platform import sharding
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers.attention import Attention
from MaxText.layers.gated_deltanet import GatedDeltaNet
from MaxText.layers.kv_cache import KVCache
from MaxText.layers.linears import dropout
from MaxText.layers.mla import MultiHeadLatentAttention
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import make_norm

ACTIVATION_NAMES = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayerCall(Protocol):
  """What the model (models/transformer.py) calls on every decoder layer (`layer_index` counts from 0 up the stack)."""

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None, layer_index: int | jax.Array) -> jax.Array: ...


def feed_forward_block(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The one place a decoder layer's MLP is chosen: routed experts when num_experts > 1, else dense."""
  return MoeBlock(cfg, rngs=rngs) if cfg.moe.num_experts > 1 else MlpBlock(cfg, rngs=rngs)


def attention_block(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The one place a decoder layer's attention is chosen: attention_type gqa, mla or gated_deltanet
  (a hybrid stack's dense_layers get gated_deltanet from ModelConfig.dense_stack_config)."""
  if cfg.attn.attention_type == "gated_deltanet":
    return GatedDeltaNet(cfg, rngs=rngs)
  return MultiHeadLatentAttention(cfg, rngs=rngs) if cfg.attn.attention_type == "mla" else Attention(cfg, rngs=rngs)


class DecoderLayer(nnx.Module):
  """Pre-norm block: h = x + Attn(norm(x)), then h + MLP(norm(h)).

  Every dense family shares it; what differs is config-driven (normalization_type, use_bias, use_qk_norm,
  attention_layer_pattern, soft caps, RoPE settings) or a subclass's norm switches below.
  """

  # Also normalise each sub-block's output before it joins the residual stream.
  normalize_block_outputs: bool = False
  # Normalise each sub-block's input (off: the sub-blocks read the residual stream as it is).
  normalize_block_inputs: bool = True

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if self.normalize_block_inputs:
      self.pre_self_attention_layer_norm = make_norm(cfg)
    self.self_attention = attention_block(cfg, rngs)
    if self.normalize_block_inputs:
      self.post_self_attention_layer_norm = make_norm(cfg)  # the norm in front of the MLP
    self.mlp = feed_forward_block(cfg, rngs)
    if self.normalize_block_outputs:
      self.attention_output_norm = make_norm(cfg)
      self.mlp_output_norm = make_norm(cfg)
    self.dropout_rate = cfg.dropout_rate

  def _block_output(self, name: str, y_BLD: jax.Array) -> jax.Array:
    return getattr(self, name)(y_BLD) if self.normalize_block_outputs else y_BLD

  def _block_input(self, name: str, x_BLD: jax.Array) -> jax.Array:
    return getattr(self, name)(x_BLD) if self.normalize_block_inputs else x_BLD

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None, layer_index: int | jax.Array = 0,
               cache: KVCache | None = None, image_blocks_BL: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Output [B, L, D]; with a decode `cache`, (output, updated cache). `image_blocks_BL`: a
    multimodal model's image blocks (masks.image_blocks), for the attention mask."""
    attn_rng, mlp_rng = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
    x_BLD = sharding.constrain(x_BLD, ACTIVATION_NAMES)
    blocks = {} if image_blocks_BL is None else {"image_blocks_BL": image_blocks_BL}
    attn_out = self.self_attention(self._block_input("pre_self_attention_layer_norm", x_BLD), positions_BL,
                                   segment_ids_BL, layer_index, cache, **blocks)
    attn_BLD, cache = attn_out if isinstance(attn_out, tuple) else (attn_out, None)
    h_BLD = x_BLD + dropout(self._block_output("attention_output_norm", attn_BLD), self.dropout_rate, attn_rng)
    mlp_BLD = self.mlp(self._block_input("post_self_attention_layer_norm", h_BLD))
    out_BLD = h_BLD + dropout(self._block_output("mlp_output_norm", mlp_BLD), self.dropout_rate, mlp_rng)
    out_BLD = sharding.constrain(out_BLD, ACTIVATION_NAMES)
    return out_BLD if cache is None else (out_BLD, cache)


class SandwichNormDecoderLayer(DecoderLayer):
  """The shared block with normalised sub-block inputs and outputs ("sandwich" norms)."""

  normalize_block_outputs = True


class PostNormDecoderLayer(DecoderLayer):
  """h = x + norm(Attn(x)), then h + norm(MLP(h)): each sub-block reads the stream unnormalised."""

  normalize_block_outputs = True
  normalize_block_inputs = False
