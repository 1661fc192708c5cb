"""The GRPO reward-function fault campaign (tests/chaos/grpo_campaign.py) as a slow test: CHAOS_SEED
and CHAOS_GRPO_TRIALS choose the trials (default: seed 0, one of each fault). Every trial ends in
the right result (bitwise the clean run's for a function that mutates its arguments or is slow) or
in one `error:` line naming the function, with exit status 2 (4: the hang watchdog)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="GRPO's prompts need transformers (EXTRAS=test bash setup.sh)")

from tests.chaos.grpo_campaign import FAULTS, run_campaign  # noqa: E402


@pytest.mark.slow
def test_grpo_survives_hostile_reward_functions(tmp_path):
  seed = int(os.environ.get("CHAOS_SEED", "0"))
  trials = int(os.environ.get("CHAOS_GRPO_TRIALS", str(len(FAULTS))))
  outcomes, summary = run_campaign(seed, trials, tmp_path)
  problems = [f"trial {o.trial.index} ({o.trial.fault} at rollout {o.trial.at}, {o.trial.arg}): {'; '.join(o.problems)}"
              for o in outcomes if o.problems]
  assert not problems, "\n".join(problems)
  assert summary["ended_right"] == trials
