"""Attention kernels against the plain dot_product kernel (outside truth: the materialised
softmax): chunked flash, splash (Pallas interpret mode on CPU), the cuDNN argument mapping (run
through XLA), autoselection, and sequence-parallel attention on the 8-device CPU mesh."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.configuration.model_config import AttentionBlocks
from MaxText.errors import ConfigError
from MaxText.layers import attention, attention_kernels, flash_blocks, splash_attention
from MaxText.layers.attention import dot_product_attention, select_kernel

# (name, window_size, soft_cap, packed): every mask kind the layer can ask for.
MASKS = [("causal", None, 0.0, False), ("packed", None, 0.0, True), ("window", 5, 0.0, False),
         ("traced_window", "traced", 0.0, True), ("soft_cap", None, 3.0, True), ("all", 7, 2.0, True)]


def _inputs(batch=2, length=40, num_q=4, num_kv=2, head_dim=8, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (batch, length, num_q, head_dim), dtype)
  k = jax.random.normal(kk, (batch, length, num_kv, head_dim), dtype)
  v = jax.random.normal(kv, (batch, length, num_kv, head_dim), dtype)
  return q, k, v


def _segments(batch: int, length: int, packed: bool) -> jax.Array:
  if not packed:
    return jnp.ones((batch, length), jnp.int32)
  # Documents of uneven lengths, a padding tail (segment 0) in the first row.
  first, second = length // 3, length // 2
  row0 = np.concatenate([np.full(first, 1), np.full(second, 2), np.zeros(length - first - second)])
  row1 = np.concatenate([np.full(length - 9, 1), np.full(9, 2)])
  return jnp.asarray(np.stack([row0, row1][:batch]), jnp.int32)


def _compare(kernel, q, k, v, seg, window, soft_cap, rtol=1e-5, atol=1e-5):
  """Values and gradients (of a non-linear loss) of `kernel` vs dot_product, jitted."""
  traced = window == "traced"

  def loss(fn, q, k, v, w):
    return jnp.sum(jnp.sin(fn(q, k, v, seg, w if traced else window, soft_cap)))

  args = (q, k, v, jnp.int32(6) if traced else 0)
  out = jax.jit(lambda q, k, v, w: kernel(q, k, v, seg, w if traced else window, soft_cap))(*args)
  ref = jax.jit(lambda q, k, v, w: dot_product_attention(q, k, v, seg, w if traced else window, soft_cap))(*args)
  np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
  grads = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2)))(*args)
  ref_grads = jax.jit(jax.grad(functools.partial(loss, dot_product_attention), argnums=(0, 1, 2)))(*args)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=rtol * 10, atol=atol * 10)


@pytest.mark.parametrize("name, window, soft_cap, packed", MASKS, ids=[m[0] for m in MASKS])
def test_flash_equals_dot_product(name, window, soft_cap, packed):
  q, k, v = _inputs()  # length 40: blocks of 16 queries / 8 keys, the last query block padded
  kernel = functools.partial(flash_blocks.flash_attention, block_q=16, block_kv=8)
  _compare(kernel, q, k, v, _segments(2, 40, packed), window, soft_cap)


def test_flash_multi_query_and_bfloat16():
  q, k, v = _inputs(num_q=6, num_kv=1, length=32)
  _compare(functools.partial(flash_blocks.flash_attention, block_q=8, block_kv=16), q, k, v,
           _segments(2, 32, True), 9, 0.0)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = jax.jit(functools.partial(flash_blocks.flash_attention, block_q=8, block_kv=8),
                static_argnums=(4,))(qb, kb, vb, _segments(2, 32, True), 9)
  ref = dot_product_attention(qb, kb, vb, _segments(2, 32, True), 9)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2)


def test_flash_skips_blocks_and_saves_memory():
  """Forward + backward temporaries of flash stay far below the materialised [L, L] scores."""
  q, k, v = _inputs(batch=1, length=1024, num_q=2, num_kv=1, head_dim=16)
  seg = jnp.ones((1, 1024), jnp.int32)

  def temp_bytes(kernel):
    step = jax.jit(jax.grad(lambda q, k, v: kernel(q, k, v, seg, None, 0.0).sum(), argnums=(0, 1, 2)))
    return step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  flash = temp_bytes(functools.partial(flash_blocks.flash_attention, block_q=128, block_kv=128))
  dense = temp_bytes(dot_product_attention)
  assert dense > 2 * 1024 * 1024 * 4  # at least two heads' float32 [L, L] scores
  assert flash < dense / 4, (flash, dense)


def test_reference_with_offset_matches_the_tail_of_full_attention():
  """The offset reference (context parallelism's local math) is the lower rows of full attention."""
  q, k, v = _inputs(length=32)
  seg = _segments(2, 32, True)
  full = dot_product_attention(q, k, v, seg, 6, 1.5)
  tail = flash_blocks.reference_attention_with_offset(q[:, 16:], k, v, seg[:, 16:], seg, 6, 1.5, 16)
  flash_tail = jax.jit(functools.partial(flash_blocks.flash_attention_with_offset, block_q=8, block_kv=8),
                       static_argnums=(5, 6))(q[:, 16:], k, v, seg[:, 16:], seg, 6, 1.5, 16)
  np.testing.assert_allclose(tail, full[:, 16:], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(flash_tail, full[:, 16:], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- splash (TPU kernel, interpreted on CPU)

@pytest.mark.parametrize("window, soft_cap", [(None, 0.0), (100, 0.0), ("traced", 4.0)])
def test_splash_kernel_interpreted_equals_dot_product(window, soft_cap):
  q, k, v = _inputs(batch=1, length=256, num_q=4, num_kv=2, head_dim=128)
  blocks = _blocks(128)
  kernel = functools.partial(splash_attention.splash_attention, blocks=blocks, local_window=100, interpret=True)
  seg = jnp.asarray(np.repeat([[1, 2]], [100, 156], axis=1), jnp.int32)
  traced = window == "traced"
  # Traced: 6 means the local kernel (its static window is local_window = 100).
  ref_window = 100 if traced else window
  out = jax.jit(lambda q, w: kernel(q, k, v, seg, w if traced else window, soft_cap))(q, jnp.int32(6))
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, seg, ref_window, soft_cap), rtol=1e-5, atol=1e-5)
  grad = jax.grad(lambda q: jnp.sum(jnp.sin(kernel(q, k, v, seg, ref_window, soft_cap))))(q)
  ref_grad = jax.grad(lambda q: jnp.sum(jnp.sin(dot_product_attention(q, k, v, seg, ref_window, soft_cap))))(q)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-4)


