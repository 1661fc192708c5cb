"""Mixtral (sparse MoE) weights: Hugging Face layout <-> this framework's parameter dict.

Hugging Face, as `save_pretrained` writes it and the published checkpoints hold it
(per layer l, per expert e):
  model.layers.{l}.block_sparse_moe.gate.weight            [E, D]  router
  model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight  [F, D]  gate projection (silu)
  model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight  [F, D]  up projection (linear)
  model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight  [D, F]  down projection
transformers >= 5 fuses the experts in memory (`model.state_dict()`):
  model.layers.{l}.mlp.gate.weight [E, D], mlp.experts.gate_up_proj [E, 2F, D] (gate rows
  first), mlp.experts.down_proj [E, D, F]. `from_hf` reads either form.
Ours, unscanned (`models.stack_layers` gives the scanned form):
  layers_{l}.mlp.gate.kernel [D, E], wi_0.kernel / wi_1.kernel [E, D, F], wo.kernel [E, F, D].
Attention, norms and embeddings use the Llama layout; HF's rotate-half RoPE is the
layout layers/embeddings.py uses, so no permutation is needed.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.config_groups import ModelConfig
from MaxText.errors import ConfigError

Weights = Mapping[str, np.ndarray]


def _attention_from_hf(w: Weights, prefix: str, cfg: ModelConfig) -> dict:
  d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  return {
      "query": {"kernel": w[prefix + "q_proj.weight"].T.reshape(d, n, h)},
      "key": {"kernel": w[prefix + "k_proj.weight"].T.reshape(d, k, h)},
      "value": {"kernel": w[prefix + "v_proj.weight"].T.reshape(d, k, h)},
      "out": {"kernel": w[prefix + "o_proj.weight"].T.reshape(n, h, d)},
  }


def _experts_from_hf(w: Weights, layer: str, cfg: ModelConfig) -> dict:
  """Stacked [E, ...] expert kernels from either the fused or the per-expert HF names."""
  f = cfg.mlp_dim
  fused = layer + "mlp.experts.gate_up_proj"
  if fused in w:
    gate_up_EKD = w[fused]  # K = 2F, gate rows then up rows
    gate_EFD, up_EFD = gate_up_EKD[:, :f], gate_up_EKD[:, f:]
    down_EDF = w[layer + "mlp.experts.down_proj"]
    router_ED = w[layer + "mlp.gate.weight"]
  else:
    moe = layer + "block_sparse_moe."
    experts = range(cfg.num_experts)
    gate_EFD = np.stack([w[f"{moe}experts.{e}.w1.weight"] for e in experts])
    up_EFD = np.stack([w[f"{moe}experts.{e}.w3.weight"] for e in experts])
    down_EDF = np.stack([w[f"{moe}experts.{e}.w2.weight"] for e in experts])
    router_ED = w[moe + "gate.weight"]
  return {
      "gate": {"kernel": router_ED.T},
      "wi_0": {"kernel": np.swapaxes(gate_EFD, 1, 2)},
      "wi_1": {"kernel": np.swapaxes(up_EFD, 1, 2)},
      "wo": {"kernel": np.swapaxes(down_EDF, 1, 2)},
  }


def from_hf(w: Weights, cfg: ModelConfig) -> dict:
  """HF tensor name -> array mapping (may be lazy: only indexed) -> our unscanned parameter dict."""
  params: dict[str, Any] = {
      "token_embedder": {"embedding": w["model.embed_tokens.weight"]},
      "decoder_norm": {"scale": w["model.norm.weight"]},
  }
  if not cfg.logits_via_embedding:
    params["logits_dense"] = {"kernel": w["lm_head.weight"].T}
  for i in range(cfg.num_decoder_layers):
    layer = f"model.layers.{i}."
    params[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {"scale": w[layer + "input_layernorm.weight"]},
        "post_self_attention_layer_norm": {"scale": w[layer + "post_attention_layernorm.weight"]},
        "self_attention": _attention_from_hf(w, layer + "self_attn.", cfg),
        "mlp": _experts_from_hf(w, layer, cfg),
    }
  return params


def _layer_to_hf(p: dict, layer: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  attn, mlp = p["self_attention"], p["mlp"]
  out = {
      layer + "input_layernorm.weight": p["pre_self_attention_layer_norm"]["scale"],
      layer + "post_attention_layernorm.weight": p["post_self_attention_layer_norm"]["scale"],
      layer + "self_attn.q_proj.weight": attn["query"]["kernel"].reshape(d, n * h).T,
      layer + "self_attn.k_proj.weight": attn["key"]["kernel"].reshape(d, k * h).T,
      layer + "self_attn.v_proj.weight": attn["value"]["kernel"].reshape(d, k * h).T,
      layer + "self_attn.o_proj.weight": attn["out"]["kernel"].reshape(n * h, d).T,
      layer + "block_sparse_moe.gate.weight": mlp["gate"]["kernel"].T,
  }
  for e in range(cfg.num_experts):
    expert = f"{layer}block_sparse_moe.experts.{e}."
    out[expert + "w1.weight"] = mlp["wi_0"]["kernel"][e].T
    out[expert + "w3.weight"] = mlp["wi_1"]["kernel"][e].T
    out[expert + "w2.weight"] = mlp["wo"]["kernel"][e].T
  return out


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Our unscanned parameter dict (numpy arrays) -> HF tensors under the on-disk names."""
  out = {
      "model.embed_tokens.weight": params["token_embedder"]["embedding"],
      "model.norm.weight": params["decoder_norm"]["scale"],
  }
  if not cfg.logits_via_embedding:
    out["lm_head.weight"] = params["logits_dense"]["kernel"].T
  for i in range(cfg.num_decoder_layers):
    out.update(_layer_to_hf(params[f"layers_{i}"], f"model.layers.{i}.", cfg))
  return {name: np.ascontiguousarray(array) for name, array in out.items()}


def overrides_from_hf_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Our config keys equivalent to a Mixtral `config.json` (as a dict)."""
  if hf.get("sliding_window"):
    raise ConfigError(f"Mixtral with sliding_window={hf['sliding_window']} is not supported; "
                     "the published Mixtral checkpoints use full attention (sliding_window: null)")
  rope = hf.get("rope_parameters") or {}
  num_heads = hf["num_attention_heads"]
  return {
      "decoder_block": "llama2", "vocab_size": hf["vocab_size"], "base_emb_dim": hf["hidden_size"],
      "base_num_query_heads": num_heads, "base_num_kv_heads": hf.get("num_key_value_heads", num_heads),
      "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads, "base_mlp_dim": hf["intermediate_size"],
      "base_num_decoder_layers": hf["num_hidden_layers"], "mlp_activations": ["silu", "linear"],
      "normalization_layer_epsilon": hf["rms_norm_eps"],
      "rope_max_timescale": rope.get("rope_theta", hf.get("rope_theta", 1e6)),
      "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
      "num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
      "load_balance_loss_weight": hf.get("router_aux_loss_coef", 0.02),
  }


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The `config.json` fields of a MixtralForCausalLM with our model's shapes."""
  return {
      "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.emb_dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_decoder_layers,
      "num_attention_heads": cfg.num_query_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.normalization_layer_epsilon,
      "rope_theta": cfg.rope_max_timescale, "sliding_window": None, "tie_word_embeddings": cfg.logits_via_embedding,
      "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
      "router_aux_loss_coef": cfg.load_balance_loss_weight, "max_position_embeddings": cfg.max_target_length,
  }
