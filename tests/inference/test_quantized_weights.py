"""quantize_weights: 8-bit kernel storage for decoding (layers/weight_quantization.py,
inference/quantized_weights.py): the matmul against float within the quantization step, a tiny
model's logits and greedy tokens against its float engine, the bytes, the weight copy of GRPO
rollouts, and the refused values."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.inference import quantized_weights
from MaxText.inference.engine import Engine
from MaxText.layers import quantization
from MaxText.layers.weight_quantization import QuantizedWeight, dense_dot, quantize_weight
from MaxText.platform import sharding
from MaxText.rl import rollout_mesh
from decode_test_utils import engine_tokens, one_device_mesh, uncached_greedy
from tests.test_grpo_run import _metrics, _train, workdir  # noqa: F401 (workdir: the fixture)

TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=24, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
E4M3_HALF_ULP = 2.0**-4  # e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2**-4 relative
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # below 2**-6 the step is 2**-9 (times the scale)


def _x_w(k: int = 64, n: int = 24, m: int = 6, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.linspace(0.2, 3.0, m)[:, None]
  w = jax.random.normal(kw, (k, n), jnp.float32) * jnp.linspace(0.1, 2.0, n)[None, :] / np.sqrt(k)
  return x, w


def _bound(x: np.ndarray, w_error: np.ndarray) -> np.ndarray:
  """|x · w - x · w_q| <= |x| · |w - w_q| (float32 accumulation adds a little: 1e-5 relative)."""
  return np.abs(x) @ w_error + 1e-5 * (np.abs(x) @ np.abs(w_error)).max() + 1e-6


@pytest.mark.parametrize("block", [0, 16])
def test_weight_only_int8_and_fp8_matmul_within_the_quantization_step(block):
  x, w = _x_w()
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for mode in ("int8", "fp8"):
    q = quantize_weight(w, mode, (0,), block)
    assert q.values.dtype == (jnp.int8 if mode == "int8" else jnp.float8_e4m3fn)
    assert q.scale.shape == ((1 if block == 0 else 64 // block), 24)
    scale = np.repeat(np.asarray(q.scale, np.float64), 64 // q.scale.shape[0], axis=0)
    if mode == "int8":  # half a step of each weight's row (block)
      step = scale / 2
    else:
      step = E4M3_HALF_ULP * np.abs(wn) + E4M3_SUBNORMAL_HALF_STEP * scale
    assert np.all(np.abs(np.asarray(q.dequantize(jnp.float32), np.float64) - wn) <= step * (1 + 1e-6))
    y = np.asarray(dense_dot(x, q, 1, jnp.float32, ""), np.float64)
    assert np.all(np.abs(y - xn @ wn) <= _bound(xn, step)), mode


def test_weight_and_activation_int8_and_fp8_matmul_within_both_steps():
  x, w = _x_w(seed=1)
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  q = quantize_weight(w, "int8", (0,))
  y = np.asarray(dense_dot(x, q, 1, jnp.float32, "int8"), np.float64)
  w_step = np.asarray(q.scale, np.float64) / 2 * np.ones_like(wn)
  x_step = np.abs(xn).max(axis=1, keepdims=True) / 127 / 2 * np.ones_like(xn)  # per token
  bound = _bound(xn, w_step) + x_step @ (np.abs(wn) + w_step)
  assert np.all(np.abs(y - xn @ wn) <= bound)
  hlo = jax.jit(lambda a: dense_dot(a, q, 1, jnp.float32, "int8")).lower(x).as_text()
  assert "xi8>" in hlo and "-> tensor<6x24xi32>" in hlo  # an int8 x int8 -> int32 dot
  q8 = quantize_weight(w, "fp8", (0,))
  y8 = np.asarray(dense_dot(x, q8, 1, jnp.float32, "fp8"), np.float64)
  scale = np.asarray(q8.scale, np.float64)
  w_step = E4M3_HALF_ULP * np.abs(wn) + E4M3_SUBNORMAL_HALF_STEP * scale
  x_scale = np.abs(xn).max() / 448
  x_step = E4M3_HALF_ULP * np.abs(xn) + E4M3_SUBNORMAL_HALF_STEP * x_scale  # per tensor
  assert np.all(np.abs(y8 - xn @ wn) <= _bound(xn, w_step) + x_step @ (np.abs(wn) + w_step))
  # Blocked scales under an activation mode: the active mode's matmul on the dequantized kernel.
  blocked = quantize_weight(w, "int8", (0,), 16)
  np.testing.assert_allclose(dense_dot(x, blocked, 1, jnp.float32, "int8"),
                             quantization.quantized_dot_general("int8", x, blocked.dequantize(jnp.float32),
                                                                (((1,), (0,)), ((), ()))), rtol=1e-6, atol=1e-6)


def test_several_input_axes_and_a_stacked_kernel():
  """Attention's out projection: [heads, head_dim, embed] contracting two axes, stacked over layers."""
  kernel = jax.random.normal(jax.random.key(2), (3, 4, 8, 16), jnp.float32)
  q = quantize_weight(kernel, "int8", (1, 2))
  assert q.scale.shape == (3, 1, 1, 16)
  x = jax.random.normal(jax.random.key(3), (2, 5, 4, 8), jnp.float32)
  layer = QuantizedWeight(q.values[1], q.scale[1], q.dtype)
  y = dense_dot(x, layer, 2, jnp.float32, "")
  np.testing.assert_allclose(y, jnp.einsum("blhd,hde->ble", x, layer.dequantize(jnp.float32)), rtol=1e-5, atol=1e-5)
  assert layer[...].shape == (4, 8, 16)  # what `param[...]` reads: the float kernel


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_channel_of_zeros_or_tiny_weights_converts_without_nan(mode):
  """A channel (block) of zeros, or of weights so small that amax / limit is subnormal: CPUs and TPUs flush
  that scale to 0, and 0 / 0 gave NaN values (fp8 stored them: NaN logits)."""
  w = np.array(_x_w()[1])
  w[:, 0] = 0.0
  w[:, 1] = 2e-38  # normal, but / 127 or / 448 subnormal
  w[::2, 1] = -6e-39  # itself subnormal: flushed to 0 on CPU
  w[:, 2] = 1e-37
  for block in (0, 16):
    q = quantize_weight(jnp.asarray(w), mode, (0,), block)
    assert np.all(np.isfinite(np.asarray(q.values, np.float32))) and np.all(np.asarray(q.scale) > 0)
    deq = np.asarray(q.dequantize(jnp.float32))
    assert np.all(deq[:, 0] == 0) and np.all(np.abs(deq[:, 1:3] - w[:, 1:3]) <= 2e-38)
    np.testing.assert_allclose(deq[:, 3:], w[:, 3:], atol=float(np.abs(w).max()) / 16)
    y = dense_dot(jnp.ones((2, 64), jnp.float32), q, 1, jnp.float32, mode)
    assert np.all(np.isfinite(np.asarray(y)))


