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
what the compile measures; plan.py prints the error of every estimate against its compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
from jax.sharding import AbstractMesh

from MaxText.training import metrics, optimizers
from MaxText.aot.step_time.network import NETWORKS, Network, mesh_axis_bandwidth
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


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the estimate needs from the model, computed once per plan."""

  cfg: ModelConfig
  leaves: tuple[tuple[tuple[int, ...], int, tuple[str | None, ...]], ...]  # (shape, itemsize, logical names)
  opt_multiple: float  # optimizer-state bytes per parameter byte (AdamW: mu and nu)
  num_params: int
  layer_params: int  # in one decoder layer (what FSDP gathers per layer)
  teachers: tuple["Teacher", ...] = ()  # models the objective runs forward-only beside this one

  @classmethod
  def of(cls, cfg: ModelConfig, optim_cfg: OptimConfig | None, teachers: tuple["Teacher", ...] = ()) -> "ModelShape":
    """The shape of `cfg`'s model, trained with `optim_cfg` (None: frozen, no optimizer state)."""
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
    return cls(cfg, leaves, opt_multiple, num_params, layer_params, teachers)


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


def _widths(cfg: ModelConfig) -> dict[remat_policies.Width, float]:
  """Per token and layer, what each width a remat policy keeps (bf16) holds:
  qkv = (N + 2K)·H, out = D (attention output projection), mlp_in = gated·F, mlp_out = D where the
  backward pass reads it (mlp_output_read)."""
  heads = (cfg.num_query_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  mlp = cfg.mlp_dim * (cfg.moe.num_experts_per_tok if cfg.moe.num_experts > 1 else 1)
  return {"qkv": heads, "out": cfg.emb_dim, "mlp_in": mlp * len(cfg.mlp_activations),
          "mlp_out": cfg.emb_dim if mlp_output_read(cfg) else 0,
          "attn": cfg.num_query_heads * cfg.head_dim, "norms": 2 * cfg.emb_dim, "mlp_act": mlp}


def mlp_output_read(cfg: ModelConfig) -> bool:
  """Whether the backward pass reads a dense MLP's output projection (mlpwo), so that a policy keeping it
  keeps it. The shared pre-norm layer only adds it to the residual stream (a MoE layer's shared experts to
  the routed output), whose gradient does not need it, so jax saves none of it; a layer that normalises its
  block outputs, a family's own layer, or a gate on the shared experts reads it."""
  return _layer_reads_mlp_output(cfg.decoder_block) or (cfg.moe.num_experts > 1 and cfg.moe.shared_expert_gate)


@functools.cache
def _layer_reads_mlp_output(decoder_block: str) -> bool:
  from MaxText import families  # noqa: PLC0415  (flax; only the planner needs it here)
  from MaxText.layers import decoders  # noqa: PLC0415
  layer = families.family_for_decoder_block(decoder_block).layer
  if layer is None:
    return False
  own_call = getattr(layer, "__call__", None) is not decoders.DecoderLayer.__call__
  return own_call or bool(getattr(layer, "normalize_block_outputs", True))


@functools.cache
def _layer_norms_query_and_key(decoder_block: str) -> bool:
  """Whether the family's own layer normalises the query and key whatever use_qk_norm says (its record's layer)."""
  from MaxText import families  # noqa: PLC0415  (flax; only the planner needs it here)
  return bool(getattr(families.family_for_decoder_block(decoder_block).layer, "norms_query_and_key", False))


def expert_rows(cfg: ModelConfig, experts: int = 1) -> float:
  """Rows per token of the routed experts' projections as the MoE path that runs lays them out
  (layers/moe.py, moe_dispatch.py), at `experts` expert-parallel degree: the capacity slots [E, B, C, ·],
  E·C per sequence of L tokens (C = L when dropless); sparse_matmul's sorted rows, one per chosen expert;
  under expert parallelism its all-to-all receive buffer (moe_exchange_rows), or with moe_dispatch=gather
  the rows of the whole expert group's tokens on every device."""
  moe = cfg.moe
  if moe.num_experts <= 1:
    return 0.0
  if not moe.sparse_matmul:
    length = cfg.max_target_length
    return moe.num_experts * _expert_capacity(moe, length) / length
  if experts <= 1:
    return float(moe.num_experts_per_tok)
  if moe.moe_dispatch == "all_to_all":
    return moe_exchange_rows(cfg, experts, 1.0)[0]
  return float(experts * moe.num_experts_per_tok)


def _expert_capacity(moe: Any, length: int) -> int:
  from MaxText.layers.moe import expert_capacity  # noqa: PLC0415  (flax; only MoE models need it)
  return expert_capacity(moe, length)


def expert_replication(cfg: ModelConfig, mesh: Mapping[str, int] | None) -> tuple[float, float]:
  """(input projections', output projection's) factor on a routed expert tensor's rows per chip over the
  per-chip tokens. The expert bodies run per batch shard (layers/moe.py, moe_dispatch.py), so their rows
  repeat over the mesh axes that do not split rows (tensor, sequence); the all-to-all bodies split the input
  projections' width over tensor, the capacity path's sharding splits the output projection's."""
  if mesh is None or cfg.moe.num_experts <= 1:
    return 1.0, 1.0
  tensor, seq = mesh["tensor"], mesh["sequence"]
  if mesh["expert"] > 1 and cfg.moe.moe_dispatch == "all_to_all":
    return seq, tensor * seq
  return tensor * seq, (tensor * seq if cfg.moe.sparse_matmul else seq)


def tensor_widths(cfg: ModelConfig, mesh: Mapping[str, int] | None = None) -> dict[str, float]:
  """Per token and layer, the elements of each named activation a remat_policy=custom key places
  (remat_policies.TENSORS); a routed expert's tensors count `expert_rows` rows per token, times their
  repeats over the candidate's `mesh` (expert_replication; None: one chip)."""
  n, k, h, d = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.emb_dim
  moe = cfg.moe.num_experts > 1
  rows = expert_rows(cfg, mesh["expert"] if mesh else 1)
  repeat_in, repeat_out = expert_replication(cfg, mesh)
  routed = cfg.mlp_dim * rows * repeat_in
  dense = cfg.mlp_dim * max(cfg.moe.shared_experts, 1) if not moe or cfg.moe.shared_experts else 0
  rope = cfg.mla.qk_rope_head_dim
  gated = len(cfg.mlp_activations) > 1  # two input projections (layers/mlp.py names them mlpwi_0, mlpwi_1)
  fused_mlp = gated and cfg.fused_mlp  # their one matmul's output is mlpwi, the parts unnamed (as upstream)
  mla = cfg.attn.attention_type == "mla"  # whose attention output is `attention_out`; the others' is `context`
  # MLA's key_proj and value_proj are per query head, its values v_head_dim wide (layers/mla.py).
  key, value = (n * h, n * cfg.mla.v_head_dim) if mla else (k * h, k * h)
  return {"decoder_layer_input": d, "query_proj": n * h, "key_proj": key, "value_proj": value,
          "qkv_proj": (n + 2 * k) * h if cfg.fused_qkv else 0,
          "context": 0 if mla else n * h, "attention_out": n * h if mla else 0, "out_proj": d,
          "query_wa_proj": cfg.mla.q_lora_rank,
          "kv_wa_proj": cfg.mla.kv_lora_rank + rope if mla else 0,
          "mla_q": cfg.mla.q_lora_rank, "mla_kv": cfg.mla.kv_lora_rank if mla else 0,
          "mlpwi": dense * len(cfg.mlp_activations) if fused_mlp or not gated else 0,
          "mlpwi_0": dense if gated and not fused_mlp else 0, "mlpwi_1": dense if gated and not fused_mlp else 0,
          "mlpwo": d if dense and mlp_output_read(cfg) else 0, "moe_mlpwi_0": routed, "moe_mlpwi_1": routed if gated else 0,
          "moe_mlpwo": d * rows * repeat_out}


def placed_tensors(cfg: ModelConfig, policy: remat_policies.RematPolicy) -> dict[str, str]:
  """Each tensor `policy` names, placed (device | offload), and the routed experts' tensors the
  MLP names reach (remat_policies.expert_placements)."""
  placed = {**{n: "device" for n in policy.device}, **{n: "offload" for n in policy.offload}}
  return {**placed, **remat_policies.expert_placements(placed, cfg.moe.sparse_matmul)}


def backward_dots(cfg: ModelConfig) -> dict[str, float]:
  """Per token and layer, projection outputs the backward pass needs that no name covers. query_proj and
  key_proj name the kernel's inputs (after the QK-norm, as upstream), so with use_qk_norm, use_qk_l2_norm
  (computed on every layer of a mixed rope pattern) or Gemma 4's norms, the norms' gradients need the raw
  query and key; the output gate is unnamed, as upstream's. A policy that keeps the dots keeps these
  (kept_width); any other re-runs their matmuls (rerun_flops), whether query_proj and key_proj are kept or not."""
  n, k, h = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  out: dict[str, float] = {}
  if cfg.attn.attention_type != "mla" and (cfg.attn.use_qk_norm or cfg.attn.use_qk_l2_norm
                                           or _layer_norms_query_and_key(cfg.decoder_block)):
    out.update(query_proj=n * h, key_proj=k * h)
  if cfg.attn.attention_output_gate:
    out["output_gate"] = n * h
  return out


def recompute_flops(cfg: ModelConfig) -> dict[str, float]:
  """Per token and layer, the forward FLOPs the backward pass re-runs when a named tensor is not kept:
  the matmul that makes it. The MLP output projections' results feed only the residual add, which no
  backward op needs, so dropping them costs nothing; a norm's output costs no matmul; the attention
  output (`context`, MLA's `attention_out`) is priced per sequence (rerun_flops), as it grows with
  the length. Additive over the tensors, as compiled FLOPs show (tests/test_remat_custom.py)."""
  widths = tensor_widths(cfg)
  d = cfg.emb_dim
  mla = cfg.attn.attention_type == "mla"
  value_dim = cfg.mla.v_head_dim if mla else cfg.head_dim
  # What each projection reads per token: the layer's (normalised) input, MLA's latents for its up-projections.
  reads = {name: d for name in widths}
  reads.update(decoder_layer_input=0, mla_q=0, mla_kv=0, mlpwo=0, moe_mlpwo=0, context=0, attention_out=0)
  reads["qkv_proj"] = 0  # fused_qkv's matmul is counted once, as its query, key and value parts
  if mla:
    reads.update(query_proj=cfg.mla.q_lora_rank or d, key_proj=cfg.mla.kv_lora_rank, value_proj=cfg.mla.kv_lora_rank)
  flops = {name: 2 * reads[name] * width for name, width in widths.items()}
  flops["out_proj"] = 2 * cfg.num_query_heads * value_dim * d
  # A normed query or key kept spares no matmul: the norm's gradient re-runs it anyway (backward_dots).
  flops.update({name: 0.0 for name in backward_dots(cfg) if name in flops})
  return flops


def rerun_flops(cfg: ModelConfig, policy: remat_policies.RematPolicy, seq_len: int) -> float:
  """Forward FLOPs per sequence that `policy`'s backward pass re-runs over every layer: the matmuls
  of the tensors it does not keep, the attention scores (re-run whatever is kept: the softmax's
  backward needs them), and the probabilities-times-values product unless the attention output is kept."""
  if policy.keeps == "everything":
    return 0.0
  kept = {name for name, placed in placed_tensors(cfg, policy).items() if placed != "remat"}
  projections = sum(f for name, f in recompute_flops(cfg).items() if name not in kept)
  if policy.keeps != "dots":
    projections += sum(2 * cfg.emb_dim * width for width in backward_dots(cfg).values())
  value_dim = cfg.mla.v_head_dim if cfg.attn.attention_type == "mla" else cfg.head_dim
  pairs = metrics.attended_pairs(cfg, seq_len, causal=True)
  attention = 2 * cfg.num_query_heads * cfg.head_dim * pairs
  if not kept & {"context", "attention_out"}:
    attention += 2 * cfg.num_query_heads * value_dim * pairs
  return seq_len * cfg.num_decoder_layers * projections + attention


def kernel_rerun_flops(cfg: ModelConfig, seq_len: int, attention_kernel: str) -> float:
  """FLOPs per sequence a training step runs beyond the model's and remat's: splash's backward
  re-runs QK^T for the probabilities in each of its kernels and dO·V^T for their gradient in the dQ
  kernel (aot/step_time/program.splash_matmuls), where the model's count has neither; its fused
  backward (sa_use_fused_bwd_kernel) re-runs QK^T once. use_iota_embed's one-hot lookup is a matmul
  with the table, forward and for the table's gradient, which the model's count (like upstream's)
  leaves out as a lookup. num_vocab_tiling > 1 re-runs the output head's forward matmul in the backward."""
  flops = 4.0 * seq_len * cfg.vocab_size * cfg.emb_dim if cfg.use_iota_embed else 0.0
  if cfg.num_vocab_tiling > 1:
    flops += 2.0 * seq_len * cfg.vocab_size * cfg.emb_dim
  if attention_kernel != "flash":
    return flops
  value_dim = cfg.mla.v_head_dim if cfg.attn.attention_type == "mla" else cfg.head_dim
  pairs = metrics.attended_pairs(cfg, seq_len, causal=True)
  scores, scores_grad = 2 * cfg.num_query_heads * cfg.head_dim * pairs, 2 * cfg.num_query_heads * value_dim * pairs
  return flops + (scores if cfg.attn.attention_blocks.sa_use_fused_bwd_kernel else 2 * scores + scores_grad)


# The MLP tensors behind each preset width (remat_policies' mapping), which a MoE layer prices per tensor.
_MLP_TENSORS: dict[remat_policies.Width, tuple[str, ...]] = {
    "mlp_in": ("mlpwi", "mlpwi_0", "mlpwi_1", "moe_mlpwi_0", "moe_mlpwi_1"), "mlp_out": ("mlpwo", "moe_mlpwo")}


def kept_width(cfg: ModelConfig, policy: remat_policies.RematPolicy, on_host: bool,
               mesh: Mapping[str, int] | None = None) -> float:
  """Elements per token and layer `policy` keeps on the host, or in HBM besides the layer input, averaged
  over the layers: a MoE model's dense-MLP layers (DeepSeek's first_dense_layers, Llama 4's interleaved
  ones) keep their own MLP's (layer_kept_width). A hybrid stack's Gated DeltaNet layers are counted as
  the others."""
  layers, dense = cfg.num_decoder_layers, cfg.num_dense_layers
  kept = layer_kept_width(cfg, policy, on_host, mesh)
  if dense <= 0 or cfg.linear_attn.full_attention_interval > 1 or layers <= 0:
    return kept
  dense_kept = layer_kept_width(cfg.dense_prefix_config(), policy, on_host, mesh)
  return ((layers - dense) * kept + dense * dense_kept) / layers


def layer_kept_width(cfg: ModelConfig, policy: remat_policies.RematPolicy, on_host: bool,
                     mesh: Mapping[str, int] | None = None) -> float:
  """Elements per token one layer of `cfg` keeps (kept_width): a custom placement per tensor, a fixed
  policy by its preset widths (a MoE layer's MLP per tensor, as its path lays the experts' rows out on
  the candidate's `mesh`: tensor_widths)."""
  where = "offload" if on_host else "device"
  if policy.name == "custom":
    widths = tensor_widths(cfg, mesh)
    return sum(widths[n] for n, placed in placed_tensors(cfg, policy).items() if placed == where)
  preset = _widths(cfg)
  saved = policy.saved_on_host if on_host else policy.saved_on_device
  # The dots policies keep the projection outputs no name covers too, where they keep the dots.
  unnamed = sum(backward_dots(cfg).values()) if policy.keeps == "dots" and on_host == policy.offloaded else 0.0
  if cfg.moe.num_experts > 1:
    # Only the MLP tensors a preset's names reach (sparse_matmul's wi_1 carries only moe_mlpwi_1, which no
    # preset names: remat_policies.expert_placements), the shared experts' too; "none" keeps them all.
    widths, placed = tensor_widths(cfg, mesh), placed_tensors(cfg, policy)
    for width, names in _MLP_TENSORS.items():
      preset[width] = sum(widths[n] for n in names if policy.keeps == "everything" or placed.get(n) == where)
  kept = sum(preset[w] for w in saved)
  if policy.keeps == "dots" and cfg.moe.num_experts > 1 and on_host == policy.offloaded:
    # The router's logits (and the shared experts' gate) are dots without batch dimensions.
    kept += cfg.moe.num_experts + (1 if cfg.moe.shared_expert_gate else 0)
  return kept + unnamed


def stream_width(cfg: ModelConfig, policy: remat_policies.RematPolicy) -> float:
  """The layer input's elements per token and layer in HBM: none when it is offloaded."""
  return 0 if "decoder_layer_input" in policy.offload else cfg.emb_dim


def policy_of(candidate: Mapping[str, Any]) -> remat_policies.RematPolicy:
  """A candidate's remat policy: remat_policy's record, or custom's from its placement keys."""
  if candidate["remat_policy"] == "custom":
    return remat_policies.custom({n: str(candidate[n]) for n in remat_policies.TENSORS if n in candidate})
  return remat_policies.by_name(str(candidate["remat_policy"]))


def offloaded_activations(cfg: ModelConfig, policy: remat_policies.RematPolicy, tokens: float,
                          mesh: Mapping[str, int] | None = None) -> float:
  """Bytes (bf16) that `policy` keeps in host memory for `tokens` tokens on a chip, over every layer
  (`mesh`: the candidate's degrees, which size a MoE layer's expert rows per chip: tensor_widths)."""
  return tokens * 2 * cfg.num_decoder_layers * kept_width(cfg, policy, on_host=True, mesh=mesh)


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
  if not moe.sparse_matmul:  # capacity slots, sent and received whole: E·C per sequence (expert_rows)
    slots = tokens * expert_rows(cfg)
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
  policy = policy_of(candidate)
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
  widths = _widths(cfg)
  layers = cfg.num_decoder_layers
  act_bytes = 2  # bf16
  saved = tokens * act_bytes * layers * (stream_width(cfg, policy)
                                         + kept_width(cfg, policy, on_host=False, mesh=mesh_shape))
  saved *= pipe.live_share
  # A stage works on one pipeline microbatch at a time: its share of the stage's rows.
  working_tokens = tokens * stages / pipe.microbatches if stages > 1 else tokens
  working = working_tokens * act_bytes * (2 * cfg.emb_dim + widths["qkv"])  # one layer's recompute and backward
  if attention_kernel == "dot_product":  # the [heads, L, L] scores of one layer in float32, forward and backward
    working += working_tokens / seq_len * cfg.num_query_heads * seq_len * seq_len * 4 * 2
  # Float32 logits (their gradient reuses the buffer); num_vocab_tiling keeps one tile's at a time.
  logits = tokens * cfg.vocab_size * 4 / cfg.num_vocab_tiling
  shard_group = chips // (mesh_shape["data"] * mesh_shape["stage"])
  gathered = model.layer_params * 2 * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"])  # two layers in flight
  gathered = gathered if shard_group > 1 else 0.0
  exchange_rows, routed_rows = moe_exchange_rows(cfg, mesh_shape["expert"], working_tokens)
  activations = saved + working + logits + gathered + exchange_rows * cfg.emb_dim * act_bytes * MOE_EXCHANGE_COPIES
  # Gradients arrive layer by layer as the saved activations are freed: the step needs the larger
  # of the two, plus the running sum when it accumulates microbatches.
  accumulated = gradients if accumulation > 1 else 0.0
  device_optimizer = optimizer * OFFLOADED_OPTIMIZER_ON_DEVICE if offload_opt else optimizer
  # A teacher's weights stay beside the student's; its output (log-probs) lives through the student's
  # step; its forward runs before the student's, its one layer and logits live only then.
  teacher_params = sum(param_layout(t.shape, mesh_shape, rules)[0] for t in model.teachers)
  activations += sum(t.held_bytes_per_token for t in model.teachers) * tokens
  for t in model.teachers:
    t_cfg, t_tokens = t.shape.cfg, tokens if t.per_micro_batch else tokens * accumulation
    t_gathered = t.shape.layer_params * 2 * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"])
    t_working = t_tokens * (act_bytes * (2 * t_cfg.emb_dim + _widths(t_cfg)["qkv"]) + t_cfg.vocab_size * 4 * 2)
    activations = max(activations, t_working + (t_gathered if shard_group > 1 else 0.0))
  total = params + teacher_params + device_optimizer + max(gradients, activations) + accumulated

  flops = metrics.training_tflops_per_step(cfg, max(1, round(global_batch)), seq_len,
                                           forward_only=tuple(t.shape.cfg for t in model.teachers))
  flops_per_chip = flops.total_tflops * 1e12 / chips
  # Rematerialisation re-runs the forward matmuls whose results it did not keep.
  recompute = rerun_flops(cfg, policy, seq_len) * global_batch / chips
  executed = flops_per_chip * (1 + pipe.extra_compute) + recompute + kernel_rerun_flops(
      cfg, seq_len, attention_kernel) * global_batch / chips
  compute_s = executed / (gen.peak_tflops * 1e12) / (1 - pipe.bubble)

  # Collectives per chip per step (ring algorithms: (g-1)/g of the buffer crosses the links).
  def ring(nbytes: float, group: int) -> float:
    return nbytes * (group - 1) / group if group > 1 else 0.0

  full_params_bytes = model.num_params * 2 / max(1, mesh_shape["tensor"] * mesh_shape["expert"] * mesh_shape["stage"])
  fsdp_group = mesh_shape["fsdp"] * mesh_shape["fsdp_transpose"] * mesh_shape["sequence"]
  gathers = 3 if policy.keeps == "nothing" else 2  # full remat gathers the weights again for the recompute
  ici_fsdp = min(fsdp_group, topology.chips)
  ici_bytes = accumulation * gathers * ring(full_params_bytes, ici_fsdp) + ring(full_params_bytes * 2, ici_fsdp)
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
  critical_s += accumulation * expert_layers(cfg) * 4 * ring(routed_rows * cfg.emb_dim * act_bytes, ici_experts) * max(
      1.0, ici_experts / 4) / in_layer_bandwidth(topology, candidate, "expert", links)
  # Stage boundaries pass each microbatch's activations forward and their gradients back.
  stage_bytes = 2 * pdb * seq_len * stages * cfg.emb_dim * act_bytes * pipe.repeats if stages > 1 else 0.0
  dcn_stages = int(candidate.get(MeshAxis.STAGE.dcn_key, 1))
  critical_s += 0.0 if dcn_stages > 1 else stage_bytes / links.ici
  ici_s = ici_bytes / links.ici
  exposed_s = critical_s
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
    dcn_bytes += sum(n * ring(nbytes / ici_fsdp, dcn_fsdp) for n, nbytes in teacher_gathers)
  dcn_s = dcn_bytes / links.dcn
  exposed_s += dcn_exposed / links.dcn
  host_bytes = 2 * optimizer if offload_opt else 0.0
  if policy.offloaded:
    host_bytes += 2 * tokens * accumulation * act_bytes * layers * kept_width(cfg, policy, on_host=True,
                                                                              mesh=mesh_shape)
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
                  unsharded, offloaded_activations(cfg, policy, tokens, mesh_shape) * pipe.live_share,
                  optimizer if offload_opt else 0.0, recompute, teacher_params)


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
