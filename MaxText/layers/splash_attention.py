"""attention=flash on TPU: the Pallas splash-attention kernel shipped with JAX.

The kernel runs per device under shard_map (batch over the batch mesh axes, heads over
`tensor`); its masks are static, so a traced window (a scanned stack mixing local and global
layers) selects between a local and a global kernel with lax.cond.

Legend: B batch, L length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from MaxText.configuration.model_config import AttentionBlocks
from MaxText.errors import ConfigError
from MaxText.layers import masks


def block_sizes(blocks: AttentionBlocks, length: int) -> splash.BlockSizes:
  """The configured tiles, shrunk to the sequence for short sequences. With sa_use_fused_bwd_kernel
  the dK/dV pass also yields dQ, so the dQ pass and its tiles are not used."""
  fit = lambda size: min(size, length)  # noqa: E731
  sizes = dict(block_q=fit(blocks.sa_block_q), block_kv=fit(blocks.sa_block_kv),
               block_kv_compute=fit(blocks.sa_block_kv_compute), block_q_dkv=fit(blocks.sa_block_q_dkv),
               block_kv_dkv=fit(blocks.sa_block_kv_dkv), block_kv_dkv_compute=fit(blocks.sa_block_kv_dkv_compute))
  if not blocks.sa_use_fused_bwd_kernel:
    sizes.update(block_q_dq=fit(blocks.sa_block_q_dq), block_kv_dq=fit(blocks.sa_block_kv_dq))
  for name, size in sizes.items():
    if length % size or size % 128:
      raise ConfigError(f"attention=flash on TPU (splash) needs max_target_length ({length}) to be a multiple of "
                        f"sa_{name} ({size}) and every block a multiple of 128; adjust the sa_* block sizes")
  return splash.BlockSizes(**sizes, use_fused_bwd_kernel=blocks.sa_use_fused_bwd_kernel)


def tiles(blocks: AttentionBlocks, length: int) -> bool:
  """Whether the configured tiles divide `length` (else callers use another kernel)."""
  try:
    block_sizes(blocks, length)
  except ConfigError:
    return False
  return True


def _mask(length: int, window: int | None, num_heads: int) -> splash_mask.MultiHeadMask:
  one: splash_mask.Mask
  if window is None or window >= length:
    one = splash_mask.CausalMask((length, length))
  else:
    one = splash_mask.LocalMask((length, length), window_size=masks.local_window_bounds(window), offset=0)
  return splash_mask.MultiHeadMask((one,) * num_heads)


def _run(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array, window: int | None,
         soft_cap: float, blocks: AttentionBlocks, interpret: bool) -> jax.Array:
  _, length, num_q, _ = q_BLNH.shape
  kernel = splash.make_splash_mha_single_device(  # GQA: N query heads over K key/value heads
      mask=_mask(length, window, num_q), block_sizes=block_sizes(blocks, length),
      attn_logits_soft_cap=soft_cap if soft_cap > 0 else None, interpret=interpret)
  q_BNLH, k_BKSH, v_BKSH = (x.swapaxes(1, 2) for x in (q_BLNH, k_BSKH, v_BSKH))
  segments = splash.SegmentIds(q=segment_ids_BL.astype(jnp.int32), kv=segment_ids_BL.astype(jnp.int32))
  out_BNLH = jax.vmap(kernel)(q_BNLH, k_BKSH, v_BKSH, segments)
  return out_BNLH.swapaxes(1, 2)


def splash_attention(q_BLNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BL: jax.Array,
                     window_size: masks.Window, soft_cap: float, *, blocks: AttentionBlocks,
                     local_window: int | None = None, interpret: bool = False) -> jax.Array:
  """Splash attention on one device's shard. A traced `window_size` is either `local_window` or
  "no window" (attention.layer_window_size); each gets its own static-mask kernel."""
  run = lambda window: _run(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, window, soft_cap, blocks, interpret)  # noqa: E731
  if masks.is_static(window_size):
    return run(window_size)
  if local_window is None:
    raise ConfigError("attention=flash on TPU needs a static window size or sliding_window_size for a traced one")
  return jax.lax.cond(masks.is_windowed(jnp.asarray(window_size)), lambda: run(local_window), lambda: run(None))
