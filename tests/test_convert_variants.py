"""config.json variants that published checkpoints and transformers accept but the families' reference configs
(tests/hf_families.py) leave out: each converts to the model transformers builds from the same config.json
(float32 logits of a tiny random model) or is refused naming the field.

transformers mutates the dicts a config is built from, so HF gets a deep copy and the converter the config.json
as written."""

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

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
_GPT_OSS_YARN = {k: v for k, v in H.REFERENCE_CONFIGS["gpt_oss"]["rope_parameters"].items() if k != "rope_theta"}
_DEEPSEEK_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def _variant(reference: str, **fields: Any) -> dict[str, Any]:
  """A reference config with `fields` replaced (None: removed)."""
  merged = {**H.REFERENCE_CONFIGS[reference], **fields}
  return {k: v for k, v in merged.items() if v is not None}


def _hf_model(raw: dict[str, Any]) -> Any:
  fields = copy.deepcopy(raw)
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  H.torch.manual_seed(0)
  model = H.transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  return H.randomize(model.eval(), 0)


def _model_keys(raw: dict[str, Any]) -> dict[str, Any]:
  return engine.hf_model_keys(families.family_for_hf_config(raw), raw)


def _max_logit_error(raw: dict[str, Any], tmp_path: Path) -> float:
  model = _hf_model(raw)
  config = Config.for_testing(**{**_model_keys(raw), "max_target_length": H.LENGTH, "dtype": "float32",
                                 "print_config": False})
  token_ids = H.tokens()
  ours = H.our_logits(config, H.our_params(model, config, tmp_path / "staging"), token_ids)
  return float(np.abs(ours - H.hf_logits(model, token_ids)).max())


