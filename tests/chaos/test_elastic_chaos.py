"""The elastic fault campaign (tests/chaos/elastic_campaign.py) as a slow test: CHAOS_SEED and
CHAOS_ELASTIC_TRIALS choose the trials (default: seed 0, 3 trials, one of each kind: a kill during
a step, during a checkpoint save, during a resize). Every trial must finish without a person, with
the losses of an uninterrupted run and no checkpoint lost."""

from __future__ import annotations

import os

import pytest

from tests.chaos.elastic_campaign import run_campaign


@pytest.mark.slow
def test_elastic_training_survives_a_seeded_fault_campaign(tmp_path):
  trials = int(os.environ.get("CHAOS_ELASTIC_TRIALS", "3"))
  outcomes, summary = run_campaign(int(os.environ.get("CHAOS_SEED", "0")), trials, tmp_path)
  problems = [f"trial {o.trial.index} ({o.trial.fault}): {'; '.join(o.problems)}" for o in outcomes if o.problems]
  assert not problems, "\n".join(problems)
  assert summary["equal_to_uninterrupted"] == trials
