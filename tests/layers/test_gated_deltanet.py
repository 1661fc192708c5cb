"""Gated DeltaNet: the chunked form equals the recurrent form step by step and HF transformers'
torch reference functions; packed documents do not see each other; decoding token by token with
the layer's LinearState equals the whole-sequence pass, and a padded prefill keeps padding out of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.layers import gated_delta_rule as gdr
from MaxText.layers.gated_deltanet import GatedDeltaNet, empty_state
from MaxText.platform import sharding
from flax import nnx

B, L, Y, Q, W = 2, 21, 3, 8, 6  # L crosses two chunk boundaries at chunk size 8
CHUNK = 8
# Compiled once per shape: eager, every op of the scans would dispatch on its own.
chunked = jax.jit(gdr.chunked, static_argnums=6)
recurrent = jax.jit(gdr.recurrent)


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, L, Y, Q)).astype(np.float32)
  k = rng.normal(size=(B, L, Y, Q)).astype(np.float32)
  v = rng.normal(size=(B, L, Y, W)).astype(np.float32)
  g = -np.abs(rng.normal(size=(B, L, Y))).astype(np.float32)
  beta = (1 / (1 + np.exp(-rng.normal(size=(B, L, Y))))).astype(np.float32)
  state = rng.normal(size=(B, Y, Q, W)).astype(np.float32)
  return np.asarray(gdr.l2_normalize(q)) * Q ** -0.5, np.asarray(gdr.l2_normalize(k)), v, g, beta, state


def test_chunked_equals_recurrent_at_every_step():
  q, k, v, g, beta, state = _inputs()
  out, _ = recurrent(q, k, v, g, beta, state)  # every step's output, token by token
  # Prefixes ending on both sides of each chunk boundary: outputs of every step and the state after the last.
  for length in (1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, L):
    chunk_out, chunk_state = chunked(q[:, :length], k[:, :length], v[:, :length], g[:, :length],
                                         beta[:, :length], state, CHUNK)
    _, step_state = recurrent(q[:, :length], k[:, :length], v[:, :length], g[:, :length], beta[:, :length], state)
    np.testing.assert_allclose(chunk_out, out[:, :length], atol=2e-5, err_msg=f"length {length}")
    np.testing.assert_allclose(chunk_state, step_state, atol=2e-5, err_msg=f"length {length}")


def test_both_forms_equal_hf_reference_functions():
  torch = pytest.importorskip("torch")
  modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
  q, k, v, g, beta, state = _inputs(1)
  t = torch.tensor
  # HF's functions take raw q, k and normalise and scale them themselves: hand them ours pre-scaled back.
  hf_out, hf_state = modeling.torch_chunk_gated_delta_rule(
      t(q * Q ** 0.5), t(k), t(v), t(g), t(beta), chunk_size=CHUNK, initial_state=t(state), output_final_state=True,
      use_qk_l2norm_in_kernel=True)
  for out, final in (chunked(q, k, v, g, beta, state, CHUNK), recurrent(q, k, v, g, beta, state)):
    np.testing.assert_allclose(out, hf_out.numpy(), atol=2e-5)
    np.testing.assert_allclose(final, hf_state.numpy(), atol=2e-5)


def test_causal_conv_continues_from_its_state():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(B, L, 5)).astype(np.float32)
  kernel = rng.normal(size=(4, 5)).astype(np.float32)
  whole, _ = gdr.causal_conv(x, np.zeros((B, 3, 5), np.float32), kernel)
  state = np.zeros((B, 3, 5), np.float32)
  for t in range(L):
    step, state = gdr.causal_conv(x[:, t:t + 1], state, kernel)
    np.testing.assert_allclose(step[:, 0], whole[:, t], atol=1e-6)


def _layer() -> tuple[GatedDeltaNet, Config]:
  config = Config.for_testing(decoder_block="qwen3_next", attention_type="gated_deltanet", base_emb_dim=32,
                              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                              linear_value_head_dim=6, linear_conv_kernel_dim=4, linear_attention_chunk_size=CHUNK,
                              dtype="float32", max_target_length=L)
  with nnx.use_eager_sharding(False):
    return GatedDeltaNet(config.model, rngs=nnx.Rngs(params=0)), config


def test_packed_documents_do_not_see_each_other():
  layer, _ = _layer()
  x = jax.random.normal(jax.random.PRNGKey(0), (1, L, 32))
  positions = jnp.arange(L)[None]
  cut = 11
  segments = jnp.where(positions < cut, 1, 2)
  run = nnx.jit(lambda layer, *args: layer(*args))
  with sharding.unsharded():
    packed = run(layer, x, positions, segments)
    second = run(layer, x[:, cut:], positions[:, cut:] - cut, jnp.ones((1, L - cut), jnp.int32))
  np.testing.assert_allclose(packed[:, cut:], second, atol=1e-4)


def test_decode_token_by_token_equals_whole_sequence():
  layer, config = _layer()
  x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 32))
  positions = jnp.broadcast_to(jnp.arange(L)[None], (B, L))
  run = nnx.jit(lambda layer, *args: layer(*args))
  with sharding.unsharded():
    whole = run(layer, x, positions, jnp.ones((B, L), jnp.int32))
    prefill = 9  # a prefill, then one token at a time past the next chunk boundary
    out, state = run(layer, x[:, :prefill], positions[:, :prefill], jnp.ones((B, prefill), jnp.int32), 0,
                     empty_state(config.model, B))
    steps = [out]
    for t in range(prefill, L):
      out, state = run(layer, x[:, t:t + 1], positions[:, t:t + 1], jnp.ones((B, 1), jnp.int32), 0, state)
      steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, atol=1e-4)


def test_padded_prefill_leaves_the_state_of_its_real_tokens():
  """A right-padded prompt (segment id 0 after its real tokens, as Transformer.decode marks a prefill's
  padding) leaves the state its real tokens alone leave: padding neither decays nor writes it, and the
  conv state ends at the last real token. Row 1's prompt is shorter than the conv width."""
  layer, config = _layer()
  x = jax.random.normal(jax.random.PRNGKey(2), (B, L, 32))
  positions = jnp.broadcast_to(jnp.arange(L)[None], (B, L))
  lengths = (13, 2)
  run = nnx.jit(lambda layer, *args: layer(*args))
  with sharding.unsharded():
    segments = (positions < jnp.asarray(lengths)[:, None]).astype(jnp.int32)
    _, padded = run(layer, x, positions, segments, 0, empty_state(config.model, B))
    for row, n in enumerate(lengths):
      _, alone = run(layer, x[row:row + 1, :n], positions[row:row + 1, :n], jnp.ones((1, n), jnp.int32), 0,
                     empty_state(config.model, 1))
      for got, want in zip(jax.tree.leaves(padded), jax.tree.leaves(alone)):
        np.testing.assert_allclose(got[row:row + 1], want, atol=1e-5, err_msg=f"row {row}")


