"""Llama 2 / 3 / 3.1 (HF `llama`) and Mistral (HF `mistral`): config and tensor mappings.

HF names (per layer i)                               ours (inside layer i)
  model.layers.{i}.input_layernorm.weight            pre_self_attention_layer_norm/scale
  model.layers.{i}.self_attn.{q,k,v}_proj.weight     self_attention/{query,key,value}/kernel [D, heads, H]
  model.layers.{i}.self_attn.o_proj.weight           self_attention/out/kernel [N, H, D]
  model.layers.{i}.post_attention_layernorm.weight   post_self_attention_layer_norm/scale
  model.layers.{i}.mlp.{gate,up,down}_proj.weight    mlp/{wi_0,wi_1,wo}/kernel
and model.embed_tokens / model.norm / lm_head at the top. HF stores RoPE in the halves
layout our default uses; with rope_interleaved the q/k kernels are permuted.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from MaxText.configuration.model_config import ModelConfig, RopeConfig
from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.errors import ConfigError


def decoder_tensors(cfg: ModelConfig, prefix: str = "model.layers.{i}.") -> list[r.TensorMap]:
  """Attention and norm tensors of a Llama-layout layer (also Gemma's and Mixtral's)."""
  q_in, q_out = r.heads_in(r.query_heads, rope=True)
  k_in, k_out = r.heads_in(r.kv_heads, rope=True)
  v_in, v_out = r.heads_in(r.kv_heads)
  attn = prefix + "self_attn."
  return [
      r.one(prefix + "input_layernorm.weight", "pre_self_attention_layer_norm/scale"),
      r.one(prefix + "post_attention_layernorm.weight", "post_self_attention_layer_norm/scale"),
      r.one(attn + "q_proj.weight", "self_attention/query/kernel", q_in, q_out),
      r.one(attn + "k_proj.weight", "self_attention/key/kernel", k_in, k_out),
      r.one(attn + "v_proj.weight", "self_attention/value/kernel", v_in, v_out),
      r.one(attn + "o_proj.weight", "self_attention/out/kernel", r.heads_out, r.heads_out_to_hf),
  ]


def gated_mlp_tensors(prefix: str = "model.layers.{i}.mlp.") -> list[r.TensorMap]:
  return [
      r.one(prefix + "gate_proj.weight", "mlp/wi_0/kernel", r.transpose, r.transpose),
      r.one(prefix + "up_proj.weight", "mlp/wi_1/kernel", r.transpose, r.transpose),
      r.one(prefix + "down_proj.weight", "mlp/wo/kernel", r.transpose, r.transpose),
  ]


def qk_norm_tensors(prefix: str = "model.layers.{i}.self_attn.") -> list[r.TensorMap]:
  """QK-norm gains (Qwen3, Gemma 3): one RMSNorm scale over head_dim for queries, one for keys."""
  return [r.one(prefix + "q_norm.weight", "self_attention/query_norm/scale"),
          r.one(prefix + "k_norm.weight", "self_attention/key_norm/scale")]


def embedding_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """Token table, final norm and (untied) output projection; a tied checkpoint's lm_head copy is skipped."""
  maps = [r.one("model.embed_tokens.weight", "token_embedder/embedding"),
          r.one("model.norm.weight", "decoder_norm/scale")]
  if cfg.logits_via_embedding:
    return maps + [r.ignored("lm_head.weight")]
  return maps + [r.one("lm_head.weight", "logits_dense/kernel", r.transpose, r.transpose)]


def llama_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return embedding_tensors(cfg) + decoder_tensors(cfg) + gated_mlp_tensors() + [
      r.ignored("model.layers.{i}.self_attn.rotary_emb.inv_freq")]  # a buffer older checkpoints saved


