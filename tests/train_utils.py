"""Helpers that build a run the way train.py does, for tests."""

from __future__ import annotations

from typing import Any

import jax

from MaxText.training import metrics as metrics_lib, train_state
from MaxText.configuration.config import Config
from MaxText.training.run_assembly import build_run


class Run:
  """train.py's run assembly (`build_run`) plus its data iterator and rng, for one config."""

  def __init__(self, config: Config):
    self.config = config
    self.assembly = build_run(config)
    self.mesh, self.setup, self.step_fn = self.assembly.mesh, self.assembly.setup, self.assembly.train_step
    self.data = self.assembly.data_iterator()
    self.rng = jax.random.key(config.run.init_weights_seed)

  def init(self, params: Any | None = None) -> train_state.TrainState:
    state = self.assembly.init_state()
    if params is not None:
      params = jax.device_put(params, self.setup.state_shardings.params)
      state = state.replace(params=params, opt_state=jax.jit(
          self.setup.optimizer.init, out_shardings=self.setup.state_shardings.opt_state)(params))
    return state

  def train(self, state: train_state.TrainState, num_steps: int) -> tuple[train_state.TrainState, list[dict]]:
    history = []
    for _ in range(num_steps):
      state, metrics = self.step_fn(state, next(self.data), self.rng)
      history.append(metrics_lib.host_scalars(jax.device_get(metrics)))
    return state, history


def losses(config: Config, num_steps: int, params: Any | None = None) -> list[float]:
  run = Run(config)
  _, history = run.train(run.init(params), num_steps)
  return [h["loss"] for h in history]


def assert_accumulation_equals_one_big_batch(base: dict, micro_batches: int) -> None:
  """Two steps with `micro_batches` gradient-accumulation steps equal two steps on the whole batch."""
  import numpy as np

  big = Run(Config.for_testing(**base, gradient_accumulation_steps=1))
  micro = Run(Config.for_testing(**base, gradient_accumulation_steps=micro_batches))
  big_state, big_hist = big.train(big.init(), 2)
  micro_state, micro_hist = micro.train(micro.init(), 2)
  for key in ("loss", "grad_norm", "num_tokens"):
    np.testing.assert_allclose([h[key] for h in micro_hist], [h[key] for h in big_hist], rtol=2e-5, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               micro_state.params, big_state.params)
