"""DeepSeek's paths beyond the logit parity of test_families_vs_hf.py: the routing bias, MLA under a
fused kernel, the compressed decode cache, the dense-prefix stack's layouts and the bias update."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from MaxText import models
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import kv_cache
from train_utils import Run

H = pytest.importorskip("hf_families")
FP32_ATOL = 2e-5

# A tiny V3-shaped model for the training tests: MLA with low-rank queries, a dense first layer,
# sigmoid routing with the bias over 2 groups of 4 experts, one shared expert.
TINY_V3 = dict(decoder_block="deepseek3", base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=4, head_dim=12,
               base_mlp_dim=32, base_num_decoder_layers=3, vocab_size=128, max_target_length=32,
               per_device_batch_size=1, print_config=False, attention_type="mla", q_lora_rank=24, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_experts=8, num_experts_per_tok=2,
               shared_experts=1, moe_score_function="sigmoid", moe_score_correction_bias=True, moe_num_groups=2,
               moe_topk_groups=1, moe_group_score="top2_sum", routed_scaling_factor=2.5, first_dense_layers=1,
               dense_mlp_dim=48, rope_interleaved=True)


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
  return tmp_path_factory.mktemp("deepseek")


def test_the_correction_bias_steers_the_choice(staging):
  """deepseek3 matches HF with the randomised bias (test_families_vs_hf); zeroing ours breaks it."""
  model = H.build_hf_model("deepseek3")
  config = H.our_config(model, dtype="float32")
  params = H.our_params(model, config, staging / "bias")
  bias = params["layers"]["mlp"]["score_correction_bias"]
  assert np.abs(bias).max() > 0.05
  params["layers"]["mlp"]["score_correction_bias"] = np.zeros_like(bias)
  token_ids = H.tokens()
  assert np.abs(H.our_logits(config, params, token_ids) - H.hf_logits(model, token_ids)).max() > 100 * FP32_ATOL


def test_mla_under_the_flash_kernel_equals_dot_product(staging):
  """The fused kernels take one head width: MLA pads its narrower value heads and slices them off."""
  model = H.build_hf_model("deepseek2-lite")
  token_ids = H.tokens()
  dot = H.our_config(model, dtype="float32", attention="dot_product")
  flash = H.our_config(model, dtype="float32", attention="flash", flash_block_q=8, flash_block_kv=8)
  params = H.our_params(model, dot, staging / "flash")
  np.testing.assert_allclose(H.our_logits(flash, params, token_ids), H.our_logits(dot, params, token_ids),
                             atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_decode_cache_holds_the_latent_and_rope_key_only(scan_layers):
  cfg = Config.for_testing(**TINY_V3, scan_layers=scan_layers).model
  caches = kv_cache.model_caches(cfg, batch=2, length=32)
  assert set(caches) == {"dense_layers", "layers"}
  main = caches["layers"] if scan_layers else caches["layers"][0]
  lead = (cfg.num_moe_stack_layers,) if scan_layers else ()
  assert main.key_BKSH.shape == (*lead, 2, 1, 32, cfg.mla.kv_lora_rank)
  assert main.value_BKHS.shape == (*lead, 2, 1, cfg.mla.qk_rope_head_dim, 32)
  names = kv_cache.model_cache_names(cfg)
  assert jax.tree.structure(names, is_leaf=lambda x: isinstance(x, tuple)) == \
      jax.tree.structure(jax.tree.map(lambda x: (), caches), is_leaf=lambda x: isinstance(x, tuple))


def test_the_dense_prefix_stack_unstacks_and_restacks():
  cfg = Config.for_testing(**TINY_V3).model
  params = jax.tree.map(np.asarray, models.build_model_spec(cfg).init_params(jax.random.key(0)))
  assert jax.tree.leaves(params["dense_layers"])[0].shape[0] == 1
  assert params["dense_layers"]["mlp"]["wi_0"]["kernel"].shape == (1, 64, 48)  # dense_mlp_dim, no experts
  unrolled = models.unstack_layers(params, cfg.num_moe_stack_layers)
  assert {"dense_layers_0", "layers_0", "layers_1"} <= set(unrolled) and "layers_2" not in unrolled
  unrolled_cfg = Config.for_testing(**TINY_V3, scan_layers=False).model
  assert jax.tree.structure(unrolled) == jax.tree.structure(models.build_model_spec(unrolled_cfg).abstract_params)
  jax.tree.map(np.testing.assert_array_equal, models.stack_layers(unrolled, cfg.num_moe_stack_layers), params)


def test_without_a_prefix_the_tree_has_one_stack(tiny_overrides):
  params = models.build_model_spec(Config.for_testing(**tiny_overrides).model).abstract_params
  assert "layers" in params and not any(k.startswith("dense_layers") for k in params)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 1e-3])
def test_the_bias_moves_only_by_the_expert_load(rate):
  """With rate 0 the bias stays bitwise (no weight decay, no gradient); otherwise each step adds
  rate · sign(mean load - load): up for the underloaded experts."""
  run = Run(Config.for_testing(**TINY_V3, moe_bias_update_rate=rate, adam_weight_decay=0.1))
  state = run.init()
  before = np.asarray(state.params["layers"]["mlp"]["score_correction_bias"])
  state, history = run.train(state, 1)
  after = np.asarray(state.params["layers"]["mlp"]["score_correction_bias"])
  if rate == 0:
    np.testing.assert_array_equal(after, before)
    return
  step = np.round((after - before) / rate)
  assert set(np.unique(step)) <= {-1.0, 0.0, 1.0} and np.abs(step).sum() > 0
  assert np.isfinite(history[0]["loss"])


def test_pipeline_parallelism_refuses_the_dense_prefix():
  with pytest.raises(ConfigError, match="first_dense_layers"):
    Config.for_testing(**TINY_V3, ici_pipeline_parallelism=2, ici_fsdp_parallelism=1, ici_data_parallelism=-1,
                       num_pipeline_microbatches=2)


def test_flops_formula_counts_mla_and_the_dense_prefix():
  """metrics' MLA projections, value width and dense prefix against XLA's count (unrolled, float32)."""
  from MaxText.training import metrics
  from MaxText.platform import sharding
  import jax.numpy as jnp
  overrides = dict(TINY_V3, base_emb_dim=256, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, head_dim=48, v_head_dim=24, base_mlp_dim=128, dense_mlp_dim=512,
                   max_target_length=128, scan_layers=False, dtype="float32")
  cfg = Config.for_testing(**overrides).model
  spec = models.build_model_spec(cfg)
  batch, length = 2, 128
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  compiled = jax.jit(sharding.unsharded()(spec.apply)).lower(spec.abstract_params, tokens, tokens, tokens).compile()
  cost = compiled.cost_analysis()
  xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  weights, attention = metrics.forward_flops_per_sequence(cfg, length, causal=False)
  ours = batch * (weights + attention)
  assert ours <= xla_flops <= 1.06 * ours, (ours, xla_flops, xla_flops / ours)


def _two_steps(**overrides):
  run = Run(Config.for_testing(**dict(TINY_V3, learning_rate=3e-3, moe_bias_update_rate=1e-3, **overrides)))
  state, history = run.train(run.init(), 2)
  return jax.device_get(state.params), history


# Slow: the default run covers expert parallelism through Qwen3-MoE (tests/test_family_training.py).
@pytest.mark.parametrize("dispatch, grouped", [pytest.param("all_to_all", True, marks=pytest.mark.slow),
                                               pytest.param("gather", False, marks=pytest.mark.slow)])
def test_expert_parallel_training_equals_the_run_without_an_expert_axis(dispatch, grouped):
  """The routing (bias, groups, scaling) happens before either dispatch: two steps with experts
  over 2 devices give the losses and parameters (bias included) of the run without an expert axis."""
  mode = dict(capacity_factor=-1.0, sparse_matmul=grouped)
  want_params, want = _two_steps(**mode)
  got_params, got = _two_steps(**mode, ici_expert_parallelism=2, ici_fsdp_parallelism=-1, moe_dispatch=dispatch)
  for key in ("loss", "grad_norm", "moe_lb_loss"):
    np.testing.assert_allclose([h[key] for h in got], [h[key] for h in want], rtol=2e-5, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               got_params, want_params)


def test_the_checkpoints_mtp_layer_is_skipped(staging):
  """V3 checkpoints store the multi-token-prediction module as layer num_hidden_layers; the
  converter skips it (as HF does) instead of refusing the checkpoint."""
  from MaxText import families
  from MaxText.convert import engine
  model = H.build_hf_model("deepseek3")
  config = H.our_config(model, dtype="float32")
  spec = models.build_model_spec(config.model)
  (staging / "mtp").mkdir()
  staged = engine.StagedParams(spec.abstract_params, str(staging / "mtp"), "float32")
  last = config.model.num_decoder_layers
  extra = [(f"model.layers.{last}.eh_proj.weight", np.ones((64, 128), np.float32)),
           (f"model.layers.{last}.self_attn.q_a_proj.weight", np.ones((24, 64), np.float32))]
  tensors = [(name, t.detach().float().numpy()) for name, t in model.state_dict().items()] + extra
  engine.stage_hf_tensors(iter(tensors), families.family_for_hf_config(H.hf_config_dict(model)), config.model, staged)
  written = [name for name, _ in engine.hf_tensors_from_params(
      lambda path: engine.flat_abstract(staged.tree())[path], families.family_for_hf_config(H.hf_config_dict(model)),
      config.model)]
  assert not any(name.startswith(f"model.layers.{last}.") for name in written)
