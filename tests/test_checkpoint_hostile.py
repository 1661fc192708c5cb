"""Checkpoints, adversarial: damaged step directories, a disk that fills during a save under
max_to_keep, parameters of another model size or with NaN, and load paths that point one level off.
Each gives the right result or one line naming the culprit, and no good step is ever lost."""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import TrainingError, UserError
from MaxText.run_dir import checkpointing
from MaxText.training import params_io, run_start
from tests.train_utils import Run


# conftest's tiny_overrides, for the module's one trained run
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1, print_config=False)


def _config(tiny: dict, root: Path, **overrides) -> Config:
  values = dict(tiny, base_output_directory=str(root), run_name="run", steps=20, async_checkpointing=True)
  values.update(overrides)
  return Config.for_testing(**values)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One run's checkpoints of steps 2 and 4 (kept pristine: each test works on a copy), and the run."""
  tiny = TINY
  root = tmp_path_factory.mktemp("saved")
  config = _config(tiny, root)
  run = Run(config)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  state = run.init()
  for step in (1, 2, 3, 4):
    state, _ = run.train(state, 1)
    if step % 2 == 0:
      checkpoints.save(step, state, {"step": step}, {"step": step})
  checkpoints.close()
  return tiny, Path(config.checkpoint.directory), run, state


def _copy(saved, tmp_path: Path, **overrides) -> tuple[Config, Path]:
  tiny, directory, _, _ = saved
  config = _config(tiny, tmp_path, **overrides)
  shutil.copytree(directory, config.checkpoint.directory)
  return config, Path(config.checkpoint.directory)


def _names(directory: Path) -> list[str]:
  return sorted(p.name.split("-")[0] for p in directory.iterdir())


def _zero_array_files(step: Path) -> None:
  for data in (step / "state").glob("**/d/*"):
    data.write_bytes(b"")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "array files of zero bytes": _zero_array_files,
    "the state's _METADATA not JSON": lambda step: (step / "state" / "_METADATA").write_text("{"),
    "the meta item's JSON invalid": lambda step: (step / "meta" / "metadata").write_text("{not json"),
    "the data item missing (half written)": lambda step: shutil.rmtree(step / "data"),
    "the state item missing (half written)": lambda step: shutil.rmtree(step / "state"),
    "an empty step directory": lambda step: (shutil.rmtree(step), step.mkdir()),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_step_is_set_aside_and_the_older_one_resumes_then_survives_max_to_keep(saved, tmp_path,
                                                                                                 damage, capsys):
  """The older good step is the one resumed, and the next save under max_to_keep=2 keeps it."""
  _, _, run, state = saved
  config, directory = _copy(saved, tmp_path, max_num_checkpoints_to_keep=2, async_checkpointing=False)
  DAMAGE[damage](directory / "4")
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  restored = checkpoints.restore_latest(run.setup.abstract_state, run.setup.state_shardings)
  assert restored is not None and restored.step == 2 and restored.data_state == {"step": 2}
  assert f"checkpoint step 4 in {directory} is incomplete or corrupt" in capsys.readouterr().out
  checkpoints.save(6, state, {"step": 6}, {})
  checkpoints.close()
  assert _names(directory) == ["2", "4.corrupt", "6"]


@pytest.mark.parametrize("damage", ["missing", "not JSON"])
def test_a_step_whose_checkpoint_metadata_is_missing_or_invalid_still_resumes(saved, tmp_path, damage):
  """_CHECKPOINT_METADATA holds the save's time and the like, not the state: the step is whole."""
  _, _, run, _ = saved
  config, directory = _copy(saved, tmp_path)
  metadata = directory / "4" / "_CHECKPOINT_METADATA"
  metadata.unlink() if damage == "missing" else metadata.write_text("{")
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  restored = checkpoints.restore_latest(run.setup.abstract_state, run.setup.state_shardings)
  checkpoints.close()
  assert restored is not None and restored.step == 4 and _names(directory) == ["2", "4"]


