"""Speculative decoding on every family: each family's tiny reference model (its HF weights, converted) as the
target and a randomly initialised model of the same family as the draft; speculative greedy tokens equal the
target's plain greedy tokens, past every window and chunk boundary of the reference configs (the Gated DeltaNet
families roll their recurrent states back by a replay), with the paged cache on every other family. One case runs
in the default suite, the rest under -m slow."""

from __future__ import annotations

import pytest

from MaxText.inference import speculative
from MaxText.inference.engine import Engine
from decode_test_utils import engine_tokens, one_device_mesh

PROMPTS = [[5, 17, 42, 7, 99, 3, 64, 20, 11], [101, 2, 33, 8]]
NEW_TOKENS, TARGET, PREFILL = 14, 32, 12
hf = pytest.importorskip("hf_families", reason="needs torch and transformers (EXTRAS=test bash setup.sh)")
DEFAULT = {"llama4"}  # chunked attention, NoPE global layers and an MoE
CASES = [pytest.param(family, i % 2 == 1, id=f"{family}-{'paged' if i % 2 else 'dense'}",
                      marks=[] if family in DEFAULT else [pytest.mark.slow])
         for i, family in enumerate(hf.FAMILIES)]


@pytest.mark.parametrize("family,paged", CASES)
def test_speculative_greedy_equals_plain_greedy(family, paged, tmp_path):
  model = hf.build_hf_model(family)
  layout = dict(kv_cache_layout="paged", kv_page_size=4, kv_num_pages=32) if paged else {}
  config = hf.our_config(model, dtype="float32", max_target_length=TARGET, max_prefill_predict_length=PREFILL,
                         **layout)
  mesh = one_device_mesh()
  target, draft = Engine(config, num_slots=2, mesh=mesh), Engine(config, num_slots=2, mesh=mesh)
  target_params, draft_params = hf.our_params(model, config, tmp_path), draft.load_params(seed=3)
  expected = engine_tokens(target, target_params, PROMPTS, NEW_TOKENS)
  decoder = speculative.SpeculativeDecoder(target, draft, 3)
  assert speculative.generate(decoder, target_params, draft_params, PROMPTS, NEW_TOKENS) == expected
