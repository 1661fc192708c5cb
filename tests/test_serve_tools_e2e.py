"""end_to_end/cpu/serve_tools.sh, shortened: a tiny model taught by SFT to call a calculator, served,
and driven through the official openai client's tool-calling flow (tools -> tool_calls -> a tool
message -> the final answer), whole and streamed; getting_started/Serving.md runs the full script."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_openai_clients_tool_calling_flow_against_a_served_sft_tool_caller(tmp_path: Path) -> None:
  # One device (not conftest's 8 simulated ones), as a reader runs it.
  env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)), "SFT_STEPS": "400", "N": "8"}
  done = subprocess.run(["bash", str(REPO / "end_to_end/cpu/serve_tools.sh"), str(tmp_path / "out")], env=env,
                        capture_output=True, text=True, timeout=1200)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "whole: " in done.stdout and "streamed: " in done.stdout
  assert "end_to_end ok" in done.stdout
