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
`LINKS`. What the model leaves out (XLA's fusion choices, buffer reuse, collective overlap) is
what the compile measures; plan.py prints the error of every estimate against its compile.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Iterator, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh

from MaxText.training import metrics, optimizers
from MaxText.aot.step_time.network import NETWORKS, Network
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


# The generations the step-time model has published figures for take them from its table
# (aot/step_time/network.py, sources in AOT.md), so the two models price one network.
LINKS: dict[str, Links] = {
    "v4": Links(ici=300e9, dcn=100e9 / 8 / 4, host=16e9),
    **{name: _from_network(network) for name, network in NETWORKS.items()},
    "v6e": Links(ici=448e9, dcn=400e9 / 8 / 4, host=32e9),
}

# With optimizer_memory_host_offload the update still copies the moments to the device; the
# share of them live there at once, fitted to compiles of llama2-7b on v5e-4 (getting_started/Planner.md).
OFFLOADED_OPTIMIZER_ON_DEVICE = 0.7
# Row-sized arrays ([rows, emb_dim]) of the expert exchange's receive buffer that one layer holds at once: the
# received rows, their sorted and returned copies, the grouped matmuls' outputs and, backward, their gradients;
# counted from XLA's buffer assignments of expert-parallel Qwen3-Next 80B compiles (getting_started/Planner.md).
MOE_EXCHANGE_COPIES = 12
SEARCHED_POLICIES = tuple(p.name for p in remat_policies.REMAT_POLICIES if p.searched_by_planner)
# XLA's TPU compiler refuses more than this many bytes of offloaded temporaries (activations) in host
# memory per chip, on every generation here; offloaded arguments (optimizer state) are outside it.
XLA_HOST_TEMPORARIES = 128 * GIB

# Keys a candidate sets; a key the user gives is held fixed instead.
PIPELINE_KEYS = ("pipeline_schedule", "num_pipeline_repeats", "num_pipeline_microbatches")
# Pipeline stages within a slice: a few, as ICI is fast enough that they rarely beat FSDP there.
MAX_ICI_STAGES = 4
# The mesh axes whose degrees the planner sets, within a slice and across slices (the others stay 1).
ICI_AXES = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.FSDP_TRANSPOSE, MeshAxis.SEQUENCE, MeshAxis.TENSOR,
            MeshAxis.EXPERT, MeshAxis.STAGE)
