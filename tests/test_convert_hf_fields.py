"""config.json fields the converters read by a default (transformers' own): num_key_value_heads null and Gemma 4's
layer_types left out, checked against transformers' config classes."""

from __future__ import annotations

import pytest

from MaxText import families
from MaxText.convert import engine
from MaxText.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
GEMMA4 = families.reference_hf_configs()["gemma4"]


def _keys(fields: dict) -> dict:
  return engine.hf_model_keys(families.family_for_hf_config(fields), fields)


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "olmo2", "mistral", "gemma3", "qwen3_moe"])
def test_null_kv_heads_read_as_the_query_heads(name: str) -> None:
  """As transformers' Llama, Qwen3 and OLMo 2 read null (Mistral, Gemma 3 and Qwen3-MoE refuse it there)."""
  fields = {**families.reference_hf_configs()[name], "num_key_value_heads": None}
  assert _keys(fields)["base_num_kv_heads"] == fields["num_attention_heads"]
  if name in ("llama3.1", "qwen3", "olmo2"):
    assert transformers.AutoConfig.for_model(**fields).num_key_value_heads == fields["num_attention_heads"]


@pytest.mark.parametrize("value", [0, -1, 2.5, "2", True])
def test_a_kv_head_count_that_is_not_a_positive_whole_number_is_one_line(value: object) -> None:
  """0 was read as unset (the query heads); the rest failed later on other keys' names."""
  with pytest.raises(ConfigError, match=rf"^HF config.json num_key_value_heads={value!r} is not a positive whole"):
    _keys({**families.reference_hf_configs()["llama3.1"], "num_key_value_heads": value})


def _expanded(keys: dict) -> list[str]:
  pattern = keys["attention_layer_pattern"]
  return ["sliding_attention" if pattern[i % len(pattern)] == "local" else "full_attention"
          for i in range(keys["base_num_decoder_layers"])]


def test_gemma4_without_layer_types_takes_transformers_default_kinds() -> None:
  """12 layers sharing the last 4: the default kinds (5 sliding : 1 full) leave each kind a layer to share from."""
  fields = {k: v for k, v in GEMMA4.items() if k != "layer_types"} | {"num_hidden_layers": 12,
                                                                      "num_kv_shared_layers": 4}
  keys = _keys(fields)
  theirs = transformers.AutoConfig.for_model(**fields)
  assert _expanded(keys) == theirs.layer_types and keys["num_kv_shared_layers"] == 4
  theirs.kv_sharing_modes  # transformers accepts the sharing too


def test_gemma4_kv_sharing_without_layer_types_names_the_missing_field() -> None:
  """The default kinds leave the shared full-attention layer no source (transformers refuses it); was: "lower
  num_kv_shared_layers", a key of ours, advice that converts another model than the checkpoint's."""
  fields = {k: v for k, v in GEMMA4.items() if k != "layer_types"}
  with pytest.raises(ValueError, match="layer types producing a cache"):
    transformers.AutoConfig.for_model(**fields).kv_sharing_modes
  with pytest.raises(ConfigError) as e:
    _keys(fields)
  assert str(e.value) == ("HF config has no layer_types, so transformers' default kinds apply (5 sliding : 1 full, the "
                          "last full), and num_kv_shared_layers=3 leaves the full-attention layers among the last 3 no "
                          "earlier full-attention layer to share keys and values from; give the checkpoint's "
                          "layer_types in config.json")


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], "sliding_attention",
                                         ["sliding_attention"] * 5 + ["chunked_attention"]],
                         ids=["short", "string", "unknown-kind"])
def test_gemma4_layer_types_that_do_not_describe_the_layers_are_one_line(layer_types: object) -> None:
  """Were cycled, read letter by letter or read as full attention, then failed on a tensor's shape."""
  with pytest.raises(ConfigError, match=r"^HF config layer_types=.* is not a list of num_hidden_layers=6 entries"):
    _keys({**GEMMA4, "layer_types": layer_types})
