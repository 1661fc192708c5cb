"""Side by side with upstream MaxText: the same recipes compiled AOT for their TPU topology by
upstream's train_compile and by ours, with the same JAX, jaxlib and libtpu (one Python
environment runs both) and the same estimator (hlo_cycles.estimated_cycles over the compiled
HLO, MFU from metrics.training_tflops_per_step), plus the planner's setting where a plan ran.

Upstream is the `maxtext` package from PyPI in its own environment, never a dependency:

  python3.12 -m venv ~/maxtext-peer && ~/maxtext-peer/bin/pip install "maxtext[tpu]" "jax[tpu]==0.11.2"
  python3 benchmarks/peer_aot.py peer_python=~/maxtext-peer/bin/python [cases=v5e/16b,v5e/128b,v5p/32b]
      [plans=outputs/plan_recipes.jsonl] [output_path=outputs/peer_aot.jsonl]

Both compiles run under peer_python (this checkout on its PYTHONPATH), so this project is
measured on the peer's JAX too. Figures: getting_started/AOT.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.errors import UserError  # noqa: E402
from benchmarks import bench_args  # noqa: E402

CASES = {"v5e/16b": "v5e-256", "v5e/128b": "v5e-256", "v5p/32b": "v5p-128"}
# The model's keys, read off our recipe, that fix the FLOPs both compiles are measured against.
MODEL_KEYS = ("global_parameter_scale", "base_emb_dim", "max_target_length", "per_device_batch_size")


def peer_env(**extra: str) -> dict[str, str]:
  """The environment for a compile under the peer's Python: without the libtpu path this
  process's imports exported (the peer's own libtpu must load), with `extra`."""
  env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
  return {**env, **extra}


def upstream_recipe(peer_python: str, case: str) -> tuple[str, list[str]]:
  """(LIBTPU_INIT_ARGS, train_compile arguments) of upstream's recipe for `case`."""
  site = subprocess.run([peer_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  text = (Path(site) / "configs" / "tpu" / f"{case}.sh").read_text()
  flags = re.search(r'^export LIBTPU_INIT_ARGS="([^"]*)"', text, re.M).group(1)
  command = re.search(r"^python3 -m maxtext\.trainers\.pre_train\.\$EXECUTABLE (.*?)(?:\n(?!\s)|\Z)",
                      text.replace("\\\n", " "), re.M | re.S).group(1)
  args = shlex.split(command)[1:]  # the base.yml path first
  args = [a for a in args if not a.startswith(("base_output_directory=", "gcs_metrics="))]
  return flags, [f"{site}/configs/base.yml", *args]


def upstream_step_s(peer_python: str, case: str, topology: str) -> dict:
  from MaxText.platform import accelerators  # noqa: PLC0415
  from MaxText.aot.hlo_cycles import estimated_cycles  # noqa: PLC0415
  flags, args = upstream_recipe(peer_python, case)
  with tempfile.TemporaryDirectory(prefix="peer_") as tmp:
    env = peer_env(LIBTPU_INIT_ARGS=flags,
                   XLA_FLAGS=f"--xla_dump_to={tmp}/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*")
    start = time.perf_counter()
    result = subprocess.run([peer_python, "-m", "maxtext.trainers.pre_train.train_compile", *args,
                             f"compile_topology={topology}", "compile_topology_num_slices=1",
                             f"base_output_directory={tmp}/out", "run_name=peer"],
                            cwd=tmp, env=env, capture_output=True, text=True, check=False)
    compile_s = time.perf_counter() - start
    dumps = sorted(glob.glob(f"{tmp}/dump/*jit_train_step*after_codegen.txt"))
    if result.returncode or not dumps:
      return {"error": (result.stderr or result.stdout).strip().splitlines()[-1:], "compile_s": compile_s}
    cycles = estimated_cycles(Path(dumps[-1]).read_text())
  clock = accelerators.tpu_topology(topology).generation.clock_ghz * 1e9
  return {"step_s": cycles / clock if cycles else None, "compile_s": round(compile_s, 1), "args": args[1:]}


def ours_step_s(peer_python: str, case: str, extra: list[str]) -> dict:
  """Our recipe compiled under the peer's Python (its JAX and libtpu)."""
  env = peer_env(PATH=f"{Path(peer_python).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
  start = time.perf_counter()
  result = subprocess.run(["bash", f"configs/{case}.sh", "EXECUTABLE=train_compile", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
  step = re.search(r"compiler estimate \(not a measurement\): step ([\d,.]+) ms", result.stdout + result.stderr)
  return {"step_s": float(step.group(1).replace(",", "")) / 1e3 if step else None,
          "compile_s": round(time.perf_counter() - start, 1),
          "error": None if step else (result.stderr or result.stdout).strip().splitlines()[-1:]}


def model_flops_per_chip(case: str, topology: str, extra: list[str]) -> float:
  """Model FLOPs per chip per step of our recipe's model and batch (with `extra` overrides)."""
  from MaxText.training import metrics
  from MaxText.platform import accelerators
  from MaxText.configuration import config as config_lib  # noqa: PLC0415
  text = (REPO / "configs" / f"{case}.sh").read_text()
  args = shlex.split(re.search(r"^RECIPE_ARGS=\((.*)\)", text, re.M).group(1))
  values = dict(a.split("=", 1) for a in args + extra)
  topo = accelerators.tpu_topology(topology)
  config = config_lib.Config.for_testing(target=topo.target(), run_name="peer",
                                         **{k: values[k] for k in MODEL_KEYS if k in values})
  batch = round(float(values["per_device_batch_size"]) * topo.chips)
  return metrics.training_tflops_per_step(config.model, batch, config.data.max_target_length).total_tflops * 1e12 / topo.chips


def planned_args(plans: Path, case: str) -> list[str]:
  """The planner's best setting for `case` from plan_recipes.py's output: the keys its command
  line adds to the recipe's model."""
  if not plans.exists():
    return []
  for line in plans.read_text().splitlines():
    row = json.loads(line)
    if row["recipe"] != case:
      continue
    for text in row.get("table", []):
      if " -m MaxText.train " in text:
        args = shlex.split(text.split(" -m MaxText.train ", 1)[1])[1:]
        return [a for a in args if a.split("=", 1)[0] not in ("global_parameter_scale", "max_target_length")]
  return []


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--peer_python", required=True, help="python of the environment with upstream's maxtext")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--plans", default="outputs/plan_recipes.jsonl")
  parser.add_argument("--output_path", default="outputs/peer_aot.jsonl")
  parser.add_argument("--columns", default="upstream,ours,planned", help="which compiles to run")
  opts = tool_args.parse_args(parser, None, renamed={"out": "output_path"})
  columns = set(bench_args.names("columns", opts.columns, ("upstream", "ours", "planned")))
  cases = bench_args.names("cases", opts.cases, CASES)
  if shutil.which(opts.peer_python) is None:
    raise UserError(f"peer_python={opts.peer_python!r} is not a program here; give the python of the environment "
                    "with upstream's maxtext")
  from MaxText.platform import accelerators  # noqa: PLC0415
  versions = subprocess.run([opts.peer_python, "-c", "import jax, jaxlib, importlib.metadata as m; "
                             "print(jax.__version__, jaxlib.__version__, m.version('libtpu'), m.version('maxtext'))"],
                            capture_output=True, text=True, check=True).stdout.split()
  print(f"jax {versions[0]}, jaxlib {versions[1]}, libtpu {versions[2]}, upstream maxtext {versions[3]}", flush=True)
  rows = []
  for case in cases:
    topology = CASES[case]
    peak = accelerators.tpu_topology(topology).generation.peak_tflops * 1e12
    row: dict = {"case": case, "topology": topology, "versions": versions}
    for column in ("upstream", "ours", "planned"):
      extra = planned_args(Path(opts.plans), case) if column == "planned" else []
      if column not in columns or (column == "planned" and not extra):
        continue
      figures = upstream_step_s(opts.peer_python, case, topology) if column == "upstream" else \
          ours_step_s(opts.peer_python, case, extra)
      step = figures.get("step_s")
      flops = model_flops_per_chip(case, topology, extra)
      row[column] = {**figures, "extra": extra, "mfu": flops / step / peak if step else None}
      print(json.dumps({"case": case, column: row[column]}), flush=True)
    rows.append(row)
    with open(opts.output_path, "a") as f:
      f.write(json.dumps(row) + "\n")
  print("| recipe | topology | upstream, same estimator | this project | the planner's setting |")
  print("| --- | --- | --- | --- | --- |")
  for row in rows:
    cells = [f"{row[c]['mfu']:.1%}" if row.get(c, {}).get("mfu") else "-" for c in ("upstream", "ours", "planned")]
    print(f"| `{row['case']}` | {row['topology']} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  bench_args.run(main)
