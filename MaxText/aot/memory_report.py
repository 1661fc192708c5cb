"""What the compiled train step needs in device memory (and in the host's, for what it offloads),
from XLA's memory analysis and its buffer-assignment report; XLA's out-of-memory messages read
back (which memory, how much against how much); and the one-line "does not fit" messages
(train_compile's report)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax

from MaxText.aot.plan_remat import offloaded_activations
from MaxText.configuration import config as config_lib
from MaxText.configuration import remat_policies
from MaxText.paths import storage
from MaxText.platform import accelerators

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
  def host(self) -> int:
    """Bytes per chip in the host's pinned memory: offloaded activations and optimizer state."""
    return sum(size for space, size in self.other_spaces if space == "host")

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

  def lines(self, unit: str = "chip") -> list[str]:
    """The report's lines; `unit`: what one device is (TpuGeneration.device_unit: a TensorCore on tpu7x)."""
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
      what = "the host's pinned memory: offloaded activations and optimizer state" if space == "host" else \
          "not device HBM"
      lines.append(f"  {space + ' memory':<15} {format_bytes(size):>12}  ({what})")
    lines.append(f"  total           {format_bytes(self.total):>12}  (device memory per {unit}, from the {self.source})")
    return lines


# Memory spaces of XLA's TPU buffer assignment that are not the device heap and too small to
# matter (vector/scalar scratch memories, semaphores); XLA's memory-space assignment may hold
# whole activations in VMEM too, which only a small model notices (getting_started/Planner.md).
_SCRATCH_SPACES = {"vmem", "smem", "sflag"}
# Colour 5 is the host's pinned memory (layouts' S(5), which XLA's out-of-memory messages call
# "host"); this libtpu's memory-usage report labels it "cmem".
_HOST_COLOR = 5
_SPACE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)\s*\nTotal bytes: (\d+)", re.MULTILINE)


def memory_spaces(dump_dir: str) -> dict[str, int]:
  """Bytes of every memory space (default, vmem, host, ...) in the train step's memory-usage report
  under `dump_dir` (see `buffer_assignment_dump_options`); empty if absent."""
  reports = storage.glob(storage.join(dump_dir, "*jit_train_step*memory-usage-report.txt"))
  return {name: int(size) for name, _, size in _SPACE.findall(storage.read_text(reports[-1]))} if reports else {}


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
      others.append(("host" if int(color) == _HOST_COLOR else name, int(size)))
  return (heap, tuple(others)) if heap else None


# What each train-state field holds, for the "state per chip" line (other fields: their own name).
_STATE_PART_NAMES = {"params": "parameters", "opt_state": "optimizer state", "reference": "reference model",
                     "teacher": "teacher"}


def state_bytes_per_chip(state: Any) -> list[tuple[str, int]]:
  """(part, bytes one chip holds) for each field of a train state of sharded ShapeDtypeStructs
  (run_assembly.StepInputs.state): the parameters, the optimizer state and what the objective keeps
  beside them (DPO's reference, a distillation teacher); scalars left out."""
  parts: list[tuple[str, int]] = []
  for field in dataclasses.fields(state) if dataclasses.is_dataclass(state) else ():
    leaves = [leaf for leaf in jax.tree.leaves(getattr(state, field.name)) if leaf.ndim]  # not the step counter
    total = 0
    for leaf in leaves:
      shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
      total += math.prod(shape) * leaf.dtype.itemsize
    if leaves:
      parts.append((_STATE_PART_NAMES.get(field.name, field.name), total))
  return parts


def describe_state(parts: list[tuple[str, int]], unit: str = "chip") -> str:
  """'train state per chip: parameters 1.0 GiB, optimizer state 2.0 GiB, teacher 3.0 GiB'; `unit`: what one device
  is (TpuGeneration.device_unit): the parts are a JAX device's, a TensorCore's on tpu7x."""
  return f"train state per {unit}: " + ", ".join(f"{name} {format_bytes(size)}" for name, size in parts) if parts else ""


def buffer_assignment_dump_options(dump_dir: str) -> dict[str, str]:
  """Compiler options (for `Lowered.compile`) that make XLA write the train step's buffer-assignment reports."""
  return {"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*jit_train_step.*", "xla_dump_hlo_pass_re": "^$"}


def format_bytes(n: float) -> str:
  return f"{n / GIB:.3f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


