"""Compiled HLO text as data: computations (in their scheduled order), instructions with their
opcode, result shape, operands, callees and the attributes the step-time model reads
(replica groups, channel, the compiler's cycle estimate, the source op in the metadata)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from MaxText.errors import UserError

_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = ")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16,
               "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64, "token": 0}
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
HOST_MEMORY_SPACE = 5  # XLA's memory space of host-offloaded buffers: S(5) in a layout

COLLECTIVE_OPCODES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                      "collective-permute")


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  memory_space: int

  @property
  def bytes(self) -> int:
    return math.prod(self.dims) * _DTYPE_BITS.get(self.dtype, 8) // 8  # fp8 kinds are one byte


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result's shape text (a tuple for multi-output ops)
  opcode: str
  operands: tuple[str, ...]
  attrs: str  # everything after the operand list
  is_root: bool = False
  args: str = ""  # the operand list's text (a constant's literal)
  text: str = dataclasses.field(default="", repr=False)  # the whole line

  @functools.cached_property
  def arrays(self) -> tuple[Array, ...]:
    return parse_arrays(self.shape)

  @property
  def result_bytes(self) -> int:
    return sum(a.bytes for a in self.arrays)

  @property
  def cycles(self) -> int | None:
    found = _CYCLES.findall(self.attrs)
    return sum(int(c) for c in found) if found else None

  def attr(self, key: str) -> str | None:
    match = re.search(rf"\b{re.escape(key)}=(%?[\w.\-]+|\"[^\"]*\")", self.attrs)
    return match.group(1).lstrip("%").strip('"') if match else None

  @property
  def callees(self) -> list[str]:
    names = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", self.attrs)
    listed = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
    if listed:
      names += [n.strip().lstrip("%") for n in listed.group(1).split(",")]
    names += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", self.attrs)
    return names

  @property
  def source(self) -> str:
    """The JAX op this came from: the metadata's op_name, without the jit(...) prefix."""
    match = re.search(r'op_name="([^"]*)"', self.attrs)
    return match.group(1).removeprefix("jit(train_step)/") if match else ""

  @property
  def custom_call_target(self) -> str:
    return self.attr("custom_call_target") or ""


def parse_arrays(shape_text: str) -> tuple[Array, ...]:
  arrays = []
  for dtype, dims, layout in _ARRAY.findall(shape_text):
    space = re.search(r"S\((\d+)\)", layout or "")
    arrays.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
  return tuple(arrays)


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def parse_instruction(line: str) -> Instruction | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  rest = line[match.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren]
  end = _balanced(rest, paren)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:end]))
  return Instruction(match.group(2), shape, opcode, operands, rest[end:], bool(match.group(1)), rest[paren + 1:end - 1],
                     line)


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str

  @functools.cached_property
  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for body in self.computations.values() for i in body}

  def collectives_inside(self, computation: str) -> list[Instruction]:
    """Collective instructions in a called computation and what it calls in turn."""
    found, seen, todo = [], set(), [computation]
    while todo:
      name = todo.pop()
      if name in seen:
        continue
      seen.add(name)
      for inst in self.computations.get(name, []):
        if base_opcode(inst.opcode) in COLLECTIVE_OPCODES:
          found.append(inst)
        todo.extend(inst.callees)
    return found

  def root(self, computation: str) -> Instruction | None:
    body = self.computations.get(computation, [])
    return next((i for i in body if i.is_root), body[-1] if body else None)


