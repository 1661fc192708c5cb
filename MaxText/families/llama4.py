"""Llama 4 text (HF `llama4_text`, decoder_block "llama4"): the decoders of Scout 17B-16E and Maverick 17B-128E.

Llama's pre-norm layer (llama.py) with
  * iRoPE: RoPE layers attend within fixed chunks of `attention_chunk_size` positions
    (attention_layer_pattern "chunked"); every no_rope_layer_interval-th layer is a global NoPE
    layer (rope_layer_pattern "nope") whose queries are scaled up with position
    (attn_temperature_floor_scale / attn_temperature_scale),
  * a weightless QK-norm after RoPE on the RoPE layers (use_qk_l2_norm),
  * RoPE in the interleaved pair layout, which HF stores as is (no q/k permutation),
  * an MoE MLP in every layer: top-1 routing whose sigmoid(router logit) scales the expert's
    input (moe_router_scales_input) and one shared expert as wide as a routed one.

HF names (layer i)                                           ours (inside layer i)
  model.layers.{i}.feed_forward.router.weight [E, D]         mlp/gate/kernel [D, E]
  model.layers.{i}.feed_forward.experts.gate_up_proj [E, D, 2F]  mlp/wi_0, mlp/wi_1 kernels [E, D, F]
                                                              (gate columns first, then up)
  model.layers.{i}.feed_forward.experts.down_proj [E, F, D]  mlp/wo/kernel [E, F, D]
  model.layers.{i}.feed_forward.shared_expert.{gate,up,down}_proj.weight  mlp/shared_mlp/{wi_0,wi_1,wo}/kernel
Attention, norms and embeddings map as Llama's. The experts are fused on disk too.

Maverick 17B-128E interleaves dense layers (a gated MLP of intermediate_size_mlp, HF
feed_forward.{gate,up,down}_proj) with the MoE ones (interleave_moe_layer_step 2: layers 1, 3, ...
MoE): moe_layer_interval=2, the dense layers in the dense_layers stack, run in order with the MoE
layers (models/transformer.py).

The image-text checkpoints (HF `llama4`, Llama4ForConditionalGeneration: a text_config beside a
vision_config) convert with use_multimodal (llama4_vision.py): the text model under
`language_model.`, the vision encoder and its pixel-shuffle adapter under `vision_model.` (ours
vision_encoder/, the adapter at vision_encoder/adapter/), the projector `multi_modal_projector.linear_1`
(ours multimodal_projector/projection). Linear weights are torch [out, in], our kernels [in, out].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from MaxText.families import tensor_maps as r
from MaxText.families import VisionTower, llama4_vision
from MaxText.errors import ConfigError
from MaxText.families import Family, llama4_images, register_family
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, gated_mlp_tensors,
                                    max_positions, rope_hf_config, rope_keys, shape_hf_config, shape_keys)
from MaxText.configuration.model_config import ModelConfig

_FF = "model.layers.{i}.feed_forward."


def _split_gate_up(gate_up_EDK: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """HF [E, D, 2F] (gate columns, then up) → our wi_0, wi_1 [E, D, F]."""
  f = cfg.mlp_dim
  return gate_up_EDK[..., :f], gate_up_EDK[..., f:]


def _join_gate_up(kernels: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
  del cfg
  return np.concatenate(kernels, axis=-1)


def llama4_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  attn = "model.layers.{i}.self_attn."
  # HF's Llama 4 rotates interleaved pairs itself, so q/k map unpermuted (rope_interleaved is ours too).
  q_in, q_out = r.heads_in(r.query_heads)
  k_in, k_out = r.heads_in(r.kv_heads)
  layer = [m for m in decoder_tensors(cfg) if not m.hf.endswith(("q_proj.weight", "k_proj.weight"))]
  shared = gated_mlp_tensors(_FF + "shared_expert.")
  moe = [
      r.one(_FF + "router.weight", "mlp/gate/kernel", r.transpose, r.transpose),
      r.TensorMap(_FF + "experts.gate_up_proj", ("mlp/wi_0/kernel", "mlp/wi_1/kernel"), _split_gate_up,
                  _join_gate_up),
      r.one(_FF + "experts.down_proj", "mlp/wo/kernel"),
      *[r.TensorMap(m.hf, tuple(p.replace("mlp/", "mlp/shared_mlp/") for p in m.ours), m.to_ours, m.to_hf)
        for m in shared],
  ]
  # Maverick's dense layers (moe_layer_interval > 1): a plain gated MLP under feed_forward.
  dense = [dataclasses.replace(m, stack="dense_layers") for m in gated_mlp_tensors(_FF)] \
      if cfg.moe.moe_layer_interval > 1 else []
  return embedding_tensors(cfg) + layer + [
      r.one(attn + "q_proj.weight", "self_attention/query/kernel", q_in, q_out),
      r.one(attn + "k_proj.weight", "self_attention/key/kernel", k_in, k_out),
  ] + [dataclasses.replace(m, stack="layers") for m in moe] + dense


def _pattern(kinds: Sequence[str]) -> list[str]:
  """The shortest list that, repeated, gives the per-layer `kinds`."""
  for period in range(1, len(kinds) + 1):
    if all(kinds[i] == kinds[i % period] for i in range(len(kinds))):
      return list(kinds[:period])
  return list(kinds)


def _moe_layers(hf: Mapping[str, Any]) -> list[int]:
  layers, step = hf["num_hidden_layers"], _moe_step(hf)
  given = hf.get("moe_layers")
  return list(given) if given is not None else list(range(step - 1, layers, step))


def _moe_step(hf: Mapping[str, Any]) -> int:
  return r.count_hf(hf, "interleave_moe_layer_step", "a layer period", 1)


def _no_rope_layers(hf: Mapping[str, Any]) -> list[int]:
  interval = r.count_hf(hf, "no_rope_layer_interval", "a layer period", 4)
  return list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])])


# What transformers' Llama4TextConfig takes for a shape field config.json (or its text_config) leaves out:
# fixed numbers, not derived from the query heads and width as shape_keys would.
_LLAMA4_TEXT_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500_000.0}


def llama4_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_LLAMA4_TEXT_DEFAULTS, **hf}
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "num_experts_per_tok", (1,), 1)
  layers = hf["num_hidden_layers"]
  step = _moe_step(hf)
  if _moe_layers(hf) != list(range(step - 1, layers, step)) or layers % step:
    raise ConfigError(f"HF llama4_text moe_layers={hf.get('moe_layers')} with interleave_moe_layer_step={step} over "
                      f"{layers} layers is not supported: the MoE layers must be every {step}-th "
                      f"(layers {step - 1}, {2 * step - 1}, ...) and the layer count a multiple of {step}")
  uses_rope = _no_rope_layers(hf)[:layers]
  # transformers' default kinds chunk every RoPE layer unless attention_chunk_size is null (0 is a chunk size)
  chunk = hf.get("attention_chunk_size", 8192)
  layer_types = r.given_layer_types(hf, ("chunked_attention", "full_attention"),
                                    lambda: ["chunked_attention" if rope and chunk is not None else "full_attention"
                                             for rope in uses_rope])
  for kind in layer_types:
    if kind not in ("chunked_attention", "full_attention"):
      raise ConfigError(f"HF llama4_text layer_types entry {kind!r} is not supported "
                        "(supported: chunked_attention, full_attention)")
  attention = _pattern(["chunked" if kind == "chunked_attention" else "global" for kind in layer_types])
  keys = {"decoder_block": "llama4", **shape_keys(hf), **rope_keys(hf), "rope_interleaved": True,
          "mlp_activations": ["silu", "linear"], "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
          "attention_layer_pattern": attention,
          "rope_layer_pattern": _pattern(["rope" if rope else "nope" for rope in uses_rope]),
          "use_qk_l2_norm": bool(hf.get("use_qk_norm", True)),
          "num_experts": r.routed_experts(hf, "num_local_experts"), "num_experts_per_tok": 1, "shared_experts": 1,
          "moe_router_scales_input": True, "moe_layer_interval": step}
  if step > 1:
    keys["dense_mlp_dim"] = int(hf["intermediate_size_mlp"])
  if "chunked" in attention:
    keys["attention_chunk_size"] = r.count_hf(hf, "attention_chunk_size", "a chunk length for its "
                                                 "chunked_attention layers", 8192)
  if hf.get("attn_temperature_tuning", True):
    keys.update(attn_temperature_floor_scale=float(hf.get("floor_scale", 8192)),
                attn_temperature_scale=float(hf.get("attn_scale", 0.1)))
  return keys


def _per_layer(pattern: Sequence[str], layers: int) -> list[str]:
  return [pattern[i % len(pattern)] for i in range(layers)]


def llama4_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  layers = cfg.num_decoder_layers
  # What HF's Llama 4 cannot express (a window, learned QK-norm, top-2, ...) is refused by
  # maxtext_to_hf's round trip through llama4_model_keys, which names the keys.
  attention = _per_layer(cfg.attn.attention_layer_pattern, layers)
  tuning = cfg.attn.attn_temperature_floor_scale > 0
  return {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", **shape_hf_config(cfg),
          **rope_hf_config(cfg.rope), "hidden_act": "silu", "attention_bias": False,
          "max_position_embeddings": max_positions(cfg),
          # With every layer MoE the dense width is unused; Scout's config gives twice an expert's.
          "intermediate_size_mlp": (cfg.moe.dense_mlp_dim or cfg.mlp_dim) if cfg.moe.moe_layer_interval > 1 else 2 * cfg.mlp_dim,
          "interleave_moe_layer_step": cfg.moe.moe_layer_interval,
          "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": 1,
          "no_rope_layers": [int(kind == "rope") for kind in _per_layer(cfg.rope.rope_layer_pattern, layers)],
          "layer_types": ["chunked_attention" if kind == "chunked" else "full_attention" for kind in attention],
          "attention_chunk_size": cfg.attn.attention_chunk_size if "chunked" in attention else None,
          "use_qk_norm": cfg.attn.use_qk_l2_norm, "attn_temperature_tuning": tuning,
          "floor_scale": int(cfg.attn.attn_temperature_floor_scale) if tuning else 8192,
          "attn_scale": cfg.attn.attn_temperature_scale, "router_aux_loss_coef": cfg.moe.load_balance_loss_weight}


# Scout's llama3 frequency scaling, shrunk so it moves real frequencies at the test lengths.
_TINY_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# ---- the image-text model (HF `llama4`)

def _patch_in(w: r.Array, cfg: ModelConfig) -> r.Array:
  """HF's unfold linear [E, C·p·p] (channel-major, as Unfold flattens) -> our kernel [C, p, p, E]."""
  p = cfg.vision.vision_patch_size
  return w.T.reshape(-1, p, p, cfg.vision.vision_emb_dim)


