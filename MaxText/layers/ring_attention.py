"""Context parallelism over the `sequence` axis: ring, all_gather and all-to-all (Ulysses). All run
inside shard_map with the length split over the axis (context_parallel.kernel_specs).

- ring: each shard keeps its queries; K/V (and their segment ids) move one shard along the ring
  per step with ppermute, so after `n` steps every query has met every key block and no shard
  holds more than two blocks (the one in use, the next arriving). The per-pair (output,
  log-sum-exp) results merge as an online softmax. The backward pass (a custom VJP) rotates K/V
  again, and dK/dV accumulators travel with their blocks, arriving home after the last step.
- all_gather: K/V gathered once, then the ring's pairs over the gathered blocks (no rotation);
  the gather's transpose reduce-scatters dK/dV.
- all_to_all: heads <-> length re-sharding: each shard gets the whole sequence for 1/n of the
  heads, runs a full-sequence kernel, and re-shards back.
- load balancing (context_parallel.balanced_*): a shard's queries and keys are two contiguous
  chunks of global positions; every kernel call is per (query chunk, key chunk) pair with the
  global offsets, so causal masks, windows and segment ids stay those of the whole sequence, and
  each step runs only the pairs that can see something (_step_pairs).

Kernels (attention_kernels.CONTEXT_PARALLEL): the ring and all_gather run block_kernel per chunk
pair (splash on TPU, cuDNN on GPU, else chunked: each returns the pair's log-sum-exp and takes the
global one in its backward). all_to_all's local attention is an ordinary full-sequence attention,
so it runs full_sequence_kernel (splash, cuDNN or chunked likewise).

Legend: B batch, L local length, S global length, N query heads, K key/value heads, G = N // K,
H head dim; a "segment" here is a contiguous run of global positions (chunk), not a document.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from MaxText.platform import sharding
from MaxText.errors import ConfigError
from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import attention_kernels, context_parallel, flash_blocks, masks, ring_blocks

Array = jax.Array
Tree = TypeVar("Tree")  # what a ring step carries or rotates (arrays, or a tuple of them)
Grads = tuple[Array, Array, Array]  # dQ, dK, dV (chunked, float32 while they accumulate)
Block = tuple[Array, Array, Array]  # a K/V block travelling the ring: keys, values, segment ids (chunked)


def _chunked(x: Array, count: int, axis: int = 1) -> Array:
  """x with `axis` cut into `count` equal chunks, the chunk index leading."""
  shape = x.shape[:axis] + (count, x.shape[axis] // count) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunked(x: Array, axis: int = 1) -> Array:
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _step_pairs(count: int, shard: Array, source: Array, first: bool) -> tuple[Array, Array]:
  """(query chunk, key chunk) indices of the pairs a shard computes against `source`'s block; the
  others lie above the diagonal. One chunk per shard: the one pair. Load balanced (early chunk 0
  and late chunk 1 of each shard): late queries over the source's early keys always (below the
  diagonal); early queries over its late keys never; of the two same-kind pairs, the early one when
  the source is earlier, the late one when it is later; on the shard's own block (`first`) both
  diagonals. So every ring step after the first runs two pairs, which the compiler's estimate
  prices exactly, where scanning all four pairs through a kernel switch would count four.
  Pairs run one after another (a scan): unrolled, XLA keeps all their temporaries alive at once."""
  if count == 1:
    return jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  if first:
    return jnp.asarray([1, 0, 1], jnp.int32), jnp.asarray([0, 0, 1], jnp.int32)
  same = (source > shard).astype(jnp.int32)
  return jnp.stack([jnp.int32(1), same]), jnp.stack([jnp.int32(0), same])


def merge(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
  """Online-softmax merge of two partial results (out_BLKGH normalised per part, lse_BKGL), in
  float32. A row whose part has lse = -inf (it saw nothing) contributes nothing, whatever its
  output holds (a kernel may leave NaN there)."""
  (out_a, lse_a), (out_b, lse_b) = a, b
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

  def weighted(out: Array, part: Array) -> Array:
    weight = jnp.moveaxis(jnp.exp(part - safe), 3, 1)[..., None]  # [B, L, K, G, 1]
    return jnp.where(weight > 0, out.astype(jnp.float32) * weight, 0.0)

  return weighted(out_a, lse_a) + weighted(out_b, lse_b), lse


class _Local(NamedTuple):
  """One shard's side of a ring or all_gather pass: its query chunks (cut once per pass) and
  where they start globally."""
  q_c: Array  # [chunks, B, C, K, G, H]
  qseg_c: Array  # [chunks, B, C]
  shard: Array
  shards: int
  balanced: bool
  q_starts: Array

  def pairs_with(self, source: Array, first: bool) -> tuple[Array, tuple[Array, Array]]:
    """The global starts of `source`'s key chunks and the (query, key) chunk pairs to compute."""
    length = self.q_c.shape[0] * self.q_c.shape[2]
    k_starts = _chunk_starts(source, length, self.shards, self.balanced)
    return k_starts, _step_pairs(self.q_c.shape[0], self.shard, source, first)


