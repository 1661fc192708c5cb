"""Sampling strategies against their definitions computed with numpy: which tokens can be drawn and
with what frequency; fixed seeds reproduce; top-k=1 and tiny nucleus are greedy."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.inference import sampling
from MaxText.inference.sampling import SamplingParams

PROBS = np.asarray([0.05, 0.5, 0.15, 0.3])  # token 1 most likely, then 3, 2, 0
DRAWS = 20000


def frequencies(params: SamplingParams, probs: np.ndarray = PROBS, seed: int = 0) -> np.ndarray:
  logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (DRAWS, len(probs)))
  tokens = jax.jit(sampling.sample, static_argnums=2)(logits_BV, jax.random.key(seed), params)
  return np.bincount(np.asarray(tokens), minlength=len(probs)) / DRAWS


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max())
  return e / e.sum()


# Binomial standard error at 20000 draws is at most 0.0035; 0.015 is > 4 standard errors.
TOL = 0.015


def test_weighted_follows_tempered_softmax():
  for temperature in (1.0, 2.0, 0.5):
    expected = softmax(np.log(PROBS) / temperature)
    np.testing.assert_allclose(frequencies(SamplingParams("weighted", temperature=temperature)), expected, atol=TOL)


def test_nucleus_keeps_the_smallest_set_reaching_p():
  # Sorted masses 0.5, 0.3, 0.15, 0.05: p=0.8 is reached by {1, 3}; p=0.81 also needs token 2.
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", top_p=0.8)), [0, 0.625, 0, 0.375], atol=TOL)
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", top_p=0.81)),
                             [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], atol=TOL)
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", top_p=1.0)), PROBS, atol=TOL)


def test_top_k_renormalises_over_the_k_best():
  np.testing.assert_allclose(frequencies(SamplingParams("topk", top_k=2)), [0, 0.625, 0, 0.375], atol=TOL)
  expected = softmax(np.log([0.5, 0.15, 0.3]) / 2.0)
  np.testing.assert_allclose(frequencies(SamplingParams("topk", top_k=3, temperature=2.0))[1:], expected, atol=TOL)


@pytest.mark.parametrize("params", [SamplingParams("topk", top_k=1), SamplingParams("nucleus", top_p=1e-6),
                                    SamplingParams("greedy")])
def test_degenerate_settings_are_greedy(params):
  logits = jax.random.normal(jax.random.key(1), (64, 100))
  tokens = sampling.sample(logits, jax.random.key(2), params)
  np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("strategy", ["weighted", "nucleus", "topk"])
def test_fixed_seed_reproduces_and_other_seeds_differ(strategy):
  logits = jax.random.normal(jax.random.key(1), (64, 100))
  params = SamplingParams(strategy, temperature=1.0, top_p=0.9, top_k=20)
  first = np.asarray(sampling.sample(logits, jax.random.key(7), params))
  np.testing.assert_array_equal(first, np.asarray(sampling.sample(logits, jax.random.key(7), params)))
  assert (first != np.asarray(sampling.sample(logits, jax.random.key(8), params))).any()


def row_frequencies(temperature: float, top_p: float, top_k: int, probs: np.ndarray = PROBS) -> np.ndarray:
  """sample_rows with DRAWS rows, each with its own key and these parameters."""
  logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (DRAWS, len(probs)))
  keys_B = jax.random.key_data(jax.random.split(jax.random.key(3), DRAWS))
  full = lambda value, dtype: jnp.full((DRAWS,), value, dtype)  # noqa: E731
  tokens = jax.jit(sampling.sample_rows)(logits_BV, keys_B, full(temperature, jnp.float32), full(top_p, jnp.float32),
                                         full(top_k, jnp.int32))
  return np.bincount(np.asarray(tokens), minlength=len(probs)) / DRAWS


def test_per_row_sampling_follows_the_same_definitions():
  np.testing.assert_allclose(row_frequencies(2.0, 1.0, 0), softmax(np.log(PROBS) / 2.0), atol=TOL)
  np.testing.assert_allclose(row_frequencies(1.0, 0.8, 0), [0, 0.625, 0, 0.375], atol=TOL)
  np.testing.assert_allclose(row_frequencies(1.0, 1.0, 2), [0, 0.625, 0, 0.375], atol=TOL)
  # top-k first, then top-p over the survivors renormalised: {1, 3, 2} -> 0.5/0.95 reaches 0.5.
  np.testing.assert_allclose(row_frequencies(1.0, 0.5, 3), [0, 1, 0, 0], atol=TOL)


def test_per_row_parameters_are_each_rows_own():
  """Greedy rows (temperature 0) are the argmax beside sampled rows; a row's draws depend on its
  own key only, not on its neighbours' parameters."""
  logits = jax.random.normal(jax.random.key(1), (8, 100))
  keys = jax.random.key_data(jax.random.split(jax.random.key(4), 8))
  temperature = jnp.asarray([0, 1, 0, 1, 0, 1, 0, 1], jnp.float32)
  tokens = np.asarray(sampling.sample_rows(logits, keys, temperature, jnp.ones(8), jnp.zeros(8, jnp.int32)))
  greedy = np.argmax(np.asarray(logits), axis=-1)
  np.testing.assert_array_equal(tokens[::2], greedy[::2])
  all_sampled = np.asarray(sampling.sample_rows(logits, keys, jnp.ones(8), jnp.ones(8), jnp.zeros(8, jnp.int32)))
  np.testing.assert_array_equal(tokens[1::2], all_sampled[1::2])
  assert (all_sampled != greedy).any()


