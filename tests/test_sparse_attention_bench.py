"""benchmarks/sparse_attention_bench.py keeps working: its CPU table at a short length (every form), and its
TPU mode (slow: two AOT compiles)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = str(REPO / "benchmarks" / "sparse_attention_bench.py")


def _rows(stdout: str, forms: tuple[str, ...]) -> list[list[str]]:
  return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines()
          if line.startswith(tuple(f"| {form} " for form in forms))]


@pytest.mark.slow
def test_its_cpu_table_times_every_form():
  proc = subprocess.run([sys.executable, BENCH, "lengths=512", "index_topk=64"], capture_output=True, text=True,
                        timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = _rows(proc.stdout, ("full", "gathered", "masked"))
  assert [r[0] for r in rows] == ["full", "gathered", "masked"]
  for row in rows:  # seconds, tokens/s
    assert float(row[2]) > 0 and float(row[3].replace(",", "")) > 0, row


@pytest.mark.slow
def test_its_tpu_mode_prices_dense_and_sparse_mla_compiled_for_a_topology():
  """aot=TOPOLOGY: V3.2's attention compiled for v5p-8 with and without the indexer, priced by the step-time model."""
  pytest.importorskip("libtpu", reason="needs libtpu for the TPU topology")
  proc = subprocess.run([sys.executable, BENCH, "aot=v5p-8", "lengths=2048", "index_topk=256"],
                        capture_output=True, text=True, timeout=1800, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = _rows(proc.stdout, ("full", "sparse"))
  assert [r[0] for r in rows] == ["full", "sparse"], proc.stdout[-2000:]
  for row in rows:  # predicted step ms, tokens/s/chip
    assert float(row[2].replace(",", "")) > 0 and float(row[3].replace(",", "")) > 0, row
  assert rows[0][2] != rows[1][2], "the indexer changed nothing in the compiled step"
