"""The ring's per-chunk-pair attention kernels (ring_attention.py): the chunked JAX kernel on every
platform, splash on TPU and cuDNN on GPU; which one runs: attention_kernels.block_kernel.

A ring step attends a query chunk to a key chunk whose global start is `offset` tokens earlier
(a traced multiple of the chunk length). Each kernel gives:
- forward: the pair's output (float32, or the inputs' dtype for splash and cuDNN, whose outputs
  are rounded there anyway) and float32 log-sum-exp, -inf on rows that see no key of the pair
  (their output is then ignored by the merge, and may be NaN);
- backward: the pair's dQ, dK, dV (float32 or the inputs' dtype; the ring accumulates them in
  float32) from the *global* output, log-sum-exp and delta of the merged
  rows. With the global statistics, p = exp(s - lse) is the row's final probability and each
  pair's gradients add up to the exact ones (FlashAttention-2's backward, one key chunk at a time).

Splash and cuDNN do not take outside statistics through their public, differentiable entry points
(splash's save_residuals variant is forward-only). Their own backward rules do take the forward's
residuals, so the pair's backward calls those rules with the global output and log-sum-exp in
place of the pair's. They are private to JAX: tests/layers/test_ring_blocks.py runs splash's in
Pallas' interpreter on CPU, and the GPU check runs cuDNN's, so a JAX upgrade that changes them
fails there.

Masks: splash's masks are static, so each kind of pair (above the diagonal: skipped; on it:
causal, or a band with a short window; below it: full, a band or skipped, by the window) gets its
own kernel and `lax.switch` picks one from the traced offset. cuDNN takes the pair's mask (causal,
window and documents, from global positions) as a bias, as attention_kernels.cudnn_flash_attention
does.

Legend: B batch, L query chunk length, C key chunk length, N query heads, K key/value heads,
G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Protocol

import jax
import jax.numpy as jnp

from MaxText.configuration.model_config import AttentionBlocks
from MaxText.layers import flash_blocks, masks, splash_attention

if TYPE_CHECKING:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_types
  from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

Array = jax.Array
Grads = tuple[Array, Array, Array]
# A pair's mask as a hashable key: ("causal",), ("full",) or ("local", window - 1, right, offset).
PairKind = tuple[Any, ...]


class BlockKernel(Protocol):
  """Hashable (a static argument of the ring's custom VJP)."""

  def forward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
              offset: Array) -> tuple[Array, Array]: ...

  def backward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
               offset: Array, do_BLKGH: Array, out_BLKGH: Array, lse_BKGL: Array, delta_BKGL: Array) -> Grads: ...


def fit(block: int, length: int) -> int:
  """The largest tile <= block that divides length (the chunked kernel does not pad)."""
  return math.gcd(min(block, length), length)


def _no_key_lse(lse_BKGL: Array, seen: Array | None = None) -> Array:
  """-inf on rows that saw no key of the pair (`seen` false; by default where the log-sum-exp is
  about splash's mask value or -inf), so the merge ignores their outputs."""
  if seen is None:
    seen = lse_BKGL > 0.5 * masks.MASK_VALUE
  return jnp.where(seen, lse_BKGL, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class ChunkedBlocks:
  """The chunked JAX kernel (flash_blocks.py): any platform, any offset, window and soft cap."""
  soft_cap: float
  block_q: int
  block_kv: int

  def _tiles(self, q_BLKGH: Array, k_BCKH: Array) -> tuple[int, int]:
    return fit(self.block_q, q_BLKGH.shape[1]), fit(self.block_kv, k_BCKH.shape[1])

  def forward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
              offset: Array) -> tuple[Array, Array]:
    # The mask depends on q_pos - k_pos only, so keys at k_start are keys at 0 for queries at offset.
    out, lse = flash_blocks.forward(q_BLKGH, k_BCKH, v_BCKH, qseg_BL, kseg_BC, window, offset, None, self.soft_cap,
                                     *self._tiles(q_BLKGH, k_BCKH), out_dtype=jnp.float32)
    return out, jnp.where(jnp.isinf(lse), -jnp.inf, lse)

  def backward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
               offset: Array, do_BLKGH: Array, out_BLKGH: Array, lse_BKGL: Array, delta_BKGL: Array) -> Grads:
    args = (q_BLKGH, k_BCKH, v_BCKH, qseg_BL, kseg_BC, window, offset, self.soft_cap,
            *self._tiles(q_BLKGH, k_BCKH), do_BLKGH, lse_BKGL, delta_BKGL)
    dk, dv = flash_blocks.backward_dkv(*args)
    return flash_blocks.backward_dq(*args), dk, dv


