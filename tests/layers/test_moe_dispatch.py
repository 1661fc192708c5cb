"""MoE at pod scale: the all-to-all dispatch against the gather path (losses, gradients and
parameters after two steps on the 8-device mesh), what the compiled step communicates, the
ragged exchange's semantics, the grouped-matmul kernels, routing health and bad input."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.training import metrics as metrics_lib
from MaxText import train_compile
from MaxText.platform import sharding
from MaxText.training.objectives.language_model import routing_metrics
from MaxText.configuration.config import BASE_CONFIG_PATH
from MaxText.errors import ConfigError
from MaxText.layers import grouped_matmul, moe, moe_dispatch
from MaxText.training.run_assembly import build_run
from MaxText.training.trainer import RouterHealthHook, StepRecord
from tests.compile_settings import cpu_xla_flags, jax_cache_env
from train_utils import Run

from layers.test_moe import D, E, F, TOP_K, _apply, _block, _reference, tiny_mixtral

REPO = Path(__file__).resolve().parents[2]
LENGTH, DIM = 16, 64
DROPLESS_GROUPED = dict(capacity_factor=-1.0, sparse_matmul=True)
DROPPING = dict(capacity_factor=0.5)  # half an even share: many assignments dropped
DROPLESS_PADDED = dict(capacity_factor=-1.0)


def _two_steps(**overrides):
  run = Run(tiny_mixtral(max_target_length=LENGTH, vocab_size=128, learning_rate=3e-3, **overrides))
  state, history = run.train(run.init(), 2)
  return jax.device_get(state.params), history


def _assert_same_training(got, want, rtol=2e-5):
  (got_params, got_history), (want_params, want_history) = got, want
  for key in ("loss", "grad_norm", "moe_lb_loss"):
    np.testing.assert_allclose([h[key] for h in got_history], [h[key] for h in want_history], rtol=rtol, err_msg=key)
  for path, got_leaf in jax.tree_util.tree_leaves_with_path(got_params):
    want_leaf = functools.reduce(lambda tree, key: tree[key.key], path, want_params)
    np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


MESHES = {
    "expert2_fsdp4": dict(ici_expert_parallelism=2, ici_fsdp_parallelism=-1),
    "expert4_tensor2": dict(ici_expert_parallelism=4, ici_tensor_parallelism=2, ici_fsdp_parallelism=1),
    "expert8": dict(ici_expert_parallelism=8, ici_fsdp_parallelism=1, num_experts=8),
    "expert2_fsdp2_tensor2": dict(ici_expert_parallelism=2, ici_tensor_parallelism=2, ici_fsdp_parallelism=-1),
    "expert2_data2_tensor2": dict(ici_expert_parallelism=2, ici_tensor_parallelism=2, ici_data_parallelism=2,
                                  ici_fsdp_parallelism=1),
}
CASES = [
    # Slow-marked: by default test_receive_buffer_factor_bounds_the_buffer_and_drops_only_what_overflows trains this
    # very case (its buffer factor 2.0 is the worst-case buffer, the same as the default) against the gather path.
    pytest.param("expert2_fsdp4", DROPLESS_GROUPED, 0, marks=pytest.mark.slow),
    ("expert4_tensor2", DROPPING, 1),
    pytest.param("expert8", DROPLESS_GROUPED, 1, marks=pytest.mark.slow),
    pytest.param("expert2_fsdp2_tensor2", DROPLESS_PADDED, 0, marks=pytest.mark.slow),
    pytest.param("expert4_tensor2", DROPLESS_GROUPED, 1, marks=pytest.mark.slow),
    pytest.param("expert8", DROPPING, 0, marks=pytest.mark.slow),
    pytest.param("expert2_fsdp4", DROPPING, 1, marks=pytest.mark.slow),
    pytest.param("expert2_data2_tensor2", DROPLESS_GROUPED, 0, marks=pytest.mark.slow),
    pytest.param("expert2_data2_tensor2", DROPPING, 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh, mode, shared", CASES)
def test_all_to_all_trains_exactly_like_the_gather_path(mesh, mode, shared):
  """Loss, gradient norm, load-balancing loss and every updated parameter after two steps."""
  overrides = dict(MESHES[mesh], **mode, shared_experts=shared)
  want = _two_steps(**overrides, moe_dispatch="gather")
  got = _two_steps(**overrides, moe_dispatch="all_to_all")
  _assert_same_training(got, want)
  if mode is DROPPING:  # the capacity really drops, the same assignments on both paths
    dropped = [v for k, v in got[1][0].items() if k.startswith("moe_dropped_fraction/")]
    assert dropped and min(dropped) > 0.1, dropped


# Llama 4's routing: top-1, sigmoid(router logit) on the expert input, a shared expert.
INPUT_SCALED = dict(num_experts_per_tok=1, moe_router_scales_input=True, shared_experts=1)


@pytest.mark.parametrize("mode", [DROPLESS_GROUPED, DROPPING])
@pytest.mark.slow
def test_input_scaled_routing_trains_alike_on_both_dispatches(mode):
  """The input scaling happens before dispatch, so all_to_all must still equal gather."""
  overrides = dict(MESHES["expert2_fsdp4"], **mode, **INPUT_SCALED)
  _assert_same_training(_two_steps(**overrides, moe_dispatch="all_to_all"),
                        _two_steps(**overrides, moe_dispatch="gather"))


def test_receive_buffer_factor_bounds_the_buffer_and_drops_only_what_overflows():
  """Big enough: the same training as the gather path (dropless); small: rows are dropped, so the
  output changes, and the receive buffer in the compiled step is that many even shares."""
  overrides = dict(MESHES["expert2_fsdp4"], **DROPLESS_GROUPED)
  want = _two_steps(**overrides, moe_dispatch="gather")
  _assert_same_training(_two_steps(**overrides, moe_ragged_buffer_factor=2.0), want)  # 2 even shares = worst case
  assert moe_dispatch.receive_rows(tokens=16, top_k=2, local_experts=2, degree=2, buffer_factor=2.0) == 64
  assert moe_dispatch.receive_rows(tokens=16, top_k=2, local_experts=2, degree=2, buffer_factor=-1) == 64
  assert moe_dispatch.receive_rows(tokens=16, top_k=2, local_experts=2, degree=2, buffer_factor=0.5) == 16
  _, dropping = _two_steps(**overrides, moe_ragged_buffer_factor=0.5)
  assert np.isfinite(dropping[0]["loss"]) and abs(dropping[0]["loss"] - want[1][0]["loss"]) > 1e-4
  # Half an even share: at least half the assignments cannot land; the metric counts them.
  dropped = [v for k, v in dropping[0].items() if k.startswith("moe_dropped_fraction/")]
  assert dropped and all(0.5 <= d < 1 for d in dropped), dropped
  assert all(v == 0 for k, v in want[1][0].items() if k.startswith("moe_dropped_fraction/"))


@pytest.mark.slow  # an escape hatch's equivalence, not the default path
def test_unchecked_shard_map_gives_the_same_gradients(monkeypatch):
  """The shard_map runs with check_vma=False around megablox; that must not change the
  gradients (shard_map inserts the same reductions either way for this body)."""
  overrides = dict(MESHES["expert2_fsdp2_tensor2"], **DROPLESS_GROUPED, moe_dispatch="all_to_all")
  want = _two_steps(**overrides)
  original = moe_dispatch.moe_all_to_all
  monkeypatch.setattr(moe_dispatch, "moe_all_to_all", lambda *a, **k: original(*a, **{**k, "check_vma": False}))
  _assert_same_training(_two_steps(**overrides), want)


@pytest.mark.slow
def test_megablox_kernel_trains_like_ragged_dot(monkeypatch):
  """The Pallas kernel, run by the Pallas interpreter on CPU, inside the all-to-all dispatch."""
  overrides = dict(MESHES["expert2_fsdp4"], **DROPLESS_GROUPED, moe_dispatch="all_to_all")
  want = _two_steps(**overrides)
  monkeypatch.setattr(grouped_matmul, "select",
                      lambda name, platform: functools.partial(grouped_matmul.megablox, interpret=True))
  _assert_same_training(_two_steps(**overrides), want, rtol=1e-4)


def test_shared_experts_add_one_wide_dense_mlp_for_every_token():
  block = _block(tiny_mixtral(shared_experts=2, capacity_factor=-1.0))
  assert block.shared_mlp.wi_0.kernel.shape == (D, 2 * F) and block.shared_mlp.wo.kernel.shape == (2 * F, D)
  x_BLD = np.random.default_rng(3).normal(size=(2, 8, D)).astype(np.float32)
  with sharding.unsharded():
    shared_BLD = np.asarray(block.shared_mlp(jnp.asarray(x_BLD)))
  assert np.abs(shared_BLD).max() > 0.1
  np.testing.assert_allclose(_apply(block, x_BLD), _reference(block, x_BLD, capacity=8) + shared_BLD,
                             rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- what the compiled step communicates


def _collectives(**overrides) -> tuple[int, list[str]]:
  """(number of all-to-alls, all-gathers of token activations [n, L, D] along the batch dim)."""
  config = tiny_mixtral(max_target_length=LENGTH, vocab_size=128, per_device_batch_size=1, **overrides)
  run = build_run(config)
  text = run.train_step.lower(*run.abstract_inputs().as_args()).compile().as_text()
  all_to_all = len(re.findall(r"\ball-to-all\(", text))
  token_gathers = [line.strip()[:120] for line in text.splitlines()
                   if re.search(rf"= f32\[\d+,{LENGTH},{DIM}\]\S* all-gather\(", line) and "dimensions={0}" in line]
  return all_to_all, token_gathers


@pytest.mark.parametrize("mode", [pytest.param(DROPLESS_GROUPED, marks=pytest.mark.slow), DROPPING])
def test_expert_parallel_step_uses_all_to_all_and_gathers_no_tokens(mode):
  mesh = dict(ici_expert_parallelism=4, ici_fsdp_parallelism=-1)
  all_to_all, token_gathers = _collectives(**mesh, **mode, moe_dispatch="all_to_all")
  assert all_to_all >= 2 and not token_gathers, token_gathers
  if mode is DROPLESS_GROUPED:  # the check can fail: the gather path gathers the tokens over `expert`
    _, gather_path = _collectives(**mesh, **mode, moe_dispatch="gather")
    assert gather_path


TPU_MOE = dict(base_emb_dim=256, base_num_query_heads=2, base_num_kv_heads=2, head_dim=64, base_mlp_dim=512,
               base_num_decoder_layers=1, vocab_size=256, max_target_length=128, per_device_batch_size=1,
               print_config=False, decoder_block="mixtral", num_experts=8, num_experts_per_tok=2,
               ici_expert_parallelism=4, ici_fsdp_parallelism=-1, **DROPLESS_GROUPED)


def test_tpu_compile_uses_ragged_all_to_all_and_megablox():
  """On a TPU topology (compiled ahead of time here) auto picks the ragged exchange and the
  Pallas grouped matmul; the step, backward included, compiles."""
  argv = ["train_compile", str(BASE_CONFIG_PATH), "compile_topology=v5e-8"] + [f"{k}={v}" for k, v in TPU_MOE.items()]
  config, devices, _ = train_compile.load_target_config(argv)
  run = build_run(config, devices=devices, compiled_step=False)
  text = run.train_step.lower(*run.abstract_inputs().as_args()).compile().as_text()
  assert len(re.findall(r"ragged-all-to-all\(", text)) >= 4  # there and back, forward and backward
  assert 'custom_call_target="tpu_custom_call"' in text


# ---------------------------------------------------------------- the exchange and the kernels


def test_padded_exchange_has_ragged_all_to_all_semantics():
  """Random row counts between 4 devices: every row lands where ragged_all_to_all puts it."""
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  rng = np.random.default_rng(0)
  n, dim = 12, 3
  sizes = rng.integers(0, 4, size=(4, 4))  # [source, destination], each source sends <= 12 rows
  operand = rng.normal(size=(4, n, dim)).astype(np.float32)
  send_offsets = np.cumsum(sizes, axis=1) - sizes
  land_offsets = (np.cumsum(sizes, axis=0) - sizes)  # in destination d: lower sources first
  want = np.zeros((4, 16, dim), np.float32)
  for s in range(4):
    for d in range(4):
      rows = operand[s, send_offsets[s, d]:send_offsets[s, d] + sizes[s, d]]
      want[d, land_offsets[s, d]:land_offsets[s, d] + sizes[s, d]] = rows

  def per_device(op, out, send_off, send, land, recv):
    return moe_dispatch.padded_ragged_all_to_all(op[0], out[0], send_off[0], send[0], land[0], recv[0],
                                                 axis_name=("x",))[None]

  spec = jax.sharding.PartitionSpec("x")
  args = [operand, np.zeros((4, 16, dim), np.float32), send_offsets, sizes, land_offsets, sizes.T]
  args = [jax.device_put(jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else a.dtype),
                         jax.sharding.NamedSharding(mesh, spec)) for a in args]
  got = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(*args)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_megablox_equals_ragged_dot_values_and_gradients():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(40, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 32, 48)), jnp.float32)
  sizes = jnp.asarray([10, 0, 20], jnp.int32)  # rows 30..39 are padding: zeros out
  kernel = functools.partial(grouped_matmul.megablox, interpret=True)
  np.testing.assert_allclose(kernel(x, w, sizes), grouped_matmul.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(kernel(x, w, sizes))[30:])
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w, sizes)))
  for got, want in zip(jax.grad(loss(kernel), (0, 1))(x, w), jax.grad(loss(grouped_matmul.ragged_dot), (0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- routing health


def _health_metrics(experts_BLk: np.ndarray) -> dict[str, float]:
  probs_BLE = jax.nn.one_hot(experts_BLk[..., 0], E) * 0.5 + 0.5 / E
  stats = moe.routing_health(probs_BLE, moe.routed_fraction(jnp.asarray(experts_BLk), E), jnp.zeros(()))
  sums = {name: value[None] for name, value in stats.items()}  # one layer
  return metrics_lib.host_scalars(routing_metrics(sums, num_micro=1))


def test_even_router_has_zero_load_cv_and_a_collapsed_one_is_reported(capsys):
  tokens = np.arange(2 * 8)
  even = np.stack([tokens % E, (tokens + 1) % E], axis=-1).reshape(2, 8, TOP_K)
  got = _health_metrics(even)
  assert got["moe_load_cv/layer_0"] == pytest.approx(0.0, abs=1e-6)
  assert got["moe_load_max/layer_0"] == pytest.approx(TOP_K / E)
  collapsed = _health_metrics(np.stack([np.zeros(16, int), tokens % 3 + 1], axis=-1).reshape(2, 8, TOP_K))
  assert collapsed["moe_load_max/layer_0"] == 1.0 and collapsed["moe_load_cv/layer_0"] > 0.5

  hook = RouterHealthHook(fraction=0.5, logs=3, even_share=TOP_K / E)
  for step in range(1, 6):
    hook.on_step(None, StepRecord(step, 0.1, {**got, "moe_load_max/layer_1": collapsed["moe_load_max/layer_0"]}),
                 None)
  err = capsys.readouterr().err
  assert err.count("warning: MoE router of layer 1 sent 100% of the tokens to one expert") == 1, err
  assert "layer 0" not in err and "up to step 3" in err


def test_a_zero_router_collapses_in_a_real_step_and_the_metrics_say_so():
  """All router logits equal: top-k picks the same experts for every token."""
  config = tiny_mixtral(max_target_length=LENGTH, vocab_size=128, ici_expert_parallelism=2, ici_fsdp_parallelism=-1)
  run = Run(config)
  state = run.init()
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: jnp.zeros_like(p) if "gate" in jax.tree_util.keystr(path) else p, state.params)
  _, history = run.train(run.init(params), 1)
  layers = config.model.num_decoder_layers
  assert [history[0][f"moe_load_max/layer_{i}"] for i in range(layers)] == [1.0] * layers
  # A float32 mean over the tokens: equal to log E to float32 accumulation error, not to float64's.
  assert all(history[0][f"moe_router_entropy/layer_{i}"] == pytest.approx(np.log(E), rel=1e-5) for i in range(layers))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_dispatch="ragged"), "moe_dispatch must be one of all_to_all, gather"),
    (dict(moe_all_to_all="nccl"), "moe_all_to_all must be one of auto, ragged, padded"),
    (dict(moe_grouped_matmul="tokamax"), "moe_grouped_matmul must be one of auto, ragged_dot, megablox"),
    (dict(shared_experts=-1), "shared_experts must be >= 0"),
    (dict(moe_router_scales_input=True), "moe_router_scales_input=True supports num_experts_per_tok=1 only"),
    (dict(num_experts=6, ici_expert_parallelism=4, ici_fsdp_parallelism=-1),
     "num_experts (6) must be a multiple of the expert parallelism"),
])
def test_bad_moe_keys_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError) as info:
    tiny_mixtral(**overrides)
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_all_to_all="ragged"), "moe_all_to_all=ragged needs XLA's ragged all-to-all, which the cpu backend"),
    (dict(moe_grouped_matmul="megablox"), "moe_grouped_matmul=megablox is a TPU (Pallas Mosaic) kernel but this "
                                          "program is for cpu"),
])
def test_platform_lacking_the_exchange_or_kernel_is_a_one_line_error(overrides, message):
  config = tiny_mixtral(max_target_length=LENGTH, ici_expert_parallelism=2, ici_fsdp_parallelism=-1,
                        **DROPLESS_GROUPED, **overrides)
  run = build_run(config)
  with pytest.raises(ConfigError) as info:
    run.train_step.lower(*run.abstract_inputs().as_args())
  assert message in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- through train.py

CLI_MODEL = ["decoder_block=mixtral", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
             "base_mlp_dim=128", "base_num_decoder_layers=2", "vocab_size=128", "max_target_length=32",
             "num_experts=8", "num_experts_per_tok=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=-1",
             "per_device_batch_size=1", "dataset_type=synthetic", "enable_checkpointing=False"]


def _train_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(8), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), **jax_cache_env()}
  return subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={tmp_path}",
                         "run_name=moe", *CLI_MODEL, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)


@pytest.mark.slow
def test_train_cli_writes_per_layer_routing_health(tmp_path):
  proc = _train_cli(tmp_path, "steps=3", "sparse_matmul=True")
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in records if "loss" in r][-1]
  for name in ("moe_load_min", "moe_load_max", "moe_load_cv", "moe_dropped_fraction", "moe_router_entropy"):
    assert {f"{name}/layer_0", f"{name}/layer_1"} <= set(last), sorted(last)
  assert 0 < last["moe_load_min/layer_0"] <= 2 / 8 <= last["moe_load_max/layer_0"] <= 1
  assert 0 < last["moe_router_entropy/layer_1"] <= np.log(8) + 1e-6


def test_train_cli_ragged_exchange_on_cpu_is_one_error_line(tmp_path):
  proc = _train_cli(tmp_path, "steps=1", "sparse_matmul=True", "moe_all_to_all=ragged")
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "moe_all_to_all=ragged needs XLA's ragged all-to-all" in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
