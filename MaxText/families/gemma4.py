"""Gemma 4 (HF `gemma4_text`, Gemma4ForCausalLM; and the text decoder of `gemma4`, Gemma4ForConditionalGeneration):
Gemma 3's local/global stack (gemma.py) with plain RMSNorm gains, unscaled queries, a value norm, the
global layers' own head shape (and, with attention_k_eq_v, no value projection), keys and values shared
by the last layers, per-layer input embeddings and a per-layer output scalar (gemma4_layers.py).

Each layer has its own table entries (its head shape is its own), written with its index:
  model.layers.{i}.input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
    post_feedforward_layernorm                             → Gemma 2's names (gemma.py)
  model.layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm → self_attention/...
  model.layers.{i}.per_layer_input_gate / per_layer_projection / post_per_layer_input_norm
                                                          → per_layer_input_gate, per_layer_projection, post_per_layer_input_norm
  model.layers.{i}.layer_scalar [1]                       → layer_scalar
  model.embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm → per_layer_inputs/...
A KV-shared layer's k/v projections and norms, which checkpoints may still hold, are skipped.

Multimodal checkpoints (`gemma4`): the text decoder under `model.language_model.` converts; the vision and
audio towers and their embedders are left out (Models.md). Written back, it is a text-only Gemma4ForCausalLM.
Gemma 4's MoE block (26B A4B, enable_moe_block): experts beside the dense MLP (moe_beside_mlp), their fused
gate/up projection split into our wi_0 / wi_1.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.errors import ConfigError
from MaxText.families import Family, gemma4_layers, register_family
from MaxText.families.gemma import _activation, _same, soft_cap
from MaxText.families.llama import TINY_SHAPES, layer_type_ropes, max_positions, shape_hf_config, shape_keys
from MaxText.layers import layer_shapes

# HF's default layer kinds: five sliding to one full, the last layer always full.
_SLIDING_PERIOD = 6
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def _layer_types(hf: Mapping[str, Any]) -> list[str]:
  num_layers = hf["num_hidden_layers"]
  given = hf.get("layer_types")
  if given is not None and (not isinstance(given, list) or len(given) != num_layers
                            or not set(given) <= {"sliding_attention", "full_attention"}):
    raise ConfigError(f"HF config layer_types={str(given)[:80]} is not a list of num_hidden_layers={num_layers} "
                      "entries, each \"sliding_attention\" or \"full_attention\"; use the checkpoint's own config.json")
  kinds = list(given or ["sliding_attention" if (i + 1) % _SLIDING_PERIOD else "full_attention"
                         for i in range(num_layers)])
  kinds[-1] = "full_attention"  # as HF forces it
  _check_kv_sharing(hf, kinds, given is None)
  return kinds


def _check_kv_sharing(hf: Mapping[str, Any], kinds: list[str], defaulted: bool) -> None:
  """The last num_kv_shared_layers layers read the keys and values of the last unshared layer of their kind, so
  every kind needs one among the others (transformers refuses the config otherwise)."""
  shared = hf.get("num_kv_shared_layers") or 0
  if not shared or not 0 < shared < len(kinds) or set(kinds[len(kinds) - shared:]) <= set(kinds[:len(kinds) - shared]):
    return
  kind = sorted(set(kinds[len(kinds) - shared:]) - set(kinds[:len(kinds) - shared]))[0].replace("_", "-")
  source = ("has no layer_types, so transformers' default kinds apply (5 sliding : 1 full, the last full), and "
            if defaulted else "")
  raise ConfigError(f"HF config {source}num_kv_shared_layers={shared} leaves the {kind} layers among the last {shared} "
                    f"no earlier {kind} layer to share keys and values from; "
                    + ("give the checkpoint's layer_types in config.json" if defaulted else
                       "use the checkpoint's own layer_types and num_kv_shared_layers"))


# Gemma4TextConfig's rope_parameters where config.json has none (a rope_scaling replaces them; rope_theta is not read).
_GEMMA4_ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


def _rope_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  params = hf.get(field) or _GEMMA4_ROPE
  if "full_attention" not in params:  # transformers' Gemma 4 fails on it (a KeyError)
    raise ConfigError(f"HF config {field}={params!r} is not supported by the gemma4 converter: Gemma 4 reads RoPE by "
                      "layer type; write rope_parameters {\"full_attention\": {...}, \"sliding_attention\": {...}}")
  full, sliding = layer_type_ropes({"rope_parameters": params}, 1_000_000.0, 10_000.0)
  named = {"model_type": f"gemma4 ({field})"}  # so a refusal names where the rope_type sits
  r.require_hf({**sliding, **named}, "rope_type", ("default",), "default")
  rope_type = r.require_hf({**full, **named}, "rope_type", ("default", "proportional"), "default")
  keys: dict[str, Any] = {"rope_max_timescale": float(full.get("rope_theta", 1_000_000.0)), "rope_type": rope_type,
                          "rope_local_max_timescale": float(sliding.get("rope_theta", 10_000.0))}
  if rope_type == "proportional":
    keys.update(rope_proportional_rotated_fraction=float(full.get("partial_rotary_factor", 1.0)),
                rope_scaling_factor=float(full.get("factor", 1.0)))
  return keys


def _global_shape(hf: Mapping[str, Any], kinds: list[str], k_eq_v: bool) -> dict[str, int]:
  """global_head_dim, global_num_kv_heads: from config.json's global_head_dim / num_global_key_value_heads (HF
  reads the latter only with attention_k_eq_v), or the per_layer_config transformers writes from them."""
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    return {"global_head_dim": int(hf.get("global_head_dim", 512)),
            # null: no override of the global layers' kv heads; a 0 would be zero heads in transformers
            "global_num_kv_heads": (r.count_hf(hf, "num_global_key_value_heads", "a head count")
                                    if k_eq_v and hf.get("num_global_key_value_heads") is not None else 0)}
  overrides = {int(index): dict(fields) for index, fields in per_layer.items()}
  full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
  shapes = {tuple(sorted(overrides.get(i, {}).items())) for i in full}
  if set(overrides) - set(full) or len(shapes) > 1 or any(set(f) - {"head_dim", "num_key_value_heads"}
                                                          for f in overrides.values()):
    raise ConfigError(f"HF config per_layer_config={per_layer!r} is not supported by the gemma4 converter "
                      "(supported: the same head_dim / num_key_value_heads on every full-attention layer)")
  fields = overrides.get(full[0], {})
  return {"global_head_dim": int(fields.get("head_dim", hf.get("head_dim") or 0)),
          "global_num_kv_heads": int(fields.get("num_key_value_heads", 0))}


# What transformers' Gemma4TextConfig takes for a shape field config.json (or its text_config) leaves out:
# fixed numbers, not derived from the query heads and width as shape_keys would.
_GEMMA4_TEXT_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256}


def gemma4_text_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  hf = {**_GEMMA4_TEXT_DEFAULTS, **hf}
  _activation(hf)
  r.require_hf(hf, "attention_bias", (False,), False)
  r.require_hf(hf, "tie_word_embeddings", (True,), True)
  r.require_hf(hf, "use_bidirectional_attention", (None,), None)
  kinds = _layer_types(hf)
  pattern = r.attention_pattern([kind == "sliding_attention" for kind in kinds])
  k_eq_v = bool(hf.get("attention_k_eq_v", False))
  per_layer = int(hf.get("hidden_size_per_layer_input", 256) or 0)  # transformers' default where absent
  keys = {"decoder_block": "gemma4", **shape_keys(hf), **_rope_keys(hf), "mlp_activations": ["gelu", "linear"],
          "normalization_type": "rms", "logits_via_embedding": True, "scale_embedding": True, "use_qk_norm": True,
          "query_pre_attn_scalar": 1.0, "attention_layer_pattern": pattern,
          "final_logits_soft_cap": soft_cap(hf, "final_logit_softcapping"),
          **_global_shape(hf, kinds, k_eq_v),
          "attention_k_eq_v": k_eq_v, "use_v_norm": True,
          "num_kv_shared_layers": r.count_hf(hf, "num_kv_shared_layers", "a layer count", 0, minimum=0),
          "kv_shared_double_mlp": bool(hf.get("use_double_wide_mlp", False)),
          "per_layer_input_dim": per_layer,
          # Every token id looks up a row of it: fewer rows than the vocabulary leave ids without one.
          "per_layer_input_vocab_size": (r.count_hf(hf, "vocab_size_per_layer_input",
                                                    f"a vocabulary size of at least vocab_size={hf['vocab_size']}",
                                                    262_144, minimum=max(int(hf["vocab_size"]), 1))
                                         if per_layer else 0)}
  if "local" in pattern:  # 512: transformers' default where absent
    keys["sliding_window_size"] = r.count_hf(hf, "sliding_window", "a window for its sliding_attention layers", 512)
  if hf.get("enable_moe_block"):  # 26B A4B: experts (our mlp_dim) beside the dense MLP (dense_mlp_dim)
    num_experts = r.routed_experts(hf, "num_experts")
    keys.update(moe_beside_mlp=True, num_experts=num_experts,
                num_experts_per_tok=r.experts_per_token(hf, num_experts, "top_k_experts"),
                base_mlp_dim=int(hf["moe_intermediate_size"]), dense_mlp_dim=int(hf["intermediate_size"]),
                norm_topk_prob=True)
  return keys


def gemma4_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """A text checkpoint's keys, or a multimodal one's text decoder's (its towers are left out)."""
  if hf.get("model_type") != "gemma4":
    return gemma4_text_model_keys(hf)
  text = {"model_type": "gemma4_text", **(hf.get("text_config") or {})}
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  return gemma4_text_model_keys(text)


