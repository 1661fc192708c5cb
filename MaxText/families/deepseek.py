"""DeepSeek-V3 (HF `deepseek_v3`, decoder_block "deepseek3"; also Moonshot's Kimi K2, HF `kimi_k2`: the same
architecture with 384 experts and 64 heads) and DeepSeek-V2 / V2-Lite (HF
`deepseek_v2`, decoder_block "deepseek2"): multi-head latent attention (attention_type=mla,
layers/mla.py), a dense-MLP prefix of first_k_dense_replace layers (first_dense_layers), then
routed MoE layers with shared experts. V3 routes by sigmoid scores with the correction bias and
group-limited top-k (top-2-sum group scores) and a routed scaling factor; V2 by softmax, greedy or
group-limited (best-expert group scores).

HF names (layer i, expert e)                             ours (inside layer i's stack)
  self_attn.q_proj.weight [N(C+P), D] (q_lora_rank None)  self_attention/query/kernel [D, N, C+P]
  self_attn.q_a_proj.weight [Q, D]                        self_attention/wq_a/kernel [D, Q]
  self_attn.q_a_layernorm.weight [Q]                      self_attention/q_norm/scale
  self_attn.q_b_proj.weight [N(C+P), Q]                   self_attention/wq_b/kernel [Q, N, C+P]
  self_attn.kv_a_proj_with_mqa.weight [R+P, D]            self_attention/wkv_a/kernel [D, R+P]
  self_attn.kv_a_layernorm.weight [R]                     self_attention/kv_norm/scale
  self_attn.kv_b_proj.weight [N(C+V), R]                  self_attention/wkv_b/kernel [R, N, C+V]
  self_attn.o_proj.weight [D, NV]                         self_attention/out/kernel [N, V, D]
  mlp.{gate,up,down}_proj.weight (i < first_k_dense)      dense_layers: mlp/{wi_0,wi_1,wo}/kernel
  mlp.gate.weight [E, D]                                  layers: mlp/gate/kernel [D, E]
  mlp.gate.e_score_correction_bias [E] (V3)               layers: mlp/score_correction_bias
  mlp.experts.{e}.{gate,up,down}_proj.weight              layers: mlp/{wi_0,wi_1,wo}/kernel[e]
  mlp.shared_experts.{gate,up,down}_proj.weight           layers: mlp/shared_mlp/{wi_0,wi_1,wo}/kernel
(all under model.layers.{i}.), norms and embeddings as Llama's. transformers >= 5 holds the
experts fused in memory (read too, never written). HF's DeepSeek RoPE rotates adjacent pairs
(rope_interleaved) and leaves the weights as stored. The published V3 checkpoint's
multi-token-prediction layer (model.layers.61) becomes our mtp_0 module when converting with
mtp_num_layers=1 (enorm, hnorm, eh_proj, shared_head.norm -> final_norm; its embedding and head
copies are read past), and is skipped otherwise, as transformers skips it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family
from MaxText.families.llama import embedding_tensors, gated_mlp_tensors, max_positions, rope_hf_config, rope_keys
from MaxText.families.mixtral import fused_expert_tensors, routed_expert_tensors
from MaxText.configuration.model_config import ModelConfig, RopeConfig
from MaxText.errors import ConfigError

_LAYER = "model.layers.{i}."
_ATTN = _LAYER + "self_attn."
_MOE = _LAYER + "mlp."


def _heads_in(w: r.Array, cfg: ModelConfig) -> r.Array:
  """HF [N·W, in] projection → our [in, N, W] kernel."""
  return w.T.reshape(w.shape[1], cfg.num_query_heads, -1)


def _heads_to_hf(kernel: r.Array, cfg: ModelConfig) -> r.Array:
  del cfg
  return kernel.reshape(kernel.shape[0], -1).T


def _out_in(w: r.Array, cfg: ModelConfig) -> r.Array:
  return w.T.reshape(cfg.num_query_heads, cfg.mla.v_head_dim, cfg.emb_dim)


def _out_to_hf(kernel: r.Array, cfg: ModelConfig) -> r.Array:
  return kernel.reshape(-1, cfg.emb_dim).T


def attention_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  heads_in, heads_to_hf = _heads_in, _heads_to_hf
  maps = [
      r.one(_LAYER + "input_layernorm.weight", "pre_self_attention_layer_norm/scale"),
      r.one(_LAYER + "post_attention_layernorm.weight", "post_self_attention_layer_norm/scale"),
      r.one(_ATTN + "kv_a_proj_with_mqa.weight", "self_attention/wkv_a/kernel", r.transpose, r.transpose),
      r.one(_ATTN + "kv_a_layernorm.weight", "self_attention/kv_norm/scale"),
      r.one(_ATTN + "kv_b_proj.weight", "self_attention/wkv_b/kernel", heads_in, heads_to_hf),
      r.one(_ATTN + "o_proj.weight", "self_attention/out/kernel", _out_in, _out_to_hf),
  ]
  if cfg.mla.q_lora_rank > 0:
    return maps + [
        r.one(_ATTN + "q_a_proj.weight", "self_attention/wq_a/kernel", r.transpose, r.transpose),
        r.one(_ATTN + "q_a_layernorm.weight", "self_attention/q_norm/scale"),
        r.one(_ATTN + "q_b_proj.weight", "self_attention/wq_b/kernel", heads_in, heads_to_hf)]
  return maps + [r.one(_ATTN + "q_proj.weight", "self_attention/query/kernel", heads_in, heads_to_hf)]


def mlp_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """The dense prefix's MLP, the router, routed and shared experts, each limited to its stack."""
  dense = [dataclasses.replace(m, stack="dense_layers") for m in gated_mlp_tensors()]
  moe = [
      *routed_expert_tensors(_MOE),
      *fused_expert_tensors(_MOE),
  ]
  if cfg.moe.moe_score_correction_bias:
    moe.append(r.one(_MOE + "gate.e_score_correction_bias", "mlp/score_correction_bias"))
  if cfg.moe.shared_experts > 0:
    moe += [dataclasses.replace(m, ours=("mlp/shared_mlp/" + m.ours[0].removeprefix("mlp/"),))
            for m in gated_mlp_tensors(_MOE + "shared_experts.")]
  moe = [dataclasses.replace(m, stack="layers") for m in moe]
  return (dense if cfg.moe.first_dense_layers > 0 else []) + moe


