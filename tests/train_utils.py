"""Helpers that build a run the way train.py does, for tests."""

from __future__ import annotations

from typing import Any

import jax

from MaxText import sharding, train_state, train_step
from MaxText.config import Config
from MaxText.input_pipeline import create_data_iterator


class Run:
  """Mesh, sharded state, data and jitted step for one config."""

  def __init__(self, config: Config):
    self.config = config
    self.mesh = sharding.create_mesh(config.mesh)
    self.setup = train_state.build_state_setup(config, self.mesh)
    self.batch_sharding = sharding.batch_sharding(self.mesh, config.mesh.data_sharding)
    self.step_fn = train_step.jit_train_step(self.setup, config, self.batch_sharding)
    self.data = create_data_iterator(config, self.mesh)
    self.rng = jax.random.key(config.run.init_weights_seed)

  def init(self, params: Any | None = None) -> train_state.TrainState:
    state = train_state.init_state(self.setup, self.config.run.init_weights_seed)
    if params is not None:
      params = jax.device_put(params, self.setup.state_shardings.params)
      state = state.replace(params=params, opt_state=jax.jit(
          self.setup.optimizer.init, out_shardings=self.setup.state_shardings.opt_state)(params))
    return state

  def train(self, state: train_state.TrainState, num_steps: int) -> tuple[train_state.TrainState, list[dict]]:
    history = []
    for _ in range(num_steps):
      state, metrics = self.step_fn(state, next(self.data), self.rng)
      history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return state, history


def losses(config: Config, num_steps: int, params: Any | None = None) -> list[float]:
  run = Run(config)
  _, history = run.train(run.init(params), num_steps)
  return [h["loss"] for h in history]