def test_nan_or_inf_weights_are_one_line_naming_the_kernel():
  """A NaN or inf in a kernel: before, int8 gave that channel a scale of 1 (its other weights rounded to 0,
  the NaN to 0) and decoding went on with a silently different model; now the scale carries it, and the
  engine's conversion stops with one line naming the kernel."""
  w = np.array(_x_w()[1])
  for bad in (np.nan, np.inf, -np.inf):
    w_bad = w.copy()
    w_bad[5, 3] = bad
    for mode in ("int8", "fp8"):
      q = quantize_weight(jnp.asarray(w_bad), mode, (0,))
      assert not np.isfinite(np.asarray(q.scale)[0, 3]) and np.all(np.isfinite(np.asarray(q.scale)[0, :3]))
  engine = Engine(Config.for_testing(**TINY, quantize_weights="int8"), num_slots=1, mesh=one_device_mesh())
  params = Engine(Config.for_testing(**TINY), mesh=one_device_mesh()).load_params(seed=1)
  params["layers"]["mlp"]["wo"]["kernel"] = params["layers"]["mlp"]["wo"]["kernel"].at[1, 7, 3].set(jnp.nan)
  with pytest.raises(UserError, match=r"^quantize_weights=int8: the parameters hold NaN or inf weights in 1 of the 7 "
                     r"kernels converted, first layers/mlp/wo/kernel; load a checkpoint"):
    engine.prepare_params(params)


