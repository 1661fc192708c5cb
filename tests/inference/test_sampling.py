"""Sampling strategies against their definitions computed with numpy: which tokens can be drawn and
with what frequency; fixed seeds reproduce; top-k=1 and tiny nucleus are greedy."""

from __future__ import annotations

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
