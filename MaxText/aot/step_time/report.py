"""The step-time model's figures as train_compile prints them under the compiler's estimate."""

from __future__ import annotations

from MaxText.aot.step_time import program, simulate
from MaxText.aot.step_time.network import Calibration
from MaxText.aot.step_time.saved import StepTarget
from MaxText.platform import accelerators

# The constants fitted to the 33 published MFU points (benchmarks/step_time_table.py; AOT.md,
# "The step-time model"): one set for every model.
FITTED = Calibration(mxu_efficiency=0.935, other_compute_scale=0.617, kernel_efficiency=0.28, ici_efficiency=1.0,
                     ici_hop_latency_s=1e-6, dcn_efficiency=0.902, dcn_latency_s=3.2e-4)

_COMPUTE = ("matmul", "other compute", "kernel")


def predict(hlo_text: str, target: StepTarget, cal: Calibration = FITTED) -> simulate.Prediction:
  ops = program.build_program(hlo_text, target)
  peak = accelerators.TPU_GENERATIONS[target.generation].peak_tflops
  return simulate.simulate(ops, cal, target.model_tflops_per_device, peak)


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


def lines(pred: simulate.Prediction, peak_tflops: float) -> list[str]:
  s = pred.seconds
  ms = lambda seconds: f"{seconds * 1e3:,.1f} ms"  # noqa: E731
  ici = sorted(((k.removeprefix("ici:"), v) for k, v in s.items() if k.startswith("ici:")), key=lambda kv: -kv[1])
  ici_text = f"exposed ICI {ms(pred.exposed('ici:'))}" + (
      " (" + ", ".join(f"{k} {ms(v)}" for k, v in ici[:3]) + (", ..." if len(ici) > 3 else "") + ")" if ici else "")
  out = [f"step-time model (not a measurement): step {ms(pred.step_s)} -> MFU {pred.mfu:.1%} of {peak_tflops:g} TFLOP/s",
         f"  compute {ms(s.get('matmul', 0.0) + s.get('other compute', 0.0))} (matmuls {ms(s.get('matmul', 0.0))}), "
         f"Pallas kernels {ms(s.get('kernel', 0.0))}, {ici_text}, exposed DCN {ms(pred.exposed('dcn:'))}, "
         f"host transfers {ms(pred.exposed('host:'))}"]
  for label, name, source, seconds in pred.top_exposed:
    out.append(f"  exposed: {ms(seconds)} {label.split(':', 1)[-1]} ({name}; {where(source)})")
  return out
