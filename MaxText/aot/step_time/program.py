"""The train step's schedule as the step-time model sees it: the compiled HLO's sequential
computations walked in their scheduled order, each instruction turned into one `Op` (compute on
the TensorCore, the start or the end of asynchronous work on a link, or a synchronous
collective), loops kept as loops. Built once per compiled step; `simulate` prices it for any
calibration.

Two readings of the overlap (`OVERLAPS`): `scheduled` waits for asynchronous work where the
compiled schedule puts its done; `dataflow` waits only where the result is first read (through
tuple plumbing and on-chip copies), inside the same computation: what a latency-hiding scheduler
may make of the same program when it lets independent compute run between start and use. A
compile's schedule can leave a start and its done adjacent though nothing between them and the
first read needs the result (AOT.md has the case: tensor-parallel windowed matmuls)."""

from __future__ import annotations

import dataclasses
import math
import re

from MaxText.aot.step_time import hlo
from MaxText.aot.step_time.network import (NETWORKS, Network, Transfer, collective_transfer, dcn_all_reduce,
                                           host_transfer, mesh_axes_of)
from MaxText.aot.step_time.saved import StepTarget
from MaxText.errors import UserError
from MaxText.platform import accelerators

_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency",
         "slice-start"}  # an on-chip DMA into vector memory, beside the TensorCore
_HOST_ASYNC = ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start")
OVERLAPS = ("scheduled", "dataflow")
# Instructions that hand a value on without reading it on the TensorCore: a done's result passing
# through them is not yet needed.
_PLUMBING = {"get-tuple-element", "bitcast", "tuple", "copy-start", "copy-done"}


@dataclasses.dataclass
class Op:
  """kind: compute (seconds on the TensorCore), start / done (asynchronous work `key` on a link),
  sync (a collective the TensorCore waits for), loop (`body` run `trips` times)."""

  kind: str
  name: str
  source: str = ""
  seconds: float = 0.0
  work: Transfer | None = None
  key: str = ""
  category: str = ""  # matmul, other compute, kernel, or a link's work: "ici:all-gather", "dcn:all-reduce", "host:offload"
  body: list["Op"] = dataclasses.field(default_factory=list)
  trips: int = 1
  flops: float = 0.0  # matmul FLOPs of a compute op
  roofline_s: float = 0.0  # its FLOPs at peak or its HBM bytes at full bandwidth, whichever is longer
  cycles_s: float = 0.0  # a matmul's time by the compiler's cost model (Calibration.matmul_cost="compiler")


def network_for(generation: str) -> Network:
  if generation not in NETWORKS:
    raise UserError(f"the step-time model has no network figures for TPU {generation} (it has "
                    f"{', '.join(NETWORKS)}); add them to MaxText/aot/step_time/network.py with their source")
  return NETWORKS[generation]


def _is_done(module: hlo.Module, inst: hlo.Instruction) -> bool:
  if inst.opcode == "copy-done":  # a host transfer's; an on-chip copy costs nothing here
    return not _on_chip_copy(module, inst)
  if not (inst.opcode.endswith("-done") or inst.opcode == "fusion"):
    return False
  if inst.opcode == "fusion":
    root = module.root(inst.attr("calls") or "")
    return root is not None and root.custom_call_target == "AsyncCollectiveDone"
  return True


def _on_chip_copy(module: hlo.Module, inst: hlo.Instruction) -> bool:
  start = module.by_name.get(inst.operands[0]) if inst.opcode == "copy-done" and inst.operands else inst
  return start is not None and not any(a.memory_space == hlo.HOST_MEMORY_SPACE for a in start.arrays)


def dataflow_order(module: hlo.Module, insts: list[hlo.Instruction]) -> list[hlo.Instruction]:
  """`insts` with each asynchronous done moved down to just before the first instruction that reads
  its result (following tuple plumbing and on-chip copies), or to the end of the computation when
  only its root (a loop's carried state) takes it."""
  users: dict[str, list[int]] = {}
  for k, inst in enumerate(insts):
    for operand in inst.operands:
      users.setdefault(operand, []).append(k)
  end = len(insts)

  def first_read(name: str, after: int) -> int:
    first, seen, todo = end, set(), [name]
    while todo:
      for k in users.get(todo.pop(), []):
        if k <= after or k in seen:
          continue
        seen.add(k)
        user = insts[k]
        plumbing = user.opcode in _PLUMBING and not user.is_root and (
            user.opcode not in ("copy-start", "copy-done") or _on_chip_copy(module, user))
        if plumbing:
          todo.append(user.name)
        else:
          first = min(first, k)
    return first

  before: dict[int, list[hlo.Instruction]] = {}
  kept: list[tuple[int, hlo.Instruction]] = []
  for k, inst in enumerate(insts):
    if _is_done(module, inst):
      before.setdefault(first_read(inst.name, k), []).append(inst)
    else:
      kept.append((k, inst))
  ordered: list[hlo.Instruction] = []
  for k, inst in kept:
    ordered.extend(before.pop(k, []))
    ordered.append(inst)
  for k in sorted(before):  # read by nothing after them but the root, or the root itself is a done
    ordered.extend(before[k])
  return ordered


