"""Sparse MoE (Mixtral): HF logits, the load-balancing loss, capacity dropping, expert-parallel training.

Shape legend: B batch, L length, D emb_dim, E experts, k experts per token.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import models
from MaxText.training import metrics, train_state
from MaxText.platform import sharding
from MaxText.training.objectives.language_model import LanguageModel
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import moe
from MaxText.training.run_assembly import build_run
from train_utils import Run

D, N, K, H, F, V, E, TOP_K, LAYERS, LENGTH = 64, 4, 2, 16, 128, 128, 4, 2, 2, 24
MOE = dict(num_experts=E, num_experts_per_tok=TOP_K)


def tiny_mixtral(**overrides) -> Config:
  values = dict(base_emb_dim=D, base_num_query_heads=N, base_num_kv_heads=K, head_dim=H, base_mlp_dim=F,
                base_num_decoder_layers=LAYERS, vocab_size=V, rope_max_timescale=1e6, normalization_layer_epsilon=1e-5,
                dtype="float32", print_config=False, **MOE)
  return Config.for_testing(**{**values, **overrides})


# ---------------------------------------------------------------- against Hugging Face


@pytest.fixture(scope="module")
def hf():
  """The shared HF test helpers (tests/hf_families.py); skipped without torch and transformers."""
  pytest.importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
  pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
  import hf_families
  return hf_families


def build_hf_mixtral(hf, seed: int = 0):
  """A random tiny MixtralForCausalLM: 2 layers, 4 experts, top-2, GQA (4 query / 2 kv heads)."""
  hf.torch.manual_seed(seed)
  config = hf.transformers.MixtralConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS, num_attention_heads=N,
      num_key_value_heads=K, head_dim=H, num_local_experts=E, num_experts_per_tok=TOP_K, rope_theta=1e6,
      sliding_window=None, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
  model = hf.transformers.MixtralForCausalLM(config).eval()
  generator = hf.torch.Generator().manual_seed(seed)
  with hf.torch.no_grad():
    # As the dense families do: norm gains off their init of 1 (a swapped norm shows) and
    # matrices at O(1/sqrt(D)), which also spreads the router probabilities (HF's std 0.02
    # leaves them near uniform) so top-k choices and weights vary from token to token.
    for param in model.parameters():
      noise = hf.torch.randn(param.shape, generator=generator)
      param.copy_(param + 0.1 * noise if param.ndim == 1 else 0.15 * noise)
  return model


def _hf_run(hf, model, tokens) -> tuple[np.ndarray, tuple]:
  with hf.torch.no_grad():
    out = model(hf.torch.tensor(tokens), output_router_logits=True)
  return out.logits.float().numpy(), out.router_logits


def _ours(hf, model, tokens, staging_dir, **overrides) -> tuple[np.ndarray, dict]:
  """Our logits and aux losses, every model key inferred from the HF config and the
  parameters converted through the mixtral tensor table (MaxText/convert/mixtral.py)."""
  config = hf.our_config(model, **overrides)
  assert (config.model.decoder_block, config.model.moe.num_experts) == ("mixtral", E)
  assert config.model.moe.num_experts_per_tok == overrides.get("num_experts_per_tok", TOP_K)
  params = hf.our_params(model, config, staging_dir)
  spec = models.build_model_spec(config.model)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  logits, aux = jax.jit(sharding.unsharded()(spec.apply_with_aux))(params, jnp.asarray(tokens), jnp.asarray(positions),
                                             jnp.ones(tokens.shape, jnp.int32))
  return np.asarray(logits), aux


@pytest.mark.parametrize("scan_layers", [False, True])
def test_float32_logits_and_aux_loss_match_hf(hf, scan_layers, tmp_path):
  model, tokens = build_hf_mixtral(hf), hf.tokens()
  expected, router_logits = _hf_run(hf, model, tokens)
  ours, aux = _ours(hf, model, tokens, tmp_path, dtype="float32", scan_layers=scan_layers)
  # Dropless routing is exact, so only float32 summation order differs (observed ~1e-6 on
  # logits of size ~5); routing each token to one expert instead of two moves them by O(1).
  np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)
  if scan_layers:
    top_1, _ = _ours(hf, model, tokens, tmp_path / "top1", dtype="float32", num_experts_per_tok=1)
    assert np.abs(top_1 - expected).max() > 0.1
  # HF pools router statistics over all layers; ours is the per-layer loss averaged over
  # layers (Switch applies it per layer), so compare with HF's function applied layer by layer.
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  per_layer = [float(load_balancing_loss_func((logits,), E, TOP_K)) for logits in router_logits]
  np.testing.assert_allclose(float(aux["moe_lb_loss"]), np.mean(per_layer), rtol=1e-5)


def _rms(x: np.ndarray) -> float:
  return float(np.sqrt(np.mean(np.square(x))))


def test_bfloat16_error_is_no_worse_than_hf_bfloat16(hf, tmp_path):
  """bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 0.2% per operation) and the two
  implementations round at different points (we keep norms, softmaxes and the routing softmax in
  float32), so neither is "the" bf16 answer. Both are measured against the float32 reference on
  the same bf16-rounded weights (the dense families' criterion): our error may exceed HF's own
  bf16 error by 50% (RMS) and 2x (max). A routing decision flipped by rounding on one side only
  would move that token's logits by O(1) and fail the max bound."""
  model, tokens = hf.round_to_bfloat16(build_hf_mixtral(hf)), hf.tokens()
  reference, _ = _hf_run(hf, model, tokens)
  hf_bf16, _ = _hf_run(hf, model.to(hf.torch.bfloat16), tokens)
  ours, _ = _ours(hf, model.float(), tokens, tmp_path, dtype="bfloat16")
  ours_error, hf_error = ours - reference, hf_bf16 - reference
  assert _rms(ours_error) <= 1.5 * _rms(hf_error), (_rms(ours_error), _rms(hf_error))
  assert np.abs(ours_error).max() <= 2 * np.abs(hf_error).max(), (np.abs(ours_error).max(), np.abs(hf_error).max())


def test_conversion_round_trip_through_disk(hf, tmp_path):
  """HF save_pretrained (per-expert w1/w2/w3 names) → hf_to_maxtext → maxtext_to_hf reproduces
  every tensor bit for bit, and transformers loads the result as the same model."""
  from safetensors.numpy import load_file

  from MaxText.convert import hf_to_maxtext, maxtext_to_hf
  model, tokens = build_hf_mixtral(hf), hf.tokens()
  model.save_pretrained(tmp_path / "hf")
  original = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in original
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), ["scan_layers=True"])
  maxtext_to_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "back"), [])
  back = {}
  for path in sorted((tmp_path / "back").glob("*.safetensors")):
    back.update(load_file(str(path)))
  assert sorted(back) == sorted(original)
  for name, array in original.items():
    np.testing.assert_array_equal(back[name], array, err_msg=name)
  reloaded = hf.transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
  assert type(reloaded).__name__ == "MixtralForCausalLM"
  np.testing.assert_array_equal(hf.hf_logits(reloaded, tokens), hf.hf_logits(model, tokens))