def gemma4_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  shapes, rope = cfg.layer_shapes, cfg.rope
  if shapes.global_num_kv_heads and not shapes.attention_k_eq_v:
    raise ConfigError("global_num_kv_heads without attention_k_eq_v has no HF Gemma 4 config (HF reads "
                      "num_global_key_value_heads only with attention_k_eq_v); set global_num_kv_heads=0")
  full: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.rope_max_timescale}
  if rope.rope_type == "proportional":
    full.update(rope_type="proportional", partial_rotary_factor=rope.rope_proportional_rotated_fraction,
                factor=rope.rope_scaling_factor)
  return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", **shape_hf_config(cfg),
          "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
          "max_position_embeddings": max_positions(cfg),
          "layer_types": r.hf_layer_types(cfg.attn.attention_layer_pattern, cfg.num_decoder_layers),
          "sliding_window": cfg.attn.sliding_window_size,
          "rope_parameters": {"full_attention": full, "sliding_attention": {
              "rope_type": "default", "rope_theta": rope.rope_local_max_timescale or rope.rope_max_timescale}},
          "final_logit_softcapping": cfg.final_logits_soft_cap or None,
          "global_head_dim": shapes.global_head_dim or cfg.head_dim,
          "num_global_key_value_heads": shapes.global_num_kv_heads or None,
          "attention_k_eq_v": shapes.attention_k_eq_v, "num_kv_shared_layers": shapes.num_kv_shared_layers,
          "use_double_wide_mlp": shapes.kv_shared_double_mlp,
          "hidden_size_per_layer_input": shapes.per_layer_input_dim,
          "vocab_size_per_layer_input": shapes.per_layer_input_vocab_size or cfg.vocab_size,
          **_moe_hf_config(cfg)}


