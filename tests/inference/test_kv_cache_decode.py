"""Cached decoding against two outside truths, for every model family: greedy decoding that re-runs
the full forward pass each step (no cache), and Hugging Face `generate(do_sample=False)` on the
same tiny random models converted through our converters.

Prompts of different lengths share one batch (right padding), and generation runs past the
sliding windows of Mistral (5) and Gemma 2, 3 and GPT-OSS (6) and across Llama 4's chunk boundaries (8, 16,
24), so windows, chunks, padding and GQA are all exercised; 16 new tokens each, as the
model-family issue asks. Qwen3-Next's Gated DeltaNet layers carry their recurrent state in the cache:
its prefill must keep the padding out of that state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference.engine import Engine
from MaxText.layers import kv_cache, masks
from decode_test_utils import engine_tokens, one_device_mesh, uncached_greedy
from test_paged_cache import DSA

PREFILL, TARGET, NEW_TOKENS = 12, 32, 16
PROMPTS = [[5, 17, 42, 7, 99, 3, 64, 20, 11], [101, 2, 33, 8]]


@pytest.fixture(scope="module")
def hf():
  pytest.importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
  pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
  import hf_families
  return hf_families


def hf_greedy(hf, model, prompt: list[int], num_new: int) -> list[int]:
  with hf.torch.no_grad():
    ids = model.generate(hf.torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
  return ids[0, len(prompt):].tolist()


# scan_layers alternates so both cache layouts (stacked and per-layer tuple) are covered.
# One case per cache mechanism stays in the default run: sliding window with soft caps (gemma2),
# learned positions (gpt3), MoE (mixtral), chunked attention (llama4), MLA's latent cache (deepseek3),
# sinks with alternating windows (gpt_oss), per-layer-type RoPE (olmo3), per-layer cache shapes with
# KV-shared layers reading their sources' caches (gemma4). The rest are slow (Qwen3-Next's recurrent
# state too: its DeltaNet scans compile slowly on CPU; tests/layers/test_gated_deltanet.py checks a padded
# prefill's state in the default run).
_slow = pytest.mark.slow
CASES = [pytest.param("llama3.1", True, marks=_slow), pytest.param("llama2-tied", False, marks=_slow),
         pytest.param("mistral", True, marks=_slow), pytest.param("gemma", False, marks=_slow), ("gemma2", True),
         ("gpt3", False), ("mixtral", True), pytest.param("gemma3", False, marks=_slow),
         pytest.param("qwen3_moe", True, marks=_slow), pytest.param("qwen3", False, marks=_slow),
         pytest.param("qwen3-yarn", True, marks=_slow),
         ("llama4", True), pytest.param("llama4", False, marks=_slow),
         pytest.param("llama4-maverick", False, marks=_slow), pytest.param("llama4-maverick", True, marks=_slow),
         ("deepseek3", True), pytest.param("deepseek2-lite", False, marks=_slow),
         pytest.param("deepseek32", True, marks=_slow), pytest.param("deepseek32", False, marks=_slow),
         ("gpt_oss", False), ("olmo3", True), pytest.param("olmo2", False, marks=_slow),
         ("gemma4", False), pytest.param("gemma4-experts", False, marks=_slow),
         pytest.param("qwen3_next", True, marks=_slow), pytest.param("qwen3_next", False, marks=_slow),
         pytest.param("qwen3_5", True, marks=_slow), pytest.param("qwen3_5_moe", False, marks=_slow)]
# Per family: keys beyond the reference config. Qwen3-Next and Qwen3.5: DeltaNet chunks of 4, so the prompts span
# chunks and the new tokens pass several chunk lengths (its recurrent state rides in the cache).
EXTRA = {family: {"linear_attention_chunk_size": 4} for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}


@pytest.mark.parametrize("family,scan_layers", CASES)
def test_cached_greedy_equals_uncached_and_hf(hf, family, scan_layers, tmp_path):
  model = hf.build_hf_model(family)
  config = hf.our_config(model, dtype="float32", scan_layers=scan_layers, max_target_length=TARGET,
                         max_prefill_predict_length=PREFILL, **EXTRA.get(family, {}))
  params = hf.our_params(model, config, tmp_path)
  # A family whose 8-device forward hangs (hf_families.MESH_HANGS) decodes on one device.
  engine = Engine(config, num_slots=2, mesh=one_device_mesh() if family in hf.MESH_HANGS else None)
  cached = engine_tokens(engine, params, PROMPTS, NEW_TOKENS)
  for prompt, ours in zip(PROMPTS, cached):
    assert ours == uncached_greedy(engine.spec, params, prompt, NEW_TOKENS, TARGET), family
    assert ours == hf_greedy(hf, model, prompt, NEW_TOKENS), family
  assert engine.metrics()["step_compilations"] == 1


def test_the_indexer_warm_up_decodes_with_the_dense_attention_its_forward_runs():
  """indexer_warmup=True: the attention stays dense (the indexer only learns), so the cache attends to every
  past key as the uncached forward does, not to the half-trained indexer's top-4."""
  config = Config.for_testing(**DSA, indexer_warmup=True, indexer_loss_scaling_factor=1.0)
  engine = Engine(config, num_slots=1, mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  prompt = PROMPTS[0][:DSA["max_prefill_predict_length"]]
  assert engine_tokens(engine, params, [prompt], 8) == [uncached_greedy(engine.spec, params, prompt, 8,
                                                                        DSA["max_target_length"])]


def test_mask_sees_only_past_and_window():
  positions_BL = jnp.asarray([[3, 4]])
  mask = np.asarray(masks.cache_mask(positions_BL, 8, window=2))
  np.testing.assert_array_equal(mask[0, 0], [0, 0, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(mask[0, 1], [0, 0, 0, 1, 1, 0, 0, 0])
  full = np.asarray(masks.cache_mask(positions_BL, 8, None))
  np.testing.assert_array_equal(full[0, 1], [1, 1, 1, 1, 1, 0, 0, 0])


def test_chunked_mask_sees_only_its_own_chunk():
  """Chunks of 4: position 5 sees 4..5 (not 2..5 as a window of 4 would); position 4 only itself."""
  positions_BL = jnp.asarray([[4, 5]])
  mask = np.asarray(masks.cache_mask(positions_BL, 8, chunk=4))
  np.testing.assert_array_equal(mask[0, 0], [0, 0, 0, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(mask[0, 1], [0, 0, 0, 0, 1, 1, 0, 0])
  training = np.asarray(masks.self_mask(jnp.ones((1, 8), jnp.int32), chunk=4))
  np.testing.assert_array_equal(training[0, 5], mask[0, 1])
  # A packed second document starting at index 3 cuts its chunks at its own positions.
  packed = np.asarray(masks.self_mask(jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2]]), chunk=4,
                                      positions_BL=jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])))
  np.testing.assert_array_equal(packed[0, 7], [0, 0, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(packed[0, 6], [0, 0, 0, 1, 1, 1, 1, 0])


def test_int8_round_trip_within_half_a_step():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16)) * 4
  q, scale = kv_cache.quantize_int8(x)
  assert q.dtype == jnp.int8 and scale.shape == (2, 5, 3, 1)
  error = np.abs(np.asarray(q * scale - x))
  assert (error <= np.asarray(scale) / 2 + 1e-6).all()