# ---------------------------------------------------------------- splash (TPU)


def _pair_kind(chunk: int, window: int | None, m: int) -> PairKind | None:
  """What a pair whose key chunk starts m >= 0 chunks before its query chunk sees, as a key of
  splash's static mask, or None where the window leaves nothing. Query i sees key j iff
  0 <= m·chunk + i - j < window."""
  if m == 0:
    return ("causal",) if window is None or window >= chunk else ("local", window - 1, 0, 0)
  nearest, farthest = (m - 1) * chunk + 1, (m + 1) * chunk - 1  # the pair's smallest and largest q_pos - k_pos
  if window is None or farthest < window:
    return ("full",)
  if nearest >= window:
    return None
  return ("local", window - 1, None, m * chunk)


def _pair_kinds(chunk: int, window: int | None) -> list[PairKind | None]:
  """Kinds for m = 0, 1, ... up to where they stop changing; the last entry is every farther pair's
  (full without a window, nothing with one)."""
  last = 1 if window is None else -(-(window - 1) // chunk) + 1
  return [_pair_kind(chunk, window, m) for m in range(last + 1)]


def _splash_mask(kind: PairKind, chunk: int) -> Any:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
  shape = (chunk, chunk)
  if kind[0] == "causal":
    return splash_mask.CausalMask(shape)
  if kind[0] == "full":
    return splash_mask.FullMask(shape)
  return splash_mask.LocalMask(shape, window_size=kind[1:3], offset=kind[3])


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
  """Splash per pair. `window` is the static window, or with `traced_window` the local window of a
  stack mixing local and global layers (a traced window then picks local or global masks)."""
  soft_cap: float
  blocks: AttentionBlocks
  window: int | None
  traced_window: bool = False
  interpret: bool = False

  def _cases(self, chunk: int, heads: int, window: Array
             ) -> tuple[list[splash_types.SplashAttentionKernel | None], Callable[[Array], Array]]:
    """The distinct kernels (None: nothing to see) and a function of the traced offset picking one."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
    kinds: list[PairKind | None] = [None]
    tables = []
    for win in ([self.window, None] if self.traced_window else [self.window]):
      entries = []
      for kind in _pair_kinds(chunk, win):
        if kind not in kinds:
          kinds.append(kind)
        entries.append(kinds.index(kind))
      tables.append(jnp.asarray(entries, jnp.int32))
    sizes = splash_attention.block_sizes(self.blocks, chunk)
    kernels = [None] + [splash.make_splash_mha_single_device(
        mask=splash_mask.MultiHeadMask((_splash_mask(kind, chunk),) * heads), block_sizes=sizes,
        save_residuals=True, attn_logits_soft_cap=self.soft_cap if self.soft_cap > 0 else None,
        interpret=self.interpret) for kind in kinds if kind is not None]

    def pick(offset: Array) -> Array:
      m = offset // chunk
      case = [table[jnp.clip(m, 0, table.shape[0] - 1)] for table in tables]
      chosen = case[0] if len(case) == 1 else jnp.where(masks.is_windowed(window), case[0], case[1])
      return jnp.where(m < 0, 0, chosen)

    return kernels, pick

  def forward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
              offset: Array) -> tuple[Array, Array]:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    batch, length, kv_heads, group, head_dim = q_BLKGH.shape
    kernels, pick = self._cases(length, kv_heads * group, window)
    q_BNLH, k_BKCH, v_BKCH = _heads_first(q_BLKGH), k_BCKH.swapaxes(1, 2), v_BCKH.swapaxes(1, 2)
    segments = splash.SegmentIds(q=qseg_BL, kv=kseg_BC)

    def branch(kernel: splash_types.SplashAttentionKernel | None) -> Callable[[], tuple[Array, Array]]:
      if kernel is None:
        return lambda: (jnp.zeros(q_BLKGH.shape, q_BLKGH.dtype),
                        jnp.full((batch, kv_heads, group, length), -jnp.inf, jnp.float32))

      def run() -> tuple[Array, Array]:
        out_BNLH, (lse_BNL,) = jax.vmap(kernel)(q_BNLH, k_BKCH, v_BKCH, segments)
        return (_heads_last(out_BNLH, kv_heads).astype(q_BLKGH.dtype),
                _no_key_lse(lse_BNL.reshape(batch, kv_heads, group, length).astype(jnp.float32)))
      return run

    return jax.lax.switch(pick(offset), [branch(k) for k in kernels])

  def backward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
               offset: Array, do_BLKGH: Array, out_BLKGH: Array, lse_BKGL: Array, delta_BKGL: Array) -> Grads:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    del delta_BKGL  # splash's backward computes it from the (global) output
    batch, length, kv_heads, group, head_dim = q_BLKGH.shape
    kernels, pick = self._cases(length, kv_heads * group, window)
    q_BNLH, do_BNLH, out_BNLH = (_heads_first(x) for x in (q_BLKGH, do_BLKGH, out_BLKGH.astype(q_BLKGH.dtype)))
    k_BKCH, v_BKCH = k_BCKH.swapaxes(1, 2), v_BCKH.swapaxes(1, 2)
    lse_BNL = lse_BKGL.reshape(batch, kv_heads * group, length)
    segments = splash.SegmentIds(q=qseg_BL, kv=kseg_BC)
    zeros: Grads = (jnp.zeros(q_BLKGH.shape, q_BLKGH.dtype), jnp.zeros(k_BCKH.shape, k_BCKH.dtype),
                    jnp.zeros(v_BCKH.shape, v_BCKH.dtype))

    def branch(kernel: splash_types.SplashAttentionKernel | None) -> Callable[[], Grads]:
      if kernel is None:
        return lambda: zeros

      def run() -> Grads:
        def one(q: Array, k: Array, v: Array, seg: splash_types.SegmentIds, out: Array, lse: Array, do: Array) -> Grads:
          return _splash_backward(kernel, q, k, v, seg, out, lse, do)
        dq_BNLH, dk_BKCH, dv_BKCH = jax.vmap(one)(q_BNLH, k_BKCH, v_BKCH, segments, out_BNLH, lse_BNL, do_BNLH)
        return (_heads_last(dq_BNLH, kv_heads).astype(q_BLKGH.dtype), dk_BKCH.swapaxes(1, 2).astype(k_BCKH.dtype),
                dv_BKCH.swapaxes(1, 2).astype(v_BCKH.dtype))
      return run

    return jax.lax.switch(pick(offset), [branch(k) for k in kernels])


def _splash_backward(kernel: splash_types.SplashAttentionKernel, q_NLH: Array, k_KCH: Array, v_KCH: Array,
                     segments: splash_types.SegmentIds, out_NLH: Array, lse_NL: Array,
                     do_NLH: Array) -> Grads:
  """Splash's own backward rule with the global output and log-sum-exp as its residuals."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  def collapsed(info: MaskInfo | None) -> MaskInfo | None:  # as splash's jitted entry point hands mask infos to its custom VJP
    if info is None or info.partial_mask_blocks is None:
      return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
        -1, *info.partial_mask_blocks.shape[-2:]))

  kw = kernel.kwargs
  residuals = (q_NLH, k_KCH, v_KCH, segments, None, out_NLH, lse_NL, collapsed(kernel.dq_mask_info),
               collapsed(kernel.dkv_mask_info))
  grads = splash._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
                                       kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], residuals,
                                       do_NLH)
  return grads[3], grads[4], grads[5]