def test_blocks_of_a_kernel_with_several_input_axes_are_consecutive_input_rows():
  """Attention's out projection [heads, head_dim, embed] with quantize_weights_block=B: one scale per B rows
  of [heads x head_dim, embed] (DeepSeek-V3's layout). Each axis was blocked by B on its own, which made a
  block heads x head_dim rows: one scale per output channel, so a head of small weights rounded to zeros."""
  kernel = np.array(jax.random.normal(jax.random.key(6), (4, 16, 8), jnp.float32))
  kernel[3] *= 1e-3  # one head's weights far below the others'
  for block, scale_shape in ((16, (4, 1, 8)), (8, (4, 2, 8)), (32, (2, 1, 8)), (64, (1, 1, 8)), (128, (1, 1, 8))):
    q = quantize_weight(jnp.asarray(kernel), "int8", (0, 1), block)
    assert q.scale.shape == scale_shape, block
    rows = np.asarray(q.dequantize(jnp.float32)).reshape(64, 8)
    for start in range(0, 64, min(block, 64)):  # each block within half a step of its own amax
      part = kernel.reshape(64, 8)[start:start + block]
      assert np.all(np.abs(rows[start:start + block] - part) <= np.abs(part).max(0) / 254 * (1 + 1e-5))
  with pytest.raises(ValueError, match=re.escape("quantize_weights_block=24 does not tile the input axes 4 x 16")):
    quantize_weight(jnp.asarray(kernel), "int8", (0, 1), 24)
  with pytest.raises(UserError, match=r"quantize_weights_block=32 does not tile the input axes 4 x 12 .* of "
                     r"layers/self_attention/out/kernel"):
    Engine(Config.for_testing(**dict(TINY, head_dim=12, base_mlp_dim=96), quantize_weights="fp8",
                              quantize_weights_block=32), mesh=one_device_mesh())


def _logits(engine: Engine, params, tokens: jax.Array) -> jax.Array:
  apply = jax.jit(sharding.unsharded()(engine.spec.apply))
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return apply(params, tokens, positions, jnp.ones_like(tokens))


def _agreement_and_kl(reference: jax.Array, quantized: jax.Array) -> tuple[float, float]:
  """The share of positions whose argmax agrees, and the mean KL(reference || quantized) in nats."""
  log_p, log_q = jax.nn.log_softmax(reference, -1), jax.nn.log_softmax(quantized, -1)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)
  return float(jnp.mean(jnp.argmax(reference, -1) == jnp.argmax(quantized, -1))), float(jnp.mean(kl))


# Bounds on the random tiny model (flat logits: near ties make argmax flips likelier than on a
# trained model). The measured figures are in getting_started/Serving.md.
BOUNDS = {"int8": (0.95, 1e-4), "fp8": (0.90, 3e-3)}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_engine_against_its_float_engine(mode):
  reference = Engine(Config.for_testing(**TINY), num_slots=2, mesh=one_device_mesh())
  float_params = reference.load_params(seed=1)
  engine = Engine(Config.for_testing(**TINY, quantize_weights=mode), num_slots=2, mesh=one_device_mesh())
  params = engine.prepare_params(float_params)
  # Every projection of the stack converted; the embedding, the head and the norms kept.
  converted = {path for path, leaf in _leaves(params) if isinstance(leaf, QuantizedWeight)}
  assert converted == {("layers", "self_attention", p, "kernel") for p in ("query", "key", "value", "out")} | \
      {("layers", "mlp", p, "kernel") for p in ("wi_0", "wi_1", "wo")}
  kernel_bytes = sum(_get(float_params, p).nbytes for p in converted)
  scale_bytes = sum(_get(params, p).scale.nbytes for p in converted)
  before, after = quantized_weights.weight_bytes(float_params), quantized_weights.weight_bytes(params)
  assert after == before - kernel_bytes + kernel_bytes // 4 + scale_bytes  # float32 -> 1 byte each
  tokens = jax.random.randint(jax.random.key(0), (16, 24), 0, 128)
  agreement, kl = _agreement_and_kl(_logits(reference, float_params, tokens), _logits(engine, params, tokens))
  least, most = BOUNDS[mode]
  assert agreement >= least and kl <= most, (agreement, kl)
  # The engine decodes the converted weights as the model's full forward pass does.
  prompts = [[3, 9, 27], [1, 2, 3, 4, 5]]
  assert engine_tokens(engine, params, prompts, 8) == [uncached_greedy(engine.spec, params, p, 8, 24) for p in prompts]


