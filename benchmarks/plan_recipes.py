"""The planner against the shipped v5e/v5p recipes (issue 21's validation): for each recipe,
plans its model, topology and global batch with everything else left to the planner, and
prints the planner's best predicted MFU (the step-time model's, which ranks) and wall time beside
the recipe's own, by the same model and by the compiler's estimate.

  python3 benchmarks/plan_recipes.py [recipes=v5e/32b,v5p/64b] [max_candidates=2] [workers=1]
      [cache_dir=outputs/plan_cache] [output_path=outputs/plan_recipes.jsonl] [plan_args="attention_blocks=none"]

The recipe's own setting is compiled too (`bash configs/<recipe>.sh EXECUTABLE=train_compile`;
`no_recipe_compile=true` skips it), with the same code, flags and estimator, so the columns
compare. Figures: getting_started/Planner.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.configuration.config_yaml import split_items  # noqa: E402
from MaxText.errors import UserError, run_cli  # noqa: E402

import estimator_table  # noqa: E402  (the recipe compile and its MFU, shared)

# The model's keys, kept fixed; the rest of a recipe's arguments is what the planner searches.
MODEL_KEYS = ("global_parameter_scale", "base_emb_dim", "base_num_decoder_layers", "max_target_length", "model_name")
RUN_ONLY_KEYS = ("steps", "enable_checkpointing", "dataset_type")


def read_recipe(path: Path) -> tuple[str, list[str]]:
  text = path.read_text()
  topology = re.search(r"^RECIPE_TOPOLOGY=(\S+)", text, re.M)
  args = re.search(r"^RECIPE_ARGS=\((.*)\)", text, re.M)
  if topology is None or args is None:
    raise UserError(f"{path}: no RECIPE_TOPOLOGY=... and RECIPE_ARGS=(...) lines, as configs/v5e/*.sh have")
  return topology.group(1), shlex.split(args.group(1))


def plan_command(topology: str, args: list[str], max_candidates: int, workers: int, cache_dir: str) -> list[str]:
  from MaxText.platform import accelerators  # noqa: PLC0415
  values = dict(a.split("=", 1) for a in args)
  chips = accelerators.tpu_topology(topology).chips
  seq = int(values.get("max_target_length", 2048))
  batch_tokens = round(float(values["per_device_batch_size"]) * chips) * seq
  model = [f"{k}={values[k]}" for k in MODEL_KEYS if k in values]
  return [sys.executable, "-m", "MaxText.plan", "configs/base.yml", *model, f"compile_topology={topology}",
          f"global_batch_tokens={batch_tokens}", f"max_candidates={max_candidates}", f"workers={workers}",
          f"cache_dir={cache_dir}", "budget_minutes=120"]


def recipe_names(given: str) -> list[str]:
  """The recipes `given` names (comma-separated gen/name; "" = every v5e and v5p recipe); a name with no
  configs/<name>.sh is one line listing those there are (it was a FileNotFoundError traceback)."""
  known = sorted(f"{p.parent.name}/{p.stem}" for gen in ("v5e", "v5p") for p in (REPO / "configs" / gen).glob("*.sh"))
  # only commas (an empty shell variable in a list) is the line below; an empty item among names, one of its own
  names = [n.removesuffix(".sh") for n in split_items("recipes", given)] if given.replace(",", "").strip() else []
  if given and not names:  # an empty shell variable: not every recipe (hours of plans)
    raise UserError(f"recipes={given!r} names no recipe; leave it out for every v5e and v5p recipe")
  names = names or known
  unknown = [n for n in names if not (REPO / "configs" / f"{n}.sh").is_file()]
  if unknown:
    raise UserError(f"recipes={given}: no recipe {', '.join(unknown)}; known: {', '.join(known)}")
  return names


def check_output_path(path: str) -> None:
  """Before any plan runs (each may take its budget_minutes): the rows go to a local file, appended."""
  if not path.strip() or "://" in path or path.lower().startswith("gs:"):
    raise UserError(f"output_path={path!r}: name a local .jsonl file (the rows are appended to it)")
  if Path(path).is_dir():
    raise UserError(f"output_path={path} is a directory; name a .jsonl file in it")


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--recipes", default="", help="comma-separated gen/name (default: every v5e and v5p recipe)")
  parser.add_argument("--max_candidates", type=int, default=2)
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--cache_dir", default="outputs/plan_cache")
  parser.add_argument("--output_path", default="outputs/plan_recipes.jsonl")
  parser.add_argument("--no_recipe_compile", action="store_true")
  parser.add_argument("--plan_args", default="", help="more planner arguments, e.g. attention_blocks=none")
  opts = tool_args.parse_args(parser, argv[1:], renamed={"out": "output_path"})
  names = recipe_names(opts.recipes)
  check_output_path(opts.output_path)
  Path(opts.output_path).parent.mkdir(parents=True, exist_ok=True)
  for name in names:
    topology, args = read_recipe(REPO / "configs" / f"{name}.sh")
    command = plan_command(topology, args, opts.max_candidates, opts.workers, opts.cache_dir) + opts.plan_args.split()
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    best = re.search(r"^best: (.*): (predicted|compiler-estimated) MFU ([\d.]+)%", result.stdout, re.M)
    row = {"recipe": name, "topology": topology, "plan_wall_s": round(wall, 1), "returncode": result.returncode,
           "best": best.group(1) if best else None, "plan_mfu": float(best.group(3)) / 100 if best else None,
           "plan_by": best.group(2) if best else None,
           "breakdown": [line.strip() for line in result.stdout.splitlines() if line.startswith("  compute ")],
           "table": result.stdout.strip().splitlines()[-20:], "error": result.stderr.strip().splitlines()[-1:]}
    if not opts.no_recipe_compile:
      # The recipe's own setting, compiled by the recipe itself: its flags, the planner's estimator.
      own = estimator_table.compile_point(name, topology, 1)
      row["recipe_mfu"] = own["estimate"] / 100 if own["estimate"] is not None else None
      row["recipe_model_mfu"] = own["model"] / 100 if own["model"] is not None else None
      row["recipe_breakdown"] = own["model_breakdown"]
      row["recipe_compile_s"] = own["compile_s"]
    print(json.dumps({k: v for k, v in row.items() if k != "table"}), flush=True)
    with open(opts.output_path, "a") as f:
      f.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  run_cli(main)
