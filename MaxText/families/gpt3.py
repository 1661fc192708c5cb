"""GPT-3 (our `gpt3` decoder_block) ↔ HF `gpt2`, the same architecture in HF's model zoo.

HF GPT-2 uses Conv1D weights stored [in, out] (no transpose needed), fuses q, k, v into
`attn.c_attn` ([D, 3·N·H] and bias [3·N·H], q then k then v), ties lm_head to `wte`, and
learns `wpe` position rows:
  transformer.wte.weight / wpe.weight         token_embedder/embedding, position_embedder/embedding
  transformer.h.{i}.ln_1.{weight,bias}        pre_self_attention_layer_norm/{scale,bias}
  transformer.h.{i}.attn.c_attn.{weight,bias} self_attention/{query,key,value}/{kernel,bias}
  transformer.h.{i}.attn.c_proj.{weight,bias} self_attention/out/{kernel,bias}
  transformer.h.{i}.ln_2.{weight,bias}        post_self_attention_layer_norm/{scale,bias}
  transformer.h.{i}.mlp.c_fc / c_proj         mlp/wi_0, mlp/wo
  transformer.ln_f.{weight,bias}              decoder_norm/{scale,bias}
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.families import tensor_maps as r
from MaxText.families import Family, register_family

_QKV = ("self_attention/query", "self_attention/key", "self_attention/value")


def _split_qkv_kernel(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
  return tuple(part.reshape(cfg.emb_dim, cfg.num_query_heads, cfg.head_dim) for part in np.split(w, 3, axis=1))


def _fuse_qkv_kernel(kernels: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
  return np.concatenate([k.reshape(cfg.emb_dim, -1) for k in kernels], axis=1)


def _split_qkv_bias(b: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
  return tuple(part.reshape(cfg.num_query_heads, cfg.head_dim) for part in np.split(b, 3))


def _fuse_qkv_bias(biases: tuple[np.ndarray, ...], cfg: ModelConfig) -> np.ndarray:
  return np.concatenate([b.reshape(-1) for b in biases])


def _out_kernel(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return w.reshape(cfg.num_query_heads, cfg.head_dim, cfg.emb_dim)


def _out_kernel_to_hf(kernel: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return kernel.reshape(-1, cfg.emb_dim)


def _norm(hf: str, ours: str) -> list[r.TensorMap]:
  return [r.one(hf + ".weight", ours + "/scale"), r.one(hf + ".bias", ours + "/bias")]


def gpt3_tensors(cfg: ModelConfig) -> list[r.TensorMap]:
  layer = "transformer.h.{i}."
  return [
      r.one("transformer.wte.weight", "token_embedder/embedding"),
      r.one("transformer.wpe.weight", "position_embedder/embedding"),
      *_norm("transformer.ln_f", "decoder_norm"),
      r.ignored("lm_head.weight"),  # tied to wte
      r.ignored(layer + "attn.bias"), r.ignored(layer + "attn.masked_bias"),  # mask buffers of old checkpoints
      *_norm(layer + "ln_1", "pre_self_attention_layer_norm"),
      *_norm(layer + "ln_2", "post_self_attention_layer_norm"),
      r.TensorMap(layer + "attn.c_attn.weight", tuple(p + "/kernel" for p in _QKV), _split_qkv_kernel,
                  _fuse_qkv_kernel),
      r.TensorMap(layer + "attn.c_attn.bias", tuple(p + "/bias" for p in _QKV), _split_qkv_bias, _fuse_qkv_bias),
      r.one(layer + "attn.c_proj.weight", "self_attention/out/kernel", _out_kernel, _out_kernel_to_hf),
      r.one(layer + "attn.c_proj.bias", "self_attention/out/bias"),
      r.one(layer + "mlp.c_fc.weight", "mlp/wi_0/kernel"),
      r.one(layer + "mlp.c_fc.bias", "mlp/wi_0/bias"),
      r.one(layer + "mlp.c_proj.weight", "mlp/wo/kernel"),
      r.one(layer + "mlp.c_proj.bias", "mlp/wo/bias"),
  ]


def gpt3_model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  r.require_hf(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), "gelu_new")
  r.require_hf(hf, "scale_attn_weights", (True,), True)
  r.require_hf(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
  r.require_hf(hf, "tie_word_embeddings", (True,), True)
  d, heads = hf["n_embd"], hf["n_head"]
  return {
      "decoder_block": "gpt3", "base_emb_dim": d, "base_num_query_heads": heads, "base_num_kv_heads": heads,
      "head_dim": d // heads, "base_num_decoder_layers": hf["n_layer"],
      # null: 4 x n_embd, as in transformers; 0 is a zero-width MLP there
      "base_mlp_dim": 4 * d if hf.get("n_inner") is None else r.count_hf(hf, "n_inner", "an MLP width"),
      "vocab_size": hf["vocab_size"], "mlp_activations": ["gelu"], "normalization_type": "layer",
      "normalization_layer_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "use_bias": True,
      "position_embedding": "learned", "max_position_embeddings": hf["n_positions"], "logits_via_embedding": True,
  }


def gpt3_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  return {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.emb_dim, "n_head": cfg.num_query_heads,
      "n_inner": cfg.mlp_dim, "n_layer": cfg.num_decoder_layers, "n_positions": cfg.max_position_embeddings,
      "vocab_size": cfg.vocab_size, "layer_norm_epsilon": cfg.normalization_layer_epsilon,
      "activation_function": "gelu_new", "tie_word_embeddings": True, "scale_attn_weights": True,
      "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
      "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
  }


register_family(Family("gpt3", ("gpt2",), ("gpt3",), gpt3_model_keys, gpt3_hf_config, gpt3_tensors,
                       reference_hf_configs={
                           "gpt3": dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                        n_positions=64)}))
