"""Decoder-layer variants, one registered class per model family.

A family adds a class here (or in its own file) with `@register_decoder("name")`;
models.py looks the class up by `decoder_block` and never switches on names.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText import sharding
from MaxText.config_groups import ModelConfig
from MaxText.errors import ConfigError
from MaxText.layers.attention import Attention
from MaxText.layers.linears import dropout
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.normalizations import RMSNorm

ACTIVATION_NAMES = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(Protocol):
  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None) -> jax.Array: ...


_DECODERS: dict[str, Callable[..., nnx.Module]] = {}


def register_decoder(name: str) -> Callable[[type], type]:
  def register(cls: type) -> type:
    _DECODERS[name] = cls
    return cls
  return register


def decoder_layer_class(name: str) -> Callable[..., nnx.Module]:
  if name not in _DECODERS:
    raise ConfigError(f"unknown decoder_block {name!r}; registered: {', '.join(sorted(_DECODERS))}")
  return _DECODERS[name]


@register_decoder("llama2")
class LlamaDecoderLayer(nnx.Module):
  """Pre-norm block: x + Attn(RMSNorm(x)), then h + MLP(RMSNorm(h))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    norm = dict(epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
                weight_dtype=jnp.dtype(cfg.weight_dtype))
    self.pre_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)
    self.self_attention = Attention(cfg, rngs=rngs)
    self.post_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)
    self.mlp = MlpBlock(cfg, rngs=rngs)
    self.dropout_rate = cfg.dropout_rate

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None) -> jax.Array:
    attn_rng, mlp_rng = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
    x_BLD = sharding.constrain(x_BLD, ACTIVATION_NAMES)
    attn_BLD = self.self_attention(self.pre_self_attention_layer_norm(x_BLD), positions_BL, segment_ids_BL)
    h_BLD = x_BLD + dropout(attn_BLD, self.dropout_rate, attn_rng)
    mlp_BLD = self.mlp(self.post_self_attention_layer_norm(h_BLD))
    return sharding.constrain(h_BLD + dropout(mlp_BLD, self.dropout_rate, mlp_rng), ACTIVATION_NAMES)