class _Builder:
  def __init__(self, module: hlo.Module, target: StepTarget, overlap: str = "scheduled"):
    if overlap not in OVERLAPS:
      raise UserError(f"step-time overlap {overlap!r} is not one of {', '.join(OVERLAPS)}")
    self.module = module
    self.overlap = overlap
    self.target = target
    self.net = network_for(target.generation)
    gen = accelerators.TPU_GENERATIONS[target.generation]
    self.clock_hz = gen.clock_ghz * 1e9
    self.peak = gen.peak_tflops * 1e12
    self.num_devices = len(target.coords)

  def computation(self, name: str) -> list[Op]:
    ops: list[Op] = []
    insts = self.module.computations.get(name, [])
    if self.overlap == "dataflow":
      insts = dataflow_order(self.module, insts)
    for inst in insts:
      ops.extend(self.instruction(inst))
    return ops

  def instruction(self, inst: hlo.Instruction) -> list[Op]:
    opcode = inst.opcode
    if opcode in _FREE:
      return []
    if opcode == "while":
      body = inst.attr("body")
      trips = hlo.trip_count(self.module, inst)
      return [Op("loop", inst.name, body=self.computation(body or ""), trips=trips)]
    if opcode == "call":
      return [op for callee in inst.callees for op in self.computation(callee)]
    if opcode == "conditional":  # one branch runs; the costliest is an upper bound
      branches = [self.computation(b) for b in inst.callees]
      return max(branches, key=_static_seconds, default=[])
    if opcode.endswith("-done") or opcode in ("send-done", "recv-done"):
      return [Op("done", inst.name, key=inst.operands[0] if inst.operands else inst.name)]
    if opcode in ("send", "recv"):
      return self._megascale(inst)
    if opcode in _HOST_ASYNC:
      return self._host_start(inst)
    if opcode == "async-start" or (opcode.endswith("-start") and hlo.base_opcode(opcode) in hlo.COLLECTIVE_OPCODES):
      collective = inst if opcode != "async-start" else self._inner_collective(inst)
      if collective is None:
        return [Op("start", inst.name, key=inst.name, work=Transfer("ici", 0.0))]
      return [self._collective(collective, "start", inst.name, inst.source)]
    if hlo.base_opcode(opcode) in hlo.COLLECTIVE_OPCODES:
      return [self._collective(inst, "sync", inst.name, inst.source)]
    if opcode == "fusion":
      return self._fusion(inst)
    if opcode == "custom-call" and inst.custom_call_target == "tpu_custom_call" and inst.cycles is None:
      return [self._kernel(inst)]
    return [self._compute(inst)]

  def _compute(self, inst: hlo.Instruction) -> Op:
    cycles = inst.cycles
    flops = hlo.fusion_flops(self.module, inst.attr("calls") or "") if inst.opcode == "fusion" else \
        hlo.matmul_flops(inst, self.module.by_name) if inst.opcode in ("dot", "convolution") else 0.0
    hbm_bytes = sum(a.bytes for a in inst.arrays if a.memory_space == 0) + sum(
        a.bytes for o in inst.operands if o in self.module.by_name
        for a in self.module.by_name[o].arrays[:1] if a.memory_space == 0)
    roofline = max(flops / self.peak, hbm_bytes / self.net.hbm_per_device)
    seconds = cycles / self.clock_hz if cycles is not None else roofline
    if flops > 0:  # a matmul: its FLOPs at the MXUs' achieved share of peak (the calibration's)
      return Op("compute", inst.name, inst.source, work=Transfer("mxu", flops / self.peak), category="matmul",
                flops=flops, roofline_s=roofline, cycles_s=seconds)
    return Op("compute", inst.name, inst.source, seconds=seconds, category="other compute", roofline_s=roofline)

  def _fusion(self, inst: hlo.Instruction) -> list[Op]:
    callee = inst.attr("calls") or ""
    root = self.module.root(callee)
    target = root.custom_call_target if root is not None else ""
    collectives = self.module.collectives_inside(callee)
    if target in ("AsyncCollectiveStart", "AsyncCollectiveDone") and collectives:
      key = f"channel:{collectives[0].attr('channel_id')}"
      if target == "AsyncCollectiveDone":
        return [Op("done", inst.name, key=key)]
      return [self._collective(collectives[0], "start", key, collectives[0].source or inst.source)]
    compute = self._compute(inst)
    continuing = any("async_collective_fusion_config" in c.attrs or "chain_id" in c.attrs for c in collectives)
    if collectives and not continuing:  # a collective the TensorCore runs in line
      # An all-reduce fused with the slice each device keeps is a reduce-scatter on the links.
      scatter = callee.startswith("all-reduce-scatter") or "AllReduceScatterFusion" in inst.attrs
      return [self._collective(c, "sync", inst.name, c.source or inst.source, as_kind="reduce-scatter-full" if scatter else "")
              for c in collectives] + [compute]
    return [compute]

  def _collective(self, inst: hlo.Instruction, kind: str, key: str, source: str, as_kind: str = "") -> Op:
    opcode = as_kind or hlo.base_opcode(inst.opcode)
    arrays = [a.bytes for a in inst.arrays]
    if opcode == "ragged-all-to-all":
      # One of its buffers is sized for the worst case (every peer's rows landing on one device): the result
      # where it dispatches, the operand where it combines. The rows that cross the links fit the smaller one.
      size = min(self._operand_bytes(inst) or max(arrays, default=0), max(arrays, default=0))
    elif inst.opcode.endswith("-start") or opcode in ("all-gather", "collective-permute"):
      size = max(arrays, default=0)  # a start's tuple holds the operand and the result
    else:
      size = sum(arrays)
    groups = hlo.replica_groups(inst, self.num_devices)
    if opcode == "collective-permute":  # the mesh axes a pair's source and target differ in
      varying = {a for pair in groups[:16] for a in mesh_axes_of(pair, self.target.mesh).split("+")}
      axis = "+".join(a for a in self.target.mesh if a in varying) or "none"
      work = collective_transfer(opcode, size, groups[0], self.target, self.net, axis)
    else:
      work = collective_transfer(opcode, size, groups[0], self.target, self.net)
    return Op(kind, inst.name, source, work=work, key=key,
              category=f"{work.resource}:{opcode.removesuffix('-full')}")

  def _operand_bytes(self, inst: hlo.Instruction) -> int:
    """The bytes of an instruction's first operand (0 where it is not in the module)."""
    operand = self.module.by_name.get(inst.operands[0]) if inst.operands else None
    return operand.arrays[0].bytes if operand is not None and operand.arrays else 0

  def _inner_collective(self, inst: hlo.Instruction) -> hlo.Instruction | None:
    inner = [c for callee in inst.callees for c in self.module.collectives_inside(callee)]
    return inner[0] if inner else None

  def _megascale(self, inst: hlo.Instruction) -> list[Op]:
    """XLA's cross-slice collectives are host transfers to the megascale runtime: one send and
    one recv per exchange; the recv carries the exchange's cost."""
    size = max((a.bytes for a in inst.arrays), default=0)
    transfer_type = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.attrs)
    if inst.opcode == "send" or transfer_type is None:
      return [Op("start", inst.name, key=inst.name, work=Transfer("dcn", 0.0))]
    work = dcn_all_reduce(size, self.target.num_slices, self.net)
    kind = transfer_type.group(1).lower().replace("_", "-")
    return [Op("start", inst.name, inst.source, work=work, key=inst.name, category=f"dcn:{kind}")]

  def _host_start(self, inst: hlo.Instruction) -> list[Op]:
    arrays = inst.arrays
    if not any(a.memory_space == hlo.HOST_MEMORY_SPACE for a in arrays):  # an on-chip prefetch: no link
      return []
    moved = max((a.bytes for a in arrays if a.memory_space != hlo.HOST_MEMORY_SPACE and a.dims), default=0)
    return [Op("start", inst.name, inst.source, work=host_transfer(moved, self.net), key=inst.name,
               category="host:offload")]

  def _kernel(self, inst: hlo.Instruction) -> Op:
    """A Pallas kernel priced from its shapes: splash attention's matmuls (4-D q and k operands,
    causal) at the chip's peak, the kernel efficiency applied in `simulate`; megablox's grouped
    matmuls from their FLOPs; any other kernel reads and writes its operands once at HBM speed.
    Splash's matmuls per query-key pair (splash_matmuls): forward 2, dq 3, dkv 4, the fused
    backward 5."""
    shapes = [self.module.by_name[o].arrays[0] for o in inst.operands
              if o in self.module.by_name and self.module.by_name[o].arrays]
    # q and k: [batch, heads, length, head dim], or without the batch where a chip holds one sequence
    # (its block masks are integer arrays, never these).
    qk = [a for a in shapes if len(a.dims) in (3, 4) and a.dtype in ("bf16", "f16", "f32")]
    heads_length_dim = [a.dims[-3:] + (math.prod(a.dims[:-3]),) for a in qk]
    name = inst.name.lower()
    if len(heads_length_dim) >= 2 and ("mha" in name or "attention" in name or "splash" in name or "flash" in name):
      (heads, q_length, head_dim, batch), k_length = heads_length_dim[0], heads_length_dim[1][1]
      matmuls = splash_matmuls(name, qk[0], inst.arrays)
      flops = matmuls * 2 * batch * heads * q_length * k_length * head_dim * 0.5
      return Op("compute", inst.name, inst.source, work=Transfer("kernel", flops / self.peak), category="kernel")
    grouped = _grouped_matmul_flops(name, shapes, inst.arrays)
    if grouped:  # megablox: a grouped GEMM, at the MXUs' share of peak as XLA's own matmuls
      return Op("compute", inst.name, inst.source, work=Transfer("mxu", grouped / self.peak), category="kernel",
                flops=grouped)
    moved = sum(a.bytes for a in shapes) + inst.result_bytes
    return Op("compute", inst.name, inst.source, seconds=moved / self.net.hbm_per_device, category="kernel")