def test_a_save_that_fills_the_disk_under_max_to_keep_names_the_steps_still_on_disk(saved, tmp_path):
  """Orbax drops the steps max_to_keep prunes from its list when a save starts (it deletes them only
  once that save is complete): a failed async save said "no older checkpoint" while steps 2 and 4
  were on disk and restored."""
  _, _, run, state = saved
  config, directory = _copy(saved, tmp_path, max_num_checkpoints_to_keep=1)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as a full disk gives ENOSPC
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    with pytest.raises(TrainingError, match=r"^saving checkpoint of step 6 .* failed: .*File too large.*; older "
                                            r"checkpoints are untouched \(2, 4\); free space"):
      checkpoints.save(6, state, {"step": 6}, {})
      checkpoints.wait(6)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)
  try:
    checkpoints.close()
  except TrainingError:
    pass  # the failed save, reported again
  assert [name for name in _names(directory) if name.isdigit()] == ["2", "4"]
  again = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  restored = again.restore_latest(run.setup.abstract_state, run.setup.state_shardings)
  again.close()
  assert restored is not None and restored.step == 4


def test_a_failed_saves_line_keeps_the_os_reason_at_the_end_of_a_long_message(saved, tmp_path, monkeypatch):
  """TensorStore's disk-full error names two long paths before its reason; the line was cut at 400
  characters, before "No space left on device"."""
  _, _, _, state = saved
  config, directory = _copy(saved, tmp_path)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  where = f"{directory}/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0"
  message = (f'RESOURCE_EXHAUSTED: Error writing "params.layers.mlp.wi_1.kernel/0.0.0" in OCDBT database at local '
             f'file "{where}/": Failed writing: "{where}/d/a457e16d267bb88c0d6614fd01be40a3": Failed to write 144525 '
             "bytes to file 18: No space left on device [os_error_code='28']")
  assert len(message) > 400

  def disk_full(*args, **kwargs):
    raise ValueError(message)

  monkeypatch.setattr(checkpoints._manager, "save", disk_full)
  with pytest.raises(TrainingError) as error:
    checkpoints.save(6, state, {"step": 6}, {})
  line = str(error.value)
  assert "\n" not in line and "ValueError: RESOURCE_EXHAUSTED: Error writing" in line, line
  assert "No space left on device [os_error_code='28']; older checkpoints are untouched (2, 4)" in line, line
  checkpoints.close()
  assert _names(directory) == ["2", "4"]


def test_parameters_of_another_layer_count_are_refused_naming_the_layer(saved, tmp_path):
  """Unrolled layers: a checkpoint with one more layer than the model loaded with that layer silently
  dropped, and one with fewer left the missing layer's parameters unread placeholders."""
  tiny, _, _, _ = saved
  two = Run(_config(tiny, tmp_path, scan_layers=False))
  path = tmp_path / "two_layers"
  params_io.save_params(str(path), two.init().params)
  for layers, why in ((1, r"params/layers_1 is stored but this config builds fewer layers"),
                      (3, r"params/layers_2/\S+ is not stored")):
    other = Run(_config(tiny, tmp_path, scan_layers=False, base_num_decoder_layers=layers))
    with pytest.raises(UserError, match=rf"^cannot load parameters from {path} .*written by another model config: "
                                        rf".*{why}.*give the model keys that wrote it"):
      params_io.load_params(str(path), other.setup.abstract_state.params, other.setup.state_shardings.params)


def test_parameters_of_another_width_name_the_parameter_and_both_shapes(saved):
  """Orbax's line named two shapes but no parameter, and advised padding (strict=False)."""
  tiny, directory, _, _ = saved
  wider = Run(_config(tiny, directory.parent.parent, base_mlp_dim=256))
  with pytest.raises(UserError) as error:
    params_io.load_params(str(directory / "4"), wider.setup.abstract_state.params, wider.setup.state_shardings.params)
  line = str(error.value)
  assert "params/layers/mlp/wi_0/kernel (2, 64, 128) (this config: (2, 64, 256))" in line, line
  assert "strict" not in line and "\n" not in line


