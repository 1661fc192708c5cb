"""The ring's per-chunk-pair kernels (ring_blocks.py): splash (TPU, run by Pallas' interpreter on
CPU) equals the chunked kernel on every kind of pair, forward and backward with global statistics;
the ring with splash pairs equals dense attention; the platform picks its kernel (the ring's TPU
compile: test_ring_attention.py). cuDNN's pair kernel is checked on a
GPU by benchmarks/ring_blocks_gpu.py (its results are in getting_started/Attention.md)."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.layers import attention, attention_kernels, context_parallel, ring_blocks
from MaxText.layers.attention import dot_product_attention
from tests.conftest import REPO_ROOT

SPLASH_BLOCKS = {f"sa_block_{b}": 128 for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute",
                                                "q_dq", "kv_dq")}
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=512, per_device_batch_size=1,
            print_config=False, **SPLASH_BLOCKS)


def _checks():
  spec = importlib.util.spec_from_file_location("ring_blocks_gpu", REPO_ROOT / "benchmarks" / "ring_blocks_gpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _splash(window, traced=False):
  blocks = Config.for_testing(**TINY).model.attn.attention_blocks
  return ring_blocks.SplashBlocks(0.0, blocks, window, traced_window=traced, interpret=True)


@pytest.mark.parametrize("window, traced", [
    pytest.param(300, False, marks=pytest.mark.slow),  # m = 0 causal, 1 and 2 a band, 3 nothing (chunks of 256)
    pytest.param(None, False, marks=pytest.mark.slow),  # causal, full
    pytest.param(100, False, marks=pytest.mark.slow),  # m = 0 and 1 a band, 2 nothing
    pytest.param(100, True, marks=pytest.mark.slow),  # a traced window: local and global masks
])
def test_splash_pair_equals_chunked_pair(window, traced):
  """Every kind of pair (m chunks apart, m = -1 .. 3): output, log-sum-exp and rows that see
  nothing; the backward with another pair's statistics merged in (the ring's global lse)."""
  checks = _checks()
  kernel = _splash(window, traced)
  checks.pair_checks(kernel, 256, window, jnp.float32, 1e-4)
  if traced:  # the same kernel on a global layer
    checks.pair_checks(kernel, 256, None, jnp.float32, 1e-4)
  assert not checks.FAILED, checks.FAILED


@pytest.mark.parametrize("strategy, balanced, window", [
    pytest.param("ring", True, None, marks=pytest.mark.slow), ("ring", True, 40), ("all_gather", True, 40),
    ("all_gather", False, None)])
def test_splash_pairs_equal_dense(strategy, balanced, window, monkeypatch):
  """The ring and all_gather over 2 sequence shards (chunks of 128 balanced) with splash per pair,
  GQA and packed documents, against dense attention: values and gradients."""
  shards, length = 2, 512
  config = Config.for_testing(**TINY, ici_sequence_parallelism=shards, ici_fsdp_parallelism=-1, attention="flash",
                              context_parallel_strategy=strategy, context_parallel_load_balance=balanced)
  mesh, rules = sharding.create_mesh(config.mesh), config.mesh.logical_axis_rules
  kernel = attention.ATTENTION_KERNELS["flash"](config.model)
  monkeypatch.setattr(sharding, "trace_platform", lambda: "tpu")
  chosen = []

  def interpreted(*args, **kwargs):
    chosen.append(ring_blocks_choice(*args, **kwargs, interpret=True))
    return chosen[-1]

  ring_blocks_choice = attention_kernels.block_kernel
  monkeypatch.setattr(attention_kernels, "block_kernel", interpreted)
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(kq, (1, length, 4, 8))
  k, v = jax.random.normal(kk, (1, length, 2, 8)), jax.random.normal(kv, (1, length, 2, 8))
  seg = jnp.asarray([[1] * 200 + [2] * 250 + [0] * 62], jnp.int32)
  order = context_parallel.balanced_order(length, shards) if balanced else np.arange(length)
  back = np.argsort(order)
  weights = jnp.arange(1.0, length + 1)

  def loss(fn, weights, seg, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v, seg, window, 0.0)) * weights[None, :, None, None])

  def sharded(q, k, v):
    with sharding.activation_sharding(mesh, rules):
      return kernel(q, k, v, seg[:, order], window, 0.0), jax.grad(
          functools.partial(loss, kernel, weights[order], seg[:, order]), argnums=(0, 1, 2))(q, k, v)

  out, grads = jax.jit(sharded)(*(x[:, order] for x in (q, k, v)))
  assert chosen and all(isinstance(c, ring_blocks.SplashBlocks) for c in chosen)
  ref = dot_product_attention(q, k, v, seg, window)
  ref_grads = jax.grad(functools.partial(loss, dot_product_attention, weights, seg), argnums=(0, 1, 2))(q, k, v)
  valid = np.asarray(seg[0] > 0)  # padding rows: splash and dense disagree on rows that see no key
  np.testing.assert_allclose(np.asarray(out[:, back])[:, valid], np.asarray(ref)[:, valid], rtol=2e-5, atol=2e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g[:, back], r, rtol=1e-4, atol=1e-3)  # weights up to 512: sums of large terms


def test_platform_picks_the_pair_kernel():
  model = Config.for_testing(**TINY).model
  assert isinstance(attention_kernels.block_kernel(model, "tpu", 256, None, 0.0), ring_blocks.SplashBlocks)
  assert isinstance(attention_kernels.block_kernel(model, "tpu", 192, None, 0.0), ring_blocks.ChunkedBlocks)  # no tiling
  assert isinstance(attention_kernels.block_kernel(model, "cpu", 256, None, 0.0), ring_blocks.ChunkedBlocks)
  assert isinstance(attention_kernels.block_kernel(model, "gpu", 256, None, 0.0), ring_blocks.ChunkedBlocks)  # float32
  half = Config.for_testing(**TINY, dtype="bfloat16").model
  assert attention_kernels.block_kernel(half, "gpu", 256, 64, 0.0) == ring_blocks.CudnnBlocks(64)
  assert isinstance(attention_kernels.block_kernel(half, "gpu", 256, None, 30.0), ring_blocks.ChunkedBlocks)  # soft cap
  traced = attention_kernels.block_kernel(Config.for_testing(**TINY, sliding_window_size=64).model, "tpu", 256,
                                    jnp.int32(64), 0.0)
  assert traced == ring_blocks.SplashBlocks(0.0, model.attn.attention_blocks, 64, traced_window=True)


@pytest.mark.parametrize("chunk, window, kinds", [
    (256, None, [("causal",), ("full",)]),
    (256, 100, [("local", 99, 0, 0), ("local", 99, None, 256), None]),
    (256, 300, [("causal",), ("local", 299, None, 256), ("local", 299, None, 512), None]),
    (256, 512, [("causal",), ("full",), ("local", 511, None, 512), None]),
])
def test_pair_kinds_follow_the_window(chunk, window, kinds):
  assert ring_blocks._pair_kinds(chunk, window) == kinds
