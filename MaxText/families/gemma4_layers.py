"""Gemma 4's decoder layer and its per-layer input embeddings (the gemma4 family's `layer` and
`per_layer_inputs`, families/gemma4.py).

On Gemma 2's sandwich-normed block (decoders.SandwichNormDecoderLayer's four norms, plain RMSNorm gains)
it adds, per layer (layers/layer_shapes.py builds each layer's own configuration):
  * the global layers' own head width and key/value heads (global_head_dim, global_num_kv_heads);
  * attention_k_eq_v: a global layer has no value projection, its values are its keys as projected;
  * use_v_norm: a scale-free RMSNorm over each value head (keys and queries keep their QK-norm);
  * KV sharing: the last num_kv_shared_layers layers project queries only and attend over the keys and
    values of an earlier layer of their kind (training: `layer_shapes.SharedKV`; decoding: its cache);
  * per-layer inputs: a token embedding of its own per layer (`PerLayerInputs`, computed once for the
    stack), gated by the layer's output and added back through a projection and a norm;
  * `layer_scalar`: one learned number the layer's output is multiplied by;
  * moe_beside_mlp (26B A4B): routed experts (moe.MoeBlock) beside the dense MLP, each branch with its own norms,
    the router reading the scale-free-normed stream times a learned scale, each expert's weight a learned factor.
Queries are not scaled (the QK-norm sets their size): query_pre_attn_scalar = 1.

Shape legend beyond layers/__init__.py's: P per-layer input width, M layers (the per-layer inputs' axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import kv_cache, layer_shapes, paged_kv
from MaxText.layers.attention import ATTENTION_KERNELS, Attention, layer_window_size, select_kernel
from MaxText.layers.decoders import ACTIVATION_NAMES
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral, dropout
from MaxText.layers.mlp import ACTIVATION_FNS, MlpBlock
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import RMSNorm, make_norm
from MaxText.platform import sharding

HEADS_NAMES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
KV_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
LayerCache = kv_cache.KVCache | paged_kv.PagedKVCache | layer_shapes.SharedKV


def scale_free_rms(x: jax.Array, epsilon: float) -> jax.Array:
  """x / rms(x) over the last axis in float32, no gain (the value norm)."""
  f = x.astype(jnp.float32)
  return (f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + epsilon)).astype(x.dtype)


class Gemma4Attention(Attention):
  """Attention with this layer's own head shape; `owns_kv=False` (a KV-shared layer) has query and
  output projections only; `k_eq_v` has no value projection."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, owns_kv: bool, k_eq_v: bool):
    # Attention's own modules are built only where this layer has them (no stray parameters).
    d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    dense = functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                              rngs=rngs, use_bias=cfg.use_bias)
    norm = functools.partial(RMSNorm, epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
                             weight_dtype=jnp.dtype(cfg.weight_dtype))
    self.query = dense((d,), (n, h), ("embed", "heads", "kv"), **cfg.lora.adapter("q_proj"))
    self.query_norm = norm(h)
    if owns_kv:
      self.key = dense((d,), (k, h), ("embed", "kv_heads", "kv"), **cfg.lora.adapter("k_proj"))
      self.key_norm = norm(h)
      if not k_eq_v:
        self.value = dense((d,), (k, h), ("embed", "kv_heads", "kv"), **cfg.lora.adapter("v_proj"))
    self.out = dense((n, h), (d,), ("heads", "kv", "embed"), tag="out_proj", **cfg.lora.adapter("o_proj"))
    self.cfg, self.owns_kv, self.k_eq_v = cfg, owns_kv, k_eq_v
    self.chunked = False
    self.kernel = ATTENTION_KERNELS[select_kernel(cfg.attn.attention, cfg=cfg)](cfg)
    self.query_scale = 1.0

  def _keys_values(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    k_BSKH = self.key(x_BLD)
    v_BSKH = k_BSKH if self.k_eq_v else self.value(x_BLD)
    k_BSKH = self._rope(self.key_norm(k_BSKH), positions_BL, 0)
    if cfg.layer_shapes.use_v_norm:
      v_BSKH = scale_free_rms(v_BSKH, cfg.normalization_layer_epsilon)
    # key_proj and value_proj on the normed, rotated key and the (normed) value, as named_qkv
    return checkpoint_name(sharding.constrain(k_BSKH, KV_NAMES), "key_proj"), checkpoint_name(
        sharding.constrain(v_BSKH, KV_NAMES), "value_proj")

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,  # type: ignore[override]
               layer_index: int | jax.Array = 0, cache: LayerCache | None = None,
               image_blocks_BL: jax.Array | None = None) -> jax.Array | tuple[jax.Array, LayerCache]:
    """Output [B, L, D]; with `cache`, (output, cache): a KVCache / page pool (decoding: written unless this
    layer shares another's, which it then only reads) or a SharedKV (training: filled by a source layer,
    read by a sharing one)."""
    cfg = self.cfg
    window = layer_window_size(cfg.attn, 0)
    q_BLNH = self._rope(self.query_norm(self.query(x_BLD)), positions_BL, 0)
    q_BLNH = checkpoint_name(sharding.constrain(q_BLNH, HEADS_NAMES), "query_proj")  # after norm and RoPE
    if isinstance(cache, layer_shapes.SharedKV):
      if self.owns_kv:
        cache = layer_shapes.SharedKV(*self._keys_values(x_BLD, positions_BL))
      out_BLNH = self.kernel(q_BLNH, cache.key_BSKH, cache.value_BSKH, segment_ids_BL, window, 0.0)
      # named as the unshared path's: training runs every source and sharing layer here
      return self.out(checkpoint_name(sharding.constrain(out_BLNH, HEADS_NAMES), "context")), cache
    if cache is not None:
      if self.owns_kv:
        cache = kv_cache.write(cache, *self._keys_values(x_BLD, positions_BL), positions_BL)
      out_BLNH = kv_cache.cached_attention(q_BLNH, cache, positions_BL, window, 0.0, image_blocks_BL=image_blocks_BL)
      return self.out(sharding.constrain(out_BLNH, HEADS_NAMES)), cache
    if not self.owns_kv:
      raise ValueError("a KV-shared layer needs its source layer's keys and values (layer_shapes.SharedKV)")
    k_BSKH, v_BSKH = self._keys_values(x_BLD, positions_BL)
    out_BLNH = self.kernel(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window, 0.0)
    return self.out(checkpoint_name(sharding.constrain(out_BLNH, HEADS_NAMES), "context"))