def trip_count(module: Module, loop: Instruction) -> int:
  """A while loop's trips: XLA's known trip count, else the counter's limit in the condition, its
  step in the body (an unrolled loop counts by 2 or more) and its start in the loop's initial tuple."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
  if known:
    return int(known.group(1))
  by_name = module.by_name
  condition = loop.attr("condition") or ""
  root = module.root(condition)
  counter, bound = (by_name.get(o) for o in root.operands) if root is not None and len(root.operands) == 2 else \
      (None, None)
  if root is None or root.opcode != "compare" or counter is None or bound is None or \
      counter.opcode != "get-tuple-element" or not bound.args.isdigit():
    # No counter to follow: the largest constant the condition compares with.
    constants = [int(i.args) for i in module.computations.get(condition, []) if i.opcode == "constant" and i.args.isdigit()]
    return max(constants, default=1)
  index, limit = int(counter.attr("index") or 0), int(bound.args)
  start = 0
  initial = by_name.get(loop.operands[0]) if loop.operands else None
  if initial is not None and initial.opcode == "tuple" and index < len(initial.operands):
    first = by_name.get(initial.operands[index])
    start = int(first.args) if first is not None and first.opcode == "constant" and first.args.isdigit() else 0
  return max(1, -(-(limit - start) // _counter_step(module, loop.attr("body") or "", index)))


def _counter_step(module: Module, body: str, index: int) -> int:
  root = module.root(body)
  if root is None or root.opcode != "tuple" or index >= len(root.operands):
    return 1
  update = module.by_name.get(root.operands[index])
  if update is None or update.opcode != "add":
    return 1
  for operand in update.operands:
    found = module.by_name.get(operand)
    if found is not None and found.opcode == "constant" and found.args.isdigit():
      return max(1, int(found.args))
  return 1


def base_opcode(opcode: str) -> str:
  return opcode.removesuffix("-start").removesuffix("-done")


def parse_module(hlo_text: str) -> Module:
  computations: dict[str, list[Instruction]] = {}
  current, entry = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(2)
      computations[current] = []
      entry = current if match.group(1) else entry
    elif line == "}":
      current = None
    elif current is not None:
      inst = parse_instruction(line)
      if inst is not None:
        computations[current].append(inst)
  if entry is None:
    raise UserError("no ENTRY computation in the HLO text: pass the text of a compiled module (compiled.as_text())")
  return Module(computations, entry)


def replica_groups(inst: Instruction, num_devices: int) -> list[list[int]]:
  """The device groups of a collective: explicit `{{0,1},{2,3}}`, iota `[4,2]<=[8]` or
  `[2,4]<=[4,2]T(1,0)`, or source-target pairs for a permute; one group of all devices when
  none is given."""
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", inst.attrs)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                   r"(?: \{([^}]*)\})?", inst.attrs)
  if mesh:
    return mesh_groups(mesh.group(1), mesh.group(2), mesh.group(3), mesh.group(4))
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", inst.attrs)
  if iota:
    return iota_groups([int(d) for d in iota.group(1).split(",")], [int(d) for d in iota.group(2).split(",")],
                       [int(d) for d in iota.group(3).split(",")] if iota.group(3) else None)
  explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", inst.attrs)
  if explicit and explicit.group(1):
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
  return [list(range(num_devices))]


def mesh_groups(axes_text: str, reshape: str | None, transpose: str | None, listed: str | None) -> list[list[int]]:
  """XLA's mesh-axes form: `mesh['axis_0'=16,'axis_1'=16], device_ids=([16,16]T(1,0)) {'axis_0'}` is
  the devices (iota, or iota reshaped and transposed) laid out on the named axes; each group
  varies the listed axes and fixes the others (no list: one group of every device)."""
  axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", axes_text)]
  sizes = [size for _, size in axes]
  total = math.prod(sizes)
  devices = list(range(total))
  if reshape:
    dims = [int(d) for d in reshape.split(",")]
    devices = iota_groups([total], dims, [int(d) for d in transpose.split(",")] if transpose else None)[0]
  if listed is None:
    return [devices]
  varying = {name.strip().strip("'") for name in listed.split(",") if name.strip()}
  strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
  groups: dict[tuple[int, ...], list[int]] = {}
  for flat, device in enumerate(devices):
    index = [(flat // strides[k]) % sizes[k] for k in range(len(sizes))]
    fixed = tuple(index[k] for k, (name, _) in enumerate(axes) if name not in varying)
    groups.setdefault(fixed, []).append(device)
  return list(groups.values())


def iota_groups(group_shape: list[int], reshape: list[int], transpose: list[int] | None) -> list[list[int]]:
  """iota(prod(reshape)) reshaped to `reshape`, transposed by `transpose`, reshaped to `group_shape`
  (groups x group size): XLA's compact replica-group form."""
  ids = list(range(math.prod(reshape)))
  if transpose:
    strides = [math.prod(reshape[i + 1:]) for i in range(len(reshape))]
    new_dims = [reshape[p] for p in transpose]
    ids = []
    for flat in range(math.prod(new_dims)):
      index, rem = [], flat
      for size in reversed(new_dims):
        index.append(rem % size)
        rem //= size
      index.reverse()
      ids.append(sum(index[k] * strides[transpose[k]] for k in range(len(transpose))))
  size = group_shape[-1]
  return [ids[i:i + size] for i in range(0, len(ids), size)]


def matmul_flops(inst: Instruction, by_name: dict[str, Instruction]) -> float:
  """FLOPs of a dot or convolution (the TPU compiler writes batched matmuls as convolutions with
  a batch dimension in a padded or dilated spatial window; a window tap past the input, or into
  the holes of a dilated one, is not work)."""
  out = math.prod(inst.arrays[0].dims) if inst.arrays else 0
  operands = [by_name.get(o) for o in inst.operands[:2]]
  if not out or any(o is None or not o.arrays for o in operands):
    return 0.0
  lhs, rhs = (o.arrays[0].dims for o in operands if o is not None)
  if inst.opcode == "dot":
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * out * math.prod(lhs[d] for d in dims)
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
  if not labels:
    return 0.0
  lhs_labels, rhs_labels = labels.group(1), labels.group(2)
  dilation = re.search(r"lhs_dilate=([\dx]+)", inst.attrs)
  lhs_dilate = [int(d) for d in dilation.group(1).split("x")] if dilation else []
  macs = 1
  for position, label in enumerate(rhs_labels):
    if label == "i":
      macs *= rhs[position]
    elif label.isdigit():
      # Of a window's taps, those on the input's elements: not past its ends (padding) nor between
      # them (lhs dilation's holes, how the compiler lays a batch dimension along a window).
      size, stride = lhs[lhs_labels.index(label)], lhs_dilate[int(label)] if int(label) < len(lhs_dilate) else 1
      macs *= max(1, min(size, math.ceil(min(rhs[position], (size - 1) * stride + 1) / stride)))
  return 2.0 * out * macs


def fusion_flops(module: Module, computation: str) -> float:
  """Matmul FLOPs of a fused computation and the fusions nested in it."""
  total = 0.0
  for inst in module.computations.get(computation, []):
    if inst.opcode in ("dot", "convolution"):
      total += matmul_flops(inst, module.by_name)
    elif inst.opcode == "fusion":
      total += fusion_flops(module, inst.attr("calls") or "")
  return total
