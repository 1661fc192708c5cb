"""A learnable synthetic dataset, generated on device, deterministic per (seed, step).

Each sequence is an arithmetic progression modulo the vocabulary:
    x_t = (start + t * stride) mod vocab_size,   stride ~ U{1..max_stride}.
Only the first target is uncertain (it depends on the unseen stride); every later
token follows from the two before it. A decoder that reads the stride from its
context drives the loss from ln(vocab_size) towards ln(max_stride) / length; one
that only learns bigram statistics stalls near ln(max_stride), so the data is
also a quick check that attention works.
"""

from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from MaxText.configuration.data_config import DataConfig
from MaxText.input_pipeline.batch_spec import DTYPE

Batch = dict[str, jax.Array]


def make_batch(cfg: DataConfig, step: jax.Array, batch_size: int) -> Batch:
  """One global batch of the declared layout (input_pipeline.batch_spec): inputs, targets,
  positions and segment ids, all [B, L] int32."""
  key = jax.random.fold_in(jax.random.key(cfg.data_shuffle_seed), step)
  start_key, stride_key = jax.random.split(key)
  length = cfg.max_target_length
  start_B = jax.random.randint(start_key, (batch_size, 1), 0, cfg.vocab_size)
  stride_B = jax.random.randint(stride_key, (batch_size, 1), 1, cfg.synthetic_max_stride + 1)
  # length + 1 tokens so inputs and targets are the same sequence shifted by one.
  tokens = (start_B + jnp.arange(length + 1)[None, :] * stride_B) % cfg.vocab_size
  tokens = tokens.astype(DTYPE)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=DTYPE), (batch_size, length))
  segments = jnp.ones((batch_size, length), DTYPE)
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "inputs_position": positions,
      "inputs_segmentation": segments,
      "targets_segmentation": segments,
  }


class SyntheticIterator:
  """Yields sharded global batches; `step` is the whole iterator state (resumable)."""

  def __init__(self, cfg: DataConfig, sharding: NamedSharding, start_step: int = 0, seed_offset: int = 0):
    self.cfg, self.step = cfg, start_step
    self._seed_offset = seed_offset
    self._make = jax.jit(lambda s: make_batch(cfg, s, cfg.global_batch_size), out_shardings=sharding)

  def reset(self, step: int = 0) -> "SyntheticIterator":
    """Rewinds to `step` without recompiling the generator (eval reuses one iterator)."""
    self.step = step
    return self

  def get_state(self) -> dict[str, int]:
    """What a checkpoint stores to resume the exact batch sequence."""
    return {"step": self.step}

  def set_state(self, state: dict[str, int]) -> None:
    self.step = int(state["step"])

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    batch = self._make(jnp.asarray(self.step + self._seed_offset, jnp.uint32))
    self.step += 1
    return batch
