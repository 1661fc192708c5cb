"""Qwen3 dense (HF `qwen3`, decoder_block "qwen3") and Qwen3-MoE (HF `qwen3_moe`,
decoder_block "qwen3_moe"): Llama's layout plus QK-norm, and for the MoE members a routed
SwiGLU MLP in every layer (no shared expert).

HF names beyond Llama's (layer i, expert e)                 ours (inside layer i)
  model.layers.{i}.self_attn.q_norm.weight [H]              self_attention/query_norm/scale
  model.layers.{i}.self_attn.k_norm.weight [H]              self_attention/key_norm/scale
  model.layers.{i}.mlp.gate.weight [E, D]                   mlp/gate/kernel [D, E]
  model.layers.{i}.mlp.experts.{e}.gate_proj.weight         mlp/wi_0/kernel[e] [D, F]  (silu)
  model.layers.{i}.mlp.experts.{e}.up_proj.weight           mlp/wi_1/kernel[e] [D, F]  (linear)
  model.layers.{i}.mlp.experts.{e}.down_proj.weight         mlp/wo/kernel[e]   [F, D]
transformers >= 5 holds the experts fused in memory (mlp.experts.gate_up_proj [E, 2F, D],
mlp.experts.down_proj [E, D, F]); those names are read too, never written.

Qwen3-MoE's expert width is `moe_intermediate_size` (our mlp_dim). Its dense-MLP layers
(`mlp_only_layers`, `decoder_sparse_step` > 1) and Qwen3's sliding-window layers are not in the
released models and are refused with one line.
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.llama import (TINY_SHAPES, decoder_tensors, embedding_tensors, gated_mlp_tensors, max_positions,
                                    qk_norm_tensors, rope_hf_config, rope_keys, shape_hf_config, shape_keys)
from MaxText.families.mixtral import fused_expert_tensors, routed_expert_tensors
from MaxText.configuration.model_config import ModelConfig

_MOE = "model.layers.{i}.mlp."


def qwen3_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return embedding_tensors(cfg) + decoder_tensors(cfg) + qk_norm_tensors() + gated_mlp_tensors()


def qwen3_moe_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return (embedding_tensors(cfg) + decoder_tensors(cfg) + qk_norm_tensors() + routed_expert_tensors(_MOE)
          + fused_expert_tensors(_MOE))


def _common_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "use_sliding_window", (False,), False)
  return {**shape_keys(hf), **rope_keys(hf), "mlp_activations": ["silu", "linear"], "use_qk_norm": True,
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False))}


# What transformers' Qwen3Config / Qwen3MoeConfig take for a shape field config.json leaves out: fixed numbers,
# not LlamaConfig's derived ones (as many KV heads as query heads; hidden_size // num_attention_heads, which
# Qwen3-MoE, with no head_dim default, does take).
_QWEN3_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128}
_QWEN3_MOE_DEFAULTS = {"num_key_value_heads": 4}


def qwen3_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  return {"decoder_block": "qwen3", **_common_keys({**_QWEN3_DEFAULTS, **hf})}


def qwen3_moe_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_QWEN3_MOE_DEFAULTS, **hf}
  r.require_hf(hf, "decoder_sparse_step", (1,), 1)
  if hf.get("mlp_only_layers"):
    r.require_hf(hf, "mlp_only_layers", ([],))
  num_experts = r.routed_experts(hf, "num_experts", "num_local_experts")
  return {**_common_keys(hf), "decoder_block": "qwen3_moe",
          "base_mlp_dim": r.count_hf(hf, "moe_intermediate_size", "an expert width"), "num_experts": num_experts,
          "num_experts_per_tok": r.experts_per_token(hf, num_experts),
          "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _common_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {**shape_hf_config(cfg), **rope_hf_config(cfg.rope), "hidden_act": "silu", "attention_bias": False,
          "use_sliding_window": False, "max_position_embeddings": max_positions(cfg)}


def qwen3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_common_hf_config(cfg)}


def qwen3_moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_common_hf_config(cfg),
          "moe_intermediate_size": cfg.mlp_dim, "num_experts": cfg.moe.num_experts,
          "num_experts_per_tok": cfg.moe.num_experts_per_tok, "norm_topk_prob": cfg.moe.norm_topk_prob,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": cfg.moe.load_balance_loss_weight}


_TINY = dict(TINY_SHAPES, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
register_family(Family("qwen3", ("qwen3",), ("qwen3",), qwen3_model_keys, qwen3_hf_config, qwen3_tensors,
                       reference_hf_configs={
                           "qwen3": dict(model_type="qwen3", **_TINY),
                           "qwen3-tied": dict(model_type="qwen3", **_TINY, tie_word_embeddings=True),
                           # Qwen3's long-context setting: YaRN over a short original context so
                           # the ramp falls inside these few dimensions.
                           "qwen3-yarn": dict(model_type="qwen3", **{k: v for k, v in _TINY.items() if k != "rope_theta"},
                                              rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0,
                                                               "factor": 4.0, "original_max_position_embeddings": 16})}))
register_family(Family("qwen3_moe", ("qwen3_moe",), ("qwen3_moe",), qwen3_moe_model_keys, qwen3_moe_hf_config,
                       qwen3_moe_tensors,
                       reference_hf_configs={  # 8 experts, top-2; both routing-weight rules
                           "qwen3_moe": dict(model_type="qwen3_moe", **_TINY, moe_intermediate_size=48,
                                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
                           "qwen3_moe-unnormalised": dict(model_type="qwen3_moe", **_TINY, moe_intermediate_size=48,
                                                          num_experts=8, num_experts_per_tok=2,
                                                          norm_topk_prob=False)}))
