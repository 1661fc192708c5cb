"""Speculative decoding with a draft model (inference/speculative.py): greedy tokens equal the
target's plain greedy decoding (dense and paged caches, scanned and unrolled layers, k = 1 and 3,
up to max_target_length), a draft equal to the target accepts everything, sampled first tokens
follow the target's distribution (chi-square), Gated DeltaNet models (target, draft or both) roll their
recurrent states back, and bad input is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.inference import mtp_draft, paged_cache, sampling, speculative, speculative_engine
from MaxText.inference.engine import Engine
from MaxText.platform import sharding
from decode_test_utils import engine_tokens, one_device_mesh
from test_paged_cache import CHUNKED, DSA, INTERLEAVED, MIXED, MLA, QWEN3_NEXT

TARGET = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
              base_num_decoder_layers=2, vocab_size=128, max_target_length=24, max_prefill_predict_length=8,
              per_device_batch_size=1, print_config=False, dtype="float32")
DRAFT = dict(TARGET, base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=1, head_dim=16, base_mlp_dim=64,
             base_num_decoder_layers=1)
# The last prompt runs into max_target_length: 24 + 1 - 8 = 17 tokens, fewer than asked.
PROMPTS = [[3, 9, 27], [100], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_NEW = 20


def engines(num_slots: int, **overrides) -> tuple[Engine, Engine, object, object]:
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**TARGET, **overrides), num_slots=num_slots, mesh=mesh)
  draft = Engine(Config.for_testing(**DRAFT, **overrides), num_slots=num_slots, mesh=mesh)
  return target, draft, target.load_params(seed=1), draft.load_params(seed=2)


def check_greedy(layout: str, scan_layers: bool, k: int) -> None:
  paged = dict(kv_cache_layout="paged", kv_page_size=4) if layout == "paged" else {}
  # 4 slots, 3 prompts: an idle slot steps along with nothing to emit.
  target, draft, target_params, draft_params = engines(4, scan_layers=scan_layers, **paged)
  expected = engine_tokens(target, target_params, PROMPTS, MAX_NEW)
  decoder = speculative.SpeculativeDecoder(target, draft, k)
  got = speculative.generate(decoder, target_params, draft_params, PROMPTS, MAX_NEW)
  budgets = [min(MAX_NEW, 24 + 1 - len(p)) for p in PROMPTS]
  assert [len(g) for g in got] == budgets == [20, 20, 17]
  assert got == [e[:n] for e, n in zip(expected, budgets)]
  assert decoder.traces == {"round": 1}  # one compiled round for every call
  metrics = decoder.metrics()
  # Three slots count while they run (the idle fourth never does); each emits accepted + 1 per round.
  assert metrics["proposed"] % k == 0 and metrics["proposed"] <= 3 * k * metrics["rounds"]
  assert 0 <= metrics["accepted"] <= metrics["proposed"]
  assert metrics["accepted"] + metrics["proposed"] // k >= sum(budgets) - len(PROMPTS)
  if layout == "paged":  # every page back once every slot is released
    assert target.cache_stats()["pages_used"] == 0 and draft.cache_stats()["pages_used"] == 0


@pytest.mark.parametrize("layout,scan_layers,k", [("dense", True, 3), pytest.param("paged", False, 1, marks=pytest.mark.slow)])
def test_greedy_equals_plain_greedy(layout, scan_layers, k):
  check_greedy(layout, scan_layers, k)


@pytest.mark.slow
@pytest.mark.parametrize("layout,scan_layers,k", [("dense", True, 1), ("dense", False, 1), ("dense", False, 3),
                                                   ("paged", True, 1), ("paged", True, 3), ("paged", False, 3)])
def test_greedy_equals_plain_greedy_everywhere(layout, scan_layers, k):
  check_greedy(layout, scan_layers, k)


def test_a_draft_equal_to_the_target_is_always_accepted():
  target, _, target_params, _ = engines(3)
  decoder = speculative.SpeculativeDecoder(target, target, 3)
  got = speculative.generate(decoder, target_params, target_params, PROMPTS, 9)
  assert got == engine_tokens(target, target_params, PROMPTS, 9)
  metrics = decoder.metrics()
  assert metrics["proposed"] > 0 and metrics["acceptance_rate"] == 1.0
  # 8 tokens after prefill at k + 1 = 4 per round: two rounds.
  assert metrics["rounds"] == 2


def test_sampled_first_tokens_follow_the_target_distribution():
  """4000 first speculative tokens (500 slots x 8 rounds, each slot its own seed) of one fixed
  context, drawn with temperature, top-k and top-p, from a draft that differs a lot from the
  target: their histogram passes a chi-square test against the target's distribution (bins with
  under 5 expected draws pooled; p-value > 1e-3, so a correct sampler fails for 1 in 1000 seeds;
  the seeds are fixed, so the run is deterministic) and fails it against the draft's."""
  num_slots, rounds, prompt, pending = 500, 8, [5, 17, 42, 99], 7
  row = sampling.RowParams(temperature=0.9, top_p=0.95, top_k=64)
  target, draft, target_params, draft_params = engines(num_slots)
  context = jnp.asarray([prompt + [pending]])

  def distribution(engine: Engine, params) -> np.ndarray:
    logits = sharding.unsharded()(engine.spec.apply)(params, context, jnp.arange(context.shape[1])[None],
                                                     jnp.ones_like(context))[:, -1]
    return np.asarray(sampling.row_probs(logits, jnp.asarray([row.temperature]), jnp.asarray([row.top_p]),
                                         jnp.asarray([row.top_k])))[0]

  p, q = distribution(target, target_params), distribution(draft, draft_params)
  assert 0.5 * np.abs(p - q).sum() > 0.4  # the draft is a poor guess: many rejections
  decoder = speculative.SpeculativeDecoder(target, draft, 2)
  rows = [dataclasses.replace(row, seed=1000 + i) for i in range(num_slots)]
  prefixes = decoder.prefill(target_params, draft_params, [prompt] * num_slots, row_params=rows)
  state = decoder.init_decode_state()
  for slot in range(num_slots):
    state = decoder.insert(prefixes, state, slot, slot)

  def rewind(one):  # the same context again; the keys have moved on
    return dataclasses.replace(one, tokens_B=jnp.full((num_slots,), pending, jnp.int32),
                               next_positions_B=jnp.full((num_slots,), len(prompt), jnp.int32))

  draws = []
  for _ in range(rounds):
    state = speculative.SpeculativeState(rewind(state.target), rewind(state.draft))
    state, tokens, _ = decoder.step(target_params, draft_params, state)
    draws.append(tokens[:, 0])
  counts = np.bincount(np.concatenate(draws), minlength=p.size)
  assert 0 < decoder.metrics()["acceptance_rate"] < 1

  def chi_square_p_value(probs: np.ndarray) -> float:
    if counts[probs == 0].any():  # a draw the distribution cannot give
      return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed, expected = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if expected[-1] < 1e-9:  # nothing to pool
      observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(statistic, observed.size - 1))

  print(f"chi-square p-values: target {chi_square_p_value(p):.3f}, draft {chi_square_p_value(q):.2g}")
  assert chi_square_p_value(p) > 1e-3
  assert chi_square_p_value(q) < 1e-12
  assert 0.5 * np.abs(counts / counts.sum() - p).sum() < 0.08


