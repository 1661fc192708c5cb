"""The serving fault campaign (tests/chaos/serving_campaign.py) as a slow test: CHAOS_SEED and
CHAOS_SERVE_REQUESTS choose the seed and the number of requests (any count by hand)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")

from .serving_campaign import run  # noqa: E402


@pytest.mark.slow
def test_serving_fault_campaign():
  figures = run(seed=int(os.environ.get("CHAOS_SEED", "0")),
                requests=int(os.environ.get("CHAOS_SERVE_REQUESTS", "1000")))
  assert not figures["bad_reference"], figures["bad_reference"]
  assert not figures["unexpected"], figures["unexpected"]
  assert not figures["mismatches"], figures["mismatches"]
  assert figures["equal_to_alone"] == figures["well_formed"] > 0
  assert not figures["health_failures"] and figures["health_probes"] > 0, figures["health_failures"]
  after = figures["after"]
  assert after["slots_in_use"] == 0 and after["queue_length"] == 0, after
  assert after["pages_reserved"] == 0 and after["pages_free"] == after["pages_total"], after
