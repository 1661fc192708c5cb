"""The families' config.json readers on values a `value or default` read as "unset": a 0, a null, a negative
where transformers computes with the value as given (every key masked under a window of 0, a zero-width latent,
a division by zero) or fails. Each is one line naming the field (was: converted as another model: a Gemma 2 /
3, GPT-OSS or OLMo 3 `sliding_window: 0` or null as every layer global, a Llama 4 `attention_chunk_size: 0` as
no chunking, a DeepSeek `q_lora_rank: 0` as direct queries, `n_group: 0` as one group, a soft cap of 0 as none,
...), or is read as transformers reads it (Llama 4 without attention_chunk_size: its 8192-token chunks)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hf_families as H
from MaxText import families
from MaxText.configuration.config import Config
from MaxText.convert import engine
from MaxText.errors import ConfigError

_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16}


def _raw(reference: str, **fields: Any) -> dict[str, Any]:
  """A reference config with `fields` replaced; a None stays, as an explicit null."""
  return {**copy.deepcopy(dict(H.REFERENCE_CONFIGS[reference])), **fields}


def _model_keys(raw: dict[str, Any]) -> dict[str, Any]:
  return engine.hf_model_keys(families.family_for_hf_config(raw), raw)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # sliding layers with no window transformers can run: 0 masks every key, null fails
    "gemma2-sliding_window-0": (_raw("gemma2", sliding_window=0), "sliding_window=0"),
    "gemma2-sliding_window-negative": (_raw("gemma2", sliding_window=-1), "sliding_window=-1"),
    "gemma2-sliding_window-null": (_raw("gemma2", sliding_window=None), "sliding_window=None"),
    "gemma3-sliding_window-0": (_raw("gemma3", sliding_window=0), "sliding_window=0"),
    "gpt_oss-sliding_window-0": (_raw("gpt_oss", sliding_window=0), "sliding_window=0"),
    "gpt_oss-sliding_window-null": (_raw("gpt_oss", sliding_window=None), "sliding_window=None"),
    "olmo3-sliding_window-0": (_raw("olmo3", sliding_window=0), "sliding_window=0"),
    "olmo3-sliding_window-null": (_raw("olmo3", sliding_window=None), "sliding_window=None"),
    "gemma4-sliding_window-0": (_raw("gemma4", sliding_window=0), "sliding_window=0"),
    "gemma4-sliding_window-null": (_raw("gemma4", sliding_window=None), "sliding_window=None"),
    # Llama 4: a chunk of 0 and periods of 0 (transformers divides by them)
    "llama4-attention_chunk_size-0": (_raw("llama4", attention_chunk_size=0), "attention_chunk_size=0"),
    "llama4-interleave_moe_layer_step-0": (_raw("llama4", interleave_moe_layer_step=0), "interleave_moe_layer_step=0"),
    "llama4-no_rope_layer_interval-0": (_raw("llama4", no_rope_layer_interval=0), "no_rope_layer_interval=0"),
    # Gemma: a soft cap of 0 divides by 0; a layer period of 0
    "gemma2-attn_logit_softcapping-0": (_raw("gemma2", attn_logit_softcapping=0.0), "attn_logit_softcapping=0.0"),
    "gemma2-final_logit_softcapping-0": (_raw("gemma2", final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    "gemma4-final_logit_softcapping-0": (_raw("gemma4", final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    "gemma3-sliding_window_pattern-0": ({k: v for k, v in _raw("gemma3", sliding_window_pattern=0).items()
                                         if k != "layer_types"}, "sliding_window_pattern=0"),
    "gemma4-vocab_size_per_layer_input-0": (_raw("gemma4", vocab_size_per_layer_input=0),
                                            "vocab_size_per_layer_input=0"),
    # ... a per-layer table of fewer rows than the vocabulary (an id past it reads no row: NaN in our model, an
    # index error in transformers); layers sharing keys and values null or negative (transformers subtracts it)
    "gemma4-vocab_size_per_layer_input-under-vocab": (
        _raw("gemma4", vocab_size_per_layer_input=_raw("gemma4")["vocab_size"] - 1),
        f"vocab_size_per_layer_input={_raw('gemma4')['vocab_size'] - 1}"),
    # layer_types empty, short or of another kind: transformers keeps it as given and refuses it (was: [] read as
    # absent, a short list's pattern repeated over the layers, an unknown kind read as full attention)
    "gemma2-layer_types-empty": (_raw("gemma2", layer_types=[]), "layer_types=[]"),
    "gemma3-layer_types-empty": (_raw("gemma3", layer_types=[]), "layer_types=[]"),
    "gpt_oss-layer_types-short": (_raw("gpt_oss", layer_types=["sliding_attention"]), "layer_types=['sliding"),
    "olmo3-layer_types-empty": (_raw("olmo3", layer_types=[]), "layer_types=[]"),
    "llama4-layer_types-empty": (_raw("llama4", layer_types=[]), "layer_types=[]"),
    "qwen3_next-layer_types-empty": (_raw("qwen3_next", layer_types=[]), "layer_types=[]"),
    "gemma2-layer_types-other-kind": (_raw("gemma2", layer_types=["linear_attention"] * _raw("gemma2")[
        "num_hidden_layers"]), "layer_types=['linear"),
    "gemma4-num_global_key_value_heads-0": (_raw("gemma4", attention_k_eq_v=True, num_global_key_value_heads=0),
                                            "num_global_key_value_heads=0"),
    "gemma4-num_kv_shared_layers-null": (_raw("gemma4", num_kv_shared_layers=None), "num_kv_shared_layers=None"),
    "gemma4-num_kv_shared_layers-negative": (_raw("gemma4", num_kv_shared_layers=-1), "num_kv_shared_layers=-1"),
    # YaRN's attention factor scales cos and sin as given
    "yarn-attention_factor-0": (_raw("llama2-tied", rope_parameters={**_YARN, "attention_factor": 0.0}),
                                "rope_parameters attention_factor=0.0"),
    # GPT-2: n_inner 0 is a zero-width MLP (null is 4 x n_embd)
    "gpt2-n_inner-0": (_raw("gpt3", n_inner=0), "n_inner=0"),
    # DeepSeek's MLA: a query latent of rank 0 is zero queries (null: direct queries), a key/value latent of 0
    "deepseek3-q_lora_rank-0": (_raw("deepseek3", q_lora_rank=0), "q_lora_rank=0"),
    "deepseek3-kv_lora_rank-0": (_raw("deepseek3", kv_lora_rank=0), "kv_lora_rank=0"),
    "deepseek3-qk_rope_head_dim-odd": (_raw("deepseek3", qk_rope_head_dim=3), "qk_rope_head_dim=3"),
    # ... its expert groups: 0 or null divides by zero, a top-k of 0 groups drops every expert
    "deepseek3-n_group-0": (_raw("deepseek3", n_group=0), "n_group=0"),
    "deepseek3-n_group-null": (_raw("deepseek3", n_group=None), "n_group=None"),
    "deepseek3-topk_group-0": (_raw("deepseek3", topk_group=0), "topk_group=0"),
    "deepseek3-topk_group-over-n_group": (_raw("deepseek3", topk_group=5), "topk_group=5"),
    "deepseek3-n_group-not-dividing": (_raw("deepseek3", n_group=3, topk_group=1), "n_group=3"),
    "deepseek2-n_group-0": (_raw("deepseek2-grouped", n_group=0), "n_group=0"),
    # ... absent: DeepseekV2Config's default is null, which group_limited_greedy cannot split by (was read as 1 group)
    "deepseek2-n_group-absent": ({k: v for k, v in _raw("deepseek2-grouped").items() if k != "n_group"},
                                 "n_group=None (absent)"),
    "deepseek2-topk_group-absent": ({k: v for k, v in _raw("deepseek2-grouped").items() if k != "topk_group"},
                                    "topk_group=None (absent)"),
    # ... its dense prefix (null fails in transformers), its shared expert count and widths
    "deepseek3-first_k_dense_replace-null": (_raw("deepseek3", first_k_dense_replace=None),
                                             "first_k_dense_replace=None"),
    "deepseek3-first_k_dense_replace-negative": (_raw("deepseek3", first_k_dense_replace=-1),
                                                 "first_k_dense_replace=-1"),
    "deepseek3-n_shared_experts-null": (_raw("deepseek3", n_shared_experts=None), "n_shared_experts=None"),
    "deepseek3-moe_intermediate_size-0": (_raw("deepseek3", moe_intermediate_size=0), "moe_intermediate_size=0"),
    # MoE counts: no experts, a top-k of 0 (every expert dropped) or over the experts (transformers fails)
    "deepseek3-n_routed_experts-0": (_raw("deepseek3", n_routed_experts=0), "n_routed_experts=0"),
    "mixtral-num_experts_per_tok-0": (_raw("mixtral", num_experts_per_tok=0), "num_experts_per_tok=0"),
    "mixtral-num_experts_per_tok-over": (_raw("mixtral", num_experts_per_tok=9), "num_experts_per_tok=9"),
    "qwen3_moe-num_experts_per_tok-0": (_raw("qwen3_moe", num_experts_per_tok=0), "num_experts_per_tok=0"),
    "qwen3_moe-moe_intermediate_size-0": (_raw("qwen3_moe", moe_intermediate_size=0), "moe_intermediate_size=0"),
    "gpt_oss-num_experts_per_tok-over": (_raw("gpt_oss", num_experts_per_tok=5), "num_experts_per_tok=5"),
    "deepseek3-num_experts_per_tok-0": (_raw("deepseek3", num_experts_per_tok=0), "num_experts_per_tok=0"),
    "gemma4-top_k_experts-over": (_raw("gemma4-experts", top_k_experts=99), "top_k_experts=99"),
    # Qwen3-Next: a layer period of 0 where it makes the layer kinds, a rotated fraction of 0 or over 1
    "qwen3_next-full_attention_interval-0": ({k: v for k, v in _raw("qwen3_next", full_attention_interval=0).items()
                                              if k != "layer_types"}, "full_attention_interval=0"),
    "qwen3_next-partial_rotary_factor-0": (_raw("qwen3_next", rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.0}), "partial_rotary_factor=0.0"),
    "qwen3_next-partial_rotary_factor-over-1": (_raw("qwen3_next", rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.5}), "partial_rotary_factor=1.5"),
    "qwen3_next-shared_expert_intermediate_size-null": (_raw("qwen3_next", shared_expert_intermediate_size=None),
                                                        "shared_expert_intermediate_size=None"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_value_transformers_cannot_run_as_written_is_one_line_naming_the_field(name: str) -> None:
  raw, named = REFUSED[name]
  with pytest.raises(ConfigError) as raised:
    _model_keys(raw)
  assert f"HF config {named}" in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_sliding_window_zero_in_transformers_masks_every_key() -> None:
  """What the refusals stand on: transformers computes with a window of 0 and cannot run it."""
  model = H.build_hf_model("gemma2", sliding_window=0)
  with pytest.raises(Exception):
    H.hf_logits(model, H.tokens(length=8))


def _max_logit_error(raw: dict[str, Any], tmp_path: Path) -> float:
  fields = copy.deepcopy(raw)
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  H.torch.manual_seed(0)
  model = H.randomize(H.transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), 0)
  ours = Config.for_testing(**{**_model_keys(raw), "max_target_length": H.LENGTH, "dtype": "float32",
                               "print_config": False})
  token_ids = H.tokens()
  return float(np.abs(H.our_logits(ours, H.our_params(model, ours, tmp_path), token_ids)
                      - H.hf_logits(model, token_ids)).max())


def test_a_window_no_layer_slides_in_is_not_read(tmp_path: Path) -> None:
  """Gemma 2 with only full-attention layers: transformers never uses the window, so a 0 there converts."""
  raw = _raw("gemma2", sliding_window=0)
  raw["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
  assert _model_keys(raw)["attention_layer_pattern"] == ["global"]
  assert _max_logit_error(raw, tmp_path) < H.FP32_ATOL


def test_llama4_without_attention_chunk_size_chunks_as_transformers_does() -> None:
  """Llama4TextConfig's default chunk is 8192: its RoPE layers are chunked (was: every layer global)."""
  raw = {k: v for k, v in _raw("llama4").items() if k != "attention_chunk_size"}
  fields = copy.deepcopy(raw)
  hf = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  keys = _model_keys(raw)
  kinds = keys["attention_layer_pattern"]
  assert ["chunked_attention" if kinds[i % len(kinds)] == "chunked" else "full_attention"
          for i in range(raw["num_hidden_layers"])] == list(hf.layer_types)
  assert keys["attention_chunk_size"] == hf.attention_chunk_size == 8192


def test_null_q_lora_rank_and_a_zero_shared_width_are_still_read() -> None:
  """null is DeepSeek's direct query projection; Qwen3-Next's shared expert of width 0 adds nothing."""
  assert _model_keys(_raw("deepseek3", q_lora_rank=None))["q_lora_rank"] == 0
  keys = _model_keys(_raw("qwen3_next", shared_expert_intermediate_size=0))
  assert keys["shared_experts"] == 0 and not keys["shared_expert_gate"]
