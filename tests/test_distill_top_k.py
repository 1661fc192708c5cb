"""Distillation from a teacher's top k precomputed to files (generate_teacher_top_k.py,
input_pipeline/teacher_top_k.py): the student's loss equals the on-the-fly teacher's on the same
batches, the data position is exact across a resume, and files that do not fit the run stop it in
one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import generate_teacher_top_k
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import teacher_top_k
from MaxText.input_pipeline.batch_spec import TEACHER_TOP_K_INDICES, TEACHER_TOP_K_LOGPS
from MaxText.platform import accelerators
from MaxText.training.objectives.distill import DistillFromFiles
from MaxText.training.run_assembly import Run, build_run
from MaxText.training.train_state import TrainState
from tests.test_distill import TEACHER_MODEL, _teacher_overrides, teacher_path  # noqa: F401 (a fixture)

K, STEPS, ROWS = 8, 4, 4
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=ROWS,
            print_config=False)  # conftest's tiny_overrides (4 rows on one device), for the module-scoped files


def _config(teacher: str, **overrides: object) -> Config:
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  return Config.for_testing(one_device, **_values(TINY, teacher, **overrides))


def _build(teacher: str, **overrides: object) -> Run:
  return build_run(_config(teacher, **overrides), devices=jax.devices()[:1])


def _values(tiny_overrides: dict, teacher: str, **overrides: object) -> dict:
  return {**tiny_overrides, "objective": "distill", "distill_teacher_path": teacher,
          "distill_teacher_model_name": "default", "distill_teacher_overrides": _teacher_overrides(),
          "distill_top_k": K, "distill_temperature": 2.0, "distill_alpha": 0.7, "steps": STEPS, "eval_interval": 2,
          "eval_steps": 2, "learning_rate": 1e-2, "warmup_steps_fraction": 0.0, **overrides}


@pytest.fixture(scope="module")
def top_k_dir(tmp_path_factory, teacher_path) -> str:  # noqa: F811 (the fixture above)
  """The teacher's top 8 of the 4 train and 2 eval batches of the tiny synthetic run (4 rows)."""
  directory = str(tmp_path_factory.mktemp("top_k") / "teacher_top_k")
  generate_teacher_top_k.generate(_config(teacher_path, distill_top_k_path=directory), jax.devices()[:1])
  return directory


def test_the_files_hold_every_row_and_the_manifest_names_the_data(top_k_dir):
  manifest = json.loads(Path(top_k_dir, "manifest.json").read_text())
  assert manifest["top_k"] == K and manifest["batches"] == {"train": STEPS, "eval": 2}
  assert manifest["data"]["max_target_length"] == 32 and manifest["data"]["dataset_type"] == "synthetic"
  part = np.load(Path(top_k_dir, "train", "shard-0", "part-00000.npy"))
  assert part.shape == (STEPS * ROWS,) and part["indices"].shape[1:] == (32, K)
  logps = part["logps"]
  assert np.all(np.diff(logps, axis=-1) <= 0) and np.all(logps <= 0)  # sorted, log-probabilities


def test_the_loss_from_files_equals_the_teacher_run_beside_the_student(teacher_path, top_k_dir):  # noqa: F811
  """The same batches (train and eval), the same student: the loss sums from the files equal those with
  the teacher's forward in the step (float32 tolerance). The training steps: the slow test below."""
  live, files = _build(teacher_path), _build("", distill_top_k_path=top_k_dir)
  assert isinstance(files.objective, DistillFromFiles) and files.objective.forward_only_models == ()
  live_state, file_state = live.init_state(), files.init_state()
  assert type(file_state) is TrainState  # no teacher in the state
  file_state = dataclasses.replace(file_state, params=live_state.params)  # the same student
  pairs = [(live.data_iterator(), files.data_iterator(), STEPS), (live.eval_iterator(), files.eval_iterator(), 2)]
  for live_data, file_data, count in pairs:
    assert live_data is not None and file_data is not None
    for _ in range(count):
      file_batch = next(file_data)
      assert file_batch[TEACHER_TOP_K_INDICES].shape == file_batch[TEACHER_TOP_K_LOGPS].shape == (ROWS, 32, K)
      want = jax.device_get(live.eval_step(live_state, next(live_data)))
      got = jax.device_get(files.eval_step(file_state, file_batch))
      assert got["weight_sum"] == want["weight_sum"] and got["xent_sum"] == want["xent_sum"]
      for name in ("loss_sum", "distill_kl_sum"):
        assert float(got[name]) == pytest.approx(float(want[name]), rel=2e-5), name