def _local(q_BLKGH: Array, seg_BL: Array, axes: tuple[str, ...], shards: int, balanced: bool) -> _Local:
  shard = jax.lax.axis_index(axes)
  q_starts = _chunk_starts(shard, q_BLKGH.shape[1], shards, balanced)
  count = q_starts.shape[0]
  return _Local(_chunked(q_BLKGH, count), _chunked(seg_BL, count), shard, shards, balanced, q_starts)


def _pair_forward(kernel: ring_blocks.BlockKernel, local: _Local, block: tuple[Array, Array, Array], window: Array,
                  source: Array, first: bool, merged: tuple[Array, Array]) -> tuple[Array, Array]:
  """The running float32 output and log-sum-exp of the local query chunks (out_c [chunks, B, C, K,
  G, H], lse_c [chunks, B, K, G, C]; -inf where a row has seen nothing yet) merged with `source`'s
  K/V block (k_c, v_c, kseg_c, cut into chunks), pair by pair: query chunk a at global
  q_starts[a], key chunk b at k_starts[b]."""
  k_c, v_c, kseg_c = block
  k_starts, pairs = local.pairs_with(source, first)

  def pair(carry: tuple[Array, Array], ab: tuple[Array, Array]) -> tuple[tuple[Array, Array], None]:
    out_c, lse_c = carry
    a, b = ab
    part = kernel.forward(local.q_c[a], k_c[b], v_c[b], local.qseg_c[a], kseg_c[b], window,
                          local.q_starts[a] - k_starts[b])
    out, lse = merge((out_c[a], lse_c[a]), part)
    return (out_c.at[a].set(out), lse_c.at[a].set(lse)), None

  return jax.lax.scan(pair, merged, pairs)[0]


