"""Sequence (context) parallelism for attention: the shard_map specs, the load-balanced chunk
order and the batch reorder. The strategies (context_parallel_strategy: all_gather, the default,
ring, all_to_all) are in ring_attention.py: queries stay split along the length over the
`sequence` mesh axis and each shard attends with its queries' global positions, so causal masks,
windows and segment ids are those of the whole sequence.

all_gather gathers K/V over the axis (one collective that XLA overlaps with the projections; K/V
memory per device is that of the whole sequence, 2 · S · K · H per sequence); ring passes K/V
blocks around instead, so no device holds more than two.

Load balancing (context_parallel_load_balance): with a causal mask the shard holding the end of
the sequence does n times the work of the first. The batch is reordered once, before the model
(`balance_batch`: tokens, positions, segment ids and targets alike), into 2n chunks with shard i
holding chunks i and 2n - 1 - i, so every shard's causal work is equal. The per-token layers do
not care about order, RoPE reads the batch's own positions, the loss is a mean over tokens, and
attention kernels compute masks from each chunk's global start (`shard_chunk_starts`).

Legend: B batch, L local query length, S global length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from MaxText.platform import sharding
from MaxText.layers import masks
from MaxText.configuration.model_config import AttentionConfig

_Q_NAMES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_KV_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")


def _axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def kernel_specs(mesh: Mesh, rules: sharding.Rules, q_shape: tuple[int, ...], kv_shape: tuple[int, ...],
                 split_length: bool) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec, tuple[str, ...]]:
  """shard_map specs (q, k/v, segment ids) of an attention kernel and the length mesh axes.

  Heads stay split only when query and key/value heads split alike (else a shard's query heads
  would not line up with its key/value heads); without `split_length` the length is whole.
  """
  q_spec = sharding.logical_to_mesh_spec(_Q_NAMES, rules, mesh, q_shape)
  kv_spec = sharding.logical_to_mesh_spec(_KV_NAMES, rules, mesh, kv_shape)
  heads = q_spec[2] if q_spec[2] == kv_spec[2] else None
  length = q_spec[1] if split_length and q_spec[1] == kv_spec[1] else None
  batch = q_spec[0]
  return (PartitionSpec(batch, length, heads, None), PartitionSpec(batch, length, heads, None),
          PartitionSpec(batch, length), _axes(length))


def length_shards(mesh: Mesh, rules: sharding.Rules, q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> int:
  """How many shards the attention length is split into (1 = no context parallelism)."""
  axes = kernel_specs(mesh, rules, q_shape, kv_shape, split_length=True)[3]
  return math.prod(mesh.shape[a] for a in axes)


def _window_operand(window_size: masks.Window) -> jax.Array:
  """A traced window enters shard_map as a replicated operand; a static one stays a Python value
  in the kernel's closure (this placeholder unused)."""
  return jnp.int32(0) if masks.is_static(window_size) else jnp.asarray(window_size, jnp.int32)


def per_shard_attention(kernel: Callable[..., jax.Array], mesh: Mesh, rules: sharding.Rules, q_BLNH: jax.Array,
                        k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                        window_size: masks.Window, soft_cap: float) -> jax.Array:
  """A single-device kernel (splash) run per batch/head shard, the length whole on each."""
  q_spec, kv_spec, seg_spec, _ = kernel_specs(mesh, rules, q_BLNH.shape, k_BSKH.shape, split_length=False)
  static_window = masks.is_static(window_size)

  def shard(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, seg_BL: jax.Array,
            window_scalar: jax.Array) -> jax.Array:
    return kernel(q_BLNH, k_BSKH, v_BSKH, seg_BL, window_size if static_window else window_scalar, soft_cap)

  return jax.shard_map(shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, PartitionSpec()),
                       out_specs=q_spec, check_vma=False)(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                             _window_operand(window_size))


