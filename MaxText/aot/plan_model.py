"""The planner's fast analytical model (MaxText/plan.py): for one candidate setting of the
mesh degrees, remat policy, batch, gradient accumulation and optimizer offload, the bytes each
chip holds (parameters, optimizer state, gradients, saved and working activations), the bytes
each chip sends over ICI and DCN, the FLOPs, and a roofline step time. It prunes and ranks
thousands of candidates in seconds; the short list is then compiled (plan.py) and the
compiler's figures replace these.

Parameter and optimizer bytes are exact per chip: the abstract parameter tree
(models.build_model_spec) sharded by logical_axis_rules over the candidate's mesh shape, as
train_state shards it. Activations are a per-token count of what each remat policy saves; the
collectives are ring all-gathers / reduce-scatters / all-reduces at the bandwidths in
`LINKS`, the in-layer exchanges at the links one group of their mesh axis has (in_layer_bandwidth). What the model leaves out (XLA's fusion choices, buffer reuse, collective overlap) is
what the compile measures; plan.py prints the error of every estimate against its compile. What each
remat policy keeps and re-runs per tensor is plan_remat.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Mapping

import jax
from jax.sharding import AbstractMesh

from MaxText.aot import plan_remat
from MaxText.training import metrics, optimizers
from MaxText.aot.step_time.network import NETWORKS, Network, mesh_axis_bandwidth, mesh_axis_extents, torus_ring_bandwidth
from MaxText.aot.step_time.report import FITTED
from MaxText.aot.plan_recipe import compile_flags
from MaxText.platform import accelerators, sharding
from MaxText.configuration import remat_policies
from MaxText.configuration.config_groups import OptimConfig
from MaxText.platform.mesh_axes import MESH_AXES, REPLICATED_PARAMETER_AXES, MeshAxis
from MaxText.layers import splash_attention
from MaxText.configuration.model_config import ModelConfig

GIB = 1024**3

# Per-chip link bandwidths in bytes/s: ICI is the published per-chip interconnect figure
# (all links together, one direction); DCN is the host's data-centre network share per chip;
# host is the PCIe path offloaded state and activations take.
@dataclasses.dataclass(frozen=True)
class Links:
  ici: float
  dcn: float
  host: float


def _from_network(network: Network) -> Links:
  return Links(ici=network.ici_bidirectional / 2, dcn=network.dcn_per_chip, host=network.host_link)


def per_device_links(links: Links, devices_per_chip: int) -> Links:
  """A chip's links, DCN share and host link as one JAX device sees them: a tpu7x chip's two
  TensorCores share its own (the step-time model's network.py shares them the same way)."""
  return Links(links.ici / devices_per_chip, links.dcn / devices_per_chip, links.host / devices_per_chip)


# The generations the step-time model has published figures for take them from its table
# (aot/step_time/network.py, sources in AOT.md), so the two models price one network.
LINKS: dict[str, Links] = {
    "v4": Links(ici=300e9, dcn=100e9 / 8 / 4, host=16e9),
    **{name: _from_network(network) for name, network in NETWORKS.items()},  # v5e, v5p, v6e, tpu7x: their sources
}

# With optimizer_memory_host_offload the update still copies the moments to the device; the
# share of them live there at once, fitted to compiles of llama2-7b on v5e-4 (getting_started/Planner.md).
OFFLOADED_OPTIMIZER_ON_DEVICE = 0.7
# Row-sized arrays ([rows, emb_dim]) of the expert exchange's receive buffer that one layer holds at once: the
# received rows, their sorted and returned copies, the grouped matmuls' outputs and, backward, their gradients;
# counted from XLA's buffer assignments of expert-parallel Qwen3-Next 80B compiles (getting_started/Planner.md).
MOE_EXCHANGE_COPIES = 12
# XLA's TPU compiler refuses more than this many bytes of offloaded temporaries (activations) in host
# memory per chip, on every generation here; offloaded arguments (optimizer state) are outside it.
XLA_HOST_TEMPORARIES = 128 * GIB
# Ring passes of a layer's [tokens, emb_dim] activations over the tensor axis, each (g-1)/g of it, as a
# compiled step runs them (counted in a v5e-8 compile, getting_started/Planner.md): forward, an all-gather
# before and an all-reduce after attention and the MLP (6); backward, two all-gathers and an all-reduce
# each (8); full remat adds 5 (the forward's re-run up to the MLP's input, 4, and one all-gather more).
# Outside the layers: the embedding's and the logits' exchanges, once per microbatch. The norms' small
# float32 gathers are left out.
TENSOR_LAYER_PASSES = 14
TENSOR_RECOMPUTE_PASSES = 5
TENSOR_OUTSIDE_PASSES = 6
# Ring passes of a layer's keys and values over the sequence axis (all_gather context parallelism), counted
# alike: the forward's all-gather (1), the backward's re-gather (1) and the gradients' all-reduce (2).
SEQUENCE_LAYER_PASSES = 4
# FSDP's collectives in the compiled steps looked at (getting_started/Planner.md, *FSDP groups of more than 16
# chips*): over 16 chips or fewer (v5e-8, v5e-16, v5p-256 beside tensor=8) the gradient reductions run as windowed
# matmuls beside the compute; over more, the backward loop waits for them: over a whole slice each layer's
# gradients are all-reduced whole (v5e-256, v5p-128 to v5p-2048), beside data or tensor parallelism they are
# reduce-scattered (v5p-256 data=2, v5e-256 tensor=2). The weight gathers stay asynchronous, except where the
# compile flags turn all-gather fusion off (v5p's recipes) and no data parallelism sits beside FSDP in the slice
# (a whole slice, or beside tensor alone): there the TensorCore gathers them itself, twice a layer per microbatch,
# full remat included; beside data parallelism the v5p compiles ran them on the SparseCores.
WINDOWED_FSDP_GROUP = 16
# Beside data or tensor parallelism, groups of up to this many chips reduce-scattered every layer gradient in the
# compiles read (v5p, 32 to 512 chips); larger ones all-reduced them whole like a whole slice (1,536 chips: all
# seven; 768 and 1,024: four of seven), with or without gradient accumulation (Planner.md, *FSDP groups of more
# than 16 chips*).
REDUCE_SCATTER_FSDP_GROUP = 512
FUSED_ALL_GATHER_FLAG = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather"


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The analytical figures for one candidate, per chip."""

  params: float
  optimizer: float  # on the device (with optimizer_memory_host_offload: the share live during the update)
  gradients: float
  activations: float  # saved for the backward pass, plus one layer's working set and the logits
  total: float
  flops: float  # model FLOPs per chip per step (what MFU counts)
  compute_s: float
  ici_s: float
  dcn_s: float
  host_s: float
  step_s: float
  mfu: float
  tokens_per_s: float  # per chip
  caveats: tuple[str, ...]  # where the compiler estimate cannot be trusted
  unsharded: float  # fraction of parameter bytes not split over every non-data axis
  host_activations: float = 0.0  # in the host's pinned memory: what an *_offloaded remat policy keeps
  host_optimizer: float = 0.0  # in the host's pinned memory: the optimizer state, when offloaded
  recompute_flops: float = 0.0  # per chip per step: the forward FLOPs the backward pass re-runs
  teacher: float = 0.0  # a distillation teacher's parameters (in `total`, not in `params`)
  gradients_beside: bool = False  # gradients held whole beside the activations (a scanned stack), else the larger
  weights_copy: float = 0.0  # the stacked weights cast to the compute dtype (in `total`)
  reference: float = 0.0  # the objective's frozen copy of the parameters (in `total`, not in `params`)


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the estimate needs from the model, computed once per plan."""

  cfg: ModelConfig
  leaves: tuple[tuple[tuple[int, ...], int, tuple[str | None, ...]], ...]  # (shape, itemsize, logical names)
  opt_multiple: float  # optimizer-state bytes per parameter byte (AdamW: mu and nu)
  num_params: int
  layer_params: int  # in one decoder layer (what FSDP gathers per layer)
  teachers: tuple["Teacher", ...] = ()  # models the objective runs forward-only beside this one
  layer_tensors: int = 1  # weight arrays of one decoder layer: FSDP gathers and reduces each on its own
  images_per_row: int = 0  # views a row's vision tower encodes (max_images_per_row): their FLOPs are in the step
  # The objective's passes per row and frozen copy (its ObjectiveRecord's cost); language modelling's by default.
  cost: metrics.ObjectiveCost = metrics.ObjectiveCost()

  @classmethod
  def of(cls, cfg: ModelConfig, optim_cfg: OptimConfig | None, teachers: tuple["Teacher", ...] = (),
         images_per_row: int = 0, cost: metrics.ObjectiveCost = metrics.ObjectiveCost()) -> "ModelShape":
    """The shape of `cfg`'s model, trained with `optim_cfg` (None: frozen, no optimizer state) by an objective
    of `cost`."""
    from MaxText import models  # noqa: PLC0415  (flax; only the planner needs it here)
    spec = models.build_model_spec(cfg)
    params, names = spec.abstract_params, spec.logical_names
    flat = jax.tree.leaves(params)
    flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    leaves = tuple((tuple(p.shape), p.dtype.itemsize, tuple(n)) for p, n in zip(flat, flat_names))
    opt_multiple = 0.0
    if optim_cfg is not None:
      opt_state = jax.eval_shape(optimizers.create_optimizer(optim_cfg, names).init, params)
      param_bytes = sum(p.size * p.dtype.itemsize for p in flat)
      opt_multiple = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state)) / max(1, param_bytes)
    num_params = sum(p.size for p in flat)
    stacked = sum(p.size for p, n in zip(flat, flat_names) if "layers" in n)
    layer_params = stacked // max(1, cfg.num_decoder_layers)
    layer_tensors = max(1, sum(1 for n in flat_names if "layers" in n))
    unrolled = _unrolled_layers(params)
    if not stacked and unrolled:  # an unrolled stack (scan_layers=False, Gemma 4's): the largest layer is gathered
      layer_params = max(size for size, _ in unrolled.values())
      layer_tensors = max(1, round(sum(count for _, count in unrolled.values()) / len(unrolled)))
    return cls(cfg, leaves, opt_multiple, num_params, layer_params, teachers, layer_tensors, images_per_row, cost)


