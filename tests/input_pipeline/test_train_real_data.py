"""train.py on real data: eval loss and input_wait_s in the metrics, and a resumed run that sees
exactly the batches of an uninterrupted one (the checkpoint stores the data position)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env

MODEL = ["base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
         "vocab_size=512", "print_config=False", "cpu_peak_tflops=0.1", "learning_rate_schedule_steps=6",
         "checkpoint_period=3", "async_checkpointing=False", "eval_interval=3", "eval_steps=2",
         "data_prefetch_batches=3"]


def _train(out: Path, run_name: str, spm_model: str, prepared: Path, *extra: str) -> subprocess.CompletedProcess:
  files = [f"grain_train_files={prepared / 'arrayrecord' / 'train.array_record'}",
           f"grain_eval_files={prepared / 'arrayrecord' / 'validation.array_record'}"]
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={run_name}",
             f"base_output_directory={out}", "dataset_type=grain", f"tokenizer_path={spm_model}", *files, *MODEL,
             *extra]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _records(run_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three train.py processes: about a minute on an idle 2-core machine
def test_resumed_run_matches_uninterrupted_run_and_reports_eval(tmp_path, spm_model, prepared):
  reference = _train(tmp_path, "ref", spm_model, prepared, "steps=6")
  _train(tmp_path, "resumed", spm_model, prepared, "steps=3")
  resumed = _train(tmp_path, "resumed", spm_model, prepared, "steps=6")
  assert "resumed from step 3" in resumed.stdout
  ref, res = _records(tmp_path / "ref"), _records(tmp_path / "resumed")
  losses = lambda records: {r["step"]: r["loss"] for r in records if "loss" in r}  # noqa: E731
  evals = lambda records: {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}  # noqa: E731
  assert losses(ref) == losses(res) and sorted(losses(ref)) == list(range(1, 7))
  assert evals(ref) == evals(res) and sorted(evals(ref)) == [3, 6]
  assert all(0 <= r["input_wait_s"] < 60 for r in ref if "loss" in r)
  assert "eval        6 | loss" in reference.stdout and "perplexity" in reference.stdout
