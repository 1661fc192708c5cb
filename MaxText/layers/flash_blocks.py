"""Chunked flash attention in pure JAX (any platform): the block primitives (online-softmax
forward with per-row log-sum-exp, the FlashAttention-2 backward from given statistics) and the
self-attention kernel built on them. attention_kernels.py runs the kernel; ring_blocks.py runs the
primitives per ring chunk pair, merging by log-sum-exp (ring_attention.py).

The mask is masks.py's: causal, same segment, and with a window, at most window - 1 tokens back,
from global positions (`q_offset`: where the queries start relative to the keys).

Legend: B batch, L query length, S key length, N query heads, K key/value heads, G = N // K query
heads per key/value head, H head dim, Q one query block, C one key/value block (chunk).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from MaxText.layers import masks

Array = jax.Array

def block_logits(q_BQKGH: jax.Array, k_BCKH: jax.Array, qseg_BQ: jax.Array, kseg_BC: jax.Array,
                  q_start: jax.Array, k_start: jax.Array, window: jax.Array, soft_cap: float
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Masked float32 logits [B, K, G, Q, C], the visibility mask [B, 1, 1, Q, C] and, with a soft
  cap, tanh(raw / cap) (its derivative is needed by the backward pass)."""
  s_BKGQC = jnp.einsum("bqkgh,bckh->bkgqc", q_BQKGH, k_BCKH, preferred_element_type=jnp.float32)
  tanh_BKGQC = None
  if soft_cap > 0:
    tanh_BKGQC = jnp.tanh(s_BKGQC / soft_cap)
    s_BKGQC = soft_cap * tanh_BKGQC
  q_pos_1Q = (q_start + jnp.arange(q_BQKGH.shape[1]))[None]
  k_pos_1C = (k_start + jnp.arange(k_BCKH.shape[1]))[None]
  mask_B11QC = masks.allowed(q_pos_1Q, k_pos_1C, qseg_BQ, kseg_BC, window)[:, None, None]
  return jnp.where(mask_B11QC, s_BKGQC, masks.MASK_VALUE), mask_B11QC, tanh_BKGQC


