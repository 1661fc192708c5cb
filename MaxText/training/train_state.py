"""The train state and how it is born sharded: abstract shapes → shardings → jitted init.

Shared by train.py, train_compile.py and the tests, so every path builds the
same state with the same shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding

from MaxText.configuration.config import Config
from MaxText import models
from MaxText.training import optimizers
from MaxText.training.model_assembly import ModelOnMesh
from MaxText.platform import sharding
from MaxText.training.optimizers import Params


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Params  # nested dict of arrays
  opt_state: optax.OptState


@struct.dataclass
class PreferenceState(TrainState):
  """The train state of a DPO run (objectives/preference.py): also the frozen reference, the run's
  starting weights sharded like `params`. The step only reads it (no gradient, no optimizer state); it lives in the
  state so it is born sharded, counted by AOT memory reports and saved with the run, which then
  resumes against the same reference. A class of its own keeps every other run's checkpoints
  exactly as they were."""

  reference: Params | None = None


T = TypeVar("T")
SpecEntry = str | tuple[str, ...] | None  # one entry of a PartitionSpec


class StateLayout(Protocol):
  """What the objective (objectives/base.Objective) decides about the state: its class, the
  fields beyond step/params/opt_state, and whether a fresh initialisation can start it."""

  state_class: type[TrainState]
  needs_loaded_params: str  # why a fresh init cannot start the run; "" when it can

  def extra_state(self, params: T, copy: Callable[[T], T]) -> dict[str, T]: ...

  def load_extra_state(self, state: TrainState) -> TrainState: ...


@dataclasses.dataclass(frozen=True)
class StateSetup:
  """Everything needed to create, shard and step the train state for one config and mesh."""

  on_mesh: ModelOnMesh  # the model, its mesh and its parameters' shardings (model_assembly)
  optimizer: optax.GradientTransformation  # already restricted to the trainable parameters
  abstract_state: TrainState
  state_shardings: TrainState
  param_unsharded_fraction: float
  updater: optimizers.Updater  # how the step applies gradients (partition, host-offloaded state)
  layout: StateLayout


def _create_state(model: models.ModelSpec, optimizer: optax.GradientTransformation, rng: jax.Array,
                  layout: StateLayout) -> TrainState:
  params = model.init_params(rng)
  return state_from_params(params, optimizer, layout)


def state_from_params(params: Params, optimizer: optax.GradientTransformation, layout: StateLayout) -> TrainState:
  """Step 0 and a fresh optimizer around `params`, with the layout's extra fields (e.g. DPO's
  reference, a copy of them)."""
  step, opt_state = jnp.zeros((), jnp.int32), optimizer.init(params)
  extra = layout.extra_state(params, lambda p: jax.tree.map(jnp.copy, p))
  return layout.state_class(step=step, params=params, opt_state=opt_state, **extra)


def build_state_setup(config: Config, on_mesh: ModelOnMesh, partition: optimizers.Partition,
                      layout: StateLayout) -> StateSetup:
  """Abstract state and its shardings around the model on its mesh; fails when too many parameter
  bytes stay unsharded. `partition`: which parameters train (the optimizer keeps no state for the others)."""
  model, mesh, param_shardings = on_mesh.spec, on_mesh.mesh, on_mesh.param_shardings
  optimizer = partition.optimizer(optimizers.create_optimizer(config.optim, model.logical_names))
  abstract_state = jax.eval_shape(lambda: _create_state(model, optimizer, jax.random.key(0), layout))
  fraction = sharding.check_sharding_tolerance(
      model.abstract_params, param_shardings, mesh, config.mesh.sharding_tolerance)
  replicated = sharding.replicated(mesh)
  # A masked optimizer (LoRA's frozen base weights) keeps an empty MaskedNode where it has no state.
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  opt_shardings = optax.tree_map_params(
      optimizer, lambda state, s: state if masked(state) else s, abstract_state.opt_state, param_shardings,
      transform_non_params=lambda _: replicated, is_leaf=masked)
  opt_device_shardings = None
  if config.optim.optimizer_memory_host_offload:
    opt_device_shardings, opt_shardings = opt_shardings, optimizers.host_offloaded(opt_shardings, mesh)
  # The same dataclass holding shardings in place of arrays, as jit's in/out_shardings expect.
  state_shardings = layout.state_class(step=replicated, params=param_shardings,  # type: ignore[arg-type]
                                       opt_state=opt_shardings, **layout.extra_state(param_shardings, lambda s: s))
  updater = optimizers.Updater(optimizer, partition, opt_device_shardings)
  return StateSetup(on_mesh, optimizer, abstract_state, state_shardings, fraction, updater, layout)


def reference_of(state: TrainState) -> Params | None:
  """The frozen DPO reference of `state` (or of its abstract form or shardings); None outside DPO."""
  return state.reference if isinstance(state, PreferenceState) else None


def init_state(setup: StateSetup, seed: int) -> TrainState:
  """Initialises parameters and optimizer state directly into their shardings
  (no device ever holds the whole model)."""
  create = jax.jit(lambda rng: _create_state(setup.on_mesh.spec, setup.optimizer, rng, setup.layout),
                   out_shardings=setup.state_shardings)
  return setup.layout.load_extra_state(create(jax.random.key(seed)))


def shardings_summary(shardings: TrainState | Params) -> dict[str, tuple[SpecEntry, ...]]:
  """'path' -> PartitionSpec entries (a plain tuple) for every leaf (for logs and tests)."""
  flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
  return {jax.tree_util.keystr(path): tuple(s.spec) for path, s in flat}
