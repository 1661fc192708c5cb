"""The training fault campaign (tests/chaos/training_campaign.py) as a slow test: CHAOS_SEED and
CHAOS_TRAINING_TRIALS choose the trials (default: seed 0, 20 trials over local disk and gs://,
one process and two). Every trial must end bitwise equal to an uninterrupted run, lose no saved
step, and announce every failure in one line within its budget."""

from __future__ import annotations

import os

import pytest

from tests.chaos.training_campaign import Layout, run_campaign

LAYOUTS = [Layout("local", 1), Layout("local", 2), Layout("gcs", 1), Layout("gcs", 2)]


@pytest.mark.slow
def test_training_survives_a_seeded_fault_campaign(tmp_path, gcs):
  seed = int(os.environ.get("CHAOS_SEED", "0"))
  trials = int(os.environ.get("CHAOS_TRAINING_TRIALS", "20"))
  outcomes, summary = run_campaign(seed, trials, LAYOUTS, tmp_path, gcs)
  problems = [f"trial {o.trial.index} ({o.trial.layout}, {o.trial.fault}): {'; '.join(o.problems)}"
              for o in outcomes if o.problems]
  assert not problems, "\n".join(problems)
  assert summary["bitwise_equal"] == trials
