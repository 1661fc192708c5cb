"""The 1F1B timetable (layers/pipeline_timetable.py), replayed symbolically: every stage runs every
(microbatch, pass) forward and backward exactly once, each after the work it depends on; the
input ring never overwrites an input whose backward has not run; the phases and bubble."""

from __future__ import annotations

import pytest

from MaxText.layers import pipeline, pipeline_timetable

CASES = [(2, 1, 1), (2, 4, 1), (4, 8, 1), (4, 3, 1), (2, 4, 2), (2, 2, 3), (4, 8, 2), (4, 4, 4), (3, 9, 2)]


def _replay(table: pipeline_timetable.Timetable) -> dict:
  """Runs the timetable on symbols; returns {("f"|"b", micro, pass, stage): iteration}."""
  s_count, r_count = table.num_stages, table.num_repeats
  done: dict = {}
  ring = [dict() for _ in range(s_count)]  # slot -> (micro, pass) stored there
  for t in range(table.num_iterations):
    for s in range(s_count):  # forwards first, as in the loop: a stage stores its input, then runs it
      if not table.fwd_valid[t, s]:
        continue
      m, r = int(table.fwd_micro[t, s]), int(table.fwd_pass[t, s])
      if s > 0:
        assert done[("f", m, r, s - 1)] == t - 1
      elif r > 0:
        assert done[("f", m, r - 1, s_count - 1)] == t - 1
      else:
        assert table.feed_from_inputs[t] and pipeline_timetable.first_pass_micro(t, s_count, r_count) == m
      slot = int(table.fwd_slot[t, s])
      assert slot not in ring[s], f"stage {s} overwrites {ring[s].get(slot)} at iteration {t}"
      assert 0 <= slot < table.num_slots
      ring[s][slot] = (m, r)
      assert ("f", m, r, s) not in done
      done[("f", m, r, s)] = t
    if table.head_valid[t]:
      m = int(table.head_micro[t])
      assert done[("f", m, r_count - 1, s_count - 1)] == t
      done[("head", m)] = t
    for s in reversed(range(s_count)):
      if not table.bwd_valid[t, s]:
        continue
      m, r = int(table.bwd_micro[t, s]), int(table.bwd_pass[t, s])
      if s < s_count - 1:
        assert done[("b", m, r, s + 1)] == t - 1
      elif r < r_count - 1:
        assert done[("b", m, r + 1, 0)] == t - 1
      else:
        assert done[("head", m)] == t
      assert ring[s].pop(int(table.bwd_slot[t, s])) == (m, r)
      assert ("b", m, r, s) not in done
      done[("b", m, r, s)] = t
  assert all(not slots for slots in ring)
  return done


@pytest.mark.parametrize("stages, micro, repeats", CASES)
def test_every_item_runs_once_in_dependency_order(stages, micro, repeats):
  table = pipeline_timetable.build(stages, micro, repeats)
  done = _replay(table)
  assert len(done) == 2 * stages * micro * repeats + micro
  # Phases: forwards only before warmup_end, backwards only from steady_end.
  assert not table.bwd_valid[:table.warmup_end].any() and not table.fwd_valid[table.steady_end:].any()
  assert table.head_valid[table.warmup_end] and not table.head_valid[:table.warmup_end].any()
  # Busy stage-iterations are F+B pairs: the bubble is the circular/GPipe one, (S-1)/(M·R+S-1).
  t_count = table.num_iterations
  forward_time = table.steady_end  # iterations that contain a forward
  backward_time = t_count - table.warmup_end
  assert forward_time == backward_time == pipeline.num_iterations(stages, micro, repeats)
  assert 1 - table.fwd_valid.sum() / (forward_time * stages) == pytest.approx(
      pipeline.bubble_fraction(stages, micro, repeats))


@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 4), (4, 3), (4, 8), (4, 16)])
def test_one_pass_keeps_min_m_2s_minus_1_inputs(stages, micro):
  assert pipeline_timetable.build(stages, micro).num_slots == min(micro, 2 * stages - 1)


def test_interleaving_keeps_far_fewer_inputs_than_all_items():
  """Stage 0 holds a group's R·S items plus the next group's S-1 first-pass ones; the
  circular GPipe schedule holds all M·R."""
  table = pipeline_timetable.build(4, 32, 2)
  assert table.num_slots == (2 + 1) * 4 - 1
  assert table.num_slots < 32 * 2 / 5


def test_interleaving_needs_microbatches_in_groups_of_stages():
  with pytest.raises(ValueError, match="multiple of the stages"):
    pipeline_timetable.build(4, 6, 2)
