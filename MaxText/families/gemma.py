"""Gemma (HF `gemma`), Gemma 2 (HF `gemma2`) and Gemma 3 (HF `gemma3_text`, and `gemma3` with its
SigLIP vision tower: use_multimodal, layers/vision_tower.py): config and tensor mappings.

The tensors follow the Llama layout (see llama.py); the embedding is tied (no lm_head) and
the RMSNorm weights are stored as the gain's offset from 1 in both frameworks. Gemma 2's
four norms per layer map as
  input_layernorm            → pre_self_attention_layer_norm
  post_attention_layernorm   → attention_output_norm   (on the attention output)
  pre_feedforward_layernorm  → post_self_attention_layer_norm   (in front of the MLP)
  post_feedforward_layernorm → mlp_output_norm
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from MaxText.configuration.config_fields import require
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError
from MaxText.families import tensor_maps as r
from MaxText.families import VisionTower
from MaxText.layers import decoders, vision_tower
from MaxText.families import Family, gemma3_images, register_family
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, gated_mlp_tensors,
                                    layer_type_rope_hf_config, layer_type_ropes, max_positions, qk_norm_tensors,
                                    rope_hf_config, rope_keys, shape_hf_config, shape_keys)

# HF activation names that are the tanh-approximated GELU our "gelu" computes.
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _activation(hf: Mapping[str, Any]) -> None:
  """Gemma 2 and 3's MLP runs hidden_activation (hidden_act is not read). Gemma 1's runs hidden_act in transformers 5
  and hidden_activation in 4, so both must be the tanh GELU; its releases' hidden_act "gelu" is read as that."""
  if hf.get("model_type") == "gemma":
    r.require_hf(hf, "hidden_act", (*_TANH_GELU, "gelu"), "gelu_pytorch_tanh")
    r.require_hf(hf, "hidden_activation", (*_TANH_GELU, None), None)
  else:
    r.require_hf(hf, "hidden_activation", _TANH_GELU, "gelu_pytorch_tanh")


# What transformers' Gemma configs take for a field config.json leaves out (the published Gemma 3 image-text
# configs give only a few text_config fields): our own defaults would be another model.
_GEMMA_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 16}
_GEMMA2_DEFAULTS = {**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "num_key_value_heads": 4}
_GEMMA3_DEFAULTS = {**_GEMMA2_DEFAULTS, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4}


def gemma_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_GEMMA_DEFAULTS, **hf}
  _activation(hf)
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "tie_word_embeddings", (True,), True)
  return {"decoder_block": "gemma", **shape_keys(hf), **rope_keys(hf), "mlp_activations": ["gelu", "linear"],
          "normalization_type": "rms_plus_one", "logits_via_embedding": True, "scale_embedding": True}


def gemma_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "gelu_pytorch_tanh", "attention_bias": False,
          "max_position_embeddings": max_positions(cfg)}


def gemma_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return embedding_tensors(cfg) + decoder_tensors(cfg) + gated_mlp_tensors()


def gemma2_model_keys(hf: Mapping[str, Any], defaults: Mapping[str, Any] = _GEMMA2_DEFAULTS) -> dict[str, Any]:
  hf = {**defaults, **hf}
  keys = gemma_model_keys(hf)
  num_layers = hf["num_hidden_layers"]
  layer_types = r.given_layer_types(hf, ("sliding_attention", "full_attention"),
                                    lambda: ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(num_layers)])
  local = [kind == "sliding_attention" for kind in layer_types]
  window = r.sliding_window(hf, local)
  keys.update(decoder_block="gemma2", attention_layer_pattern=r.attention_pattern(local),
              attn_logits_soft_cap=soft_cap(hf, "attn_logit_softcapping"),
              final_logits_soft_cap=soft_cap(hf, "final_logit_softcapping"),
              query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]))
  if window is not None:
    keys["sliding_window_size"] = window
  return keys