def test_a_draft_config_error_names_the_draft():
  """A draft whose model keys do not fit the target's other keys: the line says it is the draft's (it named a
  max_position_embeddings the target does not have, as if the target's)."""
  from MaxText.configuration.config import draft_config

  config = Config.for_testing(**TARGET, speculative_tokens=2, draft_model_name="default",
                              draft_overrides="position_embedding=learned,max_position_embeddings=8")
  with pytest.raises(ConfigError) as error:
    draft_config(config)
  assert str(error.value).startswith("speculative decoding with a draft model: the draft (draft_model_name=default) "
                                     "with this run's other keys: max_target_length"), str(error.value)


def test_bad_input_is_refused():
  with pytest.raises(ConfigError, match="speculative_tokens must be >= 0"):
    Config.for_testing(**TARGET, speculative_tokens=-1)
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**TARGET, speculative_tokens=2), num_slots=2, mesh=mesh)
  assert speculative.SpeculativeDecoder(target, target).k == 2  # the key's value by default
  with pytest.raises(UserError, match="speculative_tokens must be >= 0"):
    speculative.SpeculativeDecoder(target, target, -1)
  other_vocab = Engine(Config.for_testing(**dict(DRAFT, vocab_size=256)), num_slots=2, mesh=mesh)
  with pytest.raises(UserError, match=r"vocab_size \(256\) differs from the target's \(128\)"):
    speculative.SpeculativeDecoder(target, other_vocab)
  with pytest.raises(UserError, match="the draft engine has 3 slots, the target 2"):
    speculative.SpeculativeDecoder(target, Engine(Config.for_testing(**DRAFT), num_slots=3, mesh=mesh))


