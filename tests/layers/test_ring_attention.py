"""Context-parallel strategies (all_gather, ring, all_to_all; with and without load balancing) equal
dense attention, forward and gradients, on the CPU mesh with GQA, packing and a sliding window;
the ring's HLO has no all-gather; the block schedule is balanced with load balancing; the batch
order round-trips; bad settings are one-line config errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import attention, attention_kernels, context_parallel, ring_attention
from MaxText.layers.attention import dot_product_attention
from tests.compile_settings import cpu_xla_flags, jax_cache_env

TINY = dict(base_emb_dim=64, base_num_query_heads=16, base_num_kv_heads=8, head_dim=4, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
            print_config=False, flash_block_q=4, flash_block_kv=4)
LENGTH = 32


def _kernel(strategy, shards, balanced):
  config = Config.for_testing(**TINY, ici_sequence_parallelism=shards, ici_fsdp_parallelism=-1, attention="flash",
                              context_parallel_strategy=strategy, context_parallel_load_balance=balanced)
  mesh, rules = sharding.create_mesh(config.mesh), config.mesh.logical_axis_rules
  return attention.ATTENTION_KERNELS["flash"](config.model), mesh, rules


def _inputs():
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (2, LENGTH, 16, 4))
  k, v = jax.random.normal(kk, (2, LENGTH, 8, 4)), jax.random.normal(kv, (2, LENGTH, 8, 4))
  # Documents crossing every chunk boundary and a padding tail.
  seg = jnp.asarray([[1] * 11 + [2] * 14 + [0] * 7, [3] * 19 + [4] * 13], jnp.int32)
  return q, k, v, seg


def _check_strategy(strategy, shards, balanced, window):
  kernel, mesh, rules = _kernel(strategy, shards, balanced)
  q, k, v, seg = _inputs()
  order = context_parallel.balanced_order(LENGTH, shards) if balanced else np.arange(LENGTH)
  back = np.argsort(order)

  def loss(fn, weights, q, k, v, seg):  # position weights so a misplaced row changes the gradients
    return jnp.sum(jnp.sin(fn(q, k, v, seg, window, 0.0)) * weights[None, :, None, None])

  weights = jnp.arange(1.0, LENGTH + 1)

  def sharded(q, k, v, seg):
    with sharding.activation_sharding(mesh, rules):
      grads = jax.grad(functools.partial(loss, kernel, weights[order]), argnums=(0, 1, 2))(q, k, v, seg)
      return kernel(q, k, v, seg, window, 0.0), grads

  step = jax.jit(sharded)
  args = tuple(x[:, order] for x in (q, k, v, seg))
  text = step.lower(*args).as_text(dialect="hlo")
  out, grads = step(*args)
  ref = dot_product_attention(q, k, v, seg, window)
  ref_grads = jax.grad(functools.partial(loss, dot_product_attention, weights), argnums=(0, 1, 2))(q, k, v, seg)
  np.testing.assert_allclose(out[:, back], ref, rtol=2e-5, atol=2e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g[:, back], r, rtol=1e-4, atol=1e-4)
  return text


CASES = [(s, n, b, w) for s in ("ring", "all_to_all", "all_gather") for n in (2, 4, 8) for b in (False, True)
         for w in (None, 5)]
FAST = {("ring", 4, True, 5), ("ring", 2, False, None), ("all_to_all", 4, True, 5), ("all_gather", 2, True, 5)}


@pytest.mark.parametrize("strategy, shards, balanced, window",
                         [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_strategy_equals_dense_attention(strategy, shards, balanced, window):
  text = _check_strategy(strategy, shards, balanced, window)
  if strategy == "ring":  # K/V only ever travel one block at a time
    assert "collective-permute" in text and "all-gather" not in text
  if strategy == "all_to_all":
    assert "all-to-all" in text


def test_balanced_order_round_trips_and_pairs_chunks():
  x = jnp.arange(2 * 16).reshape(2, 16)
  balanced = context_parallel.to_balanced_order(x, 4)
  np.testing.assert_array_equal(balanced[0], context_parallel.balanced_order(16, 4))
  np.testing.assert_array_equal(balanced[0], [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
  np.testing.assert_array_equal(context_parallel.to_natural_order(balanced, 4), x)
  assert context_parallel.shard_chunk_starts(1, 4, 4, balanced=True) == [2, 12]


def test_load_balance_equalises_the_block_schedule():
  """Causal attention tiles per shard (FLOPs are proportional): equal within 2% balanced (the
  diagonal tiles differ by at most one per chunk pair), the last shard doing more than n times the first's without."""
  for shards in (2, 4, 8):
    balanced = ring_attention.tiles_per_shard(4096, shards, 128, balanced=True)
    plain = ring_attention.tiles_per_shard(4096, shards, 128, balanced=False)
    assert sum(balanced) == sum(plain)  # the same causal work, only distributed differently
    assert max(balanced) <= 1.02 * min(balanced), balanced
    assert plain == sorted(plain) and plain[-1] >= shards * plain[0], plain


