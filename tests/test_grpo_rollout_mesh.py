"""GRPO's rollout mesh (rl/rollout_mesh.py): bad layouts stop in one line, the weights move to the
rollout devices device to device, and a split run trains exactly as the same-mesh run does."""

from __future__ import annotations

import shutil
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.rl import rollout_mesh
from MaxText.training import run_assembly
from tests.test_grpo import GRPO
from tests.test_grpo_run import REPO_ROOT, _command, _env, _metrics, _train, workdir  # noqa: F401 (workdir: the fixture)


def _config(tiny_overrides, **extra) -> Config:
  return Config.for_testing(**{**tiny_overrides, **GRPO, **extra})


@pytest.mark.parametrize("overrides, message", [
    (dict(rl_rollout_devices=8), "rl_rollout_devices=8 leaves no device to train of the 8 devices"),
    (dict(rl_rollout_devices=12), "rl_rollout_devices=12 leaves no device to train of the 8 devices"),
    # was: "ici_fsdp_parallelism = 8 does not divide 4 devices per slice", the 8 devices the user counted
    (dict(rl_rollout_devices=4, ici_fsdp_parallelism=8), "ici_fsdp_parallelism = 8 does not divide 4 devices per slice "
     "(the training mesh has 4 of the 8 devices: rl_rollout_devices=4 roll out)"),
    (dict(rl_rollout_devices=-1), "rl_rollout_devices must be >= 0 (the last devices that roll out on a mesh of their "
     "own; 0 = roll out on the training mesh), got -1"),  # was: "-1 leaves no device to train"
    (dict(rl_rollout_devices=4, rl_rollout_ici_tensor_parallelism=3),
     "rl_rollout_ici_tensor_parallelism=3 does not divide the rl_rollout_devices=4"),
    (dict(rl_rollout_devices=6, rl_rollout_ici_tensor_parallelism=6, per_device_batch_size=2),
     "rl_rollout_ici_tensor_parallelism=6 does not divide the model's 4 query heads"),
    (dict(rl_rollout_devices=4, rl_weight_sync_interval=0), "rl_weight_sync_interval must be >= 1"),
    (dict(rl_max_staleness=1), "rl_max_staleness=1 generates batches while the training runs, which needs devices of "
     "its own for the rollouts: set rl_rollout_devices"),
    (dict(rl_rollout_devices=4, rl_weight_sync_interval=3, rl_max_staleness=1),
     "rl_weight_sync_interval=3 trains on batches sampled up to 2 steps before, beyond rl_max_staleness=1"),
    (dict(rl_rollout_devices=4, rl_max_staleness=-1), "rl_max_staleness must be >= 0"),
    # were accepted and ignored: the same-mesh rollouts run in the training layout
    (dict(rl_rollout_ici_tensor_parallelism=2), "rl_rollout_ici_tensor_parallelism=2 lays out a rollout mesh of its "
     "own, which needs devices: set rl_rollout_devices (a multiple of it) or rl_rollout_ici_tensor_parallelism=1"),
    (dict(rl_rollout_ici_tensor_parallelism=0), "rl_rollout_ici_tensor_parallelism=0 lays out a rollout mesh of its "
     "own"),
    # was: "raise rl_max_staleness to 1", which the next run refused for want of rl_rollout_devices
    (dict(rl_weight_sync_interval=2), "rl_weight_sync_interval=2 spaces out the weight copies to a rollout mesh of its "
     "own, which needs devices: set rl_rollout_devices (and rl_max_staleness >= 1) or rl_weight_sync_interval=1"),
    # was: "the global batch of 1 completions (per_device_batch_size x devices)", the 8 devices the user counted
    (dict(rl_rollout_devices=7), "the global batch of 1 completions (per_device_batch_size x devices) does not divide "
     "into groups of num_generations=4; make it a multiple (the training mesh has 1 of the 8 devices: "
     "rl_rollout_devices=7 roll out)"),
])
def test_rollout_mesh_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    _config(tiny_overrides, **overrides)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_training_mesh_and_batch_count_only_the_training_devices(tiny_overrides):
  config = _config(tiny_overrides, rl_rollout_devices=4, per_device_batch_size=2)
  assert dict(config.mesh.shape)["fsdp"] == 4 and config.data.global_batch_size == 8
  train, rollout = rollout_mesh.split_devices(config)
  assert train == jax.devices()[:4] and rollout == jax.devices()[4:]
  mesh = rollout_mesh.rollout_mesh(_config(tiny_overrides, rl_rollout_devices=4, rl_rollout_ici_tensor_parallelism=2,
                                           per_device_batch_size=2), rollout)
  assert dict(mesh.shape)["data"] == 2 and dict(mesh.shape)["tensor"] == 2
  assert rollout_mesh.training_devices(_config(tiny_overrides)) is None  # the same-mesh mode: every device


