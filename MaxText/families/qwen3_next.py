"""Qwen3-Next (HF `qwen3_next`, decoder_block "qwen3_next"): a hybrid stack in periods of
full_attention_interval layers (4 in the release), the first ones Gated DeltaNet (linear attention,
layers/gated_deltanet.py, in the `dense_layers` stack) and the last gated full attention (partial RoPE,
QK-norm, a sigmoid output gate); every layer's MLP is a high-sparsity MoE with one shared expert
whose output a per-token sigmoid scales. Every RMSNorm but the DeltaNet's output norm is zero-centred
(gain 1 + w: normalization_type rms_plus_one).

HF names (layer i; full-attention layers)                  ours (inside layer i)
  self_attn.q_proj.weight [N * 2H, D] (per head: query, gate)  self_attention/query/kernel, output_gate/kernel
  self_attn.{k,v,o}_proj, q_norm, k_norm                       as Qwen3's
HF names (Gated DeltaNet layers), under linear_attn.
  in_proj_qkvz.weight [I * (2Q + 2rW), D] (per key head: q, k, r values, r gates; r = Y / I)
                                                              self_attention/{query,key,value,output_gate}/kernel
  in_proj_ba.weight [I * 2r, D] (per key head: r b's, r a's)   self_attention/{write_strength,decay_input}/kernel
  conv1d.weight [2IQ + YW, 1, w] (channels q, k, v)           self_attention/{query,key,value}_conv [w, heads, dim]
  dt_bias [Y], A_log [Y], norm.weight [W], out_proj.weight    self_attention/dt_bias, a_log, norm_scale, out/kernel
MoE (every layer), under mlp.: gate, experts (as Qwen3-MoE's), shared_expert.{gate,up,down}_proj
→ mlp/shared_mlp/wi_0, wi_1, wo, shared_expert_gate.weight [1, D] → mlp/shared_gate/kernel [D, 1].

Qwen3.5 (qwen3_5.py) reuses these layers and most of these tables (its DeltaNet projections are laid out
differently).

HF checkpoints of Qwen3-Next carry no multi-token-prediction weights (transformers drops them), so
none are converted. Dense-MLP layers (mlp_only_layers, decoder_sparse_step > 1) and layer types
that do not repeat in periods ending in full attention are refused with one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.errors import ConfigError
from MaxText.families import Family, register_family
from MaxText.families.llama import TINY_SHAPES, embedding_tensors, max_positions, shape_hf_config, shape_keys
from MaxText.families.mixtral import fused_expert_tensors, routed_expert_tensors

_LAYER = "model.layers.{i}."
_MOE = _LAYER + "mlp."
_LINEAR = _LAYER + "linear_attn."
_ATTN = _LAYER + "self_attn."
Array = np.ndarray


def _linear_shape(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
  """(I key heads, r value heads per key head, Q key dim, W value dim, D)."""
  la = cfg.linear_attn
  i = la.linear_num_key_heads
  return i, la.linear_num_value_heads // i, la.linear_key_head_dim, la.linear_value_head_dim, cfg.emb_dim


def _qkvz_to_ours(w: Array, cfg: ModelConfig) -> tuple[Array, ...]:
  i, r_, q, wd, d = _linear_shape(cfg)
  per_head = w.reshape(i, 2 * q + 2 * r_ * wd, d)
  query, key, value, gate = np.split(per_head, [q, 2 * q, 2 * q + r_ * wd], axis=1)
  heads = lambda x, n, dim: x.reshape(n, dim, d).transpose(2, 0, 1)  # noqa: E731  [n*dim, D] -> [D, n, dim]
  return heads(query, i, q), heads(key, i, q), heads(value, i * r_, wd), heads(gate, i * r_, wd)


def _qkvz_to_hf(ours: tuple[Array, ...], cfg: ModelConfig) -> Array:
  i, r_, q, wd, d = _linear_shape(cfg)
  query, key, value, gate = (x.transpose(1, 2, 0) for x in ours)  # [heads, dim, D]
  per_head = [query, key, value.reshape(i, r_ * wd, d), gate.reshape(i, r_ * wd, d)]
  return np.concatenate(per_head, axis=1).reshape(-1, d)


def _ba_to_ours(w: Array, cfg: ModelConfig) -> tuple[Array, ...]:
  i, r_, _, _, d = _linear_shape(cfg)
  b, a = np.split(w.reshape(i, 2 * r_, d), 2, axis=1)
  return b.reshape(i * r_, d).T, a.reshape(i * r_, d).T


def _ba_to_hf(ours: tuple[Array, ...], cfg: ModelConfig) -> Array:
  i, r_, _, _, d = _linear_shape(cfg)
  b, a = (x.T.reshape(i, r_, d) for x in ours)
  return np.concatenate([b, a], axis=1).reshape(-1, d)


def _conv_to_ours(w: Array, cfg: ModelConfig) -> tuple[Array, ...]:
  i, r_, q, wd, _ = _linear_shape(cfg)
  kernel = w[:, 0, :].T  # [w, channels]
  query, key, value = np.split(kernel, [i * q, 2 * i * q], axis=1)
  width = kernel.shape[0]
  return query.reshape(width, i, q), key.reshape(width, i, q), value.reshape(width, i * r_, wd)


def _conv_to_hf(ours: tuple[Array, ...], cfg: ModelConfig) -> Array:
  del cfg
  kernel = np.concatenate([x.reshape(x.shape[0], -1) for x in ours], axis=1)
  return kernel.T[:, None, :]


def _gated_query_to_ours(w: Array, cfg: ModelConfig) -> tuple[Array, ...]:
  per_head = w.reshape(cfg.num_query_heads, 2, cfg.head_dim, cfg.emb_dim)
  return per_head[:, 0].transpose(2, 0, 1), per_head[:, 1].transpose(2, 0, 1)


def _gated_query_to_hf(ours: tuple[Array, ...], cfg: ModelConfig) -> Array:
  query, gate = (x.transpose(1, 2, 0) for x in ours)  # [N, H, D]
  return np.stack([query, gate], axis=1).reshape(-1, cfg.emb_dim)


def _linear_out_to_ours(w: Array, cfg: ModelConfig) -> Array:
  la = cfg.linear_attn
  return w.T.reshape(la.linear_num_value_heads, la.linear_value_head_dim, cfg.emb_dim)


def _linear_out_to_hf(kernel: Array, cfg: ModelConfig) -> Array:
  return kernel.reshape(-1, cfg.emb_dim).T


# Each attention kind lives in its own stack: full attention in `layers`, Gated DeltaNet in `dense_layers`.
def full_attention_tensors() -> list[r.TensorMap]:
  k_in, k_out = r.heads_in(r.kv_heads)
  v_in, v_out = r.heads_in(r.kv_heads)
  return [dataclasses.replace(m, stack="layers") for m in [
      r.TensorMap(_ATTN + "q_proj.weight", ("self_attention/query/kernel", "self_attention/output_gate/kernel"),
                  _gated_query_to_ours, _gated_query_to_hf),
      r.one(_ATTN + "k_proj.weight", "self_attention/key/kernel", k_in, k_out),
      r.one(_ATTN + "v_proj.weight", "self_attention/value/kernel", v_in, v_out),
      r.one(_ATTN + "o_proj.weight", "self_attention/out/kernel", r.heads_out, r.heads_out_to_hf),
      r.one(_ATTN + "q_norm.weight", "self_attention/query_norm/scale"),
      r.one(_ATTN + "k_norm.weight", "self_attention/key_norm/scale")]]


def linear_attention_tensors(projections: list[r.TensorMap]) -> list[r.TensorMap]:
  """A Gated DeltaNet layer's tensors (the `dense_layers` stack): its input `projections` (laid out
  differently by Qwen3-Next and Qwen3.5), then the conv, decay, output norm and output projection."""
  return [dataclasses.replace(m, stack="dense_layers") for m in projections + [
      r.TensorMap(_LINEAR + "conv1d.weight", _ours("query_conv", "key_conv", "value_conv"), _conv_to_ours, _conv_to_hf),
      r.one(_LINEAR + "dt_bias", "self_attention/dt_bias"),
      r.one(_LINEAR + "A_log", "self_attention/a_log"),
      r.one(_LINEAR + "norm.weight", "self_attention/norm_scale"),
      r.one(_LINEAR + "out_proj.weight", "self_attention/out/kernel", _linear_out_to_ours, _linear_out_to_hf)]]


def _ours(*names: str) -> tuple[str, ...]:
  return tuple(f"self_attention/{n}" for n in names)


def _fused_projections() -> list[r.TensorMap]:
  """Qwen3-Next's interleaved in_proj_qkvz and in_proj_ba."""
  return [r.TensorMap(_LINEAR + "in_proj_qkvz.weight", _ours("query/kernel", "key/kernel", "value/kernel",
                                                             "output_gate/kernel"), _qkvz_to_ours, _qkvz_to_hf),
          r.TensorMap(_LINEAR + "in_proj_ba.weight", _ours("write_strength/kernel", "decay_input/kernel"), _ba_to_ours,
                      _ba_to_hf)]


