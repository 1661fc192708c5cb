"""Speculative decoding through the server's scheduler (inference/speculative_engine.py): greedy
jobs get the tokens, log-probabilities and top alternatives the plain scheduler gives them (dense
and paged caches, chunked prefill and prefix caching, a llama-style, an MoE, an MLA and a Gated DeltaNet
family),
max_tokens and end-of-sequence tokens cut a round short, a sampled job's reported scores are the
target's for the tokens it got, every page comes back, the acceptance counters count; the draft's
config and each bad input's one-line error."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config, draft_config
from MaxText.errors import ConfigError, UserError
from MaxText.inference import scheduler as sched
from MaxText.inference import speculative, speculative_engine
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh
from test_paged_cache import INTERLEAVED, MLA, QWEN3_NEXT
from test_speculative import DRAFT, TARGET

PROMPTS = [[3, 9, 27], [100], [1, 2, 3, 4, 5, 6, 7, 8], [3, 9, 27, 4], [50, 60]]
MAX_TOKENS = [9, 5, 12, 7, 1]  # not multiples of k + 1: rounds are cut by max_tokens


class Sink:
  def __init__(self):
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.tops: list[list[tuple[int, float]]] = []
    self.reason = ""
    self.done = threading.Event()

  def __call__(self, event: sched.Event) -> None:
    if isinstance(event, sched.Tokens):
      self.tokens += event.tokens
      self.logprobs += event.logprobs
      self.tops += event.tops
    elif isinstance(event, sched.Done):
      self.reason = event.reason + event.message
      self.done.set()


def run_jobs(engine, params, rows=None, eos_ids=(), max_tokens=MAX_TOKENS) -> tuple[list[Sink], dict]:
  """Every prompt as one job through a Scheduler (more jobs than slots: slots are reused)."""
  scheduler = sched.Scheduler(engine, params, max_queue=16, eos_ids=eos_ids).start()
  sinks = [Sink() for _ in PROMPTS]
  rows = rows or [RowParams()] * len(PROMPTS)
  try:
    scheduler.submit([sched.Job(i, p, n, r, s) for i, (p, n, r, s) in enumerate(zip(PROMPTS, max_tokens, rows,
                                                                                       sinks))])
    for sink in sinks:
      assert sink.done.wait(300), "a job did not end"
    return sinks, scheduler.load()
  finally:
    scheduler.stop(30)


def build(overrides: dict, draft_overrides: dict | None, k: int = 3, num_slots: int = 3
          ) -> tuple[Engine, object, speculative_engine.SpeculativeEngine, tuple]:
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**overrides), num_slots=num_slots, mesh=mesh)
  target_params = target.load_params(seed=1)
  if draft_overrides is None:  # the same architecture, weights 3% of the way to random ones
    draft = Engine(Config.for_testing(**overrides), num_slots=num_slots, mesh=mesh)
    draft_params = jax.tree.map(lambda t, r: 0.97 * t + 0.03 * r, target_params, draft.load_params(seed=2))
  else:
    draft = Engine(Config.for_testing(**draft_overrides), num_slots=num_slots, mesh=mesh)
    draft_params = draft.load_params(seed=2)
  spec = speculative_engine.SpeculativeEngine(speculative.SpeculativeDecoder(target, draft, k))
  return target, target_params, spec, (target_params, draft_params)


PAGED = dict(kv_cache_layout="paged", kv_page_size=4)
CASES = {
    "llama_dense": (TARGET, DRAFT),
    "llama_paged_chunked_prefix": (dict(TARGET, **PAGED, prefill_chunk_size=4, prefix_caching=True),
                                   dict(DRAFT, **PAGED, prefill_chunk_size=4, prefix_caching=True)),
    "moe_paged": (dict(INTERLEAVED, **PAGED), None),
    "mla_dense": (MLA, None),
    # Gated DeltaNet states roll back by a replay each round (speculative.roll_back_recurrent), and carry across
    # prefill chunks; prefix caching is off for a recurrent model (the engine turns it off).
    "qwen3_next_paged_chunked": (dict(QWEN3_NEXT, **PAGED, prefill_chunk_size=4), None),
}


def check_equal_to_plain(case: str) -> None:
  target_overrides, draft_overrides = CASES[case]
  target, target_params, spec, params = build(target_overrides, draft_overrides)
  plain, _ = run_jobs(target, target_params)
  # An end-of-sequence token the first job meets mid-way: both stop right after it.
  eos = plain[0].tokens[4]
  plain, _ = run_jobs(target, target_params, eos_ids=[eos])
  got, load = run_jobs(spec, params, eos_ids=[eos])
  for p, g in zip(plain, got):
    assert g.reason == p.reason and g.tokens == p.tokens
    np.testing.assert_allclose(g.logprobs, p.logprobs, atol=2e-5)
    assert [[i for i, _ in t] for t in g.tops] == [[i for i, _ in t] for t in p.tops]
    np.testing.assert_allclose([[lp for _, lp in t] for t in g.tops], [[lp for _, lp in t] for t in p.tops],
                               atol=2e-5)
  assert plain[0].reason == "stop" and len(plain[0].tokens) == 5
  assert load["speculative_tokens"] == 3 and load["speculative_proposed"] > 0
  assert 0 <= load["speculative_accepted"] <= load["speculative_proposed"]
  assert load["pages_reserved"] == 0 and load["pages_free"] == load["pages_total"]
  if spec.draft.pages is not None:
    assert spec.draft.cache_stats()["pages_used"] == 0
  print(f"{case}: acceptance {load['speculative_accepted'] / load['speculative_proposed']:.2f}")


@pytest.mark.parametrize("case", ["llama_dense", "llama_paged_chunked_prefix",
                                  pytest.param("qwen3_next_paged_chunked", marks=pytest.mark.slow)])
def test_greedy_jobs_get_the_plain_schedulers_tokens_and_scores(case):
  check_equal_to_plain(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe_paged", "mla_dense"])
def test_greedy_jobs_get_the_plain_schedulers_tokens_and_scores_for_each_family(case):
  check_equal_to_plain(case)


def test_a_sampled_jobs_scores_are_the_targets_for_its_tokens():
  target, target_params, spec, params = build(TARGET, DRAFT)
  rows = [RowParams(temperature=0.8, top_p=0.9, top_k=50, seed=i) for i in range(len(PROMPTS))]
  got, load = run_jobs(spec, params, rows=rows, max_tokens=[6] * len(PROMPTS))
  for prompt, sink in zip(PROMPTS, got):
    text = prompt + sink.tokens
    scores = jax.device_get(target.score(target_params, text[:TARGET["max_prefill_predict_length"]]))
    n = min(len(text), TARGET["max_prefill_predict_length"]) - len(prompt)
    np.testing.assert_allclose(sink.logprobs[:n], scores.chosen_B[len(prompt):len(prompt) + n], atol=2e-5)
    if n:
      assert [i for i, _ in sink.tops[0]] == list(scores.top_ids_Bk[len(prompt)])
  assert load["speculative_proposed"] > 0


def test_the_draft_config_keeps_the_targets_keys_but_its_own_model():
  config = Config.for_testing(**TARGET, kv_cache_layout="paged", speculative_tokens=2, draft_model_name="default",
                              draft_overrides="base_emb_dim=32,base_num_decoder_layers=1,vocab_size=128")
  draft = draft_config(config)
  assert (draft.model.emb_dim, draft.model.num_decoder_layers, draft.model.vocab_size) == (32, 1, 128)
  assert draft.model.max_target_length == 24 and draft.decode.kv_cache_layout == "paged"
  assert draft.model.dtype == "float32" and draft.decode.max_prefill_predict_length == 8
  assert draft.checkpoint.load_parameters_path == "" and draft.decode.speculative_tokens == 0


@pytest.mark.parametrize("overrides,error,message", [
    (dict(speculative_tokens=2), UserError, "speculative_tokens=2 needs a draft model: set draft_model_name"),
    (dict(speculative_tokens=2, draft_load_parameters_path="/nonexistent/draft"), UserError,
     "draft checkpoint /nonexistent/draft does not exist"),
    (dict(speculative_tokens=2, draft_model_name="no-such-model"), ConfigError, "unknown model_name 'no-such-model'"),
    (dict(speculative_tokens=2, draft_model_name="default", draft_overrides="base_emb_dim=32,vocab_size=256"),
     UserError, r"the draft model's vocab_size \(256\) differs from the target's \(128\)"),
    (dict(speculative_tokens=2, draft_model_name="default", draft_overrides="bogus_key=1"), ConfigError,
     "unknown config key 'bogus_key' from draft_overrides"),
    (dict(speculative_tokens=2, draft_model_name="default", draft_overrides="vocab_size"), ConfigError,
     "draft_overrides items are key=value"),
    # The target's quantize_weights_block divides its own kernels, not the draft's width (24): the draft's culprit.
    (dict(speculative_tokens=2, draft_model_name="default", quantize_weights="fp8", quantize_weights_block=16,
          draft_overrides="base_emb_dim=24,base_num_decoder_layers=1,vocab_size=128"), UserError,
     r"^the draft model \(draft_model_name / draft_load_parameters_path\): quantize_weights_block=16 does not divide "
     "the input axis of 24"),
])
def test_each_bad_draft_is_one_clear_error(overrides, error, message):
  with pytest.raises(error, match=message) as raised:
    speculative_engine.load(Config.for_testing(**TARGET, **overrides), 2, "", one_device_mesh())
  assert "\n" not in str(raised.value)
