"""Constrained jobs in calls of several decode steps (decode_steps_per_call > 1, issue 58): a constrained slot
takes one step per call under its mask (its next mask depends on the token it gets), while the slots beside it
take their k steps in the same call. Every job's tokens equal those of one step per call, with the dense cache
and with paged + prefix caching + chunked prefill, and the host's page positions follow each slot's steps."""

from __future__ import annotations

import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import sampling
from MaxText.inference import scheduler as sched
from MaxText.inference.engine import Engine
from MaxText.inference.engine_api import StepLimits
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh
from test_constrained_decoding import VOCAB, PROMPTS, Pattern, bits, run
from test_speculative import TARGET
from test_speculative_serving import PAGED, Sink

K = 4
LAYOUTS = {"dense": {}, "paged_prefix_chunked": dict(PAGED, prefill_chunk_size=4, prefix_caching=True)}


class Runs(Sink):
  """A Sink that also keeps how many tokens each event brought."""

  def __init__(self) -> None:
    super().__init__()
    self.sizes: list[int] = []

  def __call__(self, event: sched.Event) -> None:
    if isinstance(event, sched.Tokens):
      self.sizes.append(len(event.tokens))
    super().__call__(event)


def engine_for(layout: str, steps: int) -> Engine:
  config = Config.for_testing(**TARGET, **LAYOUTS[layout], decode_steps_per_call=steps)
  return Engine(config, num_slots=4, mesh=one_device_mesh())


def serve(engine: Engine, constraints: list, rows: list[RowParams]) -> list[Runs]:
  return run(engine, engine.load_params(seed=1), constraints, rows, max_tokens=9, sink=Runs)


def constraints() -> list:
  """Two unconstrained jobs (greedy, sampled) beside a greedy and a sampled one cycling residues mod 3."""
  cycle = lambda i, t: t % 3 == i % 3  # noqa: E731
  return [None, Pattern(cycle), None, Pattern(cycle)]


ROWS = [RowParams(), RowParams(), RowParams(1.0, 1.0, 0, 7), RowParams(1.0, 0.9, 0, 5)]


@pytest.mark.parametrize("layout", ["dense", pytest.param("paged_prefix_chunked", marks=pytest.mark.slow)])
def test_unconstrained_jobs_take_k_steps_beside_constrained_ones_with_the_same_tokens(layout: str) -> None:
  one = serve(engine_for(layout, 1), constraints(), ROWS)
  several = serve(engine_for(layout, K), constraints(), ROWS)
  for i, (a, b) in enumerate(zip(one, several)):
    assert a.reason == b.reason == "length" and len(b.tokens) == 9, (i, a.reason, b.reason)
    assert b.tokens == a.tokens, i
    np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
  for i in (1, 3):  # constrained: the first token from the prompt, then one per call, each in its mask
    assert set(several[i].sizes) == {1}, several[i].sizes
    assert [t % 3 for t in several[i].tokens] == [j % 3 for j in range(9)]
  for i in (0, 2):  # beside them, several tokens a call
    assert max(several[i].sizes) == K, several[i].sizes


@pytest.mark.parametrize("layout", ["dense", "paged_prefix_chunked"])
def test_a_masked_call_of_k_steps_gives_a_constrained_slot_one_token_and_moves_its_pages_one(layout: str) -> None:
  engine = engine_for(layout, K)
  params = engine.load_params(seed=1)
  state = engine.init_decode_state()
  if engine.pages is not None:
    for slot, prompt in enumerate(PROMPTS):
      start = engine.begin_prompt(slot, prompt)
      while True:
        state, start, first = engine.prefill_chunk(params, state, slot, prompt, start)
        if first is not None:
          break
  else:
    state = engine.insert_rows(engine.prefill(params, PROMPTS), state, [0, 1, 2], [0, 1, 2])
  before = None if engine.pages is None else engine.pages.positions.copy()
  free = np.full(sampling.mask_words(VOCAB), sampling.ALL_TOKENS, np.int32)  # an unconstrained row
  mask = np.stack([bits(np.arange(VOCAB) % 3 == 0), free, free, free])
  ends = np.asarray([len(p) + 12 for p in PROMPTS] + [0])
  state, emitted = engine.decode_step(params, state, mask=mask, limits=StepLimits(ends))
  counts, tokens = np.asarray(emitted.counts), np.asarray(emitted.tokens)
  assert list(counts) == [1, K, K, 0] and int(tokens[0, 0]) % 3 == 0
  if before is not None:
    assert list(engine.pages.positions[:3] - before[:3]) == [1, K, K]
