"""Sequence (context) parallel attention on the 8-device CPU mesh equals unsharded attention;
a train step with the length split over `sequence` equals the unsharded run; the TPU kernels
lower for a v5e topology (splash) and for 32k tokens with sequence parallelism."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import train_compile
from MaxText.platform import sharding
from MaxText.configuration.config import BASE_CONFIG_PATH, Config
from MaxText.layers import attention, context_parallel
from MaxText.layers.attention import dot_product_attention
from MaxText.training.run_assembly import build_run
from tests import train_utils

TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
            print_config=False)


def _mesh_and_rules(**mesh_overrides):
  config = Config.for_testing(**{**TINY, **mesh_overrides})
  return sharding.create_mesh(config.mesh), config.mesh.logical_axis_rules, config


@pytest.mark.parametrize("window, soft_cap", [(None, 0.0), (5, 0.0), ("traced", 2.0)])
def test_sequence_parallel_flash_equals_unsharded_dot_product(window, soft_cap):
  mesh, rules, config = _mesh_and_rules(ici_sequence_parallelism=4, ici_tensor_parallelism=2, ici_fsdp_parallelism=1,
                                        attention="flash")
  kernel = attention.ATTENTION_KERNELS["flash"](config.model)
  kq, kk, kv = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(kq, (2, 32, 4, 8))
  k, v = jax.random.normal(kk, (2, 32, 2, 8)), jax.random.normal(kv, (2, 32, 2, 8))
  # Documents crossing the shard boundaries (every 8 tokens) and a padding tail.
  seg = jnp.asarray([[1] * 11 + [2] * 14 + [0] * 7, [3] * 20 + [4] * 12], jnp.int32)
  traced = window == "traced"

  def loss(fn, q, k, v, w):
    return jnp.sum(jnp.sin(fn(q, k, v, seg, w if traced else window, soft_cap)))

  def sharded(q, k, v, w):
    with sharding.activation_sharding(mesh, rules):
      assert context_parallel.length_shards(mesh, rules, q.shape, k.shape) == 4
      return kernel(q, k, v, seg, w if traced else window, soft_cap), jax.grad(
          functools.partial(loss, kernel), argnums=(0, 1, 2))(q, k, v, w)

  args = (q, k, v, jnp.int32(6))
  step = jax.jit(sharded)
  assert "all-gather" in step.lower(*args).as_text(dialect="hlo")
  out, grads = step(*args)
  ref = dot_product_attention(q, k, v, seg, 6 if traced else window, soft_cap)
  ref_grads = jax.grad(functools.partial(loss, dot_product_attention), argnums=(0, 1, 2))(*args)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_train_step_with_sequence_parallelism_equals_unsharded_run():
  common = dict(TINY, dataset_type="synthetic", enable_checkpointing=False, attention_layer_pattern="[local,global]",
                sliding_window_size=6)
  parallel = Config.for_testing(**common, attention="flash", ici_sequence_parallelism=4, ici_fsdp_parallelism=-1)
  plain = Config.for_testing(**common, attention="dot_product", ici_fsdp_parallelism=1, ici_data_parallelism=-1)
  assert dict(parallel.mesh.shape)["sequence"] == 4
  runs = [train_utils.Run(c) for c in (parallel, plain)]
  histories = []
  for run in runs:
    _, history = run.train(run.init(), 2)
    histories.append(history)
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in histories[0]], [h[key] for h in histories[1]], rtol=2e-5)


def _compile_for_topology(**overrides):
  argv = ["train_compile", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in overrides.items()]
  config, devices, _ = train_compile.load_target_config(argv)
  run = build_run(config, devices=devices, compiled_step=False)
  return run.train_step.lower(*run.abstract_inputs().as_args())


SPLASH_BLOCKS = {f"sa_{name}": 128 for name in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv",
                                                 "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")}


def test_splash_attention_lowers_and_compiles_for_v5e():
  """attention=flash on a TPU topology is the Pallas splash kernel (a Mosaic custom call) under
  shard_map, local and global layers mixed in one scanned stack."""
  lowered = _compile_for_topology(
      compile_topology="v5e-8", **dict(TINY, base_emb_dim=256, head_dim=128, max_target_length=256),
      attention="flash", attention_layer_pattern="[local,global]", sliding_window_size=128, **SPLASH_BLOCKS)
  assert "tpu_custom_call" in lowered.as_text()
  compiled = lowered.compile()
  assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_32k_tokens_with_sequence_parallelism_lower_for_v5e():
  """max_target_length=32768 split over sequence=8: each chip holds 4k queries and gathers K/V
  along the length inside shard_map. Lowering only (the full compile takes ~100 s here and needs
  1.3 GiB of temporaries per chip)."""
  lowered = _compile_for_topology(
      compile_topology="v5e-8", **dict(TINY, base_emb_dim=256, head_dim=128, max_target_length=32768),
      attention="flash", ici_sequence_parallelism=8, ici_fsdp_parallelism=1, **SPLASH_BLOCKS)
  text = lowered.as_text()
  assert "manual_computation" in text and "all_gather_dim = 1" in text and "32768" in text
