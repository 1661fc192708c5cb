"""The image side of a vision-language model (use_multimodal): Gemma 3's SigLIP encoder and its
multimodal projector, and the placing of their soft tokens into the decoder's input.

  pixel values [I, C, R, R] (families/gemma3_images.py, channels first as HF's processors give them)
    ─► VisionEncoder: R/p x R/p patches (a conv with stride = kernel = p, computed as a dense layer
       over each flattened patch) + learned position embeddings ─► pre-LayerNorm encoder layers
       (bidirectional attention, GELU MLP, biases everywhere), scanned ─► post-LayerNorm
    ─► MultimodalProjector: average pooling of the patch grid to mm_tokens_per_image tokens ─►
       RMSNorm with Gemma's (1 + w) gain ─► a projection into emb_dim   = soft tokens [I, T, D]
  ─► place_image_tokens: the k-th image_token_id of a row takes the row's k-th soft token.

Sharding: the tower's parameters carry the text stack's logical names (its width is "embed", its
MLP "mlp", its heads "heads"), so they are FSDP-sharded like the decoder (tensor-parallel where
the sizes divide). Replicating them would keep the encoder's weights and their optimizer state
whole on every chip, for a tower used once per step; sharded, each layer is gathered like a
decoder layer.

Legend (besides layers/__init__.py's): I images, P patches per image, E vision width, W vision MLP
width, A vision heads, Y vision head width, T soft tokens per image, C channels, R image side,
M images per row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.configuration.model_config import ModelConfig
from MaxText.configuration import remat_policies
from MaxText.layers import masks, remat
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import LayerNorm, RMSNorm
from MaxText.platform import sharding

NUM_CHANNELS = 3  # RGB, as the families' image formats give them
IMAGE_NAMES = ("activation_batch", "activation_length", "activation_embed")


def _dense(cfg: ModelConfig, rngs: nnx.Rngs) -> functools.partial[DenseGeneral]:
  return functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                           rngs=rngs, use_bias=True, quantize=False)


def _layer_norm(cfg: ModelConfig) -> LayerNorm:
  return LayerNorm(cfg.vision.vision_emb_dim, epsilon=cfg.vision.vision_layer_norm_epsilon,
                   dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))


def stacked_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
  """`count` layers from `make_layer(rngs)`, stacked on a leading axis: a vision encoder's layers are always
  scanned (whatever scan_layers says), one compiled layer and one stacked checkpoint layout."""

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def stacked(rngs: nnx.Rngs) -> nnx.Module:
    return make_layer(rngs)

  return stacked(rngs)


def run_stacked(layers: nnx.Module, x: jax.Array, remat_policy: remat_policies.RematPolicy, *args: Any) -> jax.Array:
  """`x` through every layer of `stacked_layers` in a scan (each layer called as layer(x, *args)),
  rematerialised by `remat_policy`."""
  graphdef, stacked_state = nnx.split(layers)

  def one_layer(x: jax.Array, layer_state: nnx.State[Any, Any]) -> tuple[jax.Array, None]:
    return sharding.constrain(nnx.merge(graphdef, layer_state)(x, *args), IMAGE_NAMES), None

  policy = remat.checkpoint_policy(remat_policy)
  body = one_layer if isinstance(policy, str) else jax.checkpoint(one_layer, policy=policy)
  x, _ = jax.lax.scan(body, x, stacked_state)
  return x


def image_patches(pixels_ICRR: jax.Array, patch: int) -> jax.Array:
  """[I, C, R, R] -> [I, P, C, p, p], patches in row-major order (a conv's and an unfold's order)."""
  i, c, r, _ = pixels_ICRR.shape
  grid = r // patch
  x = pixels_ICRR.reshape(i, c, grid, patch, grid, patch).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(i, grid * grid, c, patch, patch)


class VisionAttention(nnx.Module):
  """Multi-head self-attention over one image's patches, every patch seeing every other."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, a, y = cfg.vision.vision_emb_dim, cfg.vision.vision_num_heads, cfg.vision.vision_head_dim
    dense = _dense(cfg, rngs)
    self.query = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.key = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.value = dense((e,), (a, y), ("embed", "heads", "kv"))
    self.out = dense((a, y), (e,), ("heads", "kv", "embed"))
    self.scale = y**-0.5

  def __call__(self, x_IPE: jax.Array) -> jax.Array:
    q_IPAY = self.query(x_IPE)
    q_IPAY = q_IPAY * jnp.asarray(self.scale, q_IPAY.dtype)
    everything_1PP = jnp.ones((1,) + x_IPE.shape[1:2] * 2, jnp.bool_)
    return self.out(masks.dense_attention(q_IPAY, self.key(x_IPE), self.value(x_IPE), everything_1PP))