# ---------------------------------------------------------------- the layer itself


def test_load_balance_loss_hand_computed():
  probs_BLE = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]])
  experts_BLk = jnp.argmax(probs_BLE, axis=-1)[..., None]  # top-1: experts 0, 0, 1, 0
  # fraction routed (0.75, 0.25), mean probability (0.65, 0.35): 2 * (0.4875 + 0.0875) = 1.15
  np.testing.assert_allclose(float(moe.load_balance_loss(probs_BLE, experts_BLk)), 1.15, rtol=1e-6)
  # Even routing and uniform probabilities give k (here top-2 of 4 experts: 2).
  uniform_BLE = jnp.full((1, 4, 4), 0.25)
  pairs_BLk = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  np.testing.assert_allclose(float(moe.load_balance_loss(uniform_BLE, pairs_BLk)), 2.0, rtol=1e-6)


def _block(cfg: Config, gate_DE: np.ndarray | None = None) -> moe.MoeBlock:
  with nnx.use_eager_sharding(False):
    block = moe.MoeBlock(cfg.model, rngs=nnx.Rngs(params=1))
  if gate_DE is not None:
    block.gate.kernel[...] = jnp.asarray(gate_DE)
  return block


def _apply(block: moe.MoeBlock, x_BLD: np.ndarray) -> np.ndarray:
  with sharding.unsharded():
    return np.asarray(nnx.capture(block, nnx.Intermediate)(jnp.asarray(x_BLD))[0])


