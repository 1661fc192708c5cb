"""The paged KV cache (kv_cache_layout=paged): the host page allocator, greedy decoding through
pages equal to the dense cache token for token (families, layouts, int8, sharding), one generate
compilation across page boundaries, every page back after release, the memory it saves, and
the bad-input errors. The Pallas TPU kernel path: an AOT compile for a TPU topology (slow)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.inference import paged_cache
from MaxText.inference.engine import Engine, Request, serve
from MaxText.layers import attention_kernels, gated_deltanet, kv_cache, paged_kv
from decode_test_utils import engine_tokens, one_device_mesh, uncached_greedy

TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=24, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
MIXED = dict(TINY, attention_layer_pattern=["local", "global"], sliding_window_size=4)
# MLA (compressed cache) with a dense first layer: the {"dense_layers", "layers"} cache stacks.
MLA = dict(TINY, decoder_block="deepseek3", base_num_query_heads=4, base_num_kv_heads=4, head_dim=12, base_mlp_dim=32,
           base_num_decoder_layers=2, attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6, num_experts=4, num_experts_per_tok=2, shared_experts=1,
           first_dense_layers=1, dense_mlp_dim=48)
# DeepSeek-V3.2: MLA with the indexer's keys in the rope-key pages; top-4 of up to 24 positions.
DSA = dict(MLA, decoder_block="deepseek32", index_topk=4, index_n_heads=2, index_head_dim=8)
CHUNKED = dict(TINY, base_num_kv_heads=4, attention_layer_pattern=["chunked", "global"], attention_chunk_size=4)
# Llama 4 Maverick's interleaved stack: dense and MoE layers alternate (the scanned periods carry two pools).
INTERLEAVED = dict(TINY, decoder_block="llama4", base_num_decoder_layers=4, num_experts=4, num_experts_per_tok=1,
                   moe_layer_interval=2, dense_mlp_dim=96, shared_experts=1, capacity_factor=-1.0,
                   mlp_activations=["silu", "linear"], attention_layer_pattern=["chunked", "global"],
                   attention_chunk_size=4)
# OLMo 3: outputs-only norms, QK-norm over all heads, 3 local : 1 global layers, YaRN on the global ones.
OLMO3 = dict(TINY, decoder_block="olmo3", base_num_decoder_layers=4, use_qk_norm=True, qk_norm_over_all_heads=True,
             attention_layer_pattern=["local", "local", "local", "global"], sliding_window_size=4,
             mlp_activations=["silu", "linear"], rope_type="yarn", rope_scaling_factor=4.0,
             rope_original_max_position=8, rope_local_max_timescale=10000)
# Gemma 4: global layers with their own head shape and k = v, the last 3 layers reading earlier layers' pages.
GEMMA4 = dict(TINY, decoder_block="gemma4", base_num_decoder_layers=6, attention_layer_pattern=["local", "local", "global"],
              sliding_window_size=4, global_head_dim=32, global_num_kv_heads=1, attention_k_eq_v=True, use_v_norm=True,
              num_kv_shared_layers=3, kv_shared_double_mlp=True, per_layer_input_dim=8, use_qk_norm=True,
              query_pre_attn_scalar=1.0, rope_type="proportional", rope_proportional_rotated_fraction=0.5,
              rope_scaling_factor=1.0, rope_local_max_timescale=10000, mlp_activations=["gelu", "linear"])
# Qwen3-Next: Gated DeltaNet and gated full attention alternate; the DeltaNet states are slot state, not pages.
QWEN3_NEXT = dict(TINY, decoder_block="qwen3_next", base_num_decoder_layers=4, full_attention_interval=2,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_conv_kernel_dim=4, linear_attention_chunk_size=4, attention_output_gate=True,
                  use_qk_norm=True, partial_rotary_factor=0.5, normalization_type="rms_plus_one",
                  prefix_caching=False)  # tests of prefix caching turn it on (its recurrent states: state_snapshots.py)
# Qwen3.5: the same stack as qwen3_5 (a dense MLP, as above) and as qwen3_5_moe (routed experts and a gated shared one).
QWEN3_5 = dict(QWEN3_NEXT, decoder_block="qwen3_5")
QWEN3_5_MOE = dict(QWEN3_NEXT, decoder_block="qwen3_5_moe", base_mlp_dim=32, num_experts=4, num_experts_per_tok=2,
                   shared_experts=1, shared_expert_gate=True)
PROMPTS = [[3, 9, 27], [1, 2, 3, 4, 5, 6, 7, 8], [100], [50, 60, 70, 80, 90], [7, 7]]
NEW_TOKENS = [9, 12, 16, 6, 10]


# ---------------------------------------------------------------- the allocator (host only)
def test_allocator_assigns_grows_at_page_boundaries_and_releases():
  pages = paged_cache.PageAllocator(num_pages=6, page_size=4, num_slots=2, max_length=10)
  assert pages.table.shape == (2, 3)  # ceil(10 / 4) pages per slot
  pages.assign(0, 5)  # positions 0..4: two pages
  assert pages.table[0].tolist() == [0, 1, -1] and pages.stats()["pages_used"] == 2
  for _ in range(3):  # pending tokens at 5, 6, 7: still page 1
    pages.grow(), pages.advance()
  assert pages.held(0) == 2
  pages.grow()  # position 8 starts page 2
  assert pages.table[0].tolist() == [0, 1, 2]
  pages.advance(), pages.advance()  # position 10 = max_length: never cached, no fourth page
  pages.grow()
  assert pages.held(0) == 3 and pages.positions[0] == 10
  pages.assign(1, 4)
  pages.release(0)
  assert pages.stats() == {"pages_total": 6, "pages_free": 5, "pages_used": 1, "pages_cached": 0, "page_size": 4}
  assert not pages.active[0] and (pages.table[0] == -1).all()
  pages.grow()  # slot 1's pending token (position 4) starts its second page; released slot 0 takes none
  assert pages.held(1) == 2 and pages.held(0) == 0 and pages.stats()["pages_used"] == 2


def test_allocator_out_of_pages_changes_nothing_and_reinsert_frees_the_old_pages():
  pages = paged_cache.PageAllocator(num_pages=3, page_size=2, num_slots=2, max_length=6)
  pages.assign(0, 4)
  before = pages.table.copy(), list(pages.free)
  with pytest.raises(paged_cache.OutOfPages, match="a prompt of 3 tokens needs 2 pages of 2 tokens, 1 are free"):
    pages.assign(1, 3)
  assert (pages.table == before[0]).all() and pages.free == before[1]
  pages.assign(0, 6)  # a new prompt in a busy slot reuses its pages: 3 fit although only 1 is free
  assert pages.held(0) == 3 and not pages.free
  pages.assign(0, 1)
  pages.assign(1, 2)
  pages.advance(), pages.advance()  # slot 0 at position 3 (needs page 1), slot 1 at 4 (needs page 2)
  with pytest.raises(paged_cache.OutOfPages, match="2 slots need a new page, 1 are free"):
    pages.grow()
  assert pages.held(0) == 1 and pages.held(1) == 1


# ---------------------------------------------------------------- decoding: paged == dense
def serve_both(overrides: dict, num_slots: int, kv_num_pages: int, page_size: int = 4, seed: int = 1):
  """serve() of the same requests through a dense and a paged engine: (dense, paged outputs, paged engine)."""
  dense = Engine(Config.for_testing(**overrides), num_slots=num_slots, mesh=one_device_mesh())
  params = dense.load_params(seed=seed)
  paged = Engine(Config.for_testing(**overrides, kv_cache_layout="paged", kv_page_size=page_size,
                                    kv_num_pages=kv_num_pages), num_slots=num_slots, mesh=one_device_mesh())
  requests = lambda: [Request(list(p), n) for p, n in zip(PROMPTS, NEW_TOKENS)]
  expected = [r.output for r in serve(dense, params, requests())]
  got = [r.output for r in serve(paged, params, requests())]
  return expected, got, paged, params


def check_paged_run(paged: Engine) -> None:
  per_layer = (paged_kv.PagedKVCache, gated_deltanet.LinearState)  # a DeltaNet layer's state is slot state
  pools = jax.tree.leaves(paged.state_shardings.caches, is_leaf=lambda x: isinstance(x, per_layer))
  assert any(isinstance(pool, paged_kv.PagedKVCache) for pool in pools)
  assert all(isinstance(pool, per_layer) for pool in pools)
  stats = paged.cache_stats()
  assert stats["pages_free"] == stats["pages_total"] and stats["pages_used"] == 0  # every page came back
  steps = {name: paged.traces[name] for name in ("prefill", "insert", "generate")}
  assert steps == {"prefill": 1, "insert": 1, "generate": 1}  # one program each, across page crossings


def test_paged_serve_equals_dense_with_windows_slot_reuse_and_waiting_for_pages():
  """Five requests of 1..8 prompt tokens through 3 slots, 4-token pages: generation crosses page
  boundaries and sliding windows; 10 pages (a third of the dense 3 x 6) make requests wait."""
  expected, got, paged, params = serve_both(dict(MIXED, scan_layers=False), num_slots=3, kv_num_pages=10)
  assert got == expected
  check_paged_run(paged)
  # Pages in use follow the tokens cached: 8 prompt tokens fill 2 pages, the first generated
  # token (position 8) takes a third; then out of pages at insert: a clear error, nothing taken.
  state = paged.init_decode_state()
  prefix = paged.prefill(params, [PROMPTS[1]])
  state = paged.insert(prefix, state, slot=0)
  assert paged.cache_stats()["pages_used"] == 2
  state, _ = paged.generate(params, state)
  assert paged.cache_stats()["pages_used"] == 3 and paged.pages.held(0) == 3
  paged.pages.free = paged.pages.free[:1]
  with pytest.raises(paged_cache.OutOfPages, match="a prompt of 8 tokens needs 2 pages of 4 tokens, 1 are free"):
    paged.insert(prefix, state, slot=1)
  assert paged.pages.held(1) == 0 and paged.pages.held(0) == 3


@pytest.mark.parametrize("overrides,scan_layers", [
    (dict(MLA, quantize_kvcache=True), True),
    pytest.param(MLA, False, marks=pytest.mark.slow),
    pytest.param(DSA, True, marks=pytest.mark.slow),
    pytest.param(dict(DSA, quantize_kvcache=True), False, marks=pytest.mark.slow),
    pytest.param(dict(CHUNKED, quantize_kvcache=True), False, marks=pytest.mark.slow),  # MHA, chunks, int8
    pytest.param(CHUNKED, True, marks=pytest.mark.slow),
    pytest.param(MIXED, True, marks=pytest.mark.slow),
    pytest.param(INTERLEAVED, True, marks=pytest.mark.slow),
    pytest.param(OLMO3, False, marks=pytest.mark.slow),
    pytest.param(GEMMA4, False, marks=pytest.mark.slow),
    pytest.param(QWEN3_NEXT, True, id="qwen3_next-True", marks=pytest.mark.slow),
    pytest.param(QWEN3_NEXT, False, id="qwen3_next-False", marks=pytest.mark.slow),
    pytest.param(QWEN3_5, False, id="qwen3_5-False", marks=pytest.mark.slow),
    pytest.param(QWEN3_5_MOE, True, id="qwen3_5_moe-True", marks=pytest.mark.slow),
])
def test_paged_serve_equals_dense_for_each_family(overrides, scan_layers):
  expected, got, paged, _ = serve_both(dict(overrides, scan_layers=scan_layers), num_slots=2, kv_num_pages=12,
                                       page_size=3)
  assert got == expected
  check_paged_run(paged)


@pytest.mark.parametrize("overrides,scan_layers,num_slots", [
    (TINY, False, 1), (TINY, True, 1), pytest.param(TINY, True, 4, marks=pytest.mark.slow),
    pytest.param(INTERLEAVED, True, 1, marks=pytest.mark.slow),
    pytest.param(QWEN3_NEXT, True, 2, id="qwen3_next-True-2", marks=pytest.mark.slow)])
def test_a_generate_step_works_in_memory_that_does_not_grow_with_the_pool(overrides, scan_layers, num_slots):
  """The attention reads only each slot's pages and the step writes the pool in place: its
  scratch memory is the same for the default pool and one 16 times larger (a pool-sized copy, as
  one slot's single-token write through a flattened pool made, shows up here)."""
  def temp_bytes(num_pages: int) -> int:
    config = Config.for_testing(**dict(overrides, max_target_length=64), scan_layers=scan_layers,
                                kv_cache_layout="paged", kv_page_size=4, kv_num_pages=num_pages)
    engine = Engine(config, num_slots=num_slots, mesh=one_device_mesh())
    params = sharding.with_shardings(engine.spec.abstract_params, engine.param_shardings)
    return engine.compile_step(params).memory_analysis().temp_size_in_bytes

  default_pages = num_slots * paged_cache.pages_per_slot(64, 4)
  assert temp_bytes(0) == temp_bytes(16 * default_pages)


def test_the_dense_layout_refuses_prefill_into_pages_in_one_line():
  """page_prefill.PagePrefill composes with either layout: with the dense one (no pages) each call refuses."""
  engine = Engine(Config.for_testing(**dict(TINY, max_target_length=32)), num_slots=2, mesh=one_device_mesh())
  assert not engine.prefills_into_pages and not engine.prefix_caching  # prefix_caching=auto: off without pages
  state = engine.init_decode_state()
  with pytest.raises(UserError, match="chunked prefill needs kv_cache_layout=paged"):
    engine.begin_prompt(0, [5, 6, 7])
  with pytest.raises(UserError, match="chunked prefill needs kv_cache_layout=paged"):
    engine.prefill_chunk(None, state, 0, [5, 6, 7], 0)
  assert not engine.slot(0).busy


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_the_step_compiles_ahead_of_time_with_either_layouts_table(layout):
  """compile_step takes the block table the layout gives (the dense one none): the rollouts' and AOT checks' path."""
  config = Config.for_testing(**dict(TINY, max_target_length=32), kv_cache_layout=layout, kv_page_size=4)
  engine = Engine(config, num_slots=2, mesh=one_device_mesh())
  params = sharding.with_shardings(engine.spec.abstract_params, engine.param_shardings)
  assert engine.compile_step(params).memory_analysis() is not None


@pytest.mark.slow  # ~30 s: 8 simulated devices
def test_sharded_paged_decode_equals_one_device():
  """tensor=2 x fsdp=4: the pools' kv heads split over tensor (pages replicated), tokens unchanged."""
  config = Config.for_testing(**MIXED, ici_tensor_parallelism=2, ici_fsdp_parallelism=4, kv_cache_layout="paged",
                              kv_page_size=4)
  prompts = PROMPTS[:4]
  single = Engine(config, num_slots=4, mesh=one_device_mesh())
  params = single.load_params(seed=2)
  sharded = Engine(config, num_slots=4)
  assert engine_tokens(sharded, jax.device_put(params, sharded.param_shardings), prompts, 12) == \
      engine_tokens(single, params, prompts, 12)
  pool_spec = sharded.state_shardings.caches.key_KPZH.spec  # [layers, kv heads, pages, page, head dim]
  assert pool_spec[1] == "tensor" and all(axis is None for axis in pool_spec[2:4])


# ---------------------------------------------------------------- memory and errors
def test_paged_memory_grows_with_cached_tokens_not_slots_times_length():
  """8 slots, max_target_length 256, prompts of 5..60 tokens with 20 new each: the pool sized for
  what is cached is a fraction of the dense slots x max_target_length."""
  overrides = dict(TINY, max_target_length=256, max_prefill_predict_length=64)
  lengths = [5, 60, 12, 33, 7, 48, 20, 9]
  page = 16
  pages_needed = sum(-(-(n + 20 - 1) // page) for n in lengths)
  dense = Engine(Config.for_testing(**overrides), num_slots=8).cache_stats()
  paged = Engine(Config.for_testing(**overrides, kv_cache_layout="paged", kv_page_size=page,
                                    kv_num_pages=pages_needed), num_slots=8).cache_stats()
  assert paged["pages_total"] == pages_needed == 25
  assert paged["cache_bytes"] < dense["cache_bytes"] / 4
  full = Engine(Config.for_testing(**overrides, kv_cache_layout="paged", kv_page_size=page), num_slots=8)
  assert full.cache_stats()["pages_total"] == 8 * 256 // page  # 0 = the dense capacity


@pytest.mark.parametrize("overrides,message", [
    (dict(kv_cache_layout="ragged"), "kv_cache_layout must be one of dense, paged; got 'ragged'"),
    (dict(kv_page_size=0), "kv_page_size must be >= 1, got 0"),
    (dict(kv_num_pages=-1), "kv_num_pages must be >= 0"),
    # Past int32 cache indices: serve sized a [slots, pages] host table first (a numpy MemoryError traceback).
    (dict(serve_max_slots=10**9), r"serve_max_slots 1000000000 x max_target_length \d+ = .* cache positions, over the "
                                  r"2\*\*31 this project accepts: lower serve_max_slots"),
    (dict(kv_num_pages=10**14), r"kv_num_pages 100000000000000 x kv_page_size \d+ = .* over the 2\*\*31"),
    # A chunk budget past every slot's tokens sized a [1, chunk] host array at the first chunked prefill.
    (dict(kv_cache_layout="paged", prefill_chunk_size=10**12),
     r"prefill_chunk_size=1000000000000 is more than the \d+ prompt tokens serve_max_slots x max_target_length"),
    # kv_num_pages=0 (the dense capacity) is a page a slot at least: decode died in a RESOURCE_EXHAUSTED traceback.
    (dict(kv_cache_layout="paged", kv_page_size=2**30),
     r"kv_page_size=1073741824 makes the paged cache \d+ pages x 1073741824 = .* over the 2\*\*31 .* lower kv_page_size$"),
    # A negative slot count passed the products and blamed prefill_chunk_size=0.
    (dict(serve_max_slots=-1), r"^serve_max_slots must be >= 1, got -1$"),
])
def test_bad_paged_keys_are_config_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(**TINY, **overrides)


def test_too_few_pages_for_one_request_is_a_clear_error():
  config = Config.for_testing(**TINY, kv_cache_layout="paged", kv_page_size=4, kv_num_pages=5)
  with pytest.raises(UserError, match=r"kv_num_pages=5 cannot hold one request at max_target_length=24 \(6 pages"):
    Engine(config, num_slots=2, mesh=one_device_mesh())


def test_a_large_page_pool_costs_the_host_no_list_of_its_pages():
  """kv_num_pages=10**9 made the allocator a Python list of every page number (tens of GiB): the process was killed
  before its cache was allocated. The free list still hands the pages out in that list's order."""
  import tracemalloc

  tracemalloc.start()
  try:
    big = paged_cache.PageAllocator(num_pages=10**7, page_size=2, num_slots=2, max_length=8)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 10**8  # its reference counts, 40 MB; the list took 360 MB more
  assert len(big.free) == 10**7 and big.available() == 10**7
  small, listed = (paged_cache.PageAllocator(num_pages=6, page_size=2, num_slots=2, max_length=8) for _ in range(2))
  listed.free = list(range(5, -1, -1))  # as it was
  for pages in (small, listed):
    pages.assign(0, 5), pages.assign(1, 3)
    pages.release(0)
    pages.assign(0, 6)
    pages.grow()  # position 6 starts a fourth page
  assert small.table.tolist() == listed.table.tolist() == [[0, 1, 2, 5], [3, 4, -1, -1]]
  assert list(small.free) == listed.free == [] and small.available() == 0


def test_a_kv_cache_too_large_to_allocate_is_one_line(monkeypatch):
  """kv_num_pages=1000000000 (kv_page_size=2, under the int32 bound): decode died in a RESOURCE_EXHAUSTED traceback.
  The allocation failure stands in for a real one (a large one may succeed lazily and get the process killed)."""
  for layout, keys in (("paged", "kv_num_pages or kv_page_size"), ("dense", "serve_max_slots or max_target_length")):
    engine = Engine(Config.for_testing(**TINY, kv_cache_layout=layout), num_slots=2, mesh=one_device_mesh())

    def exhausted(*args, **kwargs):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 255999999488 bytes.")

    monkeypatch.setattr(engine, "_init_state", exhausted)
    with pytest.raises(UserError, match=rf"^the {layout} KV cache of 2 slots needs [\d.e-]+ GiB, more than the devices "
                                        rf"could allocate: lower {keys}$"):
      engine.init_decode_state()


def test_dense_release_is_a_no_op_and_reports_no_pages():
  engine = Engine(Config.for_testing(**TINY), num_slots=2, mesh=one_device_mesh())
  engine.release(1)
  assert engine.cache_stats()["pages_total"] == 0 and engine.cache_stats()["layout"] == "dense"
  with pytest.raises(ValueError, match="slot 2 out of range"):
    engine.release(2)


# ---------------------------------------------------------------- the TPU kernel path
def filled_pool(quantized: bool) -> paged_kv.PagedKVCache:
  """3 slots over scattered pages of 8 tokens, 2 kv heads of 128; keys/values exact in bfloat16
  (the kernel computes in bfloat16)."""
  slots, pages_per_slot, page, width = 3, 4, 8, 128
  pool = paged_kv.empty_pool(10, page, 2, width, jnp.float32, slots, pages_per_slot, quantized)
  table = np.full((slots, pages_per_slot), -1, np.int32)
  table[0, :2], table[1, :], table[2, :1] = [3, 7], [0, 9, 2, 5], [8]
  pool = dataclasses.replace(pool, block_table_BM=jnp.asarray(table))
  shape = (slots, pages_per_slot * page, 2, width)
  k, v = (jax.random.normal(jax.random.key(i), shape).astype(jnp.bfloat16).astype(jnp.float32) for i in (1, 2))
  with sharding.unsharded():
    return kv_cache.write(pool, k, v, jnp.broadcast_to(jnp.arange(shape[1]), shape[:2]))


@pytest.mark.parametrize("quantized,soft_cap", [(False, 5.0), pytest.param(True, 0.0, marks=pytest.mark.slow)])
def test_tpu_paged_kernel_equals_the_reference_in_interpret_mode(quantized, soft_cap):
  """The Pallas TPU kernel, run by Pallas' TPU interpreter on CPU, against the gather reference:
  GQA (4 query heads on 2 kv heads), slots of 13, 31 and 6 tokens over scattered pages."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  pool = filled_pool(quantized)
  q = jax.random.normal(jax.random.key(3), (3, 1, 4, 128))
  positions = jnp.asarray([[12], [30], [5]])
  expected = attention_kernels.paged_attention(q, pool, positions, soft_cap=soft_cap)
  with pltpu.force_tpu_interpret_mode(), sharding.unsharded():
    got = paged_kv.tpu_paged_attention(q, pool, positions, soft_cap)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=0)


@pytest.mark.slow  # ~15 s: libtpu compiles for a TPU topology on CPU
@pytest.mark.parametrize("topology,tensor,quantized,head_dim,kernels", [
    ("v5e-1", 1, True, 128, 1), ("v5e-4", 2, False, 128, 1), ("v5e-1", 1, False, 64, 0)])
def test_paged_generate_compiles_for_tpu_with_the_pallas_kernel(topology, tensor, quantized, head_dim, kernels):
  """AOT: the paged generate step lowers to the Pallas paged-attention kernel (one custom call in
  the scanned layer) and compiles for a TPU topology, kv heads split over tensor under shard_map;
  a head dim of 64, which the kernel's blocks cannot tile, takes the gather reference instead."""
  pytest.importorskip("libtpu")
  from MaxText.platform import accelerators
  from MaxText.startup import describe_topology
  tpu = accelerators.tpu_topology(topology)
  config = Config.for_testing(tpu.target(1), **dict(TINY, base_emb_dim=256, head_dim=head_dim, max_target_length=256,
                                                    dtype="bfloat16"),
                              kv_cache_layout="paged", kv_page_size=16, quantize_kvcache=quantized,
                              ici_tensor_parallelism=tensor, ici_fsdp_parallelism=-1)
  engine = Engine(config, num_slots=8, mesh=sharding.create_mesh(config.mesh, describe_topology(tpu, 1)))
  params = sharding.with_shardings(engine.spec.abstract_params, engine.param_shardings)
  state = sharding.with_shardings(jax.eval_shape(engine._init_state_fn, jnp.uint32(0)), engine.state_shardings)
  table = jax.ShapeDtypeStruct(engine.pages.table.shape, jnp.int32, sharding=sharding.replicated(engine.mesh))
  with sharding.activation_sharding(engine.mesh, engine.rules):
    lowered = engine._generate.lower(params, state, table)
  assert lowered.as_text().count("paged_flash_attention_kernel") == kernels
  lowered.compile()
  assert engine.state_shardings.caches.key_KPZH.spec[1] == (None if tensor == 1 else "tensor")


# ---------------------------------------------------------------- chunked prefill
def _scheduled_outputs(engine: Engine, params, prompts, new_tokens, cancel_second: bool = False,
                       loads: list | None = None) -> list[list[int]]:
  """Each job's tokens through the server's scheduler (greedy); with cancel_second, job 1 is
  cancelled as soon as it is submitted (it may be waiting, prefilling or running)."""
  import threading

  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  class Sink:
    def __init__(self):
      self.tokens, self.done = [], threading.Event()

    def __call__(self, event):
      if isinstance(event, sched.Tokens):
        self.tokens += event.tokens
      elif isinstance(event, sched.Done):
        self.done.set()

  runner = sched.Scheduler(engine, params, max_queue=16).start()
  try:
    sinks = [Sink() for _ in prompts]
    jobs = [sched.Job(0, list(p), n, RowParams(), sink) for p, n, sink in zip(prompts, new_tokens, sinks)]
    runner.submit(jobs)
    if cancel_second:
      jobs[1].cancel()
    for sink in sinks:
      assert sink.done.wait(120)
    load = runner.load()
    assert load["pages_reserved"] == 0 and load["pages_free"] == load["pages_total"], load
    if loads is not None:
      loads.append(load)
    return [sink.tokens for sink in sinks]
  finally:
    runner.stop(10)


@pytest.mark.parametrize("overrides,scan_layers", [
    (MIXED, True), pytest.param(MLA, False, marks=pytest.mark.slow), pytest.param(DSA, True, marks=pytest.mark.slow),
    pytest.param(CHUNKED, True, marks=pytest.mark.slow), pytest.param(QWEN3_NEXT, True, id="qwen3_next-True", marks=pytest.mark.slow)])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(overrides, scan_layers):
  """Prompts prefilled 3 tokens per scheduler loop straight into their pages, between the other
  slots' generate steps, give the same greedy tokens as whole-prompt prefills; every page comes
  back, also from a job cancelled while it waits or prefills."""
  config = dict(overrides, scan_layers=scan_layers, kv_cache_layout="paged", kv_page_size=3, kv_num_pages=16)
  whole = Engine(Config.for_testing(**config), num_slots=2, mesh=one_device_mesh())
  params = whole.load_params(seed=1)
  chunked = Engine(Config.for_testing(**config, prefill_chunk_size=3), num_slots=2, mesh=one_device_mesh())
  expected = _scheduled_outputs(whole, params, PROMPTS, NEW_TOKENS)
  assert _scheduled_outputs(chunked, params, PROMPTS, NEW_TOKENS) == expected
  assert chunked.traces["extend"] == 1 and chunked.traces["prefill"] == 0  # one program for every chunk
  got = _scheduled_outputs(chunked, params, PROMPTS, NEW_TOKENS, cancel_second=True)
  assert [g for i, g in enumerate(got) if i != 1] == [e for i, e in enumerate(expected) if i != 1]


@pytest.mark.slow
def test_a_model_of_only_gated_deltanet_layers_decodes_like_its_uncached_forward():
  """attention_type=gated_deltanet on every layer: no KV cache at all, only the layers' slot states,
  in both layouts (the paged engine then holds no pages)."""
  config = dict(QWEN3_NEXT, full_attention_interval=0, attention_type="gated_deltanet", base_num_decoder_layers=2)
  prompts = PROMPTS[:2]
  for layout in ({}, dict(kv_cache_layout="paged", kv_page_size=4, kv_num_pages=16)):
    engine = Engine(Config.for_testing(**config, **layout), num_slots=2, mesh=one_device_mesh())
    params = engine.load_params(seed=1)
    expected = [uncached_greedy(engine.spec, params, p, 10, TINY["max_target_length"]) for p in prompts]
    assert engine_tokens(engine, params, prompts, 10) == expected, layout


def test_prefill_chunk_size_needs_the_paged_cache():
  with pytest.raises(ConfigError, match="prefill_chunk_size=4 needs kv_cache_layout=paged"):
    Config.for_testing(**TINY, prefill_chunk_size=4)


# ---------------------------------------------------------------- prefix caching
def test_the_allocator_shares_full_prefix_pages_keeps_them_when_unheld_and_evicts_the_oldest():
  pages = paged_cache.PageAllocator(num_pages=6, page_size=2, num_slots=3, max_length=8, prefix_caching=True)
  first, second = [1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 9]
  assert pages.assign(0, len(first), active=False, prompt=first) == 0  # nothing indexed yet
  pages.activate(0, first)  # its two full pages [1, 2], [3, 4] are indexed
  assert pages.assign(1, len(second), active=False, prompt=second) == 4
  assert pages.table[1, :2].tolist() == pages.table[0, :2].tolist() and pages.refs[pages.table[0, :2]].tolist() == [2, 2]
  assert pages.stats()["pages_used"] == 3 + 2  # 3 for the first prompt, 2 more of the second's 4
  # A prompt that is all cached full pages still computes its last page (its last token's logits).
  assert pages.assign(2, 4, active=False, prompt=[1, 2, 3, 4]) == 2
  for slot in (0, 1, 2):
    pages.release(slot)
  stats = pages.stats()
  assert stats["pages_free"] == 6 and stats["pages_cached"] == 2 and not pages.refs.any()
  assert pages.assign(0, 5, prompt=first) == 4  # found again after everyone left
  pages.release(0)
  # Free pages go first; then the unheld indexed ones are evicted, and are not matched any more.
  assert pages.assign(1, 8, prompt=[7] * 8) == 0 and pages.stats()["pages_cached"] == 2
  assert pages.assign(2, 4, prompt=[8] * 4) == 0 and pages.stats()["pages_cached"] == 0
  pages.release(1)
  pages.release(2)
  assert pages.assign(0, 5, prompt=first) == 0  # evicted: computed again


def test_state_snapshots_reuse_the_least_recently_used_row_but_never_a_pinned_one():
  """The recurrent states kept at page boundaries (inference/state_snapshots.py): a boundary keeps its row, a new
  one takes a free row, then the least recently used; a row a prompt will restore from is not reused until it
  has been, and with every row pinned nothing is kept."""
  from MaxText.inference.state_snapshots import SnapshotIndex

  index = SnapshotIndex(2)
  assert index.reserve(b"a") == 0 and index.reserve(b"b") == 1 and index.reserve(b"a") == 0
  assert index.lookup(b"a") == 0  # now b is the least recently used
  assert index.reserve(b"c") == 1 and not index.has(b"b") and index.has(b"a")
  index.pin(0)
  assert index.reserve(b"d") == 1 and index.has(b"a")  # c's row, not the pinned one
  index.pin(1)
  assert index.reserve(b"e") is None and len(index) == 2
  index.unpin(0)
  assert index.reserve(b"e") == 0 and not index.has(b"a")


@pytest.mark.parametrize("family,scan_layers,num_pages", [
    ("mixed", True, 24), pytest.param("mixed", False, 12, marks=pytest.mark.slow),
    pytest.param("qwen3_next", True, 24, marks=pytest.mark.slow),
    pytest.param("qwen3_next_chunked", False, 24, marks=pytest.mark.slow)])
def test_prefix_caching_gives_the_same_tokens_and_shares_the_prefix_pages(family, scan_layers, num_pages):
  """Requests sharing a 12-token prefix (4 pages of 3) with different tails: identical greedy
  tokens with and without prefix caching, the shared prefix's pages reused by later requests;
  with a pool too small to keep it (12 pages), eviction changes no answer; afterwards no page
  is held. Qwen3-Next's Gated DeltaNet layers restart from their states kept at the page boundary where
  the shared part ends (inference/state_snapshots.py): at the prompt's last page boundary, or, prefilled in
  chunks of 2 pages, at every chunk's end."""
  prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
  prompts = [prefix + tail for tail in ([1], [2, 3], [4, 5, 6, 7], [1], [8, 9])]
  new_tokens = [4, 3, 5, 4, 2]
  base = {"mixed": MIXED, "qwen3_next": QWEN3_NEXT, "qwen3_next_chunked": dict(QWEN3_NEXT, prefill_chunk_size=6)}[family]
  config = dict(base, scan_layers=scan_layers, kv_cache_layout="paged", kv_page_size=3, kv_num_pages=num_pages,
                max_target_length=32, max_prefill_predict_length=16)
  config.pop("prefix_caching", None)
  plain = Engine(Config.for_testing(**config, prefix_caching=False), num_slots=2, mesh=one_device_mesh())
  params = plain.load_params(seed=1)
  cached = Engine(Config.for_testing(**config, prefix_caching=True), num_slots=2, mesh=one_device_mesh())
  assert plain.prefills_into_pages is (family == "qwen3_next_chunked") and cached.prefills_into_pages is True
  assert (cached.page_prefill.snapshots is not None) is family.startswith("qwen3_next")
  expected = _scheduled_outputs(plain, params, prompts, new_tokens)
  loads: list = []
  assert _scheduled_outputs(cached, params, prompts, new_tokens, loads=loads) == expected
  assert cached.pages.stats()["pages_used"] == 0 and not cached.pages.refs.any()
  if num_pages == 24:  # room to keep the prefix: every request after the first two finds it
    assert loads[0]["prefix_cached_tokens"] >= 3 * len(prefix)


def _two_sharing_requests(num_pages: int, prefix_caching: bool = True):
  """Two requests with one 13-token prompt (4 full pages of 3) and 4 new tokens each, submitted
  together to a scheduler over a pool of `num_pages`: (the events in order as (job, kind), the
  load afterwards, the engine, the tokens of each)."""
  import threading

  from MaxText.inference import scheduler as sched
  from MaxText.inference.sampling import RowParams

  prompt = list(range(20, 33))
  config = dict(MIXED, kv_cache_layout="paged", kv_page_size=3, max_target_length=18, max_prefill_predict_length=16)
  engine = Engine(Config.for_testing(**config, kv_num_pages=num_pages, prefix_caching=prefix_caching), num_slots=2,
                  mesh=one_device_mesh())
  params = engine.load_params(seed=1)
  events, tokens, lock, done = [], ([], []), threading.Lock(), [threading.Event(), threading.Event()]

  def sink(i):
    def emit(event):
      with lock:
        events.append((i, type(event).__name__))
      if isinstance(event, sched.Tokens):
        tokens[i].extend(event.tokens)
      if isinstance(event, sched.Done):
        done[i].set()
    return emit

  runner = sched.Scheduler(engine, params, max_queue=4).start()
  try:
    runner.submit([sched.Job(0, list(prompt), 4, RowParams(), sink(0)), sched.Job(1, list(prompt), 4, RowParams(),
                                                                                     sink(1))])
    assert all(d.wait(120) for d in done)
    return events, runner.load(), engine, tokens
  finally:
    runner.stop(10)


def test_admission_counts_a_shared_prefix_page_once():
  """Each request holds 6 pages at its end: 12 counted apart, 8 with the 4 shared pages once. A
  pool of 9 runs them together (the second starts before the first ends) with the tokens of a
  pool big enough for both without sharing; afterwards every page is free again."""
  expected = _two_sharing_requests(24, prefix_caching=False)[3]
  events, load, engine, tokens = _two_sharing_requests(9)
  assert tokens == expected
  assert events.index((1, "Tokens")) < events.index((0, "Done")), events  # admitted beside the first
  assert load["pages_reserved"] == 0 and load["pages_free"] == 9 and not engine.pages.refs.any(), load
  assert load["pages_cached"] == 4


def test_admission_still_waits_when_the_shared_pages_do_not_make_room():
  """The same two requests in a pool of 7: 8 pages even counted once, so the second waits until the first gives its
  pages back, when its last call is dispatched (before that call's token is read), and gets the same tokens though
  that call still writes the first's last entry into a page the second may take."""
  events, load, engine, tokens = _two_sharing_requests(7)
  assert events[:events.index((1, "Tokens"))].count((0, "Tokens")) == 3, events
  assert tokens == _two_sharing_requests(24, prefix_caching=False)[3]
  assert load["pages_reserved"] == 0 and load["pages_free"] == 7 and not engine.pages.refs.any(), load