def norm_tensors() -> list[r.TensorMap]:
  return [r.one(_LAYER + "input_layernorm.weight", "pre_self_attention_layer_norm/scale"),
          r.one(_LAYER + "post_attention_layernorm.weight", "post_self_attention_layer_norm/scale")]


def moe_tensors() -> list[r.TensorMap]:
  """Every layer's routed experts (per expert on disk, fused in transformers' memory) and gated shared expert."""
  return [
      *routed_expert_tensors(_MOE),
      r.one(_MOE + "shared_expert.gate_proj.weight", "mlp/shared_mlp/wi_0/kernel", r.transpose, r.transpose),
      r.one(_MOE + "shared_expert.up_proj.weight", "mlp/shared_mlp/wi_1/kernel", r.transpose, r.transpose),
      r.one(_MOE + "shared_expert.down_proj.weight", "mlp/shared_mlp/wo/kernel", r.transpose, r.transpose),
      r.one(_MOE + "shared_expert_gate.weight", "mlp/shared_gate/kernel", r.transpose, r.transpose),
      *fused_expert_tensors(_MOE)]


def qwen3_next_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  return (embedding_tensors(cfg) + norm_tensors() + full_attention_tensors()
          + linear_attention_tensors(_fused_projections()) + moe_tensors())


def full_attention_interval(hf: Mapping[str, Any], converter: str = "qwen3_next") -> int:
  num_layers = hf["num_hidden_layers"]
  def from_interval() -> list[str]:  # transformers reads the interval only to make the layer kinds
    period = r.count_hf(hf, "full_attention_interval", "a layer period", 4)
    return ["full_attention" if (i + 1) % period == 0 else "linear_attention" for i in range(num_layers)]

  layer_types, interval = r.given_layer_types(hf, ("full_attention", "linear_attention"), from_interval), 4
  if "full_attention" in layer_types:
    interval = layer_types.index("full_attention") + 1
  expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
  if layer_types != expected or num_layers % interval:
    raise ConfigError(f"HF config layer_types {layer_types} is not supported by the {converter} converter: it needs "
                      "periods of linear_attention layers each ended by one full_attention layer")
  return interval