@pytest.mark.parametrize("overrides, message", [
    (dict(context_parallel_load_balance=True, max_target_length=36), "multiple of 8"),
    (dict(context_parallel_strategy="all_to_all", base_num_kv_heads=2, base_num_query_heads=4), "all_to_all"),
    (dict(context_parallel_strategy="ring", attention="cudnn_flash"), "cannot run it"),
    (dict(context_parallel_strategy="spiral"), "context_parallel_strategy"),
])
def test_bad_context_parallel_settings_are_config_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(**{**TINY, "ici_sequence_parallelism": 4, "ici_fsdp_parallelism": -1, "attention": "flash",
                          **overrides})


TRAIN = dict(TINY, base_num_query_heads=8, base_num_kv_heads=4, head_dim=8, dataset_type="synthetic",
             enable_checkpointing=False, attention_layer_pattern="[local,global]", sliding_window_size=6)


@pytest.mark.slow  # ~25 s each on 2 cores
@pytest.mark.parametrize("strategy, balanced", [("ring", True), ("all_to_all", True), ("all_gather", True),
                                                ("ring", False)])
def test_three_train_steps_equal_the_run_without_context_parallelism(strategy, balanced):
  """Loss and gradient norm of 3 steps (the batch reordered before the model when balanced)."""
  from tests import train_utils

  parallel = Config.for_testing(**TRAIN, attention="flash", ici_sequence_parallelism=4, ici_fsdp_parallelism=-1,
                                context_parallel_strategy=strategy, context_parallel_load_balance=balanced)
  plain = Config.for_testing(**TRAIN, attention="dot_product", ici_fsdp_parallelism=1, ici_data_parallelism=-1)
  histories = []
  for config in (parallel, plain):
    run = train_utils.Run(config)
    histories.append(run.train(run.init(), 3)[1])
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in histories[0]], [h[key] for h in histories[1]], rtol=2e-5)


@pytest.mark.parametrize("args, message", [
    (["context_parallel_load_balance=True", "max_target_length=100"], "error: context_parallel_load_balance=True "
     "splits max_target_length=100 into 2 x 4"),
    (["context_parallel_strategy=all_to_all", "base_num_query_heads=6", "base_num_kv_heads=2"],
     "error: context_parallel_strategy=all_to_all splits heads"),
    (["context_parallel_strategy=ring", "attention=dot_product"], "attention=dot_product cannot run it"),
])
def test_cli_rejects_bad_context_parallelism_in_one_line(args, message, tmp_path):
  import pathlib
  import subprocess
  import sys

  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(8), "PATH": "/usr/bin:/bin",
         **jax_cache_env()}
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={tmp_path}",
                         "ici_sequence_parallelism=4", "ici_fsdp_parallelism=-1", *args],
                        cwd=pathlib.Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                        timeout=300)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- all_to_all's local kernel per platform
SPLASH = dict(TINY, max_target_length=256, **{f"sa_block_{b}": 128 for b in (
    "q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")})


def _splash_config(shards, **overrides):
  return Config.for_testing(**{**SPLASH, **overrides}, ici_sequence_parallelism=shards, ici_fsdp_parallelism=-1,
                            attention="flash", context_parallel_strategy="all_to_all",
                            context_parallel_load_balance=True)


def test_all_to_all_picks_the_platform_kernel():
  model = _splash_config(2).model
  assert isinstance(attention_kernels.full_sequence_kernel(model, "tpu", 256), functools.partial)  # splash
  assert attention_kernels.full_sequence_kernel(model, "tpu", 192).__name__ == "chunked"  # tiles do not divide
  assert attention_kernels.full_sequence_kernel(model, "cpu", 256).__name__ == "chunked"
  assert attention_kernels.full_sequence_kernel(model, "gpu", 256).__name__ == "chunked"  # float32: no cuDNN
  half = _packed(_splash_config(2, dtype="bfloat16", head_dim=8).model)
  assert attention_kernels.full_sequence_kernel(half, "gpu", 256) is attention_kernels.cudnn_flash_attention
  # Synthetic rows hold one document each: cuDNN runs without the document mask.
  synthetic = _splash_config(2, dtype="bfloat16", head_dim=8).model
  unmasked = attention_kernels.full_sequence_kernel(synthetic, "gpu", 256)
  assert unmasked.func is attention_kernels.cudnn_flash_attention and unmasked.keywords == {"document_mask": False}


def _packed(model):
  """The model as a run on packed real data sees it (rows may hold several documents)."""
  return dataclasses.replace(model, attn=dataclasses.replace(model.attn, rows_hold_one_document=False))