def _primitives(jaxpr: Any, inside_cond: bool = False) -> Iterator[tuple[str, bool]]:
  """(primitive name, whether it runs inside a `cond` branch) for every equation, nested calls included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name, inside_cond
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _primitives(inner, inside_cond or eqn.primitive.name == "cond")


def test_greedy_is_argmax_without_its_reduction() -> None:
  """The first of equal maxima, NaN as the largest, rows of -inf, as jnp.argmax; but no argmax
  primitive (a (value, index) reduction, which XLA's CPU backend runs one element at a time)."""
  logits = np.array(jax.random.normal(jax.random.key(3), (9, 50)), np.float32)
  logits[1, [4, 30]] = 9.0  # a tie: the first wins
  logits[2, [7, 40]] = np.nan  # the first NaN wins
  logits[3] = -np.inf
  logits[4, 11] = np.inf
  logits[5, [2, 3]] = np.inf
  logits[6, 0] = np.nan
  logits[7, 49] = np.nan
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(logits, dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.greedy)(x)), np.asarray(jnp.argmax(x, axis=-1)))
  assert "argmax" not in {name for name, _ in _primitives(jax.make_jaxpr(sampling.greedy)(logits).jaxpr)}


def _rows(temperature: list[float]) -> Any:
  from MaxText.inference.decode_state import RowSampling
  n = len(temperature)
  return RowSampling(jnp.asarray(temperature, jnp.float32), jnp.ones(n), jnp.zeros(n, jnp.int32),
                     jax.random.key_data(jax.random.split(jax.random.key(5), n)), jnp.zeros(n, jnp.int32))


def test_keys_split_only_when_a_row_samples() -> None:
  """decode_state.sample splits the rows' keys inside the branch that samples: a batch of greedy rows
  (or whose sampled rows are not live) runs no PRNG and keeps its keys; a batch with a sampled row
  advances every key and draws as before (split, then sample_rows)."""
  from MaxText.inference import decode_state
  logits = jax.random.normal(jax.random.key(1), (4, 100))
  jaxpr = jax.make_jaxpr(lambda x, r: decode_state.sample(x, r, top=False))(logits, _rows([0.0] * 4)).jaxpr
  random_ops = [(name, in_cond) for name, in_cond in _primitives(jaxpr) if name.startswith(("random", "threefry"))]
  assert random_ops and all(in_cond for _, in_cond in random_ops), random_ops

  greedy_rows = _rows([0.0] * 4)
  tokens, rows, _ = decode_state.sample(logits, greedy_rows, top=False)
  np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), axis=-1))
  np.testing.assert_array_equal(np.asarray(rows.keys_B), np.asarray(greedy_rows.keys_B))

  mixed = _rows([0.0, 1.0, 0.0, 0.7])
  tokens, rows, _ = decode_state.sample(logits, mixed, top=False)
  next_keys, draw_keys = sampling.split_rows(mixed.keys_B)
  np.testing.assert_array_equal(np.asarray(rows.keys_B), np.asarray(next_keys))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(sampling.sample_rows(
      logits, draw_keys, mixed.temperature_B, mixed.top_p_B, mixed.top_k_B)))

  live = jnp.asarray([True, False, True, False])  # the sampled rows are stopped: their results are dropped
  tokens, rows, _ = decode_state.sample(logits, mixed, top=False, live_B=live)
  np.testing.assert_array_equal(np.asarray(rows.keys_B), np.asarray(mixed.keys_B))
  np.testing.assert_array_equal(np.asarray(tokens)[[0, 2]], np.argmax(np.asarray(logits), axis=-1)[[0, 2]])


def test_rows_that_cut_nothing_sort_nothing() -> None:
  """masked_logits sorts inside a branch taken only when a sampled row has top_p < 1 or a top_k below the
  vocabulary: rows keeping every token get their scaled logits as they are, also beside a row that cuts.
  (Before, every sampled batch sorted the vocabulary, and a top_p of 1 cut the tokens whose mass before them
  rounded up to 1.)"""
  logits = jax.random.normal(jax.random.key(1), (4, 100)) * 3
  temperature = jnp.asarray([0.7, 1.0, 0.0, 1.3], jnp.float32)
  scaled = np.asarray(logits, np.float32) / np.maximum(np.asarray(temperature), 1e-6)[:, None]

  def masked(top_p: list[float], top_k: list[int]) -> jax.Array:
    return sampling.masked_logits(logits, temperature, jnp.asarray(top_p, jnp.float32), jnp.asarray(top_k, jnp.int32))

  kept = np.asarray(masked([1.0] * 4, [0, 100, 5, 0]))  # row 2 is greedy: never read
  np.testing.assert_allclose(kept, scaled, rtol=1e-6)
  mixed = np.asarray(masked([1.0, 0.5, 1.0, 1.0], [0, 0, 0, 3]))
  np.testing.assert_array_equal(mixed[[0, 2]], kept[[0, 2]])
  assert np.isinf(mixed[1]).any() and np.isinf(mixed[3]).sum() == 97
  sorts = [in_cond for name, in_cond in _primitives(jax.make_jaxpr(masked)([1.0] * 4, [0] * 4).jaxpr) if name == "sort"]
  assert sorts and all(sorts), sorts