def _moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.layer_shapes.moe_beside_mlp:
    return {"enable_moe_block": False}
  return {"enable_moe_block": True, "num_experts": cfg.moe.num_experts, "top_k_experts": cfg.moe.num_experts_per_tok,
          "moe_intermediate_size": cfg.mlp_dim, "intermediate_size": cfg.moe.dense_mlp_dim or cfg.mlp_dim}


def _bound(convert: r.ConvertOne, own: ModelConfig) -> r.ConvertOne:
  """`convert` with layer `i`'s own configuration in place of the model's."""
  return lambda x, cfg: convert(x, own)


def _layer_tensors(cfg: ModelConfig, i: int, prefix: str) -> list[r.TensorMap]:
  own = layer_shapes.layer_config(cfg, i)
  hf, ours = f"{prefix}layers.{i}.", f"layers_{i}/"
  attn = hf + "self_attn."
  q_in, q_out = r.heads_in(r.query_heads, rope=True)
  k_in, k_out = r.heads_in(r.kv_heads, rope=True)
  v_in, v_out = r.heads_in(r.kv_heads)
  one = lambda name, path, to_ours=_same, to_hf=_same: r.one(  # noqa: E731
      name, ours + path, _bound(to_ours, own), _bound(to_hf, own))
  maps = [one(hf + "input_layernorm.weight", "pre_self_attention_layer_norm/scale"),
          one(hf + "post_attention_layernorm.weight", "attention_output_norm/scale"),
          one(hf + "pre_feedforward_layernorm.weight", "post_self_attention_layer_norm/scale"),
          one(hf + "post_feedforward_layernorm.weight", "mlp_output_norm/scale"),
          one(hf + "layer_scalar", "layer_scalar"),
          one(attn + "q_proj.weight", "self_attention/query/kernel", q_in, q_out),
          one(attn + "q_norm.weight", "self_attention/query_norm/scale"),
          one(attn + "o_proj.weight", "self_attention/out/kernel", r.heads_out, r.heads_out_to_hf),
          one(hf + "mlp.gate_proj.weight", "mlp/wi_0/kernel", r.transpose, r.transpose),
          one(hf + "mlp.up_proj.weight", "mlp/wi_1/kernel", r.transpose, r.transpose),
          one(hf + "mlp.down_proj.weight", "mlp/wo/kernel", r.transpose, r.transpose)]
  kv = [(attn + "k_proj.weight", "self_attention/key/kernel", k_in, k_out),
        (attn + "k_norm.weight", "self_attention/key_norm/scale", _same, _same)]
  is_global = own.attn.attention_layer_pattern == ("global",)
  if not (cfg.layer_shapes.attention_k_eq_v and is_global):
    kv.append((attn + "v_proj.weight", "self_attention/value/kernel", v_in, v_out))
  if layer_shapes.has_own_kv(cfg, i):
    maps += [one(*entry) for entry in kv]
  else:  # checkpoints may keep a shared layer's unused projections
    maps += [r.ignored(entry[0]) for entry in kv]
  if cfg.layer_shapes.moe_beside_mlp:
    maps += _expert_tensors(hf, ours)
  if cfg.layer_shapes.per_layer_input_dim:
    maps += [one(hf + "per_layer_input_gate.weight", "per_layer_input_gate/kernel", r.transpose, r.transpose),
             one(hf + "per_layer_projection.weight", "per_layer_projection/kernel", r.transpose, r.transpose),
             one(hf + "post_per_layer_input_norm.weight", "post_per_layer_input_norm/scale")]
  return maps