@pytest.mark.parametrize("platform, window", [("tpu", None), ("tpu", 40), ("gpu", 40)])
def test_all_to_all_platform_kernel_equals_dense(platform, window, monkeypatch):
  """all_to_all's TPU path (splash on the whole, naturally ordered sequence of each head group) run
  by Pallas' interpreter on CPU, and its GPU path (the cuDNN wrapper's arguments run by XLA),
  against dense attention: values and gradients, balanced order."""
  shards, length = 2, 256
  # cuDNN covers bfloat16 models with head dims that are multiples of 8 (the inputs stay float32 for XLA).
  config = _splash_config(shards, head_dim=8, **(dict(dtype="bfloat16") if platform == "gpu" else {}))
  mesh, rules = sharding.create_mesh(config.mesh), config.mesh.logical_axis_rules
  kernel = attention.ATTENTION_KERNELS["flash"](_packed(config.model))  # the segments below pack two documents
  monkeypatch.setattr(sharding, "trace_platform", lambda: platform)
  # Pallas' HLO interpreter (interpret=True) traces into plain ops, which run under shard_map.
  monkeypatch.setattr(attention_kernels, "full_sequence_kernel",
                      functools.partial(attention_kernels.full_sequence_kernel, interpret=True))
  cudnn_calls = []

  def cudnn_by_xla(*args):
    cudnn_calls.append(args[0].shape)
    return cudnn_flash(*args, implementation="xla")

  cudnn_flash = attention_kernels.cudnn_flash_attention
  monkeypatch.setattr(attention_kernels, "cudnn_flash_attention", cudnn_by_xla)
  kq, kk, kv = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(kq, (1, length, 4, 8))
  k, v = jax.random.normal(kk, (1, length, 2, 8)), jax.random.normal(kv, (1, length, 2, 8))
  seg = jnp.asarray([[1] * 100 + [2] * 120 + [0] * 36], jnp.int32)
  order = context_parallel.balanced_order(length, shards)
  back = np.argsort(order)
  weights = jnp.arange(1.0, length + 1)

  def loss(fn, weights, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v, seg_in, window, 0.0)) * weights[None, :, None, None])

  def sharded(q, k, v):
    with sharding.activation_sharding(mesh, rules):
      return kernel(q, k, v, seg_in, window, 0.0), jax.grad(functools.partial(loss, kernel, weights[order]),
                                                             argnums=(0, 1, 2))(q, k, v)

  seg_in = seg[:, order]
  step = jax.jit(sharded)
  text = step.lower(*(x[:, order] for x in (q, k, v))).as_text()
  out, grads = step(*(x[:, order] for x in (q, k, v)))
  assert ("splash" in text) == (platform == "tpu") and "all_to_all" in text
  assert bool(cudnn_calls) == (platform == "gpu")  # the whole sequence, half the heads: (1, 256, 2, 8)
  assert all(shape == (1, length, 2, 8) for shape in cudnn_calls)
  seg_in = seg
  ref = dot_product_attention(q, k, v, seg, window)
  ref_grads = jax.grad(functools.partial(loss, dot_product_attention, weights), argnums=(0, 1, 2))(q, k, v)
  valid = np.asarray(seg[0] > 0)  # padding rows: splash and dense disagree on rows that see no key
  np.testing.assert_allclose(np.asarray(out[:, back])[:, valid], np.asarray(ref)[:, valid], rtol=2e-5, atol=2e-5)
  for g, r in zip(grads, ref_grads):  # a document's first query sees only itself: dQ is 0 up to rounding
    np.testing.assert_allclose(g[:, back], r, rtol=1e-4, atol=5e-4)


@pytest.mark.parametrize("topology, strategy, length", [  # about 2 s each: tiny shapes
    ("v5e-4", "all_to_all", 512), ("v5p-8", "all_to_all", 512), ("v5p-8", "ring", 1024)])
def test_strategies_compile_for_tpu_with_splash(topology, strategy, length):
  """AOT: all_to_all's forward and backward on a TPU topology compile to the Mosaic (splash)
  custom calls between the all-to-alls; the balanced ring's to splash kernels per kind of chunk
  pair (causal and full: 2 forward kernels, run again in the backward, and 2 x dQ, dKV) and
  collective-permutes, with no all-gather of K/V."""
  pytest.importorskip("libtpu")
  from MaxText.platform import accelerators
  from MaxText.startup import describe_topology
  tpu = accelerators.tpu_topology(topology)
  config = Config.for_testing(tpu.target(1), **{**SPLASH, "max_target_length": length, "head_dim": 128},
                              dtype="bfloat16", ici_sequence_parallelism=2, ici_fsdp_parallelism=-1,
                              attention="flash", context_parallel_strategy=strategy,
                              context_parallel_load_balance=True)
  mesh = sharding.create_mesh(config.mesh, describe_topology(tpu, 1))
  rules = config.mesh.logical_axis_rules
  kernel = attention.ATTENTION_KERNELS["flash"](config.model)

  def loss(q, k, v, seg):
    return jnp.sum(kernel(q, k, v, seg, None, 0.0).astype(jnp.float32))

  def abstract(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

  args = (abstract((2, length, 4, 128), jnp.bfloat16), abstract((2, length, 2, 128), jnp.bfloat16),
          abstract((2, length, 2, 128), jnp.bfloat16), abstract((2, length), jnp.int32))
  with sharding.activation_sharding(mesh, rules):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
  hlo = lowered.compile().as_text()
  kernels = hlo.count('custom_call_target="tpu_custom_call"')
  if strategy == "all_to_all":
    assert "all-to-all" in hlo and kernels >= 3  # splash forward, dq and dkv kernels
  else:
    assert "collective-permute" in hlo and "all-gather" not in hlo and kernels >= 6
