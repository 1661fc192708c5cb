"""The planner's compiled candidates (MaxText/plan.py): one short-listed candidate with its
analytical estimate and compile result, and their ranking table: the step-time model's MFU ranks
(the compiler's estimate where the model has no figures), with each estimate's error beside it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from MaxText.aot import plan_search
from MaxText.aot.memory_report import GIB
from MaxText.aot.plan_model import Estimate
from MaxText.configuration import config as config_lib


@dataclasses.dataclass
class Planned:
  """One short-listed candidate: its settings, config, analytical estimate and compile result."""

  settings: dict[str, Any]
  config: config_lib.Config
  estimate: Estimate
  key: str
  result: dict[str, Any] | None = None
  cached: bool = False

  def argv_values(self) -> list[str]:
    return [f"{k}={_text(v)}" for k, v in self.settings.items()]


def _text(value: object) -> str:
  return ("true" if value else "false") if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


# The analytical model's caveats that the step-time model prices (the compiler's estimate does not).
MODEL_PRICES = frozenset({"host offload", "DCN-bound"})


@dataclasses.dataclass(frozen=True)
class Ranked:
  """A compiled candidate's standing: the MFU it is ranked by (the step-time model's, else the
  compiler's; -1 when it did not compile or fit) and the caveats that apply to that figure."""

  mfu: float
  by_model: bool
  caveats: tuple[str, ...]


def _row(index: int, p: Planned, hbm: float, chips: int, seq_len: int, peak: float,
         host: float = math.inf) -> tuple[list[str], Ranked]:
  """The table row of a compiled candidate and its standing (`host`: the host's memory per chip)."""
  r = p.result or {"status": "not compiled"}
  label = plan_search.describe(p.settings) or "(as given)"
  analytic = f"{p.estimate.total / GIB:.2f}"
  by_model = r.get("model_mfu") is not None
  caveats = tuple(c for c in p.estimate.caveats if not (by_model and c in MODEL_PRICES))
  if r["status"] != "compiled":  # XLA's out-of-memory figure, where it gave one, is its whole heap too
    needed = float(r.get("total") or 0.0)
    error = f"{(p.estimate.total - needed) / needed:+.0%}" if needed else "-"
    return [str(index), label, f"{needed / GIB:.2f}" if needed else "-", r["status"], "-", "-", "-", "-", "-",
            _compile_time(p), analytic, error, "-", ", ".join(caveats)], Ranked(-1.0, by_model, caveats)
  total, compiler_step, model_step = float(r["total"]), r.get("step_s"), r.get("model_step_s")
  host_fits = float(r.get("host_bytes") or 0.0) <= host  # offloaded activations and optimizer state
  fits = total <= hbm and host_fits
  tokens = float(p.config.data.global_batch_size) * seq_len / chips
  compiler_mfu = p.estimate.flops / compiler_step / (peak * 1e12) if compiler_step else float("nan")
  step = model_step if by_model else compiler_step
  mfu = float(r["model_mfu"]) if by_model else compiler_mfu
  memory_error = (p.estimate.total - total) / total
  step_error = (p.estimate.step_s - step) / step if step else float("nan")
  ms = lambda seconds: f"{seconds * 1e3:,.1f}" if seconds else "-"  # noqa: E731
  fits_cell = f"yes ({1 - total / hbm:.0%} free)" if fits else "NO" if host_fits else "NO (host memory)"
  row = [str(index), label, f"{total / GIB:.2f}", fits_cell,
         ms(model_step), f"{r['model_mfu']:.1%}" if by_model else "-",
         f"{tokens / step:,.0f}" if step else "-", ms(compiler_step), f"{compiler_mfu:.1%}" if compiler_step else "-",
         _compile_time(p), analytic, f"{memory_error:+.0%}", f"{step_error:+.0%}", ", ".join(caveats)]
  return row, Ranked(mfu if fits and step else -1.0, by_model, caveats)


def rank_compiled(planned: list[Planned], hbm: float, chips: int, seq_len: int, peak: float,
                  host: float = math.inf) -> tuple[list[list[str]], tuple[Planned, Ranked] | None]:
  """The table rows, and the best candidate that compiled and fits HBM and the host's memory
  (`host` per chip): the highest ranking MFU, a candidate whose ranking figure carries caveats
  winning only when no other fits."""
  rows: list[list[str]] = []
  best: tuple[Planned, Ranked] | None = None
  for i, p in enumerate(planned, 1):
    row, standing = _row(i, p, hbm, chips, seq_len, peak, host)
    rows.append(row)
    if standing.mfu >= 0 and (best is None or (not standing.caveats, standing.mfu) > (not best[1].caveats, best[1].mfu)):
      best = (p, standing)
  return rows, best


def _compile_time(p: Planned) -> str:
  if not p.result:
    return "-"
  return f"cached ({p.result['compile_s']:.0f} s)" if p.cached else f"{p.result['compile_s']:.1f} s"


HEADER = ["#", "candidate", "HBM GiB/chip", "fits", "model ms", "model MFU", "tokens/s/chip", "compiler ms",
          "compiler MFU", "compile", "analytic GiB", "mem err", "step err", "caveats"]


def format_table(rows: list[list[str]], unit: str = "chip") -> str:
  """`unit`: what one device is (TpuGeneration.device_unit): the per-chip columns are a TensorCore's on tpu7x."""
  header = [h.replace("/chip", f"/{unit}") for h in HEADER]
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header] + rows]
  return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])