def test_splash_fused_backward_reaches_the_kernel_and_keeps_the_gradients():
  """sa_use_fused_bwd_kernel: splash's one backward kernel (dQ beside dK/dV), its dQ tiles dropped."""
  sizes = splash_attention.block_sizes(_blocks(128, sa_use_fused_bwd_kernel=True), 256)
  assert sizes.use_fused_bwd_kernel and (sizes.block_q_dq, sizes.block_kv_dq) == (None, None)
  assert not splash_attention.block_sizes(_blocks(128), 256).use_fused_bwd_kernel
  q, k, v = _inputs(batch=1, length=256, num_q=4, num_kv=2, head_dim=128)
  seg = jnp.asarray(np.repeat([[1, 2]], [100, 156], axis=1), jnp.int32)
  kernel = functools.partial(splash_attention.splash_attention, blocks=_blocks(128, sa_use_fused_bwd_kernel=True),
                             interpret=True)
  grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(kernel(q, k, v, seg, None, 0.0))), argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(dot_product_attention(q, k, v, seg, None, 0.0))),
                 argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_splash_block_sizes_must_tile_the_sequence():
  with pytest.raises(ConfigError, match=r"max_target_length \(320\) to be a multiple of sa_block_q \(256\)"):
    splash_attention.block_sizes(_blocks(512, sa_block_q=256), 320)


# ---------------------------------------------------------------- cuDNN

@pytest.mark.parametrize("name, window, soft_cap, packed", [m for m in MASKS if m[2] == 0],
                         ids=[m[0] for m in MASKS if m[2] == 0])
def test_cudnn_argument_mapping_through_xla_equals_dot_product(name, window, soft_cap, packed):
  """The mask, window and causal arguments handed to jax.nn.dot_product_attention, run by XLA."""
  q, k, v = _inputs()
  kernel = functools.partial(attention_kernels.cudnn_flash_attention, implementation="xla")
  _compare(kernel, q, k, v, _segments(2, 40, packed), window, soft_cap)


@pytest.mark.parametrize("window", [None, 5])
def test_cudnn_without_document_mask_is_causal_attention_over_the_whole_row(window):
  """document_mask=False (synthetic rows, one document each) hands cuDNN no mask: whatever segment
  ids come in, the result is causal (and windowed) attention over the whole row."""
  q, k, v = _inputs()
  unmasked = functools.partial(attention_kernels.cudnn_flash_attention, implementation="xla", document_mask=False)
  out = unmasked(q, k, v, _segments(2, 40, packed=True), window, 0.0)
  want = dot_product_attention(q, k, v, _segments(2, 40, packed=False), window, 0.0)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  lowered = jax.jit(lambda q: unmasked(q, k, v, _segments(2, 40, packed=True), window, 0.0)).lower(q).as_text()
  assert "tensor<2x1x40x40xi1>" not in lowered  # no [B, 1, L, S] mask is built
  masked = functools.partial(attention_kernels.cudnn_flash_attention, implementation="xla")
  assert "tensor<2x1x40x40xi1>" in jax.jit(lambda q: masked(q, k, v, _segments(2, 40, True), window, 0.0)
                                           ).lower(q).as_text()