def test_weights_move_device_to_device_every_interval(tiny_overrides):
  from MaxText.inference.engine import Engine

  config = _config(tiny_overrides, rl_rollout_devices=4, rl_rollout_ici_tensor_parallelism=2, per_device_batch_size=2,
                   rl_weight_sync_interval=2, rl_max_staleness=1)
  train, rollout = rollout_mesh.split_devices(config)
  run = run_assembly.build_run(config, devices=train)
  params = run.init_state().params
  engine = Engine(config, num_slots=8, mesh=rollout_mesh.rollout_mesh(config, rollout))
  sync = rollout_mesh.WeightSync(engine.param_shardings, interval=2)
  with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
    copy, scalars = sync.for_step(params, 0)
  for ours, theirs in zip(jax.tree.leaves(copy), jax.tree.leaves(params)):
    assert set(ours.sharding.device_set) <= set(rollout) and set(theirs.sharding.device_set) <= set(train)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  assert scalars["weight_sync_bytes"] == rollout_mesh.tree_bytes(params) > 0 and scalars["weight_sync_s"] > 0
  again, skipped = sync.for_step(params, 1)  # between copies: the last one, a step old
  assert again is copy and skipped == {"weight_sync_bytes": 0.0, "weight_sync_s": 0.0, "policy_lag": 1.0}
  assert sync.for_step(params, 2)[1]["weight_sync_bytes"] > 0
  assert rollout_mesh.WeightSync(None, 1).for_step(params, 0) == (params, {})  # the same-mesh mode


@pytest.mark.parametrize("family", [
    # dense: the slow run below compares whole runs
    pytest.param({}, marks=pytest.mark.slow), dict(lora_rank=4, lora_target_modules="q_proj,v_proj", grpo_beta=0.1),
    pytest.param(dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2), marks=pytest.mark.slow),
], ids=["dense", "lora", "moe"])
def test_the_rollout_mesh_samples_what_the_training_mesh_samples(tiny_overrides, family):
  from MaxText.inference.engine import Engine
  from MaxText.inference.sampling import RowParams
  from MaxText.rl import rollouts

  config = _config(tiny_overrides, per_device_batch_size=2, rl_rollout_devices=4, rl_rollout_ici_tensor_parallelism=2,
                   **family)
  train, rollout = rollout_mesh.split_devices(config)
  run = run_assembly.build_run(config, devices=train)
  params = run.init_state().params
  engine = Engine(config, num_slots=8, mesh=rollout_mesh.rollout_mesh(config, rollout))
  copy, _ = rollout_mesh.WeightSync(engine.param_shardings, 1).for_step(params, 0)
  rows, row_params = [[1, 2, 3, 4 + i % 2] for i in range(8)], [RowParams(1.0, 1.0, 0, seed) for seed in range(8)]
  ours = rollouts.generate(engine, copy, rows, row_params, max_new_tokens=5, eos_id=None)
  theirs = rollouts.generate(Engine(config, num_slots=8, mesh=run.mesh), params, rows, row_params, 5, None)
  assert ours == theirs


LORA = dict(lora_rank=4, lora_target_modules="q_proj,v_proj", dtype="float32")


def _trained(params):
  """`params` after a LoRA update: every adapter leaf moved (lora_b away from zero), the base as it was."""
  from MaxText.training import lora

  step = jax.jit(lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + 1) if lora.is_adapter(path)
      else x, tree))
  adapters, base = lora.split(step(params))
  return lora.combine(adapters, lora.split(params)[1])  # the base leaves themselves, as a LoRA step leaves them


