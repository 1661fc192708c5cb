"""A decode call whose requests read no top alternatives (StepLimits.top_logprobs=False) gives the same
tokens, counts and chosen log-probabilities, and no alternatives (no top-k on the device, no buffer);
the scheduler asks for them only when a job of the call reads them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import scheduler as sched
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import StepLimits
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh
from test_scheduler import EOS, FakeEngine, job

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4]]
ROWS = [RowParams(seed=0), RowParams(temperature=1.0, seed=7), RowParams(seed=3)]


@pytest.mark.parametrize("steps", [1, 4])
def test_a_call_without_top_alternatives_gives_the_same_tokens(steps):
  eng = Engine(Config.for_testing(**TINY, decode_steps_per_call=steps), num_slots=3, mesh=one_device_mesh())
  params = eng.load_params()
  prefix = eng.prefill(params, PROMPTS, row_params=ROWS)
  ends = np.asarray([len(p) + 16 for p in PROMPTS])  # each call of the three: every slot steps
  runs = {}
  for top in (True, False):
    state = eng.insert_rows(prefix, eng.init_decode_state(), [0, 1, 2], [0, 1, 2])
    calls = []
    for _ in range(3):
      state, emitted = eng.decode_step(params, state, limits=StepLimits(ends, (), top))
      calls.append(jax.device_get(emitted))
    runs[top] = calls
  for with_top, without in zip(runs[True], runs[False]):
    np.testing.assert_array_equal(without.tokens, with_top.tokens)
    np.testing.assert_array_equal(without.counts if steps > 1 else 0, with_top.counts if steps > 1 else 0)
    np.testing.assert_array_equal(without.logprobs.chosen_B, with_top.logprobs.chosen_B)
    assert without.logprobs.top_ids_Bk.shape[-1] == without.logprobs.top_logprobs_Bk.shape[-1] == 0
    assert np.any(with_top.logprobs.top_logprobs_Bk)


class _Recording(FakeEngine):
  def __init__(self, **kw):
    super().__init__(**kw)
    self.tops: list[bool] = []

  def decode_step(self, params, state, active=None, limits=None):
    self.tops.append(limits.top_logprobs)
    return super().decode_step(params, state, active, limits)


def test_the_scheduler_asks_for_the_alternatives_only_when_a_job_reads_them():
  engine = _Recording(num_slots=2)
  s = sched.Scheduler(engine, None, max_queue=8, eos_ids=[EOS]).start()
  try:
    quiet = [job(4, 5, first=10 * (i + 1)) for i in range(2)]
    for j, _ in quiet:
      j.top_logprobs = False
    s.submit([j for j, _ in quiet])
    assert [sink.reason() for _, sink in quiet] == ["length", "length"]
    assert engine.tops and not any(engine.tops)
    engine.tops.clear()
    asks, asks_sink = job(4, 5, first=30)
    s.submit([asks])
    assert asks_sink.reason() == "length"
    assert engine.tops and all(engine.tops)
  finally:
    s.stop(5)
