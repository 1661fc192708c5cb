"""The attention kernels in one table: for a kernel name (the `attention=` values, context
parallelism's per-block kernels, the paged decode kernel) and a platform family, the
implementations that may run, each with what it supports; the first that supports the call runs.

Every whole-sequence implementation has the signature of `dot_product_attention`:
`kernel(q_BLNH (pre-scaled), k_BSKH, v_BSKH, segment_ids_BL, window_size, soft_cap) -> out_BLNH`,
with the same mask (masks.py): causal, same segment, and with a window, at most window_size - 1
tokens back. dot_product and the chunked flash kernel (flash_blocks.py) also take `sinks_N`
(attention sinks, GPT-OSS); splash (splash_attention.py) and cuDNN do not
(getting_started/Attention.md). The per-chunk-pair kernels of the ring are ring_blocks.py's.

To add a kernel: its code in its own module, one `Implementation` entry in IMPLEMENTATIONS, and
its name in the routes below (KERNELS, CONTEXT_PARALLEL, AUTOSELECT) where it should run.

Legend: B batch, L query length, S key length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal

import jax

from MaxText.platform import accelerators, sharding
from MaxText.errors import ConfigError
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import flash_blocks, masks, paged_kv, ring_blocks, splash_attention

Array = jax.Array
AttentionKernel = Callable[..., jax.Array]  # (q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window_size, soft_cap)
# CPU: dot_product is at least as fast up to this many tokens, flash faster beyond (the figures:
# benchmarks/attention_bench.py, getting_started/Attention.md).
AUTOSELECT_CPU_FLASH_ABOVE = 512


def dot_product_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                          window_size: masks.Window = None, soft_cap: float = 0.0, chunk_size: masks.Window = None,
                          positions_BL: jax.Array | None = None, sinks_N: jax.Array | None = None,
                          image_blocks_BL: jax.Array | None = None) -> jax.Array:
  """Plain XLA attention with the mask of masks.py; queries must already be scaled. The only
  kernel with chunked attention (`chunk_size`, cut at `positions_BL`) and with bidirectional
  image blocks (`image_blocks_BL`). `sinks_N`: attention sinks (masks.dense_attention)."""
  mask_BLL = masks.self_mask(segment_ids_BL, window_size, chunk_size, positions_BL, image_blocks_BL)
  return masks.dense_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLL, soft_cap, sinks_N)


# ---------------------------------------------------------------- cuDNN (GPU)

def cudnn_flash_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                          window_size: masks.Window = None, soft_cap: float = 0.0,
                          implementation: Literal["xla", "cudnn"] = "cudnn", document_mask: bool = True) -> jax.Array:
  """cuDNN flash attention through jax.nn.dot_product_attention. `implementation="xla"` runs the
  same arguments through XLA (how the argument mapping is tested off GPU). `document_mask=False`
  (rows that each hold one full-length document) leaves the segment ids out: with a static window
  cuDNN then runs its causal kernel alone, without reading a [B, 1, L, S] bias."""
  if soft_cap > 0:
    raise ConfigError(f"attention=cudnn_flash does not support attn_logits_soft_cap={soft_cap} (cuDNN has no "
                      "logit soft cap); use attention=flash")
  # Packing: keys of other documents are masked with a [B, 1, L, S] mask (cuDNN adds it as a bias);
  # a static window goes to cuDNN as bounds, a traced one (mixed local/global stack) into the mask.
  local_window = None
  if isinstance(window_size, int):
    local_window = masks.local_window_bounds(window_size)
  mask_window = None if masks.is_static(window_size) else window_size
  mask_B1LS = None
  if document_mask or mask_window is not None:  # a traced window still needs its mask
    mask_B1LS = masks.self_mask(segment_ids_BL, mask_window)[:, None]
  return jax.nn.dot_product_attention(q_BLNH, k_BSKH, v_BSKH, mask=mask_B1LS, scale=1.0, is_causal=True,
                                      local_window_size=local_window, implementation=implementation)


def cudnn_supports(cfg: ModelConfig) -> bool:
  """Whether cuDNN flash attention covers this model (else autoselected uses flash on GPU)."""
  return (cfg.attn.attn_logits_soft_cap == 0 and cfg.dtype in ("bfloat16", "float16")
          and cfg.head_dim <= 128 and cfg.head_dim % 8 == 0)


# ---------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Call:
  """What a call site knows when it picks: the model, the tokens attended at once (the sequence,
  or one chunk of a context-parallel pair), the layer's window (static, or traced in a stack
  mixing local and global layers) and soft cap; `interpret` runs Pallas kernels in the
  interpreter (tests on CPU)."""
  cfg: ModelConfig
  length: int
  window: masks.Window = None
  soft_cap: float = 0.0
  interpret: bool = False


def _static_window(window: masks.Window) -> bool:
  return window is None or isinstance(window, int)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One attention implementation: the families it runs on, whether it covers a call, and its
  kernels: `sequence` over a whole sequence on one device, `pair` for a context-parallel chunk
  pair (ring_blocks.BlockKernel), if it has one. `single_device`: a Mosaic kernel XLA does not
  partition, run per shard under shard_map. `sinks`: takes attention sinks. `needs`: what a
  platform lacking it lacks, for the error line."""
  families: tuple[str, ...]
  supports: Callable[[Call], bool]
  sequence: Callable[[Call], AttentionKernel]
  pair: Callable[[Call], ring_blocks.BlockKernel] | None = None
  single_device: bool = False
  sinks: bool = False
  needs: str = ""


