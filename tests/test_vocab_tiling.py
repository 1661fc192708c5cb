"""num_vocab_tiling (models/outputs.head_loss_sums): the output head and the loss computed in tiles of
each row's positions give the untiled loss, z-loss and gradients, keep the compiled step's
temporaries smaller when the vocabulary dominates, and refuse what they cannot serve in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from test_pipeline_parallel import _packed_batch
from test_plan import TINY, analytic
from MaxText import families, models
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.platform import accelerators, sharding
from MaxText.training import train_step
from MaxText.training.objectives.language_model import LanguageModel
from MaxText.training.run_assembly import build_run


def _family_keys(family: str) -> dict:
  hf = H.hf_config(family).to_dict()
  return families.family_for_hf_config(hf).model_keys(hf)


def _config(base: dict, **overrides: object) -> Config:
  return Config.for_testing(**{**base, "dataset_type": "synthetic", "enable_checkpointing": False, "dtype": "float32",
                               "weight_dtype": "float32", "print_config": False, "sharding_tolerance": 0.2,
                               **overrides})


def _batch(rows: int, length: int, vocab: int) -> dict:
  """Two packed documents per row, the last targets padding (weight 0)."""
  batch = _packed_batch(rows, length, vocab)
  batch["targets_segmentation"] = batch["targets_segmentation"].copy()
  batch["targets_segmentation"][:, -3:] = 0
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _assert_close(got: dict, want: dict) -> None:
  """Equal up to float32 summation order (the tiles add their sums in another order)."""
  def close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))
  jax.tree.map(close, got, want)


def _loss_and_grads(config: Config, params: dict, batch: dict) -> tuple[dict, dict]:
  objective = LanguageModel(models.build_model_spec(config.model), config.optim.z_loss_multiplier)
  grad_fn = jax.grad(lambda p: objective.loss_sums(p, None, batch, None), has_aux=True)
  grads, sums = jax.jit(sharding.unsharded()(grad_fn))(params)
  return jax.device_get(sums), jax.device_get(grads)


# gemma2: the tied embedding as the head, with a final soft cap; llama3.1: an output projection.
@pytest.mark.parametrize("family", ["gemma2", pytest.param("llama3.1", marks=pytest.mark.slow)])
def test_tiled_loss_and_gradients_equal_untiled(tiny_overrides, family):
  base = {**tiny_overrides, **_family_keys(family), "base_num_decoder_layers": 1, "max_target_length": 32,
          "z_loss_multiplier": 1e-2}
  untiled, tiled = _config(base), _config(base, num_vocab_tiling=4)
  params = jax.jit(models.build_model_spec(untiled.model).init_params)(jax.random.key(0))
  batch = _batch(2, 32, untiled.model.vocab_size)
  want_sums, want_grads = _loss_and_grads(untiled, params, batch)
  got_sums, got_grads = _loss_and_grads(tiled, params, batch)
  assert want_sums["z_loss_sum"] > 0
  for key in ("xent_sum", "z_loss_sum", "weight_sum"):
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-6, err_msg=key)
  _assert_close(got_grads, want_grads)


@pytest.mark.slow  # ~15 s: two MTP gradients compiled
def test_with_mtp_the_tiled_sums_equal_untiled(tiny_overrides):
  """Multi-token prediction's heads are tiled the same way."""
  base = {**tiny_overrides, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
  untiled, tiled = _config(base), _config(base, num_vocab_tiling=2)
  params = jax.jit(models.build_model_spec(untiled.model).init_params)(jax.random.key(1))
  batch = _batch(2, 32, untiled.model.vocab_size)
  want_sums, want_grads = _loss_and_grads(untiled, params, batch)
  got_sums, got_grads = _loss_and_grads(tiled, params, batch)
  for key in ("xent_sum", "mtp_xent_sum", "mtp_weight_sum"):
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-6, err_msg=key)
  _assert_close(got_grads, want_grads)


def _sharded_sums_and_grads(config: Config, params: dict, batch: dict) -> tuple[dict, dict]:
  run = build_run(config)

  def grads(p: dict, b: dict) -> tuple:
    with sharding.activation_sharding(run.mesh, config.mesh.logical_axis_rules):
      return train_step._grads_and_sums(run.setup, run.objective, config, p, None, b, None)

  got = jax.jit(grads)(jax.device_put(params, run.setup.state_shardings.params), jax.device_put(batch, run.batch_sharding))
  return jax.device_get(got[1]), jax.device_get(got[0])


