"""Input pipelines: `create_data_iterator(config, mesh)` is the one front door."""

from __future__ import annotations

from jax.sharding import Mesh

from MaxText.input_pipeline.synthetic import Batch, SyntheticIterator
from MaxText.sharding import batch_sharding

# Eval batches come from a disjoint part of the synthetic stream.
_EVAL_SEED_OFFSET = 1 << 30


def create_data_iterator(config, mesh: Mesh, start_step: int = 0) -> SyntheticIterator:
  """The training iterator for `config.data`, producing batches sharded by `data_sharding`."""
  sharding = batch_sharding(mesh, config.mesh.data_sharding)
  return SyntheticIterator(config.data, sharding, start_step=start_step)


def create_eval_iterator(config, mesh: Mesh) -> SyntheticIterator:
  sharding = batch_sharding(mesh, config.mesh.data_sharding)
  return SyntheticIterator(config.data, sharding, seed_offset=_EVAL_SEED_OFFSET)


__all__ = ["Batch", "create_data_iterator", "create_eval_iterator"]
