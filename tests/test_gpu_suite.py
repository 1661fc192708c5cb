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


def _tables(out: str) -> list[list[list[str]]]:
  """Each Markdown table printed, as rows of cells (its header first)."""
  tables: list[list[list[str]]] = []
  previous = ""
  for line in out.splitlines():
    if line.startswith("| "):
      if not previous.startswith("| "):
        tables.append([])
      tables[-1].append([cell.strip() for cell in line.strip("|").split("|")])
    previous = line
  return tables


def _table(out: str) -> list[list[str]]:
  return _tables(out)[0]


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
  assert "4 steps per call, unrolled layers" in by_section["decode"][0]["note"]
  assert by_section["decode"][0]["quant"] == "int8"
  assert "the weight-read bound" in by_section["decode"][0]["note"]
  assert [r["note"].split(":")[0] for r in by_section["lora"]] == ["base model only", "1 adapter", "2 adapters mixed"]
  assert all(float(r["tokens/s"]) > 0 for r in by_section["lora"])
  assert all(float(r["tokens/s"]) > 0 for r in by_section["serve"])
  assert len(table) == 2 + len(rows)
  assert float(ours["compile s"]) > 0 and float(ours["step / roofline"]) > 0
  # The second table: the roofline of the compiled step (priced as on an H200: a CPU has no figures).
  roofline = _tables(out)[1]
  assert roofline[0] == suite.ROOFLINE_COLUMNS and "on NVIDIA H200" in out
  cells = dict(zip(roofline[0], roofline[2]))
  assert cells["impl"] == "ours" and float(cells["roofline ms"]) > 0 and int(cells["kernels"]) > 0
  assert float(cells["gemm ms"]) > 0 and float(cells["measured ms"]) == pytest.approx(float(ours["step ms"]), abs=0.1)


def _args(**kw):
  base = dict(dry_run=False, budget_s=480.0, row_timeout_s=180.0, steps=5, upstream_site="", upstream_python="",
              rows="", quants="", dump_hlo="", full=False, serve=False, extra="")
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


def test_extra_rows_carry_their_settings_and_run_without_upstream(tmp_path):
  suite = _load_suite()
  seen = []

  def runner(cmd, env, cwd, timeout):
    if "_child=probe" in cmd:
      return PROBE, "ok", ""
    seen.append((cmd, env.get("XLA_FLAGS", "")))
    return dict(step_s=0.25, tokens_per_s=65536.0, tflops=400.0, mfu=0.4, params_m=1235.8, peak=989.0,
                compile_s=20), "ok", ""

  (tmp_path / "maxtext").mkdir()
  extra = "8b,bf16,4096,remat_policy=save_dot_except_mlp;1b,fp8,4096,xla_flags=--xla_gpu_enable_triton_gemm=false"
  rows = suite.run_suite(_args(upstream_site=str(tmp_path), rows="none", extra=extra), runner)
  assert [(r["model"], r["quant"], r["note"]) for r in rows if r["section"] == "train"] == [
      ("8b", "bf16", "ok; remat_policy=save_dot_except_mlp"),
      ("1b", "fp8", "ok; xla_flags=--xla_gpu_enable_triton_gemm=false")]
  assert all(cmd[1] != "-m" for cmd, _ in seen)  # no upstream twin for a setting of this project's own
  assert '"remat_policy": "save_dot_except_mlp"' in seen[0][0][-1]
  assert seen[1][1].endswith("--xla_gpu_enable_triton_gemm=false") and "xla_flags" not in seen[1][0][-1]
  with pytest.raises(SystemExit, match="extra row '9b,bf16,4096'"):
    suite.plan_extra("9b,bf16,4096", dry=False)
  with pytest.raises(SystemExit, match="no batch size for 8b at 2048"):
    suite.plan_extra("8b,bf16,2048", dry=False)


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