def hybrid_model_keys(hf: Mapping[str, Any], converter: str) -> dict[str, Any]:
  """The keys every Qwen3-Next-style hybrid shares: shapes, gated full attention with partial RoPE, Gated DeltaNet."""
  r.require_hf(hf, "hidden_act", ("silu",), "silu")
  r.require_hf(hf, "attention_bias", (False,), False)
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # transformers' precedence
  params = dict(hf.get(field) or {})
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    raise ConfigError(f"HF config {field} rope_type={rope_type!r} is not supported by the {converter} converter "
                      "(supported: 'default')")
  # transformers' default for these configs is a quarter, not the whole head
  fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
    raise ConfigError(f"HF config partial_rotary_factor={fraction!r} is not a fraction of each head to rotate (over 0, "
                      "at most 1); use the checkpoint's own config.json")
  return {"decoder_block": converter, **shape_keys(hf),
          "rope_max_timescale": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
          "partial_rotary_factor": float(fraction),
          "mlp_activations": ["silu", "linear"], "normalization_type": "rms_plus_one", "use_qk_norm": True,
          "attention_output_gate": True, "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
          "full_attention_interval": full_attention_interval(hf, converter),
          "linear_num_key_heads": int(hf["linear_num_key_heads"]),
          "linear_num_value_heads": int(hf["linear_num_value_heads"]),
          "linear_key_head_dim": int(hf["linear_key_head_dim"]), "linear_value_head_dim": int(hf["linear_value_head_dim"]),
          "linear_conv_kernel_dim": int(hf["linear_conv_kernel_dim"])}