def mtp_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """The published V3 checkpoint's multi-token-prediction module, stored as one layer past the
  last (model.layers.{num_hidden_layers}.*: a decoder layer plus the tensors below). With
  mtp_num_layers > 0 it becomes our module mtp_0 (layers/mtp.py; its decoder layer through the
  ordinary layer entries); its copies of the shared embedding and output head are read past and
  not written. Without, the whole layer is skipped (HF skips it too), an entry first in the table
  so its decoder-layer tensors are not taken for a layer of the model."""
  if cfg.mtp.mtp_num_layers == 0:
    return [r.ignored_prefix(f"model.layers.{cfg.num_decoder_layers}.")]
  maps = [r.one(_LAYER + "enorm.weight", "enorm/scale"), r.one(_LAYER + "hnorm.weight", "hnorm/scale"),
          r.one(_LAYER + "eh_proj.weight", "eh_proj/kernel", r.transpose, r.transpose),
          r.one(_LAYER + "shared_head.norm.weight", "final_norm/scale"),
          r.ignored(_LAYER + "embed_tokens.weight"), r.ignored(_LAYER + "shared_head.head.weight")]
  return [dataclasses.replace(m, stack="mtp") for m in maps]


def deepseek_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return mtp_tensors(cfg) + embedding_tensors(cfg) + attention_tensors(cfg) + mlp_tensors(cfg)


