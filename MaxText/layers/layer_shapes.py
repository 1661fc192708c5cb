"""Per-layer shapes of a stack whose layers differ (configuration/layer_shapes_config.py, Gemma 4):
each layer's kind, its own configuration (head shape, MLP width, a uniform attention pattern), and
which layers read the keys and values of an earlier one.

KV sharing: the last num_kv_shared_layers layers compute no keys or values; each reads those of
the last unshared layer of its kind (local or global), its source. Training hands the source's
keys and values on (`SharedKV`); decoding hands on the source's cache, and a shared layer has no
cache entry of its own (None in the caches' list).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import struct

from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError


@struct.dataclass
class SharedKV:
  """A source layer's keys and values [B, S, K, H] (after norms and RoPE), for the layers sharing them;
  empty (None, None) when handed to a source to fill."""
  key_BSKH: Any = None
  value_BSKH: Any = None


def layer_kinds(cfg: ModelConfig) -> list[str]:
  """Each layer's attention kind (attention_layer_pattern cycled up the stack)."""
  pattern = cfg.attn.attention_layer_pattern
  return [pattern[i % len(pattern)] for i in range(cfg.num_decoder_layers)]


def kv_sources(cfg: ModelConfig) -> dict[int, int]:
  """Shared layer -> the layer whose keys and values it reads."""
  shared = cfg.layer_shapes.num_kv_shared_layers
  if shared == 0:
    return {}
  kinds = layer_kinds(cfg)
  first_shared = len(kinds) - shared
  last_of_kind = {kind: i for i, kind in enumerate(kinds[:first_shared])}
  missing = sorted(set(kinds[first_shared:]) - set(last_of_kind))
  if missing:
    raise ConfigError(f"num_kv_shared_layers={shared} leaves no unshared {missing[0]} layer to share keys and values "
                      f"from; lower num_kv_shared_layers")
  return {i: last_of_kind[kinds[i]] for i in range(first_shared, len(kinds))}


def kv_producers(cfg: ModelConfig) -> frozenset[int]:
  return frozenset(kv_sources(cfg).values())


def layer_config(cfg: ModelConfig, index: int) -> ModelConfig:
  """Layer `index`'s own configuration: the global layers' head shape, the shared layers' MLP width,
  and its kind as the whole (uniform) attention pattern, so every per-layer choice is static."""
  shapes = cfg.layer_shapes
  kind = layer_kinds(cfg)[index]
  head_dim, num_kv = cfg.head_dim, cfg.num_kv_heads
  if kind == "global":
    head_dim, num_kv = shapes.global_head_dim or head_dim, shapes.global_num_kv_heads or num_kv
  shared = index in kv_sources(cfg)
  mlp_dim = cfg.mlp_dim * (2 if shared and shapes.kv_shared_double_mlp else 1)
  if shapes.moe_beside_mlp:  # mlp_dim is the experts' width; the dense MLP's is dense_mlp_dim
    mlp_dim = cfg.moe.dense_mlp_dim or cfg.mlp_dim
  return dataclasses.replace(cfg, head_dim=head_dim, num_kv_heads=num_kv, mlp_dim=mlp_dim,
                             attn=dataclasses.replace(cfg.attn, attention_layer_pattern=(kind,)))


def has_own_kv(cfg: ModelConfig, index: int) -> bool:
  return index not in kv_sources(cfg)
