"""Engine.insert_rows puts several rows of one prefill into their slots in one call, as an insert
each does one after the other (dense and paged: the same decode state, the same tokens after), and
the scheduler of an engine without prefill_insert (test_prefill_insert.py) makes that one call for the
jobs it admits together where it made an insert each."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import StepLimits
from MaxText.inference.sampling import RowParams
from decode_test_utils import Hiding, count_calls, one_device_mesh, served

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4], [2, 2, 6, 1, 9]]
ROWS = [RowParams(seed=0), RowParams(seed=1), RowParams(temperature=1.0, seed=7), RowParams(seed=3)]
LAYOUTS = {"dense": {}, "paged": dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching="false")}


def _engine(layout: str, **keys) -> tuple[Engine, object]:
  eng = Engine(Config.for_testing(**{**TINY, **LAYOUTS[layout], **keys}), num_slots=4, mesh=one_device_mesh())
  return eng, eng.load_params()


def _tokens(eng: Engine, params, state, steps: int = 3) -> list[np.ndarray]:
  out = []
  for _ in range(steps):
    state, emitted = eng.decode_step(params, state, limits=StepLimits(np.full(eng.num_slots, 30)))
    out.append(np.asarray(jax.device_get(emitted.tokens)))
  return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("used", [4, 3])  # every row of the prefill, or three of its four (the call pads)
def test_insert_rows_equals_an_insert_each(layout, used):
  eng, params = _engine(layout)
  slots, rows = [2, 0, 3, 1][:used], [0, 1, 2, 3][:used]
  prefix = eng.prefill(params, PROMPTS, row_params=ROWS)
  one_by_one = eng.init_decode_state(5)
  for slot, row in zip(slots, rows):
    one_by_one = eng.insert(prefix, one_by_one, slot, row)
  expected_state = jax.device_get(one_by_one)
  expected_pages = None if eng.pages is None else eng.pages.table.copy()
  expected = _tokens(eng, params, one_by_one)

  together = eng.insert_rows(prefix, eng.init_decode_state(5), slots, rows)
  assert all(eng.slot(s).busy for s in slots) and (used == 4 or not eng.slot(1).busy)
  if expected_pages is not None:
    np.testing.assert_array_equal(eng.pages.table, expected_pages)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(together), expected_state)
  got = _tokens(eng, params, together)
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(a, b)


def test_insert_rows_refuses_a_slot_twice_in_one_line():
  eng, params = _engine("dense")
  prefix = eng.prefill(params, PROMPTS[:2])
  with pytest.raises(ValueError, match="distinct slots"):
    eng.insert_rows(prefix, eng.init_decode_state(), [1, 1], [0, 1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scheduler_inserts_the_jobs_admitted_together_in_one_call(layout):
  eng, params = _engine(layout, decode_steps_per_call=4)
  calls = count_calls(eng, ["insert", "insert_rows"])

  def serve(indices: list[int]) -> dict[int, list[int]]:
    return served(Hiding(eng, "prefill_insert"), params, PROMPTS, ROWS, indices, max_new=6)

  alone = {i: serve([i])[i] for i in range(len(PROMPTS))}
  calls.update(insert=0, insert_rows=0)
  assert serve(list(range(len(PROMPTS)))) == alone
  assert calls == {"insert": 0, "insert_rows": 1}  # four jobs admitted in one loop: one call, not four
