"""Figures read off compiled HLO text, summed over one execution of the step: the TPU
compiler's own step-time estimate (its per-instruction cycle counts; train_compile's report)
and the bytes each kind of collective produces (benchmarks/moe_paths.py)."""

from __future__ import annotations

import re
from typing import Callable

from MaxText.aot.step_time import hlo

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def _per_execution(hlo_text: str, line_value: Callable[[str], dict[str, int]]) -> dict[str, int]:
  """Adds `line_value(line)` over every instruction one execution runs: a while loop (the
  scanned layer stack, windowed collective matmuls) counts its body once per iteration, its trip
  count read from its counter (limit, start and step: an unrolled loop counts by 2 or more; see
  step_time.hlo.trip_count); calls and async wrappers count their callees, a conditional its
  costliest branch per key (one branch runs; which one is decided at run time, so this is an
  upper bound, e.g. the ring's per-pair kernel switch)."""
  if "ENTRY" not in hlo_text:
    return {}
  module = hlo.parse_module(hlo_text)
  memo: dict[str, dict[str, int]] = {}

  def add(total: dict[str, int], more: dict[str, int], times: int = 1) -> None:
    for key, value in more.items():
      total[key] = total.get(key, 0) + times * value

  def walk(name: str) -> dict[str, int]:
    if name not in memo:
      memo[name] = {}  # guards against recursion through malformed text
      total: dict[str, int] = {}
      for inst in module.computations.get(name, []):
        add(total, line_value(inst.text))
        if inst.opcode == "while":
          body = inst.attr("body")
          if body:
            add(total, walk(body), hlo.trip_count(module, inst))
        elif inst.opcode == "conditional":
          branches = [walk(branch) for branch in inst.callees]
          for key in {k for branch in branches for k in branch}:
            add(total, {key: max(branch.get(key, 0) for branch in branches)})
        elif inst.opcode in ("call", "async-start"):
          for callee in re.findall(r"(?:to_apply|calls)=\{?%([\w.\-]+)", inst.attrs):
            add(total, walk(callee))
      memo[name] = total
    return memo[name]

  return walk(module.entry)


def estimated_cycles(hlo_text: str) -> int | None:
  """Sum of the TPU compiler's per-instruction `estimated_cycles` over one execution.

  Async collectives carry no cycle estimate, so communication is assumed hidden behind
  compute. None when the compiled code has no estimates (CPU/GPU).
  """
  if '"estimated_cycles"' not in hlo_text:
    return None
  return _per_execution(hlo_text, lambda line: {"cycles": sum(int(c) for c in _CYCLES.findall(line))}).get("cycles", 0)


def uncosted_kernel_calls(hlo_text: str) -> int:
  """Pallas (Mosaic) kernel calls one execution runs that carry no cycle estimate: the TPU
  compiler prices none of them (splash attention, megablox), so estimated_cycles leaves their
  work out."""
  def line_value(line: str) -> dict[str, int]:
    uncosted = 'custom_call_target="tpu_custom_call"' in line and '"estimated_cycles"' not in line
    return {"calls": 1} if uncosted else {}

  return _per_execution(hlo_text, line_value).get("calls", 0)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16,
               "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}


def _array_bytes(dtype: str, dims: str) -> int:
  count = 1
  for d in filter(None, dims.split(",")):
    count *= int(d)
  return count * _DTYPE_BITS.get(dtype, 8) // 8  # fp8 kinds (f8e4m3fn, ...) are one byte


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes each kind of collective produces per device over one execution (the size of its
  result; for an async start, of its largest buffer, the output). A ragged all-to-all counts
  its whole receive buffer, an upper bound on what it moves."""
  def line_value(line: str) -> dict[str, int]:
    match = _COLLECTIVE.search(line)
    if not match:
      return {}
    sizes = [_array_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(match.group(1))]
    return {match.group(2): (max(sizes) if match.group(3) else sum(sizes)) if sizes else 0}

  return _per_execution(hlo_text, line_value)
