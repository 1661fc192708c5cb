"""GPT-OSS's layer features beyond the HF comparison of test_families_vs_hf.py: attention sinks
against their formula and in the cached path, the kernels that refuse them, the MoE biases and
clamped SwiGLU on every dispatch and grouped-matmul path, and the converter's refusal of the
MXFP4-quantised checkpoints (read; tests/test_mxfp4.py converts them)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import families
from MaxText.platform import sharding
from MaxText.errors import ConfigError
from MaxText.layers import attention, flash_blocks, grouped_matmul, kv_cache, masks, moe
from MaxText.layers.attention import dot_product_attention, select_kernel
from MaxText.layers.mlp import clamped_plus_one, clamped_swish

from layers.test_moe import D, TOP_K, _apply, tiny_mixtral
from layers.test_moe_dispatch import DROPLESS_GROUPED, DROPPING, MESHES, _assert_same_training, _two_steps

# GPT-OSS's features on test_moe's tiny model: biases (attention, router, experts), the clamped
# SwiGLU with a limit the activations reach, and sinks (without them a key bias shifts every score
# of a row alike, so its gradient is rounding noise that the optimiser would amplify).
GPT_OSS_MOE = dict(use_bias=True, mlp_activations=["clamped_swish", "clamped_plus_one"], swiglu_limit=1.0,
                   swiglu_alpha=1.702, attention_sinks=True)


def test_sinks_join_the_softmax_denominator_only():
  rng = np.random.default_rng(0)
  b, length, n, k, h = 2, 5, 4, 2, 8
  q, kk, v = (rng.normal(size=(b, length, heads, h)).astype(np.float32) for heads in (n, k, k))
  sinks = rng.normal(size=(n,)).astype(np.float32) * 2
  segments = np.ones((b, length), np.int32)
  got = np.asarray(dot_product_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v), jnp.asarray(segments),
                                         window_size=3, sinks_N=jnp.asarray(sinks)))
  want = np.zeros_like(q)
  for bi in range(b):
    for t in range(length):
      keys = [s for s in range(length) if 0 <= t - s < 3]
      for head in range(n):
        kv = head // (n // k)
        scores = np.array([q[bi, t, head] @ kk[bi, s, kv] for s in keys])
        weights = np.exp(scores) / (np.exp(scores).sum() + np.exp(sinks[head]))
        want[bi, t, head] = weights @ v[bi, keys, kv]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The cached path gives the same rows for the same keys (a cache filled to the prompt length).
  with sharding.unsharded():
    cache = kv_cache.write(kv_cache.empty_cache(b, 8, k, h, jnp.float32), jnp.asarray(kk), jnp.asarray(v),
                           jnp.broadcast_to(jnp.arange(length), (b, length)))
    cached = kv_cache.cached_attention(jnp.asarray(q), cache, jnp.broadcast_to(jnp.arange(length), (b, length)), 3,
                                       sinks_N=jnp.asarray(sinks))
  np.testing.assert_allclose(np.asarray(cached), want, rtol=1e-5, atol=1e-6)
  # A sink far below every score is no sink.
  plain = masks.dense_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v), masks.self_mask(jnp.asarray(segments)))
  off = masks.dense_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v), masks.self_mask(jnp.asarray(segments)),
                              sinks_N=jnp.full((n,), -1e4))
  np.testing.assert_allclose(np.asarray(off), np.asarray(plain), rtol=1e-6, atol=1e-7)


def test_cudnn_refuses_sinks():
  with pytest.raises(ConfigError) as info:
    tiny_mixtral(attention_sinks=True, attention="cudnn_flash")
  assert "attention_sinks=True needs attention=dot_product, autoselected or flash" in str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_flash_sinks_match_dot_product_values_and_gradients(window):
  """Blocks of 4 over 12 tokens (so the online softmax spans blocks), GQA, packed segments."""
  rng = np.random.default_rng(0)
  b, length, n, k, h = 2, 12, 4, 2, 8
  q, kk, v = (jnp.asarray(rng.normal(size=(b, length, heads, h)).astype(np.float32)) for heads in (n, k, k))
  sinks = jnp.asarray(rng.normal(size=(n,)).astype(np.float32))
  segments = jnp.asarray(np.repeat([[1] * 7 + [2] * 5], b, axis=0).astype(np.int32))
  flash = functools.partial(flash_blocks.flash_attention, block_q=4, block_kv=4)

  def loss(kernel, q, kk, v, sinks):
    return jnp.sum(jnp.sin(kernel(q, kk, v, segments, window, sinks_N=sinks)))

  want = jax.value_and_grad(functools.partial(loss, dot_product_attention), argnums=(0, 1, 2, 3))(q, kk, v, sinks)
  got = jax.value_and_grad(functools.partial(loss, flash), argnums=(0, 1, 2, 3))(q, kk, v, sinks)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(want[1][3])).max() > 1e-3  # the sinks really get a gradient


def test_autoselected_picks_dot_product_with_sinks():
  long_ = tiny_mixtral(attention_sinks=True, max_target_length=1024).model
  for platform in ("cpu", "gpu", "tpu"):
    assert select_kernel("autoselected", platform, long_) == "dot_product"


def test_clamped_swiglu_pieces():
  x = jnp.asarray([-3.0, -0.5, 0.0, 0.5, 3.0])
  np.testing.assert_allclose(clamped_swish(x, 1.0, 1.702),
                             np.minimum(x, 1.0) / (1 + np.exp(-1.702 * np.minimum(x, 1.0))), rtol=1e-6)
  np.testing.assert_allclose(clamped_plus_one(x, 1.0), [0.0, 0.5, 1.0, 1.5, 2.0])
  np.testing.assert_allclose(clamped_plus_one(x, 0.0), np.asarray(x) + 1)  # 0 = no clipping


def test_mxfp4_is_read_and_other_quantisations_are_refused_in_one_line():
  hf = dict(families.reference_hf_configs()["gpt_oss"], num_hidden_layers=2)
  family = families.family_for_hf_config(hf)
  assert family.model_keys(dict(hf, quantization_config={"quant_method": "mxfp4"})) == family.model_keys(hf)
  with pytest.raises(ConfigError) as info:
    family.model_keys(dict(hf, quantization_config={"quant_method": "gptq"}))
  assert "quant_method='gptq'" in str(info.value) and "\n" not in str(info.value)


def _moe_block(**overrides) -> moe.MoeBlock:
  """The GPT-OSS MoE with every bias random (they initialise to zero)."""
  with nnx.use_eager_sharding(False):
    block = moe.MoeBlock(tiny_mixtral(**GPT_OSS_MOE, **overrides).model, rngs=nnx.Rngs(params=1))
  rng = np.random.default_rng(5)
  for module in (block.gate, block.wi_0, block.wi_1, block.wo):
    module.bias[...] = jnp.asarray(rng.normal(size=module.bias.shape).astype(np.float32) * 0.5)
  return block


def _reference(block: moe.MoeBlock, x_BLD: np.ndarray) -> np.ndarray:
  """Token by token, as HF's GptOssExperts computes it: top-k of the biased router logits,
  softmax over the k, each expert's clamped SwiGLU with biases."""
  logits = np.asarray(block.gate(jnp.asarray(x_BLD)))
  wi_0, wi_1, wo = (np.asarray(m.kernel[...]) for m in (block.wi_0, block.wi_1, block.wo))
  b0, b1, bo = (np.asarray(m.bias[...]) for m in (block.wi_0, block.wi_1, block.wo))
  out = np.zeros_like(x_BLD)
  for b in range(x_BLD.shape[0]):
    for t in range(x_BLD.shape[1]):
      top = np.argsort(-logits[b, t])[:TOP_K]
      weights = np.exp(logits[b, t, top] - logits[b, t, top].max())
      for e, w in zip(top, weights / weights.sum()):
        gate = np.minimum(x_BLD[b, t] @ wi_0[e] + b0[e], 1.0)
        up = np.clip(x_BLD[b, t] @ wi_1[e] + b1[e], -1.0, 1.0)
        out[b, t] += w * ((gate / (1 + np.exp(-1.702 * gate)) * (up + 1)) @ wo[e] + bo[e])
  return out


