"""The model's configuration group: the keys that shape and run the decoder, as typed records.

Every field is named after its base.yml key (config_fields.key) or derived from keys (sizes
after global_parameter_scale, the pipeline stage count from the mesh, kernel tile sizes).
ModelConfig holds the core shape and one record per feature (rope, attn, mla, moe, mtp, vision
(vision_config.py), pipeline, lora); a layer takes the root, or only the record it reads. The keys
are validated together (model_checks.py) before the records are built. Building it does no I/O.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.configuration import model_checks as checks
from MaxText.configuration.config_fields import ARCHITECTURE, FIXED, LAYOUT, MODEL, OPTIMIZER, DATA_POSITION, derived, key, key_fields, keys_where, read_keys, record
from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.model_checks import parameter_scales, positive
from MaxText.configuration import remat_policies
from MaxText.configuration.layer_shapes_config import LayerShapesConfig
from MaxText.configuration.vision_config import VisionConfig

if TYPE_CHECKING:
  from MaxText.configuration.config_groups import MeshConfig


# remat_policy=custom: one key per named activation (remat_policies.TENSORS), each remat | device | offload.
RematPlacements = dataclasses.make_dataclass(
    "RematPlacements", [(name, str, key()) for name in remat_policies.TENSORS], frozen=True, kw_only=True)


def remat_placements_from_values(v: Mapping[str, Any]) -> Any:
  """The placement keys, checked: each a placement, and only read with remat_policy=custom."""
  placements = read_keys(RematPlacements, v)
  problems = remat_policies.check_placements(placements)
  _require(not problems, "; ".join(problems))
  if v["remat_policy"] != "custom":
    moved = [f"{n}={p}" for n, p in placements.items() if p != ("device" if n in remat_policies.NOT_RECOMPUTABLE
                                                                     else "remat")]
    _require(not moved, f"{', '.join(moved)} place activations only with remat_policy=custom (it is "
             f"{v['remat_policy']!r}); add remat_policy=custom, or drop them")
  else:
    off = remat_policies.not_produced(v)
    named = v.get("model_name", "default")
    model = v["decoder_block"] if named == "default" else f"{named} ({v['decoder_block']})"
    for name in sorted(n for n, p in placements.items()
                       if p != "remat" and (n not in remat_policies.PRODUCED or n in off)):
      if name in off:
        warn_unproduced(name, placements[name], model, off[name])
      else:
        warn_unproduced(name, placements[name], None, "the key is accepted so that upstream recipes run as written")
  return RematPlacements(**placements)


_WARNED_UNPRODUCED: set[str] = set()


def warn_unproduced(name: str, placement: str, model: str | None, why: str) -> None:
  """One warning line, once per process per name (a planner builds many configs and models), that the
  placement `name`=`placement` places nothing: no layer of `model` (None: of any model here) produces it."""
  if name in _WARNED_UNPRODUCED:
    return
  _WARNED_UNPRODUCED.add(name)
  where = f"no layer of {model} produces {name!r}" if model else f"no layer here produces {name!r}"
  print(f"warning: {name}={placement} places nothing: {where} ({why})", file=sys.stderr, flush=True)


_WARNED_QWIX: set[str] = set()
_WARNED_UNUSED_KERNEL: set[str] = set()


def _note_unused_grouped_matmul(v: Mapping[str, Any]) -> None:
  """moe_grouped_matmul=megablox (upstream's megablox=true) picks the kernel of sparse_matmul, whose default here
  is False where upstream's is True: a recipe that sets only megablox runs padded dense experts, not that kernel."""
  if v["num_experts"] <= 1 or v["sparse_matmul"] or v["moe_grouped_matmul"] != "megablox" or _WARNED_UNUSED_KERNEL:
    return
  _WARNED_UNUSED_KERNEL.add("megablox")
  print("warning: moe_grouped_matmul=megablox (upstream's megablox=true) is the kernel of sparse_matmul, which is False "
        "(upstream's default is True): the experts run as padded dense matmuls; set sparse_matmul=True to run the "
        "grouped matmuls", file=sys.stderr, flush=True)


def _note_qwix(v: Mapping[str, Any]) -> None:
  """Upstream's use_qwix_quantization picks the library behind its `quantization`; here `quantization` has
  one implementation, whose backward differs from Qwix's (which quantizes the gradients' matmuls too)."""
  mode = v["quantization"]
  if not (v["use_qwix_quantization"] and mode) or mode in _WARNED_QWIX:
    return
  _WARNED_QWIX.add(mode)
  backward = ("straight-through in dtype" if mode == "int8" else "e5m2 gradients, per-tensor scales" if mode == "fp8"
              else "MXFP8 gradients")
  print(f"warning: use_qwix_quantization=True: quantization={mode} runs this project's own implementation (backward: "
        f"{backward}), not Qwix's, which quantizes the backward matmuls to the forward's type; see "
        "getting_started/Low_precision.md", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBlocks:
  """Tile sizes of attention=flash: flash_* for the chunked JAX kernel (CPU, GPU), sa_* for TPU splash."""
  flash_block_q: int = key()
  flash_block_kv: int = key()
  sa_block_q: int = key()
  sa_block_kv: int = key()
  sa_block_kv_compute: int = key()
  sa_block_q_dkv: int = key()
  sa_block_kv_dkv: int = key()
  sa_block_kv_dkv_compute: int = key()
  sa_block_q_dq: int = key()
  sa_block_kv_dq: int = key()
  sa_use_fused_bwd_kernel: bool = key()  # splash's backward as one kernel (dQ with dK/dV): sa_block_*_dq unused

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "AttentionBlocks":
    blocks = read_keys(cls, v)
    sizes = [name for name in blocks if "_block_" in name]
    positive(blocks, *sizes)
    for name in sizes:
      if name.startswith("sa_"):  # splash tiles are laid over the TPU's 128-lane vector registers
        _require(v[name] % 128 == 0, f"{name} must be a multiple of 128 (TPU lanes), got {v[name]}")
    for compute, block in (("sa_block_kv_compute", "sa_block_kv"), ("sa_block_kv_dkv_compute", "sa_block_kv_dkv")):
      _require(v[block] % v[compute] == 0, f"{compute} ({v[compute]}) must divide {block} ({v[block]})")
    return cls(**blocks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
  """Rotary position embedding (position_embedding=rope): frequencies, scaling and per-layer use."""
  rope_min_timescale: float = key(architecture=True)
  rope_max_timescale: float = key(architecture=True)
  rope_interleaved: bool = key(architecture=True)
  rope_type: str = key(architecture=True)  # default | llama3 | linear | yarn | proportional
  rope_proportional_rotated_fraction: float = key(architecture=True)  # rope_type=proportional: share of pairs that turn
  rope_local_max_timescale: float = key(architecture=True)  # 0 = local layers use the global RoPE
  rope_yarn_beta_fast: float = key(architecture=True)
  rope_yarn_beta_slow: float = key(architecture=True)
  rope_yarn_truncate: bool = key(architecture=True)
  rope_attention_factor: float = key(architecture=True)  # 0 = YaRN's default from the factor
  rope_scaling_factor: float = key(architecture=True)
  rope_low_freq_factor: float = key(architecture=True)
  rope_high_freq_factor: float = key(architecture=True)
  rope_original_max_position: int = key(architecture=True)
  rope_layer_pattern: tuple[str, ...] = key(architecture=True)  # cycled over layers: rope | nope
  rope_yarn_mscale_all_dim: float = key(architecture=True)  # 0 = no softmax-scale correction (MLA)
  partial_rotary_factor: float = key(architecture=True)  # the rotated share of each head's features (1 = all)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
  """Which attention layer and kernel, its per-layer masks and logit shaping, and how it splits
  the sequence over the `sequence` mesh axis. `attention` (the key) names the kernel."""
  attention_type: str = key(architecture=True)  # gqa | mla (layers/mla.py) | gated_deltanet (layers/gated_deltanet.py)
  attention_output_gate: bool = key(architecture=True)  # Qwen3-Next: sigmoid(x W_gate) scales the heads' output
  attention_layer_pattern: tuple[str, ...] = key(architecture=True)  # cycled over layers: global | local | chunked
  sliding_window_size: int = key(architecture=True)
  attention_chunk_size: int = key(architecture=True)  # chunked layers attend within fixed chunks of positions
  attention_sinks: bool = key(architecture=True)  # a learned per-head logit in every softmax (GPT-OSS)
  attn_logits_soft_cap: float = key(architecture=True)  # 0 = off
  use_qk_norm: bool = key(architecture=True)  # RMSNorm over each query / key head before RoPE
  qk_norm_over_all_heads: bool = key(architecture=True)  # OLMo 2/3: one RMSNorm over all heads' queries (keys) at once
  use_qk_l2_norm: bool = key(architecture=True)  # weightless RMS norm of q / k after RoPE, RoPE layers only
  attn_temperature_floor_scale: float = key(architecture=True)  # 0 = off; NoPE layers' query temperature
  attn_temperature_scale: float = key(architecture=True)
  query_pre_attn_scalar: float = key(architecture=True)  # 0 = head_dim
  attention: str = key()
  context_parallel_strategy: str = key()  # all_gather | ring | all_to_all over the `sequence` axis
  context_parallel_load_balance: bool = key()  # zig-zag chunk order so causal work is equal per shard
  context_parallel_degree: int = derived(1)  # shards of the sequence (the `sequence` mesh axis)
  # Synthetic data (no mixture, no RL rollouts): every row is one full-length document, so attention
  # needs no document mask.
  rows_hold_one_document: bool = derived(False)
  attention_blocks: AttentionBlocks = record(AttentionBlocks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
  """Gated DeltaNet (layers/gated_deltanet.py): its shape, and where it runs in a hybrid stack."""
  full_attention_interval: int = key(architecture=True)  # k > 1: every k-th layer full attention, the others Gated DeltaNet
  linear_num_key_heads: int = key(architecture=True)
  linear_num_value_heads: int = key(architecture=True)
  linear_key_head_dim: int = key(architecture=True)
  linear_value_head_dim: int = key(architecture=True)
  linear_conv_kernel_dim: int = key(architecture=True)
  linear_attention_chunk_size: int = key()  # tokens per chunk of the chunked (training, prefill) form


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaConfig:
  """Multi-head latent attention's low-rank projections (attention_type=mla)."""
  q_lora_rank: int = key(architecture=True)  # 0 = a direct query projection
  kv_lora_rank: int = key(architecture=True)
  qk_nope_head_dim: int = key(architecture=True)
  qk_rope_head_dim: int = key(architecture=True)
  v_head_dim: int = key(architecture=True)
  index_topk: int = key(architecture=True)  # DeepSeek Sparse Attention's keys per query (0 = dense MLA; indexer.py)
  index_n_heads: int = key(architecture=True)  # the lightning indexer's query heads
  index_head_dim: int = key(architecture=True)  # its query heads' and shared key's width
  # The indexer's own training (indexer.py, "Training the indexer"): the weight of its KL loss
  # (0 = the indexer stays as loaded, no loss computed) and the dense warm-up stage.
  indexer_loss_scaling_factor: float = key()
  indexer_warmup: bool = key(fixed_on_resume=OPTIMIZER)  # dense attention; only the indexer trains


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
  """The mixture-of-experts MLP: routing, which layers have it, and how tokens reach the experts."""
  num_experts: int = key(architecture=True)  # 1 = dense MLP
  num_experts_per_tok: int = key(architecture=True)
  shared_experts: int = key(architecture=True)  # 0 = none
  shared_expert_gate: bool = key(architecture=True)  # Qwen3-Next: sigmoid(x W) scales the shared experts' output
  norm_topk_prob: bool = key(architecture=True)  # renormalise the k routing weights to sum to one
  moe_router_scales_input: bool = key(architecture=True)  # Llama 4: sigmoid(top logit) scales the expert input
  moe_score_function: str = key(architecture=True)  # softmax | sigmoid
  moe_score_correction_bias: bool = key(architecture=True)  # a per-expert bias for the choice only
  moe_num_groups: int = key(architecture=True)  # experts in this many groups (1 = no group limit)
  moe_topk_groups: int = key(architecture=True)  # a token's experts come from its best this many groups
  moe_group_score: str = key(architecture=True)  # max | top2_sum: a group's score from its experts'
  routed_scaling_factor: float = key(architecture=True)  # multiplies the routing weights
  first_dense_layers: int = key(architecture=True)  # leading layers with a dense MLP (the dense_layers stack)
  dense_mlp_dim: int = key(architecture=True)  # their MLP width (0 = mlp_dim)
  moe_layer_interval: int = key(architecture=True)  # every this-many-th layer is MoE, the others dense (1 = all)
  capacity_factor: float = key()  # <= 0 = dropless
  sparse_matmul: bool = key()  # dropless experts as grouped matmuls (jax.lax.ragged_dot)
  load_balance_loss_weight: float = key()
  moe_dispatch: str = key()  # all_to_all | gather (layers/moe_dispatch.py)
  moe_all_to_all: str = key()  # auto | ragged | padded
  moe_ragged_buffer_factor: float = key()  # <= 0: worst-case receive buffer (dropless)
  moe_grouped_matmul: str = key()  # auto | ragged_dot | megablox (layers/grouped_matmul.py)
  use_custom_sort_vjp: bool = key()  # sparse_matmul: the sorts' gradients gathered back (experts.permute_rows)
  moe_bias_update_rate: float = key()  # the correction bias's step per train step (0 = fixed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpConfig:
  """Multi-token prediction (layers/mtp.py)."""
  mtp_num_layers: int = key(architecture=True)  # multi-token-prediction modules after the stack (0 = none)
  mtp_loss_scaling_factor: float = key()  # λ: the mean of the MTP depths' losses enters the loss times this


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
  """Pipeline parallelism over the `stage` mesh axis (layers/pipeline.py, pipeline_1f1b.py)."""
  pipeline_schedule: str = key()  # gpipe | circular | 1f1b (interleaved with num_pipeline_repeats > 1)
  num_pipeline_repeats: int = key()
  num_pipeline_microbatches: int = key()  # -1 resolved to the number of stages
  num_pipeline_stages: int = derived(1)  # 1 = no pipeline
  layers_per_pipeline_stage: int = derived(1)  # decoder layers one stage runs per pass (per repeat)

  @property
  def num_layers(self) -> int:
    """The decoder layers the stages run, all passes together (num_decoder_layers)."""
    return self.num_pipeline_stages * self.num_pipeline_repeats * self.layers_per_pipeline_stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """LoRA adapters (MaxText/training/lora.py): a resume keeps them, since they are the trained state."""
  lora_rank: int = key(fixed_on_resume=LAYOUT)  # 0 = off
  lora_alpha: float = key(fixed_on_resume=LAYOUT)
  lora_target_modules: tuple[str, ...] = key(fixed_on_resume=LAYOUT)  # PEFT's names (LORA_TARGETS)

  def adapter(self, target: str) -> dict[str, Any]:
    """DenseGeneral's adapter arguments for the projection PEFT calls `target` (none when untargeted)."""
    if self.lora_rank <= 0 or target not in self.lora_target_modules:
      return {}
    return {"lora_rank": self.lora_rank, "lora_scale": self.lora_alpha / self.lora_rank}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """The root record: the decoder's core shape and dtypes, with one nested record per feature.
  The records sit between the architecture keys and the rest so that the key lists read off the
  fields (ARCHITECTURE_KEYS, MODEL_KEYS, the resume groups) keep architecture keys first."""
  # Keys that fix a checkpoint's parameter shapes and the function they compute.
  decoder_block: str = key(architecture=True)
  base_emb_dim: int = key(architecture=True)
  base_num_query_heads: int = key(architecture=True)
  base_num_kv_heads: int = key(architecture=True)
  base_mlp_dim: int = key(architecture=True)
  base_num_decoder_layers: int = key(architecture=True)
  head_dim: int = key(architecture=True)
  vocab_size: int = key(architecture=True)
  mlp_activations: tuple[str, ...] = key(architecture=True)
  swiglu_limit: float = key(architecture=True)  # 0 = the clamped activations do not clip
  swiglu_alpha: float = key(architecture=True)
  normalization_type: str = key(architecture=True)  # rms | rms_plus_one | layer
  normalization_layer_epsilon: float = key(architecture=True)
  use_bias: bool = key(architecture=True)
  position_embedding: str = key(architecture=True)  # rope | learned | sinusoidal
  max_position_embeddings: int = key(architecture=True)
  final_logits_soft_cap: float = key(architecture=True)  # 0 = off
  scale_embedding: bool = key(architecture=True)
  logits_via_embedding: bool = key(architecture=True)
  rope: RopeConfig = record(RopeConfig)
  attn: AttentionConfig = record(AttentionConfig)
  mla: MlaConfig = record(MlaConfig)
  linear_attn: LinearAttentionConfig = record(LinearAttentionConfig)
  moe: MoeConfig = record(MoeConfig)
  mtp: MtpConfig = record(MtpConfig)
  vision: VisionConfig = record(VisionConfig)
  layer_shapes: LayerShapesConfig = record(LayerShapesConfig)
  global_parameter_scale: int = key(fixed_on_resume=MODEL)
  scan_layers: bool = key(fixed_on_resume=LAYOUT)
  weight_dtype: str = key(fixed_on_resume=LAYOUT)
  # How it runs.
  dtype: str = key()
  dropout_rate: float = key()  # the rate the layers apply: 0 with enable_dropout=False
  enable_dropout: bool = key()
  logits_dot_in_fp32: bool = key()
  num_vocab_tiling: int = key()  # the output head and loss in this many tiles (models/outputs.py)
  use_iota_embed: bool = key()  # the token lookup as a one-hot matmul (layers/embeddings.py)
  fused_qkv: bool = key()  # q, k, v from one matmul over their stacked kernels (linears.fused_outputs)
  fused_mlp: bool = key()  # the MLP's input projections from one matmul, likewise
  remat_policy: str = key()
  remat_placements: Any = record(RematPlacements)  # remat_policy=custom's placement keys
  max_target_length: int = key(fixed_on_resume=DATA_POSITION)
  quantization: str = key()  # "" | int8 | fp8 | mxfp8: the decoder stack's matmuls (layers/quantization.py)
  use_qwix_quantization: bool = key()  # upstream's choice between its AQT and Qwix; one implementation here
  pipeline: PipelineConfig = record(PipelineConfig)
  lora: LoraConfig = record(LoraConfig)
  # Derived: sizes after global_parameter_scale.
  emb_dim: int = derived()
  num_query_heads: int = derived()
  num_kv_heads: int = derived()
  mlp_dim: int = derived()
  num_decoder_layers: int = derived()

  @property
  def remat(self) -> remat_policies.RematPolicy:
    """The remat policy the layers run: remat_policy's record, or custom's from its placement keys."""
    if self.remat_policy == "custom":
      return remat_policies.custom(dataclasses.asdict(self.remat_placements))
    return remat_policies.by_name(self.remat_policy)

  @property
  def layer_period(self) -> int:
    """Layers per period of an interleaved stack: the last of each in `layers`, the others in
    `dense_layers` (moe_layer_interval: dense-MLP layers; full_attention_interval: Gated DeltaNet
    layers); 1 = no interleaving."""
    return max(self.moe.moe_layer_interval, self.linear_attn.full_attention_interval, 1)

  @property
  def num_dense_layers(self) -> int:
    """Layers of the `dense_layers` stack: the first_dense_layers prefix, or the layers between the
    last ones of each period (layer_period)."""
    per_period = self.layer_period - 1
    return self.moe.first_dense_layers + self.num_decoder_layers // self.layer_period * per_period

  @property
  def num_moe_stack_layers(self) -> int:
    """Layers of the `layers` stack: every decoder layer that is not in `dense_layers`."""
    return self.num_decoder_layers - self.num_dense_layers

  def stack_position(self, layer: int) -> tuple[str, int]:
    """(stack, index in it) of decoder layer `layer`: "dense_layers" or "layers"."""
    interval = self.layer_period
    if layer < self.moe.first_dense_layers:
      return "dense_layers", layer
    if interval == 1:
      return "layers", layer - self.moe.first_dense_layers
    period, offset = divmod(layer, interval)
    if offset == interval - 1:
      return "layers", period
    return "dense_layers", period * (interval - 1) + offset

  def dense_stack_config(self) -> "ModelConfig":
    """The configuration the `dense_layers` stack is built with: Gated DeltaNet in place of attention
    in a hybrid stack (full_attention_interval), else `dense_prefix_config`."""
    if self.linear_attn.full_attention_interval > 1:
      return dataclasses.replace(self, attn=dataclasses.replace(self.attn, attention_type="gated_deltanet"))
    return self.dense_prefix_config()

  def dense_prefix_config(self) -> "ModelConfig":
    """The configuration the first_dense_layers prefix is built with: a dense MLP of dense_mlp_dim."""
    return dataclasses.replace(self, moe=dataclasses.replace(self.moe, num_experts=1, shared_experts=0),
                               mlp_dim=self.moe.dense_mlp_dim or self.mlp_dim)

  @property
  def layers_per_pipeline_stage(self) -> int:
    """Decoder layers one stage runs per pass (per repeat)."""
    return self.pipeline.layers_per_pipeline_stage
  @classmethod
  def from_values(cls, v: Mapping[str, Any], mesh: "MeshConfig", global_batch: int) -> "ModelConfig":
    checks.check_core(v)
    s = parameter_scales(v["global_parameter_scale"])
    num_q, num_kv = v["base_num_query_heads"] * s["heads"], v["base_num_kv_heads"] * s["heads"]
    checks.check_positions_and_attention(v)
    checks.check_moe(v)
    checks.check_mla(v)
    checks.check_linear_attention(v)
    checks.check_quantization(v)
    _note_qwix(v)
    _note_unused_grouped_matmul(v)
    checks.check_lora(v)
    layers = v["base_num_decoder_layers"] * s["layers"]
    pipelined = dict(mesh.shape)["stage"] > 1
    checks.check_layer_layout(v, layers, pipelined)
    stages, micro = checks.check_pipeline(v, mesh, global_batch, layers)
    context = dict(mesh.shape)["sequence"]
    checks.check_context_parallel(v, context, num_q, num_kv)
    checks.check_vocab_tiling(v, context, pipelined)
    vision = VisionConfig.from_values(v, pipelined=pipelined, context_parallel=context > 1)
    attn = AttentionConfig(**read_keys(AttentionConfig, v), context_parallel_degree=context,
                           rows_hold_one_document=(v["dataset_type"] == "synthetic" and not v["data_mixture"]
                                                   and v["objective"] != "grpo"),
                           attention_blocks=AttentionBlocks.from_values(v))
    pipeline = PipelineConfig(**read_keys(PipelineConfig, v, num_pipeline_microbatches=micro), num_pipeline_stages=stages,
                              layers_per_pipeline_stage=layers // (stages * v["num_pipeline_repeats"]))
    layer_shapes = LayerShapesConfig.from_values(v, num_layers=layers, pipelined=pipelined)
    # A stack of differing layers (Gemma 4) is never scanned: each layer has its own shapes.
    scan_layers = v["scan_layers"] and not layer_shapes.active
    dropout_rate = v["dropout_rate"] if v["enable_dropout"] else 0.0
    return cls(**read_keys(cls, v, scan_layers=scan_layers, dropout_rate=dropout_rate), rope=RopeConfig(**read_keys(RopeConfig, v)), attn=attn,
               mla=MlaConfig(**read_keys(MlaConfig, v)),
               linear_attn=LinearAttentionConfig(**read_keys(LinearAttentionConfig, v)), moe=MoeConfig(**read_keys(MoeConfig, v)),
               mtp=MtpConfig(**read_keys(MtpConfig, v)), vision=vision,
               layer_shapes=layer_shapes, pipeline=pipeline, lora=LoraConfig(**read_keys(LoraConfig, v)),
               remat_placements=remat_placements_from_values(v),
               emb_dim=v["base_emb_dim"] * s["emb"], num_query_heads=num_q, num_kv_heads=num_kv,
               mlp_dim=v["base_mlp_dim"] * s["mlp"], num_decoder_layers=layers)



# The keys that fix a checkpoint's architecture (written to model_config.yml beside a converted
# checkpoint), and those a tool reading a run takes from its saved configuration.
ARCHITECTURE_KEYS = keys_where((ModelConfig,), ARCHITECTURE, True)
MODEL_KEYS = keys_where((ModelConfig,), FIXED, MODEL)
# A LoRA run's checkpoints hold adapters: a tool reading the run (or its checkpoints) needs these
# too to read them (run_record.saved_model_keys); an export merges them and carries none.
LORA_KEYS = tuple(f.name for f in key_fields(LoraConfig))
