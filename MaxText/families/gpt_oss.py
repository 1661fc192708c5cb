"""GPT-OSS (HF `gpt_oss`, decoder_block "gpt_oss"; gpt-oss-20b and gpt-oss-120b): a pre-norm
decoder whose attention has biases, per-head attention sinks and alternating sliding-window /
full layers (`layer_types`), YaRN RoPE (truncate=False), and a routed MoE MLP in every layer:
a router with a bias (top-k over its logits, softmax over the k chosen = our renormalised
top-k), experts with biases and the clamped SwiGLU (our clamped_swish x clamped_plus_one).

HF names beyond Llama's attention and norms (layer i)         ours (inside layer i)
  model.layers.{i}.self_attn.{q,k,v}_proj.bias [heads*H]       self_attention/{query,key,value}/bias [heads, H]
  model.layers.{i}.self_attn.o_proj.bias [D]                   self_attention/out/bias
  model.layers.{i}.self_attn.sinks [N]                         self_attention/sinks
  model.layers.{i}.mlp.router.weight [E, D] / .bias [E]        mlp/gate/kernel [D, E] / mlp/gate/bias
  model.layers.{i}.mlp.experts.gate_up_proj [E, D, 2F]         mlp/wi_0/kernel, mlp/wi_1/kernel [E, D, F]
      (gate and up interleaved: even columns gate, odd up; the bias [E, 2F] likewise)
  model.layers.{i}.mlp.experts.down_proj [E, F, D] / _bias [E, D]  mlp/wo/kernel / mlp/wo/bias

The published checkpoints store the experts MXFP4-quantised (`quantization_config`,
*_blocks / *_scales tensors); the converter dequantises them to the bfloat16 layout above as it
reads (families/mxfp4.py), and reads a bfloat16 checkpoint as it is. Other quantisation methods
are refused with one line. A config with sinks or biases switched off (an ablation) reads a
checkpoint without those tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from MaxText.families import mxfp4, tensor_maps as r
from MaxText.errors import ConfigError
from MaxText.families import Family, register_family
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, max_positions, rope_hf_config,
                                    rope_keys, shape_hf_config, shape_keys)
from MaxText.configuration.model_config import ModelConfig

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
ACTIVATIONS = ["clamped_swish", "clamped_plus_one"]


def _split_interleaved(x: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """[..., 2F] with gate in the even columns, up in the odd → (gate, up), each [..., F]."""
  del cfg
  return np.ascontiguousarray(x[..., 0::2]), np.ascontiguousarray(x[..., 1::2])


def _interleave(parts: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
  del cfg
  gate, up = parts
  return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _bias_in(num_heads: Callable[[ModelConfig], int], rope: bool = False) -> tuple[r.ConvertOne, r.ConvertOne]:
  """HF [heads*H] projection bias ↔ our [heads, H] (q/k permuted like their kernels when
  rope_interleaved)."""
  def to_ours(b: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    bias = b.reshape(num_heads(cfg), cfg.head_dim)
    return bias[..., r.rope_permutation(cfg.head_dim)] if rope and cfg.rope.rope_interleaved else bias

  def to_hf(bias: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if rope and cfg.rope.rope_interleaved:
      bias = bias[..., np.argsort(r.rope_permutation(cfg.head_dim))]
    return bias.reshape(-1)
  return to_ours, to_hf


def gpt_oss_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  maps = embedding_tensors(cfg) + decoder_tensors(cfg) + [
      r.one(_MLP + "router.weight", "mlp/gate/kernel", r.transpose, r.transpose),
      r.TensorMap(_MLP + "experts.gate_up_proj", ("mlp/wi_0/kernel", "mlp/wi_1/kernel"), _split_interleaved,
                  _interleave),
      r.one(_MLP + "experts.down_proj", "mlp/wo/kernel"),
  ]
  biases = [
      r.one(_ATTN + "q_proj.bias", "self_attention/query/bias", *_bias_in(r.query_heads, rope=True)),
      r.one(_ATTN + "k_proj.bias", "self_attention/key/bias", *_bias_in(r.kv_heads, rope=True)),
      r.one(_ATTN + "v_proj.bias", "self_attention/value/bias", *_bias_in(r.kv_heads)),
      r.one(_ATTN + "o_proj.bias", "self_attention/out/bias"),
      r.one(_MLP + "router.bias", "mlp/gate/bias"),
      r.TensorMap(_MLP + "experts.gate_up_proj_bias", ("mlp/wi_0/bias", "mlp/wi_1/bias"), _split_interleaved,
                  _interleave),
      r.one(_MLP + "experts.down_proj_bias", "mlp/wo/bias"),
  ]
  maps += biases if cfg.use_bias else [r.ignored(m.hf) for m in biases]
  sinks = _ATTN + "sinks"
  return maps + [r.one(sinks, "self_attention/sinks") if cfg.attn.attention_sinks else r.ignored(sinks)]


# What transformers' GptOssConfig takes for a field config.json leaves out (8 KV heads and head_dim 64, not
# derived from the query heads and width), its RoPE (YaRN over base 150000) where neither rope_parameters nor
# rope_scaling is given: our own defaults would be another model.
_GPT_OSS_DEFAULTS = {"rms_norm_eps": 1e-5, "sliding_window": 128, "rope_theta": 150_000.0, "num_key_value_heads": 8,
                     "head_dim": 64}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def gpt_oss_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_GPT_OSS_DEFAULTS, **hf}
  if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
    hf["rope_parameters"] = {**_GPT_OSS_ROPE, "rope_theta": hf["rope_theta"]}
  method = mxfp4.quant_method(hf)
  if method not in (None, "mxfp4"):
    raise ConfigError(f"this gpt_oss checkpoint is quantised with quant_method={method!r}; only the published "
                      "MXFP4 experts (quant_method 'mxfp4') or bfloat16 weights can be read: dequantise it first")
  r.require_hf(hf, "attention_bias", (True,), True)
  num_layers = hf["num_hidden_layers"]
  layer_types = r.given_layer_types(hf, ("sliding_attention", "full_attention"),
                                    lambda: ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(num_layers)])
  local = [kind == "sliding_attention" for kind in layer_types]
  window, pattern = r.sliding_window(hf, local), r.attention_pattern(local)
  num_experts = r.routed_experts(hf, "num_local_experts", "num_experts")
  keys = {"decoder_block": "gpt_oss", **shape_keys(hf), **rope_keys(hf), "mlp_activations": list(ACTIVATIONS),
          "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
          "use_bias": True, "attention_sinks": True, "attention_layer_pattern": pattern,
          "num_experts": num_experts,
          "num_experts_per_tok": r.experts_per_token(hf, num_experts), "norm_topk_prob": True,
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False))}
  if window is not None:
    keys["sliding_window_size"] = window
  return keys


def gpt_oss_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  layer_types = r.hf_layer_types(cfg.attn.attention_layer_pattern, cfg.num_decoder_layers)
  return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "silu", "attention_bias": True, "layer_types": layer_types,
          "sliding_window": cfg.attn.sliding_window_size, "max_position_embeddings": max_positions(cfg),
          "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.num_experts_per_tok,
          "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
          "router_aux_loss_coef": cfg.moe.load_balance_loss_weight}


# YaRN with an original context whose ramp spans fractional dimensions 0.2 .. 3.2 of these
# few, so GPT-OSS's truncate=False matters; a window shorter than the test sequences; a clamp
# the activations reach.
_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 256}
register_family(Family("gpt_oss", ("gpt_oss",), ("gpt_oss",), gpt_oss_model_keys, gpt_oss_hf_config,
                       gpt_oss_tensors,
                       reference_hf_configs={  # 4 experts, top-2; sliding then full layers
                           "gpt_oss": dict(model_type="gpt_oss", **{**TINY_SHAPES, "max_position_embeddings": 1024},
                                           rms_norm_eps=1e-5,
                                           num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                           swiglu_limit=1.0, rope_parameters=_YARN)}))