@pytest.mark.slow  # ~30 s: four sharded gradient steps compiled
@pytest.mark.parametrize("mesh", [
    # The tiles split each device's share of the sequence (sequence parallelism) and the vocabulary
    # stays split over tensor; and the stack's output leaving a GPipe pipeline.
    {"ici_sequence_parallelism": 2, "ici_tensor_parallelism": 2, "ici_fsdp_parallelism": 2},
    {"ici_pipeline_parallelism": 2, "ici_data_parallelism": 4, "ici_fsdp_parallelism": 1},
], ids=["sequence-tensor", "gpipe"])
def test_sharded_tiled_sums_and_gradients_equal_untiled(tiny_overrides, mesh):
  base = {**tiny_overrides, **_family_keys("gemma2"), "base_num_decoder_layers": 2, "max_target_length": 32,
          "z_loss_multiplier": 1e-2, **mesh}
  untiled, tiled = _config(base), _config(base, num_vocab_tiling=4)
  params = jax.device_get(build_run(untiled).init_state(0).params)
  batch = _batch(untiled.data.global_batch_size, 32, untiled.model.vocab_size)
  want_sums, want_grads = _sharded_sums_and_grads(untiled, params, batch)
  got_sums, got_grads = _sharded_sums_and_grads(tiled, params, batch)
  for key in ("xent_sum", "z_loss_sum"):
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-6, err_msg=key)
  _assert_close(got_grads, want_grads)


def _compiled_temp_bytes(config: Config) -> int:
  """Temporary bytes per device of the compiled gradient step under the run's mesh."""
  run = build_run(config)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=run.batch_sharding),
                       _packed_batch(config.data.global_batch_size, config.data.max_target_length, 64))

  def grads(params: dict, b: dict) -> tuple:
    with sharding.activation_sharding(run.mesh, config.mesh.logical_axis_rules):
      return train_step._grads_and_sums(run.setup, run.objective, config, params, None, b, None)

  params = run.abstract_inputs().state.params
  return jax.jit(grads).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_tiling_keeps_the_logits_from_existing_whole(tiny_overrides):
  """A model whose step memory is the logits (vocabulary 32k, width 64): with 4 tiles the step's
  temporaries shrink by well over half of one device's float32 logits."""
  base = {**tiny_overrides, "base_num_decoder_layers": 1, "vocab_size": 32768, "max_target_length": 512,
          "dataset_type": "synthetic", "enable_checkpointing": False}
  untiled = _compiled_temp_bytes(Config.for_testing(**base))
  tiled = _compiled_temp_bytes(Config.for_testing(**base, num_vocab_tiling=4))
  logits_per_device = 512 * 32768 * 4  # one row per device
  assert untiled - tiled > logits_per_device / 2, (untiled, tiled)


@pytest.mark.parametrize("overrides, message", [
    ({"num_vocab_tiling": 0}, "num_vocab_tiling must be a whole number >= 1 (1 = off), got 0"),
    ({"num_vocab_tiling": 5}, "num_vocab_tiling=5 must divide the 32 positions each device holds"),
    ({"num_vocab_tiling": 16, "ici_sequence_parallelism": 4},
     "num_vocab_tiling=16 must divide the 8 positions each device holds (max_target_length=32 / sequence parallelism 4)"),
    ({"num_vocab_tiling": 2, "objective": "distill"}, "num_vocab_tiling=2 is built for objective=lm and sft only, not "
     "objective=distill"),
    ({"num_vocab_tiling": 2, "ici_pipeline_parallelism": 2, "pipeline_schedule": "1f1b", "ici_data_parallelism": 4,
      "ici_fsdp_parallelism": 1}, "num_vocab_tiling=2 is not built for pipeline_schedule=1f1b"),
])
def test_bad_values_are_refused_in_one_line(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    Config.for_testing(**{**tiny_overrides, "dataset_type": "synthetic", **overrides})
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_planner_prices_one_tile_of_logits_and_the_heads_rerun():
  """plan_model.estimate: the logits' float32 bytes divided by num_vocab_tiling, and the head's forward
  matmul once more (the backward re-runs each tile's)."""
  length, tiles, sequences_per_chip = 2048, 4, 2
  base = dict(TINY, vocab_size=32768, max_target_length=length, per_device_batch_size=sequences_per_chip)
  untiled, tiled = analytic("v5e-4", **base), analytic("v5e-4", **base, num_vocab_tiling=tiles)
  logits = sequences_per_chip * length * base["vocab_size"] * 4
  assert untiled.activations - tiled.activations == pytest.approx(logits * (1 - 1 / tiles))
  peak = accelerators.TPU_GENERATIONS["v5e"].peak_tflops * 1e12
  head = 2 * length * base["vocab_size"] * base["base_emb_dim"] * sequences_per_chip / peak
  assert tiled.compute_s - untiled.compute_s == pytest.approx(head)
