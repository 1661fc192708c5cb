"""Pipeline parallelism on the `stage` axis: the loss and gradients of each schedule equal the
non-pipelined run on the 8 simulated CPU devices; bad configs are one-line errors; the bubble
fraction; an AOT compile for a v5p topology with stages > 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import train_compile
from MaxText.training import train_state, train_step
from MaxText.platform import sharding
from MaxText.training.run_assembly import build_run
from MaxText.configuration.config import BASE_CONFIG_PATH, Config
from MaxText.errors import ConfigError
from MaxText.layers import pipeline


def _model_overrides(num_layers: int) -> dict:
  # Alternating local/global attention makes every layer's output depend on its true layer index.
  return dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=1, head_dim=16, base_mlp_dim=64,
              base_num_decoder_layers=num_layers, vocab_size=64, max_target_length=16, per_device_batch_size=2,
              attention_layer_pattern=["local", "global"], sliding_window_size=4, print_config=False)


def _packed_batch(global_batch: int, length: int, vocab: int) -> dict:
  """Random tokens packed as two documents per row, so positions and segment ids matter."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, vocab, (global_batch, length + 1), dtype=np.int32)
  cut = length // 2 - 1
  segments = np.where(np.arange(length) < cut, 1, 2).astype(np.int32)[None].repeat(global_batch, 0)
  positions = np.where(np.arange(length) < cut, np.arange(length), np.arange(length) - cut)
  positions = positions.astype(np.int32)[None].repeat(global_batch, 0)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": positions,
          "inputs_segmentation": segments, "targets_segmentation": segments}


def _grads_and_step(config: Config, params, batch: dict):
  """(gradients, loss sums, metrics of one full jitted train step) for `config` from `params`."""
  run = build_run(config)
  setup = run.setup
  batch = jax.device_put(batch, run.batch_sharding)
  params = jax.device_put(params, setup.state_shardings.params)

  def grads_fn(p, b):
    with sharding.activation_sharding(run.mesh, config.mesh.logical_axis_rules):
      return train_step._grads_and_sums(setup, run.objective, config, p, None, b, None)

  grads, sums = jax.jit(grads_fn)(params, batch)
  # Per-token gradients, as the optimizer sees them (the raw sums grow with the token count).
  grads = jax.tree.map(lambda g: g / sums["weight_sum"], grads)
  state = run.init_state(0).replace(params=params)
  state = state.replace(opt_state=jax.jit(setup.optimizer.init, out_shardings=setup.state_shardings.opt_state)(params))
  new_state, metrics = run.train_step(state, batch, jax.random.key(0))
  return jax.device_get(grads), jax.device_get(sums), jax.device_get(metrics), jax.device_get(new_state.params)


