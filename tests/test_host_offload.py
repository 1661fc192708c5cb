"""Host offloading: optimizer state in pinned host memory, activations offloaded by remat policies."""

import jax
import numpy as np
import pytest

from MaxText.training import optimizers
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from train_utils import Run


def _memory_kinds(tree) -> set[str]:
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _train(run: Run, step_fn, state, num_steps: int):
  losses = []
  for _ in range(num_steps):
    state, metrics = step_fn(state, next(run.data), run.rng)
    losses.append(float(metrics["loss"]))
  return state, losses


def test_offloaded_optimizer_state_lives_on_host_and_steps_like_device(tiny_overrides):
  device_run = Run(Config.for_testing(**tiny_overrides))
  host_run = Run(Config.for_testing(**tiny_overrides, optimizer_memory_host_offload=True))
  state = host_run.init()
  assert _memory_kinds(state.opt_state) == {"pinned_host"}
  assert _memory_kinds(state.params) == {"device"}
  batch = next(host_run.data)
  next(device_run.data)  # both runs then train on the same batches
  compiled = host_run.step_fn.lower(state, batch, host_run.rng).compile()
  out_state_shardings = compiled.output_shardings[0]
  assert {s.memory_kind for s in jax.tree.leaves(out_state_shardings.opt_state)} == {"pinned_host"}
  assert {s.memory_kind for s in jax.tree.leaves(out_state_shardings.params)} == {"device"}

  host_state, host_losses = _train(host_run, compiled, state, 2)
  device_state, device_losses = _train(device_run, device_run.step_fn, device_run.init(), 2)
  assert _memory_kinds(host_state.opt_state) == {"pinned_host"}
  # Same arithmetic, only where the moments are stored differs: equal to float32 rounding.
  np.testing.assert_allclose(host_losses, device_losses, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(jax.device_get(host_state.opt_state)),
                       jax.tree.leaves(jax.device_get(device_state.opt_state))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_backend_without_host_memory_is_a_one_line_error():
  with pytest.raises(ConfigError, match="optimizer_memory_host_offload=True needs the 'pinned_host' memory kind"):
    optimizers.check_host_memory_kinds({"device"}, "neuron")
  optimizers.check_host_memory_kinds({"device", "pinned_host", "unpinned_host"}, "cpu")


@pytest.mark.slow  # three train-step compiles: ~45 s on a loaded 2-core CI machine
def test_offloaded_remat_policies_match_full_remat(tiny_overrides):
  losses = {}
  policies = ("minimal_offloaded", "save_dot_except_mlp_offloaded")
  for name in ("full",) + policies:
    run = Run(Config.for_testing(**tiny_overrides, remat_policy=name))
    _, history = run.train(run.init(), 2)
    losses[name] = [h["loss"] for h in history]
  for policy in policies:  # remat changes what is recomputed, not the arithmetic
    np.testing.assert_allclose(losses[policy], losses["full"], rtol=1e-5)


def test_offloaded_optimizer_state_checkpoint_round_trip(tiny_overrides, tmp_path):
  from MaxText.run_dir import checkpointing
  config = Config.for_testing(**tiny_overrides, optimizer_memory_host_offload=True, base_output_directory=str(tmp_path),
                              run_name="run", steps=5, async_checkpointing=False)
  run = Run(config)
  state, _ = run.train(run.init(), 1)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  checkpoints.save(1, state, run.data.get_state(), {"step": 1})
  checkpoints.wait()
  checkpoints.close()
  restored = checkpointing.RunCheckpoints.for_run(config.checkpoint).restore_latest(run.setup.abstract_state,
                                                                          run.setup.state_shardings)
  assert _memory_kinds(restored.state.opt_state) == {"pinned_host"}
  for got, want in zip(jax.tree.leaves(jax.device_get(restored.state.opt_state)),
                       jax.tree.leaves(jax.device_get(state.opt_state))):
    np.testing.assert_array_equal(got, want)
  run.step_fn(restored.state, next(run.data), run.rng)  # the restored state steps