def moe_model_keys(hf: Mapping[str, Any], converter: str) -> dict[str, Any]:
  """Every layer's routed experts plus one gated shared expert (a whole multiple of an expert's width)."""
  r.require_hf(hf, "decoder_sparse_step", (1,), 1)
  if hf.get("mlp_only_layers"):
    r.require_hf(hf, "mlp_only_layers", ([],))
  moe_width = r.count_hf(hf, "moe_intermediate_size", "an expert width")
  # transformers builds the gated shared expert at this width (0: one that adds nothing; null: none it can build)
  shared_width = r.count_hf(hf, "shared_expert_intermediate_size", "a shared-expert width", 0, minimum=0)
  if shared_width % moe_width:
    raise ConfigError(f"HF config shared_expert_intermediate_size={shared_width} is not supported by the {converter} "
                      f"converter: it must be a multiple of moe_intermediate_size ({moe_width})")
  num_experts = r.routed_experts(hf, "num_experts")
  return {"base_mlp_dim": moe_width, "num_experts": num_experts,
          "num_experts_per_tok": r.experts_per_token(hf, num_experts),
          "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
          "shared_experts": shared_width // moe_width, "shared_expert_gate": shared_width > 0}


# What transformers' Qwen3NextConfig takes for a shape field config.json leaves out: fixed numbers, not
# derived from the query heads and width as shape_keys would.
_QWEN3_NEXT_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256}


def qwen3_next_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_QWEN3_NEXT_DEFAULTS, **hf}
  return {**hybrid_model_keys(hf, "qwen3_next"), **moe_model_keys(hf, "qwen3_next")}


def hybrid_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """HF config fields of the hybrid stack (shapes, RoPE, layer types, Gated DeltaNet)."""
  la, interval = cfg.linear_attn, cfg.linear_attn.full_attention_interval
  return {**shape_hf_config(cfg), "hidden_act": "silu", "attention_bias": False,
          "max_position_embeddings": max_positions(cfg),
          "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.rope_max_timescale,
                              "partial_rotary_factor": cfg.rope.partial_rotary_factor},
          "full_attention_interval": interval,
          "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                          for i in range(cfg.num_decoder_layers)],
          "linear_num_key_heads": la.linear_num_key_heads, "linear_num_value_heads": la.linear_num_value_heads,
          "linear_key_head_dim": la.linear_key_head_dim, "linear_value_head_dim": la.linear_value_head_dim,
          "linear_conv_kernel_dim": la.linear_conv_kernel_dim}


def moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"moe_intermediate_size": cfg.mlp_dim, "shared_expert_intermediate_size": cfg.moe.shared_experts * cfg.mlp_dim,
          "num_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.num_experts_per_tok,
          "router_aux_loss_coef": cfg.moe.load_balance_loss_weight}


def qwen3_next_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **hybrid_hf_config(cfg),
          **moe_hf_config(cfg), "norm_topk_prob": cfg.moe.norm_topk_prob, "decoder_sparse_step": 1,
          "mlp_only_layers": []}


# Two periods of 3 Gated DeltaNet + 1 full attention, as released; 2 value heads per key head, a
# quarter of each head rotated; 8 experts, top-2, one gated shared expert. rms_norm_eps is large
# because the DeltaNet's output norm rescales each head: at random weights some heads' outputs are
# tiny differences of larger terms (q·k over 8 features), whose rounding a 1e-6 epsilon would blow up
# to where HF's own chunked and recurrent forms disagree beyond float32 tolerance.
_TINY = dict(TINY_SHAPES, num_hidden_layers=8, rms_norm_eps=1e-2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=4, full_attention_interval=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})
register_family(Family("qwen3_next", ("qwen3_next",), ("qwen3_next",), qwen3_next_model_keys, qwen3_next_hf_config,
                       qwen3_next_tensors, reference_hf_configs={"qwen3_next": dict(model_type="qwen3_next", **_TINY)}))
