"""Grouped-query self-attention: RoPE, causal + document (segment) masking, optional sliding
window or fixed chunks (the mask and head grouping: masks.py) and score soft-capping.

Per-layer behaviour is chosen from `layer_index` (a traced scalar in a scanned stack, so the
stack stays one homogeneous layer): attention_layer_pattern (global / local / chunked) and
rope_layer_pattern (rope / nope). Llama 4 (iRoPE): chunked RoPE layers with a weightless
QK-norm after RoPE (use_qk_l2_norm), and global NoPE layers whose queries are sharpened with
position (attn_temperature_floor_scale).

Kernels are looked up by name in ATTENTION_KERNELS; which implementation a name runs on which
platform, and what each supports, is attention_kernels.py's table.
"""

from __future__ import annotations

import functools

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.platform import sharding
from MaxText.errors import ConfigError
from MaxText.configuration.model_config import AttentionConfig, ModelConfig, RopeConfig
from MaxText.layers import attention_kernels, context_parallel, ring_attention
from MaxText.layers.attention_kernels import AttentionKernel, dot_product_attention
from MaxText.layers import kv_cache, masks
from MaxText.layers.embeddings import apply_rope, rope_attention_scale, rope_inverse_frequencies
from MaxText.layers.linears import DenseGeneral, fused_outputs
from MaxText.layers.normalizations import RMSNorm

Array = jax.Array

# name -> factory(model config) -> kernel; which implementation each runs where: attention_kernels.py.
ATTENTION_KERNELS: dict[str, Callable[[ModelConfig], AttentionKernel]] = {
    "dot_product": lambda cfg: dot_product_attention,
    "flash": lambda cfg: make_flash(cfg),
    "cudnn_flash": lambda cfg: make_cudnn_flash(cfg),
    "autoselected": lambda cfg: make_deferred(
        lambda platform: (name := select_kernel("autoselected", platform, cfg), ATTENTION_KERNELS[name](cfg)),
        "autoselected"),
}


def select_kernel(name: str, platform: str | None = None, cfg: ModelConfig | None = None) -> str:
  """The kernel `name` runs on `platform`. `autoselected` picks (attention_kernels.AUTOSELECT) TPU:
  flash (splash) when its blocks tile the sequence (a multiple of 128) else dot_product; GPU:
  cudnn_flash when cuDNN covers the model (no soft cap, half precision, head_dim <= 128) else flash;
  CPU: dot_product up to attention_kernels.AUTOSELECT_CPU_FLASH_ABOVE tokens, flash beyond. Without a platform
  `autoselected` stays deferred: the layer resolves it when traced, for the mesh's platform.
  With attention_sinks every choice is dot_product (splash and cuDNN have no sink logit)."""
  if name == "autoselected" and cfg is not None and "chunked" in cfg.attn.attention_layer_pattern:
    return "dot_product"  # the one kernel with a chunked mask
  if name == "autoselected" and cfg is not None and cfg.attn.attention_sinks:
    return "dot_product"
  if name == "autoselected" and cfg is not None and cfg.vision.use_multimodal:
    return "dot_product"  # the one kernel with bidirectional image blocks
  if name == "autoselected" and cfg is not None and context_parallel.merges_blocks(cfg.attn):
    return "flash"  # ring / all_to_all / load balancing run the chunked kernel per block
  if name != "autoselected" or platform is None:
    return name
  return attention_kernels.autoselect(platform, cfg)