def splash_matmuls(name: str, q: hlo.Array, result: tuple[hlo.Array, ...]) -> int:
  """Matmuls a splash kernel runs per block of query-key pairs. Forward: QK^T and PV. The dQ
  kernel re-runs QK^T and dO·V^T for the probabilities and their gradient, then dS·K. The dK/dV
  kernel re-runs QK^T, then P^T·dO, dO·V^T and dS^T·Q. The fused backward (sa_use_fused_bwd_kernel)
  is the dK/dV kernel with dS·K added: 5 where the two kernels run 7. It is told apart by its
  extra result, dQ's partial sums over the key blocks: q's shape with one more leading dimension."""
  if "dkv" not in name:
    return 3 if "dq" in name else 2
  fused = any(len(a.dims) == len(q.dims) + 1 and a.dims[-3:] == q.dims[-3:] for a in result)
  return 5 if fused else 4


def _grouped_matmul_flops(name: str, operands: list[hlo.Array], result: tuple[hlo.Array, ...]) -> float:
  """FLOPs of a megablox kernel: `gmm` multiplies each of M rows [M, K] by its group's [K, N] of a
  [G, K, N] weight; `tgmm` (the weight's gradient) sums rows [M, K] x [M, N] into [G, K, N]. Either
  way 2·M·K·N, M the routed rows the kernel was compiled for."""
  arrays = [a for a in operands if len(a.dims) >= 2]
  if not result or not arrays:
    return 0.0
  out = result[0].dims
  if name.startswith("tgmm") and len(out) == 3:
    rows = [a for a in arrays if len(a.dims) == 2 and a.dims[1] == out[1]]
    return 2.0 * rows[0].dims[0] * out[1] * out[2] if rows else 0.0
  if name.startswith("gmm") and len(out) == 2:
    weights = [a for a in arrays if len(a.dims) == 3 and a.dims[2] == out[1]]
    return 2.0 * out[0] * weights[0].dims[1] * out[1] if weights else 0.0
  return 0.0


def _static_seconds(ops: list[Op]) -> float:
  """Compute and link time at the published figures, overlap aside: a conditional's branches compared."""
  return sum((op.trips * _static_seconds(op.body) if op.kind == "loop" else op.seconds + (op.work.base_s if op.work else 0.0))
             for op in ops)


def build_program(hlo_text: str, target: StepTarget, overlap: str = "scheduled") -> list[Op]:
  module = hlo.parse_module(hlo_text)
  return _Builder(module, target, overlap).computation(module.entry)
