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
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", nucleus_p=0.8)), [0, 0.625, 0, 0.375], atol=TOL)
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", nucleus_p=0.81)),
                             [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], atol=TOL)
  np.testing.assert_allclose(frequencies(SamplingParams("nucleus", nucleus_p=1.0)), PROBS, atol=TOL)


def test_top_k_renormalises_over_the_k_best():
  np.testing.assert_allclose(frequencies(SamplingParams("topk", top_k=2)), [0, 0.625, 0, 0.375], atol=TOL)
  expected = softmax(np.log([0.5, 0.15, 0.3]) / 2.0)
  np.testing.assert_allclose(frequencies(SamplingParams("topk", top_k=3, temperature=2.0))[1:], expected, atol=TOL)


@pytest.mark.parametrize("params", [SamplingParams("topk", top_k=1), SamplingParams("nucleus", nucleus_p=1e-6),
                                    SamplingParams("greedy")])
def test_degenerate_settings_are_greedy(params):
  logits = jax.random.normal(jax.random.key(1), (64, 100))
  tokens = sampling.sample(logits, jax.random.key(2), params)
  np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("strategy", ["weighted", "nucleus", "topk"])
def test_fixed_seed_reproduces_and_other_seeds_differ(strategy):
  logits = jax.random.normal(jax.random.key(1), (64, 100))
  params = SamplingParams(strategy, temperature=1.0, nucleus_p=0.9, top_k=20)
  first = np.asarray(sampling.sample(logits, jax.random.key(7), params))
  np.testing.assert_array_equal(first, np.asarray(sampling.sample(logits, jax.random.key(7), params)))
  assert (first != np.asarray(sampling.sample(logits, jax.random.key(8), params))).any()