def merges_blocks(attn: AttentionConfig) -> bool:
  """Whether the configured strategy needs attention=flash (per-block attention merged by
  log-sum-exp, ring_attention.py): a ring or all-to-all strategy, or load balancing, with the
  sequence split. The plain all_gather also runs there under flash, but dot_product and
  cudnn_flash can run it too (XLA partitions them)."""
  return attn.context_parallel_degree > 1 and (attn.context_parallel_strategy != "all_gather"
                                              or attn.context_parallel_load_balance)


def shard_chunk_starts(shard: int | jax.Array, local_length: int, shards: int, balanced: bool) -> list[int | jax.Array]:
  """Global start positions of the contiguous chunks shard `shard` holds (its local tokens in
  order): one chunk of local_length, or with balancing two halves, chunks shard and 2n - 1 - shard."""
  if not balanced:
    return [shard * local_length]
  half = local_length // 2
  return [shard * half, (2 * shards - 1 - shard) * half]


def balanced_order(length: int, shards: int) -> np.ndarray:
  """Global position held at each index of the balanced order (shard i: chunks i, 2n - 1 - i)."""
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([chunks[c] for i in range(shards) for c in (i, 2 * shards - 1 - i)])


def to_natural_order(x: jax.Array, shards: int) -> jax.Array:
  """A whole sequence (axis 1) in balanced order back to natural order."""
  parts = x.reshape(x.shape[:1] + (shards, 2, -1) + x.shape[2:])
  first, second = parts[:, :, 0], jnp.flip(parts[:, :, 1], axis=1)
  return jnp.concatenate([first, second], axis=1).reshape(x.shape)


def to_balanced_order(x: jax.Array, shards: int) -> jax.Array:
  """A whole sequence (axis 1) in natural order to balanced order (the inverse of to_natural_order)."""
  chunks = x.reshape(x.shape[:1] + (2 * shards, -1) + x.shape[2:])
  paired = jnp.stack([chunks[:, :shards], jnp.flip(chunks[:, shards:], axis=1)], axis=2)
  return paired.reshape(x.shape)


def is_balanced(attn: AttentionConfig) -> bool:
  """Whether training batches arrive in balanced order (`balance_batch` reordered them)."""
  return attn.context_parallel_load_balance and attn.context_parallel_degree > 1


def sequence_index(attn: AttentionConfig, length: int) -> jax.Array:
  """[1, length]: the natural index of each slot of a training sequence, what a layer that builds
  its own causal mask must compare (0 .. length - 1 unless the batch is in balanced order)."""
  if not is_balanced(attn):
    return jnp.arange(length)[None]
  return jnp.asarray(balanced_order(length, attn.context_parallel_degree), jnp.int32)[None]


def sequence_self_mask(attn: AttentionConfig, segment_ids_BL: jax.Array) -> jax.Array:
  """masks.self_mask of a training sequence in whichever order `balance_batch` left it."""
  index_1L = sequence_index(attn, segment_ids_BL.shape[1])
  return masks.allowed(index_1L, index_1L, segment_ids_BL, segment_ids_BL)


def in_natural_order(attn: AttentionConfig, fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
  """fn(*xs) for a layer that reads the sequence in order (a recurrence, a causal conv): its [B, L, ...]
  inputs put back in natural order and its output in the batch's balanced order again."""
  if not is_balanced(attn):
    return fn(*xs)
  shards = attn.context_parallel_degree
  return to_balanced_order(fn(*(to_natural_order(x, shards) for x in xs)), shards)


def balance_batch(batch: dict[str, jax.Array], attn: AttentionConfig, length: int) -> dict[str, jax.Array]:
  """The batch in balanced order when load balancing is on (every [B, length, ...] entry alike,
  so targets stay next to their inputs; length is max_target_length), else unchanged."""
  if not is_balanced(attn):
    return batch
  shards = attn.context_parallel_degree
  return {name: to_balanced_order(x, shards) if x.ndim >= 2 and x.shape[1] == length else x
          for name, x in batch.items()}