class Gemma4DecoderLayer(nnx.Module):
  """Layer `layer_index` of a Gemma 4 stack: h = x + norm(Attn(norm(x))), h + norm(MLP(norm(h))), then the
  per-layer input's gated residual, all times layer_scalar. Built unrolled, one configuration per layer."""

  per_layer_shapes = True  # the model builds each unrolled layer with its index
  # Its attention always normalises the query and key before the names query_proj/key_proj (whatever
  # use_qk_norm says), so their matmuls' raw outputs are what the norms' gradients read (aot/plan_model).
  norms_query_and_key = True
  # Activation names the shared layers produce that this one never does, with why: a remat_policy=custom
  # placement of one places nothing (models/transformer.py warns; aot/plan_remat.py prices it so).
  unproduced_names = {"qkv_proj": "its attention projects the query, key and value apart whatever fused_qkv says"}

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_index: int = 0):
    own = layer_shapes.layer_config(cfg, layer_index)
    shapes = cfg.layer_shapes
    is_global = own.attn.attention_layer_pattern[0] == "global"
    self.pre_self_attention_layer_norm = make_norm(own)
    self.self_attention = Gemma4Attention(own, rngs=rngs, owns_kv=layer_shapes.has_own_kv(cfg, layer_index),
                                          k_eq_v=shapes.attention_k_eq_v and is_global)
    self.attention_output_norm = make_norm(own)
    self.post_self_attention_layer_norm = make_norm(own)
    self.mlp = MlpBlock(own, rngs=rngs)
    self.mlp_output_norm = make_norm(own)
    if shapes.moe_beside_mlp:  # experts of mlp_dim beside the dense MLP, each branch with its own norms
      self.moe = MoeBlock(cfg, rngs=rngs)
      self.router_scale = nnx.Param(jnp.ones((cfg.emb_dim,), jnp.dtype(cfg.weight_dtype)), out_sharding=("norm",))
      self.router_expert_scale = nnx.Param(jnp.ones((cfg.moe.num_experts,), jnp.dtype(cfg.weight_dtype)),
                                           out_sharding=(None,))
      self.dense_output_norm, self.experts_input_norm, self.experts_output_norm = (make_norm(own) for _ in range(3))
    p = shapes.per_layer_input_dim
    if p:
      dense = functools.partial(DenseGeneral, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype),
                                rngs=rngs)
      self.per_layer_input_gate = dense((cfg.emb_dim,), (p,), ("embed", "mlp"))
      self.per_layer_projection = dense((p,), (cfg.emb_dim,), ("mlp", "embed"))
      self.post_per_layer_input_norm = make_norm(own)
    self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.dtype(cfg.weight_dtype)), out_sharding=(None,))
    self.gate_activation = ACTIVATION_FNS[cfg.mlp_activations[0]]
    self.dropout_rate, self.epsilon = cfg.dropout_rate, cfg.normalization_layer_epsilon
    self.moe_beside_mlp = shapes.moe_beside_mlp

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               dropout_rng: jax.Array | None, layer_index: int | jax.Array = 0, cache: LayerCache | None = None,
               image_blocks_BL: jax.Array | None = None, per_layer_input_BLP: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, LayerCache]:
    attn_rng, mlp_rng = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
    x_BLD = sharding.constrain(x_BLD, ACTIVATION_NAMES)
    blocks = {} if image_blocks_BL is None else {"image_blocks_BL": image_blocks_BL}
    attn_out = self.self_attention(self.pre_self_attention_layer_norm(x_BLD), positions_BL, segment_ids_BL,
                                   layer_index, cache, **blocks)
    attn_BLD, cache = attn_out if isinstance(attn_out, tuple) else (attn_out, None)
    h_BLD = x_BLD + dropout(self.attention_output_norm(attn_BLD), self.dropout_rate, attn_rng)
    mlp_BLD = self.mlp(self.post_self_attention_layer_norm(h_BLD))
    if self.moe_beside_mlp:
      mlp_BLD = self.dense_output_norm(mlp_BLD) + self._experts(h_BLD)
    out_BLD = h_BLD + dropout(self.mlp_output_norm(mlp_BLD), self.dropout_rate, mlp_rng)
    if per_layer_input_BLP is not None:
      gated_BLP = self.gate_activation(self.per_layer_input_gate(out_BLD)) * per_layer_input_BLP.astype(out_BLD.dtype)
      out_BLD = out_BLD + self.post_per_layer_input_norm(self.per_layer_projection(gated_BLP))
    out_BLD = out_BLD * self.layer_scalar[...].astype(out_BLD.dtype).reshape(1, 1, 1)
    out_BLD = sharding.constrain(out_BLD, ACTIVATION_NAMES)
    return out_BLD if cache is None else (out_BLD, cache)

  def _experts(self, h_BLD: jax.Array) -> jax.Array:
    """The expert branch: routed from the scale-free-normed stream times a learned scale and D**-0.5, fed the
    stream through its own norm."""
    emb_dim = h_BLD.shape[-1]
    router_BLD = (scale_free_rms(h_BLD, self.epsilon).astype(jnp.float32)
                  * self.router_scale[...].astype(jnp.float32).reshape(1, 1, emb_dim) * emb_dim**-0.5)
    out_BLD = self.moe(self.experts_input_norm(h_BLD), router_BLD, self.router_expert_scale[...])
    return self.experts_output_norm(out_BLD)


