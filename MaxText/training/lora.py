"""LoRA: low-rank adapters trained beside frozen base weights (`lora_rank` > 0).

The adapters are ordinary parameters of the projections PEFT's names select
(`lora_target_modules`; model_checks.lora_targets maps them to ours): `lora_a` and `lora_b` in a
`DenseGeneral` (layers/linears.py), which adds lora_scale · (x · lora_a) · lora_b to its output,
lora_scale = lora_alpha / lora_rank as PEFT's default (not rsLoRA). They live in the one params
tree, so checkpoints, resume and shardings treat them like any weight; this module says which
leaves they are and keeps everything else frozen:

  * `AdapterPartition` is the optimizer's partition (optimizers.Updater): the optimizer
    (`trainable_only`) holds state only for the adapters, the train step differentiates only
    them (`split` / `combine`) and puts the base weights back as they were, bitwise;
  * `adapters_off` is the base model's function with the same tree (e.g. a DPO reference);
  * `merge` folds the adapters into their base kernels for a plain model (params-only export).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from MaxText.configuration.model_config import ModelConfig
from MaxText.layers import linears
from MaxText.training.optimizers import FrozenSubtrees, Params, Partition, TrainAll, TrainedSubtrees

ADAPTER_KEYS = ("lora_a", "lora_b")
TRAIN, FROZEN = "lora", "frozen"


def is_adapter(path: tuple[object, ...]) -> bool:
  """Whether a parameter's tree path (from jax.tree_util) ends in an adapter leaf."""
  last = path[-1] if path else None
  return getattr(last, "key", None) in ADAPTER_KEYS


def has_adapters(params: Mapping[str, Any]) -> bool:
  """Whether a nested dict of parameters (or of their checkpoint metadata) holds adapter leaves."""
  return any(key in ADAPTER_KEYS or (isinstance(value, Mapping) and has_adapters(value))
             for key, value in params.items())


def split(params: Params) -> tuple[Params, Params]:
  """(adapters, everything else): two nested dicts with the same nesting, each holding only its leaves."""
  adapters: Params = {}
  frozen: Params = {}
  for key, value in params.items():
    if isinstance(value, dict):
      a, f = split(value)
      if a:
        adapters[key] = a
      if f:
        frozen[key] = f
    elif key in ADAPTER_KEYS:
      adapters[key] = value
    else:
      frozen[key] = value
  return adapters, frozen


def combine(adapters: Params, frozen: Params) -> Params:
  """Inverse of `split`."""
  out = dict(frozen)
  for key, value in adapters.items():
    out[key] = combine(value, frozen.get(key, {})) if isinstance(value, dict) else value
  return out


def labels(params: Params) -> dict[str, Any]:
  """TRAIN for adapter leaves, FROZEN for the rest (optax.multi_transform's labels)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: TRAIN if is_adapter(path) else FROZEN, params)


def trainable_only(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer` on the adapters; the base weights get zero updates and no optimizer state at
  all (multi_transform masks them out of the inner state: no Adam moments for frozen leaves),
  and clipping by global norm sees the adapters' gradients only."""
  return optax.multi_transform({TRAIN: optimizer, FROZEN: optax.set_to_zero()}, labels)


def adapters_off(params: Params) -> Params:
  """The same tree computing the base model: every lora_b zero, so each adapter adds exactly 0."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if getattr(path[-1], "key", None) == "lora_b" else x, params)


class AdapterPartition:
  """The adapters train; every other weight is frozen, and with the adapters off gives the
  starting model (adapters start with lora_b = 0)."""

  trains_everything = False
  frozen_gives_base_model = True

  def split(self, params: Params) -> tuple[Params, Params]:
    return split(params)

  def combine(self, trainable: Params, frozen: Params) -> Params:
    return combine(trainable, frozen)

  def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    return trainable_only(inner)

  def base_model(self, params: Params) -> Params:
    return adapters_off(params)


def partition_for(cfg: ModelConfig) -> Partition:
  """Which parameters train: the adapters with lora_rank > 0 (which leaves a vision tower frozen
  too); DeepSeek-V3.2's lightning indexers alone with indexer_warmup (its dense warm-up stage);
  else all but the vision parts freeze_vision_encoder / freeze_multimodal_projector name;
  else all of them."""
  if cfg.lora.lora_rank > 0:
    return AdapterPartition()
  if cfg.mla.indexer_warmup:
    return TrainedSubtrees(["indexer"], unread=True)
  frozen = [name for name, on in (("vision_encoder", cfg.vision.freeze_vision_encoder),
                                   ("multimodal_projector", cfg.vision.freeze_multimodal_projector)) if on]
  return FrozenSubtrees(frozen) if frozen else TrainAll()


def merge(params: Params, lora_scale: float) -> Params:
  """A plain model's parameters: every adapted kernel becomes kernel + lora_scale · lora_a · lora_b
  (in float32, cast back to the kernel's dtype) and the adapter leaves are dropped. Works on
  scanned stacks too (a leading layer dim on all three)."""
  out: Params = {}
  for key, value in params.items():
    if key in ADAPTER_KEYS:
      continue
    if isinstance(value, dict):
      out[key] = merge(value, lora_scale)
    else:
      out[key] = value
  if "lora_a" in params and "kernel" in params:
    out["kernel"] = linears.merged_kernel(params["kernel"], params["lora_a"], params["lora_b"], lora_scale)
  return out