def _lora_copies(tiny_overrides):
  """A LoRA run split 4 + 4: its engine on the rollout mesh, the first and a later copy (after an update)."""
  from MaxText.inference.engine import Engine
  from MaxText.training import lora

  config = _config(tiny_overrides, per_device_batch_size=2, rl_rollout_devices=4, **LORA)
  train, rollout = rollout_mesh.split_devices(config)
  run = run_assembly.build_run(config, devices=train)
  params = run.init_state().params
  engine = Engine(config, num_slots=8, mesh=rollout_mesh.rollout_mesh(config, rollout))
  sync = rollout_mesh.WeightSync(engine.param_shardings, 1, frozen=lora.AdapterPartition())
  first, first_scalars = sync.for_step(params, 0)
  trained = _trained(params)
  copy, scalars = sync.for_step(trained, 1)
  return config, run, engine, params, trained, (first, first_scalars), (copy, scalars)


def test_with_lora_a_copy_after_the_first_moves_the_adapters_alone(tiny_overrides):
  """The base model stays on the rollout devices: the second copy moves only the adapters' bytes, its base
  leaves are the first copy's, and it holds what a copy of every weight holds."""
  from MaxText.training import lora

  _, _, engine, params, trained, (first, first_scalars), (copy, scalars) = _lora_copies(tiny_overrides)
  assert first_scalars["weight_sync_bytes"] == rollout_mesh.tree_bytes(params)
  adapters, base = lora.split(trained)
  assert scalars["weight_sync_bytes"] == rollout_mesh.tree_bytes(adapters) < rollout_mesh.tree_bytes(base) / 10
  assert all(ours is theirs for ours, theirs in zip(jax.tree.leaves(lora.split(copy)[1]),
                                                    jax.tree.leaves(lora.split(first)[1])))
  whole, _ = rollout_mesh.WeightSync(engine.param_shardings, 1).for_step(trained, 1)  # every weight, as before
  for ours, theirs in zip(jax.tree.leaves(copy), jax.tree.leaves(whole)):
    assert ours.sharding == theirs.sharding
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.slow  # a LoRA engine and a merged one, each compiled: about 25 s on a loaded CPU
def test_with_lora_rollouts_from_an_adapters_only_copy_equal_the_merged_models(tiny_overrides):
  """Greedy rollouts from a copy that moved the adapters alone equal an engine of the model with the adapters
  merged into its kernels (and differ from the base model's: the adapters count)."""
  from MaxText.inference.engine import Engine
  from MaxText.inference.sampling import RowParams
  from MaxText.rl import rollouts
  from MaxText.training import lora

  config, run, engine, _, trained, _, (copy, _) = _lora_copies(tiny_overrides)
  rows, greedy = [[1, 2, 3, 4 + i % 3] for i in range(8)], [RowParams() for _ in range(8)]
  ours = rollouts.generate(engine, copy, rows, greedy, max_new_tokens=6, eos_id=None)
  plain = Config.for_testing(**{**tiny_overrides, **GRPO, "per_device_batch_size": 2, "dtype": "float32"})
  merged_engine = Engine(plain, num_slots=8, mesh=run.mesh)
  merged = jax.device_put(lora.merge(jax.device_get(trained), config.model.lora.lora_alpha / config.model.lora.lora_rank),
                          merged_engine.param_shardings)
  assert ours == rollouts.generate(merged_engine, merged, rows, greedy, 6, None)
  assert ours != rollouts.generate(engine, lora.adapters_off(copy), rows, greedy, 6, None)