@pytest.mark.parametrize("n", [1, 2, 7, 16, 48])
def test_unit_lower_inverse_equals_the_triangular_solve(n):
  """The matmul-only inverse of a chunk's system (no LAPACK call, which deadlocks sharded CPU
  programs) against jax.scipy's solve, sizes that are and are not powers of two."""
  from jax.scipy.linalg import solve_triangular

  from MaxText.layers.gated_delta_rule import unit_lower_inverse

  eye = jnp.broadcast_to(jnp.eye(n), (3, 2, n, n))
  m = jnp.tril(jax.random.normal(jax.random.key(n), (3, 2, n, n)) * 0.5, -1) + eye
  want = solve_triangular(m, eye, lower=True, unit_diagonal=True)
  got = unit_lower_inverse(m)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))
  np.testing.assert_allclose(jnp.einsum("...ij,...jk->...ik", m, got), eye, atol=1e-4)


def test_the_kernel_table_picks_the_delta_rule_form():
  """One cached token steps the recurrence; training, prefill and multi-token calls run chunked, on
  every platform family (attention_kernels.LINEAR)."""
  from MaxText.layers import attention_kernels

  for platform in ("cpu", "gpu", "tpu"):
    assert attention_kernels.linear_attention_form(1, cached=True, platform=platform) == "recurrent"
    assert attention_kernels.linear_attention_form(1, cached=False, platform=platform) == "chunked"
    assert attention_kernels.linear_attention_form(64, cached=True, platform=platform) == "chunked"
