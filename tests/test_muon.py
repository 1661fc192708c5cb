"""opt_type=muon (training/muon.py): which parameters Muon takes and how it sees them, its update against a
NumPy reference of the published algorithm, sharded training equal to one device, and a killed run resuming
bitwise (Muon's momentum is in the checkpoint)."""

from __future__ import annotations

import signal

import jax
import numpy as np
import pytest
from optax import contrib

import train_utils
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText import models
from MaxText.training import muon, optimizers
from tests import test_resume

TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
            print_config=False, dtype="float32", opt_type="muon", learning_rate=1e-2, warmup_steps_fraction=0.0)
NS = (3.4445, -4.775, 2.0315)  # the quintic's coefficients (Jordan's modded-nanogpt), five iterations


def test_matrices_take_muon_with_their_input_axes_and_the_rest_adamw():
  spec = models.build_model_spec(Config.for_testing(**TINY, num_experts=4, num_experts_per_tok=2).model)
  flat = jax.tree_util.tree_flatten_with_path(spec.logical_names, is_leaf=lambda x: isinstance(x, tuple))[0]
  got = {"/".join(k.key for k in path): muon.dimension_numbers(names) for path, names in flat}
  dims = contrib.MuonDimensionNumbers
  assert got["token_embedder/embedding"] is None and got["logits_dense/kernel"] is None
  assert got["decoder_norm/scale"] is None and got["layers/pre_self_attention_layer_norm/scale"] is None
  assert got["layers/self_attention/query/kernel"] == dims((1,), (2, 3))  # [layers, embed, heads, kv]
  assert got["layers/self_attention/out/kernel"] == dims((1, 2), (3,))  # [layers, heads, kv, embed]
  experts = [name for name in got if name.startswith("layers/mlp/") and name.endswith("wo/kernel")]
  assert experts and all(got[name] == dims((2,), (3,)) for name in experts)  # [layers, exp, mlp, embed]


def test_lora_adapters_read_their_kernels_input_axes():
  """An adapter lora_a [in dims..., r] reads what its kernel reads and lora_b [r, out dims...] writes what it writes.
  The output projection's lora_a [heads, kv, r] was orthogonalised as a heads x (kv r) matrix, mixing its input's
  kv axis into its output (and scaled for those fans), not as the (heads kv) x r matrix it applies."""
  cfg = Config.for_testing(**TINY, lora_rank=4, lora_target_modules=["q_proj", "o_proj", "down_proj"])
  names = models.build_model_spec(cfg.model).logical_names
  flat = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, tuple))[0]
  got = {"/".join(k.key for k in path): muon._dims_at(names, path) for path, _ in flat}
  dims = contrib.MuonDimensionNumbers
  assert got["layers/self_attention/out/lora_a"] == dims((1, 2), (3,))  # [layers, heads, kv, r]
  assert got["layers/self_attention/out/lora_b"] == dims((1,), (2,))  # [layers, r, embed]
  assert got["layers/self_attention/query/lora_a"] == dims((1,), (2,))  # [layers, embed, r]
  assert got["layers/self_attention/query/lora_b"] == dims((1,), (2, 3))  # [layers, r, heads, kv]
  assert got["layers/mlp/wo/lora_a"] == dims((1,), (2,)) and got["layers/mlp/wo/lora_b"] == dims((1,), (2,))