class PerLayerInputs(nnx.Module):
  """Every layer's own input [B, L, M, P]: its slice of a per-layer token embedding (scaled by sqrt(P)) plus a
  normed projection of the input embedding (scaled by D**-0.5), the sum scaled by 2**-0.5."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    shapes = cfg.layer_shapes
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    m, p = cfg.num_decoder_layers, shapes.per_layer_input_dim
    self.embedder = Embed(shapes.per_layer_input_vocab_size or cfg.vocab_size, m * p, dtype=dtype,
                          weight_dtype=weight_dtype, rngs=rngs, names=("vocab", "embed"))
    self.projection = DenseGeneral((cfg.emb_dim,), (m, p), ("embed", None, "mlp"), dtype=dtype,
                                   weight_dtype=weight_dtype, rngs=rngs)
    self.projection_norm = RMSNorm(p, epsilon=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype)
    self.num_layers, self.dim, self.emb_dim = m, p, cfg.emb_dim

  def __call__(self, tokens_BL: jax.Array, x_BLD: jax.Array) -> jax.Array:
    b, l = tokens_BL.shape
    embedded_BLMP = self.embedder(tokens_BL).reshape(b, l, self.num_layers, self.dim)
    embedded_BLMP = embedded_BLMP * jnp.asarray(self.dim**0.5, embedded_BLMP.dtype)
    projected_BLMP = self.projection(x_BLD) * jnp.asarray(self.emb_dim**-0.5, x_BLD.dtype)
    mixed_BLMP = (self.projection_norm(projected_BLMP) + embedded_BLMP) * jnp.asarray(2.0**-0.5, x_BLD.dtype)
    return mixed_BLMP

