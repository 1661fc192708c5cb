"""benchmarks/gpu_suite.py: its dry run (tiny shapes on CPU) builds and prints the whole table, and
its row planning (budget, OOM, upstream log parsing) behaves on made-up child results."""

import argparse
import importlib.util
import os
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# A Python 3.12 venv with the PyPI maxtext package (getting_started/GPU.md says how to make one).
UPSTREAM_VENV = Path(os.environ.get("UPSTREAM_VENV", "/tmp/upstream-venv"))


def _load_suite():
  spec = importlib.util.spec_from_file_location("gpu_suite", REPO_ROOT / "benchmarks" / "gpu_suite.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _table(out: str) -> list[list[str]]:
  lines = [line for line in out.splitlines() if line.startswith("| ")]
  return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_dry_run_prints_header_and_every_section(capsys):
  suite = _load_suite()
  rows = suite.main(["dry_run=true"])
  out = capsys.readouterr().out
  for key in ("date: ", "device: 1 x cpu", "driver: ", "CUDA: ", "jax ", "python "):
    assert key in out, key
  assert "upstream: not available (no upstream_site given)" in out
  table = _table(out)
  assert table[0] == suite.COLUMNS
  by_section = {}
  for row in rows:
    by_section.setdefault(row["section"], []).append(row)
  ours = [r for r in by_section["train"] if r["impl"] == "ours" and r["quant"] == "bf16"][0]
  assert ours["note"] == "ok" and float(ours["tokens/s"]) > 0 and float(ours["step ms"]) > 0
  assert ours["seq"] == "64" and ours["MFU"].endswith("%")
  fp8 = [r for r in by_section["train"] if r.get("quant") == "fp8"][0]
  assert fp8["note"].startswith("skipped: fp8 needs compute capability")
  assert all(r["note"].startswith("engine") and float(r["tokens/s"]) > 0 for r in by_section["decode"])
  assert [r["batch"] for r in by_section["serve"]] == ["1", "8", "32"]
  assert all(float(r["tokens/s"]) > 0 for r in by_section["serve"])
  assert len(table) == 2 + len(rows)


def _args(**kw):
  base = dict(dry_run=False, budget_s=480.0, row_timeout_s=180.0, steps=5, upstream_site="", upstream_python="",
              rows="", quants="", dump_hlo="", full=False, serve=False)
  return argparse.Namespace(**dict(base, **kw))


PROBE = dict(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", count=1, compute_capability="9.0",
             memory_gib=79.1, jax="x", jaxlib="x")
UPSTREAM_LOG = "".join(f"completed step: {i}, seconds: {0.5 if i else 30:.3f}, TFLOP/s/device: 300.000, "
                       f"Tokens/s/device: 32768.000, total_weights: 1, loss: 10.0\n" for i in range(8)) + \
    "number parameters: 1.236 billion\n"


def test_planned_rows_with_fake_children(capsys, tmp_path):
  """OOM and other failures become rows, upstream's log gives a ratio, the budget skips the rest."""
  suite = _load_suite()
  calls = []

  def runner(cmd, env, cwd, timeout):
    calls.append(cmd)
    if "_child=probe" in cmd:
      return PROBE, "ok", ""
    if cmd[1] == "-m":  # upstream
      assert env["PYTHONPATH"] == str(tmp_path) and not cwd.startswith(str(REPO_ROOT))
      assert "attention=cudnn_flash_jax" in cmd and "hardware=gpu" in cmd
      return None, "failed: exit status 1", UPSTREAM_LOG
    spec = cmd[-1]
    if '"llama3.1-8b"' in spec:
      oom = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory"
      return None, suite.classify(1, oom, False, 9), ""
    return dict(step_s=0.25, tokens_per_s=65536.0, tflops=400.0, mfu=0.4, params_m=1235.8, peak=989.0,
                compile_s=20), "ok", ""

  (tmp_path / "maxtext").mkdir()
  rows = suite.run_suite(_args(upstream_site=str(tmp_path)), runner)
  train = [r for r in rows if r["section"] == "train"]
  first = train[0]
  assert [first[k] for k in ("impl", "model", "quant", "seq", "batch")] == ["ours", "1b", "bf16", "4096", "4"]
  assert first["ours/upstream"] == "2.00" and train[1]["impl"] == "upstream" and train[1]["tokens/s"] == "32768"
  assert train[1]["params"] == "1.24B" and train[1]["step ms"] == "500.0"
  assert [r["note"] for r in train if r["model"] == "8b" and r["impl"] == "ours"] == ["OOM"]
  assert [r["note"] for r in train if r["quant"] == "fp8" and r["seq"] == "8192"] == ["skipped: only with full=true"] * 2
  assert "| train | ours | 1b |" in capsys.readouterr().out

  rows = suite.run_suite(_args(upstream_site=str(tmp_path / "empty"), rows="1b"), runner)
  assert [r["note"] for r in rows if r.get("impl") == "upstream"] == [
      f"upstream: not available (no maxtext package in {tmp_path / 'empty'})"]

  calls.clear()
  rows = suite.run_suite(_args(budget_s=60.0), runner)  # less than the serving reserve: no training child
  assert [c for c in calls if "_child=probe" not in c] == []
  assert all("budget" in r["note"] or "only with full=true" in r["note"] or "no upstream_site" in r["note"]
             for r in rows if r["section"] == "train")


def test_classify_and_upstream_log():
  suite = _load_suite()
  assert suite.classify(None, "", True, 120) == "timeout after 120 s"
  assert suite.classify(1, "Traceback ...\nValueError: bad | key\n", False, 1) == "failed: ValueError: bad / key"
  parsed = suite.parse_upstream_log(UPSTREAM_LOG)
  assert parsed["steps"] == 5 and parsed["step_s"] == 0.5 and parsed["params_m"] == pytest.approx(1236)
  assert suite.parse_upstream_log("no steps here") is None


@pytest.mark.slow
@pytest.mark.skipif(not (UPSTREAM_VENV / "bin" / "python").exists(),
                    reason=f"no upstream venv at {UPSTREAM_VENV} (getting_started/GPU.md: how to make one)")
def test_dry_run_with_upstream_on_cpu(capsys):
  site = next((UPSTREAM_VENV / "lib").glob("python3*/site-packages"))
  rows = _load_suite().main(["dry_run=true", "serve=false", f"upstream_site={site}",
                             f"upstream_python={UPSTREAM_VENV / 'bin' / 'python'}"])
  train = [r for r in rows if r["section"] == "train" and r["quant"] == "bf16"]
  assert [r["impl"] for r in train] == ["ours", "upstream"]
  assert train[1]["note"] == "ok" and float(train[1]["tokens/s"]) > 0
  assert float(train[0]["ours/upstream"]) > 0
  assert "upstream: maxtext " in capsys.readouterr().out
