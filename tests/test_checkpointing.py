"""Checkpoints: save/restore in-process (corruption, failed saves, other meshes, params only)."""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import models
from MaxText.training import params_io, run_start
from MaxText.run_dir import checkpointing
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, TrainingError, UserError
from tests.train_utils import Run


def _config(tiny_overrides: dict, tmp_path: Path, **overrides) -> Config:
  values = dict(tiny_overrides, base_output_directory=str(tmp_path), run_name="run", steps=20,
                async_checkpointing=True)
  values.update(overrides)
  return Config.for_testing(**values)


def _leaves_equal(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture
def trained(tiny_overrides, tmp_path):
  """A run with checkpoints of steps 2 and 4 on disk (fsdp=8), and its state after step 4."""
  config = _config(tiny_overrides, tmp_path)
  run = Run(config)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  state = run.init()
  for step in (1, 2, 3, 4):
    state, _ = run.train(state, 1)
    if step % 2 == 0:
      checkpoints.save(step, state, run.data.get_state(), {"step": step})
  checkpoints.wait()
  yield config, run, checkpoints, state
  try:
    checkpoints.close()
  except TrainingError:
    pass  # the failed-save test leaves a failed save behind on purpose


def _restore(config: Config, run: Run):
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  return checkpoints, checkpoints.restore_latest(run.setup.abstract_state, run.setup.state_shardings)


def test_restore_latest_gives_back_the_saved_state_and_data_position(trained):
  config, run, checkpoints, state = trained
  checkpoints.close()
  _, restored = _restore(config, Run(config))
  assert restored.step == 4 and int(restored.state.step) == 4
  assert restored.data_state == {"step": 4}
  assert _leaves_equal(restored.state.params, state.params)
  assert _leaves_equal(restored.state.opt_state, state.opt_state)


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(trained, capsys):
  config, run, checkpoints, _ = trained
  checkpoints.close()
  data_files = [p for p in (Path(config.checkpoint.directory) / "4" / "state").rglob("*") if p.is_file()]
  largest = max(data_files, key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])

  checkpoints, restored = _restore(config, Run(config))
  assert restored.step == 2 and int(restored.state.step) == 2
  out = capsys.readouterr().out
  assert "checkpoint step 4" in out and "falling back" in out
  # TensorStore's own line (the array and the file), not Orbax's wrapper ending in a repr of the store's spec.
  assert "in OCDBT database at local file" in out and "TensorStore({" not in out, out
  aside = [p.name for p in Path(config.checkpoint.directory).iterdir() if p.name.startswith("4.corrupt-")]
  assert aside, "the damaged step is kept (renamed), not deleted"
  assert checkpoints.all_steps() == [2]


def test_a_step_saved_with_another_optimizer_layout_is_named_so_and_kept(trained, tiny_overrides, tmp_path):
  """gradient_clipping_threshold 1 -> 0 drops the clipping's place in the optimizer state; the refusal
  said "another model config" and asked for the model keys, which had not changed."""
  config, _, checkpoints, _ = trained
  checkpoints.close()
  unclipped = _config(tiny_overrides, tmp_path, gradient_clipping_threshold=0.0)
  with pytest.raises(UserError, match=r"step 4 .* was written by another optimizer configuration: opt_state/.*"
                                      r"Rerun with the optimizer keys that wrote it \(gradient_clipping_threshold"):
    _restore(unclipped, Run(unclipped))
  assert sorted(p.name for p in Path(config.checkpoint.directory).iterdir()) == ["2", "4"]


def _truncate_largest(step_dir: Path) -> None:
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  largest = max(files, key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])


def test_a_file_under_the_newest_steps_name_is_set_aside_not_deleted_by_the_next_save(trained, capsys):
  """A file named like a step is no checkpoint: the resume says so and keeps it aside, where the save of
  that step would otherwise have deleted it without a word."""
  config, run, checkpoints, state = trained
  checkpoints.close()
  directory = Path(config.checkpoint.directory)
  shutil.rmtree(directory / "4")
  (directory / "4").write_text("notes")
  checkpoints, restored = _restore(config, Run(config))
  assert restored.step == 2
  assert "is a file, not a checkpoint step" in capsys.readouterr().out
  checkpoints.save(4, state, {"step": 4}, {})
  checkpoints.close()
  aside = [p for p in directory.iterdir() if p.name.startswith("4.corrupt-")]
  assert [p.read_text() for p in aside] == ["notes"]


def test_load_full_state_path_falls_back_past_a_damaged_step_without_renaming_it(trained, capsys):
  """The reading run renamed another run's damaged step to .corrupt-* in that run's directory."""
  config, run, checkpoints, _ = trained
  checkpoints.close()
  directory = Path(config.checkpoint.directory)
  _truncate_largest(directory / "4")
  restored = run_start.restore_full_state(str(directory), run.setup.abstract_state, run.setup.state_shardings)
  assert restored.step == 2
  assert "step 4" in capsys.readouterr().out
  assert sorted(p.name for p in directory.iterdir()) == ["2", "4"]