class VisionLayer(nnx.Module):
  """x + Attn(LN(x)), then h + MLP(LN(h)) with a tanh-approximated GELU."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e, w = cfg.vision.vision_emb_dim, cfg.vision.vision_mlp_dim
    dense = _dense(cfg, rngs)
    self.layer_norm1, self.layer_norm2 = _layer_norm(cfg), _layer_norm(cfg)
    self.attention = VisionAttention(cfg, rngs=rngs)
    self.fc1 = dense((e,), (w,), ("embed", "mlp"))
    self.fc2 = dense((w,), (e,), ("mlp", "embed"))

  def __call__(self, x_IPE: jax.Array) -> jax.Array:
    h_IPE = x_IPE + self.attention(self.layer_norm1(x_IPE))
    return h_IPE + self.fc2(jax.nn.gelu(self.fc1(self.layer_norm2(h_IPE)), approximate=True))


class VisionEncoder(nnx.Module):
  """SigLIP's vision transformer without its pooling head: [I, C, R, R] -> [I, P, E]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    vision, p = cfg.vision, cfg.vision.vision_patch_size
    self.cfg = cfg
    self.patch_embedding = _dense(cfg, rngs)((NUM_CHANNELS, p, p), (vision.vision_emb_dim,),
                                             (None, None, None, "embed"))
    self.position_embedding = Embed(vision.patches_per_side**2, vision.vision_emb_dim, dtype=jnp.dtype(cfg.dtype),
                                    weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs, names=(None, "embed"))
    self.layers = stacked_layers(lambda rngs: VisionLayer(cfg, rngs=rngs), vision.vision_num_layers, rngs)
    self.post_layernorm = _layer_norm(cfg)

  def patches(self, pixels_ICRR: jax.Array) -> jax.Array:
    return image_patches(pixels_ICRR, self.cfg.vision.vision_patch_size)

  def __call__(self, pixels_ICRR: jax.Array) -> jax.Array:
    x_IPE = self.patch_embedding(self.patches(pixels_ICRR))
    x_IPE = x_IPE + self.position_embedding.embedding[...].astype(x_IPE.dtype)[None]
    x_IPE = sharding.constrain(x_IPE, IMAGE_NAMES)
    return self.post_layernorm(run_stacked(self.layers, x_IPE, self.cfg.remat))


class MultimodalProjector(nnx.Module):
  """Gemma 3's projector: [I, P, E] patch features -> [I, T, D] soft tokens."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    vision = cfg.vision
    self.cfg = cfg
    self.soft_embedding_norm = RMSNorm(vision.vision_emb_dim, epsilon=vision.vision_layer_norm_epsilon,
                                       dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                                       scale_offset=1.0)
    # The vision width stays whole: "embed" already names the text width here.
    self.input_projection = DenseGeneral((vision.vision_emb_dim,), (cfg.emb_dim,), (None, "embed"),
                                         dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                                         rngs=rngs, quantize=False)

  def __call__(self, x_IPE: jax.Array) -> jax.Array:
    vision = self.cfg.vision
    i, _, e = x_IPE.shape
    t, k = vision.tokens_per_side, vision.patches_per_side // vision.tokens_per_side
    pooled = x_IPE.astype(jnp.float32).reshape(i, t, k, t, k, e).mean(axis=(2, 4)).reshape(i, t * t, e)
    return self.input_projection(self.soft_embedding_norm(pooled.astype(x_IPE.dtype)))


@dataclasses.dataclass(frozen=True)
class ViewFlops:
  """Forward FLOPs of one view through a vision tower: the encoder's weight matmuls (patch embedding, layers,
  anything else the encoder module holds), its attention scores (Q·K and A·V over the view's tokens) and the
  projector's matmuls."""
  encoder_weights: float
  encoder_scores: float
  projector: float


def encoder_layer_flops(cfg: ModelConfig, tokens: int) -> tuple[float, float]:
  """(weight, score) forward FLOPs of the encoder's layers over one view of `tokens` tokens: q/k/v/out and the two
  MLP matmuls per token, every token attending to every token."""
  vision = cfg.vision
  e, w, width = vision.vision_emb_dim, vision.vision_mlp_dim, vision.vision_num_heads * vision.vision_head_dim
  layers = vision.vision_num_layers
  return layers * tokens * (8 * e * width + 4 * e * w), layers * 4 * tokens * tokens * width


def flops_per_view(cfg: ModelConfig) -> ViewFlops:
  """One image through VisionEncoder (the patch embedding, its layers) and MultimodalProjector (pooled tokens
  into emb_dim)."""
  vision = cfg.vision
  patches = vision.patches_per_side**2
  weights, scores = encoder_layer_flops(cfg, patches)
  embed = 2 * patches * NUM_CHANNELS * vision.vision_patch_size**2 * vision.vision_emb_dim
  return ViewFlops(embed + weights, scores, 2 * vision.mm_tokens_per_image * vision.vision_emb_dim * cfg.emb_dim)


def image_embeddings(encoder: VisionEncoder, projector: MultimodalProjector, pixels_ICRR: jax.Array) -> jax.Array:
  """Soft tokens [I, T, D] of I images' pixel values: what SFT, decode and serving place into
  their token embeddings (`place_image_tokens`)."""
  return projector(encoder(pixels_ICRR.astype(jnp.dtype(encoder.cfg.dtype))))


def place_image_tokens(x_BLD: jax.Array, soft_BTD: jax.Array, tokens_BL: jax.Array, image_token_id: int) -> jax.Array:
  """The embeddings with a row's k-th `image_token_id` replaced by its k-th soft token (`soft_BTD`:
  the row's images' soft tokens in order, M x mm_tokens_per_image of them). Placeholders beyond
  the row's soft tokens take its last one; the data pipeline keeps the counts equal."""
  is_image_BL = tokens_BL == image_token_id
  index_BL = jnp.clip(jnp.cumsum(is_image_BL, axis=1) - 1, 0, soft_BTD.shape[1] - 1)
  placed_BLD = jnp.take_along_axis(soft_BTD, index_BL[:, :, None], axis=1).astype(x_BLD.dtype)
  return jnp.where(is_image_BL[:, :, None], placed_BLD, x_BLD)