def make_flash(cfg: ModelConfig) -> AttentionKernel:
  """attention=flash: splash on TPU, the chunked JAX kernel elsewhere; with the length split over
  the `sequence` axis, context_parallel_strategy (ring_attention.py: splash or cuDNN per chunk pair
  on TPU / GPU, the chunked kernel on CPU)."""

  def kernel(q_BLNH: Array, k_BSKH: Array, v_BSKH: Array, segment_ids_BL: Array,
             window_size: masks.Window = None, soft_cap: float = 0.0, sinks_N: Array | None = None) -> Array:
    context = sharding.current_activation_context()
    chosen = attention_kernels.implementation("flash", sharding.trace_platform())
    split = context is not None and context_parallel.length_shards(context[0], context[1], q_BLNH.shape,
                                                                   k_BSKH.shape) > 1
    local = chosen.sequence(attention_kernels.Call(cfg, q_BLNH.shape[1]))
    if sinks_N is not None:  # only the chunked kernel has them, on one sequence shard
      if not chosen.sinks or split:
        raise ConfigError("attention=flash with attention_sinks runs only the chunked JAX kernel (CPU, GPU) without "
                          "sequence parallelism (TPU splash has no sink logit); use attention=dot_product")
      return local(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window_size, soft_cap, sinks_N=sinks_N)
    if context is not None:
      mesh, rules = context
      if split:
        return ring_attention.context_parallel_attention(cfg, mesh, rules, q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                         window_size, soft_cap)
      if chosen.single_device:
        return context_parallel.per_shard_attention(local, mesh, rules, q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                    window_size, soft_cap)
    return local(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window_size, soft_cap)

  return kernel


def make_cudnn_flash(cfg: ModelConfig) -> AttentionKernel:
  if cfg.attn.attn_logits_soft_cap > 0:
    raise ConfigError(f"attention=cudnn_flash does not support attn_logits_soft_cap={cfg.attn.attn_logits_soft_cap} "
                      "(cuDNN has no logit soft cap); use attention=flash or autoselected")

  def kernel(q_BLNH: Array, k_BSKH: Array, v_BSKH: Array, segment_ids_BL: Array,
             window_size: masks.Window = None, soft_cap: float = 0.0) -> Array:
    chosen = attention_kernels.implementation("cudnn_flash", sharding.trace_platform())
    return chosen.sequence(attention_kernels.Call(cfg, q_BLNH.shape[1]))(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                                         window_size, soft_cap)

  return kernel


_ANNOUNCED: set[tuple[str, str]] = set()


def make_deferred(resolve: Callable[[str], tuple[str, AttentionKernel]], cfg_name: str) -> AttentionKernel:
  """A kernel that picks its implementation when traced (only then is the target platform known,
  e.g. a TPU topology compiled on CPU) and says once per platform which it picked."""

  def kernel(q_BLNH: Array, k_BSKH: Array, v_BSKH: Array, segment_ids_BL: Array,
             window_size: masks.Window = None, soft_cap: float = 0.0) -> Array:
    platform = sharding.trace_platform()
    name, chosen = resolve(platform)
    if (platform, name) not in _ANNOUNCED:
      _ANNOUNCED.add((platform, name))
      if jax.process_index() == 0:
        print(f"attention={cfg_name}: using {name} on {platform}", flush=True)
    return chosen(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window_size, soft_cap)

  return kernel


def is_local_layer(attn: AttentionConfig, layer_index: int | jax.Array) -> bool | jax.Array:
  """Whether layer `layer_index` is local under `attention_layer_pattern`: static when the
  pattern is uniform, a traced boolean when a scanned stack mixes local and global layers."""
  pattern = attn.attention_layer_pattern
  if len(set(pattern)) == 1:
    return pattern[0] == "local"
  return jnp.asarray([kind == "local" for kind in pattern])[layer_index % len(pattern)]


def layer_window_size(attn: AttentionConfig, layer_index: int | jax.Array) -> masks.Window:
  """Sliding-window size of layer `layer_index`, or None for full attention: the config's window
  in masks.py's spelling (a traced one when the stack mixes kinds: a global layer then gets
  masks.NO_WINDOW)."""
  is_local = is_local_layer(attn, layer_index)
  if isinstance(is_local, bool):
    return attn.sliding_window_size if is_local else None
  return masks.layer_window(is_local, attn.sliding_window_size)