def _mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """rope_keys plus DeepSeek's YaRN mscale pair: the rotated vectors are scaled by
  mscale(factor, mscale) / mscale(factor, mscale_all_dim), the softmax by mscale(factor, mscale_all_dim)²."""
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # transformers' precedence
  params = dict(hf.get(field) or {})
  mscale, all_dim = params.pop("mscale", None), params.pop("mscale_all_dim", None)
  keys = rope_keys({**hf, "rope_parameters": params, "rope_scaling": None})
  keys["rope_interleaved"] = bool(hf.get("rope_interleave", True))  # V2 always rotates adjacent pairs
  if keys["rope_type"] == "yarn":
    factor = keys["rope_scaling_factor"]
    if params.get("attention_factor") is None and mscale and all_dim:
      keys["rope_attention_factor"] = _mscale(factor, mscale) / _mscale(factor, all_dim)
    keys["rope_yarn_mscale_all_dim"] = float(all_dim or 0.0)
  elif all_dim and keys["rope_type"] != "default" and keys.get("rope_scaling_factor", 1.0) > 1:
    # transformers' MLA scales the softmax by mscale_all_dim under any scaled RoPE; ours only with YaRN
    raise ConfigError(f"HF config {field} mscale_all_dim={all_dim} with rope_type={keys['rope_type']!r} is not "
                      f"supported by the {hf.get('model_type')} converter: transformers scales the softmax by it, "
                      "our MLA only with rope_type 'yarn'")
  return keys


def _model_keys(hf: Mapping[str, Any], decoder_block: str) -> dict[str, Any]:
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "mlp_bias", (False,), False)
  heads = int(hf["num_attention_heads"])
  r.require_hf(hf, "num_key_value_heads", (None, heads), heads)  # absent in V2: the query heads, as DeepseekV2Config
  nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
  # Left out of config.json, first_k_dense_replace is DeepseekV3Config's 3: a 1- or 2-layer test model is all dense,
  # which check_layer_layout would refuse in keys the user never wrote.
  # transformers compares layer indices with first_k_dense_replace and multiplies the width by n_shared_experts
  dense = r.count_hf(hf, "first_k_dense_replace", "a count of leading dense layers", 0, minimum=0)
  layers = int(hf["num_hidden_layers"])
  if rope % 2:  # rotated in pairs
    raise ConfigError(f"HF config qk_rope_head_dim={rope} is not even: RoPE rotates dimensions in pairs")
  shared = r.count_hf(hf, "n_shared_experts", "a shared-expert count", 0, minimum=0)
  num_experts = r.routed_experts(hf, "n_routed_experts")
  if dense >= layers:
    raise ConfigError(f"HF config first_k_dense_replace={dense} >= num_hidden_layers={layers} (every layer dense) is "
                      f"not supported by the {hf.get('model_type')} converter: it needs at least one MoE layer; set "
                      "first_k_dense_replace below num_hidden_layers in config.json")
  return {
      "decoder_block": decoder_block, "base_emb_dim": int(hf["hidden_size"]), "base_num_query_heads": heads,
      "base_num_kv_heads": heads, "base_mlp_dim": r.count_hf(hf, "moe_intermediate_size", "an expert width"),
      "base_num_decoder_layers": int(hf["num_hidden_layers"]), "head_dim": nope + rope,
      "vocab_size": int(hf["vocab_size"]), "mlp_activations": ["silu", "linear"],
      "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
      # null: queries projected directly; a rank of 0 is a query latent of width 0 in transformers (zero queries)
      "attention_type": "mla",
      "q_lora_rank": 0 if hf.get("q_lora_rank") is None else r.count_hf(hf, "q_lora_rank", "a query latent rank"),
      "kv_lora_rank": r.count_hf(hf, "kv_lora_rank", "a key/value latent rank"), "qk_nope_head_dim": nope,
      "qk_rope_head_dim": rope, "v_head_dim": r.count_hf(hf, "v_head_dim", "a value head width"), **_rope_keys(hf),
      "num_experts": num_experts, "num_experts_per_tok": r.experts_per_token(hf, num_experts),
      "shared_experts": shared, "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
      "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
      "first_dense_layers": dense, "dense_mlp_dim": int(hf["intermediate_size"]),
  }