def test_when_no_step_restores_none_is_set_aside_and_the_run_does_not_start_over(trained):
  """Every step was renamed .corrupt-* one after the other and the run started again from step 0,
  also when the cause was common to all of them (memory, permissions)."""
  config, run, checkpoints, _ = trained
  checkpoints.close()
  directory = Path(config.checkpoint.directory)
  for step in ("2", "4"):
    _truncate_largest(directory / step)
  with pytest.raises(TrainingError, match=r"^no checkpoint in .* restores \(step 4: .*; and 1 older step\(s\)\); "
                                          r"nothing was moved aside\. .*resume_from_step=0"):
    _restore(config, Run(config))
  assert sorted(p.name for p in directory.iterdir()) == ["2", "4"]


def test_a_restore_that_runs_out_of_memory_sets_nothing_aside(trained, monkeypatch):
  config, run, checkpoints, _ = trained
  checkpoints.close()

  def out_of_memory(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")

  monkeypatch.setattr(checkpointing.RunCheckpoints, "restore_step", out_of_memory)
  with pytest.raises(TrainingError, match=r"^cannot restore checkpoint step 4 of .*: RuntimeError: RESOURCE_EXHAUSTED"
                                          r".*not damage to the step, so nothing was moved aside"):
    _restore(config, Run(config))
  assert sorted(p.name for p in Path(config.checkpoint.directory).iterdir()) == ["2", "4"]


def test_failed_save_is_reported_and_keeps_older_checkpoints(trained):
  """A write that fails (here: a per-file size limit, as a full disk would) stops the run with a
  clear error; steps 2 and 4 stay restorable."""
  config, run, checkpoints, state = trained
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    with pytest.raises(TrainingError, match="saving checkpoint of step 6 .* failed.*older checkpoints are untouched"):
      checkpoints.save(6, state, {"step": 6}, {})
      checkpoints.wait(6)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)
  _, restored = _restore(config, Run(config))
  assert restored.step == 4


def test_restore_onto_a_different_mesh_gives_the_same_next_step_loss(trained, tiny_overrides, tmp_path):
  config, run, checkpoints, state = trained
  checkpoints.close()
  _, expected = run.train(state, 1)
  other = _config(tiny_overrides, tmp_path, ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
  other_run = Run(other)
  assert dict(other_run.mesh.shape)["tensor"] == 2
  _, restored = _restore(other, other_run)
  other_run.data.set_state(restored.data_state)
  _, got = other_run.train(restored.state, 1)
  # Another mesh sums partial results in another order: equal up to float32 rounding.
  np.testing.assert_allclose(got[0]["loss"], expected[0]["loss"], rtol=1e-5)


def test_load_parameters_starts_at_step_zero_with_fresh_optimizer(trained, tiny_overrides, tmp_path):
  config, run, checkpoints, state = trained
  checkpoints.close()
  path = str(tmp_path / "params_only")
  params_io.save_params(path, state.params)
  with pytest.raises(UserError, match="already exists"):
    params_io.save_params(path, state.params)
  fine_tune = _config(tiny_overrides, tmp_path, run_name="finetune", load_parameters_path=path)
  fresh = Run(fine_tune)
  start = run_start.initial_state(fine_tune, fresh.setup, None, lambda: pytest.fail("must not initialise"))
  assert int(start.state.step) == 0 and "fresh optimizer" in start.description
  assert _leaves_equal(start.state.params, state.params)
  mu = start.state.opt_state[1][0].mu  # chain(clip, adamw): adam's first moment starts at zero
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(mu))
  # A full-state step directory and a checkpoints root also serve as parameter sources.
  for source in (Path(config.checkpoint.directory) / "4", Path(config.checkpoint.directory)):
    params = params_io.load_params(str(source), run.setup.abstract_state.params,
                                       run.setup.state_shardings.params)
    assert _leaves_equal(params, state.params)


