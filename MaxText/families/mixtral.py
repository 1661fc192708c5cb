"""Mixtral (HF `mixtral`, decoder_block "mixtral"): Mistral's decoder with a sparse MoE MLP.

HF names, as `save_pretrained` writes them and the published checkpoints hold them
(layer i, expert e)                                        ours (inside layer i)
  model.layers.{i}.block_sparse_moe.gate.weight [E, D]     mlp/gate/kernel [D, E]
  model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  mlp/wi_0/kernel[e] [D, F]  (gate, silu)
  model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  mlp/wi_1/kernel[e] [D, F]  (up, linear)
  model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  mlp/wo/kernel[e]   [F, D]  (down)
transformers >= 5 fuses the experts in memory (`model.state_dict()`): mlp.gate.weight,
mlp.experts.gate_up_proj [E, 2F, D] (gate rows first) and mlp.experts.down_proj [E, D, F];
those names are read too but never written. Attention, norms and embeddings are Llama's
(llama.py); a sliding window maps as Mistral's does.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.llama import TINY_SHAPES, decoder_tensors, embedding_tensors, mistral_hf_config, mistral_model_keys

_MOE = "model.layers.{i}.block_sparse_moe."
_FUSED = "model.layers.{i}.mlp."


def _split_gate_up(gate_up_EKD: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """HF fused [E, 2F, D] (gate rows, then up rows) → our wi_0, wi_1 kernels [E, D, F]."""
  f = cfg.mlp_dim
  return np.swapaxes(gate_up_EKD[:, :f], 1, 2), np.swapaxes(gate_up_EKD[:, f:], 1, 2)


def _swap_last(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  del cfg
  return np.swapaxes(x, -1, -2)


def _fused_gate_up_to_hf(kernels: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
  del cfg
  return np.concatenate([np.swapaxes(k, 1, 2) for k in kernels], axis=1)


def fused_expert_tensors(prefix: str) -> list[r.TensorMap]:
  """transformers >= 5's in-memory fused experts under `prefix` (read only, never written)."""
  return [
      r.TensorMap(prefix + "experts.gate_up_proj", ("mlp/wi_0/kernel", "mlp/wi_1/kernel"), _split_gate_up,
                  _fused_gate_up_to_hf, write=False),
      r.one(prefix + "experts.down_proj", "mlp/wo/kernel", _swap_last, _swap_last, write=False),
  ]


def routed_expert_tensors(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
                          ) -> list[r.TensorMap]:
  """The router (`prefix`gate) and each expert's SwiGLU weights as stored on disk, one tensor per
  expert under `prefix`experts.{e}. (HF's names of its gate, up and down projections)."""
  return [r.one(prefix + "gate.weight", "mlp/gate/kernel", r.transpose, r.transpose),
          *(r.one(prefix + f"experts.{{e}}.{hf}.weight", f"mlp/{ours}/kernel", r.transpose, r.transpose)
            for hf, ours in ((gate, "wi_0"), (up, "wi_1"), (down, "wo")))]


def expert_tensors() -> list[r.TensorMap]:
  """Router and per-expert SwiGLU weights, in the on-disk form and the in-memory fused form."""
  return [
      *routed_expert_tensors(_MOE, "w1", "w3", "w2"),
      r.one(_FUSED + "gate.weight", "mlp/gate/kernel", r.transpose, r.transpose, write=False),
      *fused_expert_tensors(_FUSED),
  ]


def mixtral_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return embedding_tensors(cfg) + decoder_tensors(cfg) + expert_tensors() + [
      r.ignored("model.layers.{i}.self_attn.rotary_emb.inv_freq")]


# What transformers' MixtralConfig takes for a field config.json leaves out (not Mistral's: no window, another
# epsilon and RoPE base); our own defaults would be another model.
_MIXTRAL_DEFAULTS = {"sliding_window": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "num_key_value_heads": 8}


def mixtral_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_MIXTRAL_DEFAULTS, **hf}
  num_experts = r.routed_experts(hf, "num_local_experts")
  return {**mistral_model_keys(hf), "decoder_block": "mixtral", "num_experts": num_experts,
          "num_experts_per_tok": r.experts_per_token(hf, num_experts)}


def mixtral_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {**mistral_hf_config(cfg), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.num_experts_per_tok,
          "router_aux_loss_coef": cfg.moe.load_balance_loss_weight, "router_jitter_noise": 0.0}


register_family(Family("mixtral", ("mixtral",), ("mixtral",), mixtral_model_keys, mixtral_hf_config,
                       mixtral_tensors,
                       reference_hf_configs={  # 4 experts, top-2
                           "mixtral": dict(model_type="mixtral", **TINY_SHAPES, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5)}))