# What transformers' DeepseekV3Config (and V3.2's) / DeepseekV2Config take for a field config.json leaves out:
# our own defaults (no shared expert, direct queries, one group, ...) would be another model.
# DeepseekV3Config's num_key_value_heads is 128 (its query heads), DeepseekV2Config's the query heads: MLA runs
# one KV head per query head, so a V3 config.json that leaves it out holds 128 query heads or no model HF can run.
_DEEPSEEK3_DEFAULTS = {"n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
                      "topk_group": 4, "first_k_dense_replace": 3, "q_lora_rank": 1536, "num_key_value_heads": 128}
_DEEPSEEK2_DEFAULTS = {"n_shared_experts": 2, "q_lora_rank": 1536}


def with_v3_defaults(hf: Mapping[str, Any]) -> dict[str, Any]:
  """`hf` with DeepseekV3Config's defaults (V3.2's too) for the fields it leaves out."""
  heads = hf.get("num_attention_heads")
  if "num_key_value_heads" not in hf and heads is not None and int(heads) != _DEEPSEEK3_DEFAULTS["num_key_value_heads"]:
    raise ConfigError(f"HF {hf.get('model_type')} config.json leaves out num_key_value_heads, which transformers then "
                      f"takes as {_DEEPSEEK3_DEFAULTS['num_key_value_heads']}, not num_attention_heads={heads} as MLA "
                      f"needs (no model transformers can run); add \"num_key_value_heads\": {heads} to config.json")
  return {**_DEEPSEEK3_DEFAULTS, **hf}


def deepseek3_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  if hf.get("model_type") != "kimi_k2":  # Kimi K2's config class is its own remote code's, not transformers'
    hf = with_v3_defaults(hf)
  r.require_hf(hf, "scoring_func", ("sigmoid",), "sigmoid")
  r.require_hf(hf, "topk_method", ("noaux_tc",), "noaux_tc")
  groups, topk_groups = _expert_groups(hf)
  return {**_model_keys(hf, "deepseek3"), "moe_score_function": "sigmoid", "moe_score_correction_bias": True,
          "moe_num_groups": groups, "moe_topk_groups": topk_groups, "moe_group_score": "top2_sum"}


def _expert_groups(hf: Mapping[str, Any]) -> tuple[int, int]:
  """n_group, topk_group: transformers splits the routed experts into n_group groups and keeps the best
  topk_group (a 0 or null there is a division by zero, an empty or failed top-k: no model). DeepseekV2Config
  takes an absent one as null, so V2's group_limited_greedy needs both written (V3's defaults fill them in)."""
  for key in ("n_group", "topk_group"):
    if key not in hf:
      raise ConfigError(f"HF config {key}=None (absent) with topk_method={hf.get('topk_method')!r}: transformers "
                        "cannot split the experts into groups without it; use the checkpoint's own config.json")
  groups = r.count_hf(hf, "n_group", "an expert group count")
  topk_groups = r.count_hf(hf, "topk_group", "a count of expert groups per token")
  experts = hf.get("n_routed_experts")
  if isinstance(experts, int) and experts % groups:
    raise ConfigError(f"HF config n_group={groups} does not divide n_routed_experts={experts} into equal groups")
  if topk_groups > groups:
    raise ConfigError(f"HF config topk_group={topk_groups} is more than the n_group={groups} expert groups")
  return groups, topk_groups


def deepseek2_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_DEEPSEEK2_DEFAULTS, **hf}
  r.require_hf(hf, "scoring_func", ("softmax",), "softmax")
  method = r.require_hf(hf, "topk_method", ("greedy", "group_limited_greedy"), "greedy")
  groups, topk_groups = _expert_groups(hf) if method == "group_limited_greedy" else (1, 1)
  return {**_model_keys(hf, "deepseek2"), "moe_score_function": "softmax", "moe_num_groups": groups,
          "moe_topk_groups": topk_groups, "moe_group_score": "max"}