def layer_chunk_size(attn: AttentionConfig, layer_index: int | jax.Array) -> masks.Window:
  """attention_chunk_size on a chunked layer, None elsewhere (traced NO_WINDOW in a mixed scanned stack)."""
  pattern = attn.attention_layer_pattern
  if "chunked" not in pattern:
    return None
  if len(set(pattern)) == 1:
    return attn.attention_chunk_size
  is_chunked = jnp.asarray([kind == "chunked" for kind in pattern])[layer_index % len(pattern)]
  return masks.layer_window(is_chunked, attn.attention_chunk_size)


def is_rope_layer(rope: RopeConfig, layer_index: int | jax.Array) -> bool | jax.Array:
  """Whether layer `layer_index` rotates q/k under rope_layer_pattern (static when uniform)."""
  pattern = rope.rope_layer_pattern
  if len(set(pattern)) == 1:
    return pattern[0] == "rope"
  return jnp.asarray([kind == "rope" for kind in pattern])[layer_index % len(pattern)]


def _on_layers(selected: bool | jax.Array, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """f(x) on the layers `selected` names (a traced choice computes both and picks)."""
  if isinstance(selected, bool):
    return f(x) if selected else x
  return jnp.where(selected, f(x), x)


def l2_normalize(x_BLNH: jax.Array, epsilon: float) -> jax.Array:
  """Each head vector over its RMS, no learned gain, in float32 (Llama 4's QK-norm)."""
  x = x_BLNH.astype(jnp.float32)
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + epsilon)).astype(x_BLNH.dtype)


def temperature_scale(attn: AttentionConfig, positions_BL: jax.Array) -> jax.Array:
  """[B, L] query multiplier of NoPE layers: log1p(floor((p + 1) / floor_scale)) * scale + 1, which
  sharpens attention at long positions where a position-free score would flatten out."""
  steps_BL = jnp.floor((positions_BL.astype(jnp.float32) + 1.0) / attn.attn_temperature_floor_scale)
  return jnp.log1p(steps_BL) * attn.attn_temperature_scale + 1.0


def rotary_dim(cfg: ModelConfig) -> int:
  """The features of each head RoPE rotates: head_dim, or its partial_rotary_factor share."""
  return int(cfg.head_dim * cfg.rope.partial_rotary_factor)


def layer_rope_frequencies(cfg: ModelConfig, layer_index: int | jax.Array) -> np.ndarray | jax.Array:
  """RoPE frequencies of layer `layer_index`: the local layers' own when rope_local_max_timescale
  is set (Gemma 3), else every layer's."""
  if cfg.rope.rope_local_max_timescale <= 0 or "local" not in cfg.attn.attention_layer_pattern:
    return rope_inverse_frequencies(cfg.rope, rotary_dim(cfg))
  is_local = is_local_layer(cfg.attn, layer_index)
  local = rope_inverse_frequencies(cfg.rope, rotary_dim(cfg), local=True)
  global_ = rope_inverse_frequencies(cfg.rope, rotary_dim(cfg))
  if isinstance(is_local, bool):
    return local if is_local else global_
  return jnp.where(is_local, jnp.asarray(local), jnp.asarray(global_))


def layer_rope_scale(cfg: ModelConfig, layer_index: int | jax.Array) -> float | jax.Array:
  """YaRN's attention factor on the layers whose RoPE is YaRN (1 elsewhere)."""
  global_ = rope_attention_scale(cfg.rope)
  if global_ == 1.0 or cfg.rope.rope_local_max_timescale <= 0 or "local" not in cfg.attn.attention_layer_pattern:
    return global_
  is_local = is_local_layer(cfg.attn, layer_index)
  if isinstance(is_local, bool):
    return 1.0 if is_local else global_
  return jnp.where(is_local, 1.0, global_)


def _qk_norm(norm: RMSNorm, x_BLNH: jax.Array, cfg: ModelConfig) -> jax.Array:
  """The QK-norm over each head's vector, or (qk_norm_over_all_heads) over all heads' vectors as one."""
  if not cfg.attn.qk_norm_over_all_heads:
    return norm(x_BLNH)
  b, l, n, h = x_BLNH.shape
  return norm(x_BLNH.reshape(b, l, n * h)).reshape(b, l, n, h)


