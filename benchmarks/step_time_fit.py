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
from MaxText.aot.step_time import program, report, saved, simulate
from MaxText.aot.step_time.network import Calibration
from MaxText.platform import accelerators

# The constants fitted, with the range each may take (physical shares of a published figure, latencies).
FITTED = {"mxu_efficiency": (0.5, 1.0), "other_compute_scale": (0.5, 1.5), "kernel_efficiency": (0.2, 1.0),
          "ici_efficiency": (0.2, 1.0),
          "dcn_efficiency": (0.25, 1.0), "dcn_latency_s": (0.0, 0.01), "slice_sync_share": (0.0, 0.05)}


@dataclasses.dataclass
class Point:
  recipe: str
  topology: str
  slices: int
  published: float  # MFU, percent
  ops: list[program.Op]  # read with the fitted overlap (report.OVERLAP)
  scheduled_ops: list[program.Op]  # read as the compile scheduled it
  target: saved.StepTarget
  compiler_mfu: float | None

  def predict(self, cal: Calibration, scheduled: bool = False) -> simulate.Prediction:
    peak = accelerators.TPU_GENERATIONS[self.target.generation].peak_tflops
    return simulate.simulate(self.scheduled_ops if scheduled else self.ops, cal, self.target.model_tflops_per_device,
                             peak, self.target.num_slices)


def load_points(points: Sequence[tuple[str, str, int, float]], stem: Callable[[str, str, int], Path],
                skip: set[tuple[str, str]], overlap: str = report.OVERLAP) -> tuple[list[Point], list[str]]:
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
    loaded.append(Point(recipe, topology, slices, published, program.build_program(text, target, overlap),
                        program.build_program(text, target, "scheduled"), target, compiler))
  return loaded, missing


def _calibration(values: Sequence[float]) -> Calibration:
  return Calibration(**{name: min(hi, max(lo, v)) for (name, (lo, hi)), v in zip(FITTED.items(), values)})


# Robust least squares (soft L1 beyond 2 MFU points): a point the model cannot explain (AOT.md
# names them) pulls the shared constants no harder than its error's square root.
LOSS_SCALE = 2.0


def loss(points: Sequence[Point], cal: Calibration) -> float:
  return sum(math.sqrt(1 + ((p.predict(cal).mfu * 100 - p.published) / LOSS_SCALE) ** 2) - 1 for p in points)


# Nelder-Mead finds a local minimum: the DCN's latency and the slices' synchronisation both lower
# the multi-slice points, so the fit starts from each side of that trade as well as from `start`.
STARTS = (dict(dcn_latency_s=3e-4, slice_sync_share=0.0), dict(dcn_latency_s=0.0, slice_sync_share=0.02),
          dict(dcn_latency_s=1e-4, slice_sync_share=0.01))


def fit(points: Sequence[Point], start: Calibration | None = None, max_evals: int = 300) -> Calibration:
  """Robust least squares over the MFU points (Nelder-Mead on the bounded constants, the best of
  several starts)."""
  first = start or Calibration(mxu_efficiency=0.935, other_compute_scale=0.617, kernel_efficiency=0.28)
  starts = [first] if start is not None else [dataclasses.replace(first, **s) for s in STARTS]
  best: tuple[float, Calibration] | None = None
  for begin in starts:
    x0 = [getattr(begin, name) for name in FITTED]
    result = minimize(lambda x: loss(points, _calibration(x)), x0, method="Nelder-Mead",
                      options={"maxfev": max_evals, "xatol": 1e-3, "fatol": 1e-2})
    cal = _calibration(result.x)
    value = loss(points, cal)
    if best is None or value < best[0]:
      best = (value, cal)
  assert best is not None
  return best[1]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
  return float(spearmanr(xs, ys).statistic)


def print_table(points_spec: Sequence[tuple[str, str, int, float]], stem: Callable[[str, str, int], Path],
                skip: set[tuple[str, str]], out: Path | None = None, overlap: str = report.OVERLAP) -> None:
  points, missing = load_points(points_spec, stem, skip, overlap)
  if missing:
    print(f"not compiled yet ({len(missing)}): {', '.join(missing)}")
  cal = fit(points, max_evals=600)
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
  print("| recipe | topology | slices | published MFU | compiler estimate | as scheduled | step-time model | error | "
        "leave-one-model-out | error | largest exposed term |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for i, p in enumerate(points):
    pred = p.predict(cal)
    mfu = pred.mfu * 100
    exposed = {k: v for k, v in pred.seconds.items() if k not in ("matmul", "other compute", "kernel")}
    top = max(exposed.items(), key=lambda kv: kv[1], default=("none", 0.0))
    compiler = f"{p.compiler_mfu * 100:.1f}%" if p.compiler_mfu else "n/a"
    as_scheduled = p.predict(cal, scheduled=True).mfu * 100
    print(f"| `configs/{p.recipe}.sh` | {p.topology} | {p.slices} | {p.published:.2f}% | {compiler} | "
          f"{as_scheduled:.1f}% | {mfu:.1f}% | "
          f"{mfu - p.published:+.1f} | {held_out[i]:.1f}% | {held_out[i] - p.published:+.1f} | "
          f"{top[0]} {top[1] * 1e3:,.0f} ms of {pred.step_s * 1e3:,.0f} ms |")
    rows.append({"recipe": p.recipe, "topology": p.topology, "slices": p.slices, "published": p.published,
                 "compiler": p.compiler_mfu, "as_scheduled": as_scheduled, "predicted": mfu, "held_out": held_out[i], "step_s": pred.step_s,
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
    out.write_text(json.dumps({"constants": dataclasses.asdict(cal), "overlap": overlap, "rows": rows}, indent=1))
