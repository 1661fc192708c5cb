"""Precompute a distillation teacher's top-k log-probs on the batches a student run will read, once:

    python3 -m MaxText.generate_teacher_top_k configs/base.yml objective=distill <the student run's data keys> \\
        distill_teacher_path=TEACHER distill_top_k=K steps=N distill_top_k_path=DIR

The student then trains with the same keys (distill_top_k_path=DIR; distill_teacher_path is not
read): each batch comes with the teacher's top K per position from DIR instead of a teacher
forward pass beside the student, so a teacher too large to sit beside it is run once, here, on
whatever devices hold it. The batches are the student's own: this tool opens the run's data
iterator (same tokenizer, packing, shuffle and order; the eval split's first eval_steps batches
too when the run evaluates), for `steps` batches. input_pipeline/teacher_top_k.py holds the format
and the checks the student makes against it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # `python3 MaxText/generate_teacher_top_k.py`
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax
import jax.numpy as jnp

from MaxText import startup
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError, run_cli
from MaxText.input_pipeline import create_data_iterator, create_eval_iterator, teacher_top_k
from MaxText.input_pipeline.batch_spec import FIELDS
from MaxText.input_pipeline.pipeline import HostShard, host_shard
from MaxText.paths import storage
from MaxText.platform import sharding
from MaxText.platform.distributed import log
from MaxText.training import model_assembly
from MaxText.training.objectives import distill_loss
from MaxText.training.objectives.distill import teacher_config


def _check(config: Config) -> None:
  d = config.distill
  if not (d.distill_teacher_path and d.top_k_from_files):
    raise ConfigError("generate_teacher_top_k writes the teacher's top k on a distillation run's batches: it needs "
                      "objective=distill (or distill_sft), distill_teacher_path (the teacher), distill_top_k > 0 (k) "
                      "and distill_top_k_path (the directory to write)")
  if storage.exists(d.distill_top_k_path):
    raise UserError(f"{d.distill_top_k_path} already exists; choose a new distill_top_k_path or remove it first")
  if storage.is_remote(d.distill_top_k_path):
    raise ConfigError(f"distill_top_k_path={d.distill_top_k_path}: write the files to a local (or gcsfuse-mounted) "
                      "directory; runs memory-map them")
  problem = _unwritable_parent(d.distill_top_k_path)
  if problem:  # now, not at the first batch after the teacher has loaded
    raise UserError(f"distill_top_k_path={d.distill_top_k_path} cannot be written: {problem}; choose a directory "
                    "this process can create")
  attn = config.model.attn
  if attn.context_parallel_load_balance and attn.context_parallel_degree > 1:
    raise ConfigError("generate_teacher_top_k runs the teacher on rows in their own order; set "
                      "context_parallel_load_balance=False for it (the student may keep it)")


def _unwritable_parent(path: str) -> str:
  """Why no directory can be made at `path` (its parent made, a file written there), or ""."""
  probe = storage.join(storage.parent(storage.resolve(path)), f".write-probe-{os.getpid()}")
  try:
    storage.write_bytes(probe, b"")  # makes the parent too
  except UserError as e:
    return str(e).split(": ", 1)[-1]
  storage.remove_tree(probe)
  return ""


def _write_split(name: str, batches: Any, num_batches: int, top_k: Callable[..., Any], params: Any, directory: str,
                 shard: HostShard, config: Config) -> None:
  writer = teacher_top_k.Writer(directory, name, shard, config.data.max_target_length, config.distill.distill_top_k,
                                num_batches)
  for number in range(num_batches):
    batch = next(batches)
    logps, indices = top_k(params, batch)
    mine = {field: teacher_top_k.host_rows(batch[field], shard) for field in FIELDS}
    try:
      writer.add(mine, teacher_top_k.host_rows(indices, shard), teacher_top_k.host_rows(logps, shard))
      if number + 1 == num_batches:
        writer.close()
    except OSError as e:  # a full disk, a quota: the files so far are of no use without the manifest
      raise UserError(f"cannot write the teacher's top k to {directory} ({e.strerror or e}) at {name} batch "
                      f"{number + 1} of {num_batches}; free space there (or choose another distill_top_k_path), "
                      "remove it and run again") from None
    if (number + 1) % 100 == 0 or number + 1 == num_batches:
      log(f"{name}: {number + 1} of {num_batches} batches")


def generate(config: Config, devices: Sequence[jax.Device] | None = None) -> str:
  """Writes distill_top_k_path (the teacher on a mesh of `devices`, default all); returns it."""
  _check(config)
  d, data = config.distill, config.data
  on_mesh, params = model_assembly.assemble_model(teacher_config(config), d.distill_teacher_path, devices=devices)
  batch_sharding = sharding.batch_sharding(on_mesh.mesh, config.data.batch_axes)
  shard = host_shard(batch_sharding, data.global_batch_size, data.max_target_length)
  # The replica of a data shard with the lowest process index writes it.
  writes = all(host_shard(batch_sharding, data.global_batch_size, data.max_target_length, p).index != shard.index
               for p in range(jax.process_index()))
  out = sharding.for_rank(batch_sharding, 3)

  @jax.jit
  def top_k(teacher: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    with sharding.activation_sharding(on_mesh.mesh, config.mesh.logical_axis_rules):
      logits_BLV = on_mesh.spec.apply(teacher, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    targets = distill_loss.teacher_targets(logits_BLV, 1.0, d.distill_top_k)
    assert targets.indices is not None
    return (jax.lax.with_sharding_constraint(targets.logps, out),
            jax.lax.with_sharding_constraint(targets.indices.astype(jnp.int32), out))

  # The student's own iterators, without the files this writes.
  plain = Config({**config.values, "distill_top_k_path": ""}, config.target)
  splits = {teacher_top_k.TRAIN: (create_data_iterator(plain, on_mesh.mesh), config.run.steps)}
  if config.run.eval_interval > 0:
    eval_batches = create_eval_iterator(plain, on_mesh.mesh)
    if eval_batches is not None:
      splits[teacher_top_k.EVAL] = (eval_batches, data.eval_steps)
  directory = d.distill_top_k_path
  for name, (batches, count) in splits.items():
    if writes:
      _write_split(name, batches, count, top_k, params, directory, shard, config)
    else:  # a replica still steps through the batches: every process runs every collective
      for _ in range(count):
        jax.block_until_ready(top_k(params, next(batches)))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("teacher top-k written")
  if jax.process_index() == 0:
    teacher_top_k.write_manifest(directory, data, d.distill_top_k, shard.count, shard.rows,
                                 {name: count for name, (_, count) in splits.items()}, d.distill_teacher_path)
  log(f"wrote the teacher's top {d.distill_top_k} of {', '.join(f'{c} {n}' for n, (_, c) in splits.items())} "
      f"batches ({data.global_batch_size} x {data.max_target_length} tokens) to {directory}")
  return directory


TOOL = startup.Tool("generate_teacher_top_k", joins_job=True)

main = startup.config_main(TOOL, lambda config: generate(config))


if __name__ == "__main__":
  run_cli(main)
