"""Qwen3.5 (HF `qwen3_5_text` / `qwen3_5`, decoder_block "qwen3_5": dense; HF `qwen3_5_moe_text` /
`qwen3_5_moe`, decoder_block "qwen3_5_moe": experts): Qwen3-Next's hybrid stack (qwen3_next.py; the
same layers, Gated DeltaNet in `dense_layers` and gated full attention in `layers`) with

  * the DeltaNet's input projections in separate, plainly ordered tensors (Qwen3-Next interleaves them
    per key head), under linear_attn.:
      in_proj_qkv.weight [2IQ + YW, D] (all query heads, all key heads, all value heads)
                                            → self_attention/{query,key,value}/kernel
      in_proj_z.weight [YW, D]              → self_attention/output_gate/kernel
      in_proj_b.weight, in_proj_a.weight [Y, D] → self_attention/write_strength, decay_input/kernel
    (each query/key head still serves Y / I consecutive value heads, as in Qwen3-Next);
  * a dense SwiGLU MLP in every layer (`qwen3_5`: mlp.{gate,up,down}_proj → mlp/wi_0, wi_1, wo) or
    Qwen3-Next's routed experts plus gated shared expert (`qwen3_5_moe`; the router always renormalises
    its top-k, so norm_topk_prob is True);
  * Qwen3-VL's interleaved multimodal RoPE (mrope_section over temporal, height and width positions).
    A text token's three positions are equal, so every frequency turns by the same position: plain
    partial RoPE with the halves layout, which is what we run (tests/test_qwen3_5.py checks HF's rotary
    tables reduce to it). Image and video positions are not supported (no vision tower here).

The published checkpoints are image-text models (Qwen3_5ForConditionalGeneration: `qwen3_5` with a
text_config and a vision_config): their text decoder, under `model.language_model.`, converts; the
vision tower (`model.visual.`) and the multi-token-prediction module (`mtp.`, which transformers also
drops) are left out. Written back, the model is a text-only Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.llama import TINY_SHAPES, embedding_tensors, gated_mlp_tensors
from MaxText.families.qwen3_next import (full_attention_tensors, hybrid_hf_config, hybrid_model_keys,
                                         linear_attention_tensors, moe_hf_config, moe_model_keys, moe_tensors,
                                         norm_tensors)

_LINEAR = "model.layers.{i}.linear_attn."
# What a multimodal checkpoint holds beyond its text decoder: left out.
LEFT_OUT = ("model.visual.", "mtp.")
Array = np.ndarray


def _key_value_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
  """(I key heads, Q key head dim, Y value heads, W value head dim)."""
  la = cfg.linear_attn
  return la.linear_num_key_heads, la.linear_key_head_dim, la.linear_num_value_heads, la.linear_value_head_dim


def _qkv_to_ours(w: Array, cfg: ModelConfig) -> tuple[Array, ...]:
  i, q, y, wd = _key_value_dims(cfg)
  query, key, value = np.split(w.T, [i * q, 2 * i * q], axis=1)  # [D, channels]
  d = cfg.emb_dim
  return query.reshape(d, i, q), key.reshape(d, i, q), value.reshape(d, y, wd)


def _qkv_to_hf(ours: tuple[Array, ...], cfg: ModelConfig) -> Array:
  return np.concatenate([x.reshape(cfg.emb_dim, -1) for x in ours], axis=1).T


def _heads_to_ours(w: Array, cfg: ModelConfig) -> Array:
  """in_proj_z [YW, D] → [D, Y, W]."""
  _, _, y, wd = _key_value_dims(cfg)
  return w.T.reshape(cfg.emb_dim, y, wd)


def _heads_to_hf(kernel: Array, cfg: ModelConfig) -> Array:
  return kernel.reshape(cfg.emb_dim, -1).T


def _projections() -> list[r.TensorMap]:
  ours = lambda *names: tuple(f"self_attention/{n}" for n in names)  # noqa: E731
  return [r.TensorMap(_LINEAR + "in_proj_qkv.weight", ours("query/kernel", "key/kernel", "value/kernel"),
                      _qkv_to_ours, _qkv_to_hf),
          r.one(_LINEAR + "in_proj_z.weight", "self_attention/output_gate/kernel", _heads_to_ours, _heads_to_hf),
          r.one(_LINEAR + "in_proj_b.weight", "self_attention/write_strength/kernel", r.transpose, r.transpose),
          r.one(_LINEAR + "in_proj_a.weight", "self_attention/decay_input/kernel", r.transpose, r.transpose)]


def _text_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  mlp = moe_tensors() if cfg.moe.num_experts > 1 else gated_mlp_tensors()
  return (embedding_tensors(cfg) + norm_tensors() + full_attention_tensors() + linear_attention_tensors(_projections())
          + mlp)


def qwen3_5_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """The text checkpoint's names (written) and a multimodal one's (read only), its vision tower and
  multi-token-prediction module skipped."""
  return r.also_read_as_text_decoder(_text_tensors(cfg), LEFT_OUT)


def _text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  """A text checkpoint's config, or a multimodal one's text_config (its tie_word_embeddings is the
  top-level one, which the image-text model ties by)."""
  if "text_config" not in hf:
    return dict(hf)
  text = dict(hf.get("text_config") or {})
  if "tie_word_embeddings" in hf:
    text["tie_word_embeddings"] = hf["tie_word_embeddings"]
  return text


def _rope_checked(hf: Mapping[str, Any]) -> None:
  """Qwen3.5 writes mrope_section / mrope_interleaved beside the default RoPE: with text positions
  (all three components equal) they change nothing, so only the rope_type is checked."""
  r.require_hf(dict(hf.get("rope_parameters") or {}), "rope_type", ("default",), "default")


# What transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig take for a shape field config.json (or its
# text_config) leaves out: fixed numbers, not derived from the query heads and width as shape_keys would.
_QWEN3_5_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256}
_QWEN3_5_MOE_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256}


def qwen3_5_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  text = {**_QWEN3_5_DEFAULTS, **_text_config(hf)}
  _rope_checked(text)
  return hybrid_model_keys(text, "qwen3_5")


def qwen3_5_moe_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  text = {**_QWEN3_5_MOE_DEFAULTS, **_text_config(hf)}
  _rope_checked(text)
  text.setdefault("intermediate_size", text["moe_intermediate_size"])  # the MoE config has no dense width
  return {**hybrid_model_keys(text, "qwen3_5_moe"), **moe_model_keys(text, "qwen3_5_moe"), "norm_topk_prob": True}


def qwen3_5_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **hybrid_hf_config(cfg)}


def qwen3_5_moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  fields = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **hybrid_hf_config(cfg),
            **moe_hf_config(cfg)}
  del fields["intermediate_size"]  # not a field of Qwen3_5MoeTextConfig
  return fields


# As Qwen3-Next's reference (qwen3_next.py, which says why rms_norm_eps is large): two periods of 3
# Gated DeltaNet + 1 full attention, 2 value heads per key head, a quarter of each head rotated; the
# rope_parameters carry the multimodal sections the published configs write.
_ROPE = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [1, 1, 0], "mrope_interleaved": True}
_TINY = dict(TINY_SHAPES, num_hidden_layers=8, rms_norm_eps=1e-2, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, full_attention_interval=4,
             rope_parameters=_ROPE)
# The MoE reference: 8 experts, top-2, one gated shared expert.
_TINY_MOE = dict({k: v for k, v in _TINY.items() if k != "intermediate_size"}, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2)

register_family(Family("qwen3_5", ("qwen3_5_text", "qwen3_5"), ("qwen3_5",), qwen3_5_model_keys, qwen3_5_hf_config,
                       qwen3_5_tensors, reference_hf_configs={"qwen3_5": dict(model_type="qwen3_5_text", **_TINY)}))
register_family(Family("qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), ("qwen3_5_moe",), qwen3_5_moe_model_keys,
                       qwen3_5_moe_hf_config, qwen3_5_tensors,
                       reference_hf_configs={"qwen3_5_moe": dict(model_type="qwen3_5_moe_text", **_TINY_MOE)}))
