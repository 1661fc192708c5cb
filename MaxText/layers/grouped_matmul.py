"""Grouped matmuls for the MoE experts: rows sorted by group, one weight matrix per group.

`x [M, K] · w [G, K, N]` with `group_sizes [G]`: rows 0..g0-1 use w[0], the next g1 rows w[1],
and so on; rows after the last group come out as zeros (the MoE receive buffers are padded).

Kernels are looked up by name in GROUPED_MATMULS, as attention kernels are (attention.py):
- `ragged_dot`: `jax.lax.ragged_dot`, every platform. XLA lowers it to a grouped GEMM on GPU
  and TPU; on CPU to a masked dense product over all groups (G times the routed FLOPs).
- `megablox`: the Pallas TPU grouped-matmul kernel that ships with JAX
  (`jax.experimental.pallas.ops.tpu.megablox`, maintained there, with its own VJP); TPU only.
- `auto`: megablox on TPU, ragged_dot elsewhere.
The choice is made when the layer is traced, for the mesh's platform (a TPU topology compiled
ahead of time on a CPU gets megablox).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from MaxText.platform import accelerators
from MaxText.errors import ConfigError

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# Megablox tiles rows in blocks of this many; the row count is padded up to a multiple of it.
_MEGABLOX_TILE = 128


def ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32))


def megablox(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, *, interpret: bool = False) -> jax.Array:
  """The Pallas grouped matmul; `interpret` runs it through the Pallas interpreter (tests on CPU)."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # imported lazily: Pallas TPU is only needed here

  rows, k = x_MK.shape
  n = w_GKN.shape[-1]
  tile_m = min(_MEGABLOX_TILE, _round_up(rows, 8))
  padded = _round_up(rows, tile_m)
  x_pad = jnp.pad(x_MK, ((0, padded - rows), (0, 0))) if padded != rows else x_MK
  tiling = (tile_m, min(k, _MEGABLOX_TILE), min(n, _MEGABLOX_TILE))
  # gmm leaves rows after the last group unwritten, forward and in the input's gradient: mask
  # both (through `where` on the way in and out), so they are zeros as with ragged_dot.
  valid = (jnp.arange(padded) < jnp.sum(group_sizes_G))[:, None]
  x_pad = jnp.where(valid, x_pad, jnp.zeros((), x_pad.dtype))
  out = gmm(x_pad, w_GKN, group_sizes_G.astype(jnp.int32), x_MK.dtype, tiling, None, None, False, interpret)
  return jnp.where(valid, out, jnp.zeros((), out.dtype))[:rows]


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


GROUPED_MATMULS: dict[str, GroupedMatmul] = {"ragged_dot": ragged_dot, "megablox": megablox}


def annotates_vma(matmul: GroupedMatmul) -> bool:
  """Whether the kernel says how its output varies over a shard_map's mesh axes (megablox's
  Pallas call does not, so a shard_map around it runs with check_vma=False)."""
  return getattr(matmul, "func", matmul) is not megablox


def select(name: str, platform: str) -> GroupedMatmul:
  """The kernel `moe_grouped_matmul=name` runs on `platform`; one ConfigError line when the
  platform lacks it."""
  on_tpu = accelerators.platform_family(platform) == "tpu"
  if name == "auto":
    name = "megablox" if on_tpu else "ragged_dot"
  if name == "megablox" and not on_tpu:
    raise ConfigError(f"moe_grouped_matmul=megablox is a TPU (Pallas Mosaic) kernel but this program is for "
                      f"{platform}; use moe_grouped_matmul=auto or ragged_dot")
  return GROUPED_MATMULS[name]