def _pair_backward(kernel: ring_blocks.BlockKernel, local: _Local, block: tuple[Array, Array, Array],
                   window: Array, source: Array, first: bool, backward_inputs: tuple[Array, ...],
                   grads: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
  """Adds `source`'s block's pairs to the float32 dQ of the local query chunks and the block's dK,
  dV (all chunked), from the global output, lse and delta (`_backward_inputs`)."""
  k_c, v_c, kseg_c = block
  do_c, out_c, lse_c, delta_c = backward_inputs
  k_starts, pairs = local.pairs_with(source, first)

  def pair(carry: Grads, ab: tuple[Array, Array]) -> tuple[Grads, None]:
    dq_c, dk_c, dv_c = carry
    a, b = ab
    dq, dk, dv = kernel.backward(local.q_c[a], k_c[b], v_c[b], local.qseg_c[a], kseg_c[b], window,
                                 local.q_starts[a] - k_starts[b], do_c[a], out_c[a], lse_c[a], delta_c[a])
    return (dq_c.at[a].add(dq), dk_c.at[b].add(dk), dv_c.at[b].add(dv)), None

  return jax.lax.scan(pair, grads, pairs)[0]


def _empty(q_c: Array) -> tuple[Array, Array]:
  """Nothing seen yet: a zero output and -inf log-sum-exp per query chunk."""
  chunks, batch, chunk, kv_heads, group, _ = q_c.shape
  return jnp.zeros(q_c.shape, jnp.float32), jnp.full((chunks, batch, kv_heads, group, chunk), -jnp.inf, jnp.float32)


def _finished(q_BLKGH: Array, merged: tuple[Array, Array]) -> tuple[Array, Array]:
  """The merged output (in q's dtype) and log-sum-exp back in one piece."""
  return _unchunked(merged[0]).astype(q_BLKGH.dtype), _unchunked(merged[1], axis=3)


def _backward_inputs(do_BLKGH: Array, out_BLKGH: Array, lse_BKGL: Array, count: int) -> tuple[Array, ...]:
  """dO, O, lse and delta = rowsum(dO · O) cut into query chunks; rows that saw no key (padding)
  get lse = +inf so their recomputed probabilities are 0."""
  delta_BKGL = jnp.einsum("blkgh,blkgh->bkgl", do_BLKGH.astype(jnp.float32), out_BLKGH.astype(jnp.float32))
  lse_BKGL = jnp.where(jnp.isfinite(lse_BKGL), lse_BKGL, jnp.inf)
  return (_chunked(do_BLKGH, count), _chunked(out_BLKGH, count), _chunked(lse_BKGL, count, 3),
          _chunked(delta_BKGL, count, 3))


# ---------------------------------------------------------------- ring


def _chunk_starts(shard: Array, local_length: int, shards: int, balanced: bool) -> Array:
  return jnp.stack([jnp.asarray(s, jnp.int32)
                    for s in context_parallel.shard_chunk_starts(shard, local_length, shards, balanced)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q_BLKGH: Array, k_BLKH: Array, v_BLKH: Array, seg_BL: Array, window: Array, axes: tuple[str, ...],
          shards: int, balanced: bool, kernel: ring_blocks.BlockKernel) -> Array:
  return _ring_fwd(q_BLKGH, k_BLKH, v_BLKH, seg_BL, window, axes, shards, balanced, kernel)[0]


def _rotate(x: Tree, axes: tuple[str, ...], shards: int) -> Tree:
  """Every shard's block to the next shard along the ring (shard i receives from i - 1)."""
  return jax.lax.ppermute(x, axes, perm=[(i, (i + 1) % shards) for i in range(shards)])


def _ring_steps(attend: Callable[..., Tree], block: Block, state: Tree, axes: tuple[str, ...], shards: int) -> Tree:
  """state = attend(block, source, state, first) over every ring step: the shard's own block first
  (its own pair schedule), n - 2 steps that each issue the next block's rotation before their
  compute (so the transfer overlaps it), then the last block, which need not move on."""
  shard = jax.lax.axis_index(axes)
  following = _rotate(block, axes, shards) if shards > 1 else block
  state = attend(block, shard, state, True)
  if shards == 1:
    return state

  def step_fn(carry: tuple[Block, Any], step: Array) -> tuple[tuple[Block, Any], None]:
    block, state = carry
    following = _rotate(block, axes, shards)
    return (following, attend(block, (shard - step) % shards, state, False)), None

  (block, state), _ = jax.lax.scan(step_fn, (following, state), jnp.arange(1, shards - 1))
  return attend(block, (shard + 1) % shards, state, False)


def _ring_fwd(q_BLKGH: Array, k_BLKH: Array, v_BLKH: Array, seg_BL: Array, window: Array, axes: tuple[str, ...],
              shards: int, balanced: bool, kernel: ring_blocks.BlockKernel) -> tuple[Array, tuple[Array, ...]]:
  local = _local(q_BLKGH, seg_BL, axes, shards, balanced)
  count = local.q_c.shape[0]
  block = (_chunked(k_BLKH, count), _chunked(v_BLKH, count), _chunked(seg_BL, count))  # K/V travel cut into chunks

  def attend(block: Block, source: Array, merged: tuple[Array, Array], first: bool) -> tuple[Array, Array]:
    return _pair_forward(kernel, local, block, window, source, first, merged)

  out_BLKGH, lse_BKGL = _finished(q_BLKGH, _ring_steps(attend, block, _empty(local.q_c), axes, shards))
  return out_BLKGH, (q_BLKGH, k_BLKH, v_BLKH, seg_BL, window, out_BLKGH, lse_BKGL)


def _ring_bwd(axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel,
              residuals: tuple[Array, ...], do_BLKGH: Array) -> tuple[Array | None, ...]:
  q_BLKGH, k_BLKH, v_BLKH, seg_BL, window, out_BLKGH, lse_BKGL = residuals
  local = _local(q_BLKGH, seg_BL, axes, shards, balanced)
  count = local.q_c.shape[0]
  backward_inputs = _backward_inputs(do_BLKGH, out_BLKGH, lse_BKGL, count)
  block = (_chunked(k_BLKH, count), _chunked(v_BLKH, count), _chunked(seg_BL, count))

  def attend(block: Block, source: Array, grads: Grads, first: bool) -> Grads:
    dq_c, dk_c, dv_c = _pair_backward(kernel, local, block, window, source, first, backward_inputs, grads)
    # The dK/dV accumulators travel with their block; the last rotation brings each one home.
    return (dq_c, *_rotate((dk_c, dv_c), axes, shards))

  def zeros(x: Array) -> Array:
    return jnp.zeros(x.shape, jnp.float32)

  grads = _ring_steps(attend, block, (zeros(local.q_c), zeros(block[0]), zeros(block[1])), axes, shards)
  dq_BLKGH, dk_BLKH, dv_BLKH = (_unchunked(g) for g in grads)
  return (dq_BLKGH.astype(q_BLKGH.dtype), dk_BLKH.astype(k_BLKH.dtype), dv_BLKH.astype(v_BLKH.dtype), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_shard(q_BLNH: Array, k_BLKH: Array, v_BLKH: Array, seg_BL: Array, window: masks.Window,
               axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel) -> Array:
  """Ring attention of one shard's queries (call inside shard_map over `axes`), `kernel` per chunk pair."""
  q_BLKGH = masks.group_queries(q_BLNH, k_BLKH.shape[2])
  out = _ring(q_BLKGH, k_BLKH, v_BLKH, seg_BL.astype(jnp.int32), masks.window_scalar(window), axes, shards,
              balanced, kernel)
  return masks.merge_groups(out)


# ---------------------------------------------------------------- all-gather


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _gathered(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, seg_BL: Array, kseg_BS: Array, window: Array,
              axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel) -> Array:
  return _gathered_fwd(q_BLKGH, k_BSKH, v_BSKH, seg_BL, kseg_BS, window, axes, shards, balanced, kernel)[0]


def _gathered_steps(attend: Callable[..., Tree], state: Tree, local: _Local) -> Tree:
  """state = attend(source, state, first) over the gathered blocks in the ring's order (the
  shard's own block first: its own pair schedule)."""
  state = attend(local.shard, state, True)
  def step(state: Tree, step: Array) -> tuple[Tree, None]:
    return attend((local.shard - step) % local.shards, state, False), None

  return jax.lax.scan(step, state, jnp.arange(1, local.shards))[0]


def _gathered_blocks(k_BSKH: Array, v_BSKH: Array, kseg_BS: Array, local: _Local) -> tuple[Array, ...]:
  """The gathered K/V cut into chunks: shard j's are j·count .. j·count + count - 1."""
  return tuple(_chunked(x, local.shards * local.q_c.shape[0]) for x in (k_BSKH, v_BSKH, kseg_BS))


def _source_block(blocks: tuple[Array, ...], source: Array, count: int) -> tuple[Array, Array, Array]:
  k_c, v_c, kseg_c = (jax.lax.dynamic_slice_in_dim(b, source * count, count) for b in blocks)
  return k_c, v_c, kseg_c


def _gathered_fwd(q_BLKGH: Array, k_BSKH: Array, v_BSKH: Array, seg_BL: Array, kseg_BS: Array, window: Array,
                  axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel
                  ) -> tuple[Array, tuple[Array, ...]]:
  local = _local(q_BLKGH, seg_BL, axes, shards, balanced)
  blocks, count = _gathered_blocks(k_BSKH, v_BSKH, kseg_BS, local), local.q_c.shape[0]

  def attend(source: Array, merged: tuple[Array, Array], first: bool) -> tuple[Array, Array]:
    return _pair_forward(kernel, local, _source_block(blocks, source, count), window, source, first, merged)

  out_BLKGH, lse_BKGL = _finished(q_BLKGH, _gathered_steps(attend, _empty(local.q_c), local))
  return out_BLKGH, (q_BLKGH, k_BSKH, v_BSKH, seg_BL, kseg_BS, window, out_BLKGH, lse_BKGL)


def _gathered_bwd(axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel,
                  residuals: tuple[Array, ...], do_BLKGH: Array) -> tuple[Array | None, ...]:
  q_BLKGH, k_BSKH, v_BSKH, seg_BL, kseg_BS, window, out_BLKGH, lse_BKGL = residuals
  local = _local(q_BLKGH, seg_BL, axes, shards, balanced)
  blocks, count = _gathered_blocks(k_BSKH, v_BSKH, kseg_BS, local), local.q_c.shape[0]
  backward_inputs = _backward_inputs(do_BLKGH, out_BLKGH, lse_BKGL, count)

  def attend(source: Array, grads: Grads, first: bool) -> Grads:
    dq_c, dk_all, dv_all = grads
    block = _source_block(blocks, source, count)
    zeros = jnp.zeros(block[0].shape, jnp.float32)
    dq_c, dk_c, dv_c = _pair_backward(kernel, local, block, window, source, first, backward_inputs,
                                      (dq_c, zeros, zeros))
    put = lambda total, part: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        total, jax.lax.dynamic_slice_in_dim(total, source * count, count) + part, source * count, 0)
    return dq_c, put(dk_all, dk_c), put(dv_all, dv_c)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
  grads = _gathered_steps(attend, (zeros(local.q_c), zeros(blocks[0]), zeros(blocks[1])), local)
  dq_BLKGH, dk_BSKH, dv_BSKH = (_unchunked(g) for g in grads)
  # The all-gather's transpose (a reduce-scatter) sums every shard's dK/dV of a block at its home.
  return (dq_BLKGH.astype(q_BLKGH.dtype), dk_BSKH.astype(k_BSKH.dtype), dv_BSKH.astype(v_BSKH.dtype), None, None,
          None)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gathered_shard(q_BLNH: Array, k_BLKH: Array, v_BLKH: Array, seg_BL: Array, window: masks.Window,
                   axes: tuple[str, ...], shards: int, balanced: bool, kernel: ring_blocks.BlockKernel) -> Array:
  """all_gather: one shard's queries over the whole K/V, gathered along the sequence axis, block by
  block (shard j's block), each chunk pair with `kernel` at its global offsets: the ring's pairs,
  in place of its rotations one all-gather (and a reduce-scatter of dK/dV in the backward)."""
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)
  q_BLKGH = masks.group_queries(q_BLNH, k_BLKH.shape[2])
  seg_BL = seg_BL.astype(jnp.int32)
  out = _gathered(q_BLKGH, gather(k_BLKH), gather(v_BLKH), seg_BL, gather(seg_BL), masks.window_scalar(window),
                  axes, shards, balanced, kernel)
  return masks.merge_groups(out)


# ---------------------------------------------------------------- all-to-all


LocalKernel = attention_kernels.AttentionKernel  # (q_BSNH, k_BSKH, v_BSKH, seg_BS, window, soft_cap) -> out


def all_to_all_shard(q_BLNH: Array, k_BLKH: Array, v_BLKH: Array, seg_BL: Array, window: masks.Window,
                     soft_cap: float, axes: tuple[str, ...], shards: int, balanced: bool,
                     attend: LocalKernel) -> Array:
  """Ulysses: [B, L, N, H] split over length -> [B, S, N / n, H] split over heads, local attention
  over the whole sequence with `attend`, and back. Query heads k * G .. k * G + G - 1 and key head
  k land on the same shard because both head axes split into n contiguous groups. With load
  balancing the gathered sequence is put back in natural order first (a static permutation), so
  `attend` keeps its ordinary causal / window / segment mask, and splash its block sparsity."""
  if q_BLNH.shape[2] % shards or k_BLKH.shape[2] % shards:
    raise ConfigError(f"context_parallel_strategy=all_to_all: {q_BLNH.shape[2]} query / {k_BLKH.shape[2]} "
                         f"key-value heads per shard do not split over {shards} sequence shards; use ring")
  to_heads = functools.partial(jax.lax.all_to_all, axis_name=axes, split_axis=2, concat_axis=1, tiled=True)
  q, k, v = to_heads(q_BLNH), to_heads(k_BLKH), to_heads(v_BLKH)
  seg = jax.lax.all_gather(seg_BL, axes, axis=1, tiled=True)
  if balanced:
    q, k, v, seg = (context_parallel.to_natural_order(x, shards) for x in (q, k, v, seg))
  out = attend(q, k, v, seg, window, soft_cap)
  if balanced:
    out = context_parallel.to_balanced_order(out, shards)
  return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)