@pytest.mark.slow
def test_training_from_files_equals_training_beside_the_teacher(teacher_path, top_k_dir):  # noqa: F811
  """Four steps from the same start: the loss, KL and gradient norm of every step agree."""
  live, files = _build(teacher_path), _build("", distill_top_k_path=top_k_dir)
  live_state, file_state = live.init_state(), files.init_state()  # the same seed: the same student
  live_data, file_data = live.data_iterator(), files.data_iterator()
  for _ in range(STEPS):
    live_state, live_metrics = live.train_step(live_state, next(live_data), jax.random.key(0))
    file_state, file_metrics = files.train_step(file_state, next(file_data), jax.random.key(0))
    for name in ("loss", "distill_kl", "xent", "grad_norm"):
      assert float(file_metrics[name]) == pytest.approx(float(live_metrics[name]), rel=2e-5, abs=1e-6), name


def test_the_position_resumes_at_the_same_record(top_k_dir):
  run = _build("", distill_top_k_path=top_k_dir)
  data = run.data_iterator()
  whole = [jax.device_get(next(data)) for _ in range(STEPS)]
  first = run.data_iterator()
  next(first)
  state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
  assert state[teacher_top_k.STATE_KEY] == 1
  resumed = run.data_iterator()
  resumed.set_state(state)
  for want in whole[1:]:
    got = jax.device_get(next(resumed))
    assert all(np.array_equal(got[name], want[name]) for name in want)
  with pytest.raises(ConfigError, match="saved by a run that did not read distill_top_k_path"):
    run.data_iterator().set_state({"step": 1})


def test_a_resume_may_not_switch_between_the_teacher_and_its_files(teacher_path, top_k_dir, tmp_path):  # noqa: F811
  """The state holds the teacher in one case and not in the other: a checkpoint of one would not
  restore as the other (it would be set aside as damaged), so the resume check refuses the switch."""
  run_dir = str(tmp_path / "run")
  run_record.record_start(_config(teacher_path), run_dir)
  with pytest.raises(ConfigError, match=r"distill_top_k_path: '' -> '.*teacher_top_k'"):
    run_record.check_resume(_config(teacher_path, distill_top_k_path=top_k_dir), run_dir, "checkpoint step 2")


def _read_all(directory: str, **overrides: object) -> None:
  config = _config("", distill_top_k_path=directory, **overrides)
  data = build_run(config, devices=jax.devices()[:1]).data_iterator()
  for _ in range(config.run.steps):
    next(data)


def test_files_that_do_not_fit_the_run_are_one_line(top_k_dir, tmp_path):
  cases = [
      (dict(distill_top_k=16), r"holds the teacher's top 8, this run has distill_top_k=16; set distill_top_k<=8"),
      (dict(vocab_size=256), r"was written for vocab_size=128, this run has vocab_size=256"),
      (dict(max_target_length=64), r"was written for max_target_length=32, this run has max_target_length=64"),
      (dict(data_shuffle_seed=3), r"was written for data_shuffle_seed=0, this run has data_shuffle_seed=3"),
      (dict(tokenizer_path="other.model"), r"was written for tokenizer_path=.*, this run has tokenizer_path='other"),
      (dict(steps=STEPS + 1), r"holds 4 train batches, fewer than the 5 this run reads \(steps\)"),
  ]
  for overrides, message in cases:
    with pytest.raises(UserError, match=message):
      _read_all(top_k_dir, **overrides)
  with pytest.raises(UserError, match=r"holds 2 eval batches, fewer than the 3 this run reads \(eval_steps\)"):
    _build("", distill_top_k_path=top_k_dir, eval_steps=3).eval_iterator()
  with pytest.raises(ConfigError, match="distill_top_k_path=.* holds the teacher's top k only; set distill_top_k"):
    _config("", distill_top_k_path=top_k_dir, distill_top_k=0)
  with pytest.raises(UserError, match="has no manifest.json; write it with python3 -m MaxText.generate_teacher_top_k"):
    _read_all(str(tmp_path / "nothing"))


