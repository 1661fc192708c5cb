"""Learning-rate schedule, tied embeddings and dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.training import optimizers
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from train_utils import Run


def _apply(spec, *args):
  with sharding.unsharded():
    return spec.apply(*args)


def test_warmup_then_cosine_schedule():
  config = Config.for_testing(steps=100, learning_rate=1e-3, warmup_steps_fraction=0.1,
                              cosine_learning_rate_final_fraction=0.1, print_config=False)
  schedule = optimizers.learning_rate_schedule(config.optim)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-4)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(55)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)  # half-way down the cosine
  assert float(schedule(100)) == pytest.approx(1e-4)
  assert float(schedule(500)) == pytest.approx(1e-4)


def _inputs(batch: int = 2, length: int = 16):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  return tokens, positions, jnp.ones((batch, length), jnp.int32)


def test_tied_embeddings_use_the_token_table(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, logits_via_embedding=True)
  spec = models.build_model_spec(config.model)
  assert "logits_dense" not in spec.abstract_params
  params = spec.init_params(jax.random.key(0))
  tokens, positions, segments = _inputs()
  logits = _apply(spec, params, tokens, positions, segments)
  scaled = jax.tree.map(lambda x: x, params)
  scaled["token_embedder"]["embedding"] = params["token_embedder"]["embedding"] * 2
  # Doubling the table changes the logits (it is the output projection too).
  assert not np.allclose(_apply(spec, scaled, tokens, positions, segments), logits)


@pytest.mark.parametrize("tied", [True, False])
def test_initial_loss_near_uniform(tiny_overrides, tied):
  """A fresh model's cross-entropy starts near log V, tied or not: a tied table initialised like an
  untied one (unit rows) would start the logits at std sqrt(D) and the loss many times log V."""
  overrides = dict(tiny_overrides, base_emb_dim=256, head_dim=64, vocab_size=1024)
  config = Config.for_testing(**overrides, logits_via_embedding=tied)
  spec = models.build_model_spec(config.model)
  params = spec.init_params(jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (2, 32)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
  logits = _apply(spec, params, tokens, positions, jnp.ones((2, 32), jnp.int32))
  loss = float(jnp.mean(-jax.nn.log_softmax(logits)[:, :-1].reshape(-1, 1024)[
      jnp.arange(62), tokens[:, 1:].reshape(-1)]))
  assert float(jnp.std(logits)) < 3.0
  assert abs(loss - np.log(1024)) < 2.0, loss


def test_dropout_only_with_an_rng(tiny_overrides):
  config = Config.for_testing(**tiny_overrides, dropout_rate=0.5)
  spec = models.build_model_spec(config.model)
  params = spec.init_params(jax.random.key(0))
  tokens, positions, segments = _inputs()
  deterministic = _apply(spec, params, tokens, positions, segments)
  np.testing.assert_array_equal(deterministic, _apply(spec, params, tokens, positions, segments))
  dropped_a = _apply(spec, params, tokens, positions, segments, jax.random.key(1))
  dropped_b = _apply(spec, params, tokens, positions, segments, jax.random.key(1))
  np.testing.assert_array_equal(dropped_a, dropped_b)  # reproducible for a given rng
  assert not np.allclose(dropped_a, deterministic)
  run = Run(config)  # and the train step trains with it
  _, history = run.train(run.init(), 2)
  assert all(np.isfinite(h["loss"]) for h in history)


def test_segments_keep_documents_apart(tiny_overrides):
  """Tokens of a second packed document do not change the first document's logits."""
  config = Config.for_testing(**tiny_overrides)
  spec = models.build_model_spec(config.model)
  params = spec.init_params(jax.random.key(0))
  tokens, _, _ = _inputs(batch=1)
  segments = jnp.asarray([[1] * 8 + [2] * 8])
  positions = jnp.asarray([list(range(8)) * 2])
  logits = _apply(spec, params, tokens, positions, segments)
  other = tokens.at[0, 8:].set((tokens[0, 8:] + 1) % 128)
  np.testing.assert_allclose(_apply(spec, params, other, positions, segments)[0, :8], logits[0, :8], atol=1e-6)
