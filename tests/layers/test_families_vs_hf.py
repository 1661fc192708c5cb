"""Each dense family equals Hugging Face transformers (CPU torch) on a tiny random model whose
distinctive features are on (see tests/hf_families.py), scanned and unrolled, in float32 and
bfloat16. The parameters go through the converter's tensor tables (MaxText/convert)."""

from pathlib import Path

import numpy as np
import pytest

import hf_families as H

# float32: |logits| <= 8 here and a forward pass is a few hundred roundings of relative size
# 6e-8 that mostly cancel; the two implementations order their sums differently, so about
# 1e-5 separates them (observed: <= 5e-6). A missing feature moves the logits by >= 0.3.
FP32_ATOL = H.FP32_ATOL
# bf16, MoE: a token whose logits moved this much had its experts changed by rounding.
FLIP = 0.25


@pytest.fixture(scope="module")
def staging(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("staging")


# Qwen3-Next's and Qwen3.5's chunked DeltaNet scans compile for tens of seconds on CPU: their cases run under
# -m slow (tests/test_qwen3_5.py checks Qwen3.5's own tensor layout and RoPE in the default run).
HEAVY = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
FAMILY_CASES = [pytest.param(f, marks=pytest.mark.slow) if f in HEAVY else f for f in H.FAMILIES]


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_float32_logits_match_hf_scanned_and_unrolled(family, staging):
  model = H.build_hf_model(family)
  token_ids = H.tokens()
  expected = H.hf_logits(model, token_ids)
  for scan_layers in (True, False):
    config = H.our_config(model, dtype="float32", scan_layers=scan_layers)
    params = H.our_params(model, config, staging / f"{family}-{scan_layers}")
    atol = H.DELTANET_FP32_ATOL if family in HEAVY else FP32_ATOL
    np.testing.assert_allclose(H.our_logits(config, params, token_ids), expected, atol=atol, rtol=0,
                               err_msg=f"{family} scan_layers={scan_layers}")


# Each distinctive feature, switched off on our side, must break the match: the test above
# would catch a family that silently ignored it.
_slow = pytest.mark.slow
FEATURE_OFF = [
    ("llama3.1", {"rope_type": "default"}),
    ("mistral", {"attention_layer_pattern": ["global"]}),
    ("gemma", {"normalization_type": "rms"}),
    ("gemma2", {"attn_logits_soft_cap": 0.0}),
    ("gemma2", {"attention_layer_pattern": ["global"]}),
    ("qwen3_moe-unnormalised", {"norm_topk_prob": True}),
    ("gemma3", {"rope_local_max_timescale": 0.0}),
    ("gemma4", {"use_v_norm": False}),
    pytest.param("gemma4-experts", {"num_experts_per_tok": 1}, marks=_slow),
    ("qwen3-yarn", {"rope_attention_factor": 1.0}),
    ("llama4", {"attention_layer_pattern": ["global"]}),
    ("llama4", {"rope_layer_pattern": ["rope"]}),
    ("llama4", {"attn_temperature_floor_scale": 0.0}),
    ("llama4", {"moe_router_scales_input": False}),
    pytest.param("llama4", {"use_qk_l2_norm": False}, marks=_slow),
    pytest.param("llama4", {"rope_interleaved": False}, marks=_slow),
    ("deepseek3", {"moe_topk_groups": 4}),
    ("deepseek3", {"moe_group_score": "max"}),
    ("deepseek3", {"routed_scaling_factor": 1.0}),
    ("deepseek3", {"rope_yarn_mscale_all_dim": 0.0}),
    ("deepseek3", {"moe_score_function": "softmax"}),
    ("deepseek3-plain", {"rope_interleaved": True}),
    ("deepseek2-grouped", {"moe_topk_groups": 4}),
    ("gpt_oss", {"attention_sinks": False}),
    ("gpt_oss", {"swiglu_limit": 0.0}),
    ("gpt_oss", {"use_bias": False}),
    pytest.param("gpt_oss", {"swiglu_alpha": 1.0}, marks=_slow),
    pytest.param("gpt_oss", {"rope_yarn_truncate": True}, marks=_slow),
    pytest.param("gpt_oss", {"attention_layer_pattern": ["global"]}, marks=_slow),
    pytest.param("gemma3", {"rope_type": "default"}, marks=_slow),
    pytest.param("gemma", {"scale_embedding": False}, marks=_slow),
    pytest.param("gemma2", {"final_logits_soft_cap": 0.0}, marks=_slow),
    pytest.param("gemma2", {"attention_layer_pattern": ["local"]}, marks=_slow),
    pytest.param("gemma2", {"query_pre_attn_scalar": 0.0}, marks=_slow),
    pytest.param("gpt3", {"normalization_layer_epsilon": 0.5}, marks=_slow),
    pytest.param("gemma4", {"rope_type": "default"}, marks=_slow),
    pytest.param("gemma4", {"rope_local_max_timescale": 0.0}, marks=_slow),
    pytest.param("gemma4", {"final_logits_soft_cap": 0.0}, marks=_slow),
    pytest.param("qwen3_5", {"partial_rotary_factor": 1.0}, marks=_slow),  # M-RoPE on text: a quarter rotated
]


def _feature_id(case) -> str:
  family, off = case.values if hasattr(case, "values") else case
  return f"{family}-{next(iter(off))}={next(iter(off.values()))}"


@pytest.mark.parametrize("family, off", FEATURE_OFF, ids=[_feature_id(c) for c in FEATURE_OFF])
def test_switching_a_feature_off_breaks_the_match(family, off, staging):
  model = H.build_hf_model(family)
  token_ids = H.tokens()
  config = H.our_config(model, dtype="float32", **off)
  params = H.our_params(model, config, staging / f"off-{family}-{next(iter(off))}")
  assert np.abs(H.our_logits(config, params, token_ids) - H.hf_logits(model, token_ids)).max() > 100 * FP32_ATOL


def _rms(x: np.ndarray) -> float:
  return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_bfloat16_error_is_no_worse_than_hf_bfloat16(family, staging):
  """bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%), so logits of size ~5 move
  by a few hundredths whoever computes them, and the two implementations round at different
  points (HF rounds RoPE tables and norm outputs to bf16; we keep those in float32). Neither
  result is "the" bf16 answer, so both are compared with the float32 reference on the same
  bf16-rounded weights: our error may exceed HF's own bf16 error by at most 50% (RMS) and 2x
  (max). A real bug (a wrong norm, mask or scale) moves logits by >= 0.3, far outside this."""
  model = H.round_to_bfloat16(H.build_hf_model(family))
  token_ids = H.tokens()
  reference = H.hf_logits(model, token_ids)
  hf_bf16 = H.hf_logits(model.to(H.torch.bfloat16), token_ids)
  model = model.float()
  config = H.our_config(model, dtype="bfloat16")
  ours = H.our_logits(config, H.our_params(model, config, staging / f"bf16-{family}"), token_ids)
  ours_error, hf_error = ours - reference, hf_bf16 - reference
  agree_ours, agree_hf = ours.argmax(-1) == reference.argmax(-1), hf_bf16.argmax(-1) == reference.argmax(-1)
  if config.model.moe.num_experts > 1:
    # With many experts, near-tied router scores are common in a tiny random model: bf16
    # rounding flips a token's expert on one side or the other (an O(1) move of that token's
    # logits, seen on both sides). Flips may not be more frequent than HF's own (+1); the
    # bounds below then apply to the tokens neither side flipped.
    # A sparse-attention model (index_topk) adds a second discrete choice per layer, its top-k of
    # positions, which near ties flip the same way: its allowance is half HF's own count more.
    flipped_ours, flipped_hf = (np.abs(e).max(-1) > FLIP for e in (ours_error, hf_error))
    slack = 1 + (flipped_hf.sum() // 2 if config.model.mla.index_topk > 0 else 0)
    assert flipped_ours.sum() <= flipped_hf.sum() + slack, (flipped_ours.sum(), flipped_hf.sum())
    kept = ~(flipped_ours | flipped_hf)
    ours_error, hf_error = ours_error[kept], hf_error[kept]
    agree_ours, agree_hf = agree_ours[kept], agree_hf[kept]
  assert _rms(ours_error) <= 1.5 * _rms(hf_error), (_rms(ours_error), _rms(hf_error))
  assert np.abs(ours_error).max() <= 2 * np.abs(hf_error).max(), (np.abs(ours_error).max(), np.abs(hf_error).max())
  # A token whose two best float32 logits are closer than bf16's own error (HF's, RMS) has no argmax at
  # this precision (Gemma 4's unscaled QK-normed scores make such errors large): the agreement counts the rest.
  top2 = np.sort(reference, axis=-1)[..., -2:]
  decided = (top2[..., 1] - top2[..., 0]) > _rms(hf_error)
  if config.model.moe.num_experts > 1:
    decided = decided[kept]
  assert agree_ours[decided].mean() >= agree_hf[decided].mean() - 0.05


def test_interleaved_rope_layout_is_the_same_model(staging):
  """With rope_interleaved the converter permutes q/k features so the model is unchanged."""
  model = H.build_hf_model("llama3.1")
  token_ids = H.tokens()
  halves = H.our_config(model, dtype="float32")
  interleaved = H.our_config(model, dtype="float32", rope_interleaved=True)
  halves_params = H.our_params(model, halves, staging / "rope-halves")
  interleaved_params = H.our_params(model, interleaved, staging / "rope-interleaved")
  query = ("layers", "self_attention", "query", "kernel")
  get = lambda p: p[query[0]][query[1]][query[2]][query[3]]  # noqa: E731
  assert not np.array_equal(get(halves_params), get(interleaved_params))
  np.testing.assert_allclose(H.our_logits(interleaved, interleaved_params, token_ids), H.hf_logits(model, token_ids),
                             atol=FP32_ATOL, rtol=0)
  # and the halves parameters under the interleaved rotation are a different model
  assert np.abs(H.our_logits(interleaved, halves_params, token_ids) - H.hf_logits(model, token_ids)).max() > 0.01
