"""Multi-token prediction (layers/mtp.py): an objective that leaves the next-token model alone when
its weight is 0, sees nothing across packed documents, learns, and converts with DeepSeek-V3's
published layout (the module stored as layer num_hidden_layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models, sharding
from MaxText.config import Config
from MaxText.errors import ConfigError
from train_utils import Run


def _mtp(tiny_overrides, **overrides) -> Config:
  return Config.for_testing(**{**tiny_overrides, "dataset_type": "synthetic", "enable_checkpointing": False,
                               "ici_data_parallelism": 2, "ici_fsdp_parallelism": 4, **overrides})


def test_with_zero_weight_the_next_token_model_trains_exactly_as_without_mtp(tiny_overrides):
  plain = Run(_mtp(tiny_overrides))
  with_mtp = Run(_mtp(tiny_overrides, mtp_num_layers=2, mtp_loss_scaling_factor=0.0))
  plain_state, plain_history = plain.train(plain.init(), 3)
  mtp_state, mtp_history = with_mtp.train(with_mtp.init(), 3)
  assert set(mtp_state.params) == set(plain_state.params) | {"mtp_0", "mtp_1"}
  shared = {k: v for k, v in mtp_state.params.items() if not k.startswith("mtp_")}
  jax.tree.map(np.testing.assert_array_equal, shared, plain_state.params)
  assert [h["loss"] for h in mtp_history] == [h["loss"] for h in plain_history]
  assert all(4.0 < h["mtp_loss"] < 6.0 for h in mtp_history) and "mtp_loss" not in plain_history[0]


def _mtp_sums(spec, params, tokens, segments, positions):
  """The MTP sums for rows of packed documents, targets being each document's next token."""
  targets = jnp.roll(tokens, -1, axis=1)
  weights = ((jnp.roll(segments, -1, axis=1) == segments) & (segments != 0)).astype(jnp.float32)
  _, aux = sharding.unsharded()(spec.apply_with_aux)(params, tokens, positions, segments, None, (targets, weights))
  return float(aux["mtp_xent_sum"]), float(aux["mtp_weight_sum"])


def test_packed_documents_give_the_sums_of_each_document_alone(tiny_overrides):
  """Neither the look-ahead embedding nor the MTP layer's attention may cross a document boundary:
  two documents packed in one row give the MTP sums of the two run on their own."""
  config = _mtp(tiny_overrides, mtp_num_layers=2)
  spec = models.build_model_spec(config.model)
  params = jax.jit(spec.init_params)(jax.random.key(0))
  rng = np.random.default_rng(0)
  a, b = rng.integers(1, 100, 11), rng.integers(1, 100, 9)

  def row(*docs):
    pad = 20 - sum(map(len, docs))
    tokens = np.concatenate([*docs, np.zeros(pad, np.int64)])
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(pad, np.int64)])
    positions = np.concatenate([np.arange(len(d)) for d in docs] + [np.zeros(pad, np.int64)])
    return [jnp.asarray(x, jnp.int32)[None] for x in (tokens, segments, positions)]

  packed = _mtp_sums(spec, params, *row(a, b))
  first, second = _mtp_sums(spec, params, *row(a)), _mtp_sums(spec, params, *row(b))
  np.testing.assert_allclose(packed[0], first[0] + second[0], rtol=1e-5)
  # Depth k scores n - 1 - k positions of an n-token document.
  assert packed[1] == first[1] + second[1] == (11 - 2 + 11 - 3) + (9 - 2 + 9 - 3)


def test_mtp_learns_to_predict_further_ahead(tiny_overrides):
  run = Run(_mtp(tiny_overrides, mtp_num_layers=1, mtp_loss_scaling_factor=1.0, vocab_size=64, learning_rate=3e-3,
                 steps=40))
  _, history = run.train(run.init(), 40)
  assert np.mean([h["mtp_loss"] for h in history[-5:]]) < np.mean([h["mtp_loss"] for h in history[:3]]) - 0.5


def test_mtp_with_pipeline_stages_is_refused():
  with pytest.raises(ConfigError, match="mtp_num_layers > 0 is not supported with pipeline parallelism"):
    Config.for_testing(mtp_num_layers=1, ici_pipeline_parallelism=2, ici_fsdp_parallelism=-1,
                       base_num_decoder_layers=2)