def _always(call: Call) -> bool:
  return True


def _splash_supports(call: Call) -> bool:
  """Its tiles divide the length, and a traced window is the config's local window."""
  return (splash_attention.tiles(call.cfg.attn.attention_blocks, call.length)
          and (_static_window(call.window) or bool(call.cfg.attn.sliding_window_size)))


def _splash_sequence(call: Call) -> AttentionKernel:
  return functools.partial(splash_attention.splash_attention, blocks=call.cfg.attn.attention_blocks,
                           local_window=call.cfg.attn.sliding_window_size, interpret=call.interpret)


def _splash_pair(call: Call) -> ring_blocks.BlockKernel:
  static = _static_window(call.window)
  window = call.window if static else call.cfg.attn.sliding_window_size
  assert window is None or isinstance(window, int)
  return ring_blocks.SplashBlocks(float(call.soft_cap), call.cfg.attn.attention_blocks, window, traced_window=not static,
                                  interpret=call.interpret)


def _cudnn_sequence(call: Call) -> AttentionKernel:
  if call.cfg.attn.rows_hold_one_document:
    return functools.partial(cudnn_flash_attention, document_mask=False)
  return cudnn_flash_attention


def _cudnn_pair(call: Call) -> ring_blocks.BlockKernel:
  return ring_blocks.CudnnBlocks(call.window if isinstance(call.window, int) else None)


def _chunked_sequence(call: Call) -> AttentionKernel:
  blocks = call.cfg.attn.attention_blocks

  def chunked(q_BLNH: Array, k_BSKH: Array, v_BSKH: Array, segment_ids_BL: Array, window_size: masks.Window = None,
              soft_cap: float = 0.0, sinks_N: Array | None = None) -> Array:
    return flash_blocks.flash_attention_with_offset(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, segment_ids_BL,
                                                    window_size, soft_cap, 0, block_q=blocks.flash_block_q,
                                                    block_kv=blocks.flash_block_kv, sinks_N=sinks_N)

  return chunked


def _chunked_pair(call: Call) -> ring_blocks.BlockKernel:
  blocks = call.cfg.attn.attention_blocks
  return ring_blocks.ChunkedBlocks(float(call.soft_cap), blocks.flash_block_q, blocks.flash_block_kv)


IMPLEMENTATIONS: dict[str, Implementation] = {
    "splash": Implementation(("tpu",), _splash_supports, _splash_sequence, _splash_pair, single_device=True,
                             needs="a TPU (Pallas Mosaic)"),
    "cudnn": Implementation(("gpu",), lambda call: cudnn_supports(call.cfg) and not call.soft_cap,
                            _cudnn_sequence, _cudnn_pair, needs="an NVIDIA GPU (cuDNN)"),
    "chunked": Implementation(accelerators.FAMILIES, _always, _chunked_sequence, _chunked_pair, sinks=True),
    "dot_product": Implementation(accelerators.FAMILIES, _always, lambda call: dot_product_attention, sinks=True),
}

