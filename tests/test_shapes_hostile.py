"""Model shapes nobody chose for the reference configs: what converts, trains and decodes, or is refused
in one line naming the keys. The wide sweeps that held (GQA ratios, windows, DSA index shapes, odd
vocabularies over the tensor axis, ...) live in tests/layers/test_shape_grids.py and the parallel tests;
this file keeps the shapes that were broken."""

from __future__ import annotations

import pytest

from MaxText import families
from MaxText.errors import ConfigError

# (reference config, its routed-expert count field, its experts-per-token field): every MoE family's HF reading.
ONE_EXPERT = [("mixtral", "num_local_experts", "num_experts_per_tok"),
              ("qwen3_moe", "num_experts", "num_experts_per_tok"),
              ("qwen3_next", "num_experts", "num_experts_per_tok"),
              ("deepseek3", "n_routed_experts", "num_experts_per_tok"),
              ("gpt_oss", "num_local_experts", "num_experts_per_tok"),
              ("llama4", "num_local_experts", "num_experts_per_tok"),
              ("gemma4-experts", "num_experts", "top_k_experts")]


@pytest.mark.parametrize("name, field, per_token", ONE_EXPERT, ids=[case[0] for case in ONE_EXPERT])
def test_a_one_expert_hf_mixture_is_refused_when_its_keys_are_read(name, field, per_token):
  """Our num_experts=1 is a dense MLP, so a one-expert HF MoE became a model without the checkpoint's router:
  the conversion failed later, at the router tensor, telling the user to check decoder_block."""
  hf = {**families.reference_hf_configs()[name], field: 1, per_token: 1}
  if name.startswith("deepseek"):
    hf.update(n_group=1, topk_group=1)
  with pytest.raises(ConfigError, match=rf"HF config {field}=1 \(a mixture of one expert\) is not supported"):
    families.family_for_hf_config(hf).model_keys(hf)


@pytest.mark.parametrize("name, dense", [("deepseek3", None), ("deepseek32", None), ("deepseek2-lite", 2)])
def test_an_all_dense_hf_deepseek_is_refused_in_its_own_fields(name, dense):
  """A 2-layer DeepSeek-V3 config.json without first_k_dense_replace takes DeepseekV3Config's 3: every layer
  dense. It was refused only by the config checks, as first_dense_layers, a key the user never wrote."""
  hf = {key: value for key, value in families.reference_hf_configs()[name].items()
        if key not in ("first_k_dense_replace",)}
  hf.update(num_hidden_layers=2, **({} if dense is None else {"first_k_dense_replace": dense}))
  with pytest.raises(ConfigError, match=rf"HF config first_k_dense_replace={dense or 3} >= num_hidden_layers=2"):
    families.family_for_hf_config(hf).model_keys(hf)
