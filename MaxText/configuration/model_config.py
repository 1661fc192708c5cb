"""The model's configuration group: the keys that shape and run the decoder, validated together.

Every field is named after its base.yml key (config_fields.key) or derived from keys (sizes
after global_parameter_scale, the pipeline stage count from the mesh, kernel tile sizes).
ModelConfig holds the core shape and one record per feature (rope, attn, mla, moe, mtp, vision
(vision_config.py), pipeline, lora); a layer takes the root, or only the record it reads. Building it does no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.configuration.config_fields import ARCHITECTURE, FIXED, LAYOUT, MODEL, OPTIMIZER, DATA_POSITION, derived, key, key_fields, keys_where, read_keys, record
from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.remat_policies import NAMES as REMAT_POLICY_NAMES
from MaxText.configuration.layer_shapes_config import LayerShapesConfig
from MaxText.configuration.vision_config import VisionConfig

if TYPE_CHECKING:
  from MaxText.configuration.config_groups import MeshConfig

QUANTIZATION_MODES = ("", "int8", "fp8", "mxfp8")  # layers/quantization.py runs each
ATTENTION_KINDS = ("dot_product", "flash", "cudnn_flash", "autoselected")
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring", "all_to_all")  # layers/context_parallel.py, ring_attention.py
MOE_DISPATCHES = ("all_to_all", "gather")
ALL_TO_ALL_KINDS = ("auto", "ragged", "padded")
GROUPED_MATMUL_KINDS = ("auto", "ragged_dot", "megablox")
ACTIVATIONS = ("silu", "gelu", "relu", "linear", "tanh", "clamped_swish", "clamped_plus_one")
DTYPES = ("float32", "bfloat16", "float16")
NORMALIZATION_TYPES = ("rms", "rms_plus_one", "layer")
POSITION_EMBEDDINGS = ("rope", "learned", "sinusoidal")
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "proportional")
ATTENTION_LAYER_KINDS = ("global", "local", "chunked")
ROPE_LAYER_KINDS = ("rope", "nope")
ATTENTION_TYPES = ("gqa", "mla", "gated_deltanet")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("max", "top2_sum")
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")


def positive(values: Mapping[str, Any], *keys: str) -> None:
  for name in keys:
    _require(values[name] > 0, f"{name} must be > 0, got {values[name]}")


def one_of(v: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> None:
  _require(v[name] in allowed, f"{name} must be one of {', '.join(allowed)}; got {v[name]!r}")


def parameter_scales(global_parameter_scale: int) -> dict[str, int]:
  """Per-dimension multipliers for `global_parameter_scale` (a power of two, 2**k).

  Parameters grow with width × heads × layers, so each doubling of the scale
  doubles one dimension in turn, cycling heads+mlp → embedding → layers.
  Three doublings (8x parameters) double heads, mlp, embedding and layers once
  each: with k = 3q + r, heads and mlp scale by 2**(q + (r>=1)), the embedding
  by 2**(q + (r>=2)) and layers by 2**q.
  """
  scale = global_parameter_scale
  _require(scale >= 1 and scale & (scale - 1) == 0,
           f"global_parameter_scale must be a power of two (1, 2, 4, ...), got {scale}")
  q, r = divmod(int(math.log2(scale)), 3)
  heads = 2 ** (q + (r >= 1))
  return {"emb": 2 ** (q + (r >= 2)), "heads": heads, "mlp": heads, "layers": 2**q}


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

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "AttentionBlocks":
    blocks = read_keys(cls, v)
    positive(blocks, *blocks)
    for name in blocks:
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
  dropout_rate: float = key()
  logits_dot_in_fp32: bool = key()
  remat_policy: str = key()
  max_target_length: int = key(fixed_on_resume=DATA_POSITION)
  quantization: str = key()  # "" | int8 | fp8 | mxfp8: the decoder stack's matmuls (layers/quantization.py)
  pipeline: PipelineConfig = record(PipelineConfig)
  lora: LoraConfig = record(LoraConfig)
  # Derived: sizes after global_parameter_scale.
  emb_dim: int = derived()
  num_query_heads: int = derived()
  num_kv_heads: int = derived()
  mlp_dim: int = derived()
  num_decoder_layers: int = derived()

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
    positive(v, "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
              "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length")
    s = parameter_scales(v["global_parameter_scale"])
    num_q, num_kv = v["base_num_query_heads"] * s["heads"], v["base_num_kv_heads"] * s["heads"]
    _require(num_q % num_kv == 0,
             f"num_query_heads ({num_q}) must be a multiple of num_kv_heads ({num_kv}) for grouped-query attention")
    one_of(v, "remat_policy", REMAT_POLICY_NAMES)
    one_of(v, "attention", ATTENTION_KINDS)
    for name in ("dtype", "weight_dtype"):
      one_of(v, name, DTYPES)
    acts = tuple(v["mlp_activations"])
    _require(len(acts) >= 1 and all(a in ACTIVATIONS for a in acts),
             f"mlp_activations must be a non-empty list of {', '.join(ACTIVATIONS)}; got {list(acts)}")
    _require(v["swiglu_limit"] >= 0 and v["swiglu_alpha"] > 0,
             f"swiglu_limit must be >= 0 (0 = no clipping) and swiglu_alpha > 0; got {v['swiglu_limit']}, "
             f"{v['swiglu_alpha']}")
    _require(0.0 <= v["dropout_rate"] < 1.0, f"dropout_rate must be in [0, 1), got {v['dropout_rate']}")
    _check_positions_and_attention(v)
    _check_moe(v)
    _check_mla(v)
    _check_linear_attention(v)
    _check_quantization(v)
    _check_lora(v)
    layers = v["base_num_decoder_layers"] * s["layers"]
    _require(0 <= v["first_dense_layers"] < layers, f"first_dense_layers must be in [0, num_decoder_layers ({layers})), "
             f"got {v['first_dense_layers']}")
    _require(v["dense_mlp_dim"] >= 0, f"dense_mlp_dim must be >= 0 (0 = mlp_dim), got {v['dense_mlp_dim']}")
    interval = v["moe_layer_interval"]
    _require(interval >= 1, f"moe_layer_interval must be >= 1 (1 = every layer MoE), got {interval}")
    _require(interval == 1 or (v["first_dense_layers"] == 0 and layers % interval == 0 and v["num_experts"] > 1),
             f"moe_layer_interval={interval} needs num_experts > 1, first_dense_layers=0 and a layer count "
             f"({layers}) that is a multiple of it")
    pipelined = dict(mesh.shape)["stage"] > 1
    _require(not pipelined or interval == 1,
             "moe_layer_interval > 1 is not supported with pipeline parallelism (the stages split one homogeneous stack)")
    _require(not pipelined or v["first_dense_layers"] == 0,
             "first_dense_layers > 0 is not supported with pipeline parallelism (the stages split one homogeneous stack)")
    _require(not pipelined or v["moe_bias_update_rate"] == 0,
             "moe_bias_update_rate > 0 is not supported with pipeline parallelism (the pipelines report no expert load)")
    _require(v["mtp_num_layers"] >= 0 and v["mtp_loss_scaling_factor"] >= 0,
             f"mtp_num_layers and mtp_loss_scaling_factor must be >= 0, got {v['mtp_num_layers']} and "
             f"{v['mtp_loss_scaling_factor']}")
    _require(not pipelined or v["mtp_num_layers"] == 0,
             "mtp_num_layers > 0 is not supported with pipeline parallelism (the last stage would run the MTP modules)")
    stages, micro = _pipeline(v, mesh, global_batch, layers)
    context = dict(mesh.shape)["sequence"]
    _check_context_parallel(v, context, num_q, num_kv)
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
    return cls(**read_keys(cls, v, scan_layers=scan_layers), rope=RopeConfig(**read_keys(RopeConfig, v)), attn=attn,
               mla=MlaConfig(**read_keys(MlaConfig, v)),
               linear_attn=LinearAttentionConfig(**read_keys(LinearAttentionConfig, v)), moe=MoeConfig(**read_keys(MoeConfig, v)),
               mtp=MtpConfig(**read_keys(MtpConfig, v)), vision=vision,
               layer_shapes=layer_shapes, pipeline=pipeline, lora=LoraConfig(**read_keys(LoraConfig, v)),
               emb_dim=v["base_emb_dim"] * s["emb"], num_query_heads=num_q, num_kv_heads=num_kv,
               mlp_dim=v["base_mlp_dim"] * s["mlp"], num_decoder_layers=layers)


def _check_context_parallel(v: Mapping[str, Any], degree: int, num_q: int, num_kv: int) -> None:
  """context_parallel_* against the `sequence` degree, the sequence length, heads and kernel."""
  one_of(v, "context_parallel_strategy", CONTEXT_PARALLEL_STRATEGIES)
  strategy, balance = v["context_parallel_strategy"], v["context_parallel_load_balance"]
  _require(isinstance(balance, bool), f"context_parallel_load_balance must be True or False, got {balance!r}")
  if degree == 1 or (strategy == "all_gather" and not balance):
    return
  length = v["max_target_length"]
  if balance:
    _require(length % (2 * degree) == 0,
             f"context_parallel_load_balance=True splits max_target_length={length} into 2 x {degree} (sequence "
             f"parallelism) chunks; use a multiple of {2 * degree} or context_parallel_load_balance=False")
    _require(v["mtp_num_layers"] == 0, "context_parallel_load_balance=True reorders the sequence, which "
             "multi-token prediction (mtp_num_layers > 0) reads in order; set context_parallel_load_balance=False")
  if strategy == "all_to_all":
    _require(num_q % degree == 0 and num_kv % degree == 0,
             f"context_parallel_strategy=all_to_all splits heads over the {degree} sequence shards but "
             f"num_query_heads={num_q} / num_kv_heads={num_kv} are not multiples of {degree}; use "
             "context_parallel_strategy=ring or all_gather")
  what = f"context_parallel_strategy={strategy}" + (" with context_parallel_load_balance=True" if balance else "")
  _require(v["attention"] in ("flash", "autoselected"),
           f"{what} runs the chunked flash kernel per block (it needs each block's log-sum-exp); "
           f"attention={v['attention']} cannot run it; use attention=flash or autoselected")
  _require("chunked" not in v["attention_layer_pattern"] and not v["attention_sinks"],
           f"{what} does not support chunked attention layers or attention_sinks (dot_product only); "
           "use context_parallel_strategy=all_gather without load balancing")


def _check_quantization(v: Mapping[str, Any]) -> None:
  mode = v["quantization"]
  _require(mode in QUANTIZATION_MODES,
           f"quantization must be one of \"\", int8, fp8, mxfp8; got {mode!r} (\"\" trains in dtype)")
  _require(not (mode and v["num_experts"] > 1 and v["sparse_matmul"]),
           f"quantization={mode} does not cover sparse_matmul's ragged_dot experts; set sparse_matmul=False "
           "(the padded expert matmuls are quantized) or quantization=\"\"")


# PEFT's module names (as in HF Llama, Qwen, Gemma, Mistral and DeepSeek checkpoints) → our projections:
# attention query/key/value/out (attention.py), MLA's low-rank pieces (mla.py), the MLP's wi_0
# (gate) / wi_1 (up) / wo (down) (mlp.py; a one-activation MLP has no gate: its wi_0 is up_proj).
ATTENTION_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LORA_TARGETS = ("gate_proj", "up_proj", "down_proj")


def lora_targets(v: Mapping[str, Any]) -> tuple[str, ...]:
  """The target names the model described by `v` has."""
  if v["attention_type"] == "mla":
    query = ("q_proj",) if v["q_lora_rank"] <= 0 else ("q_a_proj", "q_b_proj")
    attention = query + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
  else:
    attention = ATTENTION_LORA_TARGETS
  mlp = MLP_LORA_TARGETS if len(v["mlp_activations"]) > 1 else ("up_proj", "down_proj")
  return attention + mlp


def _check_lora(v: Mapping[str, Any]) -> None:
  rank, targets = v["lora_rank"], list(v["lora_target_modules"])
  _require(isinstance(rank, int) and rank >= 0, f"lora_rank must be an integer >= 0 (0 = no adapters), got {rank!r}")
  if rank == 0:
    return
  _require(v["lora_alpha"] > 0, f"lora_alpha must be > 0 (the adapters' scale is lora_alpha / lora_rank), "
           f"got {v['lora_alpha']}")
  valid = lora_targets(v)
  unknown = [t for t in targets if t not in valid]
  _require(bool(targets) and not unknown,
           f"lora_target_modules {targets} names {'nothing' if not targets else unknown} in this model; "
           f"valid names: {', '.join(valid)}")
  mlp = [t for t in targets if t in MLP_LORA_TARGETS]
  _require(v["num_experts"] <= 1 or not mlp,
           f"lora_target_modules {mlp}: LoRA on mixture-of-experts MLPs is not supported; target the attention "
           f"projections only ({', '.join(t for t in valid if t not in MLP_LORA_TARGETS)})")
  _require(v["moe_bias_update_rate"] == 0,
           "lora_rank > 0 freezes every base weight, the MoE routing correction bias included; set moe_bias_update_rate=0")


def _check_positions_and_attention(v: Mapping[str, Any]) -> None:
  """Normalization, position embedding, RoPE scaling and attention-pattern keys."""
  one_of(v, "normalization_type", NORMALIZATION_TYPES)
  one_of(v, "position_embedding", POSITION_EMBEDDINGS)
  one_of(v, "rope_type", ROPE_TYPES)
  if v["position_embedding"] == "rope":
    _require(v["head_dim"] % 2 == 0, f"head_dim must be even for rotary embeddings, got {v['head_dim']}")
  else:
    _require(not v["rope_interleaved"] and v["rope_type"] == "default",
             f"rope_interleaved and rope_type apply only with position_embedding=rope, "
             f"not {v['position_embedding']!r}")
  if v["position_embedding"] == "learned":
    _require(v["max_target_length"] <= v["max_position_embeddings"],
             f"max_target_length ({v['max_target_length']}) exceeds max_position_embeddings "
             f"({v['max_position_embeddings']}), the rows of the learned position table")
  if v["position_embedding"] == "sinusoidal":
    _require(v["base_emb_dim"] % 2 == 0, f"position_embedding=sinusoidal needs an even emb_dim, "
             f"got {v['base_emb_dim']}")
  if v["rope_type"] == "llama3":
    _require(v["rope_scaling_factor"] >= 1.0 and 0 < v["rope_low_freq_factor"] < v["rope_high_freq_factor"]
             and v["rope_original_max_position"] > 0,
             "rope_type=llama3 needs rope_scaling_factor >= 1, 0 < rope_low_freq_factor < "
             f"rope_high_freq_factor and rope_original_max_position > 0; got {v['rope_scaling_factor']}, "
             f"{v['rope_low_freq_factor']}, {v['rope_high_freq_factor']}, {v['rope_original_max_position']}")
  if v["rope_type"] == "yarn":
    _require(v["rope_scaling_factor"] >= 1.0 and v["rope_original_max_position"] > 0
             and v["rope_yarn_beta_fast"] >= v["rope_yarn_beta_slow"] > 0 and v["rope_attention_factor"] >= 0,
             "rope_type=yarn needs rope_scaling_factor >= 1, rope_original_max_position > 0, rope_yarn_beta_fast >= "
             f"rope_yarn_beta_slow > 0 and rope_attention_factor >= 0; got {v['rope_scaling_factor']}, "
             f"{v['rope_original_max_position']}, {v['rope_yarn_beta_fast']}, {v['rope_yarn_beta_slow']}, "
             f"{v['rope_attention_factor']}")
  if v["rope_type"] == "proportional":
    _require(0.0 < v["rope_proportional_rotated_fraction"] <= 1.0 and v["rope_scaling_factor"] >= 1.0,
             "rope_type=proportional needs 0 < rope_proportional_rotated_fraction <= 1 and rope_scaling_factor >= 1; "
             "got "
             f"{v['rope_proportional_rotated_fraction']}, {v['rope_scaling_factor']}")
  if v["rope_type"] == "linear":
    _require(v["rope_scaling_factor"] >= 1.0, f"rope_type=linear needs rope_scaling_factor >= 1, "
             f"got {v['rope_scaling_factor']}")
  _require(v["rope_local_max_timescale"] >= 0, "rope_local_max_timescale must be >= 0 (0 = the global layers' "
           f"RoPE), got {v['rope_local_max_timescale']}")
  _require(not v["qk_norm_over_all_heads"] or v["use_qk_norm"],
           "qk_norm_over_all_heads=True sets the QK-norm's scope: it needs use_qk_norm=True")
  pattern = list(v["attention_layer_pattern"])
  _require(len(pattern) >= 1 and all(kind in ATTENTION_LAYER_KINDS for kind in pattern),
           f"attention_layer_pattern must be a non-empty list of {', '.join(ATTENTION_LAYER_KINDS)}; got {pattern}")
  if "local" in pattern:
    positive(v, "sliding_window_size")
  if "chunked" in pattern:
    positive(v, "attention_chunk_size")
    _require(v["attention"] in ("dot_product", "autoselected"),
             f"chunked attention layers run on attention=dot_product (or autoselected, which picks it); "
             f"attention={v['attention']} has no chunked mask")
  rope_pattern = list(v["rope_layer_pattern"])
  _require(len(rope_pattern) >= 1 and all(kind in ROPE_LAYER_KINDS for kind in rope_pattern),
           f"rope_layer_pattern must be a non-empty list of {', '.join(ROPE_LAYER_KINDS)}; got {rope_pattern}")
  _require(v["attn_temperature_floor_scale"] >= 0, "attn_temperature_floor_scale must be >= 0 (0 = off), got "
           f"{v['attn_temperature_floor_scale']}")
  _require(not v["attention_sinks"] or v["attention"] != "cudnn_flash",
           "attention_sinks=True needs attention=dot_product, autoselected or flash (cuDNN's kernel has no sink "
           "logit in its softmax)")
  for key in ("attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar"):
    _require(v[key] >= 0, f"{key} must be >= 0 (0 = off), got {v[key]}")


def _check_moe(v: Mapping[str, Any]) -> None:
  num_experts, top_k = v["num_experts"], v["num_experts_per_tok"]
  _require(num_experts >= 1, f"num_experts must be >= 1 (1 = dense MLP), got {num_experts}")
  _require(1 <= top_k <= num_experts,
           f"num_experts_per_tok must be between 1 and num_experts ({num_experts}), got {top_k}")
  _require(v["load_balance_loss_weight"] >= 0,
           f"load_balance_loss_weight must be >= 0, got {v['load_balance_loss_weight']}")
  _require(isinstance(v["sparse_matmul"], bool), f"sparse_matmul must be True or False, got {v['sparse_matmul']!r}")
  _require(v["shared_experts"] >= 0, f"shared_experts must be >= 0 (0 = none), got {v['shared_experts']}")
  _require(not v["moe_router_scales_input"] or top_k == 1,
           f"moe_router_scales_input=True supports num_experts_per_tok=1 only (Llama 4's releases), got {top_k}")
  one_of(v, "moe_dispatch", MOE_DISPATCHES)
  one_of(v, "moe_all_to_all", ALL_TO_ALL_KINDS)
  one_of(v, "moe_grouped_matmul", GROUPED_MATMUL_KINDS)
  one_of(v, "moe_score_function", MOE_SCORE_FUNCTIONS)
  one_of(v, "moe_group_score", MOE_GROUP_SCORES)
  groups, topk_groups = v["moe_num_groups"], v["moe_topk_groups"]
  _require(groups >= 1 and num_experts % groups == 0 and 1 <= topk_groups <= groups,
           f"moe_num_groups ({groups}) must divide num_experts ({num_experts}) and 1 <= moe_topk_groups "
           f"({topk_groups}) <= moe_num_groups")
  _require(top_k <= topk_groups * (num_experts // groups),
           f"num_experts_per_tok ({top_k}) exceeds the experts of moe_topk_groups={topk_groups} groups")
  _require(v["moe_group_score"] != "top2_sum" or groups == 1 or num_experts // groups >= 2,
           "moe_group_score=top2_sum needs at least 2 experts per group")
  _require(v["routed_scaling_factor"] > 0, f"routed_scaling_factor must be > 0, got {v['routed_scaling_factor']}")
  _require(v["moe_bias_update_rate"] >= 0 and (v["moe_bias_update_rate"] == 0 or v["moe_score_correction_bias"]),
           f"moe_bias_update_rate ({v['moe_bias_update_rate']}) must be >= 0, and > 0 only with "
           "moe_score_correction_bias=True")
  _require(not v["sparse_matmul"] or v["capacity_factor"] <= 0,
           f"sparse_matmul=True is the dropless grouped-matmul path but capacity_factor={v['capacity_factor']} "
           "asks for dropping; set capacity_factor=-1 or sparse_matmul=False")


def _check_linear_attention(v: Mapping[str, Any]) -> None:
  """Gated DeltaNet's shape, the hybrid stack's period, partial RoPE and the output gates."""
  interval, linear = v["full_attention_interval"], v["attention_type"] == "gated_deltanet"
  _require(interval >= 0, f"full_attention_interval must be >= 0 (0 = no Gated DeltaNet layers), got {interval}")
  if interval > 1 or linear:
    positive(v, "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim", "linear_attention_chunk_size")
    _require(v["linear_num_value_heads"] % v["linear_num_key_heads"] == 0,
             f"linear_num_value_heads ({v['linear_num_value_heads']}) must be a multiple of linear_num_key_heads "
             f"({v['linear_num_key_heads']})")
  if interval > 1:
    layers = v["base_num_decoder_layers"] * parameter_scales(v["global_parameter_scale"])["layers"]
    _require(v["attention_type"] == "gqa" and v["moe_layer_interval"] == 1 and v["first_dense_layers"] == 0
             and layers % interval == 0,
             f"full_attention_interval={interval} needs attention_type=gqa, moe_layer_interval=1, first_dense_layers=0 "
             f"and a layer count ({layers}) that is a multiple of it")
  fraction = v["partial_rotary_factor"]
  _require(0 < fraction <= 1 and (v["head_dim"] * fraction) % 2 == 0,
           f"partial_rotary_factor must be in (0, 1] and rotate an even number of head_dim={v['head_dim']} "
           f"features, got {fraction}")


def _check_mla(v: Mapping[str, Any]) -> None:
  one_of(v, "attention_type", ATTENTION_TYPES)
  if v["attention_type"] == "mla":
    positive(v, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    _require(v["q_lora_rank"] >= 0, f"q_lora_rank must be >= 0 (0 = a direct query projection), got {v['q_lora_rank']}")
    _require(v["head_dim"] == v["qk_nope_head_dim"] + v["qk_rope_head_dim"],
             f"attention_type=mla needs head_dim ({v['head_dim']}) = qk_nope_head_dim + qk_rope_head_dim "
             f"({v['qk_nope_head_dim']} + {v['qk_rope_head_dim']})")
    _require(v["qk_rope_head_dim"] % 2 == 0, f"qk_rope_head_dim must be even, got {v['qk_rope_head_dim']}")
    _require(v["base_num_kv_heads"] == v["base_num_query_heads"],
             "attention_type=mla needs base_num_kv_heads = base_num_query_heads (every head has its own keys)")
    _require(set(v["attention_layer_pattern"]) == {"global"} and set(v["rope_layer_pattern"]) == {"rope"}
             and not (v["use_qk_norm"] or v["use_qk_l2_norm"] or v["use_bias"]),
             "attention_type=mla supports only global rope layers, without use_qk_norm, use_qk_l2_norm or use_bias")
  _check_indexer(v)
  _require(v["rope_yarn_mscale_all_dim"] >= 0, f"rope_yarn_mscale_all_dim must be >= 0, got {v['rope_yarn_mscale_all_dim']}")


def _check_indexer(v: Mapping[str, Any]) -> None:
  _require(v["index_topk"] >= 0, f"index_topk must be >= 0 (0 = dense MLA), got {v['index_topk']}")
  scale = v["indexer_loss_scaling_factor"]
  _require(scale >= 0, f"indexer_loss_scaling_factor must be >= 0 (0 = the indexer does not train), got {scale}")
  if v["index_topk"] == 0:
    _require(scale == 0 and not v["indexer_warmup"],
             "indexer_loss_scaling_factor and indexer_warmup train DeepSeek Sparse Attention's indexer: they need "
             "index_topk > 0 (a model with a lightning indexer)")
    return
  _require(not v["indexer_warmup"] or scale > 0,
           "indexer_warmup=True trains only the indexer, by its KL loss: set indexer_loss_scaling_factor > 0")
  _require(not v["indexer_warmup"] or v["lora_rank"] == 0,
           "indexer_warmup=True trains only the indexer: it cannot be combined with lora_rank > 0")
  _require(v["attention_type"] == "mla" and v["q_lora_rank"] > 0,
           f"index_topk={v['index_topk']} (DeepSeek Sparse Attention) needs attention_type=mla with q_lora_rank > 0 "
           "(the indexer's queries read the query latent); set index_topk=0 otherwise")
  positive(v, "index_n_heads", "index_head_dim")
  _require(v["index_head_dim"] >= v["qk_rope_head_dim"],
           f"index_head_dim ({v['index_head_dim']}) must be >= qk_rope_head_dim ({v['qk_rope_head_dim']}): "
           "the indexer rotates that many of its features")


def _pipeline(v: Mapping[str, Any], mesh: "MeshConfig", global_batch: int, layers: int) -> tuple[int, int]:
  """Validates the pipeline keys against the model, mesh and batch; returns (stages, microbatches)."""
  stages = dict(mesh.shape)["stage"]
  repeats, schedule = v["num_pipeline_repeats"], v["pipeline_schedule"]
  micro = v["num_pipeline_microbatches"]
  one_of(v, "pipeline_schedule", PIPELINE_SCHEDULES)
  _require(repeats >= 1, f"num_pipeline_repeats must be >= 1, got {repeats}")
  _require(micro == -1 or micro >= 1, f"num_pipeline_microbatches must be >= 1 or -1 (= stages), got {micro}")
  if stages == 1:
    _require(repeats == 1 and micro in (-1, 1) and schedule == "gpipe",
             "num_pipeline_microbatches, num_pipeline_repeats and pipeline_schedule apply only with pipeline "
             "parallelism; set ici_pipeline_parallelism or dcn_pipeline_parallelism > 1, or leave them at their defaults")
    return 1, 1
  micro = stages if micro == -1 else micro
  _require(v["scan_layers"], "pipeline parallelism needs scan_layers=True (the stage axis splits the scanned layer stack)")
  _require(schedule != "1f1b" or v["indexer_loss_scaling_factor"] == 0,
           "indexer_loss_scaling_factor > 0 is not built for pipeline_schedule=1f1b (its loss head carries the "
           "load-balancing loss only); use pipeline_schedule=gpipe or circular")
  _require(schedule != "gpipe" or repeats == 1,
           f"num_pipeline_repeats={repeats} needs pipeline_schedule=circular or 1f1b (gpipe makes one pass through "
           "the stages)")
  _require(schedule != "circular" or repeats > 1,
           "pipeline_schedule=circular needs num_pipeline_repeats >= 2 (with one repeat it is gpipe)")
  _require(layers % (stages * repeats) == 0,
           f"num_decoder_layers ({layers}) must be divisible by pipeline stages ({stages}) x num_pipeline_repeats "
           f"({repeats}); change the layer count, the stage degree or the repeats")
  _require(schedule != "circular" or micro >= stages,
           f"pipeline_schedule=circular needs num_pipeline_microbatches ({micro}) >= pipeline stages ({stages}): "
           "a microbatch must leave the last stage before it re-enters the first")
  _require(schedule != "1f1b" or repeats == 1 or micro % stages == 0,
           f"interleaved 1F1B (pipeline_schedule=1f1b, num_pipeline_repeats={repeats}) needs num_pipeline_microbatches "
           f"({micro}) to be a multiple of the pipeline stages ({stages}): microbatches make their passes in groups "
           "of one per stage")
  layer_rules = [axes for name, axes in mesh.logical_axis_rules if name == "layers"]
  _require(bool(layer_rules) and "stage" in layer_rules[0],
           'pipeline parallelism needs the logical_axis_rules entry ["layers", ["stage"]] so each stage holds its layers')
  accum = v["gradient_accumulation_steps"]
  rows = global_batch // accum
  shape = dict(mesh.shape)
  row_shards = math.prod(shape[a] for a in mesh.data_sharding if a != "stage")
  _require(rows % (micro * row_shards) == 0,
           f"the batch of {rows} sequences per gradient-accumulation step must split into num_pipeline_microbatches="
           f"{micro} microbatches, each divisible by the {row_shards} non-stage data_sharding devices; raise "
           "per_device_batch_size or change num_pipeline_microbatches")
  return stages, micro



# The keys that fix a checkpoint's architecture (written to model_config.yml beside a converted
# checkpoint), and those a tool reading a run takes from its saved configuration.
ARCHITECTURE_KEYS = keys_where((ModelConfig,), ARCHITECTURE, True)
MODEL_KEYS = keys_where((ModelConfig,), FIXED, MODEL)
# A LoRA run's checkpoints hold adapters: a tool reading the run (or its checkpoints) needs these
# too to read them (run_record.saved_model_keys); an export merges them and carries none.
LORA_KEYS = tuple(f.name for f in key_fields(LoraConfig))