def named_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The remat names query_proj, key_proj, value_proj on the kernel's inputs: after QK-norm, RoPE, L2-norm,
  temperature tuning and the query scale, where upstream's attentions.py names them, so a placement keeps
  the tensor upstream's recipe keeps. A norm's gradient still needs the raw projection (plan_remat.backward_dots)."""
  return checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    dense = functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                              rngs=rngs, use_bias=cfg.use_bias)
    # query_proj, key_proj and value_proj name what the kernel receives (named_qkv), not these outputs.
    self.query = dense((d,), (n, h), ("embed", "heads", "kv"), **cfg.lora.adapter("q_proj"))
    self.key = dense((d,), (k, h), ("embed", "kv_heads", "kv"), **cfg.lora.adapter("k_proj"))
    self.value = dense((d,), (k, h), ("embed", "kv_heads", "kv"), **cfg.lora.adapter("v_proj"))
    self.out = dense((n, h), (d,), ("heads", "kv", "embed"), tag="out_proj", **cfg.lora.adapter("o_proj"))
    if cfg.attn.attention_output_gate:  # Qwen3-Next: sigmoid(x W_gate) scales each head's output
      # Unnamed, as upstream's gate (the unnamed half of its query projection): recomputed under remat.
      self.output_gate = dense((d,), (n, h), ("embed", "heads", "kv"))
    if cfg.attn.use_qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's vector (OLMo: over all heads), before RoPE
      norm = functools.partial(RMSNorm, epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
                               weight_dtype=jnp.dtype(cfg.weight_dtype),
                               scale_offset=1.0 if cfg.normalization_type == "rms_plus_one" else 0.0)
      all_heads = cfg.attn.qk_norm_over_all_heads
      self.query_norm, self.key_norm = norm(n * h if all_heads else h), norm(k * h if all_heads else h)
    if cfg.attn.attention_sinks:  # GPT-OSS: one learned logit per query head (masks.dense_attention)
      self.sinks = nnx.Param(jnp.zeros((n,), jnp.dtype(cfg.weight_dtype)), out_sharding=("heads",))
    self.cfg = cfg
    self.chunked = "chunked" in cfg.attn.attention_layer_pattern  # config validation: dot_product then
    self.kernel = (dot_product_attention if self.chunked
                   else ATTENTION_KERNELS[select_kernel(cfg.attn.attention, cfg=cfg)](cfg))
    # Gemma 2 27B scales by (emb_dim / num_heads)**-0.5 rather than head_dim**-0.5.
    self.query_scale = (cfg.attn.query_pre_attn_scalar or cfg.head_dim) ** -0.5

  def _rope(self, x_BLNH: jax.Array, positions_BL: jax.Array, layer_index: int | jax.Array) -> jax.Array:
    cfg = self.cfg
    if cfg.position_embedding != "rope":
      return x_BLNH
    full_rope = functools.partial(apply_rope, positions_BL=positions_BL,
                                  inv_freq_h=layer_rope_frequencies(cfg, layer_index),
                                  interleaved=cfg.rope.rope_interleaved, scale=layer_rope_scale(cfg, layer_index))
    rotated = rotary_dim(cfg)

    def rope(x: jax.Array) -> jax.Array:  # partial RoPE (Qwen3-Next): the first `rotated` features turn, the rest pass
      if rotated == cfg.head_dim:
        return full_rope(x)
      return jnp.concatenate([full_rope(x[..., :rotated]), x[..., rotated:]], axis=-1)
    x_BLNH = _on_layers(is_rope_layer(cfg.rope, layer_index), rope, x_BLNH)
    if cfg.attn.use_qk_l2_norm:
      x_BLNH = _on_layers(is_rope_layer(cfg.rope, layer_index),
                          functools.partial(l2_normalize, epsilon=cfg.normalization_layer_epsilon), x_BLNH)
    return x_BLNH

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               layer_index: int | jax.Array = 0, cache: kv_cache.KVCache | None = None,
               image_blocks_BL: jax.Array | None = None) -> jax.Array | tuple[jax.Array, kv_cache.KVCache]:
    """Output [B, L, D]; with a `cache` (decoding), (output, the cache with this call's keys and
    values written at `positions_BL`), the queries attending over the cache (see layers/kv_cache.py).
    `image_blocks_BL` (masks.image_blocks): each image's tokens see each other both ways."""
    cfg = self.cfg
    heads_names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
    kv_names = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
    if cfg.fused_qkv:  # one matmul for the three projections
      q_BLNH, k_BSKH, v_BSKH = fused_outputs([self.query, self.key, self.value], x_BLD, "qkv_proj", part_tags=False)
    else:
      q_BLNH, k_BSKH, v_BSKH = self.query(x_BLD), self.key(x_BLD), self.value(x_BLD)
    if cfg.attn.use_qk_norm:
      q_BLNH, k_BSKH = _qk_norm(self.query_norm, q_BLNH, cfg), _qk_norm(self.key_norm, k_BSKH, cfg)
    q_BLNH, k_BSKH = self._rope(q_BLNH, positions_BL, layer_index), self._rope(k_BSKH, positions_BL, layer_index)
    if cfg.attn.attn_temperature_floor_scale > 0:  # on NoPE layers only
      is_rope = is_rope_layer(cfg.rope, layer_index)
      is_nope = (not is_rope) if isinstance(is_rope, bool) else jnp.logical_not(is_rope)
      tune = lambda q: (q * temperature_scale(cfg.attn, positions_BL)[:, :, None, None]).astype(q.dtype)
      q_BLNH = _on_layers(is_nope, tune, q_BLNH)
    q_BLNH, k_BSKH, v_BSKH = named_qkv(sharding.constrain(q_BLNH * jnp.asarray(self.query_scale, q_BLNH.dtype),
                                                          heads_names),
                                       sharding.constrain(k_BSKH, kv_names), sharding.constrain(v_BSKH, kv_names))
    sinks = {"sinks_N": self.sinks[...]} if cfg.attn.attention_sinks else {}
    if cache is not None:
      cache = kv_cache.write(cache, k_BSKH, v_BSKH, positions_BL)
      out_BLNH = kv_cache.cached_attention(q_BLNH, cache, positions_BL, layer_window_size(cfg.attn, layer_index),
                                           cfg.attn.attn_logits_soft_cap, layer_chunk_size(cfg.attn, layer_index), **sinks,
                                           image_blocks_BL=image_blocks_BL)
      return self._output(sharding.constrain(out_BLNH, heads_names), x_BLD), cache
    chunk: dict[str, Any] = ({"chunk_size": layer_chunk_size(cfg.attn, layer_index), "positions_BL": positions_BL}
                             if self.chunked else {})
    if image_blocks_BL is not None:  # config validation: the kernel is dot_product then
      out_BLNH = dot_product_attention(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, layer_window_size(cfg.attn, layer_index),
                                       cfg.attn.attn_logits_soft_cap, image_blocks_BL=image_blocks_BL, **sinks)
      return self._output(sharding.constrain(out_BLNH, heads_names), x_BLD)
    out_BLNH = self.kernel(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, layer_window_size(cfg.attn, layer_index),
                           cfg.attn.attn_logits_soft_cap, **chunk, **sinks)
    return self._output(sharding.constrain(out_BLNH, heads_names), x_BLD)

  def _output(self, out_BLNH: jax.Array, x_BLD: jax.Array) -> jax.Array:
    """The output projection, after the output gate where there is one (attention_output_gate)."""
    out_BLNH = checkpoint_name(out_BLNH, "context")  # a remat_policy=custom placement
    if self.cfg.attn.attention_output_gate:
      gate_BLNH = jax.nn.sigmoid(self.output_gate(x_BLD).astype(jnp.float32))
      out_BLNH = (out_BLNH.astype(jnp.float32) * gate_BLNH).astype(out_BLNH.dtype)
    return self.out(out_BLNH)
