"""The planner's recipe (MaxText/plan.py): the TPU flags a generation's recipes run with
(configs/recipe_lib.sh), and the recipe file written for the best candidate, checked by its dry run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from MaxText.errors import UserError
from MaxText.platform import accelerators

RECIPE_LIB = Path(__file__).resolve().parents[2] / "configs" / "recipe_lib.sh"
# The LIBTPU_INIT_ARGS variable of recipe_lib.sh each generation's recipes use.
RECIPE_FLAG_VARS = {"v5e": "V5E_LIBTPU_FLAGS", "v5p": "V5P_LIBTPU_FLAGS"}


def recipe_flags(generation: str) -> str:
  """The generation's published LIBTPU_INIT_ARGS from recipe_lib.sh ("" for others)."""
  var = RECIPE_FLAG_VARS.get(generation)
  match = re.search(rf'^{var}="([^"]*)"', RECIPE_LIB.read_text(), re.M) if var else None
  return match.group(1) if match else ""


def compile_flags(generation: str) -> str:
  """What the compiles run with: the recipe flags, then the user's own (later flags win)."""
  return " ".join(f for f in (recipe_flags(generation), os.environ.get("LIBTPU_INIT_ARGS", "")) if f.strip())


def write_recipe(path: str, topology: accelerators.TpuTopology, recipe_args: list[str], summary: str,
                 breakdown: list[str] | None = None, num_slices: int = 1) -> str:
  """A recipe like configs/v5e/*.sh running `recipe_args` on `num_slices` x `topology`, its header stating the
  prediction and `breakdown` (the step-time model's lines); returns its dry run."""
  target = Path(path).resolve()
  target.parent.mkdir(parents=True, exist_ok=True)
  library = os.path.relpath(RECIPE_LIB, target.parent)
  flag_var = RECIPE_FLAG_VARS.get(topology.generation.name)
  flags = f'"${flag_var}"' if flag_var else '""'
  # A multi-slice plan's dcn_* degrees span its slices: EXECUTABLE=train_compile compiles for that many by default
  # (with one, its dcn degrees did not divide 1 slice and the recipe stopped as written).
  slices = f" RECIPE_NUM_SLICES={num_slices}" if num_slices > 1 else ""
  where = f"{num_slices} x {topology.name}" if num_slices > 1 else topology.name
  text = "\n".join([
      "#!/usr/bin/env bash",
      f"# Written by MaxText.plan: {summary}",
      *(f"# {line.strip()}" for line in breakdown or []),
      "# Predictions from the compiled step, not measurements: verify on the hardware.",
      f"#   bash {path} RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs [PLATFORM=gce|gke] [DRY_RUN=1]",
      f"#   bash {path} EXECUTABLE=train_compile [NUM_SLICES=N]   # compile for {where} on any machine",
      f'source "$(dirname "${{BASH_SOURCE[0]}}")/{library}"  # arguments: see recipe_lib.sh',
      f"RECIPE_TOPOLOGY={topology.name}{slices} RECIPE_FLAGS={flags}",
      f"RECIPE_ARGS=({' '.join(shlex.quote(a) for a in recipe_args)})",
      'recipe_run "$@"', ""])
  target.write_text(text)
  target.chmod(0o755)
  clean = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
  result = subprocess.run(["bash", str(target), "DRY_RUN=1", "RUN_NAME=planned"], capture_output=True, text=True,
                          env=clean, check=False)
  if result.returncode != 0:
    raise UserError(f"the written recipe {path} does not run: {result.stderr.strip()}")
  return result.stdout.strip()