@pytest.mark.parametrize("roles", [pytest.param("target", marks=pytest.mark.slow),
                                   pytest.param("draft", marks=pytest.mark.slow), "both"])
def test_gated_deltanet_models_decode_speculatively_as_plain_greedy(roles):
  """A recurrent state (Qwen3-Next's Gated DeltaNet layers) cannot be cut back by position: a round restores the
  states from before it and replays the accepted tokens (speculative.roll_back_recurrent). A random draft gets
  rejections (the replay), the target as its own draft none (the replay skipped); greedy output is the target's."""
  mesh = one_device_mesh()
  recurrent_cfg = Config.for_testing(**dict(QWEN3_NEXT, max_target_length=24, max_prefill_predict_length=8))
  plain_cfg = Config.for_testing(**dict(DRAFT, vocab_size=recurrent_cfg.model.vocab_size))
  target = Engine(recurrent_cfg if roles != "draft" else plain_cfg, num_slots=3, mesh=mesh)
  draft = Engine(recurrent_cfg if roles != "target" else plain_cfg, num_slots=3, mesh=mesh)
  target_params, draft_params = target.load_params(seed=1), draft.load_params(seed=2)
  expected = engine_tokens(target, target_params, PROMPTS, 12)
  decoder = speculative.SpeculativeDecoder(target, draft, 3)
  assert decoder.replays == (roles != "draft", roles != "target")
  assert speculative.generate(decoder, target_params, draft_params, PROMPTS, 12) == expected
  assert decoder.metrics()["acceptance_rate"] < 1.0
  if roles == "both":
    itself = speculative.SpeculativeDecoder(target, target, 3)
    assert speculative.generate(itself, target_params, target_params, PROMPTS, 12) == expected
    assert itself.metrics()["acceptance_rate"] == 1.0


def test_mtp_drafting_of_a_gated_deltanet_model_is_refused_in_one_line():
  """The MTP heads' rounds roll back by position only; with a recurrent target they are refused before decoding."""
  recurrent = Engine(Config.for_testing(**QWEN3_NEXT), num_slots=2, mesh=one_device_mesh())
  refused = r"^speculative decoding with the model's MTP heads is not supported for a model with Gated DeltaNet " \
            r"layers \(Qwen3-Next, Qwen3.5\).*; name a draft model \(draft_model_name=...\) or set speculative_tokens=0$"
  with pytest.raises(UserError, match=refused):
    mtp_draft.MtpSpeculativeDecoder(recurrent, 2)
  with pytest.raises(UserError, match=refused):  # decode.py and the server, before loading
    speculative_engine.check_draft(Config.for_testing(**QWEN3_NEXT, speculative_tokens=2, mtp_num_layers=1))
  speculative_engine.check_draft(Config.for_testing(**QWEN3_NEXT, speculative_tokens=2, draft_model_name="x"))


def test_a_gated_deltanet_model_keeps_state_snapshots_for_prefix_caching_unless_told_not_to(capsys):
  """Prefix caching (prefix_caching=auto: on with the paged cache) restarts a recurrent model from its states kept at
  page boundaries (2 per slot by default); with prefix_state_snapshots=0 there are none, so auto turns prefix
  caching off for such a model and says so, and prefix_caching=true is refused in one line."""
  paged = dict(QWEN3_NEXT, kv_cache_layout="paged", prefix_caching="auto")
  engine = Engine(Config.for_testing(**paged), num_slots=3, mesh=one_device_mesh())
  snapshots = engine.page_prefill.snapshots
  assert engine.prefix_caching and snapshots is not None and snapshots.capacity == 6
  engine = Engine(Config.for_testing(**paged, prefix_state_snapshots=0), mesh=one_device_mesh())
  assert not engine.prefix_caching and engine.pages is not None and engine.pages.index is None
  assert "engine: prefix_caching is off for this model" in capsys.readouterr().out
  with pytest.raises(UserError, match="prefix_caching=true needs snapshots .* set prefix_state_snapshots=-1"):
    Engine(Config.for_testing(**dict(paged, prefix_caching=True), prefix_state_snapshots=0), mesh=one_device_mesh())