def _silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))


def _reference(block: moe.MoeBlock, x_BLD: np.ndarray, capacity: int) -> np.ndarray:
  """Token-by-token loops implementing the documented policy: first choices claim slots
  before second choices, in sequence order; an over-capacity assignment adds nothing."""
  probs_BLE, experts_BLk, weights_BLk = (np.asarray(a) for a in moe.route(block.gate(jnp.asarray(x_BLD)), TOP_K))
  wi_0, wi_1, wo = (np.asarray(m.kernel[...]) for m in (block.wi_0, block.wi_1, block.wo))
  out_BLD = np.zeros_like(x_BLD)
  for b in range(x_BLD.shape[0]):
    used = np.zeros(E, int)
    for j in range(TOP_K):
      for t in range(x_BLD.shape[1]):
        e = experts_BLk[b, t, j]
        used[e] += 1
        if used[e] > capacity:
          continue
        h = _silu(x_BLD[b, t] @ wi_0[e]) * (x_BLD[b, t] @ wi_1[e])
        out_BLD[b, t] += weights_BLk[b, t, j] * (h @ wo[e])
  return out_BLD


def test_capacity_drops_overflow_as_documented():
  x_BLD = np.random.default_rng(1).normal(size=(2, 8, D)).astype(np.float32)
  # A router biased towards expert 0 (feature 0 is shifted up), so it overflows.
  x_BLD[..., 0] = np.abs(x_BLD[..., 0]) + 1.0
  gate_DE = np.random.default_rng(2).normal(size=(D, E)).astype(np.float32) * 0.1
  gate_DE[0, 0] = 5.0
  # capacity_factor 1.0: C = ceil(1.0 * 2 * 8 / 4) = 4 slots per expert for 8 tokens.
  cfg = tiny_mixtral(capacity_factor=1.0)
  assert moe.expert_capacity(cfg.model.moe, 8) == 4
  block = _block(cfg, gate_DE)
  _, experts_BLk, _ = moe.route(block.gate(jnp.asarray(x_BLD)), TOP_K)
  assert int(jnp.sum(experts_BLk[..., 0] == 0)) == 16  # every first choice is expert 0: 4 kept per row
  ours = _apply(block, x_BLD)
  np.testing.assert_allclose(ours, _reference(block, x_BLD, capacity=4), atol=1e-5, rtol=1e-5)
  # Tokens 4..7 lost expert 0 but keep their second expert; the dropless block differs exactly there.
  dropless = _apply(_block(tiny_mixtral(capacity_factor=-1.0), gate_DE), x_BLD)
  np.testing.assert_allclose(dropless, _reference(block, x_BLD, capacity=8), atol=1e-5, rtol=1e-5)
  changed = np.abs(ours - dropless).max(axis=-1) > 1e-6
  assert (changed[:, 4:].all() and not changed[:, :4].any()), changed
  assert np.abs(ours[:, 4:]).min(axis=-1).max() > 0  # not zeroed: the second expert still adds


def test_token_losing_every_choice_gets_zeros():
  cfg = tiny_mixtral(capacity_factor=0.01)  # C = 1 slot per expert
  assert moe.expert_capacity(cfg.model.moe, 8) == 1
  x_BLD = np.ones((1, 8, D), np.float32)  # identical tokens pick the same two experts
  out_BLD = _apply(_block(cfg), x_BLD)
  assert np.abs(out_BLD[0, 0]).max() > 0 and np.abs(out_BLD[0, 1:]).max() == 0


