"""Llama 4's image side (the llama4 family's `vision` tower, families/llama4.py): its vision encoder,
the pixel-shuffle adapter and the projector into the text width.

  tile pixel values [I, C, R, R] (families/llama4_images.py: each image's tiles, then its
  global thumbnail, each a separate "image" here)
    ─► Llama4VisionEncoder: R/p x R/p patches (an unfold + a linear without bias, computed as a
       dense layer over each flattened patch), a learned class token appended last, learned
       position embeddings ─► LayerNorm ─► pre-LayerNorm encoder layers (bidirectional attention
       with a 2-D RoPE over the patch grid, exact GELU MLP, biases), scanned ─► LayerNorm ─►
       class token dropped ─► pixel shuffle (each s x s block of patches, s = 1 / ratio, becomes
       one token s² times as wide) ─► adapter MLP (fc1, GELU, fc2, GELU; no biases)
    ─► Llama4Projector: one linear without bias into emb_dim   = soft tokens [I, T, D]
  ─► vision_tower.place_image_tokens, as for Gemma 3. The text stack stays causal over them
     (HF's Llama 4 builds no image block mask).

Sharding: as vision_tower.py, the parameters carry the text stack's logical names ("embed",
"mlp", "heads"), so they are FSDP-sharded like the decoder rather than replicated whole.

Legend (besides layers/__init__.py's): I images (tiles), P patches per tile, Q = P + 1 with the
class token, E vision width, W vision MLP width, A vision heads, Y vision head width, F adapter
width, T soft tokens per tile, C channels, R tile side.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.configuration.config_fields import require
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import masks, vision_tower
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import LayerNorm
from MaxText.platform import sharding

NUM_CHANNELS = 3
IMAGE_NAMES = ("activation_batch", "activation_length", "activation_embed")


def check_vision_keys(values: Mapping[str, Any]) -> None:
  """Llama 4's tower: a 2-D RoPE over the head width's quarters, a pixel shuffle by an integer
  factor s = 1 / vision_pixel_shuffle_ratio, and s x s patches per soft token."""
  ratio, heads = values["vision_pixel_shuffle_ratio"], values["vision_emb_dim"] // values["vision_num_heads"]
  require(values["vision_rope_max_timescale"] > 0,
          f"vision_rope_max_timescale must be > 0, got {values['vision_rope_max_timescale']}")
  require(values["vision_adapter_dim"] > 0, f"vision_adapter_dim must be > 0, got {values['vision_adapter_dim']}")
  require(heads % 4 == 0, f"the vision head width vision_emb_dim / vision_num_heads ({heads}) must be a multiple of "
          "4 for decoder_block llama4 (its 2-D RoPE turns a quarter of the pairs per axis)")
  factor = round(1 / ratio) if 0 < ratio <= 1 else 0
  require(factor >= 1 and math.isclose(factor * ratio, 1.0),
          f"vision_pixel_shuffle_ratio must be 1 / an integer (0.5 in the releases), got {ratio}")
  side = values["vision_image_size"] // values["vision_patch_size"]
  require(side % factor == 0, f"the {side} patches per tile side must be a multiple of 1 / vision_pixel_shuffle_ratio "
          f"({factor})")
  tokens = (side // factor) ** 2
  require(values["mm_tokens_per_image"] == tokens,
          f"mm_tokens_per_image ({values['mm_tokens_per_image']}) must be {tokens} for decoder_block llama4: the "
          f"({side} / {factor})² soft tokens of one tile")


def _dense(cfg: ModelConfig, rngs: nnx.Rngs, use_bias: bool) -> functools.partial[DenseGeneral]:
  return functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                           rngs=rngs, use_bias=use_bias, quantize=False)


def _layer_norm(cfg: ModelConfig) -> LayerNorm:
  return LayerNorm(cfg.vision.vision_emb_dim, epsilon=cfg.vision.vision_layer_norm_epsilon,
                   dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))


def rope_angles(patches_per_side: int, head_dim: int, theta: float) -> np.ndarray:
  """float32 [Q, Y / 2]: the angle each interleaved pair (x[2j], x[2j+1]) of a head turns by at
  each patch (row-major), then at the class token (none). Pairs j < Y / 4 turn with the patch's
  column + 1, the others with its row + 1, both at frequencies theta^(-4k / Y), k < Y / 4."""
  freqs = 1.0 / theta ** (np.arange(head_dim // 4, dtype=np.float64) * 4 / head_dim)
  index = np.arange(patches_per_side**2)
  cols, rows = index % patches_per_side + 1, index // patches_per_side + 1
  angles = np.concatenate([cols[:, None] * freqs[None], rows[:, None] * freqs[None]], axis=1)
  return np.concatenate([angles, np.zeros((1, angles.shape[1]))]).astype(np.float32)


def rotate_pairs(x_IQAY: jax.Array, angles_QJ: jax.Array) -> jax.Array:
  """Each interleaved pair of every head turned by its angle, in float32."""
  x = x_IQAY.astype(jnp.float32).reshape(x_IQAY.shape[:-1] + (-1, 2))
  cos, sin = jnp.cos(angles_QJ)[None, :, None], jnp.sin(angles_QJ)[None, :, None]
  even, odd = x[..., 0], x[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return rotated.reshape(x_IQAY.shape).astype(x_IQAY.dtype)


class Llama4VisionAttention(nnx.Module):
  """Multi-head self-attention over a tile's patches and class token, all seeing all, with the 2-D RoPE."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, a, y = cfg.vision.vision_emb_dim, cfg.vision.vision_num_heads, cfg.vision.vision_head_dim
    dense = _dense(cfg, rngs, use_bias=True)
    self.query = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.key = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.value = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.out = dense((a, y), (e,), ("heads", "kv", "embed"))
    self.scale = y**-0.5

  def __call__(self, x_IQE: jax.Array, angles_QJ: jax.Array) -> jax.Array:
    q_IQAY = rotate_pairs(self.query(x_IQE), angles_QJ)
    q_IQAY = q_IQAY * jnp.asarray(self.scale, q_IQAY.dtype)
    k_IQAY = rotate_pairs(self.key(x_IQE), angles_QJ)
    everything_1QQ = jnp.ones((1,) + x_IQE.shape[1:2] * 2, jnp.bool_)
    return self.out(masks.dense_attention(q_IQAY, k_IQAY, self.value(x_IQE), everything_1QQ))


