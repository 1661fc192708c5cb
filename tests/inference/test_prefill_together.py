"""The requests the scheduler admits in one loop are prefilled in one engine call (dense and paged:
prefill + insert; paged with prefix caching: their prompts' rests into pages; chunked: one chunk
budget spent on several prompts' chunks), and each gets the tokens it gets when it is served alone;
a recurrent model's prompts too (their states gathered by slot and snapshotted from the batched call)."""

from __future__ import annotations

import pytest

from MaxText.configuration.config import Config
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from decode_test_utils import one_device_mesh, served

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=1, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 4, 1], [11, 4], [2, 2, 6, 1, 9]]
ROWS = [RowParams(seed=0), RowParams(seed=1), RowParams(temperature=1.0, seed=7), RowParams(seed=3)]
PAGED = dict(kv_cache_layout="paged", kv_page_size=4)
# Qwen3-Next's stack at its smallest: a Gated DeltaNet layer (recurrent slot state) and a full attention one.
RECURRENT = dict(decoder_block="qwen3_next", base_num_decoder_layers=2, full_attention_interval=2,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                 linear_conv_kernel_dim=4, linear_attention_chunk_size=4, attention_output_gate=True, use_qk_norm=True,
                 partial_rotary_factor=0.5, normalization_type="rms_plus_one")
# layout -> (its keys, prefill calls for the four prompts submitted together, as many as one call each took before).
# A chunk budget C goes to R rows of C // R tokens, R the power of two that prefills most: of 16, the prompts' first
# 3, 4, 2, 4 tokens, then 4 and 1; of 6, calls of 3 + 3, 5, 2 + 3 and 2 tokens (one chunk per call took 5 calls).
# A recurrent model's prompt ends a piece at its last page boundary (its states kept there): the 5-token one takes
# [0, 4) and [4, 5), alone and prefilled whole together with the others.
LAYOUTS = {"dense": ({}, 1, 4), "paged": (dict(PAGED, prefix_caching="false"), 1, 4),
           "prefix-cached": (dict(PAGED, prefix_caching="true"), 1, 4),
           "chunked": (dict(PAGED, prefix_caching="false", prefill_chunk_size=16), 2, 4),
           "chunked-split": (dict(PAGED, prefix_caching="true", prefill_chunk_size=6), 4, 5),
           "recurrent-dense": (RECURRENT, 1, 4),
           "recurrent-prefix-cached": (dict(PAGED, **RECURRENT, prefix_caching="true"), 2, 5),
           "recurrent-chunked": (dict(PAGED, **RECURRENT, prefix_caching="true", prefill_chunk_size=16), 2, 5)}


def _served(eng: Engine, params, indices: list[int]) -> dict[int, list[int]]:
  return served(eng, params, PROMPTS, ROWS, indices, max_new=5)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name.startswith("recurrent") else name
                                    for name in LAYOUTS])
def test_jobs_admitted_together_share_one_prefill_and_get_their_own_tokens(layout):
  keys, together_calls, one_each_calls = LAYOUTS[layout]
  eng = Engine(Config.for_testing(**{**TINY, **keys}), num_slots=4, mesh=one_device_mesh())
  params = eng.load_params()
  calls = {"prefills": 0}
  owner = eng.page_prefill if eng.prefills_into_pages else eng
  for name in ("_prefill", "_prefill_insert", "_extend", "_extend_rows"):  # every jitted prefill the engine may call
    jitted = getattr(owner, name, None)
    if jitted is not None:
      def counted(*args, _jitted=jitted, **kwargs):
        calls["prefills"] += 1
        return _jitted(*args, **kwargs)
      setattr(owner, name, counted)
  alone = {}
  for i in range(len(PROMPTS)):
    alone[i] = _served(eng, params, [i])[i]
  alone_calls, calls["prefills"] = calls["prefills"], 0
  together = _served(eng, params, list(range(len(PROMPTS))))
  assert together == alone
  assert (calls["prefills"], alone_calls) == (together_calls, one_each_calls)