def _leaves(tree, path=()):
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _leaves(value, path + (key,))
  else:
    yield path, tree


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def test_refused_values():
  with pytest.raises(ConfigError, match=re.escape('quantize_weights must be one of "" (off), int8, fp8; got \'int4\'')):
    Config.for_testing(**TINY, quantize_weights="int4")
  with pytest.raises(ConfigError, match="quantize_weights_block must be >= 0"):
    Config.for_testing(**TINY, quantize_weights="int8", quantize_weights_block=-1)
  # A block without a mode converted nothing, silently: the float kernels were served.
  with pytest.raises(ConfigError, match=re.escape("quantize_weights_block=128 needs quantize_weights=int8 or fp8")):
    Config.for_testing(**TINY, quantize_weights_block=128)
  with pytest.raises(UserError, match="quantize_weights_block=24 does not divide the input axis of 64"):
    Engine(Config.for_testing(**TINY, quantize_weights="fp8", quantize_weights_block=24), mesh=one_device_mesh())
  with pytest.raises(ValueError, match=re.escape('quantize_weights must be one of "" (off), int8, fp8;')):
    quantize_weight(jnp.ones((4, 4)), "int4", (0,))


def test_rollout_weight_copies_are_converted_once_each():
  """GRPO: without a rollout mesh every step's policy is converted; on one, each copy once it is made."""
  config = Config.for_testing(**TINY, quantize_weights="int8")
  engine = Engine(config, num_slots=2, mesh=one_device_mesh())
  float_params = Engine(Config.for_testing(**TINY), mesh=one_device_mesh()).load_params(seed=1)
  assert quantized_weights.rollout_preparer(Config.for_testing(**TINY), engine.param_shardings) is None
  same_mesh = rollout_mesh.WeightSync(None, 1, prepare=quantized_weights.rollout_preparer(config, engine.param_shardings))
  params, scalars = same_mesh.for_step(float_params, 0)
  assert scalars == {} and isinstance(params["layers"]["mlp"]["wo"]["kernel"], QuantizedWeight)
  assert not isinstance(float_params["layers"]["mlp"]["wo"]["kernel"], QuantizedWeight)  # the policy is untouched
  other = Engine(config, num_slots=2, mesh=Mesh(np.asarray(jax.devices()[4:5]).reshape(one_device_mesh().devices.shape),
                                                one_device_mesh().axis_names))
  sync = rollout_mesh.WeightSync(other.param_shardings, 2, prepare=other.prepare_params)
  copy, scalars = sync.for_step(float_params, 0)
  assert scalars["weight_sync_bytes"] == quantized_weights.weight_bytes(float_params)  # what was copied
  kernel = copy["layers"]["self_attention"]["query"]["kernel"]
  assert isinstance(kernel, QuantizedWeight) and kernel.values.devices() == {jax.devices()[4]}
  assert sync.for_step(float_params, 1)[0] is copy  # between copies: the converted copy again


def test_a_later_conversion_compiles_nothing_and_equals_a_fresh_program():
  """Each GRPO rollout converts the policy again, and a served engine its checkpoint: both reuse the
  programs of the first conversion of same-shaped weights, and give what a fresh program gives."""
  config = Config.for_testing(**TINY, quantize_weights="int8")
  engine = Engine(config, num_slots=2, mesh=one_device_mesh())
  float_params = Engine(Config.for_testing(**TINY), mesh=one_device_mesh()).load_params(seed=1)
  prepare = quantized_weights.rollout_preparer(config, engine.param_shardings)
  first = prepare(float_params, False)
  policy = jax.block_until_ready(jax.tree.map(jnp.copy, float_params))  # the next step's arrays
  compiles = []

  def on_event(event, duration, **kwargs):  # a lowering, and a compile (or a persistent-cache read)
    if event in ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration"):
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    later, served = prepare(policy, False), engine.prepare_params(float_params)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  assert compiles == []
  axes = engine.weight_quantizer.contract_axes
  assert len(axes) == 7
  for path, contract in axes.items():
    fresh = jax.jit(functools.partial(quantize_weight, mode="int8", contract_axes=contract))(_get(float_params, path))
    for params in (first, later, served):
      got = _get(params, path)
      assert got.values.dtype == jnp.int8 and np.array_equal(got.values, fresh.values), path
      assert np.array_equal(got.scale, fresh.scale), path


# MLA with routed and shared experts after a dense first layer: the dense_layers and layers stacks,
# the expert kernels (read dequantized) and MLA's kv_b (read whole by the absorbed decode).
MLA_MOE = dict(TINY, decoder_block="deepseek3", base_num_query_heads=4, base_num_kv_heads=4, head_dim=12,
               base_mlp_dim=32, attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=6, num_experts=4, num_experts_per_tok=2, shared_experts=1,
               first_dense_layers=1, dense_mlp_dim=48)


