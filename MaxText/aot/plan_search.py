"""The planner's search (MaxText/plan.py): the candidates of a topology (mesh degrees within and
across slices, pipeline schedules, remat policy, optimizer offload, batch, gradient accumulation)
that respect the user's fixed keys, their short labels, and the lower bound on memory that says,
before anything is ranked, whether any candidate can fit and where the model would.

Each candidate is priced by the analytical model (plan_model.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Mapping, Sequence

from MaxText.aot import plan_model, plan_remat
from MaxText.aot.plan_model import GIB, Estimate, ModelShape, estimate, mesh_of
from MaxText.configuration import batch_split, remat_policies
from MaxText.configuration.model_config import ModelConfig
from MaxText.platform import accelerators, sharding
from MaxText.platform.mesh_axes import MESH_AXES, MeshAxis

SEARCHED_POLICIES = tuple(p.name for p in remat_policies.REMAT_POLICIES if p.searched_by_planner)
# A searched remat_policy=custom placement stands in the remat_policy choices as "custom:<its name>".
SEARCHED_REMAT = SEARCHED_POLICIES + tuple(f"custom:{name}" for name in remat_policies.SEARCHED_PLACEMENTS)
# Keys a candidate sets; a key the user gives is held fixed instead.
PIPELINE_KEYS = ("pipeline_schedule", "num_pipeline_repeats", "num_pipeline_microbatches")
# Pipeline stages within a slice: a few, as ICI is fast enough that they rarely beat FSDP there.
MAX_ICI_STAGES = 4
# The mesh axes whose degrees the planner sets, within a slice and across slices (the others stay 1).
ICI_AXES = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.FSDP_TRANSPOSE, MeshAxis.SEQUENCE, MeshAxis.TENSOR,
            MeshAxis.EXPERT, MeshAxis.STAGE)
DCN_AXES = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.STAGE, MeshAxis.EXPERT)
# per_device_batch_size choices without a global batch: sequences per chip, and fewer sequences than
# chips down to the smallest fraction upstream recipes run (a smaller one grows the search for layouts
# that rarely pay), each tried only where the chips hold a whole global batch.
WHOLE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
FRACTIONAL_BATCHES = (0.125, 0.25, 0.5)


def pipeline_variants(stages: int, layers: int) -> list[dict[str, Any]]:
  """The schedules searched for `stages` stages: GPipe and 1F1B at 1x, 2x and 4x the stages in
  microbatches, and circular / interleaved 1F1B with 2 repeats where the layers divide."""
  variants: list[dict[str, Any]] = []
  for micro in (stages, 2 * stages, 4 * stages):
    variants.append({"pipeline_schedule": "gpipe", "num_pipeline_repeats": 1, "num_pipeline_microbatches": micro})
    variants.append({"pipeline_schedule": "1f1b", "num_pipeline_repeats": 1, "num_pipeline_microbatches": micro})
    if layers % (stages * 2) == 0:
      variants.append({"pipeline_schedule": "circular", "num_pipeline_repeats": 2, "num_pipeline_microbatches": micro})
      variants.append({"pipeline_schedule": "1f1b", "num_pipeline_repeats": 2, "num_pipeline_microbatches": micro})
  return variants


def can_pipeline(cfg: ModelConfig) -> bool:
  """What config validation allows: a scanned stack without a second (dense) stack or MTP modules."""
  return cfg.scan_layers and cfg.num_dense_layers == 0 and cfg.mtp.mtp_num_layers == 0


def powers_of_two(limit: int) -> list[int]:
  return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def candidates(model: ModelShape, topology: accelerators.TpuTopology, num_slices: int, fixed: Mapping[str, Any],
               global_batch: int | None, seq_len: int, data_sharding: Sequence[str] = MESH_AXES,
               whole_batches: bool = True, *, rules: sharding.Rules) -> Iterator[dict[str, Any]]:
  """Every candidate in the search space that respects the user's `fixed` keys: degrees per
  mesh axis within a slice and across slices (pipeline stages with their schedules and
  microbatch counts among them), remat policy, optimizer offload, batch and gradient
  accumulation. Degrees are powers of two whose product is the device count. A batch smaller than
  the data_sharding devices splits over the axes the logical axis `rules` split rows over (as config
  validation has it). Without `whole_batches`, batches that do not split into whole rows are kept
  (for a lower bound)."""
  cfg = model.cfg
  per_slice = topology.devices  # mesh degrees count JAX devices (two per tpu7x chip)
  layers = cfg.num_decoder_layers
  pipelined = can_pipeline(cfg)
  stage_choices = [p for p in powers_of_two(min(per_slice, MAX_ICI_STAGES)) if layers % p == 0] if pipelined else [1]
  tensor_limit = min(per_slice, max(1, cfg.num_query_heads))
  choices: dict[str, list[Any]] = {
      MeshAxis.TENSOR.ici_key: [t for t in powers_of_two(tensor_limit) if t <= 16],
      MeshAxis.SEQUENCE.ici_key: [s for s in powers_of_two(per_slice) if s <= 8],
      MeshAxis.FSDP_TRANSPOSE.ici_key: [1, 2],
      MeshAxis.EXPERT.ici_key: [e for e in powers_of_two(per_slice) if e <= max(1, cfg.moe.num_experts)],
      MeshAxis.DATA.ici_key: powers_of_two(per_slice),
      MeshAxis.STAGE.ici_key: stage_choices,
      "remat_policy": list(SEARCHED_REMAT),
      "optimizer_memory_host_offload": [False, True],
      "gradient_accumulation_steps": [1, 2, 4],
  }
  if num_slices > 1:
    choices[MeshAxis.DATA.dcn_key] = [d for d in powers_of_two(num_slices) if num_slices % d == 0]
    choices[MeshAxis.FSDP.dcn_key] = [1, num_slices]
    choices[MeshAxis.STAGE.dcn_key] = [1, num_slices] if pipelined and layers % num_slices == 0 else [1]
    choices[MeshAxis.EXPERT.dcn_key] = [1, num_slices] if cfg.moe.num_experts % num_slices == 0 and cfg.moe.num_experts > 1 else [1]
  if global_batch is not None:
    batches: list[float] = [global_batch / (per_slice * num_slices)]
  else:
    chips = per_slice * num_slices
    batches = [f for f in FRACTIONAL_BATCHES if (f * chips).is_integer()] + list(WHOLE_BATCHES)
  choices["per_device_batch_size"] = batches
  for key in list(choices):
    if key in fixed:
      choices[key] = [fixed[key]]
  fsdp_key = MeshAxis.FSDP.ici_key
  # The axis that fills the slice: ici_fsdp_parallelism, unless the user fixed another to -1; FSDP is then
  # searched (or kept at the user's degree) like the others. A fixed -1 was taken as a degree: no layout.
  fill = next((a for a in ICI_AXES if a is not MeshAxis.FSDP and _fills(fixed.get(a.ici_key))), MeshAxis.FSDP)
  if fill is not MeshAxis.FSDP:
    choices[fill.ici_key] = [1]  # set below
    fsdp_fixed = fsdp_key in fixed and not _fills(fixed[fsdp_key])
    choices[fsdp_key] = [int(fixed[fsdp_key])] if fsdp_fixed else powers_of_two(per_slice)
  dcn_fill = next((a for a in DCN_AXES if _fills(fixed.get(a.dcn_key))), None) if num_slices > 1 else None
  if dcn_fill is not None:
    choices[dcn_fill.dcn_key] = [1]  # set below
  keys = list(choices)
  for values in itertools.product(*(choices[k] for k in keys)):
    candidate = _with_placements(dict(zip(keys, values)), fixed)
    ici = {a: int(candidate[a.ici_key]) for a in ICI_AXES if a is not fill}
    rest = math.prod(ici.values())
    if fill is MeshAxis.FSDP and fsdp_key in fixed and int(fixed[fsdp_key]) != -1:
      if rest * int(fixed[fsdp_key]) != per_slice:
        continue
      candidate[fsdp_key] = int(fixed[fsdp_key])
    else:
      if per_slice % rest:
        continue
      candidate[fill.ici_key] = per_slice // rest
    ici = {a: int(candidate[a.ici_key]) for a in ICI_AXES}
    if ici[MeshAxis.STAGE] > 1 and (ici[MeshAxis.SEQUENCE] > 1 or ici[MeshAxis.FSDP_TRANSPOSE] > 1):
      continue  # stages within a slice only beside the common axes: keeps the space small
    if num_slices > 1:
      if dcn_fill is not None:
        others = math.prod(int(candidate.get(a.dcn_key, 1)) for a in DCN_AXES if a is not dcn_fill)
        if num_slices % others:
          continue
        candidate[dcn_fill.dcn_key] = num_slices // others
      dcn = math.prod(int(candidate.get(a.dcn_key, 1)) for a in DCN_AXES)
      if dcn != num_slices:
        continue
    else:
      candidate[MeshAxis.DATA.dcn_key] = 1
    stages = mesh_of(candidate)["stage"]
    if layers % stages:
      continue  # stages within and across slices together split the layers (config validation)
    fixed_pipeline = {k: fixed[k] for k in PIPELINE_KEYS if k in fixed}
    divides = lambda c: not whole_batches or _batch_divides(c, per_slice * num_slices, seq_len, data_sharding, rules)
    if stages == 1:
      if divides(candidate):
        yield candidate
      continue
    for variant in pipeline_variants(stages, layers):
      if any(variant[k] != v for k, v in fixed_pipeline.items()):
        continue
      piped = {**candidate, **variant}
      if divides(piped):
        yield piped


def _fills(value: Any) -> bool:
  """Whether a fixed degree is -1: the axis takes what the others leave."""
  try:
    return value is not None and int(value) == -1
  except (TypeError, ValueError):
    return False


def _with_placements(candidate: dict[str, Any], fixed: Mapping[str, Any]) -> dict[str, Any]:
  """A searched placement ("custom:<name>") as remat_policy=custom and its keys; a custom policy the
  user fixed with the placement keys the user gave."""
  policy = str(candidate["remat_policy"])
  if policy.startswith("custom:"):
    candidate["remat_policy"] = "custom"
    candidate.update(remat_policies.SEARCHED_PLACEMENTS[policy.removeprefix("custom:")])
  elif policy == "custom":
    candidate.update({n: fixed[n] for n in remat_policies.TENSORS if n in fixed})
  return candidate


class PlacementFill:
  """remat_policy=custom placements chosen per candidate by the memory model, between the presets' steps:
  from a full-remat candidate, the tensors that spare the most re-run FLOPs per byte kept in HBM, as many
  as fit beside what the candidate holds (device-only); then, of the rest, those whose host transfers
  the analytical model prices below their recompute, as far as the host's memory goes (mixed). Priced
  per tensor like any placement (plan_model.estimate)."""

  def __init__(self, model: ModelShape, seq_len: int):
    cfg = model.cfg
    self.cfg, self.seq_len = cfg, seq_len
    full = remat_policies.by_name("full")
    rerun = plan_remat.rerun_flops(cfg, full, seq_len)
    per_token_layer = seq_len * max(1, cfg.num_decoder_layers)
    widths = plan_remat.stack_tensor_widths(cfg)
    # (names, elements per token and layer (averaged over differing layers), re-run FLOPs they spare per token and layer), most FLOPs per byte
    # first: each tensor alone, and the names a shared matmul's output splits together (MLA's key and value),
    # as it is spared only when all of them are kept (plan_remat.shared_matmuls): its narrowest such set
    # only, as a second one would spare the same matmul again (fused_qkv: qkv_proj, not query, key and value).
    units: list[tuple[str, ...]] = [(name,) for name in remat_policies.PRODUCED
                                    if name not in remat_policies.NOT_RECOMPUTABLE and widths[name] > 0]
    for spare, _ in plan_remat.shared_matmuls(cfg):
      unit = tuple(sorted(min(spare, key=lambda names: sum(widths[n] for n in names))))
      if all(widths[n] > 0 for n in unit) and unit not in units:
        units.append(unit)
    spared = [(unit, sum(widths[n] for n in unit),
               (rerun - plan_remat.rerun_flops(cfg, remat_policies.custom(dict.fromkeys(unit, "device")), seq_len))
               / per_token_layer) for unit in units]
    self.order = sorted((t for t in spared if t[2] > 0), key=lambda t: (-t[2] / t[1], -t[1]))
    # What each searched preset keeps of this model's tensors, and where.
    self.presets = [{**{n: "device" for n in policy.device if widths.get(n, 0) > 0},
                     **{n: "offload" for n in policy.offload if widths.get(n, 0) > 0}}
                    for policy in map(remat_policies.by_name, SEARCHED_POLICIES)]

  def variants(self, settings: Mapping[str, Any], base: Estimate, topology: accelerators.TpuTopology,
               limit: float, fixed: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The device-only and the mixed placement for the full-remat candidate `settings` (estimated as
    `base`), each as a candidate, when it keeps something no searched preset spells; none when the
    user fixed the remat policy."""
    if "remat_policy" in fixed or settings.get("remat_policy") != "full" or not self.order:
      return []
    gen = topology.generation
    pipe = plan_model.pipeline_shape(settings, plan_model.mesh_of(settings)["stage"])
    micro = float(settings["per_device_batch_size"]) / int(settings.get("gradient_accumulation_steps", 1))
    per_element = micro * self.seq_len * 2 * self.cfg.num_decoder_layers  # bf16 bytes of one element of width
    # Activations grow into what the gradients alone hold, unless both are held whole (a scanned stack).
    room = limit - base.total + (0.0 if base.gradients_beside else max(0.0, base.gradients - base.activations))
    device: list[str] = []
    for names, width, _ in self.order:
      if width * per_element * pipe.live_share <= room and not set(names) & set(device):
        device.extend(names)
        room -= width * per_element * pipe.live_share
    # Offloading pays where sending a tensor out and back takes less than re-running its matmul.
    links = plan_model.per_device_links(plan_model.LINKS.get(gen.name, plan_model.LINKS["v5e"]), gen.devices_per_chip)
    host_room = min(plan_model.XLA_HOST_TEMPORARIES - base.host_activations,
                    (gen.host_gib * GIB if gen.host_gib is not None else math.inf) - base.host_activations
                    - base.host_optimizer)
    offload: list[str] = []
    for names, width, spared in self.order:
      held = width * per_element * pipe.live_share
      if (not set(names) & {*device, *offload} and 2 * 2 * width / links.host < spared / (gen.peak_tflops * 1e12)
              and held <= host_room):
        offload.extend(names)
        host_room -= held
    found: list[dict[str, str]] = []
    for placed in ({n: "device" for n in device}, {**{n: "device" for n in device}, **{n: "offload" for n in offload}}):
      if placed and placed not in self.presets and placed not in found:
        found.append(placed)
    return [{**settings, "remat_policy": "custom", **placed} for placed in found]