def test_only_synthetic_rows_skip_the_document_mask():
  assert _tiny().model.attn.rows_hold_one_document
  assert not _tiny(dataset_type="hf", hf_data_files="/data/train.jsonl", tokenizer_path="/data/tok.model").model.attn.rows_hold_one_document


def _tiny(**overrides) -> Config:
  values = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
                print_config=False)
  return Config.for_testing(**{**values, **overrides})


def test_cudnn_flash_on_cpu_and_with_soft_cap_fail_clearly():
  kernel = attention.ATTENTION_KERNELS["cudnn_flash"](_tiny(attention="cudnn_flash").model)
  q, k, v = _inputs()
  with pytest.raises(ConfigError, match="attention=cudnn_flash needs an NVIDIA GPU .* this program is for cpu"):
    kernel(q, k, v, _segments(2, 40, False), None, 0.0)
  with pytest.raises(ConfigError, match="attention=cudnn_flash does not support attn_logits_soft_cap=50.0"):
    attention.ATTENTION_KERNELS["cudnn_flash"](_tiny(attention="cudnn_flash", attn_logits_soft_cap=50.0).model)


# ---------------------------------------------------------------- autoselection

def test_autoselect_rule_per_platform():
  short, long_ = _tiny().model, _tiny(max_target_length=4096).model
  capped = _tiny(attn_logits_soft_cap=30.0).model
  assert select_kernel("autoselected", "tpu", _tiny(max_target_length=256).model) == "flash"
  assert select_kernel("autoselected", "gpu", _tiny(dtype="bfloat16").model) == "cudnn_flash"
  assert select_kernel("autoselected", "gpu", capped) == "flash"
  assert select_kernel("autoselected", "gpu", _tiny(dtype="float32").model) == "flash"
  assert select_kernel("autoselected", "cpu", short) == "dot_product"
  assert select_kernel("autoselected", "cpu", long_) == "flash"
  assert select_kernel("autoselected", "cpu", _tiny(max_target_length=512).model) == "dot_product"
  assert select_kernel("autoselected", "cpu", _tiny(max_target_length=1024).model) == "flash"
  assert select_kernel("autoselected", "tpu", _tiny(max_target_length=64).model) == "dot_product"  # < 128
  assert select_kernel("dot_product", "tpu", short) == "dot_product"
  assert select_kernel("autoselected") == "autoselected"  # deferred until traced


def test_chunked_layers_run_on_dot_product_only():
  """Only dot_product has the chunked mask (Llama 4): autoselected picks it, flash is one error line."""
  chunked = dict(attention_layer_pattern=["chunked", "global"], attention_chunk_size=8)
  for platform in ("tpu", "gpu", "cpu"):
    assert select_kernel("autoselected", platform, _tiny(max_target_length=4096, **chunked).model) == "dot_product"
  with pytest.raises(ConfigError, match="chunked attention layers run on attention=dot_product"):
    _tiny(attention="flash", **chunked)


def test_autoselected_says_once_which_kernel_it_picked(capsys):
  attention._ANNOUNCED.clear()
  kernel = attention.ATTENTION_KERNELS["autoselected"](_tiny(max_target_length=4096).model)
  q, k, v = _inputs(length=16)
  seg = _segments(2, 16, False)
  run = jax.jit(lambda q, k, v: kernel(q, k, v, seg, None, 0.0))
  out = run(q, k, v)
  run(q * 2, k, v)  # traced once: one line
  jax.jit(lambda q, k, v: kernel(q, k, v, seg, None, 0.0))(q, k, v)  # traced again: no second line
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, seg), rtol=1e-5, atol=1e-6)
  assert capsys.readouterr().out.count("attention=autoselected: using flash on cpu") == 1


def test_config_validates_block_sizes():
  with pytest.raises(ConfigError, match="sa_block_kv must be a multiple of 128"):
    _tiny(sa_block_kv=100)
  with pytest.raises(ConfigError, match="flash_block_q must be > 0"):
    _tiny(flash_block_q=0)
  assert _tiny(attention="flash", flash_block_q=64).model.attn.attention_blocks.flash_block_q == 64


def _blocks(size: int, **overrides: int | bool) -> AttentionBlocks:
  """Every tile `size`, some overridden (the group's fields are its config keys, all required)."""
  names = [f.name for f in dataclasses.fields(AttentionBlocks) if "_block_" in f.name]
  return AttentionBlocks(**{**dict.fromkeys(names, size), "sa_use_fused_bwd_kernel": False, **overrides})