def _with_nan(params):
  leaves, tree = jax.tree.flatten(params)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
  return jax.tree.unflatten(tree, leaves), jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(params)[0][0],
                                                                simple=True, separator="/")


def test_parameters_holding_nan_are_refused_naming_the_array(saved, tmp_path):
  """They loaded silently; the first step's loss was then NaN and the advice was to lower the learning rate."""
  _, _, run, state = saved
  bad_params, name = _with_nan(state.params)
  path = tmp_path / "nan_params"
  params_io.save_params(str(path), bad_params)
  with pytest.raises(UserError, match=rf"^cannot load parameters from {path} \(parameters-only checkpoint\): NaN or "
                                      rf"infinite values in params/{name}; .*load an earlier checkpoint"):
    params_io.load_params(str(path), run.setup.abstract_state.params, run.setup.state_shardings.params)
  # A full state holding them (load_full_state_path) likewise.
  checkpoints = checkpointing.RunCheckpoints(str(tmp_path / "other_run"))
  checkpoints.save(8, state.replace(params=bad_params), {"step": 8}, {})
  checkpoints.close()
  with pytest.raises(UserError, match=rf"^load_full_state_path .*other_run: step 8 holds NaN or infinite values in "
                                      rf"params/{name}"):
    run_start.restore_full_state(str(tmp_path / "other_run"), run.setup.abstract_state, run.setup.state_shardings)


def test_load_full_state_path_one_level_off_says_what_to_give(saved, tmp_path):
  """A step's item (checkpoints/4/state) or a parameters-only checkpoint was "holds no complete checkpoint"."""
  _, directory, run, state = saved
  params_only = tmp_path / "params_only"
  params_io.save_params(str(params_only), state.params)
  for path, why in ((directory / "4" / "state", f"it is the 'state' item of a checkpoint step; give its step "
                                                f"directory {directory / '4'}"),
                    (directory / "4" / "meta", "it is the 'meta' item"),
                    (params_only, "it is a parameters-only checkpoint .*load it with load_parameters_path")):
    with pytest.raises(UserError, match=rf"^load_full_state_path {path} holds no complete checkpoint: {why}"):
      run_start.restore_full_state(str(path), run.setup.abstract_state, run.setup.state_shardings)
  # load_parameters_path takes the state item as it takes the step.
  params = params_io.load_params(str(directory / "4" / "state"), run.setup.abstract_state.params,
                                 run.setup.state_shardings.params)
  assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(params),
                                                                           jax.tree.leaves(state.params)))


def test_orbax_error_lines_during_a_save_wait_for_its_outcome(caplog):
  """Orbax logs a failed save's causes (ERROR, from its threads) before raising them; the run's one error line says
  the same, so those lines are dropped when the save fails, and logged when it does not. Outside a save they go out
  at once."""
  import logging

  from MaxText.run_dir import checkpointing

  def orbax_error(message: str) -> None:
    logging.getLogger("absl").handle(logging.LogRecord("absl", logging.ERROR, "/x/orbax/checkpoint/_src/f.py", 1,
                                                       message, None, None))

  held = checkpointing._SAVE_ERRORS
  with caplog.at_level(logging.ERROR, logger="absl"):
    orbax_error("outside a save")
    held.hold()
    orbax_error("cause of a failed save")
    held.drop()
    held.hold()
    orbax_error("logged by a save that then succeeded")
    assert [r.getMessage() for r in caplog.records] == ["outside a save"]
    held.release()
    orbax_error("after it")
  assert [r.getMessage() for r in caplog.records] == ["outside a save", "logged by a save that then succeeded",
                                                      "after it"]
