"""The int8 MLA cache of DeepSeek-V3.2 (quantize_kvcache with index_topk > 0): the rope key and the
indexer's key share one cache row per token but are quantized with a scale each, so a part much
smaller than the other keeps its precision. Dense and paged, either part the large one: the int8
cache's logits stay as close to the float cache's as when the two parts are of one size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference import paged_cache
from MaxText.inference.engine import Engine
from MaxText.layers import kv_cache
from MaxText.platform import sharding
from decode_test_utils import one_device_mesh
from test_paged_cache import DSA

PROMPT = [5, 17, 42, 99, 1, 64, 3, 88]  # longer than index_topk: the indexer's choice matters
STEPS = 6
PAGE = 4


def _scaled(params, cfg, rope: float, indexer: float):
  """`params` with every MLA layer's rope keys (W_kva's rope columns) times `rope` and indexer keys
  (its key norm's gain and bias) times `indexer`."""
  rank = cfg.mla.kv_lora_rank

  def scale(path, leaf):
    name = jax.tree_util.keystr(path)
    if "['indexer']['k_norm']" in name:
      return leaf * indexer
    if "['wkv_a']['kernel']" in name:
      return leaf.at[..., rank:].multiply(rope)
    return leaf
  return jax.tree_util.tree_map_with_path(scale, params)


def _caches(cfg, layout: str, quantized: bool):
  if layout == "dense":
    return kv_cache.model_caches(cfg, 1, cfg.max_target_length, quantized)
  per_slot = paged_cache.pages_per_slot(cfg.max_target_length, PAGE)
  pools = paged_cache.model_pools(cfg, per_slot, PAGE, 1, quantized)
  return paged_cache.with_block_table(pools, jnp.arange(per_slot, dtype=jnp.int32)[None])


def _logits(engine: Engine, params, layout: str, quantized: bool) -> np.ndarray:
  """Prefill of PROMPT, then STEPS steps of fixed tokens: the logits of each."""
  cfg = engine.cfg
  apply = jax.jit(sharding.unsharded()(engine.spec.apply_decode))
  logits, caches = apply(params, jnp.asarray([PROMPT]), jnp.arange(len(PROMPT))[None], _caches(cfg, layout, quantized))
  out = [logits[0, -1]]
  for step in range(STEPS):
    token, position = jnp.asarray([[(step * 37) % cfg.vocab_size]]), jnp.asarray([[len(PROMPT) + step]])
    logits, caches = apply(params, token, position, caches)
    out.append(logits[0, 0])
  return np.asarray(jnp.stack(out), np.float32)


def _int8_error(engine: Engine, params, layout: str) -> float:
  """RMS of the int8 cache's logits minus the float cache's, relative to the logits' RMS."""
  expected = _logits(engine, params, layout, False)
  got = _logits(engine, params, layout, True)
  return float(np.sqrt(np.mean((got - expected) ** 2)) / np.sqrt(np.mean(expected ** 2)))


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_the_int8_error_does_not_depend_on_the_indexer_keys_size_against_the_rope_keys(layout):
  """Indexer keys 100x the rope keys, or the rope keys 100x the indexer keys, against the same rope keys
  with indexer keys of their size: a scale each rounds each part as if it were alone (and the
  indexer's choice does not change with its keys' size), where one shared scale rounded the smaller
  part to a few levels."""
  engine = Engine(Config.for_testing(**DSA, scan_layers=True), num_slots=1, mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  cfg = engine.cfg
  cache = _caches(cfg, layout, True)
  assert jax.tree.leaves(cache)[0].dtype == jnp.int8
  # Per layer and token: the latent and the [rope | indexer] row in int8, a float32 scale for the
  # latent and one for each part of the row; the paged pools' block tables besides.
  row = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim + cfg.mla.index_head_dim + 4 * (1 + 2)
  tables = 0 if layout == "dense" else 2 * 4 * paged_cache.pages_per_slot(cfg.max_target_length, PAGE)
  assert paged_cache.cache_bytes(cache) == 2 * cfg.max_target_length * row + tables
  # (rope factor, indexer factor): each part 100x the other, against both parts of one size.
  pairs = {(1.0, 100.0): (1.0, 1.0), (100.0, 1.0): (100.0, 100.0)}
  errors = {factors: _int8_error(engine, _scaled(params, cfg, *factors), layout)
            for pair in pairs.items() for factors in pair}
  assert all(0 < errors[alike] and errors[apart] < 1.5 * errors[alike] for apart, alike in pairs.items()), errors