def _batch_divides(candidate: Mapping[str, Any], chips: int, seq_len: int, data_sharding: Sequence[str],
                   rules: sharding.Rules) -> bool:
  """The global batch splits into whole rows as config validation requires (batch_split: over the
  data_sharding axes, or with fewer rows than their devices over the axes the layers split rows
  over, each micro-batch and pipeline microbatch too); the length over sequence."""
  mesh = mesh_of(candidate)
  global_batch = float(candidate["per_device_batch_size"]) * chips
  if not global_batch.is_integer() or seq_len % mesh["sequence"]:
    return False
  rows, accum = int(global_batch), int(candidate.get("gradient_accumulation_steps", 1))
  pipeline_micro = batch_split.pipeline_microbatches(mesh, int(candidate.get("num_pipeline_microbatches", -1)))
  axes = batch_split.batch_axes(mesh, data_sharding, rules, rows, accum, pipeline_micro)
  return batch_split.splits(mesh, axes, rows, accum, pipeline_micro)


# The fewest bytes per chip: whatever the mesh, these settings only lower a candidate's estimate.
LEAN = {"remat_policy": "full", "optimizer_memory_host_offload": True}
# Beside tensor parallelism full remat's backward holds its re-run inputs gathered to full width
# (plan_model.full_remat_gathered_inputs), so a policy that keeps every matmul output in host memory can need
# less on the device; the bound takes the lesser of the two.
LEAN_POLICIES = ("full", "minimal_offloaded")
MAX_SUGGESTED_SLICES = 64


