"""The 1F1B pipeline schedule: the same gradients as GPipe where the two define the same loss
(MoE load balancing and dropout included), fewer live activations, and its config rules.
Equality with the non-pipelined run is in test_pipeline_parallel.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_pipeline_parallel import _grads_and_step, _model_overrides, _packed_batch

from MaxText import train_compile
from MaxText.training import train_step
from MaxText.platform import sharding
from MaxText.configuration.config import BASE_CONFIG_PATH, Config
from MaxText.layers import pipeline, pipeline_timetable
from MaxText.training.run_assembly import build_run


def _config(schedule: str, micro: int, **overrides) -> Config:
  return Config.for_testing(**{**_model_overrides(2), **overrides}, ici_pipeline_parallelism=2,
                            pipeline_schedule=schedule, num_pipeline_microbatches=micro, ici_data_parallelism=4,
                            ici_fsdp_parallelism=1)


def _params_and_batch(config: Config) -> tuple:
  return jax.device_get(build_run(config).init_state(0).params), _packed_batch(config.data.global_batch_size, 16, 64)


@pytest.mark.slow  # ~40 s each: two MoE train steps with dropout compiled
# The interleaved case (circular reference) by default; the plain one is slow-marked (~40 s here).
@pytest.mark.parametrize("reference, repeats", [pytest.param("gpipe", 1, marks=pytest.mark.slow), ("circular", 2)])
def test_moe_and_dropout_gradients_equal_gpipe(reference, repeats):
  """Both schedules compute the load-balancing loss per microbatch and draw dropout masks per
  (layer, microbatch), so here they define exactly the same loss; 1F1B's hand-made backward
  (aux-loss cotangents, dropout keys re-derived in the re-run) must give GPipe's (circular's,
  for interleaved 1F1B) autodiff gradients."""
  moe = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, load_balance_loss_weight=0.1,
             dropout_rate=0.1, num_pipeline_repeats=repeats, base_num_decoder_layers=2 * repeats)
  gpipe, one_f_one_b = _config(reference, 4, **moe), _config("1f1b", 4, **moe)
  params, batch = _params_and_batch(gpipe)
  want_grads, want_sums, want, _ = _grads_and_step(gpipe, params, batch)
  got_grads, got_sums, got, _ = _grads_and_step(one_f_one_b, params, batch)
  for key in want_sums:
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=2e-5, err_msg=key)
  assert float(got_sums["moe_lb_loss_sum"]) > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads)
  for key in ("loss", "moe_lb_loss", "grad_norm"):
    np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)


def _compiled_temp_bytes(config: Config) -> int:
  run = build_run(config)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=run.batch_sharding),
                       _packed_batch(config.data.global_batch_size, config.data.max_target_length, 64))

  def grads(params, b):
    with sharding.activation_sharding(run.mesh, config.mesh.logical_axis_rules):
      return train_step._grads_and_sums(run.setup, run.objective, config, params, None, b, None)

  params = run.abstract_inputs().state.params
  return jax.jit(grads).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


# The interleaved case (circular reference) by default; the plain one is slow-marked (~40 s here).
@pytest.mark.parametrize("reference, repeats", [pytest.param("gpipe", 1, marks=pytest.mark.slow), ("circular", 2)])
def test_1f1b_keeps_fewer_activations_than_gpipe(reference, repeats):
  """16 microbatches over 2 stages: GPipe's (circular's) backward needs every forward iteration's
  stage buffer (M·R + S - 1 iterations x 2 stages), 1F1B only the ring of stage inputs whose
  backward has not run (3 slots per stage; 5 interleaved); the compiled step's temporaries must
  shrink by (at least most of) the difference."""
  big = dict(max_target_length=256, per_device_batch_size=8, base_emb_dim=256, base_mlp_dim=256, remat_policy="full",
             base_num_decoder_layers=2 * repeats, num_pipeline_repeats=repeats)
  config = _config("1f1b", 16, **big)
  baseline = _compiled_temp_bytes(_config(reference, 16, **big))
  one_f_one_b = _compiled_temp_bytes(config)
  rows = config.data.global_batch_size // 4 // 16  # per data shard (data=4), per microbatch
  microbatch_bytes = rows * 256 * 256 * np.dtype(config.model.dtype).itemsize
  slots = pipeline_timetable.build(2, 16, repeats).num_slots
  assert slots == (3 if repeats == 1 else 5)
  expected_saving = (pipeline.num_iterations(2, 16, repeats) * 2 - 2 * slots) * microbatch_bytes
  print(f"temporaries per device: {reference} {baseline / 2**20:.2f} MiB, 1f1b {one_f_one_b / 2**20:.2f} MiB, "
        f"expected saving {expected_saving / 2**20:.2f} MiB")
  assert baseline - one_f_one_b >= 0.8 * expected_saving
  assert one_f_one_b < 0.75 * baseline


def test_describe_and_bubble():
  config = _config("1f1b", 8, per_device_batch_size=4)
  line = pipeline.describe(config.model.pipeline)
  assert "1f1b schedule, 2 stages, 8 microbatches" in line and "at most 3 microbatch inputs kept per stage" in line
  assert f"bubble fraction {1 / 9:.3f}" in line  # GPipe's: (S - 1) / (M + S - 1)


def test_describe_interleaved():
  config = _config("1f1b", 8, num_pipeline_repeats=2, per_device_batch_size=4, base_num_decoder_layers=4)
  line = pipeline.describe(config.model.pipeline)
  assert line.startswith("pipeline: interleaved 1f1b schedule, 2 stages, 8 microbatches, 1 layers per stage x 2 "
                         "repeats; 17 iterations")
  assert f"bubble fraction {1 / 17:.3f}" in line and "at most 5 stage inputs (microbatch x pass) kept" in line


@pytest.mark.parametrize("repeats, expected", [
    (1, "pipeline: 1f1b schedule, 2 stages, 4 microbatches, 2 layers per stage; 5 iterations"),
    pytest.param(2, "pipeline: interleaved 1f1b schedule, 2 stages, 4 microbatches, 1 layers per stage x 2 repeats; 9 iterations",
                 marks=pytest.mark.slow),
])
def test_compiles_for_a_v5p_topology(capsys, repeats, expected):
  argv = ["train_compile", str(BASE_CONFIG_PATH), "compile_topology=v5p-8", "ici_pipeline_parallelism=2",
          "pipeline_schedule=1f1b", f"num_pipeline_repeats={repeats}", "num_pipeline_microbatches=4",
          "base_emb_dim=256", "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=64", "base_mlp_dim=512",
          "base_num_decoder_layers=4", "vocab_size=256", "max_target_length=128", "per_device_batch_size=2",
          "print_config=False"]
  assert train_compile.main(argv) == 0
  out = capsys.readouterr().out
  assert "mesh: stage=2, fsdp=2" in out and expected in out
  assert "from the XLA buffer assignment" in out
  assert "fits:" in out


# The interleaved case (circular reference) by default; the plain one is slow-marked (~40 s here).
# A composition (1F1B inside the accumulation scan): both cases slow; each part runs by default.
@pytest.mark.parametrize("reference, repeats", [pytest.param("gpipe", 1, marks=pytest.mark.slow),
                                                pytest.param("circular", 2, marks=pytest.mark.slow)])
def test_gradient_accumulation_over_1f1b_equals_gpipe(reference, repeats):
  """The 1F1B custom_vjp also runs inside the gradient-accumulation scan."""
  accum = dict(gradient_accumulation_steps=2, per_device_batch_size=4, num_pipeline_repeats=repeats,
               base_num_decoder_layers=2 * repeats)
  gpipe, one_f_one_b = _config(reference, 4, **accum), _config("1f1b", 4, **accum)
  params, batch = _params_and_batch(gpipe)
  want_grads, want_sums, _, _ = _grads_and_step(gpipe, params, batch)
  got_grads, got_sums, _, _ = _grads_and_step(one_f_one_b, params, batch)
  np.testing.assert_allclose(got_sums["xent_sum"], want_sums["xent_sum"], rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads)
