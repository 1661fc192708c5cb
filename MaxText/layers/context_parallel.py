"""Sequence (context) parallelism for attention: queries stay split along the length over the
`sequence` mesh axis, keys and values are all-gathered over it inside shard_map, and each shard
attends with its queries' global positions (offset = shard index × local length), so causal
masks, windows and segment ids are those of the whole sequence.

Why all-gather rather than a ring of ppermutes: one collective that XLA overlaps with the
projections, simple causal offsets; K/V memory per device is that of the whole sequence
(2 · S · K · H per sequence, small next to the L × S scores it never materialises).

Legend: B batch, L local query length, S global length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from MaxText import sharding
from MaxText.layers import masks

_Q_NAMES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_KV_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")


def _axes(entry: Any) -> tuple[str, ...]:
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


LocalKernel = Callable[..., jax.Array]  # (q, k, v, q_seg, kv_seg, window, soft_cap, q_offset) -> out


def sequence_parallel_attention(local_kernel: LocalKernel, mesh: Mesh, rules: sharding.Rules, q_BLNH: jax.Array,
                                k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                                window_size: masks.Window, soft_cap: float) -> jax.Array:
  """Attention with queries split over the length mesh axes and K/V gathered over them."""
  q_spec, kv_spec, seg_spec, length_axes = kernel_specs(mesh, rules, q_BLNH.shape, k_BSKH.shape, split_length=True)
  static_window = masks.is_static(window_size)

  def shard(q_BLNH, k_BLKH, v_BLKH, seg_BL, window_scalar):
    gather = functools.partial(jax.lax.all_gather, axis_name=length_axes, axis=1, tiled=True)
    offset = jax.lax.axis_index(length_axes) * q_BLNH.shape[1]
    return local_kernel(q_BLNH, gather(k_BLKH), gather(v_BLKH), seg_BL, gather(seg_BL),
                        window_size if static_window else window_scalar, soft_cap, offset)

  return jax.shard_map(shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, PartitionSpec()),
                       out_specs=q_spec, check_vma=False)(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                             _window_operand(window_size))


def per_shard_attention(kernel: Callable[..., jax.Array], mesh: Mesh, rules: sharding.Rules, q_BLNH: jax.Array,
                        k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                        window_size: masks.Window, soft_cap: float) -> jax.Array:
  """A single-device kernel (splash) run per batch/head shard, the length whole on each."""
  q_spec, kv_spec, seg_spec, _ = kernel_specs(mesh, rules, q_BLNH.shape, k_BSKH.shape, split_length=False)
  static_window = masks.is_static(window_size)

  def shard(q_BLNH, k_BSKH, v_BSKH, seg_BL, window_scalar):
    return kernel(q_BLNH, k_BSKH, v_BSKH, seg_BL, window_size if static_window else window_scalar, soft_cap)

  return jax.shard_map(shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, PartitionSpec()),
                       out_specs=q_spec, check_vma=False)(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                                                             _window_operand(window_size))