_UNROLLED_LAYER = re.compile(r"layers_(\d+)$")


def _unrolled_layers(params: Any) -> dict[int, tuple[int, int]]:
  """(parameters, arrays) of each decoder layer an unrolled stack holds apart (its `layers_<i>` subtree)."""
  found: dict[int, tuple[int, int]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    index = next((int(m.group(1)) for key in path
                  if (m := _UNROLLED_LAYER.match(str(getattr(key, "key", getattr(key, "name", "")))))), None)
    if index is not None:
      size, count = found.get(index, (0, 0))
      found[index] = (size + math.prod(leaf.shape), count + 1)
  return found


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A model the objective runs forward-only beside the trained one (a distillation teacher): its
  parameters sharded by the same rules in its own dtype, no gradient, no optimizer state
  (objectives/distill.teacher_runs says which objective runs one, and how)."""

  shape: ModelShape
  held_bytes_per_token: float  # what its output keeps through the student's forward and backward
  per_micro_batch: bool  # its forward runs in every micro-batch's loss (else once per step)

  def gathered_bytes(self, mesh_shape: Mapping[str, int]) -> float:
    """Its bf16 weights one FSDP gather of the whole model moves, per tensor/expert/stage shard."""
    return self.shape.num_params * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"] * mesh_shape["stage"])


def mesh_of(candidate: Mapping[str, Any]) -> dict[str, int]:
  """Total degree per mesh axis (ici × dcn) of a candidate's resolved parallelism keys."""
  shape = {axis: 1 for axis in MESH_AXES}
  for key, value in candidate.items():
    group_axis = MeshAxis.of_key(key)
    if group_axis:
      shape[group_axis[1]] *= int(value)
  return shape


def param_layout(model: ModelShape, mesh_shape: Mapping[str, int], rules: sharding.Rules) -> tuple[float, float]:
  """(parameter bytes one chip holds, fraction of bytes not split over every non-data axis):
  each leaf split over the mesh axes its logical names map to, as train_state shards it (the
  fraction is what sharding_tolerance bounds; see sharding.unsharded_fraction)."""
  mesh = AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES)
  ignored = REPLICATED_PARAMETER_AXES
  target = math.prod(size for axis, size in mesh_shape.items() if axis not in ignored)
  per_chip = total = unsharded = 0.0
  for shape, itemsize, names in model.leaves:
    spec = sharding.logical_to_mesh_spec(names, rules, mesh, shape)  # type: ignore[arg-type]
    axes = [axis for entry in spec if entry for axis in ((entry,) if isinstance(entry, str) else entry)]
    nbytes = math.prod(shape) * itemsize
    per_chip += nbytes / math.prod(mesh_shape[a] for a in axes)
    total += nbytes
    if math.prod(mesh_shape[a] for a in axes if a not in ignored) < target:
      unsharded += nbytes
  return per_chip, (unsharded / total if total else 0.0)


