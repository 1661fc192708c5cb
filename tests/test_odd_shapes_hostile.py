"""Model shapes nobody chose, per decoder family, on CPU: odd head counts and widths, one KV head, emb_dim
unlike heads x head_dim, small MLA ranks, DSA indexers with one or two heads and a top-k past the sequence,
MoE with every expert chosen, sequences of 1 or 2 tokens, windows of 1 or past the sequence, odd small
vocabularies, tensor degrees that do not divide the heads. Each trains to a finite loss on the 8 simulated
devices or is refused in one line naming its keys; where the family has an HF reference (tests/hf_families.py)
its logits equal transformers' on that shape. The wide parity grids are tests/layers/test_shape_grids.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import train_utils
from MaxText.configuration.config import Config

_slow = pytest.mark.slow

TINY: dict[str, Any] = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                          base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
                          print_config=False, dataset_type="synthetic", enable_checkpointing=False, dtype="float32")


def _losses(steps: int = 2, **overrides: Any) -> list[float]:
  losses = train_utils.losses(Config.for_testing(**{**TINY, **overrides}), steps)
  assert np.all(np.isfinite(losses)), (overrides, losses)
  return losses


@pytest.mark.parametrize("vocab", [7, pytest.param(17, marks=_slow)])
def test_a_vocabulary_smaller_than_the_default_top_k_trains(vocab: int) -> None:
  """decode_sampling_top_k's default (40) is read only by decode_sampling_strategy=topk, yet a model with fewer
  tokens than that was refused for training (and every other strategy) by that key, which the user never set."""
  _losses(vocab_size=vocab, ici_tensor_parallelism=2, sharding_tolerance=1.0)


def test_an_odd_head_width_without_rotary_embeddings_trains() -> None:
  """GPT-3's learned positions rotate nothing, yet partial_rotary_factor's default (1.0) demanded an even
  head_dim: a GPT-2 of 20 features over 4 heads (head_dim 5, valid in HF) was refused."""
  _losses(decoder_block="gpt3", position_embedding="learned", max_position_embeddings=64, base_emb_dim=20,
          base_num_query_heads=4, base_num_kv_heads=4, head_dim=5, base_mlp_dim=24, max_target_length=9,
          normalization_type="layer", use_bias=True, mlp_activations="gelu", logits_via_embedding=True,
          sharding_tolerance=1.0)


def test_an_odd_head_width_gpt2_matches_hf(tmp_path: Path) -> None:
  H = pytest.importorskip("hf_families")
  model = H.build_hf_model("gpt3", n_embd=20, n_head=4)
  ids = H.tokens(length=9)
  config = H.our_config(model, dtype="float32", max_target_length=9)
  ours = H.our_logits(config, H.our_params(model, config, tmp_path), ids)
  np.testing.assert_allclose(ours, H.hf_logits(model, ids), atol=H.FP32_ATOL, rtol=0)


def test_top_k_past_the_vocabulary_is_still_refused_where_it_is_read() -> None:
  from MaxText.errors import ConfigError
  with pytest.raises(ConfigError, match=r"decode_sampling_top_k must be between 1 and vocab_size=7, got 40"):
    Config.for_testing(**{**TINY, "vocab_size": 7, "decode_sampling_strategy": "topk"})


# Refused at config time in one line naming the keys (each was checked to be so; kept so it stays so).
REFUSED = [
    (dict(num_experts=3, num_experts_per_tok=3, ici_expert_parallelism=2, ici_fsdp_parallelism=4),
     r"num_experts \(3\) must be a multiple of the expert parallelism"),
    (dict(base_num_query_heads=5, base_num_kv_heads=2),
     r"num_query_heads \(5\) must be a multiple of num_kv_heads \(2\)"),
    (dict(head_dim=12, partial_rotary_factor=0.25), r"partial_rotary_factor must be in \(0, 1\] and rotate an even"),
    (dict(per_device_batch_size=0.125), r"global batch 1 \(per_device_batch_size 0.125 x 8 devices\)"),
    (dict(base_num_decoder_layers=1, ici_pipeline_parallelism=2, ici_fsdp_parallelism=4),
     r"num_decoder_layers \(1\) must be divisible by pipeline stages \(2\)"),
    (dict(max_target_length=7, num_vocab_tiling=3), r"num_vocab_tiling=3 must divide the 7 positions"),
    (dict(vocab_size=257, ici_tensor_parallelism=4, ici_fsdp_parallelism=2), r"not fully sharded over mesh"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_shapes_that_cannot_run_are_refused_in_one_line(overrides: dict[str, Any], message: str) -> None:
  from MaxText.errors import ConfigError
  with pytest.raises(ConfigError, match=message) as error:
    train_utils.Run(Config.for_testing(**{**TINY, **overrides}))
  assert "\n" not in str(error.value)


def _hf_parity(family: str, length: int, hf: dict[str, Any], staging: Path) -> None:
  H = pytest.importorskip("hf_families")
  model = H.build_hf_model(family, **hf)
  ids = H.tokens(length=length)
  config = H.our_config(model, dtype="float32", max_target_length=length)
  ours = H.our_logits(config, H.our_params(model, config, staging), ids)
  np.testing.assert_allclose(ours, H.hf_logits(model, ids), atol=H.CHECKER_FP32_ATOL.get(family, H.FP32_ATOL), rtol=0,
                             err_msg=f"{family} {hf} length={length}")


def _hf_training(family: str, length: int, hf: dict[str, Any], mesh: dict[str, Any]) -> None:
  H = pytest.importorskip("hf_families")
  fields = {**H.REFERENCE_CONFIGS[family], **hf}
  from MaxText import families
  keys = families.family_for_hf_config(fields).model_keys(fields)
  # Odd shapes leave tensors unsplit over the mesh: allowed, the test is about the result.
  config = Config.for_testing(**{**keys, "dataset_type": "synthetic", "enable_checkpointing": False,
                                 "per_device_batch_size": 1, "max_target_length": length, "dtype": "float32",
                                 "print_config": False, "sharding_tolerance": 1.0, **mesh})
  losses = train_utils.losses(config, 2)
  assert np.all(np.isfinite(losses)), (family, hf, mesh, losses)


T2 = {"ici_tensor_parallelism": 2, "ici_fsdp_parallelism": 4}
T4 = {"ici_tensor_parallelism": 4, "ici_fsdp_parallelism": 2}
EP = {"ici_expert_parallelism": 2, "ici_fsdp_parallelism": 4}
MLA_SMALL = dict(kv_lora_rank=3, q_lora_rank=5, qk_rope_head_dim=2, qk_nope_head_dim=3, v_head_dim=5,
                 num_attention_heads=3, num_key_value_heads=3, n_group=1, topk_group=1)


def _shape(name: str, family: str, length: int, hf: dict[str, Any], mesh: dict[str, Any], default: bool = False) -> Any:
  return pytest.param(family, length, hf, mesh, marks=() if default else (_slow,), id=name)


# (family, sequence length, HF fields over its tiny reference, our mesh): logits equal HF's on one device, and two
# training steps on the 8-device mesh give finite losses.
SHAPES = [
    _shape("llama-3heads-1kv-hd12-emb48-tp2", "llama3.1", 7,
           dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12, hidden_size=48), T2, default=True),
    _shape("llama-5heads-hd4-emb40-tp4", "llama3.1", 24, dict(num_attention_heads=5, num_key_value_heads=5, head_dim=4,
                                                                 hidden_size=40), T4),
    _shape("llama-1head-hd24-fsdp8", "llama3.1", 24, dict(num_attention_heads=1, num_key_value_heads=1, head_dim=24,
                                                            hidden_size=40), {"ici_fsdp_parallelism": 8}),
    _shape("llama-length1", "llama3.1", 1, {}, {}),
    _shape("llama-length2", "llama3.1", 2, {}, {}),
    _shape("mistral-window1-3heads", "mistral", 9, dict(sliding_window=1, num_attention_heads=3, num_key_value_heads=1,
                                                         head_dim=12, hidden_size=48), T2),
    _shape("mistral-window-past-sequence", "mistral", 13, dict(sliding_window=100), {}),
    _shape("mixtral-every-expert", "mixtral", 24, dict(num_local_experts=2, num_experts_per_tok=2), EP),
    _shape("gemma-3heads-hd12", "gemma", 24, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12), T2),
    _shape("gemma2-window1-3heads", "gemma2", 5, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12,
                                                       sliding_window=1, hidden_size=48), T2),
    _shape("gemma3-5heads-hd4-window-past", "gemma3", 11, dict(num_attention_heads=5, num_key_value_heads=1, head_dim=4,
                                                                sliding_window=100, hidden_size=40), T4),
    _shape("gemma4-3heads", "gemma4", 7, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12,
                                              global_head_dim=24), T2),
    _shape("qwen3-3heads-hd12", "qwen3", 5, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12), T2),
    _shape("deepseek3-mla-rank3-rope2", "deepseek3", 7, MLA_SMALL, T2),
    _shape("deepseek32-1-index-head-topk-past", "deepseek32", 9, dict(index_n_heads=1, index_topk=100), T2),
    _shape("deepseek32-2-index-heads-3-heads", "deepseek32", 5,
           dict(index_n_heads=2, index_head_dim=4, index_topk=3, num_attention_heads=3, num_key_value_heads=3), T2),
    _shape("deepseek32-length1", "deepseek32", 1, {}, {}),
    _shape("llama4-chunk-past-sequence-3heads", "llama4", 9, dict(num_attention_heads=3, num_key_value_heads=1,
                                                                   head_dim=12, attention_chunk_size=100), T2),
    _shape("llama4-chunk1", "llama4", 5, dict(attention_chunk_size=1), {}),
    _shape("olmo3-5heads-window-past", "olmo3", 7, dict(num_attention_heads=5, num_key_value_heads=1, head_dim=4,
                                                         sliding_window=100), T4),
    _shape("olmo2-3heads-hd12", "olmo2", 24, dict(num_attention_heads=3, num_key_value_heads=3, head_dim=12), T2),
    _shape("qwen3-next-odd-deltanet", "qwen3_next", 7, dict(linear_num_key_heads=1, linear_num_value_heads=3,
                                                             linear_key_head_dim=6, linear_value_head_dim=5,
                                                             linear_conv_kernel_dim=2, num_hidden_layers=4), T2),
]


@pytest.mark.parametrize("family, length, hf, mesh", SHAPES)
def test_odd_shapes_match_hf_and_train_on_the_mesh(family: str, length: int, hf: dict[str, Any], mesh: dict[str, Any],
                                                   tmp_path: Path) -> None:
  _hf_parity(family, length, hf, tmp_path)
  _hf_training(family, length, hf, mesh)


# (family, HF fields, max_target_length, prefill length): cached greedy decoding equals the uncached forward.
DECODES = [
    pytest.param("mistral", dict(sliding_window=1), 9, 3, id="mistral-window1"),
    pytest.param("llama4", dict(attention_chunk_size=1), 9, 3, id="llama4-chunk1"),
    pytest.param("deepseek32", dict(index_n_heads=1, index_topk=100), 9, 3, id="deepseek32-topk-past"),
    pytest.param("deepseek32", dict(index_n_heads=2, index_topk=1), 9, 3, id="deepseek32-topk1"),
    pytest.param("deepseek3", MLA_SMALL, 9, 3, id="deepseek3-mla-rank3"),
    pytest.param("gpt_oss", dict(sliding_window=1, num_local_experts=3, num_experts_per_tok=3), 9, 3, id="gpt-oss"),
    pytest.param("gpt3", dict(n_embd=20, n_head=4), 9, 3, id="gpt2-head-dim5"),
    pytest.param("llama3.1", {}, 2, 1, id="length2"),
]


@_slow
@pytest.mark.parametrize("family, hf, target, prefill", DECODES)
def test_odd_shapes_decode_like_the_uncached_forward(family: str, hf: dict[str, Any], target: int, prefill: int,
                                                     tmp_path: Path) -> None:
  H = pytest.importorskip("hf_families")
  from MaxText.inference.engine import Engine
  from tests.inference.decode_test_utils import engine_tokens, one_device_mesh, uncached_greedy
  model = H.build_hf_model(family, **hf)
  config = H.our_config(model, dtype="float32", max_target_length=target, max_prefill_predict_length=prefill)
  params = H.our_params(model, config, tmp_path)
  engine = Engine(config, num_slots=2, mesh=one_device_mesh())
  prompts = [[5, 17, 42][:prefill], [101]]
  cached = engine_tokens(engine, params, prompts, target - prefill)
  for prompt, tokens in zip(prompts, cached):
    assert tokens == uncached_greedy(engine.spec, params, prompt, target - prefill, target), (family, hf)


def test_a_per_layer_vocabulary_smaller_than_the_model_is_refused() -> None:
  """Gemma 4's per-layer embedding table has per_layer_input_vocab_size rows and every token id looks a row up:
  with fewer rows than vocab_size the ids past it read outside the table, and training gave NaN losses from the
  first step (transformers fails on such an id)."""
  from MaxText import families
  from MaxText.errors import ConfigError
  fields = families.reference_hf_configs()["gemma4"]
  keys = families.family_for_hf_config(fields).model_keys(fields)
  with pytest.raises(ConfigError, match=r"per_layer_input_vocab_size \(7\) must be 0 or at least vocab_size \(128\)"):
    Config.for_testing(**{**keys, "per_layer_input_vocab_size": 7, "print_config": False})
