"""A speculative engine puts several rows of one prefill into their slots in one call per model
(SpeculativeEngine.insert_rows, engine_api.InsertsRowsTogether), as an insert each does one after the
other: the same target and draft states (draft model: dense and paged; MTP heads: dense) and the same
greedy rounds after; the scheduler of such an engine without prefill_insert (test_prefill_insert.py) makes
that one call for the jobs it admits together."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import mtp_draft, speculative
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import InsertsRowsTogether
from MaxText.inference.sampling import RowParams
from MaxText.inference.speculative_engine import SpeculativeEngine
from decode_test_utils import (Hiding, INSERT_BASE as BASE, INSERT_PAGED as PAGED, INSERT_PROMPTS as PROMPTS,
                              INSERT_ROWS as ROWS, count_calls, one_device_mesh, served)

CASES = {"draft_dense": ({}, "draft"), "draft_paged": (PAGED, "draft"), "mtp_dense": ({}, "mtp")}


def _engine(case: str, **keys) -> tuple[SpeculativeEngine, tuple]:
  layout, draft = CASES[case]
  mesh = one_device_mesh()
  target = Engine(Config.for_testing(**{**BASE, **layout, **keys, "mtp_num_layers": int(draft == "mtp")}),
                  num_slots=4, mesh=mesh)
  target_params = target.load_params(seed=1)
  if draft == "mtp":
    return SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, 2)), (target_params, None)
  small = Engine(Config.for_testing(**{**BASE, **layout, **keys, "base_mlp_dim": 32}), num_slots=4, mesh=mesh)
  return SpeculativeEngine(speculative.SpeculativeDecoder(target, small, 2)), (target_params,
                                                                                small.load_params(seed=2))


def _rounds(eng: SpeculativeEngine, params, state, rounds: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
  out = []
  for _ in range(rounds):
    state, emitted = eng.decode_step(params, state)
    out.append((np.asarray(emitted.tokens), np.asarray(emitted.counts)))
  return out


def _tables(eng: SpeculativeEngine) -> list[np.ndarray]:
  return [e.pages.table.copy() for e in eng._engines() if e.pages is not None]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("used", [4, 3])  # every row of the prefill, or three of its four (the call pads)
def test_insert_rows_equals_an_insert_each(case, used):
  eng, params = _engine(case)
  assert isinstance(eng, InsertsRowsTogether)
  slots, rows = [2, 0, 3, 1][:used], [0, 1, 2, 3][:used]
  prefix = eng.prefill(params, PROMPTS, row_params=ROWS)
  one_by_one = eng.init_decode_state(5)
  for slot, row in zip(slots, rows):
    one_by_one = eng.insert(prefix, one_by_one, slot, row)
  expected_state, expected_tables = jax.device_get(one_by_one), _tables(eng)
  expected = _rounds(eng, params, one_by_one)

  together = eng.insert_rows(prefix, eng.init_decode_state(5), slots, rows)
  assert all(eng.slot(s).busy for s in slots) and (used == 4 or not eng.slot(1).busy)
  for got_table, table in zip(_tables(eng), expected_tables, strict=True):
    np.testing.assert_array_equal(got_table, table)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(together), expected_state)
  for (tokens, counts), (want_tokens, want_counts) in zip(_rounds(eng, params, together), expected, strict=True):
    np.testing.assert_array_equal(counts, want_counts)
    for slot in slots:  # a free slot's tokens are never read
      np.testing.assert_array_equal(tokens[slot, :counts[slot]], want_tokens[slot, :want_counts[slot]])


@pytest.mark.parametrize("case", [pytest.param("draft_paged", marks=pytest.mark.slow), "mtp_dense"])
def test_scheduler_inserts_the_jobs_admitted_together_in_one_call_per_model(case):
  eng, params = _engine(case)
  rows = [RowParams(seed=i) for i in range(len(PROMPTS))]  # greedy: the tokens do not depend on the slot

  def serve(indices: list[int]) -> dict[int, list[int]]:
    return served(Hiding(eng, "prefill_insert"), params, PROMPTS, rows, indices, max_new=6)

  alone = {i: serve([i])[i] for i in range(len(PROMPTS))}
  models = [eng.decoder.target] + ([] if eng.draft is None else [eng.draft])
  calls = [count_calls(model, ["insert", "insert_rows"]) for model in models]
  assert serve(list(range(len(PROMPTS)))) == alone
  assert calls == [{"insert": 0, "insert_rows": 1}] * len(models)  # four jobs in one loop: one call each