# (attention=, family) -> the implementation of the layer's kernel on that family.
KERNELS: dict[tuple[str, str], str] = {
    **{("dot_product", family): "dot_product" for family in accelerators.FAMILIES},
    ("flash", "tpu"): "splash", ("flash", "gpu"): "chunked", ("flash", "cpu"): "chunked",
    ("cudnn_flash", "gpu"): "cudnn",
}
# family -> context parallelism's kernels (the ring's and all_gather's per chunk pair, all_to_all's
# over the whole sequence), in order of preference.
CONTEXT_PARALLEL: dict[str, tuple[str, ...]] = {
    "tpu": ("splash", "chunked"), "gpu": ("cudnn", "chunked"), "cpu": ("chunked",)}


def _long_sequence(call: Call | None) -> bool:
  return call is not None and call.length > AUTOSELECT_CPU_FLASH_ABOVE


# family -> attention=autoselected's candidates in order: (name, when it is worth it); the first
# worth it whose implementation supports the model runs (without a model: the first worth it).
AUTOSELECT: dict[str, tuple[tuple[str, Callable[[Call | None], bool]], ...]] = {
    "tpu": (("flash", lambda call: True), ("dot_product", lambda call: True)),
    "gpu": (("cudnn_flash", lambda call: True), ("flash", lambda call: True)),
    "cpu": (("flash", _long_sequence), ("dot_product", lambda call: True)),
}


def _known(family: str) -> str:
  """Any other backend runs what CPU runs."""
  return family if family in accelerators.FAMILIES else "cpu"


def implementation(name: str, platform: str) -> Implementation:
  """What attention=`name` runs on `platform`; one ConfigError line when the platform lacks it."""
  family = _known(accelerators.platform_family(platform))
  chosen = KERNELS.get((name, family))
  if chosen is None:
    needs = next(IMPLEMENTATIONS[impl].needs for (kernel, _), impl in KERNELS.items() if kernel == name)
    raise ConfigError(f"attention={name} needs {needs} but this program is for {platform}; "
                      "use attention=flash or autoselected")
  return IMPLEMENTATIONS[chosen]


def autoselect(platform: str, cfg: ModelConfig | None) -> str:
  """The attention= name autoselected runs on `platform` for `cfg` (AUTOSELECT)."""
  family = _known(accelerators.platform_family(platform))
  call = None if cfg is None else Call(cfg, cfg.max_target_length, soft_cap=cfg.attn.attn_logits_soft_cap)
  candidates = AUTOSELECT[family]
  for name, worth in candidates:
    if worth(call) and (call is None or implementation(name, family).supports(call)):
      return name
  return candidates[-1][0]


def context_parallel_implementation(call: Call, platform: str) -> Implementation:
  """The first of CONTEXT_PARALLEL's implementations on `platform` that supports `call`."""
  family = _known(accelerators.platform_family(platform))
  return next(IMPLEMENTATIONS[name] for name in CONTEXT_PARALLEL[family] if IMPLEMENTATIONS[name].supports(call))


def block_kernel(cfg: ModelConfig, platform: str, chunk: int, window: masks.Window, soft_cap: float, *,
                 interpret: bool = False) -> ring_blocks.BlockKernel:
  """The ring's (and all_gather's) pair kernel for `chunk`-token chunks: splash on TPU where its
  tiles divide the chunk, cuDNN on GPU where it covers the model (no soft cap), else the chunked
  kernel. `window` is the layer's window (static, or traced for a stack mixing local and global
  layers: splash then needs sliding_window_size)."""
  call = Call(cfg, chunk, window, soft_cap, interpret)
  make = context_parallel_implementation(call, platform).pair
  assert make is not None  # every CONTEXT_PARALLEL implementation has one
  return make(call)


def full_sequence_kernel(cfg: ModelConfig, platform: str, length: int, *, interpret: bool = False) -> AttentionKernel:
  """all_to_all's local kernel over the whole sequence of `length` tokens, (q_BSNH, k_BSKH, v_BSKH,
  seg_BS, window, soft_cap) -> out: splash on TPU where its tiles divide the length, cuDNN on GPU
  where it covers the model, else the chunked kernel."""
  call = Call(cfg, length, soft_cap=cfg.attn.attn_logits_soft_cap, interpret=interpret)
  return context_parallel_implementation(call, platform).sequence(call)


# ---------------------------------------------------------------- sparse attention (DeepSeek-V3.2)

# The gathered form pays once the keys outnumber each query's chosen ones by this factor (it
# gathers T rows per query and attends in the [R + P]-wide absorbed form; the masked form scores
# every key): benchmarks/sparse_attention_bench.py, getting_started/Models.md.
SPARSE_GATHER_ABOVE = 4


