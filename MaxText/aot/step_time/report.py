"""The step-time model's figures as train_compile prints them under the compiler's estimate."""

from __future__ import annotations

from MaxText.aot.step_time import program, simulate
from MaxText.aot.step_time.network import Calibration
from MaxText.aot.step_time.saved import StepTarget
from MaxText.platform import accelerators

# The constants fitted to the 33 published MFU points (benchmarks/step_time_table.py; AOT.md,
# "The step-time model"): one set for every model.
FITTED = Calibration(mxu_efficiency=0.968, other_compute_scale=0.5, kernel_efficiency=0.3, ici_efficiency=0.783,
                     ici_hop_latency_s=1e-6, dcn_efficiency=1.0, dcn_latency_s=2.91e-4, slice_sync_share=0.0152)

OVERLAP = "dataflow"  # the reading of the overlap fitted (program.OVERLAPS; AOT.md says why)
_COMPUTE = ("matmul", "other compute", "kernel")


def predict(hlo_text: str, target: StepTarget, cal: Calibration = FITTED, overlap: str = OVERLAP) -> simulate.Prediction:
  ops = program.build_program(hlo_text, target, overlap)
  peak = accelerators.TPU_GENERATIONS[target.generation].peak_tflops
  return simulate.simulate(ops, cal, target.model_tflops_per_device, peak, target.num_slices)


def where(source: str) -> str:
  """An HLO op's JAX source in words: pass, layer stack, op (e.g. `backward, scanned layers, dot_general`)."""
  if not source:
    return "compiler-made"
  parts = ["backward" if "transpose(" in source else "forward" if "jvp(" in source else "step"]
  if "while/body" in source:
    parts.append("scanned layers")
  if "rematted_computation" in source:
    parts.append("rematerialised")
  parts.append(source.rstrip("/").rsplit("/", 1)[-1])
  return ", ".join(parts)


def lines(pred: simulate.Prediction, peak_tflops: float, scheduled: simulate.Prediction | None = None) -> list[str]:
  """The printed breakdown; `scheduled`: the same step read with the compile's own waits (program.OVERLAPS)."""
  s = pred.seconds
  ms = lambda seconds: f"{seconds * 1e3:,.1f} ms"  # noqa: E731
  ici = sorted(((k.removeprefix("ici:"), v) for k, v in s.items() if k.startswith("ici:")), key=lambda kv: -kv[1])
  ici_text = f"exposed ICI {ms(pred.exposed('ici:'))}" + (
      " (" + ", ".join(f"{k} {ms(v)}" for k, v in ici[:3]) + (", ..." if len(ici) > 3 else "") + ")" if ici else "")
  out = [f"step-time model (not a measurement): step {ms(pred.step_s)} -> MFU {pred.mfu:.1%} of {peak_tflops:g} TFLOP/s",
         f"  compute {ms(s.get('matmul', 0.0) + s.get('other compute', 0.0))} (matmuls {ms(s.get('matmul', 0.0))}), "
         f"Pallas kernels {ms(s.get('kernel', 0.0))}, {ici_text}, exposed DCN {ms(pred.exposed('dcn:'))}, "
         f"host transfers {ms(pred.exposed('host:'))}"
         + (f", slice synchronisation {ms(s[simulate.SLICE_SYNC])}" if s.get(simulate.SLICE_SYNC) else "")]
  if scheduled is not None and abs(scheduled.step_s - pred.step_s) > 1e-3 * pred.step_s:
    out.append(f"  waiting where this compile's schedule waits: step {ms(scheduled.step_s)} -> MFU {scheduled.mfu:.1%} "
               f"(exposed ICI {ms(scheduled.exposed('ici:'))})")
  for label, name, source, seconds in pred.top_exposed:
    if label == simulate.SLICE_SYNC:
      out.append(f"  exposed: {ms(seconds)} slice synchronisation (every step waits for the slowest slice)")
    else:
      out.append(f"  exposed: {ms(seconds)} {label.split(':', 1)[-1]} ({name}; {where(source)})")
  return out