@pytest.mark.parametrize("schedule, stages, repeats, micro, other_axis", [
    pytest.param("gpipe", 2, 1, 4, dict(ici_data_parallelism=4), marks=pytest.mark.slow),
    # Stage=4 cases take ~30-55 s each on the 2-core CI machine: slow-marked. By default stage=2 covers
    # circular and 1F1B; gpipe and interleaved 1F1B at stage=2 are slow too (the default run's budget).
    pytest.param("gpipe", 4, 1, 4, dict(ici_fsdp_parallelism=2), marks=pytest.mark.slow),
    ("circular", 2, 2, 2, dict(ici_fsdp_parallelism=4)),
    pytest.param("circular", 4, 2, 4, dict(ici_data_parallelism=2), marks=pytest.mark.slow),
    # 1F1B with more microbatches than ring slots (2S - 1 = 3), so slots are reused.
    ("1f1b", 2, 1, 4, dict(ici_data_parallelism=4)),
    pytest.param("1f1b", 4, 1, 8, dict(ici_fsdp_parallelism=2), marks=pytest.mark.slow),
    # Interleaved 1F1B: two groups of two microbatches, two passes each.
    pytest.param("1f1b", 2, 2, 4, dict(ici_data_parallelism=4), marks=pytest.mark.slow),
    pytest.param("1f1b", 4, 2, 8, dict(ici_fsdp_parallelism=2), marks=pytest.mark.slow),
])
def test_pipeline_equals_the_non_pipelined_run(schedule, stages, repeats, micro, other_axis):
  layers = stages * repeats
  other = {"ici_fsdp_parallelism": 1, **other_axis}
  piped = Config.for_testing(**_model_overrides(layers), ici_pipeline_parallelism=stages, pipeline_schedule=schedule,
                             num_pipeline_repeats=repeats, num_pipeline_microbatches=micro, **other)
  plain = Config.for_testing(**_model_overrides(layers))  # fsdp over all 8 devices
  assert piped.model.pipeline.num_pipeline_stages == stages and piped.model.layers_per_pipeline_stage == 1
  params = jax.device_get(build_run(plain).init_state(0).params)
  batch = _packed_batch(plain.data.global_batch_size, 16, 64)

  want_grads, want_sums, want_metrics, want_params = _grads_and_step(plain, params, batch)
  got_grads, got_sums, got_metrics, got_params = _grads_and_step(piped, params, batch)
  for key in want_sums:
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=2e-5, err_msg=key)
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)  # noqa: E731
  jax.tree.map(close, got_grads, want_grads)
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=2e-5, err_msg=key)
  jax.tree.map(close, got_params, want_params)
  # The layer gradients are not trivially zero (a pipeline that dropped microbatches would fail above).
  assert float(np.abs(np.asarray(jax.tree.leaves(got_grads["layers"])[0])).max()) > 0


@pytest.mark.slow  # ~50 s: two MoE train steps compiled
@pytest.mark.parametrize("mesh", [
    dict(ici_data_parallelism=4, ici_fsdp_parallelism=1),
    # Expert parallelism's all-to-all shard_map under the pipeline's vmap over stages (JAX refused it).
    dict(ici_expert_parallelism=2, ici_data_parallelism=2, ici_fsdp_parallelism=1, moe_dispatch="all_to_all")],
    ids=["data", "expert-all_to_all"])
def test_moe_under_the_pipeline_matches_the_non_pipelined_run(mesh):
  # The cross-entropy loss is the same; the load-balancing loss is computed per microbatch in
  # the pipeline (its f·P product is not linear in the batch), so it differs by a little.
  moe = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, load_balance_loss_weight=0.01)
  piped = Config.for_testing(**_model_overrides(2), **moe, ici_pipeline_parallelism=2, num_pipeline_microbatches=4,
                             **mesh)
  plain = Config.for_testing(**_model_overrides(2), **moe)
  params = jax.device_get(build_run(plain).init_state(0).params)
  batch = _packed_batch(plain.data.global_batch_size, 16, 64)
  _, _, want, _ = _grads_and_step(plain, params, batch)
  _, _, got, _ = _grads_and_step(piped, params, batch)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)
  np.testing.assert_allclose(got["moe_lb_loss"], want["moe_lb_loss"], rtol=0.05)
  np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-3)


def test_a_forward_of_fewer_rows_than_microbatches_is_one_line():
  """The uncached forward (logit_checker, an engine's score) of one row under a 2-microbatch pipeline: it failed
  in the reshape with a TypeError."""
  from MaxText import models
  from MaxText.errors import UserError
  from MaxText.platform import sharding

  config = Config.for_testing(**_model_overrides(2), ici_pipeline_parallelism=2, num_pipeline_microbatches=2,
                              ici_fsdp_parallelism=1, ici_data_parallelism=4)
  spec = models.build_model_spec(config.model)
  tokens = jnp.ones((1, 8), jnp.int32)
  positions = jnp.arange(8)[None]
  with pytest.raises(UserError, match="forward pass of 1 row.s. cannot split into num_pipeline_microbatches=2"), \
       sharding.unsharded():
    jax.eval_shape(lambda p: spec.apply(p, tokens, positions, jnp.ones_like(tokens), None, None),
                   spec.abstract_params)


