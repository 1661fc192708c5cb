"""The step-time model's GPU row: one GPU's compiled train step priced at its roofline.

Every kernel of the compiled HLO (loops counted by their trips) takes the longer of its FLOPs at
the GPU's published dense peak and its HBM bytes at the published bandwidth; the step is their
sum. This is the simpler model the TPU one reduces to on one device with no links: it has no
fitted constant (the TPU calibration was fitted on TPU points and says nothing about cuBLAS or
cuDNN), so it is a lower bound on the step, and the measured step over it is the share of the
roofline the step reaches (getting_started/GPU.md, "The step-time model on one GPU").

What each kernel is, from the GPU compiler's HLO:
- cuBLAS / cuBLASLt GEMMs (`__cublas$gemm`, `__cublas$lt$matmul`, `...$f8`): 2·(result)·(contracted)
  FLOPs from the call's dot dimension numbers, at the fp8 peak where both inputs are 8-bit;
- Triton GEMM fusions and any fusion holding a dot: the dot's FLOPs;
- cuDNN attention (`__cudnn$fmha...`): the forward's two matmuls, the backward's five (scores
  recomputed, dV, dP, dQ, dK), halved under a causal mask;
- everything else: bytes. A slice of a parameter reads the slice, an in-place update writes the
  update: a scanned layer stack is read a layer at a time, not whole each trip.
Collectives are not priced: this row is for one GPU, and a module with any says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from MaxText.aot.step_time import hlo
from MaxText.errors import UserError


@dataclasses.dataclass(frozen=True)
class GpuChip:
  """Published figures of one GPU (dense, no sparsity), in FLOP/s and bytes/s."""

  name: str
  peak_bf16: float
  peak_fp8: float | None
  hbm: float


# NVIDIA's data sheets (SXM parts): H200 989 / 1,979 TFLOP/s bf16 / fp8 dense, HBM3e 4.8 TB/s; H100 989 /
# 1,979, HBM3 3.35 TB/s; A100 80 GB 312 bf16, no fp8, HBM2e 2,039 GB/s; L4 121 / 242.5, GDDR6 300 GB/s.
GPU_CHIPS: dict[str, GpuChip] = {
    "nvidia h200": GpuChip("NVIDIA H200", 989e12, 1979e12, 4.8e12),
    "nvidia h100": GpuChip("NVIDIA H100", 989e12, 1979e12, 3.35e12),
    "nvidia a100": GpuChip("NVIDIA A100", 312e12, None, 2.039e12),
    "nvidia l4": GpuChip("NVIDIA L4", 121e12, 242.5e12, 300e9),
}

_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency"}
_FP8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e5m2fnuz", "f8e4m3fnuz", "s8", "u8")
CATEGORIES = ("gemm", "attention", "elementwise", "copy")


def chip_for(device_kind: str) -> GpuChip:
  kind = device_kind.strip().lower()
  for prefix, chip in GPU_CHIPS.items():
    if kind.startswith(prefix):
      return chip
  raise UserError(f"the GPU step-time model has no published figures for {device_kind!r} (it has "
                  f"{', '.join(c.name for c in GPU_CHIPS.values())}); add them to MaxText/aot/step_time/gpu.py "
                  "with their source")


@dataclasses.dataclass
class GpuEstimate:
  """The roofline step: seconds and FLOPs by category, kernels launched per step."""

  seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
  flops: float = 0.0
  hbm_bytes: float = 0.0
  kernels: int = 0
  collectives: int = 0

  @property
  def step_s(self) -> float:
    return sum(self.seconds.values())

  def absorb(self, other: "GpuEstimate", times: int) -> None:
    """Adds `other` run `times` times (a conditional's chosen branch)."""
    for category, seconds in other.seconds.items():
      self.seconds[category] += seconds * times
    self.flops += other.flops * times
    self.hbm_bytes += other.hbm_bytes * times
    self.kernels += other.kernels * times
    self.collectives += other.collectives * times

  def add(self, category: str, seconds: float, flops: float, moved: float, times: int) -> None:
    self.seconds[category] += seconds * times
    self.flops += flops * times
    self.hbm_bytes += moved * times
    self.kernels += times


def _dims_from_config(attrs: str, key: str) -> list[int]:
  found = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
  return [int(d) for d in re.findall(r'"(\d+)"', found.group(1))] if found else []


def gemm_flops(inst: hlo.Instruction, by_name: dict[str, hlo.Instruction]) -> float:
  """2 x the result's elements x the contracted size, from a cuBLAS call's dot dimension numbers."""
  lhs = by_name.get(inst.operands[0]) if inst.operands else None
  if lhs is None or not lhs.arrays or not inst.arrays:
    return 0.0
  contracting = _dims_from_config(inst.attrs, "lhs_contracting_dimensions")
  contracted = math.prod(lhs.arrays[0].dims[d] for d in contracting if d < len(lhs.arrays[0].dims))
  return 2.0 * math.prod(inst.arrays[0].dims) * contracted


def attention_flops(inst: hlo.Instruction, by_name: dict[str, hlo.Instruction]) -> float:
  """A cuDNN attention call's matmul FLOPs: 2·B·N·Tq·Tk·D per matmul, from the score matrix's shape
  (`intermediate_tensor_shape`, [B, N, Tq, Tk]) and the query's head size, else from q and k as
  [B, T, N, D] (JAX's layout)."""
  operands = [by_name[o].arrays[0] for o in inst.operands[:2] if o in by_name and by_name[o].arrays]
  if len(operands) < 2 or len(operands[0].dims) != 4:
    return 0.0
  q, k = operands[0].dims, operands[1].dims
  head_dim = q[-1]
  scores = re.search(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":\[([^\]]*)\]', inst.attrs)
  dims = [int(d) for d in re.findall(r'"(\d+)"', scores.group(1))] if scores else []
  per_matmul = 2.0 * math.prod(dims) * head_dim if len(dims) == 4 else 2.0 * q[0] * q[2] * q[1] * k[1] * head_dim
  matmuls = 5 if "backward" in inst.custom_call_target.lower() else 2
  causal = 0.5 if re.search(r'"mask_type":"[A-Z_]*CAUSAL', inst.attrs) or '"is_causal_mask":true' in inst.attrs \
      else 1.0
  return matmuls * per_matmul * causal


class _Pricer:
  def __init__(self, module: hlo.Module, chip: GpuChip):
    self.module, self.chip = module, chip
    self.estimate = GpuEstimate()

  def walk(self, computation: str, times: int) -> None:
    for inst in self.module.computations.get(computation, []):
      opcode = inst.opcode
      if opcode in _FREE or opcode.endswith("-done"):
        continue
      if opcode == "while":
        self.walk(inst.attr("body") or "", times * hlo.trip_count(self.module, inst))
      elif opcode in ("call", "async-start"):
        for callee in inst.callees:
          self.walk(callee, times)
      elif opcode == "conditional":  # one branch runs: priced as the costliest
        self._costliest_branch(inst, times)
      elif hlo.base_opcode(opcode) in hlo.COLLECTIVE_OPCODES:
        self.estimate.collectives += times
      else:
        self._kernel(inst, times)

  def _costliest_branch(self, inst: hlo.Instruction, times: int) -> None:
    best: GpuEstimate | None = None
    for branch in inst.callees:
      sub = _Pricer(self.module, self.chip)
      sub.walk(branch, 1)
      if best is None or sub.estimate.step_s > best.step_s:
        best = sub.estimate
    if best is not None:
      self.estimate.absorb(best, times)

  def _kernel(self, inst: hlo.Instruction, times: int) -> None:
    by_name = self.module.by_name
    target = inst.custom_call_target.lower() if inst.opcode == "custom-call" else ""
    moved = self._moved_bytes(inst)
    flops, peak, category = 0.0, self.chip.peak_bf16, "elementwise"
    if target.startswith("__cudnn$fmha"):
      flops, category = attention_flops(inst, by_name), "attention"
      peak = self._peak_for(inst)
    elif target.startswith("__cublas"):
      flops, category = gemm_flops(inst, by_name), "gemm"
      peak = self._peak_for(inst)
    elif inst.opcode == "fusion":
      flops = hlo.fusion_flops(self.module, inst.attr("calls") or "")
      if flops:
        category, peak = "gemm", self._peak_for(inst)
    elif inst.opcode in ("dot", "convolution"):
      flops, category = hlo.matmul_flops(inst, by_name), "gemm"
    elif inst.opcode in ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate",
                         "pad", "copy-start"):
      category = "copy"
    seconds = max(flops / peak, moved / self.chip.hbm)
    self.estimate.add(category, seconds, flops, moved, times)

  def _peak_for(self, inst: hlo.Instruction) -> float:
    """The fp8 peak where the first two inputs are 8-bit floats (or ints) and the GPU has one."""
    by_name = self.module.by_name
    inputs = [by_name[o].arrays[0].dtype for o in inst.operands[:2] if o in by_name and by_name[o].arrays]
    if inst.opcode == "fusion":  # a fused GEMM's own dot reads the fusion's parameters
      inputs = [a.dtype for o in inst.operands for a in by_name[o].arrays[:1] if o in by_name][:2]
    if self.chip.peak_fp8 and len(inputs) == 2 and all(d in _FP8 for d in inputs):
      return self.chip.peak_fp8
    return self.chip.peak_bf16

  def _moved_bytes(self, inst: hlo.Instruction) -> float:
    """HBM bytes a kernel reads and writes: each operand once and its results once, except that a
    parameter the kernel only slices is read a slice at a time, and an in-place update moves only
    the update (the result aliases the operand)."""
    by_name = self.module.by_name
    operands = [by_name[o] for o in inst.operands if o in by_name]
    read = [float(sum(a.bytes for a in o.arrays)) for o in operands]
    # A library call's 1-D byte buffer result is its scratch workspace, not an output.
    workspace = inst.opcode == "custom-call"
    written = float(sum(a.bytes for a in inst.arrays if not (workspace and a.dtype in ("u8", "s8") and len(a.dims) == 1)))
    body = self.module.computations.get(inst.attr("calls") or "", []) if inst.opcode == "fusion" else []
    if inst.opcode in ("dynamic-slice", "slice") and read:
      read[0] = written
    elif inst.opcode == "dynamic-update-slice" and len(read) > 1:
      read[0], written = 0.0, read[1]
    for param in (i for i in body if i.opcode == "parameter"):
      index = int(param.args) if param.args.isdigit() else -1
      if not 0 <= index < len(read):
        continue
      users = [i for i in body if param.name in i.operands]
      if users and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == param.name for u in users):
        read[index] = float(sum(u.result_bytes for u in users))
      in_place = [u for u in users if u.opcode == "dynamic-update-slice" and u.operands[0] == param.name]
      if in_place and len(users) == len(in_place):
        update = sum(sum(a.bytes for a in by_name[u.operands[1]].arrays) for u in in_place if u.operands[1] in by_name)
        read[index] = 0.0
        written = max(0.0, written - sum(a.bytes for a in param.arrays)) + update
    return sum(read) + written


def estimate(hlo_text: str, device_kind: str) -> GpuEstimate:
  """The roofline step of a compiled GPU module (compiled.as_text() or XLA's *after_optimizations.txt)."""
  module = hlo.parse_module(hlo_text)
  pricer = _Pricer(module, chip_for(device_kind))
  pricer.walk(module.entry, 1)
  return pricer.estimate


def summary(est: GpuEstimate, measured_s: float | None = None) -> dict[str, float]:
  """Flat figures for a table row or a JSON line (milliseconds; `measured_over_model` with a measured step)."""
  out = {f"{k}_ms": 1e3 * v for k, v in est.seconds.items()}
  out.update(model_ms=1e3 * est.step_s, kernels=float(est.kernels), collectives=float(est.collectives),
             tflop=est.flops / 1e12, hbm_gb=est.hbm_bytes / 1e9)
  if measured_s:
    out["measured_over_model"] = measured_s / est.step_s if est.step_s else math.nan
  return out


def as_json(est: GpuEstimate, measured_s: float | None = None) -> str:
  return json.dumps(summary(est, measured_s))