def test_position_tables_multi_head_biases_and_depthwise_convs_take_adamw():
  """Parameters with two non-batch axes that are no projection's matrix took Muon's orthogonalised update: a
  learned position table ([positions, embed], no `vocab` axis: an input embedding like the token table), a
  multi-head projection's bias ([heads, kv]; GPT-3, gpt-oss, the vision towers) and a gated DeltaNet layer's
  depthwise convolution ([taps, heads, kv], a filter per channel; Qwen3-Next, Qwen3.5). AdamW's first update is
  the learning rate times the gradient's sign; a kernel beside them keeps Muon's."""
  cfg = Config.for_testing(**TINY, position_embedding="learned", adam_weight_decay=0.0,
                           gradient_clipping_threshold=0.0)
  assert models.build_model_spec(cfg.model).logical_names["position_embedder"]["embedding"] == (None, "embed")
  logical = {"position_embedder": {"embedding": (None, "embed")},
             "attention": {"query": {"bias": ("layers", "heads", "kv"), "kernel": ("layers", "embed", "heads", "kv")},
                           "query_conv": ("layers", None, "heads", "kv")}}
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda shape: rng.normal(size=shape).astype(np.float32), {
      "position_embedder": {"embedding": (8, 6)},
      "attention": {"query": {"bias": (2, 3, 4), "kernel": (2, 6, 3, 4)}, "query_conv": (2, 4, 3, 4)}},
      is_leaf=lambda x: isinstance(x, tuple))
  optimizer = optimizers.create_optimizer(cfg.optim, logical)
  params = jax.tree.map(np.zeros_like, grads)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  for got, g in ((updates["position_embedder"]["embedding"], grads["position_embedder"]["embedding"]),
                 (updates["attention"]["query"]["bias"], grads["attention"]["query"]["bias"]),
                 (updates["attention"]["query_conv"], grads["attention"]["query_conv"])):
    np.testing.assert_allclose(np.asarray(got), -1e-2 * np.sign(g), rtol=1e-5)
  kernel = updates["attention"]["query"]["kernel"]
  assert not np.allclose(np.asarray(kernel), -1e-2 * np.sign(grads["attention"]["query"]["kernel"]), rtol=1e-2)


def _orthogonalise(x: np.ndarray) -> np.ndarray:
  """The published Newton-Schulz quintic on one matrix, in float64."""
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(5):
    a = x @ x.T
    x = NS[0] * x + (NS[1] * a + NS[2] * a @ a) @ x
  return x.T if transposed else x


def test_the_update_equals_a_numpy_reference_of_the_algorithm():
  """Two steps on a scanned [layers, embed, mlp] kernel and an [layers, heads, kv, embed] output kernel: Nesterov
  momentum with bias correction, per-layer orthogonalisation over the reduction and output axes, the RMS match
  (0.2 sqrt(max(fan_in, fan_out))), decoupled weight decay, the learning rate."""
  cfg = Config.for_testing(**TINY, adam_weight_decay=0.1, gradient_clipping_threshold=0.0).optim
  names = {"w": ("layers", "embed", "mlp"), "o": ("layers", "heads", "kv", "embed")}
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(2, 6, 10)).astype(np.float32), "o": rng.normal(size=(2, 3, 4, 6)).astype(np.float32)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(2)]
  # Each a projection's `kernel`, the leaves Muon takes.
  optimizer = optimizers.create_optimizer(cfg, {k: {"kernel": v} for k, v in names.items()})
  kernels = lambda tree: {k: {"kernel": v} for k, v in tree.items()}  # noqa: E731
  state, current = optimizer.init(kernels(params)), dict(params)
  lr, beta = cfg.learning_rate, cfg.muon_beta
  expected = {k: v.astype(np.float64) for k, v in params.items()}
  momentum = {k: np.zeros_like(v, np.float64) for k, v in params.items()}
  for t, g in enumerate(grads, start=1):
    updates, state = optimizer.update(kernels(g), state, kernels(current))
    current = {k: np.asarray(current[k] + updates[k]["kernel"]) for k in current}
    for k in params:
      momentum[k] = beta * momentum[k] + (1 - beta) * g[k]
      nesterov = beta * momentum[k] / (1 - beta ** (t + 1)) + (1 - beta) * g[k] / (1 - beta ** t)
      layers = nesterov.shape[0]
      mats = nesterov.reshape(layers, 6, -1) if k == "w" else nesterov.reshape(layers, 12, 6)
      orth = np.stack([_orthogonalise(m) for m in mats]) * 0.2 * np.sqrt(max(mats.shape[1:]))
      expected[k] = expected[k] - lr * (orth.reshape(nesterov.shape) + cfg.adam_weight_decay * expected[k])
  for k in params:
    np.testing.assert_allclose(current[k], expected[k], rtol=2e-4, atol=2e-6, err_msg=k)


