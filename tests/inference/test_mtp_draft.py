"""Speculative decoding with the model's MTP head as the draft (inference/mtp_draft.py): greedy
tokens equal plain greedy decoding (a llama-style and a DeepSeek-style MLA + MoE model, dense and
paged caches, k = 1 and 3), the carried MTP logits after several rounds equal the module's
uncached pass over the whole text (so the MTP cache holds what it should), the scheduler gives
the plain scheduler's tokens and scores, and what MTP drafting refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.inference import mtp_draft, speculative, speculative_engine
from MaxText.inference.engine import Engine
from MaxText.platform import sharding
from decode_test_utils import engine_tokens, one_device_mesh
from test_paged_cache import MLA
from test_speculative import PROMPTS, TARGET
from test_speculative_serving import run_jobs

LLAMA_MTP = dict(TARGET, mtp_num_layers=1)
DEEPSEEK_MTP = dict(MLA, mtp_num_layers=1, max_target_length=24)
PAGED = dict(kv_cache_layout="paged", kv_page_size=4)


def build(overrides: dict, k: int, num_slots: int = 4) -> tuple[Engine, object, mtp_draft.MtpSpeculativeDecoder]:
  target = Engine(Config.for_testing(**overrides), num_slots=num_slots, mesh=one_device_mesh())
  return target, target.load_params(seed=1), mtp_draft.MtpSpeculativeDecoder(target, k)


@pytest.mark.parametrize("family,layout,k", [
    ("llama", "dense", 3),
    pytest.param("deepseek", "paged", 2, marks=pytest.mark.slow),
    pytest.param("llama", "paged", 1, marks=pytest.mark.slow),
    pytest.param("deepseek", "dense", 3, marks=pytest.mark.slow),
])
def test_greedy_equals_plain_greedy(family, layout, k):
  overrides = dict(LLAMA_MTP if family == "llama" else DEEPSEEK_MTP, **(PAGED if layout == "paged" else {}))
  target, params, decoder = build(overrides, k)
  expected = engine_tokens(target, params, PROMPTS, 12)
  got = speculative.generate(decoder, params, None, PROMPTS, 12)
  assert got == expected
  assert decoder.traces == {"round": 1, "prefill": 1}
  metrics = decoder.metrics()
  print(f"{family} {layout} k={k}: acceptance {metrics['acceptance_rate']:.2f}")
  assert metrics["proposed"] > 0 and 0 <= metrics["accepted"] <= metrics["proposed"]
  if layout == "paged":
    assert target.cache_stats()["pages_used"] == 0


@pytest.mark.slow
def test_carried_mtp_logits_equal_the_uncached_module_over_the_text():
  """After prefill and four rounds, each slot's carried logits (the next d1's distribution) are the
  MTP module's over the whole text run without a cache: position p - 1 combines the stack's
  output there with the embedding of the pending token."""
  target, params, decoder = build(LLAMA_MTP, 3, num_slots=3)
  prompts = PROMPTS
  prefixes = decoder.prefill(params, None, prompts)
  state = decoder.init_decode_state()
  for row in range(len(prompts)):
    state = decoder.insert(prefixes, state, slot=row, row=row)
  texts = [list(p) + [int(t)] for p, t in zip(prompts, np.asarray(prefixes[0].first_tokens_B))]
  for _ in range(4):
    state, tokens, counts = decoder.step(params, None, state)
    for slot, text in enumerate(texts):
      text += [int(t) for t in tokens[slot, :counts[slot]]]
  spec = target.spec
  for slot, text in enumerate(texts):
    length = min(len(text), TARGET["max_target_length"])
    text = text[:length]
    if int(state.target.next_positions_B[slot]) != length - 1:
      continue  # ran into max_target_length
    tokens = jnp.asarray([text])
    positions = jnp.arange(length)[None]

    def uncached(params, tokens, positions):
      from MaxText.layers import kv_cache
      caches = kv_cache.model_caches(spec.cfg, 1, length)
      h, _ = spec.apply_decode_hidden(params, tokens, positions, caches)
      next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
      mtp_h, _ = spec.apply_mtp_decode(params, 0, h[:, :-1], next_tokens[:, :-1], positions[:, :-1],
                                       kv_cache.layer_cache(spec.cfg, 1, length))
      return spec.apply_mtp_logits(params, 0, mtp_h[:, -1:])[0, 0]

    expected = sharding.unsharded()(uncached)(params, tokens, positions)
    np.testing.assert_allclose(np.asarray(state.draft.logits_BV[slot]), np.asarray(expected), atol=2e-4)


@pytest.mark.slow
def test_the_scheduler_with_mtp_gives_the_plain_schedulers_tokens_and_scores():
  overrides = dict(LLAMA_MTP, **PAGED)  # prefix_caching=auto: MTP leaves prefix caching out
  target, params, decoder = build(overrides, 3, num_slots=3)
  plain, _ = run_jobs(target, params)
  got, load = run_jobs(speculative_engine.SpeculativeEngine(decoder), (params, None))
  for p, g in zip(plain, got):
    assert g.tokens == p.tokens and g.reason == p.reason
    np.testing.assert_allclose(g.logprobs, p.logprobs, atol=2e-5)
  assert load["speculative_proposed"] > 0 and load["pages_free"] == load["pages_total"]


def test_mtp_drafting_is_chosen_and_refused_with_one_line():
  engine, params = speculative_engine.load(Config.for_testing(**LLAMA_MTP, speculative_tokens=2), 2, "",
                                           one_device_mesh())
  assert isinstance(engine, speculative_engine.SpeculativeEngine) and engine.draft is None
  with pytest.raises(UserError, match="prefill_chunk_size=4: MTP drafting prefills prompts whole"):
    speculative_engine.load(Config.for_testing(**LLAMA_MTP, **PAGED, prefill_chunk_size=4, speculative_tokens=2), 2,
                            "", one_device_mesh())
  with pytest.raises(UserError, match="prefix_caching=true: MTP drafting prefills prompts whole"):
    speculative_engine.load(Config.for_testing(**LLAMA_MTP, **PAGED, prefix_caching=True, speculative_tokens=2), 2,
                            "", one_device_mesh())
  target = Engine(Config.for_testing(**TARGET), num_slots=2, mesh=one_device_mesh())
  with pytest.raises(UserError, match=r"needs a model with multi-token-prediction modules \(mtp_num_layers > 0\)"):
    mtp_draft.MtpSpeculativeDecoder(target, 2)