@pytest.mark.slow  # the quantized copy; the default tests cover the copy without quantize_weights
def test_with_lora_and_quantized_weights_a_later_copy_keeps_the_converted_base(tiny_overrides):
  """quantize_weights with a rollout mesh: the first copy's base kernels are converted (donated), a later copy
  moves the adapters and keeps those converted kernels: bitwise what converting a copy of every weight gives."""
  from MaxText.inference import quantized_weights
  from MaxText.inference.engine import Engine
  from MaxText.layers.weight_quantization import QuantizedWeight
  from MaxText.training import lora

  config = _config(tiny_overrides, per_device_batch_size=2, rl_rollout_devices=4, quantize_weights="int8", **LORA)
  train, rollout = rollout_mesh.split_devices(config)
  params = run_assembly.build_run(config, devices=train).init_state().params
  engine = Engine(config, num_slots=8, mesh=rollout_mesh.rollout_mesh(config, rollout))
  prepare = quantized_weights.rollout_preparer(config, engine.param_shardings)
  sync = rollout_mesh.WeightSync(engine.param_shardings, 1, prepare=prepare, frozen=lora.AdapterPartition())
  first, _ = sync.for_step(params, 0)
  trained = _trained(params)
  copy, scalars = sync.for_step(trained, 1)
  assert scalars["weight_sync_bytes"] == rollout_mesh.tree_bytes(lora.split(trained)[0])
  is_converted = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
  kernels = [x for x in jax.tree.leaves(copy, is_leaf=is_converted) if is_converted(x)]
  assert kernels and all(any(k is f for f in jax.tree.leaves(first, is_leaf=is_converted)) for k in kernels)
  whole, _ = rollout_mesh.WeightSync(engine.param_shardings, 1, prepare=prepare).for_step(trained, 1)
  for ours, theirs in zip(jax.tree.leaves(copy), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_with_lora_on_the_training_mesh_quantized_base_kernels_are_converted_once(tiny_overrides):
  """quantize_weights on the training mesh: the frozen base kernels are converted at the first rollout only; later
  rollouts read the adapters (and every unconverted weight) from the current parameters: bitwise the
  parameters a conversion at every rollout gives."""
  from MaxText.inference import quantized_weights
  from MaxText.inference.engine import Engine
  from MaxText.training import lora

  config = _config(tiny_overrides, per_device_batch_size=1, quantize_weights="int8", **LORA)
  run = run_assembly.build_run(config)
  params = run.init_state().params
  engine = Engine(config, num_slots=8, mesh=run.mesh)
  prepare = quantized_weights.rollout_preparer(config, engine.param_shardings)
  assert prepare is not None
  calls: list[bool] = []
  sync = rollout_mesh.WeightSync(None, 1, prepare=lambda p, donate: calls.append(donate) or prepare(p, donate),
                                 frozen=lora.AdapterPartition())
  sync.for_step(params, 0)
  trained = _trained(params)
  ours, scalars = sync.for_step(trained, 1)
  assert calls == [False] and scalars == {}
  theirs, _ = rollout_mesh.WeightSync(None, 1, prepare=prepare).for_step(trained, 1)  # converted at every rollout
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert lora.split(ours)[0] == lora.split(trained)[0]  # the adapters are the current ones, not copied


@pytest.mark.slow  # two training processes
def test_a_split_mesh_run_equals_the_same_mesh_run_step_for_step(workdir, tmp_path):  # noqa: F811
  same = _train(workdir, tmp_path / "same", "steps=4", devices=2)
  split = _train(workdir, tmp_path / "split", "steps=4", "rl_rollout_devices=2", "rl_rollout_ici_tensor_parallelism=2",
                 devices=4)
  assert same.returncode == 0 and split.returncode == 0, (same.stderr + split.stderr)[-3000:]
  ours, theirs = _metrics(tmp_path / "split"), _metrics(tmp_path / "same")
  assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
  assert [r["completions/mean_length"] for r in ours] == [r["completions/mean_length"] for r in theirs]
  for key in ("loss", "grad_norm", "entropy"):  # equal bitwise on the CPU mesh; the bound allows other kernels
    np.testing.assert_allclose([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=1e-6)
  assert all(r["weight_sync_bytes"] > 0 and r["weight_sync_s"] > 0 for r in ours)
  assert "weight_sync_bytes" not in theirs[0]
  for records in (ours, theirs):  # from the second step on: each side's idle share of the step's cycle
    assert "trainer_idle_share" not in records[0]
    assert all(0 <= r["trainer_idle_share"] <= 1 and 0 <= r["rollout_idle_share"] <= 1 for r in records[1:])


@pytest.mark.slow  # three training processes
def test_rollouts_made_ahead_stay_within_the_staleness_bound_and_resume_bitwise(workdir, tmp_path):  # noqa: F811
  ahead = ("rl_rollout_devices=2", "rl_weight_sync_interval=2", "rl_max_staleness=1", "checkpoint_period=2")
  whole = _train(workdir, tmp_path / "whole", "steps=4", *ahead, devices=4)
  first = _train(workdir, tmp_path / "halves", "steps=2", *ahead, devices=4)
  second = _train(workdir, tmp_path / "halves", "steps=4", *ahead, devices=4)
  assert whole.returncode == first.returncode == second.returncode == 0, (whole.stderr + second.stderr)[-3000:]
  records = _metrics(tmp_path / "whole")
  assert [r["policy_lag"] for r in records] == [0.0, 1.0, 0.0, 1.0]
  assert [r["weight_sync_bytes"] > 0 for r in records] == [True, False, True, False]
  keys = ("reward", "loss", "grad_norm", "completions/mean_length")
  resumed = _metrics(tmp_path / "halves")
  assert [[r[k] for k in keys] for r in resumed if r["step"] > 2] == [[r[k] for k in keys] for r in records[2:]]


@pytest.mark.slow  # two training processes
def test_batches_made_ahead_are_the_batches_of_their_steps(workdir, tmp_path):  # noqa: F811
  # With weights that do not move (a learning rate far below their float32 spacing), every copy is
  # the current policy, so a run with batches made ahead (lags 0, 1, 2) trains exactly as the
  # synchronous split run: each stale batch has its own step's prompts, seeds and advantages.
  common = ("steps=6", "learning_rate=1e-12", "rl_rollout_devices=2", "grpo_old_logps=trainer")
  split = _train(workdir, tmp_path / "split", *common, devices=4)
  ahead = _train(workdir, tmp_path / "ahead", *common, "rl_weight_sync_interval=3", "rl_max_staleness=2", devices=4)
  assert split.returncode == 0 and ahead.returncode == 0, (split.stderr + ahead.stderr)[-3000:]
  keys = ("reward", "completions/mean_length", "loss", "grad_norm", "entropy")
  ours, theirs = _metrics(tmp_path / "ahead"), _metrics(tmp_path / "split")
  assert [r["policy_lag"] for r in ours] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
  assert [[r[k] for k in keys] for r in ours] == [[r[k] for k in keys] for r in theirs]


@pytest.mark.slow  # two training processes
def test_a_run_stopped_with_rollouts_in_flight_resumes_bitwise(workdir, tmp_path):  # noqa: F811
  # Saved at step 3 with the batch of step 3 made ahead from step 2's weights, which the checkpoint
  # does not hold: the checkpoint keeps that batch's completions, and the rerun trains on them.
  ahead = ("rl_rollout_devices=2", "rl_weight_sync_interval=2", "rl_max_staleness=1", "checkpoint_period=3")
  whole = _train(workdir, tmp_path / "whole", "steps=6", *ahead, devices=4)
  assert whole.returncode == 0, whole.stderr[-3000:]
  shutil.copytree(tmp_path / "whole", tmp_path / "again")
  shutil.rmtree(tmp_path / "again" / "grpo" / "checkpoints" / "6")
  again = _train(workdir, tmp_path / "again", "steps=6", *ahead, devices=4)
  assert again.returncode == 0 and "state: resumed from step 3" in again.stdout, again.stderr[-3000:]
  assert "warning: resumed at step" not in again.stderr
  keys = ("reward", "loss", "grad_norm", "entropy", "completions/mean_length", "policy_lag")
  ours, theirs = _metrics(tmp_path / "again"), _metrics(tmp_path / "whole")
  assert [[r[k] for k in keys] for r in ours if r["step"] > 3] == [[r[k] for k in keys] for r in theirs[3:]]



@pytest.mark.slow  # four training processes
def test_a_lora_run_on_a_rollout_mesh_trains_as_on_the_same_mesh_and_resumes_bitwise(workdir, tmp_path):  # noqa: F811
  """LoRA with a rollout mesh: every copy after a process's first moves the adapters alone, the run trains as
  the same-mesh run does, and a run resumed from a checkpoint (its first copy moves every weight again)
  trains as the uninterrupted one."""
  lora_keys = ("lora_rank=4", "lora_target_modules=q_proj,v_proj")
  split = ("rl_rollout_devices=2", "rl_rollout_ici_tensor_parallelism=2", "checkpoint_period=2")
  same = _train(workdir, tmp_path / "same", "steps=4", *lora_keys, devices=2)
  whole = _train(workdir, tmp_path / "whole", "steps=4", *lora_keys, *split, devices=4)
  assert same.returncode == 0 and whole.returncode == 0, (same.stderr + whole.stderr)[-3000:]
  ours, theirs = _metrics(tmp_path / "whole"), _metrics(tmp_path / "same")
  assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
  for key in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=1e-6)
  copied = [r["weight_sync_bytes"] for r in ours]
  assert copied[0] > 10 * copied[1] and len(set(copied[1:])) == 1, copied  # the base once, then the adapters
  shutil.copytree(tmp_path / "whole", tmp_path / "again")
  shutil.rmtree(tmp_path / "again" / "grpo" / "checkpoints" / "4")
  again = _train(workdir, tmp_path / "again", "steps=4", *lora_keys, *split, devices=4)
  assert again.returncode == 0 and "state: resumed from step 2" in again.stdout, again.stderr[-3000:]
  keys = ("reward", "loss", "grad_norm", "entropy", "completions/mean_length")
  resumed = [r for r in _metrics(tmp_path / "again") if r["step"] > 2]
  assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in ours[2:]]
  assert resumed[0]["weight_sync_bytes"] == copied[0]  # a new process: the first copy moves every weight