CONVERTS = {
    # transformers takes rope_scaling over rope_parameters (a transformers 5 config.json with YaRN added the old way)
    "rope_scaling-over-rope_parameters": _variant("qwen3", rope_theta=None, rope_scaling=_YARN,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # ... and a top-level original_max_position_embeddings over the one inside them
    "top-level-original_max_position_embeddings": _variant(
        "llama2-tied", original_max_position_embeddings=16,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    # YaRN's mscale pair sets the attention factor (their ratio) outside DeepSeek too
    "yarn-mscale": _variant("llama2-tied", rope_scaling={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}),
    # a rope_scaling beside layer-typed rope_parameters scales the full-attention layers
    "olmo3-nested+rope_scaling": _variant("olmo3", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "gemma3-nested+rope_scaling": _variant("gemma3", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # no rope_theta anywhere: Llama 4's own default base, 500000
    "llama4-no-rope_theta": _variant("llama4", rope_parameters=None),
    # Gemma 1's released hidden_act "gelu", which transformers runs as the tanh GELU
    "gemma-hidden_act-gelu": _variant("gemma", hidden_act="gelu"),
    # Llama's plain RoPE rotates every dimension whatever partial_rotary_factor says
    "llama-partial_rotary_factor-plain-rope": _variant("llama2-tied", partial_rotary_factor=0.5),
    # GPT-OSS: the old rope_scaling with YaRN's mscale pair and a top-level original context ...
    "gpt_oss-rope_scaling-mscale": _variant("gpt_oss", rope_parameters=None, rope_theta=10_000.0,
                                            original_max_position_embeddings=64,
                                            rope_scaling={**_GPT_OSS_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}),
    # ... and no RoPE, window or layer kinds at all: GptOssConfig's YaRN, 128-token window, alternating layers
    "gpt_oss-defaults": _variant("gpt_oss", rope_parameters=None, sliding_window=None, swiglu_limit=None),
    # DeepSeek: the old rope_scaling ("type") with a top-level original context, and mscale_all_dim alone
    "deepseek3-rope_scaling": _variant("deepseek3", rope_parameters=None, rope_theta=10_000.0,
                                       original_max_position_embeddings=16, rope_scaling=_DEEPSEEK_YARN),
    "deepseek3-mscale_all_dim-only": _variant("deepseek3", rope_parameters={
        k: v for k, v in H.REFERENCE_CONFIGS["deepseek3"]["rope_parameters"].items() if k != "mscale"}),
    "deepseek32-rope_scaling": _variant("deepseek32", rope_parameters=None, rope_theta=10_000.0,
                                        rope_scaling=_DEEPSEEK_YARN),
    # Gemma 4 without rope_parameters: Gemma4TextConfig's proportional RoPE (a rope_theta is not read)
    "gemma4-no-rope_parameters": _variant("gemma4", rope_parameters=None, rope_theta=20_000.0),
    # ... without hidden_size_per_layer_input: its 256-wide per-layer inputs
    "gemma4-no-hidden_size_per_layer_input": _variant("gemma4", hidden_size_per_layer_input=None),
    # ... without layer_types: five sliding layers to one full
    "gemma4-no-layer_types": _variant("gemma4", layer_types=None, num_kv_shared_layers=None),
}


@pytest.mark.parametrize("name", CONVERTS)
def test_variant_converts_to_hfs_model(name: str, tmp_path: Path) -> None:
  assert _max_logit_error(CONVERTS[name], tmp_path) < H.FP32_ATOL


REFUSED = {
    # transformers' Gemma 3 attention applies no soft cap: converting it would add one
    "gemma3-attn_logit_softcapping": (_variant("gemma3", attn_logit_softcapping=2.0), "attn_logit_softcapping"),
    # transformers 5 gives OLMo 3's sliding layers base 500000 when only rope_theta is written
    "olmo3-legacy-rope_theta": (_variant("olmo3", rope_parameters=None, rope_theta=20_000.0), "rope_theta"),
    "dynamic": (_variant("llama2-tied", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    "longrope": (_variant("llama2-tied", rope_parameters={
        "rope_type": "longrope", "rope_theta": 10_000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 16}), "rope_parameters"),
    "llama-gelu": (_variant("llama2-tied", hidden_act="gelu"), "hidden_act"),
    "gemma2-exact-gelu": (_variant("gemma2", hidden_activation="gelu"), "hidden_activation"),
    # a scaled RoPE with partial_rotary_factor < 1: transformers' Llama fails on it (a shape error)
    "llama3-partial_rotary_factor": (_variant("llama3.1", partial_rotary_factor=0.5), "partial_rotary_factor"),
    "yarn-partial_rotary_factor": (_variant("llama2-tied", rope_scaling={**_YARN, "partial_rotary_factor": 0.5}),
                                   "partial_rotary_factor"),
    "linear-partial_rotary_factor": (_variant("llama2-tied", partial_rotary_factor=0.5,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
                                     "partial_rotary_factor"),
    # transformers' MLA scales the softmax by mscale_all_dim under any scaled RoPE, ours only under YaRN
    "deepseek3-linear-mscale_all_dim": (_variant("deepseek3", rope_parameters={
        "rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0, "mscale_all_dim": 1.0}), "mscale_all_dim"),
    # transformers' Gemma 4 takes rope_scaling for its rope_parameters and fails on RoPE not by layer type
    "gemma4-rope_scaling": (_variant("gemma4", rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    "gemma4-flat-rope_parameters": (_variant("gemma4", rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                                    "rope_parameters"),
    "gemma4-yarn": (_variant("gemma4", rope_parameters={
        "full_attention": {**_YARN, "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default"}}), "rope_type"),
    "gpt_oss-attention_bias-false": (_variant("gpt_oss", attention_bias=False), "attention_bias"),
    "deepseek3-attention_bias": (_variant("deepseek3", attention_bias=True), "attention_bias"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_variant_is_refused_naming_the_field(name: str) -> None:
  raw, field = REFUSED[name]
  with pytest.raises(ConfigError, match=field):
    _model_keys(raw)


def test_olmo3_legacy_rope_theta_refused_only_where_transformers_disagrees(tmp_path: Path) -> None:
  """With the default base the old form means one model under every reading."""
  raw = _variant("olmo3", rope_parameters=None, rope_theta=500_000.0)
  assert _max_logit_error(raw, tmp_path) < H.FP32_ATOL


def test_gemma3_with_an_attention_soft_cap_is_not_exported() -> None:
  config = Config.for_testing(**{**_model_keys(dict(H.REFERENCE_CONFIGS["gemma3"])), "attn_logits_soft_cap": 2.0,
                                 "print_config": False})
  with pytest.raises(ConfigError, match="attn_logits_soft_cap"):
    families.family_for_decoder_block("gemma3").hf_config(config.model)


@pytest.mark.parametrize("reference", ["qwen3_next", "qwen3_5"])
def test_hybrid_rope_scaling_and_partial_rotary_default_read_as_transformers_does(reference: str) -> None:
  """Qwen3-Next / Qwen3.5 (keys only: their models compile slowly): a legacy rope_scaling is what transformers
  runs, so YaRN there is refused, not dropped; a config without partial_rotary_factor rotates a quarter."""
  scaled = _variant(reference, rope_parameters=None, rope_theta=10_000.0, rope_scaling=_YARN)
  fields = copy.deepcopy(scaled)
  assert H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).rope_parameters["rope_type"] == "yarn"
  with pytest.raises(ConfigError, match="rope_scaling"):
    _model_keys(scaled)
  plain = _variant(reference, rope_parameters=None, rope_theta=10_000.0)
  fields = copy.deepcopy(plain)
  hf_fraction = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).rope_parameters[
      "partial_rotary_factor"]
  assert _model_keys(plain)["partial_rotary_factor"] == hf_fraction == 0.25


@pytest.mark.parametrize("reference", [n for n, c in H.REFERENCE_CONFIGS.items() if "num_key_value_heads" in c])
def test_absent_num_key_value_heads_read_as_transformers_does(reference: str) -> None:
  """Without num_key_value_heads transformers takes the query heads or its class's fixed default: we read the
  same count, or refuse naming the field where that count does not divide the query heads (no model it can run)."""
  raw = _variant(reference, num_key_value_heads=None)
  fields = copy.deepcopy(raw)
  hf_config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  hf_config.allow_global_per_layer_attribute_access = True  # Gemma 4's sliding layers' count
  heads, hf_kv = raw["num_attention_heads"], hf_config.num_key_value_heads
  if heads % hf_kv:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
      _model_keys(raw)
  else:
    assert _model_keys(raw)["base_num_kv_heads"] == hf_kv