def test_layer_sows_its_loss_and_models_average_it():
  cfg = tiny_mixtral(scan_layers=False)
  spec = models.build_model_spec(cfg.model)
  params = jax.jit(spec.init_params)(jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(2, 16)))
  positions, segments = jnp.broadcast_to(jnp.arange(16), tokens.shape), jnp.ones(tokens.shape, jnp.int32)
  logits, aux = jax.jit(sharding.unsharded()(spec.apply_with_aux))(params, tokens, positions, segments)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(jax.jit(sharding.unsharded()(spec.apply))(params, tokens, positions, segments)))
  # Each layer's loss lies in [k, k·E]; the model reports their mean.
  assert set(aux) == {"moe_lb_loss", *moe.ROUTING_STATS} and TOP_K <= float(aux["moe_lb_loss"]) <= TOP_K * E
  # The routing statistics stay per layer: each layer's token fractions sum to k.
  np.testing.assert_allclose(np.sum(np.asarray(aux["moe_load"]), axis=-1), [TOP_K] * LAYERS, rtol=1e-6)
  assert aux["moe_router_entropy"].shape == aux["moe_dropped_fraction"].shape == (LAYERS,)
  dense = models.build_model_spec(tiny_mixtral(num_experts=1, num_experts_per_tok=1).model)
  dense_aux = jax.eval_shape(sharding.unsharded()(dense.apply_with_aux), dense.abstract_params, tokens, positions, segments)[1]
  assert dense_aux == {}
  # The train step's objective adds weight x (mean over layers) x target count.
  batch = dict(inputs=tokens, inputs_position=positions, inputs_segmentation=segments, targets=tokens,
               targets_segmentation=segments)
  objective = jax.jit(sharding.unsharded()(lambda p, weight: LanguageModel(spec, 0.0, weight).loss_sums(p, None, batch, None)))
  (plain, sums), (weighted, _) = objective(params, 0.0), objective(params, 0.5)
  np.testing.assert_allclose(float(sums["moe_lb_loss_sum"]), float(aux["moe_lb_loss"]) * tokens.size, rtol=1e-5)
  np.testing.assert_allclose(float(weighted - plain), 0.5 * float(sums["moe_lb_loss_sum"]), rtol=1e-4)


# ---------------------------------------------------------------- config, sharding, training


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts=0), "num_experts must be >= 1 (1 = dense MLP), got 0"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok must be between 1 and num_experts (4), got 5"),
    (dict(load_balance_loss_weight=-0.1), "load_balance_loss_weight must be a finite float32 number >= 0, got -0.1"),
    # inf passed `>= 0`: an MoE model's gradients were NaN from the first step.
    (dict(load_balance_loss_weight=float("inf")), "load_balance_loss_weight must be a finite float32 number >= 0"),
    (dict(num_experts=3, num_experts_per_tok=1, ici_expert_parallelism=2),
     "num_experts (3) must be a multiple of the expert parallelism"),
    (dict(sparse_matmul=True, capacity_factor=1.25),
     "sparse_matmul=True is the dropless grouped-matmul path but capacity_factor=1.25 asks for dropping"),
])
def test_moe_config_errors(overrides, message):
  with pytest.raises(ConfigError) as info:
    tiny_mixtral(**overrides)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_mixtral_8x7b_parameter_count():
  config = Config.for_testing(model_name="mixtral-8x7b", print_config=False)
  spec = models.build_model_spec(config.model)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(spec.abstract_params))
  assert abs(total / 46.7e9 - 1) < 0.01, total  # published: 46.7B
  mlp = spec.abstract_params["layers"]["mlp"]
  experts = sum(math.prod(mlp[name]["kernel"].shape) for name in ("wi_0", "wi_1", "wo"))
  active = total - experts + experts * 2 / 8
  assert abs(active / 12.9e9 - 1) < 0.01, active  # published: 12.9B active per token


