"""Gated DeltaNet (Qwen3-Next's linear-attention layer): projections → short causal conv on queries,
keys and values → L2-normed queries and keys → the gated delta rule (layers/gated_delta_rule.py) →
an RMSNorm of each head's output gated by silu(z) → the output projection.

The decay gate per value head and token is g = −exp(A_log) · softplus(a + dt_bias) (a, the decay
input, and b, whose sigmoid is the write strength β, are projections of x). Each query/key head
serves linear_num_value_heads / linear_num_key_heads consecutive value heads.

Decoding carries a `LinearState` per layer in place of a KV cache: the conv's last inputs and the
delta rule's state. A call whose first position is 0 (a prefill) starts from zeros, so a reused
decode slot never reads its previous request's state; a call continues the state otherwise.
When decoding, segment id 0 marks a right-padded prompt's padding (models.Transformer.decode): those
tokens neither decay nor write the state, and the conv state ends at each row's last real token.

Legend beyond layers/__init__.py (as in gated_delta_rule.py): Y value heads, Q key head dim,
W value head dim, I query/key heads (linear_num_key_heads), w the conv width.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import attention_kernels, context_parallel, gated_delta_rule
from MaxText.layers.linears import DenseGeneral
from MaxText.platform import sharding

STATE_NAMES = ("cache_batch", "cache_kv_heads", None, None)  # the delta rule's state [B, Y, Q, W]
CONV_NAMES = ("cache_batch", None, "cache_kv_heads", None)  # the conv's last inputs [B, w - 1, heads, dim]


@struct.dataclass
class LinearState:
  """One Gated DeltaNet layer's decode state (a plain pytree; the same structure carries names)."""

  conv_query: Any  # [B, w - 1, I, Q]
  conv_key: Any  # [B, w - 1, I, Q]
  conv_value: Any  # [B, w - 1, Y, W]
  state_BYQW: Any


def empty_state(cfg: ModelConfig, batch: int) -> LinearState:
  """A zero decode state of one layer for `batch` rows."""
  la = cfg.linear_attn
  width = la.linear_conv_kernel_dim - 1
  key_heads, value_heads = la.linear_num_key_heads, la.linear_num_value_heads
  dtype = jnp.dtype(cfg.dtype)
  return LinearState(jnp.zeros((batch, width, key_heads, la.linear_key_head_dim), dtype),
                     jnp.zeros((batch, width, key_heads, la.linear_key_head_dim), dtype),
                     jnp.zeros((batch, width, value_heads, la.linear_value_head_dim), dtype),
                     jnp.zeros((batch, value_heads, la.linear_key_head_dim, la.linear_value_head_dim), jnp.float32))


def state_names() -> LinearState:
  return LinearState(CONV_NAMES, CONV_NAMES, CONV_NAMES, STATE_NAMES)