@dataclasses.dataclass(frozen=True)
class Bound:
  """Where the planner looks (topology, slices, the user's fixed keys and global batch) and the
  least memory any candidate there can need: `leanest` is a lower bound on every ranked estimate."""

  model: ModelShape
  seq_len: int
  rules: sharding.Rules
  attention_kernel: str
  fixed: Mapping[str, Any]
  global_batch: int | None
  data_sharding: Sequence[str] = MESH_AXES

  def leanest(self, topology: accelerators.TpuTopology, num_slices: int,
              fixed: Mapping[str, Any] | None = None) -> tuple[Estimate, dict[str, Any]] | None:
    """The candidate of least estimated memory over every mesh layout, with full remat or every matmul output
    offloaded (LEAN_POLICIES), the optimizer offloaded and, unless the batch is fixed, one sequence per step (not
    a valid batch for most layouts: only a bound); None when the fixed keys leave no layout."""
    fixed = self.fixed if fixed is None else fixed
    lean: dict[str, Any] = dict(LEAN)
    if self.global_batch is None and "per_device_batch_size" not in fixed:
      lean.update(per_device_batch_size=1 / (topology.devices * num_slices), gradient_accumulation_steps=1)
    best = None
    for policy in LEAN_POLICIES:
      for candidate in candidates(self.model, topology, num_slices, {**lean, "remat_policy": policy, **fixed},
                                  self.global_batch, self.seq_len, self.data_sharding, whole_batches=False,
                                  rules=self.rules):
        found = estimate(self.model, candidate, topology, num_slices, self.seq_len, self.rules, self.attention_kernel)
        if best is None or found.total < best[0].total:
          best = (found, candidate)
      if "remat_policy" in fixed:
        break
    return best

  def fits(self, topology: accelerators.TpuTopology, num_slices: int, limit_share: float,
           fixed: Mapping[str, Any] | None = None) -> bool:
    found = self.leanest(topology, num_slices, fixed)
    return found is not None and found[0].total <= topology.generation.hbm_gib * GIB * limit_share

  def smallest_slice(self, generation: accelerators.TpuGeneration, num_slices: int, above_chips: int,
                     limit_share: float, fixed: Mapping[str, Any]) -> str | None:
    """The smallest slice of `generation` with more than `above_chips` chips where the bound fits, or None:
    a binary search over the slices of a power of two chips (more of them never need more memory per chip),
    then the slices between the last that does not fit and the first that does, in turn (a slice of 192
    chips may need more than one of 128: its degrees factor worse)."""
    sizes = [n for n in generation.sizes if n // generation.cores_per_chip > above_chips]
    fitting = lambda n: self.fits(accelerators.tpu_topology(f"{generation.name}-{n}"), num_slices, limit_share, fixed)
    if not sizes or not fitting(sizes[-1]):
      return None
    chips = lambda n: n // generation.cores_per_chip
    powers = [n for n in sizes[:-1] if chips(n) & (chips(n) - 1) == 0] + [sizes[-1]]
    low, high = 0, len(powers) - 1  # powers[high] fits
    while low < high:
      mid = (low + high) // 2
      low, high = (low, mid) if fitting(powers[mid]) else (mid + 1, high)
    below = powers[high - 1] if high > 0 else 0
    return f"{generation.name}-{next(n for n in sizes if below < n <= powers[high] and (n == powers[high] or fitting(n)))}"


def where_it_fits(bound: Bound, topology: accelerators.TpuTopology, num_slices: int, limit_share: float) -> str:
  """What to change so that the bound fits (analytical model): a larger slice of this generation,
  else more slices of its largest, and a generation with more HBM per chip."""
  gen = topology.generation
  # The user's mesh degrees belong to this topology; the other fixed keys (policy, batch) are kept.
  fixed = {k: v for k, v in bound.fixed.items() if MeshAxis.of_key(k) is None}
  options = []
  larger = bound.smallest_slice(gen, num_slices, topology.chips, limit_share, fixed)
  if larger:
    options.append(f"{num_slices} x {larger}" if num_slices > 1 else larger)
  else:
    largest = accelerators.tpu_topology(f"{gen.name}-{gen.sizes[-1]}")
    slices = 2 * num_slices
    while slices <= MAX_SUGGESTED_SLICES and not bound.fits(largest, slices, limit_share, fixed):
      slices *= 2
    if slices <= MAX_SUGGESTED_SLICES:
      options.append(f"{slices} x {largest.name} (compile_topology_num_slices={slices})")
  for other in accelerators.TPU_GENERATIONS.values():
    if other.hbm_gib > gen.hbm_gib:
      found = bound.smallest_slice(other, num_slices, 0, limit_share, fixed)
      if found:
        options.append(f"{num_slices} x {found}" if num_slices > 1 else found)
  if not options:
    return f"no TPU topology up to {MAX_SUGGESTED_SLICES} slices holds it (analytical model)"
  return f"it would fit (analytical model) on {', or '.join(options)}"


def fits_nowhere(bound: Bound, topology: accelerators.TpuTopology, num_slices: int, headroom: float) -> str | None:
  """Why no candidate can fit `topology`, with the figures and what to change, when the lower
  bound says so (answered before anything is ranked or compiled); None when one may fit."""
  limit_share = 1 - headroom
  gen = topology.generation
  unit = gen.device_unit  # the bound and hbm_gib are a JAX device's: a TensorCore's on tpu7x, half its chip
  limit = gen.hbm_gib * GIB * limit_share
  found = bound.leanest(topology, num_slices)
  if found is not None and found[0].total <= limit:
    return None
  if found is None:
    need = "no mesh layout respects the fixed degrees"
  else:
    e, settings = found
    need = (f"its leanest setting ({describe(settings, shown=('remat_policy', 'optimizer_memory_host_offload'))}) "
            f"needs {e.total / GIB:.1f} GiB per {unit} (parameters {e.params / GIB:.1f} + "
            + (f"the teacher's parameters {e.teacher / GIB:.1f} + " if e.teacher else "")
            + (f"the reference's parameters {e.reference / GIB:.1f} + " if e.reference else "") + "optimizer "
            f"{e.optimizer / GIB:.1f} + " + (
                f"gradients {e.gradients / GIB:.1f} + activations {e.activations / GIB:.1f}"
                + (f" + the weights' {e.weights_copy / GIB:.1f} in the compute dtype" if e.weights_copy else "")
                if e.gradients_beside else
                f"the larger of gradients {e.gradients / GIB:.1f} and activations {e.activations / GIB:.1f}") + ")")
  have = f"a {gen.name} {unit} holds {gen.hbm_gib:g} GiB ({limit / GIB:.1f} with headroom={headroom:g})"
  if bound.fixed and bound.fits(topology, num_slices, limit_share, fixed={}):
    return f"{need}, {have}; drop or change the fixed keys {', '.join(sorted(bound.fixed))}"
  return f"{need}, {have}; {where_it_fits(bound, topology, num_slices, limit_share)}"


def describe(candidate: Mapping[str, Any], shown: Sequence[str] | None = None) -> str:
  """A short label: the non-trivial degrees, then policy, batch, accumulation, offload."""
  parts = []
  for key, value in candidate.items():
    if key in remat_policies.TENSORS:
      continue  # with remat_policy=custom, in its label
    if key == "remat_policy" and value == "custom" and (shown is None or key in shown):
      parts.append(f"custom:{remat_policies.placement_label(candidate)}")
    elif MeshAxis.of_key(key):
      if int(value) > 1:
        parts.append(f"{key.replace('_parallelism', '')}={value}")
    elif shown is None or key in shown:
      if key == "optimizer_memory_host_offload":
        if value:
          parts.append("opt_offload")
      elif key == "gradient_accumulation_steps":
        if int(value) > 1:
          parts.append(f"accum={value}")
      elif key == "per_device_batch_size":
        parts.append(f"pdb={float(value):g}")
      elif key.startswith("sa_block"):
        if key == "sa_block_q":
          parts.append(f"blocks={value}")
      elif key == "num_pipeline_microbatches":
        parts.append(f"micro={value}")
      elif key == "num_pipeline_repeats":
        if int(value) > 1:
          parts.append(f"repeats={value}")
      else:
        parts.append(f"{value}")
  return " ".join(parts)
