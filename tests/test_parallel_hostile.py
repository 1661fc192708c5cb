"""Hostile shapes and settings for context (sequence) and pipeline parallelism: the sharded run
computes what the unsharded one does, or the config is refused in one line.

Load-balanced context parallelism reorders each training sequence before the model
(context_parallel.balance_batch); every layer that reads the sequence in order (a recurrence, a
causal conv, a mask built from array indices) must undo that order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.configuration.config import Config
from MaxText.layers import context_parallel
from MaxText.layers.gated_deltanet import GatedDeltaNet
from MaxText.layers.mla import MultiHeadLatentAttention
from MaxText.platform import sharding
from MaxText.training import train_step
from MaxText.training.run_assembly import build_run

BASE = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
            base_num_decoder_layers=2, vocab_size=64, max_target_length=32, per_device_batch_size=1,
            print_config=False, dtype="float32")
QWEN3_NEXT = dict(BASE, decoder_block="qwen3_next", full_attention_interval=2, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                  linear_attention_chunk_size=4, attention_output_gate=True, use_qk_norm=True,
                  partial_rotary_factor=0.5, normalization_type="rms_plus_one", num_experts=4, num_experts_per_tok=2,
                  load_balance_loss_weight=0.0)
# DeepSeek-V3.2: top-4 of 32 keys, so the indexer's causal mask decides what each query sees.
DSA = dict(BASE, decoder_block="deepseek32", base_num_query_heads=4, base_num_kv_heads=4, head_dim=12,
           attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
           num_experts=4, num_experts_per_tok=2, shared_experts=1, first_dense_layers=1, load_balance_loss_weight=0.0,
           index_topk=4, index_n_heads=2, index_head_dim=8)
BALANCED = dict(ici_sequence_parallelism=4, ici_fsdp_parallelism=-1, attention="flash",
                context_parallel_load_balance=True)
SHARDS = 4


def _packed(rows: int, length: int, vocab: int) -> dict:
  """Four documents per row whose boundaries cross the 8-token shards, and a padding tail."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, vocab, (rows, length + 1), dtype=np.int32)
  segments, positions = np.ones(length, np.int32), np.arange(length)
  for i, cut in enumerate((5, 13, 22)):
    segments[cut:], positions[cut:] = i + 2, np.arange(length - cut)
  segments = segments[None].repeat(rows, 0)
  segments[-1, -3:] = 0
  positions = positions.astype(np.int32)[None].repeat(rows, 0)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": positions,
          "inputs_segmentation": segments, "targets_segmentation": segments}


def _layer_inputs(length: int = 32) -> tuple[jax.Array, jax.Array, jax.Array]:
  batch = _packed(2, length, 64)
  x = jax.random.normal(jax.random.key(3), (2, length, 32), jnp.float32)
  return x, jnp.asarray(batch["inputs_position"]), jnp.asarray(batch["inputs_segmentation"])


def _balanced_vs_natural(layer_class, overrides: dict) -> tuple[np.ndarray, np.ndarray]:
  """(the layer on the load-balanced sequence, put back in natural order; the layer on the natural one)."""
  balanced = Config.for_testing(**overrides, **BALANCED).model
  plain = Config.for_testing(**overrides).model
  assert context_parallel.is_balanced(balanced.attn) and not context_parallel.is_balanced(plain.attn)
  x, positions, segments = _layer_inputs()
  to_balanced = lambda a: context_parallel.to_balanced_order(a, SHARDS)  # noqa: E731
  with nnx.use_eager_sharding(False):
    layer_b, layer_p = layer_class(balanced, rngs=nnx.Rngs(0)), layer_class(plain, rngs=nnx.Rngs(0))

  def apply(layer, *args):  # compiled: eagerly, every op of the layers' scans would dispatch on its own
    graphdef, state = nnx.split(layer)
    with sharding.unsharded():
      return jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a))(state, *args)

  got = apply(layer_b, to_balanced(x), to_balanced(positions), to_balanced(segments))
  want = apply(layer_p, x, positions, segments)
  return np.asarray(context_parallel.to_natural_order(got, SHARDS)), np.asarray(want)


def test_linear_attention_reads_a_load_balanced_sequence_in_order():
  """Gated DeltaNet's recurrence and causal conv ran over the balanced order (chunks 0, 7, 1, 6, ...)."""
  got, want = _balanced_vs_natural(GatedDeltaNet, QWEN3_NEXT)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_reads_a_load_balanced_sequence_in_order():
  """DeepSeek sparse attention's causal mask came from array indices, and its top-k breaks ties by them."""
  got, want = _balanced_vs_natural(MultiHeadLatentAttention, DSA)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sequence_index_is_the_balanced_order():
  attn = Config.for_testing(**BASE, **BALANCED).model.attn
  np.testing.assert_array_equal(context_parallel.sequence_index(attn, 16)[0],
                                [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
  plain = Config.for_testing(**BASE).model.attn
  np.testing.assert_array_equal(context_parallel.sequence_index(plain, 8)[0], np.arange(8))


def _grads(config: Config, params, batch: dict) -> tuple[dict, dict]:
  """Per-token gradients and the loss sums of one batch, as train_step computes them."""
  run = build_run(config)
  batch = jax.device_put(batch, run.batch_sharding)
  params = jax.device_put(params, run.setup.state_shardings.params)

  def fn(p, b):
    with sharding.activation_sharding(run.mesh, config.mesh.logical_axis_rules):
      return train_step._grads_and_sums(run.setup, run.objective, config, p, None, b, None)

  grads, sums = jax.jit(fn)(params, batch)
  return jax.device_get(jax.tree.map(lambda g: g / sums["weight_sum"], grads)), jax.device_get(sums)


def assert_sharded_equals_plain(plain: Config, sharded: Config) -> None:
  params = jax.device_get(build_run(plain).init_state(0).params)
  batch = _packed(plain.data.global_batch_size, plain.model.max_target_length, plain.model.vocab_size)
  want_grads, want_sums = _grads(plain, params, batch)
  got_grads, got_sums = _grads(sharded, params, batch)
  for key in want_sums:  # the loss and every auxiliary one (the indexer's KL included)
    np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=2e-5, atol=1e-6, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads)


@pytest.mark.slow  # ~40 s each: two train-step gradients compiled
@pytest.mark.parametrize("model, strategy", [
    (QWEN3_NEXT, "ring"), (DSA, "all_gather"),
    # The indexer's dense warm-up: its KL loss masked keys by array index.
    (dict(DSA, indexer_warmup=True, indexer_loss_scaling_factor=1.0), "ring")], ids=["qwen3_next", "dsa", "dsa-warmup"])
def test_load_balanced_context_parallel_train_step_equals_the_unsharded_one(model, strategy):
  plain = Config.for_testing(**model)
  sharded = Config.for_testing(**model, **BALANCED, context_parallel_strategy=strategy)
  assert dict(sharded.mesh.shape)["sequence"] == SHARDS
  assert_sharded_equals_plain(plain, sharded)