@pytest.mark.slow
def test_sharded_muon_training_equals_one_device():
  """fsdp=4 x tensor=2 over the 8 CPU devices gives the single device's losses and weights after 3 steps: the
  orthogonalisation runs on sharded momentum."""
  one = train_utils.Run(Config.for_testing(**TINY, ici_fsdp_parallelism=1, ici_data_parallelism=8))
  sharded = train_utils.Run(Config.for_testing(**TINY, ici_fsdp_parallelism=4, ici_tensor_parallelism=2))
  state_a, hist_a = one.train(one.init(), 3)
  state_b, hist_b = sharded.train(sharded.init(), 3)
  assert hist_a[-1]["loss"] < hist_a[0]["loss"]
  np.testing.assert_allclose([h["loss"] for h in hist_b], [h["loss"] for h in hist_a], rtol=1e-5)
  # Newton-Schulz's five matmul rounds amplify the sharded sums' different rounding: one weight in
  # 8192 has been seen 3e-4 (relative) off after 3 steps on a 2-core machine, at base as well.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=5e-5),
               jax.device_get(state_b.params), jax.device_get(state_a.params))
  muon_state = [x for x in jax.tree.leaves(state_b.opt_state) if getattr(x, "ndim", 0) == 4]
  assert muon_state and all(not x.sharding.is_fully_replicated for x in muon_state)


def test_bad_muon_keys_are_one_line_errors():
  with pytest.raises(ConfigError, match="opt_type must be one of adamw, muon, sgd, adam_pax, got 'rmsprop'"):
    Config.for_testing(**{**TINY, "opt_type": "rmsprop"})
  with pytest.raises(ConfigError, match="Muon needs 0 < muon_beta < 1"):
    Config.for_testing(**TINY, muon_beta=1.0)
  # An infinite scale passed `>= 0` and made every matrix's update infinite: NaN parameters.
  with pytest.raises(ConfigError, match="muon_consistent_rms a finite float32 number >= 0; got 0.95, 5, inf"):
    Config.for_testing(**TINY, muon_consistent_rms=float("inf"))
  # 0.99999999 is 1.0 in float32: the momentum's bias correction 1 - beta^t was 0.
  with pytest.raises(ConfigError, match=r"Muon needs 0 < muon_beta < 1 \(in float32\).* got 0.99999999, 5, 0.2"):
    Config.for_testing(**TINY, muon_beta=0.99999999)
  # Optax unrolls the Newton-Schulz loop: 100000 was accepted and the compile grew with the count.
  with pytest.raises(ConfigError, match=r"muon_ns_steps must be at most 100 \(each iteration is unrolled"):
    Config.for_testing(**TINY, muon_ns_steps=100000)


@pytest.mark.slow  # two training processes
def test_a_killed_muon_run_resumes_bitwise(tmp_path):
  reference = tmp_path / "reference"
  test_resume._run(test_resume._command(reference, "ref", "checkpoint_period=5", "opt_type=muon"))
  command = test_resume._command(tmp_path, "killed", "checkpoint_period=5", "opt_type=muon")
  run_dir = tmp_path / "killed"
  proc = test_resume._start_and_signal(command, 12, lambda: 10 in test_resume._committed_steps(run_dir),
                                       signal.SIGKILL)
  proc.communicate(timeout=60)
  latest = test_resume._committed_steps(run_dir)[-1]
  rerun = test_resume._run(command)
  assert f"state: resumed from step {latest}" in rerun.stdout
  assert test_resume._losses(run_dir) == test_resume._losses(reference / "ref")
