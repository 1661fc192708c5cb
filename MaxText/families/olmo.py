"""OLMo 2 (HF `olmo2`, decoder_block "olmo2") and OLMo 3 (HF `olmo3`, decoder_block "olmo3"): Llama's
tensors with the norms moved to the sub-blocks' outputs (layer "olmo2": h = x + norm(Attn(x)), then
h + norm(MLP(h))) and a QK-norm over all heads at once (qk_norm_over_all_heads). OLMo 3 adds sliding-window
layers, three of every four in the releases, and keeps RoPE scaling (YaRN in the long-context models) to
the full-attention layers: its local layers rotate by the unscaled base (rope_local_max_timescale).

HF names beyond Llama's (layer i)                        ours (inside layer i)
  model.layers.{i}.post_attention_layernorm.weight        attention_output_norm/scale
  model.layers.{i}.post_feedforward_layernorm.weight      mlp_output_norm/scale
  model.layers.{i}.self_attn.q_norm.weight [N * H]        self_attention/query_norm/scale
  model.layers.{i}.self_attn.k_norm.weight [K * H]        self_attention/key_norm/scale
There is no input_layernorm.
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.errors import ConfigError
from MaxText.families import Family, register_family
from MaxText.layers import decoders
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, gated_mlp_tensors,
                                    layer_type_rope_hf_config, layer_type_ropes, max_positions, qk_norm_tensors,
                                    rope_hf_config, rope_keys, shape_hf_config, shape_keys)


def olmo_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  layer = "model.layers.{i}."
  attention = [m for m in decoder_tensors(cfg) if "layernorm" not in m.hf]
  return embedding_tensors(cfg) + attention + qk_norm_tensors() + gated_mlp_tensors() + [
      r.one(layer + "post_attention_layernorm.weight", "attention_output_norm/scale"),
      r.one(layer + "post_feedforward_layernorm.weight", "mlp_output_norm/scale")]


# What transformers' Olmo2Config / Olmo3Config take for a field config.json leaves out: our own defaults
# (Llama's epsilon, no window) would be another model.
_OLMO2_DEFAULTS = {"rms_norm_eps": 1e-5}
_OLMO3_DEFAULTS = {**_OLMO2_DEFAULTS, "sliding_window": 4096}


def olmo2_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_OLMO2_DEFAULTS, **hf}
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  if hf.get("clip_qkv") is not None:
    raise ConfigError(f"HF config clip_qkv={hf['clip_qkv']!r} (OLMo 1's clipping) is not supported by the "
                      f"{hf.get('model_type')} converter (supported: None)")
  return {"decoder_block": "olmo2", **shape_keys(hf), **rope_keys(hf), "mlp_activations": ["silu", "linear"],
          "use_qk_norm": True, "qk_norm_over_all_heads": True,
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False))}


def olmo2_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "silu", "attention_bias": False,
          "max_position_embeddings": max_positions(cfg)}


def olmo3_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_OLMO3_DEFAULTS, **hf}
  global_rope, local_rope = layer_type_ropes(hf, 500_000.0, None)
  global_rope.setdefault("rope_theta", hf.get("rope_theta", 500_000.0))
  if local_rope.get("rope_theta") is None:  # transformers reads an unstated sliding-layer base as its default
    if float(global_rope["rope_theta"]) != 500_000.0:
      raise ConfigError(f"HF olmo3 config rope_theta={global_rope['rope_theta']!r} with no rope_parameters."
                        "sliding_attention.rope_theta is not supported: transformers gives the sliding layers base "
                        "500000 there, not rope_theta; state both layer types' rope_parameters")
    local_rope["rope_theta"] = 500_000.0
  r.require_hf(local_rope, "rope_type", ("default",), "default")
  # nested RoPE: transformers applies no top-level original_max_position_embeddings to it
  keys = olmo2_model_keys({**hf, "rope_parameters": global_rope, "rope_scaling": None,
                           "original_max_position_embeddings": None})
  num_layers = hf["num_hidden_layers"]
  layer_types = r.given_layer_types(hf, ("sliding_attention", "full_attention"),
                                    lambda: ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                             for i in range(num_layers)])
  local = [kind == "sliding_attention" for kind in layer_types]
  window, pattern = r.sliding_window(hf, local), r.attention_pattern(local)
  keys.update(decoder_block="olmo3", attention_layer_pattern=pattern)
  if window is not None:
    keys["sliding_window_size"] = window
    local_theta = float(local_rope.get("rope_theta", keys["rope_max_timescale"]))
    if keys["rope_type"] != "default" or local_theta != keys["rope_max_timescale"]:
      keys["rope_local_max_timescale"] = local_theta
  return keys


def olmo3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {**olmo2_hf_config(cfg), "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
          "layer_types": r.hf_layer_types(cfg.attn.attention_layer_pattern, cfg.num_decoder_layers),
          "sliding_window": cfg.attn.sliding_window_size, "rope_parameters": layer_type_rope_hf_config(cfg.rope)}


_TINY = dict(TINY_SHAPES, rms_norm_eps=1e-6)
# A window shorter than the test sequences, 3 sliding : 1 full as released; YaRN on the full layers only,
# over a short original context so that its ramp falls inside these few dimensions.
_OLMO3 = dict(model_type="olmo3", **{**_TINY, "num_hidden_layers": 4}, sliding_window=5,
              layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
register_family(Family("olmo2", ("olmo2",), ("olmo2",), olmo2_model_keys, olmo2_hf_config, olmo_tensors,
                       layer=decoders.PostNormDecoderLayer,
                       reference_hf_configs={"olmo2": dict(model_type="olmo2", **_TINY, rope_theta=500_000.0)}))
register_family(Family("olmo3", ("olmo3",), ("olmo3",), olmo3_model_keys, olmo3_hf_config, olmo_tensors,
                       layer=decoders.PostNormDecoderLayer,
                       reference_hf_configs={
                           "olmo3": dict(_OLMO3, rope_parameters={
                               "full_attention": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})}))