def rope_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """RoPE keys from either the transformers>=5 `rope_parameters` or the older `rope_theta`/`rope_scaling`, read as
  transformers reads them: `rope_scaling` over `rope_parameters` where both are set, and a top-level
  original_max_position_embeddings over the one inside them (its Phi-3 rule, applied as the model is built)."""
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  if not isinstance(hf.get(field) or {}, Mapping):
    raise ConfigError(f"HF config {field}={str(hf.get(field))[:60]!r} is not an object of RoPE settings "
                      "({\"rope_type\": ..., \"factor\": ...}); use the checkpoint's own config.json")
  params = dict(hf.get(field) or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type in ("llama3", "yarn") and hf.get("original_max_position_embeddings") is not None:
    params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
  keys: dict[str, Any] = {"rope_max_timescale": float(theta), "rope_type": "default"}
  # transformers' plain RoPE here ignores partial_rotary_factor, its scaled ones shrink the frequencies to that
  # fraction while still rotating every dimension: a shape error, no model to convert.
  fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if rope_type != "default" and fraction is not None and float(fraction) != 1.0:
    raise ConfigError(f"HF config partial_rotary_factor={fraction} with {field} rope_type={rope_type!r} is not a model "
                      f"transformers' {hf.get('model_type')} can run (it rotates every dimension); remove "
                      "partial_rotary_factor from config.json or set it to 1.0")
  if rope_type == "llama3":
    keys.update(rope_type="llama3", rope_scaling_factor=float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_max_position=int(params["original_max_position_embeddings"]))
  elif rope_type == "linear":
    keys.update(rope_type="linear", rope_scaling_factor=float(params["factor"]))
  elif rope_type == "yarn":
    # Unset (null) only takes the default: transformers computes with a 0 (an inf or NaN model).
    original = params.get("original_max_position_embeddings")
    original = hf["max_position_embeddings"] if original is None else original
    if not original > 0:
      raise ConfigError(f"HF config {field} original_max_position_embeddings={original} is not a positive length")
    factor = params.get("factor")
    if factor is not None and not float(factor) >= 1:
      raise ConfigError(f"HF config {field} factor={factor} is not a YaRN scaling factor (>= 1)")
    factor = float(hf["max_position_embeddings"] / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None and not attention_factor > 0:  # transformers scales cos and sin by it as given
      raise ConfigError(f"HF config {field} attention_factor={attention_factor} is not a YaRN attention factor (a "
                        "positive number, or null for the one from factor)")
    # transformers' YaRN takes mscale / mscale_all_dim only as this ratio, and only when both are set
    # (DeepSeek's softmax correction from mscale_all_dim is its own, families/deepseek.py).
    if attention_factor is None and params.get("mscale") and params.get("mscale_all_dim"):
      attention_factor = _yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"])
    keys.update(rope_type="yarn", rope_scaling_factor=factor, rope_original_max_position=int(original),
                rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                rope_yarn_truncate=bool(params.get("truncate", True)),
                rope_attention_factor=float(attention_factor or 0.0))
  elif rope_type != "default":
    raise ConfigError(f"HF config {field} rope_type={rope_type!r} is not supported (supported: default, llama3, "
                      "linear, yarn)")
  return keys


def _yarn_mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def layer_type_ropes(hf: Mapping[str, Any], default_theta: float, legacy_local_theta: float | None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(full-attention RoPE, sliding-attention RoPE) of a family with one RoPE per layer type (Gemma 3, OLMo 3):
  transformers >= 5's `rope_parameters` by layer type, or the older `rope_theta` / `rope_scaling` (scaling the
  full-attention layers only) with the local layers' base `legacy_local_theta` (None: left unstated)."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params:  # a rope_scaling beside them still scales the full-attention layers, as in transformers
    return ({**params["full_attention"], **(hf.get("rope_scaling") or {})},
            dict(params.get("sliding_attention") or {}))
  return ({**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", default_theta)},
          {"rope_theta": legacy_local_theta})


def layer_type_rope_hf_config(rope: RopeConfig) -> dict[str, Any]:
  """`rope_parameters` by layer type: the global RoPE on full-attention layers, plain RoPE on sliding ones."""
  return {"full_attention": rope_hf_config(rope)["rope_parameters"],
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": rope.rope_local_max_timescale or rope.rope_max_timescale}}


def max_positions(cfg: ModelConfig) -> int:
  """HF's max_position_embeddings, the longest sequence the model is meant for (serving stacks size their context
  from it): a converted model's own value, raised to the length it was trained at and, for llama3 / yarn RoPE, to
  the scaled context, so that a round trip keeps it and a model trained from scratch declares at least its run's."""
  scaled = 0
  if cfg.rope.rope_type in ("llama3", "yarn"):
    scaled = int(cfg.rope.rope_original_max_position * cfg.rope.rope_scaling_factor)
  return max(cfg.max_position_embeddings, cfg.max_target_length, scaled)


def rope_hf_config(rope: RopeConfig) -> dict[str, Any]:
  params: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.rope_max_timescale}
  if rope.rope_type == "linear":
    params.update(factor=rope.rope_scaling_factor)
  if rope.rope_type == "yarn":
    params.update(factor=rope.rope_scaling_factor, original_max_position_embeddings=rope.rope_original_max_position,
                  beta_fast=rope.rope_yarn_beta_fast, beta_slow=rope.rope_yarn_beta_slow, truncate=rope.rope_yarn_truncate)
    if rope.rope_attention_factor > 0:
      params.update(attention_factor=rope.rope_attention_factor)
  if rope.rope_type == "llama3":
    params.update(factor=rope.rope_scaling_factor, low_freq_factor=rope.rope_low_freq_factor,
                  high_freq_factor=rope.rope_high_freq_factor,
                  original_max_position_embeddings=rope.rope_original_max_position)
  return {"rope_parameters": params, "rope_theta": rope.rope_max_timescale}


def shape_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Widths, heads and depth shared by every Llama-layout config.json. A num_key_value_heads or head_dim that
  is absent or null is derived as LlamaConfig derives it (as many KV heads as query heads; hidden_size //
  num_attention_heads); a family whose transformers config has a fixed default for one instead (Mistral's 8
  KV heads, Qwen3's head_dim 128, ...) puts it in `hf` first, in its `_*_DEFAULTS`."""
  heads = hf["num_attention_heads"]
  return {
      "base_emb_dim": hf["hidden_size"], "base_num_query_heads": heads,
      "base_num_kv_heads": hf.get("num_key_value_heads") or heads, "base_mlp_dim": hf["intermediate_size"],
      "base_num_decoder_layers": hf["num_hidden_layers"], "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
      "vocab_size": hf["vocab_size"], "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
  }


def shape_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {
      "hidden_size": cfg.emb_dim, "num_attention_heads": cfg.num_query_heads, "num_key_value_heads": cfg.num_kv_heads,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_decoder_layers, "head_dim": cfg.head_dim,
      "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.normalization_layer_epsilon,
      "tie_word_embeddings": cfg.logits_via_embedding,
  }


def llama_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "mlp_bias", (False,), False)
  return {"decoder_block": "llama2", **shape_keys(hf), **rope_keys(hf), "mlp_activations": ["silu", "linear"],
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False))}


def llama_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
          "max_position_embeddings": max_positions(cfg)}