_XLA_AMOUNT = re.compile(r"([\d.]+)\s*([KMGT])i?B?\b")
_XLA_BYTES = re.compile(r"\b(\d+) ?(?:bytes\b|B\b)")  # "4770354232 bytes", "(33554432B)"
_UNIT = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def oom_bytes_from_xla(message: str) -> int | None:
  """The largest amount XLA's out-of-memory message names (its required size), in bytes.

  TPU messages read e.g. "... memory required for HLO temporaries (19.70G) exceeds available
  HBM (15.75G)" or "Used 20.5G of 15.75G hbm"; XLA's G is GiB. GPU ones may count bytes.
  """
  amounts = [float(v) * _UNIT[u] for v, u in _XLA_AMOUNT.findall(message)]
  amounts += [float(v) for v in _XLA_BYTES.findall(message)]
  return int(max(amounts)) if amounts else None


def is_xla_oom(message: str) -> bool:
  """Whether an XLA error says a device (or the host's pinned memory) ran out of memory: TPU's
  RESOURCE_EXHAUSTED, or a GPU allocator's "Out of memory"."""
  return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


def does_not_fit_message(needed_bytes: float, generation: str, hbm_gib: float, detail: str, unit: str = "chip") -> str:
  """`unit`: what one device is (TpuGeneration.device_unit): XLA's figure and `hbm_gib` are per device, so on tpu7x
  per TensorCore; "per chip, tpu7x has 96 GiB" would halve a 192 GiB chip."""
  return f"does not fit: needs {needed_bytes / GIB:.1f} GiB per {unit}, {generation} has {hbm_gib:g} GiB ({detail})"


@dataclasses.dataclass(frozen=True)
class XlaOom:
  """What an XLA out-of-memory message says: the memory space that ran out ("hbm", "host",
  "vmem", "smem"; "" when it names none), the bytes needed and available per chip (0 where it
  gives none) and, when one allocation alone is larger than the space, that buffer's shape.
  `one_allocation`: a running program's allocation failed (TPU, GPU at run time): `needed` is that
  allocation alone, `available` what was free then, not the whole memory."""

  space: str
  needed: int
  available: int
  buffer: str = ""
  one_allocation: bool = False


# The TPU compiler's messages (first lines, this libtpu), e.g.:
#   Ran out of memory in memory space host. Used 133.88G of 128.00G host. Exceeded host capacity by 5.88G.
#   Allocation (size=219848638464) would exceed memory (size=137438953472) :: %s0 = inlined_call_operand.host
#     [shape: bf16[126,2,8192,53248], index: 0, kind: output, shape index: {}] /* operand 0 */ :: custom-call.226
#   Ran out of memory on HBM, the total memory required for HLO temporaries (19.70G) exceeds available HBM (15.75G).
#   E1001: CompileTimeScopedVmemOom:
_USED = re.compile(r"Used ([\d.]+)([KMGT])i?B? of ([\d.]+)([KMGT])i?B? (\w+)")
_ALLOCATION = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
_OPERAND_SPACE = re.compile(r"inlined_call_operand\.(\w+)|space=(\w+)|memory space (\w+)")
_SHAPE = re.compile(r"shape(?::| =) '?(\w+\[[\d,]*\])")
_EXCEEDS = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available (\w+) \(([\d.]+)([KMGT])\)")
# A running program's allocation failing (first lines):
#   TPU: Error allocating device buffer: Attempting to allocate 4.39G. That was not possible. There are 2.30G free.;
#     (0x0x0_HBM0)
#   GPU: Out of memory while trying to allocate 4770354232 bytes.  /  ... to allocate 12.34GiB.
#   GPU: Failed to allocate request for 32.00MiB (33554432B) on device ordinal 0
_ATTEMPT = re.compile(r"Attempting to (?:allocate|reserve) ([\d.]+)([KMGT])i?B?\b.*?There are ([\d.]+)([KMGT])i?B? free")