def llama4_vision_tensors() -> list[r.TensorMap]:
  v = "vision_model."
  maps = [
      r.one(v + "patch_embedding.linear.weight", "vision_encoder/patch_embedding/kernel", _patch_in, r.vision_flat_out),
      r.one(v + "class_embedding", "vision_encoder/class_embedding"),
      r.one(v + "positional_embedding_vlm", "vision_encoder/position_embedding/embedding"),
      r.one(v + "vision_adapter.mlp.fc1.weight", "vision_encoder/adapter/fc1/kernel", r.transpose, r.transpose),
      r.one(v + "vision_adapter.mlp.fc2.weight", "vision_encoder/adapter/fc2/kernel", r.transpose, r.transpose),
      r.one("multi_modal_projector.linear_1.weight", "multimodal_projector/projection/kernel", r.transpose, r.transpose),
  ]
  for norm in ("layernorm_pre", "layernorm_post"):
    maps += [r.one(v + f"{norm}.weight", f"vision_encoder/{norm}/scale"),
             r.one(v + f"{norm}.bias", f"vision_encoder/{norm}/bias")]
  return maps + r.vision_layer_tensors(v + "model.layers.{e}.", norms=("input_layernorm", "post_attention_layernorm"),
                                      out="o_proj")


def llama4_any_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  if not cfg.vision.use_multimodal:
    return llama4_tensors(cfg)
  text = [dataclasses.replace(m, hf="language_model." + m.hf) for m in llama4_tensors(cfg)]
  return text + llama4_vision_tensors()