def _train_compile_v5e_4(tiny_overrides, monkeypatch, capsys, **extra) -> str:
  from MaxText import startup, train_compile
  from MaxText.platform import accelerators
  topology = accelerators.tpu_topology("v5e-4")
  config = Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, **extra})
  devices = startup.describe_topology(topology, 1)
  monkeypatch.setattr(train_compile, "load_target_config", lambda argv: (config, devices, topology))
  assert train_compile.main(["train_compile"]) == 0
  return str(capsys.readouterr().out)


def test_train_compile_compiles_both_sides_of_a_split_run_for_a_topology(tiny_overrides, monkeypatch, capsys):
  """v5e-4 with rl_rollout_devices=2: the train step on the first two chips, the decode step on the
  last two laid out tensor-parallel, each with its memory, and the weight copy's size."""
  out = _train_compile_v5e_4(tiny_overrides, monkeypatch, capsys, per_device_batch_size=2, rl_rollout_devices=2,
                             rl_rollout_ici_tensor_parallelism=2)
  assert "4 devices, TPU v5 lite; 2 train, the last 2 roll out" in out
  assert "fits: " in out and "rollout mesh: 2 devices, data 1 x tensor 2" in out
  assert "rollout step on the rollout mesh (4 completions, one token each" in out and "rollout side fits: " in out
  assert "weight copy to the rollout mesh: " in out and "per sync (every rl_weight_sync_interval=1 steps)" in out