def test_files_written_for_the_same_tokenizer_spelled_another_way_fit(top_k_dir, tmp_path, monkeypatch):
  """The manifest's tokenizer_path is compared as a file: a relative spelling or a link to the one the files were
  written with was refused as another tokenizer ('was written for tokenizer_path=...')."""
  tokenizer = tmp_path / "tok" / "tokenizer.model"
  tokenizer.parent.mkdir()
  tokenizer.write_bytes(b"the same file")
  (tmp_path / "link.model").symlink_to(tokenizer)
  copied = _copy(top_k_dir, tmp_path / "copied")
  manifest = os.path.join(copied, "manifest.json")
  with open(manifest) as f:
    written = json.load(f)
  written["data"]["tokenizer_path"] = str(tokenizer)
  with open(manifest, "w") as f:
    json.dump(written, f)
  monkeypatch.chdir(tmp_path)
  for spelling in ("tok/tokenizer.model", "./tok//tokenizer.model", "link.model"):
    _read_all(copied, tokenizer_path=spelling)
  with pytest.raises(UserError, match=r"was written for tokenizer_path=.*, this run has tokenizer_path='other"):
    _read_all(copied, tokenizer_path="other.model")


def _copy(directory: str, to: Path) -> str:
  shutil.copytree(directory, to)
  return str(to)


def test_a_damaged_or_foreign_shard_is_one_line(top_k_dir, tmp_path):
  missing = _copy(top_k_dir, tmp_path / "missing")
  os.remove(os.path.join(missing, "train", "shard-0", "part-00000.npy"))
  with pytest.raises(UserError, match=r"train/shard-0/part-00000.npy is missing; write the files again"):
    _read_all(missing)
  truncated = _copy(top_k_dir, tmp_path / "truncated")
  path = os.path.join(truncated, "train", "shard-0", "part-00000.npy")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(UserError, match=r"part-00000.npy is truncated or damaged \(.*\); write the files again"):
    _read_all(truncated)
  # Rows computed on other tokens (here: one row's hash changed): caught when that batch is read.
  foreign = _copy(top_k_dir, tmp_path / "foreign")
  part = np.load(os.path.join(foreign, "train", "shard-0", "part-00000.npy"), mmap_mode="r+")
  part["row_hash"][2 * ROWS + 3] ^= np.uint64(1)
  part.flush()
  del part
  with pytest.raises(UserError, match=r"train batch 3, row 3: the tokens differ from those the teacher's top k were "
                     "computed on"):
    _read_all(foreign)


def test_an_empty_part_file_is_one_line(top_k_dir, tmp_path):
  """Was: numpy's EOFError traceback (a file of no bytes has no header to read)."""
  empty = _copy(top_k_dir, tmp_path / "empty")
  open(os.path.join(empty, "train", "shard-0", "part-00000.npy"), "wb").close()
  with pytest.raises(UserError, match=r"part-00000.npy is truncated or damaged \(No data left in file\); write the "
                     "files again"):
    _read_all(empty)


def _edited(directory: str, to: Path, edit) -> str:
  copy = _copy(directory, to)
  part = np.load(os.path.join(copy, "train", "shard-0", "part-00000.npy"), mmap_mode="r+")
  edit(part)
  part.flush()
  del part
  return copy


