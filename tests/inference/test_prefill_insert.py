"""prefill_insert (engine_api.PrefillsIntoSlots) prefills prompts and puts them into their slots in one
device call: the same decode state, pages and later greedy tokens as `prefill` then `insert_rows` (plain
engine dense and paged, a draft-model and an MTP speculative engine), and the scheduler admits the jobs of
one loop with that one device call where it made two (a prefill and an insert)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import image_prompts, mtp_draft, speculative
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import PrefillsIntoSlots, StepLimits
from MaxText.inference.sampling import RowParams
from MaxText.inference.speculative_engine import SpeculativeEngine
from decode_test_utils import (INSERT_BASE as BASE, INSERT_PAGED as PAGED, INSERT_PROMPTS as PROMPTS,
                              INSERT_ROWS as ROWS, count_calls, one_device_mesh, served)

CASES = {"dense": ({}, None), "paged": (PAGED, None), "draft_paged": (PAGED, "draft"), "mtp_dense": ({}, "mtp")}
# The scheduler's fresh state and decode calls; every other jitted call here is an admission's.
NOT_ADMISSIONS = ("_init_state", "_init", "_generate", "_block", "_round")


def _engine(case: str, **keys) -> tuple[Any, Any, list[Engine]]:
  """(engine, params, its Engines)."""
  layout, draft = CASES[case]
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**{**BASE, **layout, **keys, "mtp_num_layers": int(draft == "mtp")}),
                  num_slots=4, mesh=mesh)
  params = target.load_params(seed=1)
  if draft is None:
    return target, params, [target]
  if draft == "mtp":
    return SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, 2)), (params, None), [target]
  small = Engine(Config.for_testing(**{**BASE, **layout, **keys, "base_mlp_dim": 32}), num_slots=4, mesh=mesh)
  return (SpeculativeEngine(speculative.SpeculativeDecoder(target, small, 2)), (params, small.load_params(seed=2)),
          [target, small])


def _tokens(eng, params, state, steps: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
  out = []
  for _ in range(steps):
    state, emitted = eng.decode_step(params, state, limits=StepLimits(np.full(eng.num_slots, 30)))
    tokens = np.asarray(jax.device_get(emitted.tokens))
    counts = np.ones(eng.num_slots, int) if emitted.counts is None else np.asarray(emitted.counts)
    out.append((tokens.reshape(eng.num_slots, -1), counts))
  return out


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "mtp_dense" else c for c in CASES])
def test_prefill_insert_equals_prefill_then_insert_rows(case):
  eng, params, engines = _engine(case)
  assert isinstance(eng, PrefillsIntoSlots)
  slots = [2, 0, 3]  # three prompts of four rows: the last is padding
  prefix = eng.prefill(params, PROMPTS, row_params=ROWS)
  separate = eng.insert_rows(prefix, eng.init_decode_state(5), slots, [0, 1, 2])
  expected_state = jax.device_get(separate)
  expected_first = jax.device_get((prefix.first_tokens_B, prefix.first_logprobs))
  expected_tables = [e.pages.table.copy() for e in engines if e.pages is not None]
  expected = _tokens(eng, params, separate)

  together, admitted = eng.prefill_insert(params, eng.init_decode_state(5), PROMPTS, slots, row_params=ROWS)
  assert [eng.slot(s).busy for s in range(4)] == [True, False, True, True]
  for got, want in zip([e.pages.table for e in engines if e.pages is not None], expected_tables, strict=True):
    np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get((admitted.first_tokens_B, admitted.first_logprobs)),
               expected_first)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(together), expected_state)
  for (tokens, counts), (want_tokens, want_counts) in zip(_tokens(eng, params, together), expected, strict=True):
    np.testing.assert_array_equal(counts[slots], want_counts[slots])
    for slot in slots:  # a free slot's tokens are never read
      np.testing.assert_array_equal(tokens[slot, :counts[slot]], want_tokens[slot, :want_counts[slot]])


def _count_dispatches(owners: list[Any]) -> list[dict[str, int]]:
  """Counts the calls of every jitted function each owner holds, but NOT_ADMISSIONS."""
  return [count_calls(owner, [name for name, value in vars(owner).items()
                              if hasattr(value, "lower") and name not in NOT_ADMISSIONS]) for owner in owners]


@pytest.mark.parametrize("case", ["dense", "paged", "draft_paged"])
def test_the_scheduler_admits_the_jobs_of_one_loop_in_one_device_call(case):
  eng, params, engines = _engine(case, decode_steps_per_call=2 if case in ("dense", "paged") else 1)
  rows = [RowParams(seed=i) for i in range(len(PROMPTS))]  # greedy: the tokens do not depend on the slot

  def serve(indices: list[int]) -> dict[int, list[int]]:
    return served(eng, params, PROMPTS, rows, indices, max_new=5)

  alone = {i: serve([i])[i] for i in range(len(PROMPTS))}
  calls = _count_dispatches(engines + ([eng.decoder] if isinstance(eng, SpeculativeEngine) else []))
  assert serve(list(range(len(PROMPTS)))) == alone
  made = {name: n for counts in calls for name, n in counts.items() if n}
  assert made == {"_prefill_insert": 1}  # four jobs in one loop; was a prefill and an insert_rows per model


def test_prompts_with_images_go_in_as_with_prefill_then_insert_rows():
  """A vision-language model's rows (tiny Gemma 3; one prompt with two images, one with none) through
  prefill_insert: the state and first tokens of prefill + insert_rows."""
  from tests.test_serve_images import MODEL  # 4 placeholders (id 12) an image, between ids 10 and 11

  eng = Engine(Config.for_testing(**MODEL), num_slots=2, mesh=one_device_mesh())
  params = eng.load_params(seed=1)
  run = [10] + [12] * MODEL["mm_tokens_per_image"] + [11]
  prompts = [[3, 4] + run + [5] + run + [6], [7, 8, 9]]
  images = [image_prompts.PromptImages.of(np.random.default_rng(0).uniform(-1, 1, (2, 3, 16, 16))), None]
  prefix = eng.prefill(params, prompts, row_params=ROWS[:2], images=images)
  separate = jax.device_get((eng.insert_rows(prefix, eng.init_decode_state(), [1, 0], [0, 1]), prefix.first_tokens_B))
  state, admitted = eng.prefill_insert(params, eng.init_decode_state(), prompts, [1, 0], row_params=ROWS[:2],
                                       images=images)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get((state, admitted.first_tokens_B)), separate)
  other = [image_prompts.PromptImages.of(np.random.default_rng(1).uniform(-1, 1, (2, 3, 16, 16))), None]
  elsewhere, _ = eng.prefill_insert(params, eng.init_decode_state(), prompts, [1, 0], row_params=ROWS[:2],
                                    images=other)
  caches = [jax.tree.leaves(jax.device_get(s.caches)) for s in (state, elsewhere)]
  assert any(not np.array_equal(a, b) for a, b in zip(*caches))  # the images reached the call
