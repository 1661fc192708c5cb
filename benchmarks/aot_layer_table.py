"""A TPU prediction table for layer benchmarks (linear_attention_bench.py, sparse_attention_bench.py aot=TOPOLOGY):
each (form, length) model is compiled for a topology by `MaxText.train_compile` in its own process, and the
row is the step-time model's price of the compiled train step (getting_started/AOT.md): a prediction from
the schedule, not a measurement.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"step-time model \(not a measurement\): step ([\d,.]+) ms -> MFU ([\d.]+)%")
COMPILER_LINE = re.compile(r"compiler estimate \(not a measurement\): step ([\d,.]+) ms")
HEADER = ("| {form} | tokens | predicted step ms | predicted tokens/s/chip | predicted MFU | compiler estimate ms |\n"
          "| --- | --- | --- | --- | --- | --- |")


def print_table(topology: str, lengths: list[int], forms: list[str], keys_of: Callable[[str, int], dict],
                form_column: str = "form") -> None:
  """One Markdown row per (length, form); `keys_of(form, length)` gives the train_compile overrides."""
  print(HEADER.format(form=form_column))
  for length in lengths:
    for form in forms:
      command = [sys.executable, "-m", "MaxText.train_compile", "configs/base.yml", f"compile_topology={topology}",
                 *(f"{k}={v}" for k, v in keys_of(form, length).items())]
      done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
      step, compiler = STEP_LINE.search(done.stdout), COMPILER_LINE.search(done.stdout)
      if done.returncode or step is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        print(f"| {form} | {length} | failed: {tail[0][:200]} | | | |", flush=True)
        continue
      ms = float(step.group(1).replace(",", ""))
      print(f"| {form} | {length} | {ms:,.1f} | {length / ms * 1e3:,.0f} | {step.group(2)}% | "
            f"{compiler.group(1) if compiler else ''} |", flush=True)