def test_teacher_ids_outside_the_vocabulary_or_log_probs_not_finite_are_one_line(top_k_dir, tmp_path):
  """The row hash covers the student's tokens only. Was: an id >= vocab_size made the loss NaN (the
  step skipped, exit 0), a negative one picked a token counted from the vocabulary's end, silently;
  a NaN log-prob made the loss NaN."""
  def set_value(field: str, value: float):
    def edit(part: np.ndarray) -> None:
      part[field][ROWS + 2, 5, 0] = value  # batch 2, row 2, position 5

    return edit

  cases = [("indices", 128, r"token id 128 outside the vocabulary \[0, 128\)"),
           ("indices", -1, r"token id -1 outside the vocabulary \[0, 128\)"),
           ("logps", np.nan, "log-prob nan"), ("logps", np.inf, "log-prob inf")]
  for number, (field, value, what) in enumerate(cases):
    damaged = _edited(top_k_dir, tmp_path / f"case{number}", set_value(field, value))
    with pytest.raises(UserError, match=rf"train batch 2, row 2, position 5: {what} is not a teacher's top k; the "
                       "files are damaged or not this writer's, write them again"):
      _read_all(damaged)

  def shift(part: np.ndarray) -> None:
    part["logps"] += 3.0

  # Finite log-probs that are not normalised (shifted, or raw logits) are read: the loss renormalises them over the k.
  _read_all(_edited(top_k_dir, tmp_path / "shifted", shift))


def test_the_tool_refuses_what_it_cannot_write(teacher_path, top_k_dir, tmp_path):  # noqa: F811
  with pytest.raises(UserError, match="already exists; choose a new distill_top_k_path"):
    generate_teacher_top_k.generate(_config(teacher_path, distill_top_k_path=top_k_dir), jax.devices()[:1])
  # Under a file: was a NotADirectoryError traceback at the first batch, after the teacher had loaded and run.
  (tmp_path / "a_file").write_text("")
  blocked = str(tmp_path / "a_file" / "top_k")
  with pytest.raises(UserError, match=f"distill_top_k_path={blocked} cannot be written: .*a_file is a file, not a folder; choose"):
    generate_teacher_top_k.generate(_config(teacher_path, distill_top_k_path=blocked), jax.devices()[:1])
  # A full disk at the first part: was an OSError traceback.
  def full(*args, **kwargs):
    raise OSError(28, "No space left on device", args[0])

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(np.lib.format, "open_memmap", full)
    with pytest.raises(UserError, match=r"cannot write the teacher's top k to .*full \(No space left on device\) at "
                       r"train batch 1 of 4; free space there"):
      generate_teacher_top_k.generate(_config(teacher_path, distill_top_k_path=str(tmp_path / "full")),
                                      jax.devices()[:1])
  with pytest.raises(ConfigError, match="generate_teacher_top_k writes the teacher's top k on a distillation run's "
                     "batches: it needs objective=distill"):
    generate_teacher_top_k.generate(_config("", distill_top_k_path="/nonexistent/top_k"), jax.devices()[:1])


# ---- a killed run reads the same records --------------------------------------------------------------

RUN_STEPS = 8


def _command(out: Path, directory: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=distill", f"base_output_directory={out}",
          "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=128",
          "base_num_decoder_layers=2", "vocab_size=128", "max_target_length=32", "print_config=False",
          "cpu_peak_tflops=0.1", f"steps={RUN_STEPS}", "checkpoint_period=3", "objective=distill", "distill_top_k=8",
          "distill_temperature=2", f"distill_top_k_path={directory}"]