def test_expert_weights_live_on_the_expert_axis():
  config = tiny_mixtral(ici_expert_parallelism=2, ici_fsdp_parallelism=-1)
  setup = build_run(config).setup
  specs = train_state.shardings_summary(setup.state_shardings.params)
  # Scanned: [layers, E, D, F]; experts over `expert`, the model dim over FSDP.
  assert specs["['layers']['mlp']['wi_0']['kernel']"] == (None, "expert", "fsdp", None)
  assert specs["['layers']['mlp']['wo']['kernel']"] == (None, "expert", None, "fsdp")
  assert setup.param_unsharded_fraction <= config.mesh.sharding_tolerance


@pytest.mark.slow
def test_training_with_expert_parallelism_lowers_the_loss():
  config = tiny_mixtral(ici_expert_parallelism=2, ici_fsdp_parallelism=-1, max_target_length=32, vocab_size=64,
                        learning_rate=3e-3, steps=25, capacity_factor=1.5, remat_policy="full")
  run = Run(config)
  _, history = run.train(run.init(), 25)
  start, end = np.mean([h["loss"] for h in history[:3]]), np.mean([h["loss"] for h in history[-5:]])
  assert end < 0.6 * start, (start, end)
  lb = [h["moe_lb_loss"] for h in history]
  assert all(TOP_K <= x <= TOP_K * E for x in lb), lb


def test_flops_formula_counts_routed_experts_only():
  # capacity_factor 1 makes the kernel's slots exactly the routed work (C·E = k·L), so XLA's
  # count of executed FLOPs must agree with the formula (same band as the dense test).
  config = tiny_mixtral(capacity_factor=1.0, scan_layers=False, max_target_length=32,
                        ici_data_parallelism=8, ici_fsdp_parallelism=1)
  spec = models.build_model_spec(config.model)
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
  cost = jax.jit(sharding.unsharded()(spec.apply)).lower(spec.abstract_params, tokens, tokens, tokens).compile().cost_analysis()
  xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  weights, attention = metrics.forward_flops_per_sequence(config.model, 32, causal=False)
  ours = 2 * (weights + attention)
  assert ours <= xla_flops <= 1.06 * ours, (ours, xla_flops)


# ---------------------------------------------------------------- grouped (ragged_dot) dropless path


def _skewed_router() -> tuple[np.ndarray, np.ndarray]:
  """Tokens and a router that sends most first choices to expert 0 and none to expert 3, so the
  groups are uneven and one is empty."""
  x_BLD = np.random.default_rng(1).normal(size=(2, 8, D)).astype(np.float32)
  x_BLD[..., 0] = np.abs(x_BLD[..., 0]) + 1.0
  gate_DE = np.random.default_rng(2).normal(size=(D, E)).astype(np.float32) * 0.1
  gate_DE[0, 0], gate_DE[0, 3] = 5.0, -5.0
  return x_BLD, gate_DE


def test_grouped_path_equals_padded_dropless_values_and_gradients():
  x_BLD, gate_DE = _skewed_router()
  padded, grouped = (_block(tiny_mixtral(sparse_matmul=s), gate_DE) for s in (False, True))
  _, experts_BLk, _ = moe.route(grouped.gate(jnp.asarray(x_BLD)), TOP_K)
  counts = np.bincount(np.asarray(experts_BLk).ravel(), minlength=E)
  assert counts[3] == 0 and counts[0] == 16, counts
  np.testing.assert_allclose(_apply(grouped, x_BLD), _apply(padded, x_BLD), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(_apply(grouped, x_BLD), _reference(grouped, x_BLD, capacity=8), atol=1e-5, rtol=1e-5)

  def grads(block: moe.MoeBlock) -> tuple:
    graph, params, rest = nnx.split(block, nnx.Param, ...)
    def loss(p, x):
      out = nnx.capture(nnx.merge(graph, p, rest), nnx.Intermediate)(x)[0]
      return jnp.sum(jnp.sin(out))
    with sharding.unsharded():
      return jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x_BLD))

  (g_params, g_x), (p_params, p_x) = grads(grouped), grads(padded)
  np.testing.assert_allclose(np.asarray(g_x), np.asarray(p_x), atol=1e-5, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
               g_params, p_params)
  assert float(jnp.abs(g_params["wo"]["kernel"][...][3]).max()) == 0  # the empty expert learns nothing


