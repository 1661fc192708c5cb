"""The compiled decode step reads the KV cache where it is stored: no copy or transpose of a cache
(kv_cache.py's layouts: keys [B, K, S, H], values [B, K, H, S], the ones attention's dots read;
stored [B, S, K, H], every step copied every layer's cache into them, and a scanned stack sliced
each layer's cache out and stacked it back), for the dense and paged layouts, scanned and unrolled
layers, float and int8 caches, one and several steps per call; and MLA's compressed cache, whose
latents and rope keys are scored by two dots, not concatenated into one key every step, also by
DeepSeek-V3.2's sparse attention in both its forms (nor are its indexer's keys copied token-major)."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.inference.engine import Engine
from MaxText.layers import attention_kernels
from MaxText.platform import sharding
from decode_test_utils import one_device_mesh

SLOTS, LENGTH, KV_HEADS, HEAD_DIM = 4, 64, 2, 16
GQA: dict[str, Any] = dict(base_emb_dim=64, base_num_query_heads=8, base_num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           base_mlp_dim=128, base_num_decoder_layers=2, vocab_size=128, max_target_length=LENGTH,
                           max_prefill_predict_length=8, per_device_batch_size=1, print_config=False, dtype="float32")
PAGED = dict(kv_cache_layout="paged", kv_page_size=8)
# A tiny DeepSeek-V3-shaped MLA model: its cache holds latents [R] and rope keys [P] per token.
KV_LORA_RANK, ROPE_DIM = 16, 4
MLA: dict[str, Any] = dict(GQA, decoder_block="deepseek3", attention_type="mla", base_num_query_heads=4,
                           base_num_kv_heads=4, head_dim=12, q_lora_rank=24, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=8,
                           qk_rope_head_dim=ROPE_DIM, v_head_dim=6, first_dense_layers=1, dense_mlp_dim=48,
                           num_experts=4, num_experts_per_tok=2)
# DeepSeek-V3.2: the indexer's keys [J] follow the rope keys in the cache. J > R tells a copy of them apart
# from the latents' CPU transpose (see the MLA test); top-4 of 64 keys takes the gathered form, top-16 the masked.
INDEX_DIM = 32
DSA: dict[str, Any] = dict(MLA, decoder_block="deepseek32", index_n_heads=2, index_head_dim=INDEX_DIM)
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\{[^}]*\} (copy|transpose|concatenate)\(")


def cache_sized_copies(hlo: str, one_layer: int = SLOTS * LENGTH * KV_HEADS * HEAD_DIM,
                       skip_gathers: bool = True) -> list[str]:
  """The copy, transpose and concatenate instructions (fused or not) whose result holds at least
  `one_layer` elements (one layer's cache), outside the computations that gather pages (the paged
  reference path reads each slot's pages into a dense array once per layer: that gather writes
  the layout the dots read). skip_gathers=False counts inside them too: a key built from the whole
  cache for the sparse form to gather its chosen rows from is a copy all the same."""
  found = []
  for computation in re.split(r"\n(?=\S)", hlo):
    if skip_gathers and " gather(" in computation:
      continue
    for line in computation.splitlines():
      match = _OP.match(line)
      if match and int(np.prod([int(d) for d in match.group(1).split(",") if d] or [1])) >= one_layer:
        found.append(line.strip()[:160])
  return found


def decode_program(steps: int, model: dict[str, Any] = GQA, **keys: Any) -> str:
  engine = Engine(Config.for_testing(**{**model, **keys}, decode_steps_per_call=steps), num_slots=SLOTS,
                  mesh=one_device_mesh())
  params = sharding.with_shardings(engine.spec.abstract_params, engine.param_shardings)
  if steps == 1:
    return str(engine.compile_step(params).as_text())
  state = jax.eval_shape(engine.init_decode_state)
  ends = np.full(SLOTS, LENGTH, np.int32)
  table = engine.cache.step_table(steps, ends.astype(np.int64))
  with sharding.activation_sharding(engine.mesh, engine.rules):
    return str(engine._block.lower(params, state, table, ends, np.asarray([-1], np.int32)).compile().as_text())


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["dense", "paged"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_a_decode_step_copies_no_cache(layout: dict[str, Any], scan_layers: bool) -> None:
  assert cache_sized_copies(decode_program(1, scan_layers=scan_layers, **layout)) == []


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["dense", "paged"])
def test_several_steps_per_call_and_an_int8_cache_copy_no_cache(layout: dict[str, Any]) -> None:
  assert cache_sized_copies(decode_program(4, **layout)) == []
  assert cache_sized_copies(decode_program(1, quantize_kvcache=True, **layout)) == []


def test_mla_scores_its_latent_cache_without_concatenating_it() -> None:
  # The latents are also the values, whose dot contracts the cache's length: on CPU, XLA lays that
  # operand out length-last with a transpose, which this test does not count.
  one_layer = SLOTS * LENGTH * KV_LORA_RANK  # the latents alone: a [S, R + P] key built each step is larger
  copies = cache_sized_copies(decode_program(1, MLA, scan_layers=False), one_layer)
  assert [line for line in copies if " concatenate(" in line] == []


@pytest.mark.parametrize("topk,form", [(4, "gathered"), (16, "masked")])
@pytest.mark.parametrize("layout", [{}, PAGED], ids=["dense", "paged"])
def test_sparse_attention_scores_the_latent_cache_without_concatenating_it(topk: int, form: str,
                                                                           layout: dict[str, Any]) -> None:
  assert attention_kernels.sparse_kernel(LENGTH, topk, "cpu") == form
  hlo = decode_program(1, dict(DSA, index_topk=topk, **layout), scan_layers=False)
  # A [S, R + P] key can sit in the fusion that gathers the chosen rows; the page gathers write no concatenate.
  copies = cache_sized_copies(hlo, SLOTS * LENGTH * KV_LORA_RANK, skip_gathers=False)
  assert [line for line in copies if " concatenate(" in line] == []
  if not layout:  # the indexer's keys read where they are stored, [J, S], not copied token-major
    assert cache_sized_copies(hlo, SLOTS * LENGTH * INDEX_DIM, skip_gathers=False) == []