def host_overflow(e: Estimate, generation: accelerators.TpuGeneration) -> str | None:
  """Why a candidate's host-memory side does not fit (what XLA refuses, or more than the host VM
  has per device), or None. The figures are per JAX device: a TensorCore on tpu7x."""
  unit = generation.device_unit
  if e.host_activations > XLA_HOST_TEMPORARIES:
    return (f"its offloaded activations need {e.host_activations / GIB:.1f} GiB of host memory per {unit}, over "
            f"the {XLA_HOST_TEMPORARIES / GIB:g} GiB XLA allows")
  host = e.host_activations + e.host_optimizer
  if generation.host_gib is not None and host > generation.host_gib * GIB:
    return (f"it needs {host / GIB:.1f} GiB of host memory per {unit} (offloaded activations "
            f"{e.host_activations / GIB:.1f} + optimizer {e.host_optimizer / GIB:.1f}), a {generation.name} host "
            f"has {generation.host_gib:.1f} GiB per {unit}")
  return None


def estimate(model: ModelShape, candidate: Mapping[str, Any], topology: accelerators.TpuTopology, num_slices: int,
             seq_len: int, rules: sharding.Rules, attention_kernel: str) -> Estimate:
  """The analytical estimate of one candidate (its keys resolved: every degree, batch, policy)."""
  cfg, gen = model.cfg, topology.generation
  links = per_device_links(LINKS.get(gen.name, LINKS["v5e"]), gen.devices_per_chip)
  chips = topology.devices * num_slices  # devices: the figures (HBM, peak) are per device
  mesh_shape = mesh_of(candidate)
  pdb = float(candidate["per_device_batch_size"])
  accumulation = int(candidate.get("gradient_accumulation_steps", 1))
  policy = plan_remat.policy_of(candidate)
  offload_opt = bool(candidate.get("optimizer_memory_host_offload", False))
  stages = mesh_shape["stage"]
  pipe = pipeline_shape(candidate, stages)

  params, unsharded = param_layout(model, mesh_shape, rules)
  global_batch = pdb * chips
  optimizer = params * model.opt_multiple
  gradients = params  # gradients in the parameter dtype, sharded like the parameters
  # Activations per chip for one microbatch: a chip's rows (configuration/batch_split) over the
  # sequence degree in length and the tensor degree in width, which is per_device_batch_size
  # sequences' worth whether the rows split over sequence and tensor too or repeat there.
  tokens = pdb / accumulation * seq_len
  layers = cfg.num_decoder_layers
  act_bytes = 2  # bf16
  saved = tokens * act_bytes * layers * (plan_remat.stream_width(cfg, policy)
                                         + plan_remat.kept_width(cfg, policy, on_host=False, mesh=mesh_shape))
  saved *= pipe.live_share
  # A stage works on one pipeline microbatch at a time: its share of the stage's rows.
  working_tokens = tokens * stages / pipe.microbatches if stages > 1 else tokens
  # One layer's recompute and backward, the widest layer's (Gemma 4's global layers: metrics.layer_groups): its
  # input, that input's gradient and its q/k/v. Full remat re-runs the layer from its input, which tensor
  # parallelism gathers to full width for the re-run's matmuls and again for the backward's: both are held for
  # `tensor` chips' rows (full_remat_gathered_inputs).
  working = working_tokens * act_bytes * max(2 * cfg.emb_dim * full_remat_gathered_inputs(policy, mesh_shape)
                                             + plan_remat.preset_widths(group.cfg)["qkv"]
                                             for group in metrics.layer_groups(cfg))
  if attention_kernel == "dot_product":  # the [heads, L, L] scores of one layer in float32, forward and backward
    working += working_tokens / seq_len * cfg.num_query_heads * seq_len * seq_len * 4 * 2
  # Float32 logits (their gradient reuses the buffer); num_vocab_tiling keeps one tile's at a time.
  logits = tokens * cfg.vocab_size * 4 / cfg.num_vocab_tiling
  shard_group = chips // (mesh_shape["data"] * mesh_shape["stage"])
  gathered = model.layer_params * 2 * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"])  # two layers in flight
  gathered = gathered if shard_group > 1 else 0.0
  exchange_rows, routed_rows = plan_remat.moe_exchange_rows(cfg, mesh_shape["expert"], working_tokens)
  activations = saved + working + logits + gathered + exchange_rows * cfg.emb_dim * act_bytes * MOE_EXCHANGE_COPIES
  # Gradients arrive layer by layer as the saved activations are freed: the step needs the larger
  # of the two, plus the running sum when it accumulates microbatches. A scanned stack holds both, and
  # a copy of its weights in the compute dtype (stacked_layer_buffers).
  accumulated = gradients if accumulation > 1 else 0.0
  gradients_beside, weights_copy = stacked_layer_buffers(model, params)
  device_optimizer = optimizer * OFFLOADED_OPTIMIZER_ON_DEVICE if offload_opt else optimizer
  # A teacher's weights stay beside the student's; its output (log-probs) lives through the student's
  # step; its forward runs before the student's, its one layer and logits live only then.
  teacher_params = sum(param_layout(t.shape, mesh_shape, rules)[0] for t in model.teachers)
  # A frozen reference (DPO's, GRPO's with grpo_beta > 0) is a copy of the parameters, sharded like them.
  reference = params if model.cost.reference_copy else 0.0
  activations += sum(t.held_bytes_per_token for t in model.teachers) * tokens
  for t in model.teachers:
    t_cfg, t_tokens = t.shape.cfg, tokens if t.per_micro_batch else tokens * accumulation
    t_gathered = t.shape.layer_params * 2 * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"])
    t_qkv = plan_remat.preset_widths(t_cfg)["qkv"]
    t_working = t_tokens * (act_bytes * (2 * t_cfg.emb_dim + t_qkv) + t_cfg.vocab_size * 4 * 2)
    activations = max(activations, t_working + (t_gathered if shard_group > 1 else 0.0))
  held = gradients + activations if gradients_beside else max(gradients, activations)
  total = params + teacher_params + reference + device_optimizer + held + weights_copy + accumulated

  cost = model.cost
  flops = metrics.training_tflops_per_step(cfg, max(1, round(global_batch)), seq_len, passes=cost.passes_per_row,
                                           forward_only=tuple(t.shape.cfg for t in model.teachers),
                                           images_per_row=model.images_per_row, trained_per_row=cost.trained_per_row,
                                           trains_indexer=cost.trains_indexer)
  flops_per_chip = flops.total_tflops * 1e12 / chips
  # Rematerialisation re-runs the forward matmuls whose results it did not keep, in each trained sequence's backward.
  trained_rows = global_batch * cost.trained_per_row
  recompute = plan_remat.rerun_flops(cfg, policy, seq_len) * trained_rows / chips
  executed = flops_per_chip * (1 + pipe.extra_compute) + recompute + plan_remat.kernel_rerun_flops(
      cfg, seq_len, attention_kernel) * trained_rows / chips
  compute_s = executed / (gen.peak_tflops * 1e12) / (1 - pipe.bubble)

  # Collectives per chip per step (ring algorithms: (g-1)/g of the buffer crosses the links).
  def ring(nbytes: float, group: int) -> float:
    return nbytes * (group - 1) / group if group > 1 else 0.0

  full_params_bytes = model.num_params * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"] * mesh_shape["stage"])
  fsdp_group = mesh_shape["fsdp"] * mesh_shape["fsdp_transpose"] * mesh_shape["sequence"]
  gathers = 3 if policy.keeps == "nothing" else 2  # full remat gathers the weights again for the recompute
  ici_fsdp = min(fsdp_group, topology.devices)
  # Each microbatch reduces its own gradients over the fsdp group inside the backward loop (Planner.md,
  # *Gradient accumulation's reductions*). One reduction stays under compute as before; each further
  # microbatch's is counted in full, since the compiled v5e-256 step all-reduces them synchronously.
  reduction = ring(full_params_bytes * 2, ici_fsdp)
  ici_bytes = accumulation * gathers * ring(full_params_bytes, ici_fsdp) + reduction
  gradient_sync_s = (accumulation - 1) * reduction / links.ici
  waits = synchronous_fsdp(topology, candidate)
  if waits is not None:  # priced as the step-time model prices the compiled synchronous collectives
    per_pass = ring(full_params_bytes, ici_fsdp) / waits.bandwidth / FITTED.ici_efficiency
    per_pass += waits.steps * FITTED.ici_hop_latency_s * model.layer_tensors * layers
    gradient_sync_s = accumulation * (2 if waits.all_reduced else 1) * per_pass
    ici_bytes -= reduction
    if int(candidate.get(MeshAxis.DATA.ici_key, 1)) == 1 and not gathers_fused(gen.name):
      gradient_sync_s += accumulation * 2 * per_pass
      ici_bytes -= accumulation * gathers * ring(full_params_bytes, ici_fsdp)
  # A teacher's weights are gathered for each of its forwards; nothing of it is reduced.
  teacher_gathers = [(accumulation if t.per_micro_batch else 1, t.gathered_bytes(mesh_shape)) for t in model.teachers]
  ici_bytes += sum(n * ring(nbytes, ici_fsdp) for n, nbytes in teacher_gathers)
  ici_data = mesh_shape["data"] // max(1, num_slices if candidate.get(MeshAxis.DATA.dcn_key, 1) != 1 else 1)
  ici_bytes += 2 * ring(params * 2, ici_data)
  tensor, seq = mesh_shape["tensor"], mesh_shape["sequence"]
  # Tensor and sequence parallelism exchange activations inside each layer, on the critical path, over
  # the links one group of their mesh axis has (in_layer_bandwidth), not all of a chip's.
  passes = layers * (TENSOR_LAYER_PASSES + (TENSOR_RECOMPUTE_PASSES if policy.keeps == "nothing" else 0))
  critical_s = accumulation * (passes + TENSOR_OUTSIDE_PASSES) * ring(
      tokens * tensor * cfg.emb_dim * act_bytes, tensor) / in_layer_bandwidth(topology, candidate, "tensor", links)
  kv_bytes = tokens * seq * 2 * cfg.num_kv_heads * cfg.head_dim * act_bytes
  critical_s += accumulation * layers * SEQUENCE_LAYER_PASSES * ring(kv_bytes, seq) / in_layer_bandwidth(
      topology, candidate, "sequence", links)
  # Expert parallelism's dispatch and combine all-to-alls, forward and backward, wait for their rows
  # (bisection-bound on a ring, as the step-time model prices an all-to-all).
  ici_experts = int(candidate.get(MeshAxis.EXPERT.ici_key, 1))
  critical_s += accumulation * plan_remat.expert_layers(cfg) * 4 * ring(
      routed_rows * cfg.emb_dim * act_bytes, ici_experts) * max(
      1.0, ici_experts / 4) / in_layer_bandwidth(topology, candidate, "expert", links)
  # Stage boundaries pass each microbatch's activations forward and their gradients back.
  stage_bytes = 2 * pdb * seq_len * stages * cfg.emb_dim * act_bytes * pipe.repeats if stages > 1 else 0.0
  dcn_stages = int(candidate.get(MeshAxis.STAGE.dcn_key, 1))
  critical_s += 0.0 if dcn_stages > 1 else stage_bytes / links.ici
  ici_s = ici_bytes / links.ici
  exposed_s = critical_s + gradient_sync_s
  dcn_bytes = 0.0
  dcn_exposed = stage_bytes if dcn_stages > 1 else 0.0
  dcn_experts = int(candidate.get(MeshAxis.EXPERT.dcn_key, 1))
  if dcn_experts > 1 and cfg.moe.num_experts > 1:  # dispatch and combine all-to-alls, forward and backward
    dcn_exposed += 4 * ring(tokens * accumulation * cfg.moe.num_experts_per_tok * cfg.emb_dim * act_bytes,
                            dcn_experts) * plan_remat.expert_layers(cfg)
  if num_slices > 1:
    dcn_fsdp = int(candidate.get(MeshAxis.FSDP.dcn_key, 1))
    dcn_bytes += 2 * ring(params * 2, int(candidate.get(MeshAxis.DATA.dcn_key, 1)))  # gradient all-reduce
    dcn_bytes += accumulation * gathers * ring(full_params_bytes / ici_fsdp, dcn_fsdp)
    dcn_bytes += sum(n * ring(nbytes / ici_fsdp, dcn_fsdp) for n, nbytes in teacher_gathers)
  dcn_s = dcn_bytes / links.dcn
  exposed_s += dcn_exposed / links.dcn
  host_bytes = 2 * optimizer if offload_opt else 0.0
  if policy.offloaded:
    host_bytes += 2 * tokens * accumulation * act_bytes * layers * plan_remat.kept_width(
        cfg, policy, on_host=True, mesh=mesh_shape)
  host_s = host_bytes / links.host
  # Weight gathers, one gradient reduction and DCN overlap with compute; activation exchanges, the further
  # microbatches' gradient reductions and host transfers (offloaded state and activations) are counted in full.
  step_s = max(compute_s, ici_s, dcn_s) + exposed_s + host_s
  mfu = flops_per_chip / step_s / (gen.peak_tflops * 1e12)
  caveats = []
  if host_s > 0:
    caveats.append("host offload")
  if dcn_s + dcn_exposed / links.dcn > 0.5 * compute_s:
    caveats.append("DCN-bound")
  if seq > 1 and attention_kernel == "flash" and not _splash_tiles_context(cfg, candidate, seq_len, seq):
    caveats.append("attention loop uncounted")
  return Estimate(params, device_optimizer, gradients, activations, total, flops_per_chip,
                  compute_s, ici_s + exposed_s, dcn_s, host_s, step_s, mfu, global_batch * seq_len / chips / step_s, tuple(caveats),
                  unsharded, plan_remat.offloaded_activations(cfg, policy, tokens, mesh_shape) * pipe.live_share,
                  optimizer if offload_opt else 0.0, recompute, teacher_params, gradients_beside, weights_copy,
                  reference)