# What transformers' MistralConfig takes for a field config.json leaves out: our own defaults were no window and
# as many KV heads as query heads (LlamaConfig's rule; MistralConfig's default is 8, its 7B's count).
_MISTRAL_DEFAULTS = {"sliding_window": 4096, "num_key_value_heads": 8}


def mistral_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_MISTRAL_DEFAULTS, **hf}
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  window = hf.get("sliding_window")
  if window is not None and not window > 0:  # transformers masks every key under a window of 0
    raise ConfigError(f"HF config sliding_window={window} is not a window (a positive length, or null for none)")
  keys = {"decoder_block": "mistral", **shape_keys(hf), **rope_keys(hf), "mlp_activations": ["silu", "linear"],
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
          "attention_layer_pattern": ["local"] if window else ["global"]}
  if window:
    keys["sliding_window_size"] = int(window)
  return keys


def mistral_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  window = cfg.attn.sliding_window_size if "local" in cfg.attn.attention_layer_pattern else None
  return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "silu", "sliding_window": window,
          "max_position_embeddings": max_positions(cfg)}


# The tiny reference models' shapes (GQA: 4 query heads, 2 kv heads), shared with the families
# built on Llama's layout.
TINY_SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# Llama 3.1's frequency scaling set to move real frequencies at these lengths.
_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

register_family(Family("llama", ("llama",), ("llama2",), llama_model_keys, llama_hf_config, llama_tensors,
                       reference_hf_configs={
                           "llama3.1": dict(model_type="llama", **TINY_SHAPES, rms_norm_eps=1e-5,
                                            rope_parameters=_LLAMA31_ROPE),
                           "llama2-tied": dict(model_type="llama", **TINY_SHAPES, rms_norm_eps=1e-5,
                                               tie_word_embeddings=True)}))
register_family(Family("mistral", ("mistral",), ("mistral",), mistral_model_keys, mistral_hf_config, llama_tensors,
                       reference_hf_configs={  # a window shorter than the test sequences
                           "mistral": dict(model_type="mistral", **TINY_SHAPES, rms_norm_eps=1e-5,
                                           sliding_window=5)}))
