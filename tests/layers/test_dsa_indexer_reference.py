"""The lightning indexer (layers/indexer.py) against a NumPy transcription of DeepSeek's reference
inference code for V3.2 (deepseek-ai/DeepSeek-V3.2-Exp, inference/model.py, `Indexer.forward` after
the fix that made its RoPE non-interleaved; `fp8_index` in inference/kernel.py), in float64 with
the FP8 quantisation left out (a precision choice, not part of the function):

  queries q_i = RoPE(qr · W_qb)_i, key k = RoPE(LayerNorm(x · W_k)), the first qk_rope_head_dim
  features rotated as two halves (pair j with j + P/2) and the rest passed through;
  both multiplied by the normalised Hadamard matrix (`rotate_activation`), which preserves q_i·k;
  score = Σ_i w_i · relu(q_i·k) · J**-0.5 with w = x · W_w · I**-0.5; causal keys only;
  each query keeps its min(index_topk, keys) best.

The reference takes the top-k with torch.topk, whose order among equal scores is unspecified; ours
takes them lowest key position first (masks.top_k_keys), which the transcription spells out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.configuration.config import Config
from MaxText.layers import indexer, masks
from MaxText.platform import sharding

HEADS, WIDTH, ROPE, TOPK, LENGTH, EMB, Q_RANK = 2, 16, 4, 4, 24, 32, 24


def _reference_topk(x_LD: np.ndarray, qr_LQ: np.ndarray, p: dict, theta: float) -> tuple[np.ndarray, np.ndarray]:
  """(index scores [L, L] with -inf above the diagonal, each query's chosen key positions [L, k])."""
  positions = np.arange(LENGTH, dtype=np.float64)
  angles_LP = positions[:, None] * theta ** (-np.arange(0, ROPE, 2) / ROPE)[None, :]
  cos, sin = np.cos(angles_LP), np.sin(angles_LP)

  def rope_halves(x: np.ndarray) -> np.ndarray:  # x [L, ..., J]: rotary part first, then the rest
    c, s = (a.reshape(a.shape[:1] + (1,) * (x.ndim - 2) + a.shape[1:]) for a in (cos, sin))
    first, second = x[..., :ROPE // 2], x[..., ROPE // 2:ROPE]
    return np.concatenate([first * c - second * s, second * c + first * s, x[..., ROPE:]], axis=-1)

  hadamard = np.array([[1.0]])
  while hadamard.shape[0] < WIDTH:
    hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
  hadamard /= np.sqrt(WIDTH)

  q_LIJ = rope_halves((qr_LQ @ p["wq_b"].reshape(Q_RANK, -1)).reshape(LENGTH, HEADS, WIDTH)) @ hadamard.T
  k_LJ = x_LD @ p["wk"]
  k_LJ = (k_LJ - k_LJ.mean(-1, keepdims=True)) / np.sqrt(k_LJ.var(-1, keepdims=True) + 1e-6)
  k_LJ = rope_halves(k_LJ * p["k_scale"] + p["k_bias"]) @ hadamard.T
  w_LI = (x_LD @ p["weights_proj"]) * HEADS ** -0.5
  dots_LIS = np.einsum("lij,sj->lis", q_LIJ, k_LJ)
  scores_LS = np.einsum("li,lis->ls", w_LI * WIDTH ** -0.5, np.maximum(dots_LIS, 0.0))
  scores_LS = np.where(np.tril(np.ones((LENGTH, LENGTH), bool)), scores_LS, -np.inf)
  order_LS = np.argsort(-scores_LS, axis=-1, kind="stable")  # equal scores: lowest position first
  return scores_LS, order_LS[:, :min(TOPK, LENGTH)]


def test_the_indexer_is_deepseeks_reference_function():
  config = Config.for_testing(decoder_block="deepseek32", attention_type="mla", base_emb_dim=EMB,
                              base_num_query_heads=4, base_num_kv_heads=4, head_dim=12, kv_lora_rank=16,
                              q_lora_rank=Q_RANK, qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=6,
                              index_topk=TOPK, index_n_heads=HEADS, index_head_dim=WIDTH, dtype="float32",
                              print_config=False)
  rope = config.model.rope
  assert rope.rope_type == "default" and rope.rope_min_timescale == 1
  with nnx.use_eager_sharding(False):
    module = indexer.LightningIndexer(config.model, rngs=nnx.Rngs(params=0))
  rng = np.random.default_rng(0)
  module.k_norm.scale[...] = jnp.asarray(1 + 0.1 * rng.standard_normal(WIDTH), jnp.float32)
  module.k_norm.bias[...] = jnp.asarray(0.1 * rng.standard_normal(WIDTH), jnp.float32)
  params = {"wq_b": module.wq_b.kernel[...], "wk": module.wk.kernel[...],
            "weights_proj": module.weights_proj.kernel[...], "k_scale": module.k_norm.scale[...],
            "k_bias": module.k_norm.bias[...]}
  params = {name: np.asarray(value, np.float64) for name, value in params.items()}
  x_LD, qr_LQ = rng.standard_normal((LENGTH, EMB)), rng.standard_normal((LENGTH, Q_RANK))

  positions = jnp.arange(LENGTH)[None]
  with sharding.unsharded():
    q_BLIJ, w_BLI = module.queries(jnp.asarray(x_LD[None], jnp.float32), jnp.asarray(qr_LQ[None], jnp.float32),
                                   positions)
    keys_BSJ = module.keys(jnp.asarray(x_LD[None], jnp.float32), positions)
  ours_LS = np.asarray(indexer.index_scores(q_BLIJ, w_BLI, keys_BSJ))[0]
  allowed_BLS = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None]
  chosen_LK, valid_LK = (np.asarray(a)[0] for a in masks.top_k_keys(jnp.asarray(ours_LS[None]), allowed_BLS, TOPK))

  expected_LS, expected_LK = _reference_topk(x_LD, qr_LQ, params, rope.rope_max_timescale)
  causal = np.isfinite(expected_LS)
  np.testing.assert_allclose(ours_LS[causal], expected_LS[causal], rtol=1e-5, atol=1e-6)
  # Two heads: a quarter of the pairs have both ReLUs at 0 and score exactly 0, so some queries'
  # k-th and (k+1)-th best keys tie and only the tie rule decides.
  kth_LK = np.sort(np.where(causal, expected_LS, -np.inf), axis=-1)[:, ::-1]
  assert np.sum((kth_LK[:, TOPK - 1] == kth_LK[:, TOPK]) & np.isfinite(kth_LK[:, TOPK])) >= 2
  for t in range(LENGTH):
    assert set(chosen_LK[t][valid_LK[t]]) == {s for s in expected_LK[t] if s <= t}, f"query {t}"