def full_remat_gathered_inputs(policy: remat_policies.RematPolicy, mesh_shape: Mapping[str, int]) -> int:
  """How many chips' rows of the working set's two layer-sized activations one chip holds in a layer's backward:
  under full remat beside tensor parallelism the re-run forward all-gathers the layer input over `tensor` to full
  width for its matmuls, and the backward all-gathers one again for its own; both are live together at the peak
  (XLA's buffer assignment of the v5p 512B and 1024B recipes' compiles, getting_started/Planner.md, *The buffers
  the estimate misses*). A policy that keeps matmul outputs reads them instead of re-running from the input."""
  return mesh_shape["tensor"] if policy.keeps == "nothing" else 1


def stacked_layer_buffers(model: ModelShape, params: float) -> tuple[bool, float]:
  """(whether the gradients are held whole beside every saved activation, the bytes of the weights' copy in
  the compute dtype) per chip, for `params` parameter bytes a chip holds. A scanned stack's backward loop
  writes its layers' gradients into stacked arrays allocated whole when it starts, and the forward casts the
  stacked weights to the compute dtype once, a copy the backward reads too (XLA's buffer assignment of v5p-128
  32B compiles, getting_started/Planner.md, *The v5p 32B recipe*). Unscanned layers free both layer by layer."""
  cfg = model.cfg
  if not cfg.scan_layers:
    return False, 0.0
  compute_size = jax.numpy.dtype(cfg.dtype).itemsize
  total = sum(math.prod(shape) * size for shape, size, _ in model.leaves)
  cast = sum(math.prod(shape) * compute_size for shape, size, names in model.leaves
             if "layers" in names and size > compute_size)
  return True, params * cast / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class FsdpRing:
  bandwidth: float  # one way, per chip, over the torus links the group's chips span
  steps: int  # ring steps: a hop of latency each
  whole_slice: bool  # the group is every chip of the slice
  all_reduced: bool  # its gradients are all-reduced whole (two passes), not reduce-scattered (one)