def soft_cap(hf: Mapping[str, Any], key: str) -> float:
  """A soft cap (0: none here); null is none in transformers, which divides by a 0 (NaN logits)."""
  value = hf.get(key)
  if value is None:
    return 0.0
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
    raise ConfigError(f"HF config {key}={value!r} is not a soft cap (a positive number, or null for none); use the "
                      "checkpoint's own config.json")
  return float(value)


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
  # HF computes an encoder's mask (EmbeddingGemma) from this flag; our gemma3 layers are causal.
  r.require_hf(hf, "use_bidirectional_attention", (None, False), None)
  hf = {**_GEMMA3_DEFAULTS, **hf}
  global_rope, local_rope = layer_type_ropes(hf, 1_000_000.0, hf.get("rope_local_base_freq", 10_000.0))
  if hf.get("layer_types") is None:  # older config.json files: every sliding_window_pattern-th layer global, as HF reads them
    period = r.count_hf(hf, "sliding_window_pattern", "a layer period", 6)
    hf = {**hf, "layer_types": ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                for i in range(hf["num_hidden_layers"])]}
  # transformers' Gemma 3 attention takes no soft cap: a config's attn_logit_softcapping is not applied
  r.require_hf(hf, "attn_logit_softcapping", (None,))
  # nested RoPE: transformers applies no top-level original_max_position_embeddings to it
  keys = gemma2_model_keys({**hf, "rope_parameters": global_rope, "rope_scaling": None,
                            "original_max_position_embeddings": None}, _GEMMA3_DEFAULTS)
  r.require_hf(local_rope, "rope_type", ("default",), "default")
  keys.update(decoder_block="gemma3", use_qk_norm=True, rope_local_max_timescale=float(local_rope["rope_theta"]))
  return keys


def gemma3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  require(not cfg.attn.attn_logits_soft_cap, f"attn_logits_soft_cap={cfg.attn.attn_logits_soft_cap} cannot be written "
          "as an HF Gemma 3 model: transformers' Gemma 3 attention applies no soft cap")
  return {**gemma2_hf_config(cfg), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "rope_parameters": layer_type_rope_hf_config(cfg.rope)}


def gemma3_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  if cfg.vision.use_multimodal:
    return gemma3_multimodal_tensors(cfg)
  return gemma2_tensors(cfg) + qk_norm_tensors()


# ---- Gemma 3 with its vision tower (HF `gemma3`, Gemma3ForConditionalGeneration): the text model
# under `language_model`, SigLIP under `vision_tower`, the projector under `multi_modal_projector`.

def gemma3_any_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  return gemma3_multimodal_model_keys(hf) if hf.get("model_type") == "gemma3" else gemma3_model_keys(hf)


def gemma3_any_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return gemma3_multimodal_hf_config(cfg) if cfg.vision.use_multimodal else gemma3_hf_config(cfg)


def gemma3_multimodal_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  text = dict(hf.get("text_config") or {})
  text.update(model_type="gemma3_text", tie_word_embeddings=hf.get("tie_word_embeddings", True))
  vision = {"model_type": "siglip_vision_model", **(hf.get("vision_config") or {})}
  r.require_hf(vision, "model_type", ("siglip_vision_model",))
  r.require_hf(vision, "vision_use_head", (False,), False)
  r.require_hf(vision, "hidden_act", _TANH_GELU, "gelu_pytorch_tanh")
  r.require_hf(vision, "num_channels", (3,), 3)
  keys = gemma3_model_keys(text)
  keys.update(use_multimodal=True, vision_emb_dim=vision.get("hidden_size", 768),
              vision_mlp_dim=vision.get("intermediate_size", 3072), vision_num_layers=vision.get("num_hidden_layers", 12),
              vision_num_heads=vision.get("num_attention_heads", 12), vision_patch_size=vision.get("patch_size", 16),
              vision_image_size=vision.get("image_size", 224),
              vision_layer_norm_epsilon=float(vision.get("layer_norm_eps", 1e-6)),
              mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
              image_token_id=hf.get("image_token_index", 262_144), boi_token_id=hf.get("boi_token_index", 255_999),
              eoi_token_id=hf.get("eoi_token_index", 256_000))
  return keys


def gemma3_multimodal_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  text = {k: v for k, v in gemma3_hf_config(cfg).items() if k != "architectures"}
  vision = cfg.vision
  return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model", **r.vision_hf_config(cfg),
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": vision.vision_layer_norm_epsilon,
                            "attention_dropout": 0.0, "vision_use_head": False},
          "mm_tokens_per_image": vision.mm_tokens_per_image, "image_token_index": vision.image_token_id,
          "boi_token_index": vision.boi_token_id, "eoi_token_index": vision.eoi_token_id, "tie_word_embeddings": True}


# Written names (the published checkpoints' layout, which transformers 4 and 5 both load) -> the other
# spellings read: transformers 5's in-memory names, and its save_pretrained's vision tower without vision_model.
_MULTIMODAL_PREFIXES = {
    "language_model.model.": ("model.language_model.",),
    "language_model.lm_head.": ("lm_head.",),
    "vision_tower.vision_model.": ("vision_tower.", "model.vision_tower."),
    "multi_modal_projector.": ("model.multi_modal_projector.",),
}