@pytest.mark.parametrize("path", [dict(capacity_factor=-1.0), dict(capacity_factor=-1.0, sparse_matmul=True)])
def test_biased_clamped_experts_match_the_token_by_token_reference(path):
  block = _moe_block(**path)
  x_BLD = np.random.default_rng(1).normal(size=(2, 8, D)).astype(np.float32)
  np.testing.assert_allclose(_apply(block, x_BLD), _reference(block, x_BLD), rtol=1e-5, atol=1e-5)


def test_megablox_adds_the_same_biases(monkeypatch):
  block = _moe_block(capacity_factor=-1.0, sparse_matmul=True)
  x_BLD = np.random.default_rng(1).normal(size=(2, 8, D)).astype(np.float32)
  want = _apply(block, x_BLD)
  monkeypatch.setattr(grouped_matmul, "select",
                      lambda name, platform: functools.partial(grouped_matmul.megablox, interpret=True))
  np.testing.assert_allclose(_apply(block, x_BLD), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh, mode", [
    ("expert2_fsdp4", DROPLESS_GROUPED),
    ("expert4_tensor2", DROPPING),
    ("expert4_tensor2", DROPLESS_GROUPED),
])
@pytest.mark.slow
def test_all_to_all_trains_like_gather_with_biases_and_clamp(mesh, mode):
  """Two steps (the zero-initialised biases move in the first): the same losses, gradients and
  parameters, biases included; with `tensor` the output bias is added once across hidden shards."""
  overrides = dict(MESHES[mesh], **mode, **GPT_OSS_MOE)
  want = _two_steps(**overrides, moe_dispatch="gather")
  got = _two_steps(**overrides, moe_dispatch="all_to_all")
  _assert_same_training(got, want)
  assert np.abs(np.asarray(got[0]["layers"]["mlp"]["wo"]["bias"])).max() > 0


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_shipped_yaml_is_the_published_architecture(name, layers, experts):
  """transformers' GptOssConfig defaults are the released models' architecture (gpt-oss-20b
  differs in depth and expert count): the converter's reading of them is our YAML."""
  transformers = pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
  from MaxText.configuration import config_fields
  from MaxText.configuration.config import Config
  hf = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts).to_dict()
  keys = families.family_for_hf_config(hf).model_keys(hf)
  model = Config.for_testing(model_name=name, print_config=False).model
  held = config_fields.key_values(model)  # the keys of the root and its records
  assert {k: list(v) if isinstance(v, tuple) else v for k, v in held.items() if k in keys} == keys
  assert families.family_for_hf_config(hf).hf_config(model)["router_aux_loss_coef"] == hf["router_aux_loss_coef"]