@pytest.mark.slow  # a second compile of both sides
def test_train_compile_gives_a_lora_runs_copy_of_the_adapters_alone(tiny_overrides, monkeypatch, capsys):
  out = _train_compile_v5e_4(tiny_overrides, monkeypatch, capsys, per_device_batch_size=2, rl_rollout_devices=2,
                             rl_rollout_ici_tensor_parallelism=2, lora_rank=4, lora_target_modules="q_proj,v_proj")
  assert "per sync (every rl_weight_sync_interval=1 steps), then " in out
  assert "per sync: the LoRA adapters alone (the base stays on the rollout mesh)" in out

def test_train_compile_compiles_the_same_mesh_rollout_beside_the_train_step(tiny_overrides, monkeypatch, capsys):
  out = _train_compile_v5e_4(tiny_overrides, monkeypatch, capsys)
  assert "4 devices, TPU v5 lite\n" in out and "mesh: fsdp=4" in out and "rollout mesh" not in out
  assert "rollout step (4 completions, one token each, KV cache of 16 positions)" in out


def test_the_weight_copy_across_processes_equals_device_put():
  """copy_across_processes (what a run of several processes uses, tried here in one): the rollout
  layout on other devices, no host round trip, the values of jax.device_put; 6 training devices
  reshard for 2 rollout devices in 3 copies."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  train = Mesh(np.asarray(jax.devices()[:6]), ("fsdp",))
  rollout = Mesh(np.asarray(jax.devices()[6:]).reshape(1, 2), ("data", "tensor"))
  value = np.arange(48 * 8, dtype=np.float32).reshape(48, 8)
  params = {"w": jax.device_put(value, NamedSharding(train, P("fsdp", None))),
            "scale": jax.device_put(np.float32(3), NamedSharding(train, P()))}
  where = {"w": NamedSharding(rollout, P(None, "tensor")), "scale": NamedSharding(rollout, P())}
  with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
    copy, scalars = rollout_mesh.WeightSync(where, 1, across_processes=True).for_step(params, 0)
  assert copy["w"].sharding == where["w"] and copy["scale"].sharding == where["scale"]
  np.testing.assert_array_equal(np.asarray(copy["w"]), value)
  assert float(copy["scale"]) == 3.0 and scalars["weight_sync_bytes"] == value.nbytes + 4


def test_several_processes_give_the_rollouts_the_same_share_of_their_devices(tiny_overrides):
  """v5e-8 (two hosts of 4 chips): each host's last 2 chips roll out; 3 rollout chips cannot be
  shared evenly, and 3 per host leave 1 training chip, too few to reshard for them."""
  from MaxText.platform import accelerators
  from MaxText import startup
  topology = accelerators.tpu_topology("v5e-8")
  config = Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, "run_name": "split", "rl_rollout_devices": 4})
  devices = startup.describe_topology(topology, 1)
  train, rollout = rollout_mesh.split_devices(config, devices)
  assert [d.process_index for d in rollout] == [0, 0, 1, 1] and [d.process_index for d in train] == [0, 0, 1, 1]
  with pytest.raises(ConfigError, match="rl_rollout_devices=3: each of the 2 processes gives the rollouts the same "
                                        "number of its devices; give a multiple of 2"):
    Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, "run_name": "split", "rl_rollout_devices": 3})
  with pytest.raises(ConfigError, match=r"rl_rollout_devices=6: each process would train on 1 and roll out on 3 of its "
                                        r"4 devices; .* \(e.g. rl_rollout_devices=4\)"):
    Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, "run_name": "split", "rl_rollout_devices": 6})


def test_rollouts_queued_inline_are_made_when_queued_and_fail_when_taken():
  ahead: rollout_mesh.RunAhead[int] = rollout_mesh.RunAhead(inline=True)
  made: list[int] = []
  ahead.submit(0, lambda: made.append(0) or 10)
  ahead.submit(1, lambda: 1 // 0)
  assert made == [0] and ahead.result(0) == 10
  with pytest.raises(ZeroDivisionError):
    ahead.result(1)


@pytest.mark.slow  # a one-process run and two jax.distributed processes
def test_two_processes_with_a_rollout_mesh_train_like_one(workdir, tmp_path):  # noqa: F811
  """Two processes of 2 CPU devices, each training on one and rolling out on the other (the weight
  copy crosses processes, rl_weight_sync_interval 2 queues a batch ahead), against one process of
  4 devices, 2 training and 2 rolling out."""
  split = ("steps=4", "rl_rollout_devices=2", "rl_rollout_ici_tensor_parallelism=2", "rl_weight_sync_interval=2",
           "rl_max_staleness=1")
  one = _train(workdir, tmp_path / "one", *split, devices=4)
  assert one.returncode == 0, one.stderr[-3000:]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  procs = [subprocess.Popen(_command(workdir, tmp_path / "two", *split, "distributed_init_timeout_seconds=120"),
                            cwd=REPO_ROOT, env={**_env(workdir, 2), "JAX_COORDINATOR_ADDRESS": address,
                                                "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": str(index)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
  ours, theirs = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
  for key in ("reward", "completions/mean_length", "policy_lag", "weight_sync_bytes"):
    assert [r[key] for r in ours] == [r[key] for r in theirs], key
  for key in ("loss", "grad_norm", "entropy"):  # equal bitwise on the CPU; the bound allows gloo's reduction order
    np.testing.assert_allclose([r[key] for r in ours], [r[key] for r in theirs], rtol=1e-5, atol=1e-6)


def test_the_idle_clock_gives_each_side_its_idle_share_of_a_cycle(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(rollout_mesh.time, "perf_counter", lambda: now[0])
  clock = rollout_mesh.IdleClock()
  assert clock.handed(0.0) == {}  # the first hand-over starts the first cycle

  def rollout() -> int:
    now[0] = 3.0
    return 7
  now[0] = 1.0
  assert clock.timed(rollout)() == 7  # the rollout side busy from 1 to 3
  clock.add(1.0)  # and a synchronous rollout's second
  now[0] = 4.0
  assert clock.handed(1.0) == {"trainer_idle_share": 0.25, "rollout_idle_share": 0.25}
  clock.running_since = 5.0  # a rollout under way counts up to the hand-over
  now[0] = 6.0
  assert clock.handed(0.0) == {"trainer_idle_share": 0.0, "rollout_idle_share": 0.5}


def test_the_training_chips_of_a_pod_split_by_host_get_a_mesh(tiny_overrides):
  """v5p-64 (8 hosts of 4 chips), one chip of each host rolling out: the 24 training chips are no
  physical block, so the mesh takes them in host order (was: cannot lay out mesh)."""
  from MaxText import startup
  from MaxText.platform import accelerators, sharding
  topology = accelerators.tpu_topology("v5p-64")
  config = Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, "run_name": "split",
                                                            "rl_rollout_devices": 8, "ici_data_parallelism": 3,
                                                            "ici_fsdp_parallelism": 8})
  train, rollout = rollout_mesh.split_devices(config, startup.describe_topology(topology, 1))
  assert len(train) == 24 and [d.process_index for d in rollout] == list(range(8))
  mesh = sharding.create_mesh(config.mesh, train)
  assert dict(mesh.shape)["data"] == 3 and dict(mesh.shape)["fsdp"] == 8 and list(mesh.devices.flat) == train


@pytest.mark.slow  # two compiles for a 32-chip topology
def test_train_compile_compiles_both_sides_on_a_pod_of_several_hosts(tiny_overrides, monkeypatch, capsys):
  """v5p-64 (8 hosts): 24 training chips (data 3 x fsdp 8), one rollout chip per host, and the
  training chips' transient for a copy across hosts (was refused: a topology of several hosts)."""
  from MaxText import startup, train_compile
  from MaxText.platform import accelerators
  topology = accelerators.tpu_topology("v5p-64")
  config = Config.for_testing(target=topology.target(), **{**tiny_overrides, **GRPO, "run_name": "split",
                                                            "per_device_batch_size": 2, "rl_rollout_devices": 8,
                                                            "ici_data_parallelism": 3, "ici_fsdp_parallelism": 8})
  devices = startup.describe_topology(topology, 1)
  monkeypatch.setattr(train_compile, "load_target_config", lambda argv: (config, devices, topology))
  assert train_compile.main(["train_compile"]) == 0
  out = capsys.readouterr().out
  assert "32 devices, TPU v5; 24 train, the last 8 roll out" in out and "mesh: data=3, fsdp=8" in out
  assert "rollout mesh: 8 devices, data 8 x tensor 1" in out and "rollout side fits: " in out
  assert "across 8 hosts: each sync first reshards on the training chips to the rollout layout" in out