def test_loading_errors_are_one_line_user_errors(trained, tiny_overrides, tmp_path):
  config, run, checkpoints, _ = trained
  checkpoints.close()
  abstract, shardings = run.setup.abstract_state.params, run.setup.state_shardings.params
  with pytest.raises(UserError, match="does not exist"):
    params_io.load_params(str(tmp_path / "missing"), abstract, shardings)
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match="is not a checkpoint"):
    params_io.load_params(str(tmp_path / "empty"), abstract, shardings)
  # A file was a NotADirectoryError traceback; a run directory (the parent of checkpoints/) was
  # "not a checkpoint" (load_full_state_path: "holds no complete checkpoint") without the way out.
  (tmp_path / "a_file").write_text("x")
  run_dir = Path(config.checkpoint.directory).parent
  with pytest.raises(UserError, match="a_file is a file, not a checkpoint directory"):
    params_io.load_params(str(tmp_path / "a_file"), abstract, shardings)
  with pytest.raises(UserError, match=f"is a run directory, not a checkpoint: give .*{config.checkpoint.directory}"):
    params_io.load_params(str(run_dir), abstract, shardings)
  for path, why in ((tmp_path / "a_file", "is a file"), (run_dir, "is a run directory")):
    with pytest.raises(UserError, match=f"load_full_state_path .* {why}"):
      run_start.restore_full_state(str(path), run.setup.abstract_state, run.setup.state_shardings)
  bigger = _config(tiny_overrides, tmp_path, base_emb_dim=128)
  big_spec = models.build_model_spec(bigger.model)
  with pytest.raises(UserError, match=r"cannot load parameters.*written by another model config: params/\S+ \(64,\) "
                                      r"\(this config: \(128,\)\)"):
    params_io.load_params(str(Path(config.checkpoint.directory) / "4"), big_spec.abstract_params,
                              Run(bigger).setup.state_shardings.params)
  # Array files cut short were the same advice, to check a config that matches.
  copy = tmp_path / "copied_checkpoints"
  shutil.copytree(config.checkpoint.directory, copy)
  for data in (copy / "4").glob("**/d/*"):
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  with pytest.raises(UserError, match=r"cannot load parameters from .*Error reading.*; its files are damaged or "
                                      r"incomplete: copy the checkpoint again or load an earlier step") as error:
    params_io.load_params(str(copy), abstract, shardings)
  assert "model config" not in str(error.value)


def test_checkpoint_config_errors(tiny_overrides, tmp_path):
  with pytest.raises(ConfigError, match="checkpoint_period must be > 0"):
    _config(tiny_overrides, tmp_path, checkpoint_period=0)
  with pytest.raises(ConfigError, match="at most one of load_parameters_path"):
    _config(tiny_overrides, tmp_path, load_parameters_path="a", load_full_state_path="b")
  with pytest.raises(ConfigError, match="max_num_checkpoints_to_keep"):
    _config(tiny_overrides, tmp_path, max_num_checkpoints_to_keep=0)


def test_a_checkpoint_directory_that_cannot_take_saves_is_refused_before_training(tiny_overrides, tmp_path,
                                                                                   monkeypatch):
  """A `checkpoints` that is a file, or a folder this user cannot write, is one line at the start, not a
  failed save after checkpoint_period steps of training; nothing in it is touched."""
  config = _config(tiny_overrides, tmp_path)
  directory = Path(config.checkpoint.directory)
  directory.parent.mkdir(parents=True)
  directory.write_text("not a folder")
  with pytest.raises(UserError, match=r"checkpoint directory .*checkpoints is a file, not a folder"):
    checkpointing.RunCheckpoints.for_run(config.checkpoint)
  assert directory.read_text() == "not a folder"
  directory.unlink()
  directory.mkdir()
  # root passes any permission check, so the refusal of a read-only folder is what is checked here
  monkeypatch.setattr(checkpointing.os, "access", lambda path, mode: path != str(directory))
  with pytest.raises(UserError, match=r"checkpoint directory .*checkpoints is not writable"):
    checkpointing.RunCheckpoints.for_run(config.checkpoint)


def test_max_to_keep_prunes_old_checkpoints(tiny_overrides, tmp_path):
  config = _config(tiny_overrides, tmp_path, max_num_checkpoints_to_keep=2, async_checkpointing=False)
  run = Run(config)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  state = run.init()
  for step in (1, 2, 3):
    checkpoints.save(step, state, {"step": step}, {})
  checkpoints.close()
  assert checkpoints.all_steps() == [2, 3]


def test_generate_param_only_checkpoint_unrolls_and_loads_in_either_layout(trained, tiny_overrides, tmp_path):
  from MaxText import generate_param_only_checkpoint

  config, run, checkpoints, state = trained
  checkpoints.close()
  out = tmp_path / "params_for_decode"
  generate_param_only_checkpoint.generate(
      _config(tiny_overrides, tmp_path, param_only_checkpoint_path=str(out), force_unroll=True))
  assert (out / "model_config.yml").exists()
  unrolled = Run(_config(tiny_overrides, tmp_path, scan_layers=False))
  params = params_io.load_params(str(out), unrolled.setup.abstract_state.params,
                                     unrolled.setup.state_shardings.params)
  assert set(params) >= {"layers_0", "layers_1"} and "layers" not in params
  assert _leaves_equal(params, models.unstack_layers(state.params, 2))
  # A scanned reader gets the stack back.
  scanned = params_io.load_params(str(out), run.setup.abstract_state.params, run.setup.state_shardings.params)
  assert _leaves_equal(scanned, state.params)
  with pytest.raises(UserError, match="already exists"):
    generate_param_only_checkpoint.generate(
        _config(tiny_overrides, tmp_path, param_only_checkpoint_path=str(out)))