@pytest.mark.parametrize("family,layout", [
    ("mla_int8", "paged"),
    pytest.param("mla_int8", "dense", marks=pytest.mark.slow),
    pytest.param("dsa_int8", "paged", marks=pytest.mark.slow),  # the rope and indexer keys' two scales
    pytest.param("chunked", "paged", marks=pytest.mark.slow),
    pytest.param("windows", "dense", marks=pytest.mark.slow),
    pytest.param("moe", "paged", marks=pytest.mark.slow),
])
def test_greedy_equals_plain_greedy_for_each_family(family, layout):
  """The target's k + 1-token verify pass through MLA (int8 cache, DeepSeek-V3.2's too), chunked and
  sliding-window attention and routed experts; the draft is the same architecture with weights 3% of the way
  from the target's to random ones, so most proposals are accepted and some rejected."""
  overrides = dict({"mla_int8": dict(MLA, quantize_kvcache=True), "dsa_int8": dict(DSA, quantize_kvcache=True),
                    "chunked": CHUNKED, "windows": MIXED, "moe": INTERLEAVED}[family], max_target_length=24)
  if layout == "paged":
    overrides.update(kv_cache_layout="paged", kv_page_size=3)
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**overrides), num_slots=3, mesh=mesh)
  draft = Engine(Config.for_testing(**overrides), num_slots=3, mesh=mesh)
  target_params = target.load_params(seed=1)
  draft_params = jax.tree.map(lambda t, r: 0.97 * t + 0.03 * r, target_params, draft.load_params(seed=2))
  decoder = speculative.SpeculativeDecoder(target, draft, 2)
  got = speculative.generate(decoder, target_params, draft_params, PROMPTS, 12)
  assert got == engine_tokens(target, target_params, PROMPTS, 12)
  print(f"{family} {layout}: acceptance {decoder.metrics()['acceptance_rate']:.2f}")
  assert 0 < decoder.metrics()["acceptance_rate"] < 1


def test_allocator_grows_pages_for_the_round_ahead_and_advances_each_slot_by_its_count():
  pages = paged_cache.PageAllocator(num_pages=8, page_size=4, num_slots=2, max_length=10)
  pages.assign(0, 3)  # positions 0..2 cached, the pending token goes at 3
  pages.grow(4)  # positions 3..6: pages 0 and 1
  assert pages.held(0) == 2 and pages.held(1) == 0  # an inactive slot gets nothing
  pages.advance(np.asarray([3, 5]))
  assert list(pages.positions) == [6, 0]
  pages.grow(4)  # 6..9: page 2 as well (positions 10+ are past max_length: no page 3)
  pages.advance(np.asarray([4, 0]))
  pages.grow(4)
  assert pages.held(0) == 3 and list(pages.positions) == [10, 0]
  pages.release(0)
  assert pages.stats()["pages_used"] == 0


@pytest.mark.slow
def test_sharded_speculative_decode_equals_one_device():
  """tensor=2 x fsdp=4 for both models: the same greedy tokens as one device."""
  sharded = dict(ici_tensor_parallelism=2, ici_fsdp_parallelism=4)
  target = Engine(Config.for_testing(**TARGET, **sharded), num_slots=4)
  draft = Engine(Config.for_testing(**DRAFT, **sharded), num_slots=4)
  single, _, target_params, draft_params = engines(4)
  decoder = speculative.SpeculativeDecoder(target, draft, 3)
  got = speculative.generate(decoder, jax.device_put(target_params, target.param_shardings),
                             jax.device_put(draft_params, draft.param_shardings), PROMPTS, 12)
  assert got == engine_tokens(single, target_params, PROMPTS, 12)