def test_layer_weights_are_stage_sharded_and_checkpoint_layout_is_unchanged():
  config = Config.for_testing(**_model_overrides(4), ici_pipeline_parallelism=4, ici_fsdp_parallelism=2)
  setup = build_run(config).setup
  specs = train_state.shardings_summary(setup.state_shardings.params)
  layer_specs = [spec for path, spec in specs.items() if path.startswith("['layers']")]
  assert layer_specs and all(spec[0] == "stage" for spec in layer_specs)
  assert all(leaf.shape[0] == 4 for leaf in jax.tree.leaves(setup.abstract_state.params["layers"]))
  assert setup.param_unsharded_fraction <= config.mesh.sharding_tolerance


def test_stage_weights_regroup_layers_per_schedule():
  config = Config.for_testing(**_model_overrides(8), ici_pipeline_parallelism=2, pipeline_schedule="circular",
                              num_pipeline_repeats=2, num_pipeline_microbatches=2)
  stacked = {"w": jnp.arange(8)}
  # [stage, repeat, layer in group]: stage 0 runs layers 0-1 then 4-5; stage 1 runs 2-3 then 6-7.
  np.testing.assert_array_equal(pipeline.stage_weights(stacked, config.model.pipeline)["w"],
                                [[[0, 1], [4, 5]], [[2, 3], [6, 7]]])


def test_bubble_fraction_per_schedule():
  assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)  # GPipe: (S-1)/(M+S-1)
  assert pipeline.bubble_fraction(4, 16) == pytest.approx(3 / 19)
  assert pipeline.bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)  # circular: (S-1)/(M*R+S-1)
  assert pipeline.num_iterations(4, 8, 3) == 27
  config = Config.for_testing(**_model_overrides(8), ici_pipeline_parallelism=4, pipeline_schedule="circular",
                              num_pipeline_repeats=2)
  assert config.model.pipeline.num_pipeline_microbatches == 4  # -1 = the number of stages
  assert pipeline.describe(config.model.pipeline) == ("pipeline: circular schedule, 4 stages, 4 microbatches, 1 layers per "
                                             "stage x 2 repeats; 11 iterations, bubble fraction 0.273")


@pytest.mark.parametrize("overrides, message", [
    (dict(ici_pipeline_parallelism=2, base_num_decoder_layers=3), r"num_decoder_layers \(3\) must be divisible by"),
    (dict(ici_pipeline_parallelism=2, pipeline_schedule="circular", num_pipeline_repeats=2, base_num_decoder_layers=2),
     r"num_decoder_layers \(2\) must be divisible by pipeline stages \(2\) x num_pipeline_repeats \(2\)"),
    (dict(ici_pipeline_parallelism=2, scan_layers=False), "pipeline parallelism needs scan_layers=True"),
    (dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2), "num_pipeline_repeats=2 needs pipeline_schedule=circular or 1f1b"),
    (dict(ici_pipeline_parallelism=4, pipeline_schedule="1f1b", num_pipeline_repeats=2, base_num_decoder_layers=8,
          num_pipeline_microbatches=6, per_device_batch_size=3),
     r"interleaved 1F1B .* num_pipeline_microbatches \(6\) to be a multiple of the pipeline stages \(4\)"),
    (dict(ici_pipeline_parallelism=2, pipeline_schedule="circular"), "circular needs num_pipeline_repeats >= 2"),
    (dict(ici_pipeline_parallelism=4, pipeline_schedule="circular", num_pipeline_repeats=2, base_num_decoder_layers=8,
          num_pipeline_microbatches=2), r"num_pipeline_microbatches \(2\) >= pipeline stages \(4\)"),
    (dict(ici_pipeline_parallelism=2, num_pipeline_microbatches=3), "must split into num_pipeline_microbatches=3"),
    (dict(ici_pipeline_parallelism=2, pipeline_schedule="zb-v"), "pipeline_schedule must be one of gpipe, circular, 1f1b"),
    (dict(num_pipeline_repeats=2), "apply only with pipeline parallelism"),
    (dict(ici_pipeline_parallelism=2, logical_axis_rules=[["layers", []]]), r'needs the logical_axis_rules entry'),
    # Qwen3-Next's hybrid stack (its two layer kinds are separate stacks; the pipeline reshaped them as one).
    (dict(ici_pipeline_parallelism=2, decoder_block="qwen3_5", full_attention_interval=2, linear_num_key_heads=1,
          linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4),
     r"full_attention_interval=2 \(Gated DeltaNet layers between full-attention layers\) is not supported with pipeline"),
])
def test_bad_pipeline_configs_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError, match=message) as info:
    Config.for_testing(**{**_model_overrides(2), **overrides})
  assert "\n" not in str(info.value)


