"""Fits the step-time model's physical constants to the published MFU points and prints AOT.md's
table (benchmarks/step_time_table.py table): each point's prediction with the constants fitted to
all points, leave-one-model-out (the constants refitted without a model's points, then its
points predicted), the errors and the rank correlation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, Sequence

from scipy.optimize import minimize
from scipy.stats import spearmanr

from MaxText.aot.hlo_cycles import estimated_cycles
from MaxText.aot.step_time import program, saved, simulate
from MaxText.aot.step_time.network import Calibration
from MaxText.platform import accelerators

# The constants fitted, with the range each may take (physical shares of a published figure, latencies).
FITTED = {"mxu_efficiency": (0.5, 1.0), "other_compute_scale": (0.5, 1.5), "kernel_efficiency": (0.2, 1.0),
          "ici_efficiency": (0.2, 1.0),
          "dcn_efficiency": (0.25, 1.0), "dcn_latency_s": (0.0, 0.01)}


@dataclasses.dataclass
class Point:
  recipe: str
  topology: str
  slices: int
  published: float  # MFU, percent
  ops: list[program.Op]
  target: saved.StepTarget
  compiler_mfu: float | None

  def predict(self, cal: Calibration) -> simulate.Prediction:
    peak = accelerators.TPU_GENERATIONS[self.target.generation].peak_tflops
    return simulate.simulate(self.ops, cal, self.target.model_tflops_per_device, peak)


def load_points(points: Sequence[tuple[str, str, int, float]], stem: Callable[[str, str, int], Path],
                skip: set[tuple[str, str]]) -> tuple[list[Point], list[str]]:
  loaded, missing = [], []
  for recipe, topology, slices, published in points:
    path = stem(recipe, topology, slices)
    if (recipe, topology) in skip:
      continue
    if not Path(f"{path}.json").exists():
      missing.append(f"{recipe} {topology} x{slices}")
      continue
    text, target, _ = saved.load_step(str(path))
    gen = accelerators.TPU_GENERATIONS[target.generation]
    cycles = estimated_cycles(text)
    compiler = target.model_tflops_per_device / (cycles / (gen.clock_ghz * 1e9)) / gen.peak_tflops if cycles else None
    loaded.append(Point(recipe, topology, slices, published, program.build_program(text, target), target, compiler))
  return loaded, missing


def _calibration(values: Sequence[float]) -> Calibration:
  return Calibration(**{name: min(hi, max(lo, v)) for (name, (lo, hi)), v in zip(FITTED.items(), values)})


# Robust least squares (soft L1 beyond 2 MFU points): a point the model cannot explain (AOT.md
# names them) pulls the shared constants no harder than its error's square root.
LOSS_SCALE = 2.0


def loss(points: Sequence[Point], cal: Calibration) -> float:
  return sum(math.sqrt(1 + ((p.predict(cal).mfu * 100 - p.published) / LOSS_SCALE) ** 2) - 1 for p in points)


def fit(points: Sequence[Point], start: Calibration | None = None, max_evals: int = 300) -> Calibration:
  """Robust least squares over the MFU points (Nelder-Mead on the bounded constants)."""
  first = start or Calibration()
  x0 = [getattr(first, name) for name in FITTED]
  result = minimize(lambda x: loss(points, _calibration(x)), x0, method="Nelder-Mead",
                    options={"maxfev": max_evals, "xatol": 1e-3, "fatol": 1e-2})
  return _calibration(result.x)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
  return float(spearmanr(xs, ys).statistic)


def print_table(points_spec: Sequence[tuple[str, str, int, float]], stem: Callable[[str, str, int], Path],
                skip: set[tuple[str, str]], out: Path | None = None) -> None:
  points, missing = load_points(points_spec, stem, skip)
  if missing:
    print(f"not compiled yet ({len(missing)}): {', '.join(missing)}")
  cal = fit(points)
  print("| constant | fitted | bounds |\n| --- | --- | --- |")
  for name, (lo, hi) in FITTED.items():
    print(f"| `{name}` | {getattr(cal, name):.3g} | {lo:g} to {hi:g} |")
  print()
  models = sorted({p.recipe for p in points})
  held_out: dict[int, float] = {}
  for model in models:
    rest = [p for p in points if p.recipe != model]
    cal_without = fit(rest, cal, max_evals=120)
    for i, p in enumerate(points):
      if p.recipe == model:
        held_out[i] = p.predict(cal_without).mfu * 100
  rows = []
  print("| recipe | topology | slices | published MFU | compiler estimate | step-time model | error | "
        "leave-one-model-out | error | largest exposed term |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for i, p in enumerate(points):
    pred = p.predict(cal)
    mfu = pred.mfu * 100
    exposed = {k: v for k, v in pred.seconds.items() if k not in ("matmul", "other compute", "kernel")}
    top = max(exposed.items(), key=lambda kv: kv[1], default=("none", 0.0))
    compiler = f"{p.compiler_mfu * 100:.1f}%" if p.compiler_mfu else "n/a"
    print(f"| `configs/{p.recipe}.sh` | {p.topology} | {p.slices} | {p.published:.2f}% | {compiler} | {mfu:.1f}% | "
          f"{mfu - p.published:+.1f} | {held_out[i]:.1f}% | {held_out[i] - p.published:+.1f} | "
          f"{top[0]} {top[1] * 1e3:,.0f} ms of {pred.step_s * 1e3:,.0f} ms |")
    rows.append({"recipe": p.recipe, "topology": p.topology, "slices": p.slices, "published": p.published,
                 "compiler": p.compiler_mfu, "predicted": mfu, "held_out": held_out[i], "step_s": pred.step_s,
                 "seconds": pred.seconds})
  published = [p.published for p in points]
  fitted = [r["predicted"] for r in rows]
  lomo = [r["held_out"] for r in rows]
  print(f"\nall points ({len(points)}): max |error| {max(abs(a - b) for a, b in zip(fitted, published)):.1f} points, "
        f"RMS {math.sqrt(sum((a - b) ** 2 for a, b in zip(fitted, published)) / len(points)):.1f}; "
        f"leave-one-model-out max |error| {max(abs(a - b) for a, b in zip(lomo, published)):.1f}, "
        f"RMS {math.sqrt(sum((a - b) ** 2 for a, b in zip(lomo, published)) / len(points)):.1f}")
  print(f"Spearman rank correlation with published MFU: model {spearman(fitted, published):.2f}, "
        f"leave-one-model-out {spearman(lomo, published):.2f}, compiler estimate "
        f"{spearman([p.compiler_mfu or 0 for p in points], published):.2f}")
  for gen in ("v5e", "v5p"):
    sub = [i for i, p in enumerate(points) if p.recipe.startswith(gen)]
    if len(sub) > 2:
      print(f"  {gen} ({len(sub)} points): model {spearman([fitted[i] for i in sub], [published[i] for i in sub]):.2f}, "
            f"leave-one-model-out {spearman([lomo[i] for i in sub], [published[i] for i in sub]):.2f}")
  if out is not None:
    out.write_text(json.dumps({"constants": dataclasses.asdict(cal), "rows": rows}, indent=1))