def test_throughput_and_mfu_are_per_device_of_the_training_mesh(tiny_overrides):
  """The step's model FLOPs (the updates, π_old and π_ref, a teacher: none of the rollouts' decoding) run on the
  training mesh, but TFLOP/s per device, tokens/s per device and MFU divided them among every device, the
  rollout mesh's included (Config.target's count): half the training mesh's figures with half rolling out."""
  from MaxText.training import metrics
  from MaxText.training.trainer import Trainer

  config = _config(tiny_overrides, rl_rollout_devices=4, per_device_batch_size=2, steps=2)
  assert (config.mesh.num_devices, config.target.num_devices) == (4, 8)

  def step(state, batch, rng):
    return state, {"loss": jnp.asarray(1.0), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0)}

  flops = metrics.StepFlops(1.0, 0.0, 1.0)
  record = Trainer(config, step, iter(range(4)), jax.random.key(0), flops, 2.0).run(None).last  # type: ignore[arg-type]
  assert record is not None
  s = record.scalars
  assert s["tflops_per_s_per_device"] * s["step_seconds"] == pytest.approx(1.0 / 4)
  assert s["tokens_per_s_per_device"] * s["step_seconds"] == pytest.approx(8.0 / 4)
  assert s["mfu"] == pytest.approx(s["tflops_per_s_per_device"] / 2.0)