def _gather_pays(keys: int, topk: int) -> bool:
  return keys > SPARSE_GATHER_ABOVE * topk


# family -> DeepSeek Sparse Attention's forms (layers/sparse_attention.py) in order: (name, when it
# is worth it for (key length, index_topk)). No Pallas kernel yet: both forms are XLA everywhere.
SPARSE: dict[str, tuple[tuple[str, Callable[[int, int], bool]], ...]] = {
    family: (("gathered", _gather_pays), ("masked", lambda keys, topk: True)) for family in accelerators.FAMILIES}


def sparse_kernel(keys: int, topk: int, platform: str | None = None) -> str:
  """The sparse-attention form (masked | gathered) for `keys` keys and `topk` chosen per query on
  `platform` (default: the traced program's)."""
  family = _known(accelerators.platform_family(platform or sharding.trace_platform()))
  return next(name for name, worth in SPARSE[family] if worth(keys, topk))


# family -> Gated DeltaNet's forms (layers/gated_delta_rule.py) in order: (name, whether it serves a
# call of `tokens` tokens, `cached`: with a decode cache's state). One token with a state steps the
# recurrence; anything longer (training, prefill) takes the chunked form, whose in-chunk work is
# matmuls XLA already maps onto the MXU / tensor cores, leaving only the scan across chunks serial.
# No Pallas kernel yet: one would keep the [Q, W] state on chip across chunks instead of a scan
# carry, but no accelerator measurement here says what that is worth.
LINEAR: dict[str, tuple[tuple[str, Callable[[int, bool], bool]], ...]] = {
    family: (("recurrent", lambda tokens, cached: cached and tokens == 1), ("chunked", lambda tokens, cached: True))
    for family in accelerators.FAMILIES}


def linear_attention_form(tokens: int, cached: bool, platform: str | None = None) -> str:
  """The gated delta rule's form (recurrent | chunked) for a call of `tokens` tokens, with or without
  a decode cache's state, on `platform` (default: the traced program's)."""
  family = _known(accelerators.platform_family(platform or sharding.trace_platform()))
  return next(name for name, serves in LINEAR[family] if serves(tokens, cached))


# ---------------------------------------------------------------- paged decode attention


@dataclasses.dataclass(frozen=True)
class PagedCall:
  cache: paged_kv.PagedKVCache
  q_BLNH: Array
  window_size: masks.Window
  chunk_size: masks.Window
  sinks_N: Array | None


# (q_BLNH, cache, positions_BL, window_size, soft_cap, chunk_size, sinks_N) -> out_BLNH
PagedKernel = Callable[[Array, paged_kv.PagedKVCache, Array, masks.Window, float, masks.Window, Array | None], Array]


@dataclasses.dataclass(frozen=True)
class PagedImplementation:
  families: tuple[str, ...]
  supports: Callable[[PagedCall], bool]
  run: PagedKernel


PAGED_IMPLEMENTATIONS: dict[str, PagedImplementation] = {
    "pallas": PagedImplementation(
        ("tpu",), lambda call: paged_kv.pallas_kernel_applies(call.cache, call.q_BLNH, call.window_size,
                                                              call.chunk_size, call.sinks_N),
        lambda q, cache, positions, window, soft_cap, chunk, sinks: paged_kv.tpu_paged_attention(
            q, cache, positions, soft_cap)),
    "gather": PagedImplementation(accelerators.FAMILIES, lambda call: True, paged_kv.gathered_attention),
}
# family -> the paged kernels in order of preference.
PAGED: dict[str, tuple[str, ...]] = {"tpu": ("pallas", "gather"), "gpu": ("gather",), "cpu": ("gather",)}


def paged_attention(q_BLNH: Array, cache: paged_kv.PagedKVCache, positions_BL: Array,
                    window_size: masks.Window = None, soft_cap: float = 0.0, chunk_size: masks.Window = None,
                    sinks_N: Array | None = None) -> Array:
  """kv_cache.cached_attention over pages, for the traced program's platform: the Pallas TPU
  kernel where it applies, else the reference (paged_kv.gathered_attention)."""
  call = PagedCall(cache, q_BLNH, window_size, chunk_size, sinks_N)
  chosen = next(PAGED_IMPLEMENTATIONS[name] for name in PAGED[_known(sharding.trace_platform())]
                if PAGED_IMPLEMENTATIONS[name].supports(call))
  return chosen.run(q_BLNH, cache, positions_BL, window_size, soft_cap, chunk_size, sinks_N)
