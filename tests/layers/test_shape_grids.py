"""Logit parity with HF (float32, CPU torch) over small grids of the shapes a mechanism depends on, so
that no mechanism is held to HF on its family's one reference shape only (tests/hf_families.py):

- DeepSeek Sparse Attention: index heads 1, 2, 4, 8, index head widths 8 and 16, top-k 4 and 8, and
  sequences past the top-k (both sparse forms: the gathered one above 4 x top-k keys);
- grouped-query attention: KV-head ratios 1 (as many KV heads as query heads), 2, 4 and 8 (one KV head);
- sliding windows from 1 token to past the sequence, sequences longer than the window;
- partial rotary embeddings (the rotated fraction of each head);
- expert routing: one expert a token, every expert, other expert counts (Mixtral, DeepSeek-V3);
- multi-head latent attention's KV rank, unrotated and rotated widths (DeepSeek-V3).

Each point converts a tiny random HF model and runs one forward pass on one device. The default run
keeps three points: the DSA shape whose exact-zero index scores tie at the top-k boundary
(masks.top_k_keys), one GQA ratio and MLA with an odd head_dim; the rest are `slow`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

H = pytest.importorskip("hf_families")
_slow = pytest.mark.slow


def _parity(family: str, staging: Path, length: int = H.LENGTH, **overrides: Any) -> None:
  model = H.build_hf_model(family, **overrides)
  token_ids = H.tokens(length=length)
  config = H.our_config(model, dtype="float32", max_target_length=length)
  ours = H.our_logits(config, H.our_params(model, config, staging), token_ids)
  atol = H.CHECKER_FP32_ATOL.get(family, H.FP32_ATOL)
  np.testing.assert_allclose(ours, H.hf_logits(model, token_ids), atol=atol, rtol=0,
                             err_msg=f"{family} {overrides} length={length}")


def _case(values: tuple, default: bool = False) -> Any:
  return pytest.param(*values, marks=() if default else (_slow,), id="-".join(map(str, values)))


# (index_n_heads, index_head_dim, index_topk, sequence length). Two index heads, 16 wide, top-4 of 24:
# a quarter of the (query, key) pairs score exactly 0 (every head's ReLU at 0), so ties at the top-k
# boundary are common and the tie rule decides the choice.
DSA_GRID = [_case((2, 16, 4, 24), default=True)] + [_case(v) for v in (
    (1, 8, 4, 24), (1, 16, 8, 40), (2, 8, 8, 40), (4, 8, 4, 24), (4, 16, 8, 40), (8, 8, 4, 40), (8, 16, 8, 24))]


@pytest.mark.parametrize("heads, width, topk, length", DSA_GRID)
def test_sparse_attention_matches_hf_over_index_shapes(heads, width, topk, length, tmp_path):
  _parity("deepseek32", tmp_path, length, index_n_heads=heads, index_head_dim=width, index_topk=topk)


# (query heads, KV heads) on Llama 3.1's layer; the reference shape is 4 heads over 2 KV heads.
GQA_GRID = [_case((4, 4), default=True)] + [_case(v) for v in ((4, 1), (8, 8), (8, 2), (8, 1))]


@pytest.mark.parametrize("heads, kv_heads", GQA_GRID)
def test_grouped_query_attention_matches_hf_over_head_ratios(heads, kv_heads, tmp_path):
  _parity("llama3.1", tmp_path, num_attention_heads=heads, num_key_value_heads=kv_heads)


# (family, sliding window, sequence length): Mistral's every layer, Gemma 2's alternate layers,
# gpt-oss's alternate layers beside its attention sinks.
WINDOW_GRID = [_case(v) for v in (
    ("mistral", 1, 24), ("mistral", 3, 24), ("mistral", 16, 40), ("mistral", 24, 24),
    ("gemma2", 2, 24), ("gemma2", 16, 40), ("gpt_oss", 1, 24), ("gpt_oss", 16, 40))]


@pytest.mark.parametrize("family, window, length", WINDOW_GRID)
def test_sliding_window_matches_hf_past_the_window(family, window, length, tmp_path):
  _parity(family, tmp_path, length, sliding_window=window)


def _gemma4_rope(fraction: float) -> dict:
  rope = {key: dict(value) for key, value in H.REFERENCE_CONFIGS["gemma4"]["rope_parameters"].items()}
  rope["full_attention"]["partial_rotary_factor"] = fraction
  return rope


def _qwen3_next_rope(fraction: float) -> dict:
  return {**H.REFERENCE_CONFIGS["qwen3_next"]["rope_parameters"], "partial_rotary_factor": fraction}


# (family, rotated fraction): Gemma 4's proportional RoPE on its global layers (reference 0.5), and
# Qwen3-Next's gated-attention layers (reference 0.25; its DeltaNet stack compiles for tens of seconds).
PARTIAL_GRID = [_case(v) for v in (("gemma4", 0.25), ("gemma4", 1.0), ("qwen3_next", 0.5))]


@pytest.mark.parametrize("family, fraction", PARTIAL_GRID)
def test_partial_rotary_matches_hf_over_fractions(family, fraction, tmp_path):
  rope = _gemma4_rope(fraction) if family == "gemma4" else _qwen3_next_rope(fraction)
  _parity(family, tmp_path, rope_parameters=rope)


# (family, experts, experts per token): routing with one expert a token, with every expert, and at
# other widths than the reference's (Mixtral 4 choose 2, DeepSeek-V3 8 choose 2 beside a shared expert).
MOE_GRID = [_case(v) for v in (("mixtral", 4, 1), ("mixtral", 4, 4), ("mixtral", 8, 3),
                               ("deepseek3", 16, 1), ("deepseek3", 8, 4))]


@pytest.mark.parametrize("family, experts, per_token", MOE_GRID)
def test_expert_routing_matches_hf_over_expert_counts(family, experts, per_token, tmp_path):
  count = {"n_routed_experts": experts} if family.startswith("deepseek") else {"num_local_experts": experts}
  _parity(family, tmp_path, num_experts_per_tok=per_token, **count)


# (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim) of DeepSeek-V3's multi-head latent attention (reference
# 16, 8, 4). An odd unrotated width makes head_dim odd; only the rotated width need be even (it was refused).
MLA_GRID = [_case((16, 7, 4), default=True)] + [_case(v) for v in ((8, 8, 4), (32, 8, 8), (16, 8, 2))]


@pytest.mark.parametrize("rank, nope_dim, rope_dim", MLA_GRID)
def test_latent_attention_matches_hf_over_ranks(rank, nope_dim, rope_dim, tmp_path):
  _parity("deepseek3", tmp_path, kv_lora_rank=rank, qk_nope_head_dim=nope_dim, qk_rope_head_dim=rope_dim)