def parse_xla_oom(message: str) -> XlaOom:
  """The memory space, sizes and buffer an XLA out-of-memory message names (its first line)."""
  line = message.strip().splitlines()[0] if message.strip() else ""
  if "VmemOom" in line:
    return XlaOom("vmem", 0, 0)
  allocation = _ALLOCATION.search(line)
  if allocation:
    where = _OPERAND_SPACE.search(line)
    space = next((g for g in where.groups() if g), "") if where else ""
    shape = _SHAPE.search(line)
    return XlaOom(space.lower(), int(allocation.group(1)), int(allocation.group(2)), shape.group(1) if shape else "")
  used = _USED.search(line)
  if used:
    return XlaOom(used.group(5).lower(), int(float(used.group(1)) * _UNIT[used.group(2)]),
                  int(float(used.group(3)) * _UNIT[used.group(4)]))
  exceeds = _EXCEEDS.search(line)
  if exceeds:
    return XlaOom(exceeds.group(3).lower(), int(float(exceeds.group(1)) * _UNIT[exceeds.group(2)]),
                  int(float(exceeds.group(4)) * _UNIT[exceeds.group(5)]))
  space = "hbm" if "hbm" in line.lower() else ""
  attempt = _ATTEMPT.search(line)
  if attempt:
    return XlaOom(space, int(float(attempt.group(1)) * _UNIT[attempt.group(2)]),
                  int(float(attempt.group(3)) * _UNIT[attempt.group(4)]), one_allocation=True)
  return XlaOom(space, oom_bytes_from_xla(line) or 0, 0, one_allocation="allocat" in line.lower())


