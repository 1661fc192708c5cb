"""One run's assembly: mesh → sharded state setup → batch sharding → train and eval steps.

train.py, train_compile.py, the tests and the benchmarks all call `build_run`, so every path
trains (or compiles) the same step with the same shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from MaxText.configuration.config import Config
from MaxText.training import compiled_step as compiled_step_file
from MaxText.training import model_assembly
from MaxText.training import lora, train_state, train_step
from MaxText.platform import sharding
from MaxText.input_pipeline import BatchIterator, create_data_iterator, create_eval_iterator
from MaxText.input_pipeline.synthetic import Batch
from MaxText.input_pipeline.batch_spec import batch_spec
from MaxText.training.objectives import Objective, objective_for
from MaxText.training.train_step import Metrics


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """ShapeDtypeStructs (with shardings) for train_step(state, batch, rng[, loss_limit])."""

  state: train_state.TrainState  # of ShapeDtypeStructs
  batch: dict[str, jax.ShapeDtypeStruct]
  rng: jax.ShapeDtypeStruct
  loss_limit: jax.ShapeDtypeStruct | None = None  # with loss_spike_threshold > 0

  def as_args(self) -> tuple[Any, ...]:
    return (self.state, self.batch, self.rng) + ((self.loss_limit,) if self.loss_limit is not None else ())


@dataclasses.dataclass(frozen=True)
class Run:
  """What one config runs on and with; `train_step` is jitted, or loaded from `compiled_trainstep_file`."""

  config: Config
  mesh: Mesh
  setup: train_state.StateSetup
  objective: Objective  # the loss, batch fields, extra state and metrics (objectives/)
  batch_sharding: NamedSharding
  train_step: Callable[..., tuple[train_state.TrainState, Metrics]]  # (state, batch, rng[, loss_limit]) -> (new state, metrics); the state is donated
  eval_step: Callable[[train_state.TrainState, Batch], Metrics]  # (state, batch) -> loss sums

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.setup.abstract_state.params))

  def lora_description(self) -> str:
    """What trains under LoRA (for the start-up log), "" without it."""
    cfg = self.config.model
    if not isinstance(self.setup.updater.partition, lora.AdapterPartition):
      return ""
    adapters = sum(x.size for x in jax.tree.leaves(lora.split(self.setup.abstract_state.params)[0]))
    return (f"lora: {adapters / 1e6:.2f}M adapter parameters train (rank {cfg.lora.lora_rank}, alpha {cfg.lora.lora_alpha:g}, "
            f"on {', '.join(cfg.lora.lora_target_modules)}); the other {(self.num_params - adapters) / 1e6:.2f}M are frozen")

  def mesh_description(self) -> str:
    return ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items() if n > 1) or "single device"

  def init_state(self, seed: int | None = None) -> train_state.TrainState:
    """A fresh state born in its shardings (seed: init_weights_seed unless given)."""
    return train_state.init_state(self.setup, self.config.run.init_weights_seed if seed is None else seed)

  def data_iterator(self, start_step: int = 0) -> BatchIterator:
    """The input pipeline's batches (an objective with `uses_rollouts` makes its own: rl/rollouts.py)."""
    return create_data_iterator(self.config, self.mesh, start_step)

  def eval_iterator(self) -> BatchIterator | None:
    return create_eval_iterator(self.config, self.mesh)

  def abstract_inputs(self) -> StepInputs:
    return abstract_inputs(self.config, self.setup, self.batch_sharding)


def abstract_inputs(config: Config, setup: train_state.StateSetup, batch_sharding: NamedSharding) -> StepInputs:
  """The step's arguments as shapes only, so no device (or a described one) needs memory.

  The batch layout is the one every data iterator declares (input_pipeline.batch_spec).
  """
  state = sharding.with_shardings(setup.abstract_state, setup.state_shardings)
  batch = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.for_rank(batch_sharding, x.ndim))
           for name, x in batch_spec(config.data, config.distill.top_k_from_files).items()}
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(setup.on_mesh.mesh))
  limit = (jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(setup.on_mesh.mesh))
           if config.run.loss_spike_threshold > 0 else None)
  return StepInputs(state, batch, rng, limit)


def _load_train_step(config: Config, inputs: StepInputs) -> jax.stages.Compiled:
  path = config.startup.compiled_trainstep_file
  step = compiled_step_file.load_compiled_step(path, compiled_step_file.step_header(config, inputs, topology_name=""))
  if jax.process_index() == 0:
    print(f"train step: loaded the compiled executable from {path} (no compilation)", flush=True)
  return step


def build_run(config: Config, *, devices: Sequence[Any] | None = None, compiled_step: bool = True) -> Run:
  """The run for `config` on `devices` (default: every device this process sees).

  With `compiled_step` and `compiled_trainstep_file` set, the train step is the saved executable
  (its header checked against this run); otherwise it is jitted here and compiles on first call.
  train_compile passes compiled_step=False: there the file is its output, not an input.
  """
  on_mesh = model_assembly.build_model(config, devices=devices)
  mesh = on_mesh.mesh
  partition = lora.partition_for(config.model)  # which parameters train: the optimizer's business
  objective = objective_for(config, on_mesh.spec, partition)
  setup = train_state.build_state_setup(config, on_mesh, partition, objective)
  batch_sharding = sharding.batch_sharding(mesh, config.data.batch_axes)
  step: Callable[..., tuple[train_state.TrainState, Metrics]]
  if compiled_step and config.startup.compiled_trainstep_file:
    step = _load_train_step(config, abstract_inputs(config, setup, batch_sharding))
  else:
    step = train_step.jit_train_step(setup, objective, config, batch_sharding)
  return Run(config, mesh, setup, objective, batch_sharding, step, train_step.make_eval_step(setup, objective, config))
