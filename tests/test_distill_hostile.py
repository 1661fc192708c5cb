"""Distillation given what a hurried or hostile user gives: each case trains right or stops in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.errors import ConfigError, UserError
from MaxText.training.objectives import distill_loss
from MaxText.training.run_assembly import build_run
from tests.test_distill import _distill_config, _teacher_overrides, teacher_path  # noqa: F401 (a fixture)
from tests.test_distill_top_k import ROWS, _edited, _read_all, top_k_dir  # noqa: F401 (a fixture)


def test_a_teacher_override_of_max_target_length_is_one_line(tiny_overrides, teacher_path):  # noqa: F811
  """Was: accepted. The teacher runs on the student's 32-token rows whatever its config says; with a learned
  position table of 16 rows, told "max_target_length (32) exceeds max_position_embeddings (16)", a user who also
  set max_target_length=16 for the teacher passed every check and trained on a NaN loss."""
  learned = _teacher_overrides(position_embedding="learned", max_position_embeddings=16, max_target_length=16)
  for overrides in (_teacher_overrides(max_target_length=16), learned):
    with pytest.raises(ConfigError) as raised:
      build_run(_distill_config(tiny_overrides, teacher_path, distill_teacher_overrides=overrides),
                devices=jax.devices()[:1])
    assert str(raised.value) == (
        "objective=distill: distill_teacher_overrides sets max_target_length=16, but the teacher runs on the student's "
        "rows of max_target_length=32; drop max_target_length from distill_teacher_overrides (the teacher takes the "
        "student's)")
  # The student's own length, spelled out, is no change.
  build_run(_distill_config(tiny_overrides, teacher_path, distill_teacher_overrides=_teacher_overrides(
      max_target_length=32)), devices=jax.devices()[:1])


def test_top_k_records_unsorted_or_with_a_repeated_id_are_one_line(top_k_dir, tmp_path):  # noqa: F811
  """Was: read as they were. The writer's records are sorted with distinct ids: unsorted, distill_top_k=4 (below the
  files' 8) took 4 tokens that were not the teacher's top 4; a repeated id counted its probability twice."""
  def swap(part: np.ndarray) -> None:  # batch 2, row 2, position 5: the 2nd and 3rd swapped
    part["logps"][ROWS + 2, 5, [1, 2]] = part["logps"][ROWS + 2, 5, [2, 1]]
    part["indices"][ROWS + 2, 5, [1, 2]] = part["indices"][ROWS + 2, 5, [2, 1]]

  def repeat(part: np.ndarray) -> None:
    part["indices"][ROWS + 2, 5, 1] = part["indices"][ROWS + 2, 5, 0]

  for name, edit, what in (("unsorted", swap, "the log-probs are not sorted high to low"),
                           ("repeated", repeat, "a token id repeats")):
    damaged = _edited(top_k_dir, tmp_path / name, edit)
    with pytest.raises(UserError) as raised:
      _read_all(damaged, distill_top_k=4)
    assert str(raised.value) == (f"distill_top_k_path {damaged}: train batch 2, row 2, position 5: {what}, which no "
                                 "teacher's top k does; the files are damaged or not this writer's, write them again")
  # Ties are sorted (not increasing): equal log-probs read.
  def tie(part: np.ndarray) -> None:
    part["logps"][ROWS + 2, 5, 1] = part["logps"][ROWS + 2, 5, 0]

  _read_all(_edited(top_k_dir, tmp_path / "tie", tie), distill_top_k=4)


def test_a_top_k_of_one_is_one_line(tiny_overrides, teacher_path):  # noqa: F811
  """Was: accepted, and the distillation term was 0 with no gradient at every position (both distributions
  renormalised over one token are 1), so the run trained on (1 - alpha) of the labels alone."""
  student, teacher = jax.random.normal(jax.random.key(0), (2, 2, 3, 11))
  targets = distill_loss.teacher_targets(teacher, 2.0, 1)
  kl, grad = jax.value_and_grad(lambda s: jnp.sum(distill_loss.token_kl(s, targets, "forward_kl", 2.0)))(student)
  assert float(kl) == 0.0 and not np.any(np.asarray(grad))
  with pytest.raises(ConfigError, match=r"^distill_top_k=1 renormalises .* so the KL is 0 and teaches nothing; set "
                     r"distill_top_k >= 2 \(or 0, the full vocabulary\)$"):
    _distill_config(tiny_overrides, teacher_path, distill_top_k=1)
  assert _distill_config(tiny_overrides, teacher_path, distill_top_k=2).distill.distill_top_k == 2


def test_a_resume_naming_another_teacher_is_refused(tiny_overrides, teacher_path, tmp_path):  # noqa: F811
  """Was: accepted. A resume reads the teacher from the checkpoint, so another teacher of the same shapes named at
  the resume was recorded in config.yml but never used. Now the resume check names the key, as for other keys
  that fix what the saved state means."""
  from MaxText.configuration import run_record

  run_dir = str(tmp_path / "run")
  run_record.record_start(_distill_config(tiny_overrides, teacher_path), run_dir)
  other = str(tmp_path / "other_teacher")
  import shutil
  shutil.copytree(teacher_path, other)
  with pytest.raises(ConfigError, match=r"distill_teacher_path: '.*params' -> '.*other_teacher'"):
    run_record.check_resume(_distill_config(tiny_overrides, other), run_dir, "checkpoint step 2")
  with pytest.raises(ConfigError, match=r"distill_teacher_overrides: "):
    run_record.check_resume(_distill_config(tiny_overrides, teacher_path, distill_teacher_overrides=_teacher_overrides(
        rope_max_timescale=500)), run_dir, "checkpoint step 2")
  run_record.check_resume(_distill_config(tiny_overrides, teacher_path), run_dir, "checkpoint step 2")  # unchanged
