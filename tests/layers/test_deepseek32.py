"""DeepSeek-V3.2's sparse attention beyond the logit parity of test_families_vs_hf.py: the indexer's
choice matters, the gathered form equals the masked one (training, prefill and decode), and a bad
checkpoint or config is one clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.families import deepseek32
from MaxText.layers import attention_kernels, masks, sparse_attention

H = pytest.importorskip("hf_families")
from test_family_training import _config, _history  # noqa: E402 (needs hf_families' skip first)
FP32_ATOL = 2e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  model = H.build_hf_model("deepseek32")
  config = H.our_config(model, dtype="float32")
  return model, config, H.our_params(model, config, tmp_path_factory.mktemp("dsv32"))


def test_switching_the_indexer_off_breaks_the_match(reference, tmp_path):
  """index_topk (8) is below the 24 tokens: dense MLA over the same weights is a different model."""
  model, _, _ = reference
  dense = H.our_config(model, dtype="float32", index_topk=0)
  token_ids = H.tokens()
  logits = H.our_logits(dense, H.our_params(model, dense, tmp_path), token_ids)
  assert np.abs(logits - H.hf_logits(model, token_ids)).max() > 100 * FP32_ATOL


def test_a_top_k_covering_every_key_is_dense_mla(reference, tmp_path):
  model, _, _ = reference
  everything = H.our_config(model, dtype="float32", index_topk=H.LENGTH)
  dense = H.our_config(model, dtype="float32", index_topk=0)
  token_ids = H.tokens()
  np.testing.assert_allclose(H.our_logits(everything, H.our_params(model, everything, tmp_path / "a"), token_ids),
                             H.our_logits(dense, H.our_params(model, dense, tmp_path / "b"), token_ids),
                             atol=FP32_ATOL, rtol=0)


def test_the_gathered_form_matches_hf(reference, monkeypatch):
  """The kernel table picks the gathered form for every length: the same logits as HF."""
  model, config, params = reference
  monkeypatch.setattr(attention_kernels, "SPARSE_GATHER_ABOVE", 0)
  assert attention_kernels.sparse_kernel(H.LENGTH, 8, "cpu") == "gathered"
  token_ids = H.tokens()
  np.testing.assert_allclose(H.our_logits(config, params, token_ids), H.hf_logits(model, token_ids),
                             atol=FP32_ATOL, rtol=0)


def test_gathered_equals_masked_over_query_blocks_with_packing(monkeypatch):
  """Four query blocks (QUERY_BLOCK), packed segments, absorbed keys shared by the heads."""
  monkeypatch.setattr(sparse_attention, "QUERY_BLOCK", 16)
  length, heads, width, rank, topk = 64, 2, 6, 4, 8
  keys = jax.random.split(jax.random.key(0), 6)
  q_BLNX = jax.random.normal(keys[0], (1, length, heads, width))
  rows_BSX = jax.random.normal(keys[1], (1, length, width))
  values_BSR = rows_BSX[..., :rank]
  q_index = jax.random.normal(keys[2], (1, length, 3, 5))
  w_index = jax.random.normal(keys[3], (1, length, 3))
  index_keys = jax.random.normal(keys[4], (1, length, 5))
  segments = jnp.where(jnp.arange(length) < 37, 1, 2)[None].astype(jnp.int32)
  positions = jnp.arange(length)[None]
  gathered = sparse_attention.gathered_attention(q_BLNX, rows_BSX, values_BSR, positions, positions, segments,
                                                 segments, q_index, w_index, index_keys, topk)
  masked = sparse_attention.masked_attention(q_BLNX, rows_BSX[:, :, None], values_BSR[:, :, None],
                                             masks.self_mask(segments), q_index, w_index, index_keys, topk)
  np.testing.assert_allclose(gathered, masked, atol=1e-5, rtol=0)


def test_the_gathered_backward_keeps_the_forward_top_k(monkeypatch):
  """Each block's top-k indices are kept from the forward pass: the gradients equal the masked form's,
  and the training step sorts the index scores once (the block's rematerialisation does not sort again)."""
  monkeypatch.setattr(sparse_attention, "QUERY_BLOCK", 16)
  length, heads, width, rank, topk = 64, 2, 6, 4, 8
  keys = jax.random.split(jax.random.key(1), 6)
  q_BLNX = jax.random.normal(keys[0], (1, length, heads, width))
  rows_BSX = jax.random.normal(keys[1], (1, length, width))
  values_BSR = jax.random.normal(keys[5], (1, length, rank))
  q_index = jax.random.normal(keys[2], (1, length, 3, 5))
  w_index = jax.random.normal(keys[3], (1, length, 3))
  index_keys = jax.random.normal(keys[4], (1, length, 5))
  positions = jnp.arange(length)[None]
  cotangent = jax.random.normal(jax.random.key(2), (1, length, heads, rank))

  def gathered(q, rows, values):
    out = sparse_attention.gathered_attention(q, rows, values, positions, positions, None, None, q_index, w_index,
                                              index_keys, topk)
    return jnp.sum(out * cotangent)

  def masked(q, rows, values):
    out = sparse_attention.masked_attention(q, rows[:, :, None], values[:, :, None], masks.self_mask(jnp.ones((1, length), jnp.int32)),
                                            q_index, w_index, index_keys, topk)
    return jnp.sum(out * cotangent)

  args = (q_BLNX, rows_BSX, values_BSR)
  for ours, theirs in zip(jax.grad(gathered, argnums=(0, 1, 2))(*args), jax.grad(masked, argnums=(0, 1, 2))(*args)):
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
  step = str(jax.make_jaxpr(jax.grad(gathered, argnums=(0, 1, 2)))(*args))
  assert step.count("top_k[") == 1, "the backward pass sorts the index scores again"


def test_top_k_mask_keeps_k_allowed_keys():
  scores = jnp.asarray([[[3.0, 1.0, 2.0, 5.0], [0.0, 9.0, 1.0, 4.0]]])
  allowed = jnp.asarray([[[True, True, True, False], [True, True, True, True]]])
  np.testing.assert_array_equal(masks.top_k_mask(scores, allowed, 2),
                                [[[True, False, True, False], [False, True, False, True]]])


def test_index_topk_needs_the_query_latent():
  with pytest.raises(ConfigError, match="index_topk=8 .*q_lora_rank > 0"):
    Config.for_testing(decoder_block="deepseek32", attention_type="mla", base_num_query_heads=4, base_num_kv_heads=4,
                       head_dim=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                       index_topk=8, index_n_heads=2, index_head_dim=8)


def test_an_unsupported_checkpoint_is_one_error_line():
  fields = {**H.REFERENCE_CONFIGS["deepseek32"], "num_hidden_layers": 3}
  with pytest.raises(ConfigError, match="q_lora_rank=None"):
    deepseek32.deepseek32_model_keys({**fields, "q_lora_rank": None})
  with pytest.raises(ConfigError, match="mlp_layer_types"):
    deepseek32.deepseek32_model_keys({**fields, "mlp_layer_types": ["sparse", "dense", "sparse"]})


@pytest.mark.slow  # two short training runs on the 8-device mesh
def test_the_gathered_form_trains_sharded_like_replicated(monkeypatch):
  """The gathered form (forced for the 24-token sequences) under fsdp x tensor x expert equals one replica."""
  monkeypatch.setattr(attention_kernels, "SPARSE_GATHER_ABOVE", 0)
  mesh = {"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 2, "ici_tensor_parallelism": 2,
          "ici_data_parallelism": -1}
  ours = _history(_config("deepseek32", **mesh))
  reference = _history(_config("deepseek32", ici_fsdp_parallelism=1, ici_data_parallelism=-1))
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in ours], [h[key] for h in reference], rtol=2e-5, err_msg=key)
