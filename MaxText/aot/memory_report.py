"""What the compiled train step needs in device memory, from XLA's memory analysis and its
buffer-assignment report, and the one-line "does not fit" message (train_compile's report)."""

from __future__ import annotations

import dataclasses
import re

import jax

from MaxText.paths import storage

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device bytes from XLA's memory analysis of the compiled step.

  Three figures, from most to least exact:
  - `device_heap`: the bytes XLA's buffer assignment lays out in device memory (HBM), read
    from its memory-usage report (`read_buffer_assignment`); arguments, outputs and every
    temporary live at once, placed at fixed offsets. 0 when no report was read.
  - `peak`: XLA's peak of live buffers, arguments included; it also counts buffers offloaded
    to host memory (v5e/128b: 47.5 GiB, of which 42 GiB host). 0 where not reported (CPU).
  - `upper_bound`: arguments + outputs + temporaries + code. `temporaries` adds up every
    temporary allocation, not what is live at once: v5e/32b has 16.1 GiB of temporaries
    but an 11.7 GiB device heap, and XLA (whose own out-of-memory check uses the heap) accepts it.
  """

  arguments: int
  outputs: int
  aliased: int  # outputs written into donated argument buffers (the new train state)
  temporaries: int
  generated_code: int
  peak: int = 0
  device_heap: int = 0
  other_spaces: tuple[tuple[str, int], ...] = ()  # (memory space, bytes) beside the device heap, e.g. host

  @property
  def upper_bound(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

  @property
  def total(self) -> int:
    """Device bytes one chip needs: the laid-out heap plus code, else the best figure reported."""
    if self.device_heap > 0:
      return self.device_heap + self.generated_code
    if self.peak > 0:  # with activations offloaded it counts host memory too: never above the bound
      return min(self.peak + self.generated_code, self.upper_bound)
    return self.upper_bound

  @property
  def source(self) -> str:
    if self.device_heap > 0:
      return "XLA buffer assignment"
    return "XLA peak" if self.peak > 0 and self.total < self.upper_bound else "XLA memory analysis, upper bound"

  @classmethod
  def from_compiled(cls, compiled: jax.stages.Compiled,
                    buffer_assignment: tuple[int, tuple[tuple[str, int], ...]] | None = None) -> "MemoryReport":
    m = compiled.memory_analysis()
    if m is None:
      raise RuntimeError("this backend reports no memory analysis for the compiled step")
    heap, others = buffer_assignment or (0, ())
    return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
               m.temp_size_in_bytes, m.generated_code_size_in_bytes,
               int(getattr(m, "peak_memory_in_bytes", 0) or 0), heap, others)

  def lines(self) -> list[str]:
    lines = [f"  arguments       {format_bytes(self.arguments):>12}  (train state shard + batch + rng)",
             f"  outputs         {format_bytes(self.outputs):>12}  ({format_bytes(self.aliased)} reuse donated argument buffers)",
             f"  temporaries     {format_bytes(self.temporaries):>12}  (activations, gradients, collective buffers; "
             "every allocation, not all live at once)",
             f"  generated code  {format_bytes(self.generated_code):>12}"]
    if self.peak > 0:
      lines.append(f"  peak live       {format_bytes(self.peak):>12}  (XLA's peak of live buffers, host-offloaded included)")
    if self.device_heap > 0:
      lines.append(f"  device heap     {format_bytes(self.device_heap):>12}  (XLA's buffer assignment in device memory)")
    for space, size in self.other_spaces:
      lines.append(f"  {space + ' memory':<15} {format_bytes(size):>12}  (not device HBM: e.g. offloaded activations)")
    lines.append(f"  total           {format_bytes(self.total):>12}  (device memory per chip, from the {self.source})")
    return lines


# Memory spaces of XLA's TPU buffer assignment that are not the device heap and too small to
# matter (vector/scalar scratch memories, semaphores).
_SCRATCH_SPACES = {"vmem", "smem", "sflag"}
_SPACE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)\s*\nTotal bytes: (\d+)", re.MULTILINE)


def read_buffer_assignment(dump_dir: str | None) -> tuple[int, tuple[tuple[str, int], ...]] | None:
  """(device heap bytes, other large memory spaces) from the train step's memory-usage report
  that XLA writes under `xla_dump_to` (see `buffer_assignment_dump_options`); None if absent."""
  if not dump_dir:
    return None
  reports = storage.glob(storage.join(dump_dir, "*jit_train_step*memory-usage-report.txt"))
  if not reports:
    return None
  heap, others = 0, []
  for name, color, size in _SPACE.findall(storage.read_text(reports[-1])):
    if int(color) == 0:
      heap = int(size)
    elif name not in _SCRATCH_SPACES and int(size) >= 2**20:
      others.append((name, int(size)))
  return (heap, tuple(others)) if heap else None


def buffer_assignment_dump_options(dump_dir: str) -> dict[str, str]:
  """Compiler options (for `Lowered.compile`) that make XLA write the train step's buffer-assignment reports."""
  return {"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*jit_train_step.*", "xla_dump_hlo_pass_re": "^$"}


def format_bytes(n: float) -> str:
  return f"{n / GIB:.3f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


_XLA_AMOUNT = re.compile(r"([\d.]+)\s*([KMGT])i?B?\b")
_UNIT = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def oom_bytes_from_xla(message: str) -> int | None:
  """The largest amount XLA's out-of-memory message names (its required size), in bytes.

  TPU messages read e.g. "... memory required for HLO temporaries (19.70G) exceeds available
  HBM (15.75G)" or "Used 20.5G of 15.75G hbm"; XLA's G is GiB.
  """
  amounts = [float(v) * _UNIT[u] for v, u in _XLA_AMOUNT.findall(message)]
  return int(max(amounts)) if amounts else None


def does_not_fit_message(needed_bytes: float, generation: str, hbm_gib: float, detail: str) -> str:
  return f"does not fit: needs {needed_bytes / GIB:.1f} GiB per chip, {generation} has {hbm_gib:g} GiB ({detail})"