# The TPU compiler's VMEM overflow names the kernel and its sizes only after its first line (libtpu 0.0.42.1):
#   E1001: CompileTimeScopedVmemOom:
#   Ran out of memory in memory space vmem while allocating on stack for
#   %splash_mha_dkv_segmented_no_residuals.1 = (...)
#   custom-call(...), ... kernel_metadata={"xprof_metadata":"{\"block_q_dkv\": 2048, ...}"} ...
#   Scoped allocation with size 36.09M and limit 32.00M exceeded scoped vmem limit by 4.09M. ...
_VMEM_KERNEL = re.compile(r"allocating on stack for %([\w.-]+) = ")
_VMEM_SIZES = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]) and limit ([\d.]+)([KMG])")
_KERNEL_BLOCK = re.compile(r'\\?"(block_\w+)\\?":\s*(\d+)')
_SPLASH_PASS = re.compile(r"^splash_m[hq]a_(fwd|dkv|dq)")
# The sa_block_* keys that size each splash pass (the forward kernel's metadata lists all eight).
_SPLASH_PASS_KEYS = {"fwd": ("forward", ("block_q", "block_kv", "block_kv_compute")),
                     "dkv": ("dK/dV backward", ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")),
                     "dq": ("dQ backward", ("block_q_dq", "block_kv_dq"))}
UPSTREAM_VMEM_LIMIT_KIB = 98304  # upstream MaxText's v6e dense recipes (xla_flags_library.DENSE_VMEM_LIMIT_FLAG)


def vmem_overflow_message(xla_message: str) -> str:
  """The one line for a Pallas kernel needing more vector memory (VMEM) than XLA's scoped limit: the kernel,
  its sa_block_* sizes when it is splash, need against limit, and the two ways out (a higher limit through
  libtpu_init_args, or smaller tiles). Upstream's v6e recipes raise the limit with that flag, so their splash
  tiles of 2048 overflow without it (getting_started/AOT.md)."""
  lines = xla_message.strip().splitlines()
  first = lines[0] if lines else ""
  named = _VMEM_KERNEL.search(xla_message)
  kernel = re.sub(r"\.\d+$", "", named.group(1)) if named else ""
  splash = _SPLASH_PASS.match(kernel)
  if splash:
    what, keys = _SPLASH_PASS_KEYS[splash.group(1)]
    blocks = dict(_KERNEL_BLOCK.findall(xla_message))
    sizes = ", ".join(f"sa_{k}={blocks[k]}" for k in keys if k in blocks)
    culprit = f"splash attention's {what} kernel {kernel}" + (f" ({sizes})" if sizes else "")
    smaller = "smaller " + "/".join(f"sa_{k}" for k in keys)
  elif kernel:
    culprit, smaller = f"the Pallas kernel {kernel}", "smaller tiles for that kernel"
  else:
    culprit, smaller = "a Pallas kernel", "smaller kernel tiles, e.g. attention=flash's sa_block_* sizes"
  amounts = _VMEM_SIZES.search(xla_message)
  limit_kib, why = UPSTREAM_VMEM_LIMIT_KIB, "what upstream's v6e recipes pass"
  if amounts:
    need, limit = float(amounts.group(1)) * _UNIT[amounts.group(2)], float(amounts.group(3)) * _UNIT[amounts.group(4)]
    over = (f" needs {need / 2**20:.2f} MiB of vector memory (VMEM), over XLA's scoped VMEM limit of "
            f"{limit / 2**20:.2f} MiB, not HBM")
    need_kib = math.ceil(need / 2**20) * 1024  # XLA rounds its figure: the next whole MiB
    if need_kib > limit_kib:  # more than upstream's value (already set, or a larger kernel)
      limit_kib, why = need_kib, "this kernel's need, if the chip's VMEM holds it"
    else:
      why += f"; this kernel needs at least {need_kib}"
    xla = f"{first} {amounts.group(0)}"
  else:
    over, xla = " overflows its vector memory (VMEM), not HBM", first
  return (f"does not fit: {culprit}{over}; raise the limit with libtpu_init_args="
          f"--xla_tpu_scoped_vmem_limit_kib={limit_kib} ({why}) or use {smaller} (XLA: {xla})")


@dataclasses.dataclass(frozen=True)
class Offload:
  """The run's settings that decide its host-memory use, for what the message suggests;
  `estimate`: the planner's count of its offloaded activations per chip (0 if not counted)."""

  remat_policy: str
  per_device_batch_size: float
  accumulation: int
  optimizer_offloaded: bool
  estimate: float = 0.0
  policy: remat_policies.RematPolicy | None = None  # the resolved record (remat_policy=custom's placements)


def host_overflow_message(needed: float, limits: str, offload: Offload, detail: str, one_buffer: str = "",
                          available: float = 0.0, unit: str = "chip") -> str:
  """The one line for host memory running out: what is there (offloaded activations from an
  *_offloaded remat policy, offloaded optimizer state), how much against how much (`limits`),
  and what would use less. With `one_buffer`, `needed` is that buffer alone (a lower bound).
  `unit`: what one device is (TpuGeneration.device_unit): the figures are a TensorCore's on tpu7x."""
  policy = offload.policy or remat_policies.BY_NAME.get(offload.remat_policy)
  what = f"the activations remat_policy={offload.remat_policy} offloads" if policy and policy.offloaded else \
      "what the step offloads"
  what += " and the optimizer state (optimizer_memory_host_offload)" if offload.optimizer_offloaded else ""
  what += " to the host's pinned memory"
  if one_buffer:
    need = f"{what}: its largest buffer {one_buffer} alone needs {needed / GIB:.1f} GiB per {unit}"
    if offload.estimate > needed:
      need += f" (all of them about {offload.estimate / GIB:.1f} GiB by the planner's count)"
  else:
    need = f"{what} need {needed / GIB:.1f} GiB per {unit}"
  # Activations scale with the sequences a chip holds at a time; offloaded optimizer state does not.
  total = max(needed, offload.estimate if one_buffer else 0.0)
  factor = total / available if available and not offload.optimizer_offloaded else 0.0
  at_least = "at least " if one_buffer and offload.estimate <= needed else ""
  options = []
  if policy and policy.name == "custom" and policy.offloaded:
    options.append(f"offload less (fewer of {', '.join(f'{n}=offload' for n in policy.offload)})")
  elif policy and policy.offloaded:
    lighter = [p.name for p in remat_policies.REMAT_POLICIES
               if p.offloaded and p.searched_by_planner and set(p.saved) < set(policy.saved)]
    options.append(f"offload less (remat_policy={' or '.join(lighter + ['full'])})")
  if offload.optimizer_offloaded:
    options.append("keep the optimizer state in HBM (optimizer_memory_host_offload=false)")
  if policy and policy.offloaded and factor > 1:
    options.append(f"fewer sequences per {unit} at a time ({at_least}{factor:.2g}x fewer: "
                   f"{_fewer_sequences(offload.per_device_batch_size, offload.accumulation, factor, unit)})")
  elif policy and policy.offloaded:
    options.append(f"fewer sequences per {unit} at a time (per_device_batch_size, gradient_accumulation_steps)")
  options.append(f"or the same global batch on {at_least}{factor:.2g}x the chips" if factor > 1 else
                 "or the same global batch on more chips")
  return f"does not fit: host memory, not HBM: {need}, {limits}; {', '.join(options)} ({detail})"


def _fewer_sequences(pdb: float, accumulation: int, factor: float, unit: str = "chip") -> str:
  """Settings that hold `factor` times fewer sequences per device (`unit`) at a time: a smaller batch or more
  microbatches while a device still holds whole sequences, else each sequence split over devices."""
  target = pdb / accumulation / factor  # sequences per chip at a time
  if target >= 1:
    ways = [f"per_device_batch_size={math.floor(target * accumulation)}"]
    whole = float(pdb).is_integer()
    steps = [k for k in range(math.ceil(accumulation * factor), int(pdb) + 1) if whole and pdb % k == 0]
    ways += [f"gradient_accumulation_steps={steps[0]}"] if steps else []
    return " or ".join(ways)
  split = 2 ** math.ceil(math.log2(1 / target))  # devices sharing each sequence
  return (f"under one sequence per {unit}, so per_device_batch_size={accumulation / split:g} with each sequence split "
          f"over {split} {unit}s (ici_tensor_parallelism={split} or ici_sequence_parallelism={split})")


def offload_of(config: config_lib.Config) -> Offload:
  """What decides the run's host-memory use, with the planner's count of its offloaded activations."""
  pdb, accumulation = config.data.per_device_batch_size, config.optim.gradient_accumulation_steps
  policy = config.model.remat
  tokens = pdb / accumulation * config.data.max_target_length
  return Offload(policy.name, pdb, accumulation, config.optim.optimizer_memory_host_offload,
                 offloaded_activations(config.model, policy, tokens, dict(config.mesh.shape)), policy)


def host_memory_message(needed: float, gen: accelerators.TpuGeneration | None, offload: Offload | None, detail: str,
                        one_buffer: str = "", xla_limit: float = 0.0) -> str:
  """Host memory ran out: against what XLA allows offloaded buffers (`xla_limit`, from its message)
  and what the generation's host VM has per device, whichever is less: XLA's figures and host_gib are a JAX
  device's, a TensorCore's on tpu7x."""
  unit = gen.device_unit if gen is not None else "chip"
  limits = [f"XLA allows {xla_limit / GIB:g} GiB of offloaded buffers per {unit}"] if xla_limit else []
  host_gib = gen.host_gib if gen is not None else None
  if gen is not None and host_gib is not None:
    limits.append(f"a {gen.name} host has {host_gib:.1f} GiB per {gen.device_unit}")
  caps = ([xla_limit] if xla_limit else []) + ([host_gib * GIB] if host_gib is not None else [])
  return host_overflow_message(needed, " and ".join(limits) or "more than there is",
                               offload or Offload("", 0, 1, False), detail, one_buffer, min(caps, default=0.0), unit)


def off_heap_message(message: str, oom: XlaOom, gen: accelerators.TpuGeneration | None,
                     offload: Offload | None) -> str | None:
  """The one line for XLA's out-of-memory error (`message`, read as `oom`) when what ran out is not the
  device heap: a Pallas kernel's scalar (SMEM) or vector (VMEM) memory, or the host's pinned memory
  (offloaded activations; `offload`: the run's settings, for what to change); None for device memory."""
  first_line = message.strip().splitlines()[0] if message.strip() else ""
  if oom.space == "smem":  # a kernel's scalar memory, not HBM: splash's block-mask metadata
    return ("does not fit: a Pallas kernel's scalar memory (SMEM) overflows, not HBM; with attention=flash the "
            "splash mask metadata grows with (sequence / sa_block)^2: raise the sa_block_* sizes or split the "
            f"sequence more (context_parallel_strategy=ring) (XLA: {first_line})")
  if oom.space == "vmem":  # a kernel's tiles, not HBM; the kernel and its sizes are past the first line
    return vmem_overflow_message(message)
  if oom.space == "host":  # offloaded activations in the host's pinned memory
    return host_memory_message(oom.needed, gen, offload, f"XLA: {first_line}", oom.buffer, oom.available)
  return None


def oom_sizes(oom: XlaOom, unit: str, device_bytes: int = 0) -> str:
  """What XLA's out-of-memory message says was needed against what there was, per device (`unit`: what one
  is); `device_bytes`: the device's memory, said where the message names none (0: not known)."""
  holds = f", a {unit} holds {format_bytes(device_bytes)}" if device_bytes else ""
  if oom.one_allocation and oom.needed:
    free = f" with {format_bytes(oom.available)} free" if oom.available else holds
    return f"allocating {format_bytes(oom.needed)} more per {unit} failed{free}"
  if oom.needed and oom.available:
    return f"needs {format_bytes(oom.needed)} per {unit}, {format_bytes(oom.available)} available"
  if oom.needed:
    return f"needs {format_bytes(oom.needed)} per {unit}{holds}"
  return f"XLA names no sizes{holds}"