def llama4_multimodal_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  vision = {"model_type": "llama4_vision_model", **(hf.get("vision_config") or {})}
  r.require_hf(vision, "hidden_act", ("gelu",), "gelu")
  r.require_hf(vision, "num_channels", (3,), 3)
  r.require_hf(vision, "multi_modal_projector_bias", (False,), False)
  r.require_hf(vision, "vision_feature_layer", (-1,), -1)
  r.require_hf(vision, "vision_feature_select_strategy", ("default",), "default")
  hidden, ratio = int(vision.get("hidden_size", 768)), float(vision.get("pixel_shuffle_ratio", 0.5))
  width = int(vision.get("projector_output_dim", 4096))
  widths = {name: int(vision.get(name, default)) for name, default in
            (("projector_input_dim", 4096), ("projector_output_dim", 4096), ("vision_output_dim", 7680))}
  mlp = int(vision.get("intermediate_size", 5632))
  if len(set(widths.values())) != 1 or round(hidden / ratio**2) != mlp:
    raise ConfigError(f"HF llama4 vision_config {widths}, hidden_size={hidden}, intermediate_size={mlp}, "
                      f"pixel_shuffle_ratio={ratio} do not form a runnable tower: the three widths must be equal and "
                      "intermediate_size = hidden_size / pixel_shuffle_ratio² (the adapter's input width)")
  image, patch = vision.get("image_size", 448), vision.get("patch_size", 14)
  if not isinstance(image, int) or not isinstance(patch, int):
    raise ConfigError(f"HF llama4 vision_config image_size={image}, patch_size={patch}: only square sizes (ints) "
                      "are supported")
  rope = vision.get("rope_parameters") or {"rope_theta": vision.get("rope_theta", 10000.0)}
  r.require_hf(rope, "rope_type", ("default",), "default")
  text = {**(hf.get("text_config") or {}), "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
  keys = llama4_model_keys(text)
  keys.update(use_multimodal=True, vision_emb_dim=hidden, vision_mlp_dim=mlp,
              vision_num_layers=int(vision.get("num_hidden_layers", 34)),
              vision_num_heads=int(vision.get("num_attention_heads", 16)), vision_patch_size=patch,
              vision_image_size=image,
              # HF's vision LayerNorms take torch's default epsilon, whatever norm_eps says.
              vision_layer_norm_epsilon=1e-5,
              mm_tokens_per_image=round(image // patch * ratio) ** 2,
              vision_rope_max_timescale=float(rope["rope_theta"]),
              vision_pixel_shuffle_ratio=ratio, vision_adapter_dim=width,
              image_token_id=int(hf.get("image_token_index", 200092)), boi_token_id=int(hf.get("boi_token_index", 200080)),
              eoi_token_id=int(hf.get("eoi_token_index", 200081)))
  return keys


def llama4_multimodal_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  text = {k: v for k, v in llama4_hf_config(cfg).items() if k != "architectures"}
  vision = cfg.vision
  width = vision.vision_adapter_dim
  return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
          "vision_config": {"model_type": "llama4_vision_model", **r.vision_hf_config(cfg),
                            "hidden_act": "gelu", "norm_eps": vision.vision_layer_norm_epsilon,
                            "pixel_shuffle_ratio": vision.vision_pixel_shuffle_ratio, "projector_input_dim": width,
                            "projector_output_dim": width, "vision_output_dim": width,
                            "multi_modal_projector_bias": False, "vision_feature_layer": -1,
                            "vision_feature_select_strategy": "default",
                            "rope_parameters": {"rope_type": "default",
                                                "rope_theta": vision.vision_rope_max_timescale}},
          "image_token_index": vision.image_token_id, "boi_token_index": vision.boi_token_id,
          "eoi_token_index": vision.eoi_token_id, "tie_word_embeddings": cfg.logits_via_embedding}


def llama4_any_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  return llama4_multimodal_model_keys(hf) if hf.get("model_type") == "llama4" else llama4_model_keys(hf)


def llama4_any_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return llama4_multimodal_hf_config(cfg) if cfg.vision.use_multimodal else llama4_hf_config(cfg)


_TINY_TEXT = dict(**{**TINY_SHAPES, "num_hidden_layers": 4, "intermediate_size": 32}, intermediate_size_mlp=96,
                  num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=8, no_rope_layer_interval=4,
                  use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.3, rms_norm_eps=1e-5,
                  rope_parameters=_TINY_ROPE)

register_family(Family("llama4", ("llama4_text", "llama4"), ("llama4",), llama4_any_model_keys, llama4_any_hf_config,
                       llama4_any_tensors,
                       upstream_model_names={"llama4-17b-16e": "llama4-scout-17b-16e",
                                             "llama4-17b-128e": "llama4-maverick-17b-128e"},
                       vision=VisionTower(llama4_vision.Llama4VisionEncoder, llama4_vision.Llama4Projector,
                                          bidirectional_images=False, flops_per_view=llama4_vision.flops_per_view,
                                          check_keys=llama4_vision.check_vision_keys),
                       image_format=llama4_images.IMAGE_FORMAT,
                       hf_image_text_logits={"llama4": llama4_images.hf_image_text_logits},
                       multimodal_reference_hf_configs={  # 32 x 32 tiles of 4 x 4 patches: 16 soft tokens each
                           "llama4-vision": dict(
                               model_type="llama4", boi_token_index=120, eoi_token_index=121, image_token_index=122,
                               text_config=dict(model_type="llama4_text", **_TINY_TEXT),
                               vision_config=dict(model_type="llama4_vision_model", hidden_size=32,
                                                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                  image_size=32, patch_size=4, pixel_shuffle_ratio=0.5,
                                                  projector_input_dim=48, projector_output_dim=48,
                                                  vision_output_dim=48,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 100.0}))},
                       reference_hf_configs={  # chunks of 8 < the test length, a NoPE layer every 4th, llama3 RoPE
                           "llama4": dict(model_type="llama4_text", **{**TINY_SHAPES, "num_hidden_layers": 4,
                                                                       "intermediate_size": 32},
                                          intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                                          attention_chunk_size=8, no_rope_layer_interval=4, use_qk_norm=True,
                                          attn_temperature_tuning=True, floor_scale=4, attn_scale=0.3,
                                          rms_norm_eps=1e-5, rope_parameters=_TINY_ROPE),
                           # Maverick's layout: dense layers (of intermediate_size_mlp) between MoE layers; 8
                           # experts (Maverick has 128), as with 4 this seed's router has a near tie that bf16 flips.
                           "llama4-maverick": dict(model_type="llama4_text", **{**TINY_SHAPES, "num_hidden_layers": 4,
                                                                               "intermediate_size": 32},
                                                   intermediate_size_mlp=96, interleave_moe_layer_step=2,
                                                   num_local_experts=8, num_experts_per_tok=1,
                                                   attention_chunk_size=8, no_rope_layer_interval=4,
                                                   use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4,
                                                   attn_scale=0.3, rms_norm_eps=1e-5, rope_parameters=_TINY_ROPE)}))
