"""The TPU compiler's own step-time estimate: its per-instruction cycle counts summed over one
execution of the compiled HLO (train_compile's report)."""

from __future__ import annotations

import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CALLEES = re.compile(r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)")


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  computations: dict[str, list[str]] = {}
  current, entry = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      computations[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif line == "}":
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def estimated_cycles(hlo_text: str) -> int | None:
  """Sum of the TPU compiler's per-instruction `estimated_cycles` over one execution.

  A while loop (the scanned layer stack, windowed collective matmuls) counts its body once
  per iteration; its trip count is the constant its condition compares the counter with.
  Async collectives carry no cycle estimate, so communication is assumed hidden behind
  compute. None when the compiled code has no estimates (CPU/GPU).
  """
  computations, entry = _split_computations(hlo_text)
  if entry is None or '"estimated_cycles"' not in hlo_text:
    return None
  memo: dict[str, int] = {}

  def trip_count(condition: str) -> int:
    constants = [int(m) for line in computations.get(condition, []) for m in re.findall(r"constant\((\d+)\)", line)]
    return max(constants) if constants else 1

  def cycles(name: str) -> int:
    if name not in memo:
      memo[name] = 0  # guards against recursion through malformed text
      total = 0
      for line in computations.get(name, []):
        total += sum(int(c) for c in _CYCLES.findall(line))
        if " while(" in line:
          condition = re.search(r"condition=%([\w.\-]+)", line)
          body = re.search(r"body=%([\w.\-]+)", line)
          if condition and body:
            total += trip_count(condition.group(1)) * cycles(body.group(1))
        elif re.search(r" (call|conditional|async-start)\(", line):
          total += sum(cycles(callee) for callee in _CALLEES.findall(line))
      memo[name] = total
    return memo[name]

  return cycles(entry)