def siglip_tensors(prefix: str = "vision_tower.vision_model.") -> list[r.TensorMap]:
  """SigLIP's vision transformer (no pooling head): torch [out, in] weights, our [in, out] kernels,
  attention projections split into heads, the patch conv as a dense kernel over (C, p, p)."""
  maps = [
      r.one(prefix + "embeddings.patch_embedding.weight", "vision_encoder/patch_embedding/kernel",
            lambda w, cfg: w.transpose(1, 2, 3, 0), lambda k, cfg: k.transpose(3, 0, 1, 2)),
      r.one(prefix + "embeddings.patch_embedding.bias", "vision_encoder/patch_embedding/bias"),
      r.one(prefix + "embeddings.position_embedding.weight", "vision_encoder/position_embedding/embedding"),
      r.one(prefix + "post_layernorm.weight", "vision_encoder/post_layernorm/scale"),
      r.one(prefix + "post_layernorm.bias", "vision_encoder/post_layernorm/bias"),
  ]
  return maps + r.vision_layer_tensors(prefix + "encoder.layers.{e}.")


def _same(x: r.Array, cfg: ModelConfig) -> r.Array:
  return x


def gemma3_multimodal_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  text = [dataclasses.replace(m, hf="language_model." + m.hf) for m in gemma2_tensors(cfg) + qk_norm_tensors()]
  projector = [r.one("multi_modal_projector.mm_input_projection_weight", "multimodal_projector/input_projection/kernel"),
               r.one("multi_modal_projector.mm_soft_emb_norm.weight", "multimodal_projector/soft_embedding_norm/scale")]
  written = text + siglip_tensors() + projector
  others = [dataclasses.replace(m, hf=alt + m.hf[len(prefix):], write=False)
            for m in written for prefix, alts in _MULTIMODAL_PREFIXES.items() if m.hf.startswith(prefix) for alt in alts]
  return written + others


def gemma3_vision_checks(values: Mapping[str, Any]) -> None:
  """Gemma 3's projector average-pools square blocks of patches into its soft tokens."""
  side, tokens = values["vision_image_size"] // values["vision_patch_size"], values["mm_tokens_per_image"]
  require(math.isqrt(tokens) ** 2 == tokens and side % math.isqrt(tokens) == 0,
          f"mm_tokens_per_image ({tokens}) must be a square whose side divides the {side} patches per image "
          "side (the projector average-pools square blocks of patches)")


register_family(Family("gemma", ("gemma",), ("gemma",), gemma_model_keys, gemma_hf_config, gemma_tensors,
                       reference_hf_configs={  # multi-query, heads wider than emb_dim / heads (as Gemma 7B)
                           "gemma": dict(model_type="gemma", **{**TINY_SHAPES, "num_key_value_heads": 1,
                                                                "head_dim": 32})}))
register_family(Family("gemma2", ("gemma2",), ("gemma2",), gemma2_model_keys, gemma2_hf_config, gemma2_tensors,
                       layer=decoders.SandwichNormDecoderLayer,
                       reference_hf_configs={  # local/global alternation, both soft caps, a query scalar
                           "gemma2": dict(model_type="gemma2", **{**TINY_SHAPES, "num_hidden_layers": 3},
                                          sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                          query_pre_attn_scalar=24)}))
register_family(Family("gemma3", ("gemma3_text", "gemma3"), ("gemma3",), gemma3_any_model_keys, gemma3_any_hf_config,
                       gemma3_tensors, layer=decoders.SandwichNormDecoderLayer,
                       vision=VisionTower(vision_tower.VisionEncoder, vision_tower.MultimodalProjector,
                                          bidirectional_images=True, flops_per_view=vision_tower.flops_per_view,
                                          check_keys=gemma3_vision_checks),
                       image_format=gemma3_images.IMAGE_FORMAT,
                       multimodal_reference_hf_configs={  # 2 images' soft tokens outnumber the window; 2x2 pooling
                           "gemma3-vision": dict(
                               model_type="gemma3", mm_tokens_per_image=16, boi_token_index=120, eoi_token_index=121,
                               image_token_index=122,
                               text_config=dict(model_type="gemma3_text", **{**TINY_SHAPES, "num_hidden_layers": 3},
                                                sliding_window=6, query_pre_attn_scalar=24,
                                                layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                               vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4, image_size=64,
                                                  patch_size=8, vision_use_head=False, layer_norm_eps=1e-5))},
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
