"""The step-time model (MaxText/aot/step_time) against every published MFU point of the
recipes' models: each point compiled once through its recipe (EXECUTABLE=train_compile,
NUM_SLICES, compile_topology) with its scheduled HLO saved under outputs/steptime/, then priced
from the saved HLO, the physical constants fitted, leave-one-model-out errors and the rank
correlation printed as AOT.md's table.

  python3 benchmarks/step_time_table.py compile [only=v5e] [slices=1,2,32]   # hours on a CPU machine
  python3 benchmarks/step_time_table.py table                                    # seconds, from the saved HLO
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)

from benchmarks import bench_args  # noqa: E402
from benchmarks.estimator_table import POINTS, chosen_points  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAVED = REPO / "outputs" / "steptime"
# The v5p 32B point was published at tensor=4 with `minimal` remat, which compiles here at 6
# sequences per chip (7 runs out of HBM, AOT.md); the recipe itself now runs the planner's setting.
EXTRA_ARGS = {"v5p/32b": ["per_device_batch_size=6", "remat_policy=minimal", "ici_tensor_parallelism=4"]}
UNCOMPILABLE = {("v5p/v5p-12288", "v5p-7680")}  # fsdp=240 divides no model dimension (AOT.md)


def stem(recipe: str, topology: str, slices: int) -> Path:
  return SAVED / f"{recipe.replace('/', '_')}_{topology}_x{slices}"


def compile_point(recipe: str, topology: str, slices: int) -> tuple[int, float, str]:
  path = stem(recipe, topology, slices)
  path.parent.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ, MAXTEXT_SAVE_STEP_HLO=str(path))
  start = time.perf_counter()
  result = subprocess.run(["nice", "-n", "15", "bash", f"configs/{recipe}.sh", "EXECUTABLE=train_compile",
                           f"NUM_SLICES={slices}", f"compile_topology={topology}", *EXTRA_ARGS.get(recipe, [])],
                          cwd=REPO, capture_output=True, text=True, check=False, env=env)
  Path(f"{path}.log").write_text(result.stdout + result.stderr)
  return result.returncode, time.perf_counter() - start, (result.stdout + result.stderr).strip().splitlines()[-1]


def compile_all(only: str, slices: set[str]) -> None:
  # The two ends of the DCN range first, then single slices, then the middle.
  order = {2: 0, 32: 1, 1: 2, 8: 3, 4: 4, 16: 5}
  for recipe, topology, num_slices, _ in sorted(POINTS, key=lambda p: (order[p[2]], p[0])):
    if not recipe.startswith(only) or str(num_slices) not in slices:
      continue
    if (recipe, topology) in UNCOMPILABLE or Path(f"{stem(recipe, topology, num_slices)}.json").exists():
      continue
    rc, seconds, last = compile_point(recipe, topology, num_slices)
    print(f"{recipe} {topology} x{num_slices}: rc={rc} {seconds:.0f} s  {last}", flush=True)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("what", choices=("compile", "table"))
  parser.add_argument("--only", default="", help="a prefix of the recipe names (e.g. v5e)")
  parser.add_argument("--slices", default="", help="only these slice counts (e.g. 1,2,32)")
  from MaxText.aot.step_time import program, report  # noqa: PLC0415
  parser.add_argument("--overlap", default=report.OVERLAP, choices=program.OVERLAPS,
                      help="table: the reading of the overlap to fit (MaxText/aot/step_time/program.py)")
  opts = tool_args.parse_args(parser, None)
  if opts.what == "compile":
    compile_all(opts.only, chosen_points(opts.only, opts.slices))
    return 0
  from benchmarks.step_time_fit import print_table  # noqa: PLC0415
  print_table(POINTS, stem, UNCOMPILABLE, SAVED / "table.json", opts.overlap)
  return 0


if __name__ == "__main__":
  bench_args.run(main)