def _expert_tensors(hf: str, ours: str) -> list[r.TensorMap]:
  """The expert branch: HF's fused gate_up_proj [E, 2F, D] is our wi_0 and wi_1 [E, D, F]; down_proj [E, D, F]
  our wo [E, F, D]; the router's projection our gate, its scales and the branch's three norms."""
  def split(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
    gate, up = np.split(w, 2, axis=1)
    return gate.transpose(0, 2, 1), up.transpose(0, 2, 1)

  def fuse(kernels: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
    return np.concatenate([k.transpose(0, 2, 1) for k in kernels], axis=1)

  def swap(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.transpose(0, 2, 1)

  return [r.TensorMap(hf + "experts.gate_up_proj", (ours + "moe/wi_0/kernel", ours + "moe/wi_1/kernel"), split, fuse),
          r.one(hf + "experts.down_proj", ours + "moe/wo/kernel", swap, swap),
          r.one(hf + "router.proj.weight", ours + "moe/gate/kernel", r.transpose, r.transpose),
          r.one(hf + "router.scale", ours + "router_scale"),
          r.one(hf + "router.per_expert_scale", ours + "router_expert_scale"),
          r.one(hf + "post_feedforward_layernorm_1.weight", ours + "dense_output_norm/scale"),
          r.one(hf + "pre_feedforward_layernorm_2.weight", ours + "experts_input_norm/scale"),
          r.one(hf + "post_feedforward_layernorm_2.weight", ours + "experts_output_norm/scale")]


def _per_layer_input_tensors(cfg: ModelConfig, prefix: str) -> list[r.TensorMap]:
  m, p = cfg.num_decoder_layers, cfg.layer_shapes.per_layer_input_dim

  def projection_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T.reshape(cfg.emb_dim, m, p)

  def projection_out(kernel: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return kernel.reshape(cfg.emb_dim, m * p).T

  return [r.one(prefix + "embed_tokens_per_layer.weight", "per_layer_inputs/embedder/embedding"),
          r.one(prefix + "per_layer_model_projection.weight", "per_layer_inputs/projection/kernel", projection_in,
                projection_out),
          r.one(prefix + "per_layer_projection_norm.weight", "per_layer_inputs/projection_norm/scale")]


def gemma4_text_tensors(cfg: ModelConfig, prefix: str = "model.") -> list[r.TensorMap]:
  maps = [r.one(prefix + "embed_tokens.weight", "token_embedder/embedding"),
          r.one(prefix + "norm.weight", "decoder_norm/scale"), r.ignored("lm_head.weight")]
  for i in range(cfg.num_decoder_layers):
    maps += _layer_tensors(cfg, i, prefix)
  if cfg.layer_shapes.per_layer_input_dim:
    maps += _per_layer_input_tensors(cfg, prefix)
  return maps


def gemma4_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  """The text checkpoint's names (written), and a multimodal one's (read), its towers skipped."""
  return r.also_read_as_text_decoder(gemma4_text_tensors(cfg), _TOWERS)


# Every mechanism at once: 2 sliding : 1 full (the last full), global layers with twice the head width and
# fewer key/value heads whose values are their keys, proportional RoPE rotating half the global pairs, the last
# 3 layers sharing keys and values (one of each kind) with double-wide MLPs, per-layer inputs, a soft cap.
_TINY = dict(TINY_SHAPES, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_GEMMA4 = dict(model_type="gemma4_text", **_TINY, global_head_dim=32, num_global_key_value_heads=1,
               attention_k_eq_v=True, sliding_window=5, final_logit_softcapping=30.0,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
               rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                   "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
               num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
               vocab_size_per_layer_input=128)

# 26B A4B's layout: experts beside the dense MLP (no per-layer inputs or KV sharing there), 5 sliding : 1 full.
_GEMMA4_MOE = dict(model_type="gemma4_text", **{**_TINY, "num_hidden_layers": 3}, global_head_dim=32,
                   num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters=_GEMMA4["rope_parameters"], hidden_size_per_layer_input=0, enable_moe_block=True,
                   num_experts=4, top_k_experts=2, moe_intermediate_size=32)

register_family(Family("gemma4", ("gemma4_text", "gemma4"), ("gemma4",), gemma4_model_keys, gemma4_hf_config,
                       gemma4_tensors, layer=gemma4_layers.Gemma4DecoderLayer,
                       per_layer_inputs=gemma4_layers.PerLayerInputs,
                       reference_hf_configs={"gemma4": _GEMMA4, "gemma4-experts": _GEMMA4_MOE}))
