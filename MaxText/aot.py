"""Ahead-of-time compilation of the train step: the memory and step-time report, and
saving/loading a compiled step with a header that says what it was built for.

Shared by `train_compile.py` (compile, report, save) and `run_assembly.py` (load a saved step).

A saved step file is executable code wrapped in a pickle: loading it runs whatever it
contains. Load only files you (or someone you trust) compiled. It may be local or on gs://.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pickle
import re
import struct
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

from MaxText import storage
from MaxText.errors import UserError

GIB = 1024**3
_MAGIC = b"MAXTEXT-COMPILED-TRAIN-STEP\n"
_FORMAT_VERSION = 1
# Header sections that must agree between the file and the run that loads it.
_CHECKED_SECTIONS = ("target", "versions", "batch", "model", "optim", "mesh", "inputs")


# ---------------------------------------------------------------- memory report


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


# ---------------------------------------------------------------- compiler step-time estimate

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


# ---------------------------------------------------------------- saved step files


def runtime_versions() -> dict[str, str | None]:
  def version(dist: str) -> str | None:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {"jax": jax.__version__, "jaxlib": version("jaxlib"), "libtpu": version("libtpu") or version("libtpu-nightly")}


def _jsonable(value: Any) -> Any:
  return json.loads(json.dumps(value, default=str))


def step_header(config, inputs: Any, topology_name: str) -> dict[str, Any]:
  """What the compiled step depends on: the config groups the step is built from, the input
  shapes/dtypes/shardings, the devices and the compiler versions."""
  flat = jax.tree_util.tree_flatten_with_path(inputs.as_args())[0]
  shapes = {jax.tree_util.keystr(path): [list(x.shape), str(x.dtype), str(x.sharding.spec)] for path, x in flat}
  target = config.target
  return _jsonable({
      "format": _FORMAT_VERSION,
      "topology": topology_name,
      "model": dataclasses.asdict(config.model),
      "optim": dataclasses.asdict(config.optim),
      "mesh": dataclasses.asdict(config.mesh),
      "batch": {"global_batch_size": config.data.global_batch_size,
                "max_target_length": config.data.max_target_length},
      "inputs": shapes,
      "target": {"platform": target.platform, "device_kind": target.device_kind,
                 "num_devices": target.num_devices, "num_slices": config.mesh.num_slices},
      "versions": runtime_versions(),
      "flags": {name: os.environ.get(name, "") for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")},
  })


def header_differences(saved: dict[str, Any], expected: dict[str, Any], limit: int = 4) -> list[str]:
  """'section.key: file X, this run Y' for the checked sections that disagree."""
  out: list[str] = []

  def walk(prefix: str, a: Any, b: Any) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
      for key in sorted(set(a) | set(b)):
        walk(f"{prefix}.{key}" if prefix else str(key), a.get(key), b.get(key))
    elif a != b:
      out.append(f"{prefix}: file {a!r}, this run {b!r}")

  for section in _CHECKED_SECTIONS:
    walk(section, saved.get(section), expected.get(section))
  return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def save_compiled_step(path: str, compiled: jax.stages.Compiled, header: dict[str, Any]) -> int:
  """Writes magic + header length + JSON header + pickled executable; returns the file size."""
  payload = pickle.dumps(serialize_executable.serialize(compiled))
  header_bytes = json.dumps(header).encode()
  storage.write_bytes(path, _MAGIC + struct.pack(">Q", len(header_bytes)) + header_bytes + payload)
  return storage.size(path)


def read_header(path: str) -> tuple[dict[str, Any], int]:
  """(header, offset of the payload); a UserError for a file that is not a saved step."""
  try:
    with storage.open_file(path, "rb") as f:  # only the header is read (a ranged read on gs://)
      magic = f.read(len(_MAGIC))
      if magic != _MAGIC:
        raise UserError(f"compiled_trainstep_file {path!r} is not a compiled train step written by train_compile")
      (length,) = struct.unpack(">Q", f.read(8))
      header = json.loads(f.read(length))
  except OSError as e:
    raise UserError(f"cannot read compiled_trainstep_file {path!r}: {e.strerror or type(e).__name__}") from None
  except (struct.error, ValueError):
    raise UserError(f"compiled_trainstep_file {path!r} has a damaged header; compile it again") from None
  return header, len(_MAGIC) + 8 + length


def load_compiled_step(path: str, expected_header: dict[str, Any]) -> Callable:
  """The saved executable, after its header is checked against this run (before unpickling)."""
  header, offset = read_header(path)
  if header.get("format") != _FORMAT_VERSION:
    raise UserError(f"compiled_trainstep_file {path!r} has format {header.get('format')}, "
                    f"this version reads {_FORMAT_VERSION}; compile it again")
  differences = header_differences(header, expected_header)
  if differences:
    raise UserError(f"compiled_trainstep_file {path!r} was compiled for a different run "
                    f"(topology {header.get('topology')}): {'; '.join(differences)}. "
                    "Compile it again with train_compile and this run's settings")
  with storage.open_file(path, "rb") as f:
    f.seek(offset)
    serialized, in_tree, out_tree = pickle.load(f)  # trusted: see the module docstring
  return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