def _hf_config(cfg: ModelConfig) -> dict[str, Any]:
  moe, mla = cfg.moe, cfg.mla
  rope = rope_hf_config(cfg.rope)
  if cfg.rope.rope_type == "yarn":
    rope["rope_parameters"].update(attention_factor=rope_attention(cfg.rope),
                                   mscale_all_dim=cfg.rope.rope_yarn_mscale_all_dim)
  return {
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.emb_dim, "intermediate_size": moe.dense_mlp_dim or cfg.mlp_dim,
      "moe_intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_decoder_layers,
      "num_attention_heads": cfg.num_query_heads, "num_key_value_heads": cfg.num_kv_heads,
      "n_shared_experts": moe.shared_experts, "n_routed_experts": moe.num_experts,
      "num_experts_per_tok": moe.num_experts_per_tok, "routed_scaling_factor": moe.routed_scaling_factor,
      "norm_topk_prob": moe.norm_topk_prob, "first_k_dense_replace": moe.first_dense_layers,
      "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank or None,
      "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
      "v_head_dim": mla.v_head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.normalization_layer_epsilon,
      "max_position_embeddings": max_positions(cfg),
      "tie_word_embeddings": cfg.logits_via_embedding, "attention_bias": False, **rope,
  }


def rope_attention(rope: RopeConfig) -> float:
  """The YaRN attention factor as HF's `attention_factor` (ours: 0 = the default from the factor)."""
  if rope.rope_attention_factor > 0:
    return rope.rope_attention_factor
  return _mscale(rope.rope_scaling_factor, 1.0)


def deepseek3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **_hf_config(cfg),
          "rope_interleave": cfg.rope.rope_interleaved, "n_group": cfg.moe.moe_num_groups,
          "topk_group": cfg.moe.moe_topk_groups,
          "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": cfg.mtp.mtp_num_layers}


def deepseek2_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  moe = cfg.moe
  limited = moe.moe_topk_groups < moe.moe_num_groups
  return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **_hf_config(cfg),
          "n_group": moe.moe_num_groups if limited else None, "topk_group": moe.moe_topk_groups if limited else None,
          "topk_method": "group_limited_greedy" if limited else "greedy", "scoring_func": "softmax"}


# Tiny shapes: 4 heads of 8 no-position + 4 rotated features, values 6 wide, latent 16, 8 experts.
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 8,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}

register_family(Family(
    "deepseek3", ("deepseek_v3", "kimi_k2"), ("deepseek3",), deepseek3_model_keys, deepseek3_hf_config, deepseek_tensors,
    reference_hf_configs={
        # Low-rank queries, sigmoid routing with the bias (randomised by the test's builder), 4 groups
        # of 2 with the best 2 kept, a scaling factor, a dense first layer, a shared expert, YaRN with
        # both mscales (the rotation and the softmax corrected).
        "deepseek3": dict(model_type="deepseek_v3", **_TINY, q_lora_rank=24, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                          n_shared_experts=1, max_position_embeddings=32, rope_parameters=_YARN, rope_interleave=True),
        # Halves RoPE, unnormalised weights, no group limit, no dense prefix, default RoPE.
        "deepseek3-plain": dict(model_type="deepseek_v3", **_TINY, q_lora_rank=24, n_group=1, topk_group=1,
                                routed_scaling_factor=1.5, norm_topk_prob=False, first_k_dense_replace=0,
                                n_shared_experts=2, rope_interleave=False)}))
register_family(Family(
    "deepseek2", ("deepseek_v2",), ("deepseek2",), deepseek2_model_keys, deepseek2_hf_config, deepseek_tensors,
    reference_hf_configs={
        # V2-Lite's form: a direct query projection, softmax greedy routing, a dense first layer, 2 shared experts.
        "deepseek2-lite": dict(model_type="deepseek_v2", **_TINY, q_lora_rank=None, topk_method="greedy",
                               n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False),
        # V2's group-limited greedy (best-expert group scores; with max scores only a limit below k
        # groups changes the choice) with a routed scaling factor.
        "deepseek2-grouped": dict(model_type="deepseek_v2", **_TINY, q_lora_rank=24, topk_method="group_limited_greedy",
                                  n_group=4, topk_group=1, routed_scaling_factor=2.0, n_shared_experts=1,
                                  first_k_dense_replace=0, norm_topk_prob=False)}))