@pytest.mark.parametrize("scan_layers", [False, True])
def test_grouped_path_matches_hf_float32(hf, scan_layers, tmp_path):
  model, tokens = build_hf_mixtral(hf), hf.tokens()
  expected, _ = _hf_run(hf, model, tokens)
  ours, _ = _ours(hf, model, tokens, tmp_path, dtype="float32", scan_layers=scan_layers, sparse_matmul=True)
  np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mesh", [dict(ici_expert_parallelism=2, ici_fsdp_parallelism=-1), pytest.param(
    dict(ici_expert_parallelism=2, ici_tensor_parallelism=2, ici_fsdp_parallelism=-1), marks=pytest.mark.slow),
    pytest.param(dict(ici_expert_parallelism=4, ici_fsdp_parallelism=-1), marks=pytest.mark.slow)])
def test_grouped_path_trains_like_padded_under_expert_parallelism(mesh):
  """On the 8 simulated devices with experts sharded over `expert` (and `tensor`; with 4 expert
  shards each device owns one expert): same losses and gradient norms as the padded dropless
  path, step by step."""
  base = dict(mesh, max_target_length=16, vocab_size=64, learning_rate=3e-3, capacity_factor=-1.0)
  histories = []
  for sparse in (False, True):
    run = Run(tiny_mixtral(**base, sparse_matmul=sparse))
    histories.append(run.train(run.init(), 3)[1])
  for key in ("loss", "grad_norm", "moe_lb_loss"):
    np.testing.assert_allclose([h[key] for h in histories[1]], [h[key] for h in histories[0]], rtol=2e-5,
                               err_msg=key)


# ---------------------------------------------------------------- use_custom_sort_vjp

def _grouped_grads(block: moe.MoeBlock, x_BLD: np.ndarray) -> tuple[tuple, str]:
  """(gradients of sum(sin(out)) for the parameters and the input, the lowered gradient's text)."""
  graph, params, rest = nnx.split(block, nnx.Param, ...)

  def loss(p, x):
    return jnp.sum(jnp.sin(nnx.capture(nnx.merge(graph, p, rest), nnx.Intermediate)(x)[0]))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  with sharding.unsharded():
    return grad(params, jnp.asarray(x_BLD)), grad.lower(params, jnp.asarray(x_BLD)).as_text()


def test_custom_sort_vjp_gathers_the_sorts_gradients_back_with_the_same_result():
  """use_custom_sort_vjp: the sort's and unsort's gradients are gathers by the inverse permutations, where
  autodiff scatter-adds; the gradients are the same up to summation order."""
  x_BLD, gate_DE = _skewed_router()
  (auto, auto_text), (custom, custom_text) = (
      _grouped_grads(_block(tiny_mixtral(sparse_matmul=True, use_custom_sort_vjp=c), gate_DE), x_BLD)
      for c in (False, True))
  row_scatters = [text.count("stablehlo.scatter<update_window_dims = [1]") for text in (auto_text, custom_text)]
  assert row_scatters == [2, 0], row_scatters  # the sort's and the unsort's (bincount's and others' stay)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6),
               custom, auto)


@pytest.mark.slow  # two short training runs on the 8 devices
def test_custom_sort_vjp_trains_like_autodiffs_under_expert_parallelism():
  """The all-to-all path (its regrouping by local expert too) with experts on 2 devices: the same losses and
  gradient norms step by step."""
  base = dict(ici_expert_parallelism=2, ici_fsdp_parallelism=-1, max_target_length=16, vocab_size=64,
              learning_rate=3e-3, capacity_factor=-1.0, sparse_matmul=True)
  histories = []
  for custom in (False, True):
    run = Run(tiny_mixtral(**base, use_custom_sort_vjp=custom))
    histories.append(run.train(run.init(), 3)[1])
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in histories[1]], [h[key] for h in histories[0]], rtol=1e-5,
                               err_msg=key)
