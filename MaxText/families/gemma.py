"""Gemma (HF `gemma`) and Gemma 2 (HF `gemma2`): config and tensor mappings.

The tensors follow the Llama layout (see llama.py); the embedding is tied (no lm_head) and
the RMSNorm weights are stored as the gain's offset from 1 in both frameworks. Gemma 2's
four norms per layer map as
  input_layernorm            → pre_self_attention_layer_norm
  post_attention_layernorm   → attention_output_norm   (on the attention output)
  pre_feedforward_layernorm  → post_self_attention_layer_norm   (in front of the MLP)
  post_feedforward_layernorm → mlp_output_norm
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.configuration.model_config import ModelConfig
from MaxText.convert import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, gated_mlp_tensors,
                                    qk_norm_tensors, rope_hf_config, rope_keys, shape_hf_config, shape_keys)

# HF activation names that are the tanh-approximated GELU our "gelu" computes.
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _activation(hf: Mapping[str, Any]) -> None:
  key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
  r.require_hf(hf, key, _TANH_GELU, "gelu_pytorch_tanh")


def gemma_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  _activation(hf)
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "tie_word_embeddings", (True,), True)
  return {"decoder_block": "gemma", **shape_keys(hf), **rope_keys(hf), "mlp_activations": ["gelu", "linear"],
          "normalization_type": "rms_plus_one", "logits_via_embedding": True, "scale_embedding": True}


def gemma_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "gelu_pytorch_tanh", "attention_bias": False,
          "max_position_embeddings": max(cfg.max_target_length, 8192)}


def gemma_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return embedding_tensors(cfg) + decoder_tensors(cfg) + gated_mlp_tensors()


def gemma2_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  keys = gemma_model_keys(hf)
  num_layers = hf["num_hidden_layers"]
  layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(num_layers)]
  window = hf.get("sliding_window")
  pattern = r.attention_pattern([kind == "sliding_attention" and bool(window) for kind in layer_types])
  keys.update(decoder_block="gemma2", attention_layer_pattern=pattern,
              attn_logits_soft_cap=float(hf.get("attn_logit_softcapping") or 0.0),
              final_logits_soft_cap=float(hf.get("final_logit_softcapping") or 0.0),
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", keys["head_dim"])))
  if "local" in pattern and window:
    keys["sliding_window_size"] = int(window)
  return keys


def gemma2_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  layer_types = r.hf_layer_types(cfg.attn.attention_layer_pattern, cfg.num_decoder_layers)
  return {**gemma_hf_config(cfg), "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
          "hidden_activation": "gelu_pytorch_tanh", "layer_types": layer_types,
          "sliding_window": cfg.attn.sliding_window_size, "attn_logit_softcapping": cfg.attn.attn_logits_soft_cap or None,
          "final_logit_softcapping": cfg.final_logits_soft_cap or None,
          "query_pre_attn_scalar": _whole(cfg.attn.query_pre_attn_scalar or cfg.head_dim)}


def _whole(value: float) -> int | float:
  """HF's config validation wants ints where the value is whole (query_pre_attn_scalar)."""
  return int(value) if float(value).is_integer() else value


def gemma2_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  layer = "model.layers.{i}."
  attention = [m for m in decoder_tensors(cfg) if not m.hf.endswith("post_attention_layernorm.weight")]
  return embedding_tensors(cfg) + attention + gated_mlp_tensors() + [
      r.one(layer + "post_attention_layernorm.weight", "attention_output_norm/scale"),
      r.one(layer + "pre_feedforward_layernorm.weight", "post_self_attention_layer_norm/scale"),
      r.one(layer + "post_feedforward_layernorm.weight", "mlp_output_norm/scale"),
  ]


def gemma3_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Gemma 3 text: Gemma 2's layer and local/global layers (5:1 in the releases), with QK-norm,
  no soft caps, and separate RoPE for local layers (base `rope_local_base_freq`, unscaled) and
  global ones (base `rope_theta`, linear scaling in the 4B and larger models)."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params:  # transformers >= 5: one RoPE per layer type
    global_rope, local_rope = params["full_attention"], params.get("sliding_attention", {})
  else:
    global_rope = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    local_rope = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
  keys = gemma2_model_keys({**hf, "rope_parameters": global_rope, "rope_scaling": None})
  r.require_hf(local_rope, "rope_type", ("default",), "default")
  keys.update(decoder_block="gemma3", use_qk_norm=True, rope_local_max_timescale=float(local_rope["rope_theta"]))
  return keys


def gemma3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  hf = gemma2_hf_config(cfg)
  global_rope = rope_hf_config(cfg.rope)["rope_parameters"]
  local_theta = cfg.rope.rope_local_max_timescale or cfg.rope.rope_max_timescale
  return {**hf, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "rope_parameters": {"full_attention": global_rope,
                              "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}}


def gemma3_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return gemma2_tensors(cfg) + qk_norm_tensors()


register_family(Family("gemma", ("gemma",), ("gemma",), gemma_model_keys, gemma_hf_config, gemma_tensors,
                       reference_hf_configs={  # multi-query, heads wider than emb_dim / heads (as Gemma 7B)
                           "gemma": dict(model_type="gemma", **{**TINY_SHAPES, "num_key_value_heads": 1,
                                                                "head_dim": 32})}))
register_family(Family("gemma2", ("gemma2",), ("gemma2",), gemma2_model_keys, gemma2_hf_config, gemma2_tensors,
                       layer="gemma2",
                       reference_hf_configs={  # local/global alternation, both soft caps, a query scalar
                           "gemma2": dict(model_type="gemma2", **{**TINY_SHAPES, "num_hidden_layers": 3},
                                          sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                          query_pre_attn_scalar=24)}))
register_family(Family("gemma3", ("gemma3_text",), ("gemma3",), gemma3_model_keys, gemma3_hf_config, gemma3_tensors,
                       layer="gemma2",
                       reference_hf_configs={  # 2 local : 1 global, QK-norm, per-kind RoPE, linear scaling
                           "gemma3": dict(model_type="gemma3_text", **{**TINY_SHAPES, "num_hidden_layers": 4},
                                          sliding_window=6, query_pre_attn_scalar=24,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                       "sliding_attention"],
                                          rope_parameters={
                                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 1_000_000.0},
                                              "sliding_attention": {"rope_type": "default",
                                                                    "rope_theta": 10_000.0}})}))
