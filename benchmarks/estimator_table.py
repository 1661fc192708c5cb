"""The compiler's step-time estimate against every published MFU point of the recipes' models
(v5e 16B-128B on 1 to 32 slices of v5e-256; v5p 32B-1160B): each point compiled AOT on this
machine through its recipe (EXECUTABLE=train_compile, NUM_SLICES, compile_topology), its
implied MFU beside the published one, the error of each and the rank correlation.

  python3 benchmarks/estimator_table.py [output_path=outputs/estimator_points.jsonl] [only=v5e] [slices=1,2,8]
      [reuse=outputs/plan_recipes.jsonl]

Points already in output_path are not compiled again. Figures: getting_started/AOT.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.errors import UserError  # noqa: E402
from benchmarks import bench_args  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Published MFU of MaxText's v5e and v5p performance configurations (facts from its docs):
# (recipe, topology, slices, published MFU).
V5E = {"16b": (61.10, 59.37, 59.14, 58.27, 56.56, 54.65), "32b": (66.86, 64.81, 64.10, 63.67, 62.26, 60.40),
       "64b": (59.90, 56.66, 55.85, 54.96, 53.29, 50.18), "128b": (56.06, 55.82, 54.93, 52.93, 50.86, 46.25)}
POINTS: list[tuple[str, str, int, float]] = [
    (f"v5e/{size}", "v5e-256", slices, mfu)
    for size, row in V5E.items() for slices, mfu in zip((1, 2, 4, 8, 16, 32), row)] + [
    ("v5p/32b", "v5p-128", 1, 71.47), ("v5p/64b", "v5p-128", 1, 70.31), ("v5p/128b", "v5p-256", 1, 68.68),
    ("v5p/128b", "v5p-512", 1, 68.53), ("v5p/256b", "v5p-1024", 1, 68.82), ("v5p/512b", "v5p-1024", 1, 63.99),
    ("v5p/1024b", "v5p-2048", 1, 64.05), ("v5p/1024b", "v5p-4096", 1, 64.80),
    ("v5p/v5p-12288", "v5p-7680", 1, 64.27), ("v5p/v5p-12288", "v5p-12288", 1, 66.23)]


def compile_point(recipe: str, topology: str, slices: int) -> dict:
  start = time.perf_counter()
  result = subprocess.run(["bash", f"configs/{recipe}.sh", "EXECUTABLE=train_compile", f"NUM_SLICES={slices}",
                           f"compile_topology={topology}"], cwd=REPO, capture_output=True, text=True, check=False)
  text = result.stdout + result.stderr
  mfu = re.search(r"implied MFU ([\d.]+)%", text)
  model = re.search(r"^step-time model \(not a measurement\): step .* -> MFU ([\d.]+)%", text, re.M)
  used = re.search(r"HBM per \S+ chip ([\d.]+) GiB: ([\d.]+)% used", text)
  return {"estimate": float(mfu.group(1)) if mfu else None, "model": float(model.group(1)) if model else None,
          "model_breakdown": [line.strip() for line in text.splitlines() if line.startswith("  compute ")],
          "hbm_used": float(used.group(2)) if used else None,
          "compile_s": round(time.perf_counter() - start, 1), "returncode": result.returncode,
          "error": None if mfu else text.strip().splitlines()[-1:]}


def spearman(xs: list[float], ys: list[float]) -> float:
  from scipy.stats import spearmanr  # noqa: PLC0415  (scipy comes with jax)
  return float(spearmanr(xs, ys).statistic)


def chosen_points(only: str, slices: str) -> set[str]:
  """The slice counts `slices` names (all when empty), checked against POINTS before anything compiles."""
  counts = [str(n) for n in sorted({p[2] for p in POINTS})]
  wanted = set(bench_args.names("slices", slices, counts)) if slices.strip() else set(counts)
  if not any(recipe.startswith(only) for recipe, _, _, _ in POINTS):
    raise UserError(f"only={only!r} is the prefix of no recipe here; e.g. only=v5e or only=v5p/32b")
  return wanted


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--output_path", default="outputs/estimator_points.jsonl")
  parser.add_argument("--only", default="", help="a prefix of the recipe names to compile (e.g. v5e)")
  parser.add_argument("--slices", default="", help="compile only these slice counts (e.g. 1,2,8,32)")
  parser.add_argument("--reuse", default="", help="plan_recipes.py's output: its single-slice recipe compiles")
  opts = tool_args.parse_args(parser, None, renamed={"out": "output_path"})
  chosen = chosen_points(opts.only, opts.slices)
  out = Path(opts.output_path)
  out.parent.mkdir(parents=True, exist_ok=True)
  done = {}
  if out.exists():
    for line in out.read_text().splitlines():
      row = json.loads(line)
      done[(row["recipe"], row["topology"], row["slices"])] = row
  if opts.reuse and Path(opts.reuse).exists():
    for line in Path(opts.reuse).read_text().splitlines():
      planned = json.loads(line)
      for recipe, topology, slices, published in POINTS:
        key = (recipe, topology, slices)
        if (recipe, topology) == (planned["recipe"], planned["topology"]) and slices == 1 and key not in done \
            and planned.get("recipe_mfu") is not None:
          done[key] = {"recipe": recipe, "topology": topology, "slices": 1, "published": published,
                       "estimate": round(planned["recipe_mfu"] * 100, 1), "compile_s": planned["recipe_compile_s"],
                       "hbm_used": None, "returncode": 0, "error": None}
  for recipe, topology, slices, published in POINTS:
    wanted = str(slices) in chosen
    if (recipe, topology, slices) in done or not recipe.startswith(opts.only) or not wanted:
      continue
    row = {"recipe": recipe, "topology": topology, "slices": slices, "published": published,
           **compile_point(recipe, topology, slices)}
    done[(recipe, topology, slices)] = row
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
      f.write(json.dumps(row) + "\n")
  rows = [r for r in done.values() if r.get("estimate") is not None]
  print("| recipe | topology | slices | published MFU | compiler estimate | error (points) | error |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    diff = r["estimate"] - r["published"]
    print(f"| `configs/{r['recipe']}.sh` | {r['topology']} | {r['slices']} | {r['published']:.2f}% | "
          f"{r['estimate']:.1f}% | {diff:+.1f} | {diff / r['published']:+.0%} |")
  if len(rows) > 2:
    print(f"rank correlation (Spearman) over {len(rows)} points: "
          f"{spearman([r['estimate'] for r in rows], [r['published'] for r in rows]):.2f}")
    for gen in ("v5e", "v5p"):
      sub = [r for r in rows if r["recipe"].startswith(gen)]
      if len(sub) > 2:
        print(f"  {gen} only ({len(sub)} points): "
              f"{spearman([r['estimate'] for r in sub], [r['published'] for r in sub]):.2f}")
  return 0


if __name__ == "__main__":
  bench_args.run(main)