class Llama4VisionLayer(nnx.Module):
  """x + Attn(LN(x)), then h + MLP(LN(h)) with the exact (erf) GELU."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, w = cfg.vision.vision_emb_dim, cfg.vision.vision_mlp_dim
    dense = _dense(cfg, rngs, use_bias=True)
    self.layer_norm1, self.layer_norm2 = _layer_norm(cfg), _layer_norm(cfg)
    self.attention = Llama4VisionAttention(cfg, rngs=rngs)
    self.fc1 = dense((e,), (w,), ("embed", "mlp"))
    self.fc2 = dense((w,), (e,), ("mlp", "embed"))

  def __call__(self, x_IQE: jax.Array, angles_QJ: jax.Array) -> jax.Array:
    h_IQE = x_IQE + self.attention(self.layer_norm1(x_IQE), angles_QJ)
    return h_IQE + self.fc2(jax.nn.gelu(self.fc1(self.layer_norm2(h_IQE)), approximate=False))


def pixel_shuffle(x_IPE: jax.Array, shuffle: int) -> jax.Array:
  """[I, P, E] -> [I, P / s², s² E]: each s x s block of the patch grid becomes one token whose
  channels run (row in block, column in block, channel), as HF's pixel_shuffle orders them."""
  i, p, e = x_IPE.shape
  side = int(round(p**0.5))
  blocks = side // shuffle
  x = x_IPE.reshape(i, blocks, shuffle, blocks, shuffle, e).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(i, blocks * blocks, shuffle * shuffle * e)