@pytest.mark.slow
def test_mla_and_experts_convert_and_decode_like_their_forward_pass():
  reference = Engine(Config.for_testing(**MLA_MOE), num_slots=2, mesh=one_device_mesh())
  float_params = reference.load_params(seed=3)
  engine = Engine(Config.for_testing(**MLA_MOE, quantize_weights="int8"), num_slots=2, mesh=one_device_mesh())
  params = engine.prepare_params(float_params)
  converted = {"/".join(path) for path, leaf in _leaves(params) if isinstance(leaf, QuantizedWeight)}
  assert {"dense_layers/mlp/wo/kernel", "layers/mlp/wi_0/kernel", "layers/mlp/shared_mlp/wo/kernel",
          "layers/self_attention/wkv_b/kernel"} <= converted
  assert "layers/mlp/gate/kernel" not in converted  # the router stays float
  tokens = jax.random.randint(jax.random.key(1), (16, 24), 0, 128)
  agreement, kl = _agreement_and_kl(_logits(reference, float_params, tokens), _logits(engine, params, tokens))
  # Looser KL than the dense model's: a token whose top-2 experts are near a tie may route differently.
  assert agreement >= BOUNDS["int8"][0] and kl <= 1e-3, (agreement, kl)
  prompts = [[3, 9, 27], [1, 2, 3, 4, 5]]
  assert engine_tokens(engine, params, prompts, 6) == [uncached_greedy(engine.spec, params, p, 6, 24) for p in prompts]


@pytest.mark.slow
def test_sharded_conversion_decodes_like_one_device_and_compiles_ahead_of_time():
  """tensor=2 x fsdp=4: each converted kernel's values sharded as the kernel, its scales unsplit on the
  input axes; the decode step compiles for the float layout (what train_compile's rollout check passes)."""
  config = Config.for_testing(**TINY, quantize_weights="int8", ici_tensor_parallelism=2, ici_fsdp_parallelism=4)
  single = Engine(config, num_slots=4, mesh=one_device_mesh())
  float_params = Engine(Config.for_testing(**TINY), mesh=one_device_mesh()).load_params(seed=2)
  sharded = Engine(config, num_slots=4)
  params = sharded.prepare_params(jax.device_put(float_params, sharded.param_shardings))
  query = params["layers"]["self_attention"]["query"]["kernel"]
  kernel_spec = sharded.param_shardings["layers"]["self_attention"]["query"]["kernel"].spec
  assert query.values.sharding.spec == kernel_spec and query.scale.sharding.spec[1] is None
  prompts = [[3, 9, 27], [1, 2, 3, 4, 5, 6, 7, 8], [100], [50, 60, 70, 80, 90]]
  assert engine_tokens(sharded, params, prompts, 8) == engine_tokens(single, single.prepare_params(float_params),
                                                                      prompts, 8)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), float_params,
                          sharded.param_shardings)
  compiled = sharded.compile_step(abstract)
  quantized_args = [a for a in jax.tree.leaves(compiled.args_info) if a.dtype == jnp.int8]  # type: ignore[attr-defined]
  assert len(quantized_args) == 7


def test_weight_and_activation_int8_engine_agrees_with_float():
  """quantization=int8 beside quantize_weights=int8: int8 x int8 dots on the stored values."""
  reference = Engine(Config.for_testing(**TINY), num_slots=2, mesh=one_device_mesh())
  float_params = reference.load_params(seed=1)
  engine = Engine(Config.for_testing(**TINY, quantize_weights="int8", quantization="int8"), num_slots=2,
                  mesh=one_device_mesh())
  tokens = jax.random.randint(jax.random.key(0), (16, 24), 0, 128)
  agreement, kl = _agreement_and_kl(_logits(reference, float_params, tokens),
                                    _logits(engine, engine.prepare_params(float_params), tokens))
  assert agreement >= 0.9 and kl <= 1e-3, (agreement, kl)


@pytest.mark.slow  # two training processes
def test_grpo_rollouts_from_int8_weights_on_a_rollout_mesh_equal_the_same_mesh_run(workdir, tmp_path):  # noqa: F811
  """The same-mesh run converts the policy before every rollout, the split run each weight copy on the
  rollout devices: the same int8 weights, so the same completions and rewards."""
  same = _train(workdir, tmp_path / "same", "steps=3", "quantize_weights=int8", devices=2)
  split = _train(workdir, tmp_path / "split", "steps=3", "quantize_weights=int8", "rl_rollout_devices=2",
                 "rl_rollout_ici_tensor_parallelism=2", devices=4)
  assert same.returncode == 0 and split.returncode == 0, (same.stderr + split.stderr)[-3000:]
  ours, theirs = _metrics(tmp_path / "split"), _metrics(tmp_path / "same")
  assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
  assert [r["completions/mean_length"] for r in ours] == [r["completions/mean_length"] for r in theirs]


