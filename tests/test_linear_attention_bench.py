"""benchmarks/linear_attention_bench.py keeps running: both layers, training and decode, at a tiny length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_linear_attention_bench_runs_both_layers_and_both_phases():
  proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "linear_attention_bench.py"), "--lengths", "128",
                         "--decode_steps", "2"], capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| linear") or
          line.startswith("| full")]
  assert [r[0].strip() for r in rows] == ["linear", "full"]
  for row in rows:
    assert float(row[3].replace(",", "")) > 0 and float(row[4]) > 0, row
