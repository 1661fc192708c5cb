"""RoPE frequency scaling against transformers' own RoPE initialisers (the outside truth): YaRN as
Qwen3 (long context) and GPT-OSS set it, linear (Gemma 3), llama3 (Llama 3.1)."""

import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.layers.embeddings import rope_attention_scale, rope_inverse_frequencies

transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 64
CASES = {
    "yarn-qwen3": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
                   dict(rope_max_timescale=1e6, rope_scaling_factor=4.0, rope_original_max_position=32768)),
    "yarn-gpt-oss": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
                     dict(rope_max_timescale=150000.0, rope_scaling_factor=32.0, rope_original_max_position=4096,
                          rope_yarn_truncate=False)),
    "yarn-attention-factor": ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "attention_factor": 1.5,
                               "original_max_position_embeddings": 2048},
                              dict(rope_max_timescale=1e4, rope_scaling_factor=8.0, rope_original_max_position=2048,
                                   rope_attention_factor=1.5)),
    "linear": ({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
               dict(rope_max_timescale=1e6, rope_scaling_factor=8.0)),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               dict(rope_max_timescale=500000.0, rope_scaling_factor=8.0, rope_original_max_position=8192)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_attention_factor_match_transformers(name):
  params, ours = CASES[name]
  hf = transformers.Qwen3Config(head_dim=HEAD_DIM, hidden_size=256, num_attention_heads=4, rope_parameters=params,
                                max_position_embeddings=131072)
  want_freq, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
  cfg = Config.for_testing(head_dim=HEAD_DIM, base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4,
                           rope_type=params["rope_type"], print_config=False, **ours).model
  np.testing.assert_allclose(rope_inverse_frequencies(cfg.rope, cfg.head_dim), want_freq.numpy(), rtol=1e-6)
  assert rope_attention_scale(cfg.rope) == pytest.approx(want_scale)
  # Scaling changed something: the plain frequencies differ.
  plain = Config.for_testing(head_dim=HEAD_DIM, base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4,
                             rope_max_timescale=params["rope_theta"], print_config=False).model
  assert not np.allclose(rope_inverse_frequencies(plain.rope, plain.head_dim), want_freq.numpy())


def test_bad_yarn_settings_are_one_line_errors():
  from MaxText.errors import ConfigError
  with pytest.raises(ConfigError, match="rope_type=yarn needs rope_scaling_factor >= 1"):
    Config.for_testing(rope_type="yarn", rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=2.0, print_config=False)
