"""benchmarks/linear_attention_bench.py keeps running: both layers, training and decode, at a tiny length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_linear_attention_bench_runs_both_layers_and_both_phases():
  proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "linear_attention_bench.py"), "lengths=128",
                         "decode_steps=2"], capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| linear") or
          line.startswith("| full")]
  assert [r[0].strip() for r in rows] == ["linear", "full"]
  for row in rows:
    assert float(row[3].replace(",", "")) > 0 and float(row[4]) > 0, row


@pytest.mark.slow
def test_its_tpu_mode_prices_both_layers_compiled_for_a_topology():
  """aot=TOPOLOGY: each layer kind's train step compiled for v5p-8 by train_compile and priced by the step-time model."""
  pytest.importorskip("libtpu", reason="needs libtpu for the TPU topology")
  proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "linear_attention_bench.py"), "aot=v5p-8",
                         "lengths=256"], capture_output=True, text=True, timeout=1200, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| linear", "| full"))]
  assert [r[0].strip() for r in rows] == ["linear", "full"]
  for row in rows:  # predicted step ms, tokens/s/chip
    assert float(row[2].replace(",", "")) > 0 and float(row[3].replace(",", "")) > 0, row