def test_compiles_for_a_v5p_topology_with_stages(capsys):
  argv = ["train_compile", str(BASE_CONFIG_PATH), "compile_topology=v5p-8", "ici_pipeline_parallelism=2",
          "pipeline_schedule=circular", "num_pipeline_repeats=2", "num_pipeline_microbatches=4",
          "base_emb_dim=256", "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=64", "base_mlp_dim=512",
          "base_num_decoder_layers=4", "vocab_size=256", "max_target_length=64", "per_device_batch_size=2",
          "print_config=False"]
  assert train_compile.main(argv) == 0
  out = capsys.readouterr().out
  assert "mesh: stage=2, fsdp=2" in out
  assert "pipeline: circular schedule, 2 stages, 4 microbatches, 1 layers per stage x 2 repeats; 9 iterations, " \
         "bubble fraction 0.111" in out
  assert "fits:" in out


def test_1f1b_with_float16_weights_takes_the_per_token_gradient_of_a_large_batch():
  """1F1B computes its gradients inside its own loop, of the loss summed over the batch, and accumulated them in
  the weights' dtype: with weight_dtype=float16 and 32768 tokens of one repeated token the output head's
  gradient passed float16's 65504 and the step's gradients were inf where float32 weights gave finite ones
  (the loop is not under train_step's per-token division). The head's cotangent is now the step's 1/tokens and
  the loop accumulates in float32."""
  def config(dtype: str) -> Config:
    overrides = {**_model_overrides(2), "per_device_batch_size": 64, "max_target_length": 64}
    return Config.for_testing(**overrides, weight_dtype=dtype, adam_eps=1e-4, ici_pipeline_parallelism=2,
                              pipeline_schedule="1f1b", num_pipeline_microbatches=2, ici_data_parallelism=4,
                              ici_fsdp_parallelism=1)

  half, full = build_run(config("float16")), build_run(config("float32"))
  state = half.init_state(0)
  batch = _packed_batch(half.config.data.global_batch_size, 64, 64)
  batch = {**batch, "inputs": np.full_like(batch["inputs"], 5), "targets": np.full_like(batch["targets"], 5),
           "inputs_segmentation": np.ones_like(batch["inputs_segmentation"]),
           "targets_segmentation": np.ones_like(batch["targets_segmentation"]),
           "inputs_position": np.broadcast_to(np.arange(64, dtype=np.int32), batch["inputs_position"].shape)}
  assert int(np.sum(batch["targets_segmentation"] > 0)) == 32768
  full_params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.float32), state.params),
                               full.setup.state_shardings.params)
  full_state = full.init_state(0).replace(params=full_params)
  full_state = full_state.replace(opt_state=jax.jit(full.setup.optimizer.init)(full_params))
  half_state, half_metrics = half.train_step(state, jax.device_put(batch, half.batch_sharding), jax.random.key(0))
  _, full_metrics = full.train_step(full_state, jax.device_put(batch, full.batch_sharding), jax.random.key(0))
  assert np.isfinite(float(full_metrics["grad_norm"]))
  assert float(half_metrics["grad_norm"]) == pytest.approx(float(full_metrics["grad_norm"]), rel=1e-2)
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(half_state.params))
