"""DeepSeek-V3.2 (HF `deepseek_v32`, decoder_block "deepseek32"): DeepSeek-V3 (families/deepseek.py)
plus DeepSeek Sparse Attention, a lightning indexer in every layer choosing each query's
index_topk keys (index_topk > 0: layers/indexer.py, layers/sparse_attention.py). Its queries
always go through the low-rank latent (q_lora_rank > 0) and its MLA RoPE always rotates adjacent
pairs (the config has no rope_interleave); the indexer rotates halves.

HF names (layer i), under model.layers.{i}.self_attn.indexer.   ours (inside layer i's stack)
  wq_b.weight [I·J, Q]                                          self_attention/indexer/wq_b/kernel [Q, I, J]
  wk.weight [J, D]                                              self_attention/indexer/wk/kernel [D, J]
  k_norm.weight / k_norm.bias [J] (a LayerNorm)                 self_attention/indexer/k_norm/{scale,bias}
  weights_proj.weight [I, D]                                    self_attention/indexer/weights_proj/kernel [D, I]
Everything else as DeepSeek-V3's.
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.deepseek import deepseek3_hf_config, deepseek3_model_keys, deepseek_tensors, with_v3_defaults
from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError

_INDEXER = "model.layers.{i}.self_attn.indexer."


def _heads_in(w: r.Array, cfg: ModelConfig) -> r.Array:
  """HF [I·J, Q] → our [Q, I, J]."""
  return w.T.reshape(w.shape[1], cfg.mla.index_n_heads, cfg.mla.index_head_dim)


def _heads_to_hf(kernel: r.Array, cfg: ModelConfig) -> r.Array:
  del cfg
  return kernel.reshape(kernel.shape[0], -1).T


def indexer_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """The indexer's tensors; read past with index_topk=0 (the checkpoint run as dense MLA)."""
  maps = [
      r.one(_INDEXER + "wq_b.weight", "self_attention/indexer/wq_b/kernel", _heads_in, _heads_to_hf),
      r.one(_INDEXER + "wk.weight", "self_attention/indexer/wk/kernel", r.transpose, r.transpose),
      r.one(_INDEXER + "k_norm.weight", "self_attention/indexer/k_norm/scale"),
      r.one(_INDEXER + "k_norm.bias", "self_attention/indexer/k_norm/bias"),
      r.one(_INDEXER + "weights_proj.weight", "self_attention/indexer/weights_proj/kernel", r.transpose, r.transpose),
  ]
  return maps if cfg.mla.index_topk > 0 else [r.ignored(m.hf) for m in maps]


def deepseek32_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return deepseek_tensors(cfg) + indexer_tensors(cfg)


def _dense_prefix(hf: Mapping[str, Any]) -> int:
  """The leading dense-MLP layers; HF's mlp_layer_types may name any pattern, ours is a prefix."""
  types = list(hf.get("mlp_layer_types") or [])
  if not types:
    return hf.get("first_k_dense_replace", 0)  # checked by deepseek._model_keys
  prefix = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
  if types[prefix:] != ["sparse"] * (len(types) - prefix):
    raise ConfigError(f"HF config mlp_layer_types={types} is not supported by the deepseek_v32 converter: only dense "
                      "layers first, then MoE layers (first_k_dense_replace)")
  return prefix


def deepseek32_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = with_v3_defaults(hf)  # DeepseekV32Config's defaults are V3's
  if not hf.get("q_lora_rank"):
    raise ConfigError("HF config q_lora_rank=None is not supported by the deepseek_v32 converter: DeepSeek-V3.2's "
                      "indexer reads the query latent, so q_lora_rank must be > 0")
  types = set(hf.get("layer_types") or ["indexed_attention"])
  if types != {"indexed_attention"}:
    raise ConfigError(f"HF config layer_types={sorted(types)} is not supported by the deepseek_v32 converter "
                      "(supported: every layer 'indexed_attention')")
  keys = deepseek3_model_keys({**hf, "rope_interleave": True, "first_k_dense_replace": _dense_prefix(hf)})
  return {**keys, "decoder_block": "deepseek32", "index_topk": int(hf.get("index_topk", 2048)),
          "index_n_heads": int(hf.get("index_n_heads", 64)), "index_head_dim": int(hf.get("index_head_dim", 128))}


def deepseek32_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  hf = deepseek3_hf_config(cfg)
  for field in ("rope_interleave", "scoring_func", "topk_method", "num_nextn_predict_layers"):
    hf.pop(field)
  layers, dense = cfg.num_decoder_layers, cfg.moe.first_dense_layers
  return {**hf, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
          "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense),
          "index_topk": cfg.mla.index_topk, "index_n_heads": cfg.mla.index_n_heads,
          "index_head_dim": cfg.mla.index_head_dim}


# Tiny shapes: V3's (families/deepseek.py) with 8 indexer heads of 8 (the first 4 rotated); the
# reference's index_topk is below the tests' 24 tokens, so the indexer's choice matters.
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
             tie_word_embeddings=False, index_n_heads=8, index_head_dim=8)
_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 8,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}

register_family(Family(
    "deepseek32", ("deepseek_v32",), ("deepseek32",), deepseek32_model_keys, deepseek32_hf_config, deepseek32_tensors,
    reference_hf_configs={
        # Top-8 of 24 (most queries attend to a third of their past), group-limited sigmoid routing,
        # a dense first layer, a shared expert, YaRN with both mscales.
        "deepseek32": dict(model_type="deepseek_v32", **_TINY, index_topk=8, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                           n_shared_experts=1, max_position_embeddings=32, rope_parameters=_YARN)}))