def synchronous_fsdp(topology: accelerators.TpuTopology, candidate: Mapping[str, Any]) -> FsdpRing | None:
  """The ring of the in-slice FSDP group (fsdp, fsdp_transpose and sequence) where the compile waits for its
  gradient reductions (a group of more than WINDOWED_FSDP_GROUP chips), else None; as the step-time model
  prices a compiled collective (network.torus_ring_bandwidth; one hop of latency per ring step)."""
  net = NETWORKS.get(topology.generation.name)
  degrees = {a: int(candidate.get(MeshAxis(a).ici_key, 1)) for a in MESH_AXES}
  group = degrees["fsdp"] * degrees["fsdp_transpose"] * degrees["sequence"]
  if net is None or group <= WINDOWED_FSDP_GROUP:
    return None
  per_chip = topology.generation.devices_per_chip
  physical = tuple(topology.shape) + ((per_chip,) if per_chip > 1 else ())
  # The three axes are adjacent in mesh order: their group is laid out as one axis of their product. Multiplying
  # each axis's own extents counted a physical axis twice where two of them split it (fsdp=32 x sequence=8 on
  # a 16 x 16 slice spanned 128 x 2 chips).
  merged = {**degrees, "fsdp": group, "fsdp_transpose": 1, "sequence": 1}
  extents = list(mesh_axis_extents(physical, merged, "fsdp"))
  chips = extents[:len(topology.shape)]
  sharing = extents[-1] if per_chip > 1 else 1
  whole_slice = group == math.prod(degrees.values())
  return FsdpRing(torus_ring_bandwidth(chips, topology.shape, topology.wrap, net) / sharing,
                  sum(e - 1 for e in chips if e > 1), whole_slice, whole_slice or group > REDUCE_SCATTER_FSDP_GROUP)


