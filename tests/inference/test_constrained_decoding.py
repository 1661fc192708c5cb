"""Constrained decoding's device side (sampling.apply_token_mask) and its path through the scheduler and
every engine: a masked greedy row equals the unmasked one where the mask allows the argmax, a sampled
row never leaves its mask, and jobs with token constraints get only allowed tokens, the first (sampled
after the prompt) included, with the dense cache, the paged cache with prefix caching and chunked prefill,
and speculative decoding (a constrained slot takes no draft token), while an unconstrained job beside
them gets its plain greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import decode_state, sampling
from MaxText.inference import scheduler as sched
from MaxText.inference.decode_state import RowSampling
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh
from test_speculative import TARGET
from test_speculative_serving import CASES, PAGED, Sink, build

VOCAB = TARGET["vocab_size"]


def bits(allowed: np.ndarray) -> np.ndarray:
  """The int32 bitmask row of a bool [V] (the bits past V clear: a constrained row)."""
  row = np.zeros(sampling.mask_words(len(allowed)) * 32, np.uint8)
  row[:len(allowed)] = allowed
  return np.packbits(row, bitorder="little").view(np.int32)


def rows_of(temperature: float, n: int) -> RowSampling:
  rows = decode_state.row_sampling([RowParams(temperature, 1.0, 0, seed) for seed in range(n)])
  return decode_state.seeded(rows)


def test_a_mask_allowing_the_argmax_leaves_greedy_as_it_was_and_sampling_stays_inside():
  logits = jax.random.normal(jax.random.key(0), (4, VOCAB)) * 3
  argmax = np.asarray(jnp.argmax(logits, -1))
  rng = np.random.default_rng(0)
  allowed = rng.random((4, VOCAB)) < 0.3
  allowed[1, argmax[1]] = True  # row 1: the argmax allowed
  allowed[2, argmax[2]] = False  # row 2: not
  allowed[3] = False
  allowed[3, 7] = True  # row 3: one token
  mask = np.stack([np.full(sampling.mask_words(VOCAB), sampling.ALL_TOKENS, np.int32)] + [bits(a) for a in allowed[1:]])
  np.testing.assert_array_equal(np.asarray(sampling.allowed_tokens(jnp.asarray(mask), VOCAB))[1:], allowed[1:])
  assert list(np.asarray(sampling.constrained_rows(jnp.asarray(mask)))) == [False, True, True, True]
  greedy, _, _ = decode_state.sample(logits, rows_of(0.0, 4), jnp.asarray(mask))
  greedy = np.asarray(greedy)
  assert greedy[0] == argmax[0] and greedy[1] == argmax[1] and greedy[3] == 7
  assert allowed[2, greedy[2]] and greedy[2] == np.flatnonzero(allowed[2])[np.argmax(np.asarray(logits)[2,
                                                                                     allowed[2]])]
  for seed in range(20):
    rows = decode_state.seeded(decode_state.row_sampling([RowParams(1.0, 0.9, 0, seed + i) for i in range(4)]))
    drawn = np.asarray(decode_state.sample(logits, rows, jnp.asarray(mask))[0])
    assert all(allowed[i, drawn[i]] for i in (1, 2, 3)), drawn


class Pattern:
  """A stand-in grammar (a scheduler.TokenConstraint): token i of the job must be `allowed(i)`; it ends after `length`."""

  def __init__(self, allowed, length: int = 10**6):
    self.allowed, self.length, self.got = allowed, length, []
    self.words = sampling.mask_words(VOCAB)

  def fill(self, row: np.ndarray) -> None:
    row[:] = bits(np.asarray([self.allowed(len(self.got), t) for t in range(VOCAB)]))

  def advance(self, token: int) -> bool:
    assert self.allowed(len(self.got), token), (len(self.got), token)
    self.got.append(token)
    return len(self.got) >= self.length

  def failure(self) -> str:
    return ""


PROMPTS = [[3, 9, 27], [100, 5, 6, 7, 8, 1], [1, 2, 3, 4, 5, 6, 7, 8]]


def run(engine, params, constraints, rows=None, max_tokens: int = 7) -> list[Sink]:
  scheduler = sched.Scheduler(engine, params, max_queue=16).start()
  sinks = [Sink() for _ in constraints]
  rows = rows or [RowParams()] * len(constraints)
  try:
    scheduler.submit([sched.Job(i, PROMPTS[i % len(PROMPTS)], max_tokens, r, s, constraint=c)
                      for i, (c, r, s) in enumerate(zip(constraints, rows, sinks))])
    for sink in sinks:
      assert sink.done.wait(300), "a job did not end"
    return sinks
  finally:
    scheduler.stop(30)


def check_masks(engine, params) -> None:
  """Greedy jobs: (0) unconstrained; (1) a mask that always allows job 0's greedy token of that prompt plus
  a third of the rest: the same tokens; (2) residues mod 3 cycling with the position, greedy and (3)
  sampled: every token, the first too, in its mask; (4) a grammar that ends after 3 tokens."""
  plain = run(engine, params, [None] * len(PROMPTS))
  want = {i: sink.tokens for i, sink in enumerate(plain)}
  keep_1 = lambda i, t: t == want[1][i] or t % 3 == 0  # noqa: E731
  cycle = lambda i, t: t % 3 == i % 3  # noqa: E731
  constraints = [None, Pattern(keep_1), Pattern(cycle), Pattern(cycle), Pattern(cycle, length=3)]
  rows = [RowParams()] * 3 + [RowParams(1.0, 1.0, 0, 5), RowParams()]
  got = run(engine, params, constraints, rows)
  assert got[0].tokens == want[0] and got[1].tokens == want[1]
  for sink in got[2:4]:
    assert [t % 3 for t in sink.tokens] == [i % 3 for i in range(len(sink.tokens))] and len(sink.tokens) == 7
  assert len(got[4].tokens) == 3 and got[4].reason == "stop"


@pytest.mark.parametrize("layout", ["dense", "paged_prefix_chunked"])
def test_constrained_jobs_get_only_allowed_tokens(layout):
  overrides = TARGET if layout == "dense" else dict(TARGET, **PAGED, prefill_chunk_size=4, prefix_caching=True)
  engine = Engine(Config.for_testing(**overrides), num_slots=3, mesh=one_device_mesh())
  check_masks(engine, engine.load_params(seed=1))


@pytest.mark.parametrize("case", ["llama_dense", "llama_paged_chunked_prefix"])
def test_speculative_constrained_slots_take_no_draft_and_stay_in_their_mask(case):
  target, target_params, spec, params = build(*CASES[case])
  check_masks(spec, params)