@pytest.mark.slow
def test_a_killed_run_from_files_rerun_is_bitwise_equal(tmp_path, teacher_path):  # noqa: F811
  """The tool's command, then a run killed after a checkpoint and rerun: its losses equal an
  uninterrupted run's bit for bit, so every resumed step read the same records."""
  from tests.test_resume import _committed_steps, _losses, _run, _start_and_signal

  directory = str(tmp_path / "top_k")
  tool = [sys.executable, "-m", "MaxText.generate_teacher_top_k", *_command(tmp_path / "tool", directory)[3:],
          f"distill_teacher_path={teacher_path}", "distill_teacher_model_name=default",
          f"distill_teacher_overrides={_teacher_overrides()}"]
  assert "wrote the teacher's top 8 of 8 train batches" in _run(tool).stdout
  _run(_command(tmp_path / "whole", directory))
  uninterrupted = _losses(tmp_path / "whole" / "distill")
  assert sorted(uninterrupted) == list(range(1, RUN_STEPS + 1))
  run_dir = tmp_path / "killed" / "distill"
  command = _command(tmp_path / "killed", directory)
  proc = _start_and_signal(command, 4, lambda: 3 in _committed_steps(run_dir), signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  latest = _committed_steps(run_dir)[-1]
  rerun = _run(command)
  assert f"state: resumed from step {latest}" in rerun.stdout
  assert _losses(run_dir) == uninterrupted


@pytest.mark.parametrize("content, problem", [(b"\xff\xfe{", "manifest.json is not JSON (not UTF-8 text)"),
                                              (b"[1, 2]", "manifest.json holds a JSON list, not this writer's object"),
                                              (b'{"format": 1}', "manifest.json has top_k=None, not a whole number >= 1"),
                                              (b'{"format": 1, "top_k": 8, "num_data_shards": 1, "batches_per_part": 64, '
                                               b'"data": {}, "batches": ["train"]}',
                                               "manifest.json has batches=['train'], not an object of batch counts per "
                                               "split")],
                         ids=["not-utf8", "a-list", "no-fields", "batches-a-list"])
def test_a_damaged_manifest_is_one_line(tmp_path, content, problem):
  """Was: a UnicodeDecodeError / AttributeError traceback (a manifest that is not JSON was one line already); a
  manifest without the writer's fields (or with them of another type) a KeyError / AttributeError traceback."""
  from MaxText.input_pipeline import teacher_top_k

  (tmp_path / "manifest.json").write_bytes(content)
  with pytest.raises(UserError) as raised:
    teacher_top_k.read_manifest(str(tmp_path))
  assert str(raised.value) == f"distill_top_k_path {tmp_path}: {problem}; write the files again", str(raised.value)


def _hand_written(tmp_path: Path, part: object, top_k: int = K) -> tuple[str, dict]:
  """A directory of one train batch whose part file is `part` (an array, or raw bytes), and its manifest."""
  directory = tmp_path / "hand_written"
  (directory / "train" / "shard-0").mkdir(parents=True)
  manifest = {"format": 1, "top_k": top_k, "num_data_shards": 1, "batches_per_part": 64, "data": {},
              "batches": {"train": 1}}
  (directory / "manifest.json").write_text(json.dumps(manifest))
  path = directory / "train" / "shard-0" / "part-00000.npy"
  if isinstance(part, bytes):
    path.write_bytes(part)
  else:
    np.save(path, part)
  return str(directory), manifest


@pytest.mark.parametrize("part, problem", [
    (np.zeros((), teacher_top_k.record_dtype(32, K)), r"holds an array of shape \(\) of .*, not \(4,\) of"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': 'zz', }\n", r"is truncated or damaged \(.*EOF in multi-line statement"),
], ids=["0-d", "damaged-header"])
def test_a_part_of_no_records_or_with_a_header_numpy_cannot_read_is_one_line(tmp_path, part, problem):
  """Was: an IndexError traceback (a 0-d array has no record count) and a tokenize.TokenError one (numpy reads the
  header as Python)."""
  directory, manifest = _hand_written(tmp_path, part)
  with pytest.raises(UserError, match=problem):
    teacher_top_k.TopKFiles(directory, manifest, "train", teacher_top_k.HostShard(0, 1, ROWS), 32)


def test_a_manifest_k_beyond_the_vocabulary_is_one_line(tmp_path):
  """Was: accepted, then numpy's ValueError traceback laying out a record of that k."""
  directory, manifest = _hand_written(tmp_path, np.zeros(ROWS, teacher_top_k.record_dtype(32, K)), top_k=2 ** 40)
  data = _config("", distill_top_k_path=directory).data
  with pytest.raises(UserError, match=r"holds the teacher's top 1099511627776, more tokens than vocab_size=128; the "
                     "files are damaged or not this writer's"):
    teacher_top_k.check_manifest(directory, teacher_top_k.read_manifest(directory), data, K, 1, "train", 1)