def gathers_fused(generation: str) -> bool:
  """Whether the compiles fuse FSDP's all-gathers with compute (asynchronous), by the flags they run with
  (plan_recipe.compile_flags): v5p's recipes turn that off, and its compiles then wait for each gather."""
  return _gathers_fused(generation, os.environ.get("LIBTPU_INIT_ARGS", ""))


@functools.lru_cache(maxsize=None)
def _gathers_fused(generation: str, user_flags: str) -> bool:  # user_flags: a key of the cache only
  found = re.findall(rf"{FUSED_ALL_GATHER_FLAG}=(\w+)", compile_flags(generation))
  return not found or found[-1].lower() not in ("false", "0")


def in_layer_bandwidth(topology: accelerators.TpuTopology, candidate: Mapping[str, Any], axis: str,
                       links: Links) -> float:
  """One-way bandwidth per chip of the ring one in-slice group of mesh `axis` runs its exchanges on, as
  the step-time model prices the compiled collective (network.mesh_axis_bandwidth: one link per torus
  axis the group spans in part, two per whole wrapped ring); a generation without its network figures
  (v4) gets all of a chip's links (links.ici)."""
  net = NETWORKS.get(topology.generation.name)
  if net is None:
    return links.ici
  degrees = {a: int(candidate.get(MeshAxis(a).ici_key, 1)) for a in MESH_AXES}
  return mesh_axis_bandwidth(net, topology.shape, topology.wrap, degrees, axis, topology.generation.devices_per_chip)