def _document_starts(segment_ids_BL: jax.Array) -> jax.Array:
  """True where a token opens a new document after an earlier one in the row (packed rows)."""
  previous = jnp.pad(segment_ids_BL, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
  return (previous != segment_ids_BL) & (previous != -1)


class GatedDeltaNet(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    la = cfg.linear_attn
    d, i, y = cfg.emb_dim, la.linear_num_key_heads, la.linear_num_value_heads
    qd, wd, width = la.linear_key_head_dim, la.linear_value_head_dim, la.linear_conv_kernel_dim
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    dense = functools.partial(DenseGeneral, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
    self.query = dense((d,), (i, qd), ("embed", "heads", "kv"))
    self.key = dense((d,), (i, qd), ("embed", "heads", "kv"))
    self.value = dense((d,), (y, wd), ("embed", "heads", "kv"))
    self.output_gate = dense((d,), (y, wd), ("embed", "heads", "kv"))  # z
    self.write_strength = dense((d,), (y,), ("embed", "heads"))  # b: β = sigmoid(b)
    self.decay_input = dense((d,), (y,), ("embed", "heads"))  # a
    conv_init = nnx.initializers.normal(width ** -0.5)
    for name, heads, dim in (("query_conv", i, qd), ("key_conv", i, qd), ("value_conv", y, wd)):
      setattr(self, name, nnx.Param(conv_init(rngs.params(), (width, heads, dim), weight_dtype),
                                    out_sharding=(None, "heads", "kv")))
    self.dt_bias = nnx.Param(jnp.ones((y,), weight_dtype), out_sharding=("heads",))
    self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (y,), jnp.float32, 1.0, 16.0)).astype(weight_dtype),
                           out_sharding=("heads",))
    self.norm_scale = nnx.Param(jnp.ones((wd,), weight_dtype), out_sharding=("norm",))
    self.out = dense((y, wd), (d,), ("heads", "kv", "embed"))
    self.cfg, self.dtype = cfg, dtype

  def _conv(self, name: str, x_BLhd: jax.Array, state: jax.Array | None, segment_ids_BL: jax.Array | None,
            lengths_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal conv over one of q, k, v [B, L, heads, dim] (its kernel is depthwise per feature)."""
    b, length, heads, dim = x_BLhd.shape
    kernel = getattr(self, name)[...]
    width = kernel.shape[0]
    if state is None:
      state = jnp.zeros((b, width - 1, heads, dim), x_BLhd.dtype)
    out, new_state = gated_delta_rule.causal_conv(x_BLhd.reshape(b, length, heads * dim),
                                                  state.reshape(b, width - 1, heads * dim),
                                                  kernel.reshape(width, heads * dim), segment_ids_BL, lengths_B)
    return out.reshape(x_BLhd.shape), new_state.reshape(state.shape)

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               layer_index: int | jax.Array = 0, cache: LinearState | None = None,
               image_blocks_BL: jax.Array | None = None) -> jax.Array | tuple[jax.Array, LinearState]:
    """Output [B, L, D]; with a decode `cache` (a LinearState), (output, the state after this call's tokens)."""
    del layer_index, image_blocks_BL  # the same on every layer; no image blocks in a text family
    if cache is None:  # training: the recurrence and conv must see the tokens in order, not load-balanced
      def run(x: jax.Array, positions: jax.Array, segments: jax.Array) -> jax.Array:
        out = self._run(x, positions, segments, None)
        assert not isinstance(out, tuple)  # no cache, no state
        return out

      return context_parallel.in_natural_order(self.cfg.attn, run, x_BLD, positions_BL, segment_ids_BL)
    return self._run(x_BLD, positions_BL, segment_ids_BL, cache)

  def _run(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
           cache: LinearState | None) -> jax.Array | tuple[jax.Array, LinearState]:
    la = self.cfg.linear_attn
    if cache is not None:  # a prefill (first position 0) starts afresh: a reused slot forgets its last request
      fresh_B = positions_BL[:, 0] == 0
      cache = jax.tree.map(lambda s: jnp.where(fresh_B.reshape((-1,) + (1,) * (s.ndim - 1)), jnp.zeros_like(s), s),
                           cache)
    segments = None if cache is not None else segment_ids_BL
    real_BL = None if cache is None else segment_ids_BL != 0  # decoding: padding after each row's prompt
    lengths_B = None if real_BL is None else jnp.sum(real_BL, axis=1, dtype=jnp.int32)
    q, conv_q = self._conv("query_conv", self.query(x_BLD), None if cache is None else cache.conv_query, segments,
                           lengths_B)
    k, conv_k = self._conv("key_conv", self.key(x_BLD), None if cache is None else cache.conv_key, segments, lengths_B)
    v, conv_v = self._conv("value_conv", self.value(x_BLD), None if cache is None else cache.conv_value, segments,
                           lengths_B)
    beta_BLY = jax.nn.sigmoid(self.write_strength(x_BLD).astype(jnp.float32))
    a_BLY = self.decay_input(x_BLD).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)[None, None, :]
    g_BLY = -jnp.exp(self.a_log[...].astype(jnp.float32))[None, None, :] * jax.nn.softplus(a_BLY)
    if real_BL is not None:  # β = 0 and g = 0: a padding token leaves the state as it is
      beta_BLY = jnp.where(real_BL[..., None], beta_BLY, 0.0)
      g_BLY = jnp.where(real_BL[..., None], g_BLY, 0.0)
    if segments is not None:
      g_BLY = g_BLY + jnp.where(_document_starts(segments), gated_delta_rule.DOCUMENT_RESET_LOG_DECAY, 0.0)[..., None]
    repeat = la.linear_num_value_heads // la.linear_num_key_heads
    q = jnp.repeat(gated_delta_rule.l2_normalize(q) * la.linear_key_head_dim ** -0.5, repeat, axis=2)
    k = jnp.repeat(gated_delta_rule.l2_normalize(k), repeat, axis=2)
    names = ("activation_batch", "activation_length", "activation_heads", None)
    q, k, v = (sharding.constrain(t, names) for t in (q, k, v))
    b = x_BLD.shape[0]
    state = (jnp.zeros((b, la.linear_num_value_heads, la.linear_key_head_dim, la.linear_value_head_dim), jnp.float32)
             if cache is None else cache.state_BYQW)
    if attention_kernels.linear_attention_form(x_BLD.shape[1], cache is not None) == "recurrent":
      out_BLYW, state = gated_delta_rule.recurrent(q, k, v, g_BLY, beta_BLY, state)
    else:
      out_BLYW, state = gated_delta_rule.chunked(q, k, v, g_BLY, beta_BLY, state, la.linear_attention_chunk_size)
    normed = out_BLYW * jax.lax.rsqrt(jnp.mean(out_BLYW * out_BLYW, axis=-1, keepdims=True)
                                      + self.cfg.normalization_layer_epsilon)
    scale = self.norm_scale[...].astype(self.dtype)[None, None, None, :]
    gate = jax.nn.silu(self.output_gate(x_BLD).astype(jnp.float32))
    out_BLYW = ((normed.astype(self.dtype) * scale).astype(jnp.float32) * gate).astype(self.dtype)
    out_BLD = self.out(sharding.constrain(out_BLYW, names))
    if cache is None:
      return out_BLD
    return out_BLD, LinearState(conv_q, conv_k, conv_v, state)
