"""The data-reader fault campaign (tests/chaos/data_campaign.py) as a slow test: CHAOS_SEED picks the
damage (default 0). Every reader of the user's files, fed garbage, a BOM, a cut-off last record, an
empty file and another format's bytes, either gives the file's own documents or stops with one line
naming the file; a few of the cases go through train.py, which must exit 2 before writing anything."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("tensorflow_datasets", reason="the tfds cases need tensorflow_datasets (EXTRAS=test bash setup.sh)")
pytest.importorskip("transformers", reason="the GRPO cases need transformers (EXTRAS=test bash setup.sh)")

from .data_campaign import CLI_CASES, cases, run_campaign  # noqa: E402


@pytest.mark.slow
def test_data_readers_survive_a_seeded_fault_campaign(tmp_path):
  outcomes, summary = run_campaign(int(os.environ.get("CHAOS_SEED", "0")), tmp_path)
  problems = [f"{o.case}: {'; '.join(o.problems)}" for o in outcomes if o.problems]
  assert not problems, "\n".join(problems)
  assert summary["cases"] == len(cases()) + len(CLI_CASES)
  assert summary["documents"] > 0 and summary["errors"] > 0, summary