def kv_block_range(q_start: jax.Array, block_q: int, block_kv: int, window: jax.Array, num_kv_blocks: int
                    ) -> tuple[jax.Array, jax.Array]:
  """Key blocks [lo, hi) that queries q_start .. q_start + block_q - 1 can see (causal + window);
  every other key block is fully masked and skipped."""
  lo = jnp.maximum(q_start - window + 1, 0) // block_kv
  hi = jnp.minimum((q_start + block_q - 1) // block_kv + 1, num_kv_blocks)
  return lo, jnp.maximum(hi, lo)


def q_block_range(k_start: jax.Array, block_q: int, block_kv: int, window: jax.Array, q_offset: jax.Array,
                   num_q_blocks: int) -> tuple[jax.Array, jax.Array]:
  """Query blocks [lo, hi) that can see keys k_start .. k_start + block_kv - 1."""
  lo = jnp.maximum(k_start - q_offset, 0) // block_q
  hi = jnp.clip((k_start + block_kv - 1 + window - 1 - q_offset) // block_q + 1, 0, num_q_blocks)
  return jnp.minimum(lo, num_q_blocks), jnp.maximum(hi, jnp.minimum(lo, num_q_blocks))


def _slice(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def forward(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, qseg_BL: Array, kseg_BS: Array, window: Array,
             q_offset: Array, sinks_KG: Array | None, soft_cap: float, block_q: int, block_kv: int,
             out_dtype: jnp.dtype | None = None) -> tuple[Array, Array]:
  """Online softmax over the visible key blocks of each query block: (out_BLKGH, lse_BKGL). A sink
  logit (masks.dense_attention) starts each row's running max and sum as a key with no value.
  `out_dtype` (default q's): float32 when partial outputs are merged later (ring_attention.py)."""
  batch, _, num_kv, group, head_dim = q_BLKGH.shape
  num_q_blocks, num_kv_blocks = q_BLKGH.shape[1] // block_q, k_BSKH.shape[1] // block_kv

  def one_q_block(i: Array) -> tuple[Array, Array]:
    q_BQKGH, qseg_BQ = _slice(q_BLKGH, i, block_q), _slice(qseg_BL, i, block_q)
    q_start = q_offset + i * block_q

    def step(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
      m_BKGQ, l_BKGQ, acc_BKGQH = carry
      s_BKGQC, mask, _ = block_logits(q_BQKGH, _slice(k_BSKH, j, block_kv), qseg_BQ, _slice(kseg_BS, j, block_kv),
                                       q_start, j * block_kv, window, soft_cap)
      m_new = jnp.maximum(m_BKGQ, s_BKGQC.max(-1))
      p_BKGQC = jnp.where(mask, jnp.exp(s_BKGQC - m_new[..., None]), 0.0)
      correction = jnp.exp(m_BKGQ - m_new)
      pv = jnp.einsum("bkgqc,bckh->bkgqh", p_BKGQC.astype(v_BSKH.dtype), _slice(v_BSKH, j, block_kv),
                      preferred_element_type=jnp.float32)
      return m_new, l_BKGQ * correction + p_BKGQC.sum(-1), acc_BKGQH * correction[..., None] + pv

    stats_shape = (batch, num_kv, group, block_q)
    init = (jnp.full(stats_shape, masks.MASK_VALUE, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    if sinks_KG is not None:
      init = (jnp.broadcast_to(sinks_KG[None, :, :, None], stats_shape), jnp.ones(stats_shape, jnp.float32),
              init[2])
    lo, hi = kv_block_range(q_start, block_q, block_kv, window, num_kv_blocks)
    m_BKGQ, l_BKGQ, acc_BKGQH = jax.lax.fori_loop(lo, hi, step, init)
    # A query that sees no key at all (padding rows) gets a zero output.
    safe_l = jnp.where(l_BKGQ > 0, l_BKGQ, 1.0)
    return acc_BKGQH / safe_l[..., None], jnp.where(l_BKGQ > 0, m_BKGQ + jnp.log(safe_l), jnp.inf)

  out_nBKGQH, lse_nBKGQ = jax.lax.map(one_q_block, jnp.arange(num_q_blocks))
  out_BLKGH = out_nBKGQH.transpose(1, 0, 4, 2, 3, 5).reshape(batch, -1, num_kv, group, head_dim)
  lse_BKGL = jnp.moveaxis(lse_nBKGQ, 0, 3).reshape(batch, num_kv, group, -1)
  return out_BLKGH.astype(out_dtype or q_BLKGH.dtype), lse_BKGL


def backward_dq(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, qseg_BL: Array, kseg_BS: Array, window: Array,
                 q_offset: Array, soft_cap: float, block_q: int, block_kv: int, do_BLKGH: Array, lse_BKGL: Array,
                 delta_BKGL: Array) -> Array:
  num_q_blocks, num_kv_blocks = q_BLKGH.shape[1] // block_q, k_BSKH.shape[1] // block_kv

  def one_q_block(i: Array) -> Array:
    q_BQKGH, qseg_BQ, do_BQKGH = _slice(q_BLKGH, i, block_q), _slice(qseg_BL, i, block_q), _slice(do_BLKGH, i, block_q)
    lse_BKGQ = jax.lax.dynamic_slice_in_dim(lse_BKGL, i * block_q, block_q, axis=3)
    delta_BKGQ = jax.lax.dynamic_slice_in_dim(delta_BKGL, i * block_q, block_q, axis=3)
    q_start = q_offset + i * block_q

    def step(j: Array, dq_BQKGH: Array) -> Array:
      k_BCKH, v_BCKH = _slice(k_BSKH, j, block_kv), _slice(v_BSKH, j, block_kv)
      ds_BKGQC = score_grad(q_BQKGH, k_BCKH, v_BCKH, qseg_BQ, _slice(kseg_BS, j, block_kv), q_start, j * block_kv,
                             window, soft_cap, do_BQKGH, lse_BKGQ, delta_BKGQ)[1]
      return dq_BQKGH + jnp.einsum("bkgqc,bckh->bqkgh", ds_BKGQC, k_BCKH, preferred_element_type=jnp.float32)

    lo, hi = kv_block_range(q_start, block_q, block_kv, window, num_kv_blocks)
    return jax.lax.fori_loop(lo, hi, step, jnp.zeros(q_BQKGH.shape, jnp.float32))

  dq_nBQKGH = jax.lax.map(one_q_block, jnp.arange(num_q_blocks))
  return dq_nBQKGH.swapaxes(0, 1).reshape(q_BLKGH.shape)


def score_grad(q_BQKGH: Array, k_BCKH: Array, v_BCKH: Array, qseg_BQ: Array, kseg_BC: Array, q_start: Array,
                k_start: Array, window: Array, soft_cap: float, do_BQKGH: Array, lse_BKGQ: Array,
                delta_BKGQ: Array) -> tuple[Array, Array]:
  """Recomputed probabilities p and d(loss)/d(raw logits) of one block, both [B, K, G, Q, C] float32."""
  s_BKGQC, mask, tanh_BKGQC = block_logits(q_BQKGH, k_BCKH, qseg_BQ, kseg_BC, q_start, k_start, window, soft_cap)
  p_BKGQC = jnp.where(mask, jnp.exp(s_BKGQC - lse_BKGQ[..., None]), 0.0)
  dp_BKGQC = jnp.einsum("bqkgh,bckh->bkgqc", do_BQKGH, v_BCKH, preferred_element_type=jnp.float32)
  ds_BKGQC = p_BKGQC * (dp_BKGQC - delta_BKGQ[..., None])
  if tanh_BKGQC is not None:
    ds_BKGQC = ds_BKGQC * (1.0 - tanh_BKGQC**2)
  return p_BKGQC, ds_BKGQC


def backward_dkv(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, qseg_BL: Array, kseg_BS: Array, window: Array,
                  q_offset: Array, soft_cap: float, block_q: int, block_kv: int, do_BLKGH: Array, lse_BKGL: Array,
                  delta_BKGL: Array) -> tuple[Array, Array]:
  num_q_blocks, num_kv_blocks = q_BLKGH.shape[1] // block_q, k_BSKH.shape[1] // block_kv

  def one_kv_block(j: Array) -> tuple[Array, Array]:
    k_BCKH, v_BCKH, kseg_BC = _slice(k_BSKH, j, block_kv), _slice(v_BSKH, j, block_kv), _slice(kseg_BS, j, block_kv)

    def step(i: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
      dk_BCKH, dv_BCKH = carry
      q_BQKGH, do_BQKGH = _slice(q_BLKGH, i, block_q), _slice(do_BLKGH, i, block_q)
      lse_BKGQ = jax.lax.dynamic_slice_in_dim(lse_BKGL, i * block_q, block_q, axis=3)
      delta_BKGQ = jax.lax.dynamic_slice_in_dim(delta_BKGL, i * block_q, block_q, axis=3)
      p_BKGQC, ds_BKGQC = score_grad(q_BQKGH, k_BCKH, v_BCKH, _slice(qseg_BL, i, block_q), kseg_BC,
                                      q_offset + i * block_q, j * block_kv, window, soft_cap, do_BQKGH,
                                      lse_BKGQ, delta_BKGQ)
      dv_BCKH += jnp.einsum("bkgqc,bqkgh->bckh", p_BKGQC.astype(do_BQKGH.dtype), do_BQKGH,
                            preferred_element_type=jnp.float32)
      dk_BCKH += jnp.einsum("bkgqc,bqkgh->bckh", ds_BKGQC, q_BQKGH, preferred_element_type=jnp.float32)
      return dk_BCKH, dv_BCKH

    lo, hi = q_block_range(j * block_kv, block_q, block_kv, window, q_offset, num_q_blocks)
    zeros = jnp.zeros(k_BCKH.shape, jnp.float32)
    return jax.lax.fori_loop(lo, hi, step, (zeros, zeros))

  dk_nBCKH, dv_nBCKH = jax.lax.map(one_kv_block, jnp.arange(num_kv_blocks))
  merge = lambda x: x.swapaxes(0, 1).reshape(k_BSKH.shape)  # noqa: E731
  return merge(dk_nBCKH), merge(dv_nBCKH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash_core(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, qseg_BL: Array, kseg_BS: Array, window: Array,
                q_offset: Array, sinks_KG: Array | None, soft_cap: float, block_q: int, block_kv: int) -> Array:
  return forward(q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kseg_BS, window, q_offset, sinks_KG, soft_cap, block_q,
                  block_kv)[0]


def _flash_core_fwd(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, qseg_BL: Array, kseg_BS: Array, window: Array,
                    q_offset: Array, sinks_KG: Array | None, soft_cap: float, block_q: int, block_kv: int
                    ) -> tuple[Array, tuple[Array | None, ...]]:
  out_BLKGH, lse_BKGL = forward(q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kseg_BS, window, q_offset, sinks_KG, soft_cap,
                                 block_q, block_kv)
  return out_BLKGH, (q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kseg_BS, window, q_offset, sinks_KG, out_BLKGH, lse_BKGL)


def _flash_core_bwd(soft_cap: float, block_q: int, block_kv: int, residuals: tuple[Any, ...], do_BLKGH: Array
                    ) -> tuple[Array | None, ...]:
  q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kseg_BS, window, q_offset, sinks_KG, out_BLKGH, lse_BKGL = residuals
  # delta = rowsum(dO * O): the softmax Jacobian's diagonal correction (FlashAttention-2, eq. in sec. 3.1).
  delta_BKGL = jnp.einsum("blkgh,blkgh->bkgl", do_BLKGH.astype(jnp.float32), out_BLKGH.astype(jnp.float32))
  args = (q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kseg_BS, window, q_offset, soft_cap, block_q, block_kv,
          do_BLKGH, lse_BKGL, delta_BKGL)
  dq_BLKGH = backward_dq(*args)
  dk_BSKH, dv_BSKH = backward_dkv(*args)
  # The lse includes the sink, so the blocks' gradients are unchanged; the sink, a key whose value
  # is zero, gets -sum over rows of its probability times delta.
  dsinks_KG = None if sinks_KG is None else -jnp.einsum(
      "bkgl,bkgl->kg", jnp.exp(sinks_KG[None, :, :, None] - lse_BKGL), delta_BKGL).astype(sinks_KG.dtype)
  return (dq_BLKGH.astype(q_BLKGH.dtype), dk_BSKH.astype(k_BSKH.dtype), dv_BSKH.astype(v_BSKH.dtype),
          None, None, None, None, dsinks_KG)


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


def _pad_length(x: jax.Array, multiple: int, value: int | float = 0) -> jax.Array:
  pad = -x.shape[1] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def flash_attention_with_offset(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_segment_ids_BL: jax.Array,
                                kv_segment_ids_BS: jax.Array, window_size: masks.Window, soft_cap: float,
                                q_offset: int | jax.Array = 0, *, block_q: int = 512, block_kv: int = 512,
                                sinks_N: jax.Array | None = None) -> jax.Array:
  """Chunked attention of queries at global positions q_offset .. q_offset + L - 1 over keys at
  0 .. S - 1 (q_offset > 0 when the queries are one sequence shard: context parallelism), with
  masks.dense_attention's sinks when given."""
  length = q_BLNH.shape[1]
  block_q, block_kv = min(block_q, length), min(block_kv, k_BSKH.shape[1])
  q_BLKGH = _pad_length(masks.group_queries(q_BLNH, k_BSKH.shape[2]), block_q)
  # Padded queries and keys get segment ids that match nothing, so they never take part.
  qseg_BL = _pad_length(q_segment_ids_BL.astype(jnp.int32), block_q, -2)
  kseg_BS = _pad_length(kv_segment_ids_BS.astype(jnp.int32), block_kv, -1)
  sinks_KG = None if sinks_N is None else sinks_N.astype(jnp.float32).reshape(q_BLKGH.shape[2], -1)
  out_BLKGH = _flash_core(q_BLKGH, _pad_length(k_BSKH, block_kv), _pad_length(v_BSKH, block_kv), qseg_BL, kseg_BS,
                          masks.window_scalar(window_size), jnp.asarray(q_offset, jnp.int32), sinks_KG,
                          float(soft_cap), block_q, block_kv)
  return masks.merge_groups(out_BLKGH[:, :length])


def flash_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                    window_size: masks.Window = None, soft_cap: float = 0.0, *, block_q: int = 512,
                    block_kv: int = 512, sinks_N: jax.Array | None = None) -> jax.Array:
  """Self-attention (L == S) with the dot_product mask, in O(L · block) memory per head."""
  return flash_attention_with_offset(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, segment_ids_BL, window_size, soft_cap,
                                     block_q=block_q, block_kv=block_kv, sinks_N=sinks_N)


def reference_attention_with_offset(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                                    q_segment_ids_BL: jax.Array, kv_segment_ids_BS: jax.Array,
                                    window_size: masks.Window, soft_cap: float,
                                    q_offset: int | jax.Array = 0) -> jax.Array:
  """Plain materialised attention with a query offset (the dot_product math; used by tests)."""
  q_pos_1L = (q_offset + jnp.arange(q_BLNH.shape[1]))[None]
  mask_BLS = masks.allowed(q_pos_1L, jnp.arange(k_BSKH.shape[1])[None], q_segment_ids_BL, kv_segment_ids_BS,
                           masks.window_scalar(window_size))
  return masks.dense_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, soft_cap)