DCN_AXES = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.STAGE, MeshAxis.EXPERT)


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


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the estimate needs from the model, computed once per plan."""

  cfg: ModelConfig
  leaves: tuple[tuple[tuple[int, ...], int, tuple[str | None, ...]], ...]  # (shape, itemsize, logical names)
  opt_multiple: float  # optimizer-state bytes per parameter byte (AdamW: mu and nu)
  num_params: int
  layer_params: int  # in one decoder layer (what FSDP gathers per layer)

  @classmethod
  def of(cls, cfg: ModelConfig, optim_cfg: OptimConfig) -> "ModelShape":
    from MaxText import models  # noqa: PLC0415  (flax; only the planner needs it here)
    spec = models.build_model_spec(cfg)
    params, names = spec.abstract_params, spec.logical_names
    flat = jax.tree.leaves(params)
    flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    leaves = tuple((tuple(p.shape), p.dtype.itemsize, tuple(n)) for p, n in zip(flat, flat_names))
    optimizer = optimizers.create_optimizer(optim_cfg, names)
    opt_state = jax.eval_shape(optimizer.init, params)
    param_bytes = sum(p.size * p.dtype.itemsize for p in flat)
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    num_params = sum(p.size for p in flat)
    stacked = sum(p.size for p, n in zip(flat, flat_names) if "layers" in n)
    layer_params = stacked // max(1, cfg.num_decoder_layers)
    return cls(cfg, leaves, opt_bytes / max(1, param_bytes), num_params, layer_params)


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


def _widths(cfg: ModelConfig) -> dict[remat_policies.Width, float]:
  """Per token and layer, what each width a remat policy keeps (bf16) holds:
  qkv = (N + 2K)·H, out = D (attention output projection), mlp_in = gated·F, mlp_out = D."""
  heads = (cfg.num_query_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  mlp = cfg.mlp_dim * (cfg.moe.num_experts_per_tok if cfg.moe.num_experts > 1 else 1)
  return {"qkv": heads, "out": cfg.emb_dim, "mlp_in": mlp * len(cfg.mlp_activations), "mlp_out": cfg.emb_dim,
          "attn": cfg.num_query_heads * cfg.head_dim, "norms": 2 * cfg.emb_dim, "mlp_act": mlp}


def offloaded_activations(cfg: ModelConfig, policy: remat_policies.RematPolicy, tokens: float) -> float:
  """Bytes (bf16) that `policy` keeps in host memory for `tokens` tokens on a chip, over every layer."""
  widths = _widths(cfg)
  return tokens * 2 * cfg.num_decoder_layers * sum(widths[w] for w in policy.saved_on_host)


def host_overflow(e: Estimate, generation: accelerators.TpuGeneration) -> str | None:
  """Why a candidate's host-memory side does not fit (what XLA refuses, or more than the host VM
  has per chip), or None."""
  if e.host_activations > XLA_HOST_TEMPORARIES:
    return (f"its offloaded activations need {e.host_activations / GIB:.1f} GiB of host memory per chip, over the "
            f"{XLA_HOST_TEMPORARIES / GIB:g} GiB XLA allows")
  host = e.host_activations + e.host_optimizer
  if generation.host_gib is not None and host > generation.host_gib * GIB:
    return (f"it needs {host / GIB:.1f} GiB of host memory per chip (offloaded activations "
            f"{e.host_activations / GIB:.1f} + optimizer {e.host_optimizer / GIB:.1f}), a {generation.name} host "
            f"has {generation.host_gib:.1f} GiB per chip")
  return None


def expert_layers(cfg: ModelConfig) -> int:
  """Decoder layers with routed experts (a hybrid stack's Gated DeltaNet layers have them too)."""
  if cfg.moe.num_experts <= 1:
    return 0
  return cfg.num_decoder_layers if cfg.linear_attn.full_attention_interval > 1 else cfg.num_moe_stack_layers


def moe_exchange_rows(cfg: ModelConfig, experts: int, tokens: float) -> tuple[float, float]:
  """(rows of one device's receive buffer, rows it sends) per layer under expert parallelism's all-to-all
  dispatch (layers/moe_dispatch.py), for `tokens` tokens on the device; (0, 0) without it."""
  moe = cfg.moe
  if moe.num_experts <= 1 or experts <= 1 or moe.moe_dispatch != "all_to_all":
    return 0.0, 0.0
  routed = tokens * moe.num_experts_per_tok
  if not moe.sparse_matmul:  # capacity slots, sent and received whole: C = capacity_factor·L·k / E per expert, or L
    slots = routed * moe.capacity_factor if moe.capacity_factor > 0 else tokens * moe.num_experts
    return slots, slots
  if moe.moe_ragged_buffer_factor > 0:
    return moe.moe_ragged_buffer_factor * routed, routed
  # Dropless: sized for every peer's tokens landing here, each at most once per local expert.
  return experts * tokens * min(moe.num_experts_per_tok, max(1, moe.num_experts // experts)), routed


def estimate(model: ModelShape, candidate: Mapping[str, Any], topology: accelerators.TpuTopology, num_slices: int,
             seq_len: int, rules: sharding.Rules, attention_kernel: str) -> Estimate:
  """The analytical estimate of one candidate (its keys resolved: every degree, batch, policy)."""
  cfg, gen = model.cfg, topology.generation
  links = LINKS.get(gen.name, LINKS["v5e"])
  chips = topology.chips * num_slices
  mesh_shape = mesh_of(candidate)
  pdb = float(candidate["per_device_batch_size"])
  accumulation = int(candidate.get("gradient_accumulation_steps", 1))
  policy = remat_policies.by_name(str(candidate["remat_policy"]))
  offload_opt = bool(candidate.get("optimizer_memory_host_offload", False))
  stages = mesh_shape["stage"]
  pipe = pipeline_shape(candidate, stages)

  params, unsharded = param_layout(model, mesh_shape, rules)
  optimizer = params * model.opt_multiple
  gradients = params  # gradients in the parameter dtype, sharded like the parameters
  # Activations per chip for one microbatch: the batch is split over every device, the
  # sequence and tensor axes splitting length and width instead of rows.
  tokens = pdb / accumulation * seq_len
  widths = _widths(cfg)
  layers = cfg.num_decoder_layers
  act_bytes = 2  # bf16
  saved = tokens * act_bytes * layers * (cfg.emb_dim + sum(widths[w] for w in policy.saved_on_device))
  saved *= pipe.live_share
  # A stage works on one pipeline microbatch at a time: its share of the stage's rows.
  working_tokens = tokens * stages / pipe.microbatches if stages > 1 else tokens
  working = working_tokens * act_bytes * (2 * cfg.emb_dim + widths["qkv"])  # one layer's recompute and backward
  if attention_kernel == "dot_product":  # the [heads, L, L] scores of one layer in float32, forward and backward
    working += working_tokens / seq_len * cfg.num_query_heads * seq_len * seq_len * 4 * 2
  logits = tokens * cfg.vocab_size * 4  # float32 logits (their gradient reuses the buffer)
  shard_group = chips // (mesh_shape["data"] * mesh_shape["stage"])
  gathered = model.layer_params * 2 * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"])  # two layers in flight
  gathered = gathered if shard_group > 1 else 0.0
  exchange_rows, routed_rows = moe_exchange_rows(cfg, mesh_shape["expert"], working_tokens)
  activations = saved + working + logits + gathered + exchange_rows * cfg.emb_dim * act_bytes * MOE_EXCHANGE_COPIES
  # Gradients arrive layer by layer as the saved activations are freed: the step needs the larger
  # of the two, plus the running sum when it accumulates microbatches.
  accumulated = gradients if accumulation > 1 else 0.0
  device_optimizer = optimizer * OFFLOADED_OPTIMIZER_ON_DEVICE if offload_opt else optimizer
  total = params + device_optimizer + max(gradients, activations) + accumulated

  global_batch = pdb * chips
  flops = metrics.training_tflops_per_step(cfg, max(1, round(global_batch)), seq_len)
  flops_per_chip = flops.total_tflops * 1e12 / chips
  # Rematerialisation re-runs the forward matmuls it did not save.
  compute_s = flops_per_chip * (1 + policy.recompute + pipe.extra_compute) / (gen.peak_tflops * 1e12) / (1 - pipe.bubble)

  # Collectives per chip per step (ring algorithms: (g-1)/g of the buffer crosses the links).
  def ring(nbytes: float, group: int) -> float:
    return nbytes * (group - 1) / group if group > 1 else 0.0

  full_params_bytes = model.num_params * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"] * mesh_shape["stage"])
  fsdp_group = mesh_shape["fsdp"] * mesh_shape["fsdp_transpose"] * mesh_shape["sequence"]
  gathers = 3 if policy.keeps == "nothing" else 2  # full remat gathers the weights again for the recompute
  ici_fsdp = min(fsdp_group, topology.chips)
  ici_bytes = accumulation * gathers * ring(full_params_bytes, ici_fsdp) + ring(full_params_bytes * 2, ici_fsdp)
  ici_data = mesh_shape["data"] // max(1, num_slices if candidate.get(MeshAxis.DATA.dcn_key, 1) != 1 else 1)
  ici_bytes += 2 * ring(params * 2, ici_data)
  tensor, seq = mesh_shape["tensor"], mesh_shape["sequence"]
  # Tensor and sequence parallelism exchange activations inside each layer, on the critical path.
  critical = accumulation * layers * 6 * ring(tokens * tensor * cfg.emb_dim * act_bytes, tensor)
  critical += accumulation * layers * 3 * ring(tokens * seq * 2 * cfg.num_kv_heads * cfg.head_dim * act_bytes, seq)
  # Expert parallelism's dispatch and combine all-to-alls, forward and backward, wait for their rows.
  ici_experts = int(candidate.get(MeshAxis.EXPERT.ici_key, 1))
  critical += accumulation * expert_layers(cfg) * 4 * ring(routed_rows * cfg.emb_dim * act_bytes, ici_experts) * max(
      1.0, ici_experts / 4)  # bisection-bound on a ring, as the step-time model prices an all-to-all
  # Stage boundaries pass each microbatch's activations forward and their gradients back.
  stage_bytes = 2 * pdb * seq_len * stages * cfg.emb_dim * act_bytes * pipe.repeats if stages > 1 else 0.0
  dcn_stages = int(candidate.get(MeshAxis.STAGE.dcn_key, 1))
  critical += 0.0 if dcn_stages > 1 else stage_bytes
  ici_s = ici_bytes / links.ici
  exposed_s = critical / links.ici
  dcn_bytes = 0.0
  dcn_exposed = stage_bytes if dcn_stages > 1 else 0.0
  dcn_experts = int(candidate.get(MeshAxis.EXPERT.dcn_key, 1))
  if dcn_experts > 1 and cfg.moe.num_experts > 1:  # dispatch and combine all-to-alls, forward and backward
    dcn_exposed += 4 * ring(tokens * accumulation * cfg.moe.num_experts_per_tok * cfg.emb_dim * act_bytes,
                            dcn_experts) * expert_layers(cfg)
  if num_slices > 1:
    dcn_fsdp = int(candidate.get(MeshAxis.FSDP.dcn_key, 1))
    dcn_bytes += 2 * ring(params * 2, int(candidate.get(MeshAxis.DATA.dcn_key, 1)))  # gradient all-reduce
    dcn_bytes += accumulation * gathers * ring(full_params_bytes / ici_fsdp, dcn_fsdp)
  dcn_s = dcn_bytes / links.dcn
  exposed_s += dcn_exposed / links.dcn
  host_bytes = 2 * optimizer if offload_opt else 0.0
  if policy.offloaded:
    host_bytes += 2 * tokens * accumulation * act_bytes * layers * sum(widths[w] for w in policy.saved_on_host)
  host_s = host_bytes / links.host
  # Weight gathers, gradient reductions and DCN overlap with compute; activation exchanges and
  # host transfers (offloaded state and activations) are counted in full.
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
                  unsharded, offloaded_activations(cfg, policy, tokens) * pipe.live_share,
                  optimizer if offload_opt else 0.0)


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
               whole_batches: bool = True) -> Iterator[dict[str, Any]]:
  """Every candidate in the search space that respects the user's `fixed` keys: degrees per
  mesh axis within a slice and across slices (pipeline stages with their schedules and
  microbatch counts among them), remat policy, optimizer offload, batch and gradient
  accumulation. Degrees are powers of two whose product is the device count. Without
  `whole_batches`, batches that do not split into whole rows are kept (for a lower bound)."""
  cfg = model.cfg
  per_slice = topology.chips
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
      "remat_policy": list(SEARCHED_POLICIES),
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
    batches = [0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
  choices["per_device_batch_size"] = batches
  for key in list(choices):
    if key in fixed:
      choices[key] = [fixed[key]]
  keys = list(choices)
  for values in itertools.product(*(choices[k] for k in keys)):
    candidate = dict(zip(keys, values))
    # ici_fsdp_parallelism fills the slice.
    ici = {a: int(candidate[a.ici_key]) for a in ICI_AXES if a is not MeshAxis.FSDP}
    if ici[MeshAxis.STAGE] > 1 and (ici[MeshAxis.SEQUENCE] > 1 or ici[MeshAxis.FSDP_TRANSPOSE] > 1):
      continue  # stages within a slice only beside the common axes: keeps the space small
    rest = math.prod(ici.values())
    fsdp_key = MeshAxis.FSDP.ici_key
    if fsdp_key in fixed and int(fixed[fsdp_key]) != -1:
      if rest * int(fixed[fsdp_key]) != per_slice:
        continue
      candidate[fsdp_key] = int(fixed[fsdp_key])
    else:
      if per_slice % rest:
        continue
      candidate[fsdp_key] = per_slice // rest
    if num_slices > 1:
      dcn = math.prod(int(candidate.get(a.dcn_key, 1)) for a in DCN_AXES)
      if dcn != num_slices:
        continue
    else:
      candidate[MeshAxis.DATA.dcn_key] = 1
    stages = mesh_of(candidate)["stage"]
    fixed_pipeline = {k: fixed[k] for k in PIPELINE_KEYS if k in fixed}
    divides = lambda c: not whole_batches or _batch_divides(c, per_slice * num_slices, seq_len, data_sharding)
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


def _batch_divides(candidate: Mapping[str, Any], chips: int, seq_len: int, data_sharding: Sequence[str]) -> bool:
  """The global (micro)batch splits into whole rows over the data_sharding axes (as config
  validation requires), each pipeline microbatch over the non-stage ones; the length over sequence."""
  mesh = mesh_of(candidate)
  global_batch = float(candidate["per_device_batch_size"]) * chips
  micro = global_batch / int(candidate.get("gradient_accumulation_steps", 1))
  rows = math.prod(mesh[a] for a in data_sharding)
  if mesh["stage"] > 1:
    rows = math.prod(mesh[a] for a in data_sharding if a != "stage") * int(candidate["num_pipeline_microbatches"])
  return micro.is_integer() and global_batch.is_integer() and int(micro) % rows == 0 and seq_len % mesh["sequence"] == 0


# The fewest bytes per chip: whatever the mesh, these settings only lower a candidate's estimate.
LEAN = {"remat_policy": "full", "optimizer_memory_host_offload": True}
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
    """The candidate of least estimated memory over every mesh layout, with full remat, the
    optimizer offloaded and, unless the batch is fixed, one sequence per step (not a valid batch
    for most layouts: only a bound); None when the fixed keys leave no layout."""
    fixed = self.fixed if fixed is None else fixed
    lean: dict[str, Any] = dict(LEAN)
    if self.global_batch is None and "per_device_batch_size" not in fixed:
      lean.update(per_device_batch_size=1 / (topology.chips * num_slices), gradient_accumulation_steps=1)
    best = None
    for candidate in candidates(self.model, topology, num_slices, {**lean, **fixed}, self.global_batch, self.seq_len,
                                self.data_sharding, whole_batches=False):
      found = estimate(self.model, candidate, topology, num_slices, self.seq_len, self.rules, self.attention_kernel)
      if best is None or found.total < best[0].total:
        best = (found, candidate)
    return best

  def fits(self, topology: accelerators.TpuTopology, num_slices: int, limit_share: float,
           fixed: Mapping[str, Any] | None = None) -> bool:
    found = self.leanest(topology, num_slices, fixed)
    return found is not None and found[0].total <= topology.generation.hbm_gib * GIB * limit_share

  def smallest_slice(self, generation: accelerators.TpuGeneration, num_slices: int, above_chips: int,
                     limit_share: float, fixed: Mapping[str, Any]) -> str | None:
    """The smallest slice of `generation` with more than `above_chips` chips where the bound fits
    (a binary search: more chips never need more memory per chip), or None."""
    sizes = [n for n in generation.sizes if n // generation.cores_per_chip > above_chips]
    fitting = lambda n: self.fits(accelerators.tpu_topology(f"{generation.name}-{n}"), num_slices, limit_share, fixed)
    if not sizes or not fitting(sizes[-1]):
      return None
    low, high = 0, len(sizes) - 1  # sizes[high] fits
    while low < high:
      mid = (low + high) // 2
      low, high = (low, mid) if fitting(sizes[mid]) else (mid + 1, high)
    return f"{generation.name}-{sizes[high]}"


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
  limit = gen.hbm_gib * GIB * limit_share
  found = bound.leanest(topology, num_slices)
  if found is not None and found[0].total <= limit:
    return None
  if found is None:
    need = "no mesh layout respects the fixed degrees"
  else:
    e, settings = found
    need = (f"its leanest setting ({describe(settings, shown=('remat_policy', 'optimizer_memory_host_offload'))}) "
            f"needs {e.total / GIB:.1f} GiB per chip (parameters {e.params / GIB:.1f} + optimizer "
            f"{e.optimizer / GIB:.1f} + the larger of gradients {e.gradients / GIB:.1f} and activations "
            f"{e.activations / GIB:.1f})")
  have = f"a {gen.name} chip holds {gen.hbm_gib:g} GiB ({limit / GIB:.1f} with headroom={headroom:g})"
  if bound.fixed and bound.fits(topology, num_slices, limit_share, fixed={}):
    return f"{need}, {have}; drop or change the fixed keys {', '.join(sorted(bound.fixed))}"
  return f"{need}, {have}; {where_it_fits(bound, topology, num_slices, limit_share)}"


def describe(candidate: Mapping[str, Any], shown: Sequence[str] | None = None) -> str:
  """A short label: the non-trivial degrees, then policy, batch, accumulation, offload."""
  parts = []
  for key, value in candidate.items():
    if MeshAxis.of_key(key):
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