@dataclasses.dataclass(frozen=True)
class PipelineShape:
  microbatches: int
  repeats: int
  bubble: float  # share of the step a stage idles in the fill and drain
  live_share: float  # share of the microbatches' saved activations a stage holds at once
  extra_compute: float  # extra work as a share of the step's model FLOPs


def _splash_tiles_context(cfg: ModelConfig, candidate: Mapping[str, Any], seq_len: int, seq: int) -> bool:
  """Whether sequence-parallel attention runs splash: its tiles must divide what each call attends
  (the ring's and all_gather's chunk pairs, all_to_all's whole sequence). Otherwise it runs the
  chunked JAX kernel, whose loop over key blocks has a trip count fixed only at run time, which
  the compiler's cycle count takes once."""
  strategy = candidate.get("context_parallel_strategy", cfg.attn.context_parallel_strategy)
  balanced = candidate.get("context_parallel_load_balance", cfg.attn.context_parallel_load_balance)
  length = seq_len if strategy == "all_to_all" else seq_len // seq // (2 if balanced else 1)
  blocks = dataclasses.replace(cfg.attn.attention_blocks,
                               **{k: v for k, v in candidate.items() if k.startswith("sa_block_")})
  return splash_attention.tiles(blocks, length)


def pipeline_shape(candidate: Mapping[str, Any], stages: int) -> PipelineShape:
  """The schedule's bubble and memory: GPipe and 1F1B idle (stages - 1) of (microbatches +
  stages - 1) slots, a circular schedule's repeats shrink that share; 1F1B keeps at most
  2 x stages microbatches' activations (pipeline_1f1b.py) and re-runs one stage forward per
  microbatch (a third of the stage's forward-and-backward work)."""
  if stages <= 1:
    return PipelineShape(1, 1, 0.0, 1.0, 0.0)
  micro = int(candidate.get("num_pipeline_microbatches", -1))
  micro = stages if micro == -1 else micro
  repeats = int(candidate.get("num_pipeline_repeats", 1))
  schedule = str(candidate.get("pipeline_schedule", "gpipe"))
  passes = micro * repeats if schedule in ("circular", "1f1b") else micro
  bubble = (stages - 1) / (passes + stages - 1)
  if schedule == "1f1b":
    return PipelineShape(micro, repeats, bubble, min(1.0, 2 * stages / micro), 1 / 3 / repeats)
  return PipelineShape(micro, repeats, bubble, 1.0, 0.0)
