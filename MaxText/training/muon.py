"""Muon (opt_type=muon): Newton-Schulz orthogonalised momentum for the weight matrices, AdamW for the rest.

Which parameters are matrices, and which axes are a matrix's rows and columns, follows from their logical axis
names: the stacked axes (`layers`, `exp`) are batch axes, each slice orthogonalised on its own; a parameter with a
`vocab` axis (the token table, the output head), a parameter with fewer than two other axes (norm scales, biases),
and any that is not a projection's kernel or LoRA adapter (learned position tables, multi-head biases, depthwise
convolutions) take AdamW, as the reference implementations do. Of the other axes a kernel reads its input on its
leading ones: an output projection ([heads, kv, embed]) reduces over all but its last axis, every other kernel over
its first; a LoRA adapter lora_a [in dims..., r] over all but its last, lora_b [r, out dims...] over its first.

The orthogonalisation is optax's (`optax.contrib.muon`); the AdamW branch is the run's own AdamW
(`optimizers.create_optimizer`), so opt_type=muon changes nothing for the non-matrix parameters. Under jit the
Newton-Schulz matmuls run on the momentum as sharded as its parameter: XLA gathers what each product needs, the
same collectives an FSDP matmul of that weight costs, five iterations of three products a step.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import optax
from optax import contrib

from MaxText.configuration.config_groups import OptimConfig

Params = dict[str, Any]  # nested dict of arrays (masked leaves where a partition leaves them out)

BATCH_AXES = frozenset({"layers", "exp"})  # stacked copies of one matrix: scanned layers, experts
MATRIX_LEAVES = frozenset({"kernel", "lora_a", "lora_b"})  # a DenseGeneral's weights and its LoRA adapter
ADAM, MUON = "adam", "muon"


def dimension_numbers(names: Sequence[str | None]) -> contrib.MuonDimensionNumbers | None:
  """How Muon sees a parameter with these logical axis names, or None: AdamW's."""
  axes = [i for i, name in enumerate(names) if name not in BATCH_AXES]
  if "vocab" in names or len(axes) < 2:
    return None
  if names[axes[-1]] == "embed" and names[axes[0]] != "embed":  # an output projection: [..., embed]
    return contrib.MuonDimensionNumbers(reduction_axis=tuple(axes[:-1]), output_axis=(axes[-1],))
  return contrib.MuonDimensionNumbers(reduction_axis=(axes[0],), output_axis=tuple(axes[1:]))


def _dims_at(logical_names: dict[str, Any], path: tuple[Any, ...]) -> contrib.MuonDimensionNumbers | None:
  """`dimension_numbers` of the parameter at `path`, which only a projection's weights (MATRIX_LEAVES) can take.
  Others with two non-batch axes are no matrix: a table read by index (an Embed's `embedding`, a learned position
  table's rows being positions, not `vocab`), a multi-head projection's bias [heads, kv], a linear-attention
  layer's short depthwise convolution [taps, heads, kv] (a filter per channel)."""
  if not path or getattr(path[-1], "key", None) not in MATRIX_LEAVES:
    return None
  node: Any = logical_names
  for entry in path:
    node = node[entry.key]
  names = tuple(node)
  dims = dimension_numbers(names)
  if dims is None or path[-1].key == "kernel":
    return dims
  # An adapter is [in dims..., r] (lora_a) or [r, out dims...] (lora_b): its rank axis, unnamed, tells nothing
  # of which side is the input, so the kernel's rule would read an output projection's lora_a [heads, kv, r] as
  # a heads x (kv r) matrix.
  axes = [i for i, name in enumerate(names) if name not in BATCH_AXES]
  if path[-1].key == "lora_a":
    return contrib.MuonDimensionNumbers(reduction_axis=tuple(axes[:-1]), output_axis=(axes[-1],))
  return contrib.MuonDimensionNumbers(reduction_axis=(axes[0],), output_axis=tuple(axes[1:]))


def muon(cfg: OptimConfig, schedule: optax.Schedule, adamw: optax.GradientTransformation,
         logical_names: dict[str, Any]) -> optax.GradientTransformation:
  """Muon on the matrices, `adamw` on the rest; `logical_names`: the model's parameter names (ModelSpec)."""

  def dims(params: Params) -> Params:  # params may be masked (LoRA, frozen parts): the names follow their paths
    return jax.tree_util.tree_map_with_path(lambda path, _: _dims_at(logical_names, path), params)

  def labels(params: Params) -> Params:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: ADAM if _dims_at(logical_names, path) is None else MUON, params)

  orthogonalised = contrib.muon(
      schedule, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta, weight_decay=cfg.adam_weight_decay,
      muon_weight_dimension_numbers=dims, consistent_rms=cfg.muon_consistent_rms or None)
  return optax.partition({MUON: orthogonalised, ADAM: adamw}, labels)
