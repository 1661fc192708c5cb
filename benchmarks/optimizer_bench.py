"""Muon against AdamW on CPU: the same small model, data and token budget, each optimizer at its best learning rate
from a small sweep; held-out loss at the end and the step time.

    python3 benchmarks/optimizer_bench.py [steps=300] [learning_rates=1e-3,3e-3,1e-2]
        [workdir=outputs/opt_bench]

The data is tinyshakespeare (../shared/data/tinyshakespeare.txt), prepared as Data.md's first run does (documents,
a 1024-token SentencePiece vocabulary, ArrayRecord); the model is a 4-layer Llama-style decoder of width 128 at
128 tokens, 8 sequences a step, a linear warmup over a tenth of the steps and cosine decay, as train.py runs it.
Every optimizer key but opt_type is the same in both (Muon's matrices take muon_consistent_rms's AdamW-matched
scale, so one learning-rate grid serves both). The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
MODEL = ["base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=512",
         "base_num_decoder_layers=4", "vocab_size=1024", "max_target_length=128", "per_device_batch_size=8",
         "warmup_steps_fraction=0.1", "print_config=False", "dtype=float32"]
STEP = re.compile(r"^step +(\d+) \| loss +([\d.]+) \| +([\d.]+) s")
EVAL = re.compile(r"^eval +(\d+) \| loss +([\d.]+)")


def run(cmd: list[str], cwd: Path) -> str:
  result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{result.stderr[-2000:]}")
  return result.stdout


def prepare(workdir: Path) -> list[str]:
  """The data keys, preparing the data once."""
  data, tokenizer = workdir / "data", workdir / "tok.model"
  if not tokenizer.exists():
    if not CORPUS.exists():
      raise SystemExit(f"needs {CORPUS}")
    run([sys.executable, "-m", "MaxText.input_pipeline.prepare_data", f"data_files={CORPUS}", f"output_path={data}"],
        REPO)
    run([sys.executable, "-m", "MaxText.train_tokenizer", f"data_files={data / 'jsonl' / 'train.jsonl'}",
         "vocab_size=1024", f"output_path={tokenizer}"], REPO)
  return ["dataset_type=grain", f"tokenizer_path={tokenizer}", f"grain_train_files={data}/arrayrecord/train.array_record",
          f"grain_eval_files={data}/arrayrecord/validation.array_record"]


def train(workdir: Path, data: list[str], opt_type: str, learning_rate: str, steps: int) -> tuple[float, float]:
  """(the held-out loss after the last step, the median step seconds past the first)."""
  name = f"{opt_type}_{learning_rate}"
  out = run([sys.executable, "-m", "MaxText.train", "configs/base.yml", f"run_name={name}",
             f"base_output_directory={workdir / 'runs'}", *MODEL, *data, f"steps={steps}", f"opt_type={opt_type}",
             f"learning_rate={learning_rate}", f"eval_interval={steps}", "eval_steps=20", "enable_checkpointing=False",
             "log_period=1"], REPO)
  seconds = [float(m.group(3)) for line in out.splitlines() if (m := STEP.match(line)) and int(m.group(1)) > 1]
  evals = [float(m.group(2)) for line in out.splitlines() if (m := EVAL.match(line))]
  if not evals or not seconds:
    raise SystemExit(f"{name}: no eval or step lines in its output:\n{out[-1500:]}")
  return evals[-1], statistics.median(seconds)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--learning_rates", default="1e-3,3e-3,1e-2")
  parser.add_argument("--workdir", default="outputs/opt_bench")
  args = tool_args.parse_args(parser, None)
  bench_args.decimals("learning_rates", args.learning_rates, "1e-3,3e-3")
  learning_rates = bench_args.items("learning_rates", args.learning_rates)  # kept as typed: the table shows them
  bench_args.at_least("steps", args.steps, 1)
  workdir = (REPO / args.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  data = prepare(workdir)
  best: dict[str, tuple[float, str, float]] = {}
  print(f"{'optimizer':>9} {'lr':>7} {'eval loss':>10} {'step s':>8}")
  for opt_type in ("adamw", "muon"):
    for lr in learning_rates:
      loss, seconds = train(workdir, data, opt_type, lr, args.steps)
      print(f"{opt_type:>9} {lr:>7} {loss:10.4f} {seconds:8.3f}", flush=True)
      if opt_type not in best or loss < best[opt_type][0]:
        best[opt_type] = (loss, lr, seconds)
  (a_loss, a_lr, a_s), (m_loss, m_lr, m_s) = best["adamw"], best["muon"]
  print(f"best: adamw {a_loss:.4f} at lr {a_lr}, muon {m_loss:.4f} at lr {m_lr}; "
        f"muon's step time {m_s / a_s:.2f}x adamw's")
  print(f"RESULT adamw_loss={a_loss:.4f} adamw_lr={a_lr} muon_loss={m_loss:.4f} muon_lr={m_lr} "
        f"adamw_step_s={a_s:.4f} muon_step_s={m_s:.4f}")


if __name__ == "__main__":
  bench_args.run(main)