def test_the_cpu_matmul_by_blocks_of_input_rows_equals_one_dot(monkeypatch):
  """On CPU the weight-only matmul converts the kernel a block of input rows at a time in a loop."""
  from MaxText.layers import weight_quantization
  kernel = jax.random.normal(jax.random.key(4), (4, 8, 6), jnp.float32)  # in (4, 8), out 6
  q = quantize_weight(kernel, "int8", (0, 1))
  x = jax.random.normal(jax.random.key(5), (2, 3, 4, 8), jnp.float32)
  whole = dense_dot(x, q, 2, jnp.float32, "")
  monkeypatch.setattr(weight_quantization, "CPU_CHUNK_ELEMENTS", 30)  # blocks of 4 rows: 8 loop steps
  hlo = jax.jit(lambda a: dense_dot(a, q, 2, jnp.float32, "")).lower(x).as_text()
  assert "stablehlo.while" in hlo
  np.testing.assert_allclose(dense_dot(x, q, 2, jnp.float32, ""), whole, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(whole, jnp.einsum("blhd,hde->ble", x, q.dequantize(jnp.float32)), rtol=1e-5, atol=1e-5)


def test_a_list_of_choices_writes_the_empty_value():
  """The empty value is written `""` with its meaning, never as nothing between commas."""
  with pytest.raises(ConfigError, match=re.escape('wandb_mode must be one of "" (wandb\'s own choice), online,')):
    Config.for_testing(**TINY, wandb_mode="cloud")
  with pytest.raises(ValueError, match=re.escape('quantization must be one of "" (float), int8, fp8, mxfp8;')):
    with quantization.use_quantization("int4"):
      pass


def test_a_checkpoint_of_converted_kernels_is_one_line_naming_one(tmp_path):
  """An engine's converted parameters saved as a checkpoint: loading it (with or without quantize_weights)
  names an 8-bit kernel and asks for the float checkpoint; a kernel stored as any other subtree is the
  loader's one line too (both were an Orbax TypeError traceback)."""
  from MaxText.training import params_io

  engine = Engine(Config.for_testing(**TINY, quantize_weights="int8"), mesh=one_device_mesh())
  params = engine.load_params()
  params_io.save_params(str(tmp_path / "converted"), params)
  for keys in ({}, dict(quantize_weights="int8")):
    reader = Engine(Config.for_testing(**TINY, **keys), mesh=one_device_mesh())
    with pytest.raises(UserError, match=r"holds 8-bit kernels .* at layers/\S+/kernel; load the float checkpoint"):
      reader.load_params(str(tmp_path / "converted"))
  odd = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), engine.spec.abstract_params)
  odd["layers"]["mlp"]["wo"]["kernel"] = {"w": odd["layers"]["mlp"]["wo"]["kernel"]}
  params_io.save_params(str(tmp_path / "odd"), odd)
  with pytest.raises(UserError, match=r"cannot load parameters .* params/layers/mlp/wo/kernel is not stored"):
    reader.load_params(str(tmp_path / "odd"))


def test_a_block_too_small_to_save_memory_is_one_warning(capsys):
  """A float32 scale per 1 to 4 int8/fp8 weights is as many bytes a weight as bfloat16 or more: served without a word,
  it took more memory than the checkpoint it was meant to shrink."""
  from MaxText.configuration import config_fields

  config_fields.WARNED.clear()
  Config.for_testing(**TINY, quantize_weights="int8", quantize_weights_block=2)
  Config.for_testing(**TINY, quantize_weights="int8", quantize_weights_block=2)
  lines = [line for line in capsys.readouterr().err.splitlines() if "quantize_weights_block" in line]
  assert lines == ["warning: quantize_weights_block=2 stores a float32 scale per 2 weight(s): as many bytes a weight "
                   "as bfloat16 or more, so it saves no memory; use a block of 32 to 128, or 0 (one scale per output "
                   "channel)"]
  Config.for_testing(**TINY, quantize_weights="int8", quantize_weights_block=8)
  assert "quantize_weights_block" not in capsys.readouterr().err