def _heads_first(x_BLKGH: Array) -> Array:
  batch, length, kv_heads, group, head_dim = x_BLKGH.shape
  return x_BLKGH.reshape(batch, length, kv_heads * group, head_dim).swapaxes(1, 2)


def _heads_last(x_BNLH: Array, kv_heads: int) -> Array:
  batch, heads, length, head_dim = x_BNLH.shape
  return x_BNLH.swapaxes(1, 2).reshape(batch, length, kv_heads, heads // kv_heads, head_dim)


# ---------------------------------------------------------------- cuDNN (GPU)


@dataclasses.dataclass(frozen=True)
class CudnnBlocks:
  """cuDNN flash attention per pair (bfloat16/float16, head dim <= 128, no soft cap). `window` is
  the static window (cuDNN's own sliding window on diagonal pairs) or None; any window, static or
  traced, is also in the pair's mask."""
  window: int | None

  def _mask(self, qseg_BL: Array, kseg_BC: Array, window: Array, offset: Array) -> Array:
    q_pos = jnp.arange(qseg_BL.shape[1])[None] + offset
    k_pos = jnp.arange(kseg_BC.shape[1])[None]
    return masks.allowed(q_pos, k_pos, qseg_BL, kseg_BC, window)[:, None]  # [B, 1, L, C]

  def _case(self, offset: Array, window: Array, chunk: int) -> Array:
    """0: nothing to see (above the diagonal, or every key beyond the window); 1: the diagonal;
    2: below it."""
    skip = (offset < 0) | (offset - chunk + 1 >= window)
    return jnp.where(skip, 0, jnp.where(offset == 0, 1, 2))

  def _call(self, diagonal: bool, q_BLNH: Array, k_BCKH: Array, v_BCKH: Array, mask_B1LC: Array
            ) -> tuple[tuple[Array, ...], dict[str, Any]]:
    """Arguments as cuDNN's fused-attention rules take them: (operands, static keywords)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    bias = cudnn.combine_bias_and_mask(None, mask_B1LC, q_BLNH.dtype)
    unused = jnp.zeros(0, dtype=q_BLNH.dtype)
    operands = (q_BLNH, k_BCKH, v_BCKH, bias, unused, unused, unused, unused, unused, unused)
    static = dict(scale=1.0, seed=42, dropout_rate=0.0, variadic_args=(True, False),
                  mask_type=cudnn.MaskType.CAUSAL if diagonal else cudnn.MaskType.NO_MASK,
                  layout=cudnn.AttentionLayout.BTNH.value,
                  sliding_window_length=self.window if diagonal else None)
    return operands, static

  def forward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
              offset: Array) -> tuple[Array, Array]:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    batch, length, kv_heads, group, head_dim = q_BLKGH.shape
    q_BLNH = q_BLKGH.reshape(batch, length, kv_heads * group, head_dim)
    mask = self._mask(qseg_BL, kseg_BC, window, offset)

    def run(diagonal: bool) -> Callable[[], tuple[Array, Array]]:
      def attend() -> tuple[Array, Array]:
        operands, static = self._call(diagonal, q_BLNH, k_BCKH, v_BCKH, mask)
        out_BLNH, lse_BNL = cudnn._dot_product_attention_fwd_p_wrapper.bind(*operands, **static, is_training=True)
        # cuDNN's mask bias is finite, so a row that sees nothing has a finite log-sum-exp.
        seen_BKGL = jnp.broadcast_to(mask.any(-1)[:, :, None], (batch, kv_heads, group, length))
        return (out_BLNH.reshape(q_BLKGH.shape).astype(q_BLKGH.dtype),
                _no_key_lse(lse_BNL.reshape(batch, kv_heads, group, length).astype(jnp.float32), seen_BKGL))
      return attend

    def skip() -> tuple[Array, Array]:
      return (jnp.zeros(q_BLKGH.shape, q_BLKGH.dtype),
              jnp.full((batch, kv_heads, group, length), -jnp.inf, jnp.float32))

    return jax.lax.switch(self._case(offset, window, k_BCKH.shape[1]), [skip, run(True), run(False)])

  def backward(self, q_BLKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BL: Array, kseg_BC: Array, window: Array,
               offset: Array, do_BLKGH: Array, out_BLKGH: Array, lse_BKGL: Array, delta_BKGL: Array) -> Grads:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    del delta_BKGL  # cuDNN's backward computes it from the (global) output
    batch, length, kv_heads, group, head_dim = q_BLKGH.shape
    def flat(x: Array) -> Array:
      return x.reshape(batch, length, kv_heads * group, head_dim)

    q_BLNH, do_BLNH, out_BLNH = flat(q_BLKGH), flat(do_BLKGH.astype(q_BLKGH.dtype)), flat(
        out_BLKGH.astype(q_BLKGH.dtype))
    lse_BNL = lse_BKGL.reshape(batch, kv_heads * group, length).astype(jnp.float32)
    mask = self._mask(qseg_BL, kseg_BC, window, offset)

    def run(diagonal: bool) -> Callable[[], Grads]:
      def grads() -> Grads:
        operands, static = self._call(diagonal, q_BLNH, k_BCKH, v_BCKH, mask)
        dq, dk, dv = cudnn._dot_product_attention_bwd_p_wrapper.bind(*operands, lse_BNL, out_BLNH, do_BLNH,
                                                                     **static)[:3]
        return dq.reshape(q_BLKGH.shape).astype(q_BLKGH.dtype), dk.astype(k_BCKH.dtype), dv.astype(v_BCKH.dtype)
      return grads

    def skip() -> Grads:
      return (jnp.zeros(q_BLKGH.shape, q_BLKGH.dtype), jnp.zeros(k_BCKH.shape, k_BCKH.dtype),
              jnp.zeros(v_BCKH.shape, v_BCKH.dtype))

    return jax.lax.switch(self._case(offset, window, k_BCKH.shape[1]), [skip, run(True), run(False)])