def test_flash_attention_with_sinks_matches_hf(tmp_path):
  """The whole tiny GPT-OSS with attention=flash (blocks of 8 over 24 tokens) against HF."""
  pytest.importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
  import hf_families as H
  model = H.build_hf_model("gpt_oss")
  token_ids = H.tokens()
  config = H.our_config(model, dtype="float32", attention="flash", flash_block_q=8, flash_block_kv=8)
  np.testing.assert_allclose(H.our_logits(config, H.our_params(model, config, tmp_path), token_ids),
                             H.hf_logits(model, token_ids), atol=2e-5, rtol=0)


def test_flash_sinks_stop_under_sequence_parallelism():
  """The length split over `sequence` would take the all-gathered-K/V path, which has no sinks."""
  mesh = jax.make_mesh((8,), ("sequence",))
  rules = (("activation_batch", ()), ("activation_length", ("sequence",)), ("activation_heads", ()),
           ("activation_kv_heads", ()), ("activation_kv", ()))
  kernel = attention.make_flash(tiny_mixtral(attention_sinks=True, attention="flash").model)
  q, kv = jnp.zeros((1, 16, 4, 8)), jnp.zeros((1, 16, 2, 8))
  with sharding.activation_sharding(mesh, rules), pytest.raises(ConfigError) as info:
    kernel(q, kv, kv, jnp.ones((1, 16), jnp.int32), None, 0.0, sinks_N=jnp.zeros((4,)))
  assert "attention=flash with attention_sinks runs only the chunked JAX kernel" in str(info.value)
  assert "\n" not in str(info.value)