class Llama4VisionAdapter(nnx.Module):
  """Pixel shuffle, then GELU(fc2(GELU(fc1(x)))) without biases: [I, P, E] -> [I, T, F]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    vision = cfg.vision
    dense = _dense(cfg, rngs, use_bias=False)
    self.shuffle = vision.pixel_shuffle_factor
    # The shuffled width s² E is vision_mlp_dim in the releases (HF sizes fc1 by intermediate_size).
    self.fc1 = dense((self.shuffle**2 * vision.vision_emb_dim,), (vision.vision_adapter_dim,), ("mlp", "embed"))
    self.fc2 = dense((vision.vision_adapter_dim,), (vision.vision_adapter_dim,), (None, "embed"))

  def __call__(self, x_IPE: jax.Array) -> jax.Array:
    h_ITF = jax.nn.gelu(self.fc1(pixel_shuffle(x_IPE, self.shuffle)), approximate=False)
    return jax.nn.gelu(self.fc2(h_ITF), approximate=False)


class Llama4VisionEncoder(nnx.Module):
  """HF's Llama4VisionModel: tiles [I, C, R, R] -> adapter features [I, T, F]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    vision, p = cfg.vision, cfg.vision.vision_patch_size
    e = vision.vision_emb_dim
    self.cfg = cfg
    self.patch_embedding = _dense(cfg, rngs, use_bias=False)((NUM_CHANNELS, p, p), (e,), (None, None, None, "embed"))
    self.class_embedding = nnx.Param(
        nnx.initializers.normal(stddev=e**-0.5)(rngs.params(), (e,), jnp.dtype(cfg.weight_dtype)),
        out_sharding=("embed",))
    self.position_embedding = Embed(vision.patches_per_side**2 + 1, e, dtype=jnp.dtype(cfg.dtype),
                                    weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs, names=(None, "embed"))
    self.layernorm_pre = _layer_norm(cfg)

    self.layers = vision_tower.stacked_layers(lambda rngs: Llama4VisionLayer(cfg, rngs=rngs),
                                              vision.vision_num_layers, rngs)
    self.layernorm_post = _layer_norm(cfg)
    self.adapter = Llama4VisionAdapter(cfg, rngs=rngs)

  def patches(self, pixels_ICRR: jax.Array) -> jax.Array:
    return vision_tower.image_patches(pixels_ICRR, self.cfg.vision.vision_patch_size)

  def __call__(self, pixels_ICRR: jax.Array) -> jax.Array:
    vision = self.cfg.vision
    x_IPE = self.patch_embedding(self.patches(pixels_ICRR))
    cls_IE = jnp.broadcast_to(self.class_embedding[...].astype(x_IPE.dtype), (x_IPE.shape[0], x_IPE.shape[2]))
    x_IQE = jnp.concatenate([x_IPE, cls_IE[:, None]], axis=1)
    x_IQE = self.layernorm_pre(x_IQE + self.position_embedding.embedding[...].astype(x_IQE.dtype)[None])
    x_IQE = sharding.constrain(x_IQE, IMAGE_NAMES)
    angles_QJ = jnp.asarray(rope_angles(vision.patches_per_side, vision.vision_head_dim,
                                        vision.vision_rope_max_timescale))
    x_IQE = vision_tower.run_stacked(self.layers, x_IQE, self.cfg.remat, angles_QJ)
    return self.adapter(self.layernorm_post(x_IQE)[:, :-1])


def flops_per_view(cfg: ModelConfig) -> vision_tower.ViewFlops:
  """One tile through Llama4VisionEncoder (the patch embedding; its layers over the patches and the class token;
  the adapter's two matmuls over the shuffled tokens) and Llama4Projector."""
  vision = cfg.vision
  patches, e = vision.patches_per_side**2, vision.vision_emb_dim
  tokens, adapter = vision.mm_tokens_per_image, vision.vision_adapter_dim
  weights, scores = vision_tower.encoder_layer_flops(cfg, patches + 1)
  embed = 2 * patches * NUM_CHANNELS * vision.vision_patch_size**2 * e
  adapter_flops = 2 * tokens * vision.pixel_shuffle_factor**2 * e * adapter + 2 * tokens * adapter * adapter
  return vision_tower.ViewFlops(embed + weights + adapter_flops, scores, 2 * tokens * adapter * cfg.emb_dim)


class Llama4Projector(nnx.Module):
  """HF's Llama4MultiModalProjector: adapter features [I, T, F] -> soft tokens [I, T, D], no bias."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    # F stays whole: "embed" already names the text width here.
    self.projection = _dense(cfg, rngs, use_bias=False)((cfg.vision.vision_adapter_dim,), (cfg.emb_dim,),
                                                        (None, "embed"))

  def __call__(self, x_ITF: jax.Array) -> jax.Array:
    return self.projection(x_ITF)
