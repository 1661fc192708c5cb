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