# ---------------------------------------------------------------- dispatch


def context_parallel_attention(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: sharding.Rules, q_BLNH: Array,
                               k_BSKH: Array, v_BSKH: Array, segment_ids_BL: Array, window_size: masks.Window,
                               soft_cap: float) -> Array:
  """cfg's context_parallel_strategy over the length mesh axes: ring, all_gather (both with the
  platform's pair kernel) or all_to_all (with its full-sequence kernel)."""
  q_spec, kv_spec, seg_spec, axes = context_parallel.kernel_specs(mesh, rules, q_BLNH.shape, k_BSKH.shape, True)
  shards = math.prod(mesh.shape[a] for a in axes)
  balanced, strategy = cfg.attn.context_parallel_load_balance, cfg.attn.context_parallel_strategy
  if balanced and shards != cfg.attn.context_parallel_degree:
    raise ConfigError(f"context_parallel_load_balance=True ordered the batch for {cfg.attn.context_parallel_degree} "
                      f"sequence shards but attention's length is split {shards} ways (logical_axis_rules "
                      "activation_length); map activation_length to the sequence axis only")
  static_window = masks.is_static(window_size)
  platform = sharding.trace_platform()
  attend = attention_kernels.full_sequence_kernel(cfg, platform, q_BLNH.shape[1])
  chunk = q_BLNH.shape[1] // shards // (2 if balanced else 1)
  pair_kernel = attention_kernels.block_kernel(cfg, platform, chunk, window_size, soft_cap)

  def shard(q: Array, k: Array, v: Array, seg: Array, window_scalar: Array) -> Array:
    window = window_size if static_window else window_scalar
    if strategy == "ring":
      return ring_shard(q, k, v, seg, window, axes, shards, balanced, pair_kernel)
    if strategy == "all_to_all":
      return all_to_all_shard(q, k, v, seg, window, soft_cap, axes, shards, balanced, attend)
    return gathered_shard(q, k, v, seg, window, axes, shards, balanced, pair_kernel)

  window_operand = jnp.int32(0) if static_window else jnp.asarray(window_size, jnp.int32)
  return jax.shard_map(shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, jax.sharding.PartitionSpec()),
                       out_specs=q_spec, check_vma=False)(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window_operand)


# ---------------------------------------------------------------- the block schedule (load-balance accounting)


def tiles_per_shard(length: int, shards: int, block: int, balanced: bool, window: int | None = None) -> list[int]:
  """[block, block] score tiles each shard computes over a whole ring pass of a causal
  self-attention (the tiles the kernel's block ranges visit, summed over every chunk pair).
  Attention FLOPs per shard are proportional (4 · block² · H per tile and head, forward)."""
  local = length // shards
  win = jnp.int32(masks.NO_WINDOW if window is None else window)
  counts = []
  for shard in range(shards):
    total = 0
    q_starts = context_parallel.shard_chunk_starts(shard, local, shards, balanced)
    chunk = local // len(q_starts)
    bq = bkv = ring_blocks.fit(block, chunk)
    for step in range(shards):
      for k_start in context_parallel.shard_chunk_starts((shard - step) % shards, local, shards, balanced):
        for q_start in q_starts:
          for i in range(chunk // bq):
            lo, hi = flash_blocks.kv_block_range(jnp.int32(q_start - k_start + i * bq), bq, bkv, win, chunk // bkv)
            total += int(hi) - int(lo)
    counts.append(total)
  return counts
