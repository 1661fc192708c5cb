"""Typed, frozen groups of the configuration, each validated next to its own fields.

`build_groups(flat_values, target)` turns the flat key=value dict into
ModelConfig / MeshConfig / OptimConfig / DataConfig / RunConfig, filling in the
derived values (scaled sizes, global batch, -1 mesh axes). Layers receive a
ModelConfig only.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping

from MaxText import storage
from MaxText.accelerators import DeviceTarget
from MaxText.errors import ConfigError

MESH_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert", "autoregressive")
# config key suffix for each mesh axis (`ici_<name>_parallelism`).
_AXIS_KEY = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "fsdp_transpose": "fsdp_transpose",
             "sequence": "sequence", "tensor": "tensor", "expert": "expert", "autoregressive": "autoregressive"}
REMAT_POLICIES = ("full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "minimal_offloaded",
                  "save_dot_except_mlp_offloaded", "none")
QUANTIZATION_MODES = ("", "int8", "fp8")  # mirrors layers/quantization.py (config must not import layers)
ATTENTION_KINDS = ("dot_product", "flash", "cudnn_flash", "autoselected")
ACTIVATIONS = ("silu", "gelu", "relu", "linear", "tanh")
DTYPES = ("float32", "bfloat16", "float16")
NORMALIZATION_TYPES = ("rms", "rms_plus_one", "layer")
POSITION_EMBEDDINGS = ("rope", "learned", "sinusoidal")
ROPE_TYPES = ("default", "llama3")
ATTENTION_LAYER_KINDS = ("global", "local")
DATASET_TYPES = ("synthetic", "tfds", "hf", "grain")


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def _positive(values: Mapping[str, Any], *keys: str) -> None:
  for key in keys:
    _require(values[key] > 0, f"{key} must be > 0, got {values[key]}")


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


# Block-size keys of the attention kernels (layers/attention_kernels.py); sa_* are the TPU splash kernel's.
_BLOCK_KEYS = ("flash_block_q", "flash_block_kv", "sa_block_q", "sa_block_kv", "sa_block_kv_compute",
               "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
  """Tile sizes of attention=flash: flash_* for the chunked JAX kernel (CPU, GPU), sa_* for TPU splash."""
  flash_block_q: int = 512
  flash_block_kv: int = 512
  sa_block_q: int = 512
  sa_block_kv: int = 512
  sa_block_kv_compute: int = 512
  sa_block_q_dkv: int = 512
  sa_block_kv_dkv: int = 512
  sa_block_kv_dkv_compute: int = 512
  sa_block_q_dq: int = 512
  sa_block_kv_dq: int = 512

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "AttentionBlocks":
    _positive(v, *_BLOCK_KEYS)
    for key in _BLOCK_KEYS[2:]:
      # Splash tiles are laid over the TPU's 128-lane vector registers.
      _require(v[key] % 128 == 0, f"{key} must be a multiple of 128 (TPU lanes), got {v[key]}")
    for compute, block in (("sa_block_kv_compute", "sa_block_kv"), ("sa_block_kv_dkv_compute", "sa_block_kv_dkv")):
      _require(v[block] % v[compute] == 0, f"{compute} ({v[compute]}) must divide {block} ({v[block]})")
    return cls(**{key: v[key] for key in _BLOCK_KEYS})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  decoder_block: str
  vocab_size: int
  emb_dim: int
  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  num_decoder_layers: int
  mlp_activations: tuple[str, ...]
  normalization_layer_epsilon: float
  rope_min_timescale: float
  rope_max_timescale: float
  logits_via_embedding: bool
  dropout_rate: float
  dtype: str
  weight_dtype: str
  logits_dot_in_fp32: bool
  attention: str
  scan_layers: bool
  remat_policy: str
  max_target_length: int
  normalization_type: str  # rms | rms_plus_one | layer
  use_bias: bool
  position_embedding: str  # rope | learned | sinusoidal
  max_position_embeddings: int
  rope_interleaved: bool
  rope_type: str  # default | llama3
  rope_scaling_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  rope_original_max_position: int
  attention_layer_pattern: tuple[str, ...]  # cycled over layers: global | local
  sliding_window_size: int
  attn_logits_soft_cap: float  # 0 = off
  final_logits_soft_cap: float  # 0 = off
  query_pre_attn_scalar: float  # 0 = head_dim
  scale_embedding: bool
  num_experts: int  # 1 = dense MLP
  num_experts_per_tok: int
  capacity_factor: float  # <= 0 = dropless
  sparse_matmul: bool  # dropless experts as grouped matmuls (jax.lax.ragged_dot)
  load_balance_loss_weight: float
  # Pipeline parallelism (filled in by build_groups from the mesh; 1 stage = no pipeline).
  num_pipeline_stages: int = 1
  num_pipeline_microbatches: int = 1
  num_pipeline_repeats: int = 1
  pipeline_schedule: str = "gpipe"  # gpipe | circular | 1f1b (interleaved with num_pipeline_repeats > 1)
  quantization: str = ""  # "" | int8 | fp8: the decoder stack's matmuls (layers/quantization.py)
  attention_blocks: AttentionBlocks = AttentionBlocks()  # attention=flash tile sizes

  @property
  def layers_per_pipeline_stage(self) -> int:
    """Decoder layers one stage runs per pass (per repeat)."""
    return self.num_decoder_layers // (self.num_pipeline_stages * self.num_pipeline_repeats)

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "ModelConfig":
    _positive(v, "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
              "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length")
    s = parameter_scales(v["global_parameter_scale"])
    num_q, num_kv = v["base_num_query_heads"] * s["heads"], v["base_num_kv_heads"] * s["heads"]
    _require(num_q % num_kv == 0,
             f"num_query_heads ({num_q}) must be a multiple of num_kv_heads ({num_kv}) for grouped-query attention")
    _require(v["remat_policy"] in REMAT_POLICIES,
             f"remat_policy must be one of {', '.join(REMAT_POLICIES)}; got {v['remat_policy']!r}")
    _require(v["attention"] in ATTENTION_KINDS,
             f"attention must be one of {', '.join(ATTENTION_KINDS)}; got {v['attention']!r}")
    for key in ("dtype", "weight_dtype"):
      _require(v[key] in DTYPES, f"{key} must be one of {', '.join(DTYPES)}; got {v[key]!r}")
    acts = tuple(v["mlp_activations"])
    _require(len(acts) >= 1 and all(a in ACTIVATIONS for a in acts),
             f"mlp_activations must be a non-empty list of {', '.join(ACTIVATIONS)}; got {list(acts)}")
    _require(0.0 <= v["dropout_rate"] < 1.0, f"dropout_rate must be in [0, 1), got {v['dropout_rate']}")
    _check_positions_and_attention(v)
    _check_moe(v)
    _check_quantization(v)
    return cls(
        decoder_block=v["decoder_block"], vocab_size=v["vocab_size"],
        emb_dim=v["base_emb_dim"] * s["emb"], num_query_heads=num_q, num_kv_heads=num_kv,
        head_dim=v["head_dim"], mlp_dim=v["base_mlp_dim"] * s["mlp"],
        num_decoder_layers=v["base_num_decoder_layers"] * s["layers"], mlp_activations=acts,
        normalization_layer_epsilon=v["normalization_layer_epsilon"],
        rope_min_timescale=v["rope_min_timescale"], rope_max_timescale=v["rope_max_timescale"],
        logits_via_embedding=v["logits_via_embedding"], dropout_rate=v["dropout_rate"],
        dtype=v["dtype"], weight_dtype=v["weight_dtype"], logits_dot_in_fp32=v["logits_dot_in_fp32"],
        attention=v["attention"], scan_layers=v["scan_layers"], remat_policy=v["remat_policy"],
        attention_blocks=AttentionBlocks.from_values(v),
        max_target_length=v["max_target_length"],
        **{key: v[key] for key in _FAMILY_KEYS},
        attention_layer_pattern=tuple(v["attention_layer_pattern"]),
        num_experts=v["num_experts"], num_experts_per_tok=v["num_experts_per_tok"],
        capacity_factor=v["capacity_factor"], sparse_matmul=v["sparse_matmul"],
        load_balance_loss_weight=v["load_balance_loss_weight"], quantization=v["quantization"],
    )


def _check_quantization(v: Mapping[str, Any]) -> None:
  mode = v["quantization"]
  _require(mode in QUANTIZATION_MODES,
           f"quantization must be one of \"\", int8, fp8; got {mode!r} (\"\" trains in dtype)")
  _require(not (mode and v["num_experts"] > 1 and v["sparse_matmul"]),
           f"quantization={mode} does not cover sparse_matmul's ragged_dot experts; set sparse_matmul=False "
           "(the padded expert matmuls are quantized) or quantization=\"\"")


# Keys copied as they are into ModelConfig (validated by _check_positions_and_attention).
_FAMILY_KEYS = ("normalization_type", "use_bias", "position_embedding", "max_position_embeddings",
                "rope_interleaved", "rope_type", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position", "sliding_window_size",
                "attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar", "scale_embedding")


def _one_of(v: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> None:
  _require(v[key] in allowed, f"{key} must be one of {', '.join(allowed)}; got {v[key]!r}")


def _check_positions_and_attention(v: Mapping[str, Any]) -> None:
  """Normalization, position embedding, RoPE scaling and attention-pattern keys."""
  _one_of(v, "normalization_type", NORMALIZATION_TYPES)
  _one_of(v, "position_embedding", POSITION_EMBEDDINGS)
  _one_of(v, "rope_type", ROPE_TYPES)
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
  pattern = list(v["attention_layer_pattern"])
  _require(len(pattern) >= 1 and all(kind in ATTENTION_LAYER_KINDS for kind in pattern),
           f"attention_layer_pattern must be a non-empty list of {', '.join(ATTENTION_LAYER_KINDS)}; got {pattern}")
  if "local" in pattern:
    _positive(v, "sliding_window_size")
  for key in ("attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar"):
    _require(v[key] >= 0, f"{key} must be >= 0 (0 = off), got {v[key]}")


def _check_moe(v: Mapping[str, Any]) -> None:
  num_experts, top_k = v["num_experts"], v["num_experts_per_tok"]
  _require(num_experts >= 1, f"num_experts must be >= 1 (1 = dense MLP), got {num_experts}")
  _require(1 <= top_k <= num_experts,
           f"num_experts_per_tok must be between 1 and num_experts ({num_experts}), got {top_k}")
  _require(v["load_balance_loss_weight"] >= 0,
           f"load_balance_loss_weight must be >= 0, got {v['load_balance_loss_weight']}")
  _require(num_experts == 1 or not v["use_bias"],
           "use_bias=True is not supported with num_experts > 1 (the MoE experts have no biases)")
  _require(isinstance(v["sparse_matmul"], bool), f"sparse_matmul must be True or False, got {v['sparse_matmul']!r}")
  _require(not v["sparse_matmul"] or v["capacity_factor"] <= 0,
           f"sparse_matmul=True is the dropless grouped-matmul path but capacity_factor={v['capacity_factor']} "
           "asks for dropping; set capacity_factor=-1 or sparse_matmul=False")


def _fill_auto_axis(degrees: dict[str, int], total: int, group: str) -> dict[str, int]:
  """Replaces at most one -1 degree so the group's product equals `total`."""
  key = lambda axis: f"{group}_{_AXIS_KEY[axis]}_parallelism"  # noqa: E731
  unit = "devices per slice" if group == "ici" else "slices"
  auto = [axis for axis, d in degrees.items() if d == -1]
  _require(len(auto) <= 1, f"at most one {group}_*_parallelism may be -1, got {', '.join(map(key, auto))}")
  for axis, d in degrees.items():
    _require(d == -1 or d >= 1, f"{key(axis)} must be >= 1 or -1, got {d}")
  fixed = {a: d for a, d in degrees.items() if d != -1}
  product = math.prod(fixed.values())
  named = " * ".join(key(a) for a, d in fixed.items() if d != 1) or f"the {group}_* degrees"
  if total % product:
    raise ConfigError(f"{named} = {product} does not divide {total} {unit}")
  if auto:
    return {**degrees, auto[0]: total // product}
  _require(product == total, f"{named} = {product} uses only {product} of {total} {unit}; "
           f"set one {group}_*_parallelism to -1 to fill the rest")
  return degrees


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  ici: tuple[tuple[str, int], ...]
  dcn: tuple[tuple[str, int], ...]
  num_slices: int
  logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...]
  data_sharding: tuple[str, ...]
  sharding_tolerance: float

  @property
  def shape(self) -> tuple[tuple[str, int], ...]:
    """Total degree per mesh axis (ici × dcn), in MESH_AXES order."""
    dcn = dict(self.dcn)
    return tuple((axis, degree * dcn[axis]) for axis, degree in self.ici)

  @classmethod
  def from_values(cls, v: Mapping[str, Any], target: DeviceTarget) -> "MeshConfig":
    num_slices = v["num_slices"] if v["num_slices"] != -1 else target.num_slices
    _require(num_slices >= 1 and target.num_devices % num_slices == 0,
             f"num_slices={num_slices} does not divide the {target.num_devices} devices")
    ici = {a: v[f"ici_{_AXIS_KEY[a]}_parallelism"] for a in MESH_AXES}
    dcn = {a: v[f"dcn_{_AXIS_KEY[a]}_parallelism"] for a in MESH_AXES}
    ici = _fill_auto_axis(ici, target.num_devices // num_slices, "ici")
    dcn = _fill_auto_axis(dcn, num_slices, "dcn")
    rules = []
    for rule in v["logical_axis_rules"]:
      _require(isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str),
               f"each logical_axis_rules entry must be [logical_name, [mesh_axes...]], got {rule!r}")
      mesh_axes = (rule[1],) if isinstance(rule[1], str) else tuple(rule[1] or ())
      for axis in mesh_axes:
        _require(axis in MESH_AXES, f"logical_axis_rules maps {rule[0]!r} to unknown mesh axis "
                 f"{axis!r}; mesh axes are {', '.join(MESH_AXES)}")
      rules.append((rule[0], mesh_axes))
    for axis in v["data_sharding"]:
      _require(axis in MESH_AXES, f"data_sharding names unknown mesh axis {axis!r}")
    _require(0.0 <= v["sharding_tolerance"] <= 1.0,
             f"sharding_tolerance must be in [0, 1], got {v['sharding_tolerance']}")
    return cls(ici=tuple(ici.items()), dcn=tuple(dcn.items()), num_slices=num_slices,
               logical_axis_rules=tuple(rules), data_sharding=tuple(v["data_sharding"]),
               sharding_tolerance=v["sharding_tolerance"])


PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")


def _with_pipeline(model: ModelConfig, v: Mapping[str, Any], mesh: MeshConfig, global_batch: int) -> ModelConfig:
  """Validates the pipeline keys against the model, mesh and batch; fills in the derived stage counts."""
  stages = dict(mesh.shape)["stage"]
  repeats, schedule = v["num_pipeline_repeats"], v["pipeline_schedule"]
  micro = v["num_pipeline_microbatches"]
  _one_of(v, "pipeline_schedule", PIPELINE_SCHEDULES)
  _require(repeats >= 1, f"num_pipeline_repeats must be >= 1, got {repeats}")
  _require(micro == -1 or micro >= 1, f"num_pipeline_microbatches must be >= 1 or -1 (= stages), got {micro}")
  if stages == 1:
    _require(repeats == 1 and micro in (-1, 1) and schedule == "gpipe",
             "num_pipeline_microbatches, num_pipeline_repeats and pipeline_schedule apply only with pipeline "
             "parallelism; set ici_pipeline_parallelism or dcn_pipeline_parallelism > 1, or leave them at their defaults")
    return model
  micro = stages if micro == -1 else micro
  layers = model.num_decoder_layers
  _require(model.scan_layers, "pipeline parallelism needs scan_layers=True (the stage axis splits the scanned layer stack)")
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
  return dataclasses.replace(model, num_pipeline_stages=stages, num_pipeline_microbatches=micro,
                             num_pipeline_repeats=repeats, pipeline_schedule=schedule)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  opt_type: str
  learning_rate: float
  warmup_steps: int
  schedule_steps: int
  cosine_final_fraction: float
  adam_b1: float
  adam_b2: float
  adam_eps: float
  adam_eps_root: float
  weight_decay: float
  gradient_clipping_threshold: float
  gradient_accumulation_steps: int
  z_loss_multiplier: float
  optimizer_memory_host_offload: bool = False  # optimizer state in pinned host memory

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "OptimConfig":
    _require(v["opt_type"] == "adamw", f"opt_type must be 'adamw', got {v['opt_type']!r}")
    _positive(v, "learning_rate", "gradient_accumulation_steps")
    _require(0.0 <= v["warmup_steps_fraction"] <= 1.0,
             f"warmup_steps_fraction must be in [0, 1], got {v['warmup_steps_fraction']}")
    schedule_steps = v["learning_rate_schedule_steps"]
    schedule_steps = v["steps"] if schedule_steps == -1 else schedule_steps
    _require(schedule_steps > 0, f"learning_rate_schedule_steps must be > 0 or -1, got {schedule_steps}")
    for key in ("adam_b1", "adam_b2"):
      _require(0.0 <= v[key] < 1.0, f"{key} must be in [0, 1), got {v[key]}")
    _require(v["gradient_clipping_threshold"] >= 0, "gradient_clipping_threshold must be >= 0 (0 = off)")
    return cls(
        opt_type=v["opt_type"], learning_rate=v["learning_rate"],
        warmup_steps=int(v["warmup_steps_fraction"] * schedule_steps), schedule_steps=schedule_steps,
        cosine_final_fraction=v["cosine_learning_rate_final_fraction"], adam_b1=v["adam_b1"],
        adam_b2=v["adam_b2"], adam_eps=v["adam_eps"], adam_eps_root=v["adam_eps_root"],
        weight_decay=v["adam_weight_decay"], gradient_clipping_threshold=v["gradient_clipping_threshold"],
        gradient_accumulation_steps=v["gradient_accumulation_steps"], z_loss_multiplier=v["z_loss_multiplier"],
        optimizer_memory_host_offload=v["optimizer_memory_host_offload"],
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dataset_type: str
  per_device_batch_size: float
  global_batch_size: int
  max_target_length: int
  vocab_size: int
  seed: int
  synthetic_max_stride: int
  eval_steps: int
  # Real data (dataset_type tfds | hf | grain); see input_pipeline/.
  dataset_path: str = ""
  dataset_name: str = ""
  train_split: str = "train"
  eval_split: str = "validation"
  hf_path: str = ""
  hf_data_files: str = ""
  hf_eval_files: str = ""
  grain_train_files: str = ""
  grain_eval_files: str = ""
  grain_worker_count: int = 0
  text_column: str = "text"
  tokenizer_type: str = "sentencepiece"
  tokenizer_path: str = ""
  add_bos: bool = True
  add_eos: bool = True
  packing: bool = True
  enable_data_shuffling: bool = True
  data_prefetch_batches: int = 2
  has_eval_source: bool = False  # real data with eval_interval > 0

  @classmethod
  def from_values(cls, v: Mapping[str, Any], target: DeviceTarget, mesh: MeshConfig) -> "DataConfig":
    _one_of(v, "dataset_type", DATASET_TYPES)
    _positive(v, "per_device_batch_size", "synthetic_max_stride", "eval_steps")
    if v["dataset_type"] != "synthetic":
      _check_real_data(v)
    global_batch = v["per_device_batch_size"] * target.num_devices
    _require(float(global_batch).is_integer(), f"per_device_batch_size {v['per_device_batch_size']} x "
             f"{target.num_devices} devices = {global_batch} is not a whole number of sequences")
    global_batch = int(global_batch)
    shape = dict(mesh.shape)
    batch_shards = math.prod(shape[a] for a in mesh.data_sharding)
    accum = v["gradient_accumulation_steps"]
    _require(global_batch % (batch_shards * accum) == 0,
             f"global batch {global_batch} must split evenly into gradient_accumulation_steps={accum} "
             f"micro-batches over the {batch_shards} devices of data_sharding; raise per_device_batch_size")
    return cls(dataset_type=v["dataset_type"], per_device_batch_size=v["per_device_batch_size"],
               global_batch_size=global_batch, max_target_length=v["max_target_length"],
               vocab_size=v["vocab_size"], seed=v["data_shuffle_seed"],
               synthetic_max_stride=v["synthetic_max_stride"], eval_steps=v["eval_steps"],
               **{key: v[key] for key in _REAL_DATA_KEYS}, text_column=v["train_data_columns"][0],
               has_eval_source=v["dataset_type"] != "synthetic" and v["eval_interval"] > 0)


# Keys copied as they are into DataConfig (validated by _check_real_data).
_REAL_DATA_KEYS = ("dataset_path", "dataset_name", "train_split", "eval_split", "hf_path", "hf_data_files",
                   "hf_eval_files", "grain_train_files", "grain_eval_files", "grain_worker_count", "tokenizer_type",
                   "tokenizer_path", "add_bos", "add_eos", "packing", "enable_data_shuffling", "data_prefetch_batches")


def _check_real_data(v: Mapping[str, Any]) -> None:
  """What can be checked before any data is opened: the keys each dataset_type needs, that named
  files exist, and that the tokenizer loads and fits in vocab_size."""
  from MaxText.input_pipeline import files, tokenizer  # lazily: the pipeline imports this module

  kind, evaluates = v["dataset_type"], v["eval_interval"] > 0
  _require(len(v["train_data_columns"]) == 1,
           f"train_data_columns must name exactly one text column, got {list(v['train_data_columns'])}")
  _require(v["grain_worker_count"] >= 0 and v["data_prefetch_batches"] >= 0,
           "grain_worker_count and data_prefetch_batches must be >= 0")
  _require(v["max_target_length"] >= 2, f"max_target_length must be >= 2 for real data, got {v['max_target_length']}")
  if kind == "tfds":
    _require(bool(v["dataset_name"]), "dataset_type=tfds needs dataset_name (and dataset_path, its data_dir)")
    _require(not storage.is_remote(v["dataset_path"]),
             f"dataset_path={v['dataset_path']}: TFDS data is read through ArrayRecord, which cannot open gs:// "
             "paths; copy the prepared dataset to local disk (gcloud storage cp -r) or mount the bucket with gcsfuse")
    _require(not v["dataset_path"] or storage.is_dir(v["dataset_path"]),
             f"dataset_path {v['dataset_path']} is not a directory")
  elif kind == "hf":
    _require(bool(v["hf_path"] or v["hf_data_files"]), "dataset_type=hf needs hf_path or hf_data_files")
    for key in ("hf_data_files", "hf_eval_files"):
      if v[key]:
        files.expand_files(key, v[key])
    _require(not evaluates or bool(v["hf_eval_files"] or (v["hf_path"] and not v["hf_data_files"])),
             "eval_interval > 0 with hf_data_files needs hf_eval_files (the eval split's files)")
  else:
    files.expand_files("grain_train_files", v["grain_train_files"])
    _require(not evaluates or bool(v["grain_eval_files"]), "eval_interval > 0 with dataset_type=grain "
             "needs grain_eval_files")
    if v["grain_eval_files"]:
      files.expand_files("grain_eval_files", v["grain_eval_files"])
  vocab = tokenizer.load_tokenizer(v["tokenizer_type"], v["tokenizer_path"]).vocab_size
  _require(vocab <= v["vocab_size"], f"the tokenizer {v['tokenizer_path']} has {vocab} tokens, more than "
           f"vocab_size={v['vocab_size']}; set vocab_size >= {vocab}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  run_name: str
  base_output_directory: str
  run_dir: str
  steps: int
  log_period: int
  eval_interval: int
  init_weights_seed: int
  enable_tensorboard: bool
  enable_jsonl_metrics: bool
  print_config: bool
  cpu_peak_tflops: float
  profiler: str  # "" (off) or "xplane"
  profile_start_step: int
  profile_steps: int
  profile_all_processes: bool
  collect_stack_trace: bool
  stack_trace_to_cloud: bool
  stack_trace_interval_seconds: int
  storage_timeout_seconds: int
  lease_timeout_seconds: float

  @classmethod
  def from_values(cls, v: Mapping[str, Any], num_processes: int = 1) -> "RunConfig":
    _positive(v, "steps", "log_period", "profile_steps", "stack_trace_interval_seconds", "storage_timeout_seconds",
              "run_lease_timeout_seconds")
    _require(v["eval_interval"] == -1 or v["eval_interval"] > 0, "eval_interval must be > 0 or -1 (never)")
    _require(num_processes == 1 or v["run_name"], f"set run_name=NAME: with {num_processes} processes each "
             "would otherwise name the run after its own clock")
    run_name = v["run_name"] or datetime.datetime.now().strftime("run_%Y%m%d_%H%M%S")
    _require("/" not in run_name, f"run_name must not contain '/', got {run_name!r}")
    _require(v["profiler"] in ("", "xplane"), f"profiler must be '' (off) or 'xplane', got {v['profiler']!r}")
    _require(v["profile_start_step"] >= 0, f"profile_start_step must be >= 0, got {v['profile_start_step']}")
    return cls(run_name=run_name, base_output_directory=v["base_output_directory"],
               run_dir=storage.join(v["base_output_directory"], run_name), steps=v["steps"],
               log_period=v["log_period"], eval_interval=v["eval_interval"],
               init_weights_seed=v["init_weights_seed"], enable_tensorboard=v["enable_tensorboard"],
               enable_jsonl_metrics=v["enable_jsonl_metrics"], print_config=v["print_config"],
               cpu_peak_tflops=v["cpu_peak_tflops"], profiler=v["profiler"],
               profile_start_step=v["profile_start_step"], profile_steps=v["profile_steps"],
               profile_all_processes=v["profile_all_processes"], collect_stack_trace=v["collect_stack_trace"],
               stack_trace_to_cloud=v["stack_trace_to_cloud"],
               stack_trace_interval_seconds=v["stack_trace_interval_seconds"],
               storage_timeout_seconds=v["storage_timeout_seconds"],
               lease_timeout_seconds=v["run_lease_timeout_seconds"])


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  enabled: bool
  async_checkpointing: bool
  period: int
  max_to_keep: int | None  # None = keep all
  directory: str  # run_dir/checkpoints
  load_parameters_path: str
  load_full_state_path: str
  param_only_checkpoint_path: str
  force_unroll: bool
  # The fast per-host tier of multi-tier checkpointing ("" = off).
  local_directory: str = ""
  local_period: int = 0
  local_max_to_keep: int = 2

  @classmethod
  def from_values(cls, v: Mapping[str, Any], run: "RunConfig") -> "CheckpointConfig":
    _require(v["checkpoint_period"] > 0, f"checkpoint_period must be > 0, got {v['checkpoint_period']} "
             "(to turn checkpoints off set enable_checkpointing=False)")
    keep = v["max_num_checkpoints_to_keep"]
    _require(keep == -1 or keep >= 1, f"max_num_checkpoints_to_keep must be >= 1 or -1 (keep all), got {keep}")
    _require(not (v["load_parameters_path"] and v["load_full_state_path"]),
             "set at most one of load_parameters_path (weights only, fresh optimizer) and "
             "load_full_state_path (weights, optimizer state and step)")
    local = v["enable_emergency_checkpoint"]
    _require(not local or (v["local_checkpoint_directory"] and v["local_checkpoint_period"] > 0),
             "enable_emergency_checkpoint=True needs local_checkpoint_directory=<a directory on each host's disk> "
             "and local_checkpoint_period > 0")
    _require(not local or not storage.is_remote(v["local_checkpoint_directory"]),
             f"local_checkpoint_directory must be on the host's own disk, got {v['local_checkpoint_directory']}; "
             "the persistent tier (base_output_directory) is the one for gs://")
    _require(not local or v["enable_checkpointing"], "enable_emergency_checkpoint=True needs enable_checkpointing=True "
             "(the persistent tier)")
    _require(v["local_checkpoint_max_to_keep"] >= 1, "local_checkpoint_max_to_keep must be >= 1")
    return cls(enabled=v["enable_checkpointing"], async_checkpointing=v["async_checkpointing"],
               period=v["checkpoint_period"], max_to_keep=None if keep == -1 else keep,
               directory=storage.join(run.run_dir, "checkpoints"),
               load_parameters_path=v["load_parameters_path"], load_full_state_path=v["load_full_state_path"],
               param_only_checkpoint_path=v["param_only_checkpoint_path"], force_unroll=v["force_unroll"],
               local_directory=storage.join(storage.resolve(v["local_checkpoint_directory"]), run.run_name) if local else "",
               local_period=v["local_checkpoint_period"] if local else 0,
               local_max_to_keep=v["local_checkpoint_max_to_keep"])


SAMPLING_STRATEGIES = ("greedy", "weighted", "nucleus", "topk")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  prompt: str
  prompt_token_ids: tuple[int, ...]  # empty = tokenize `prompt`
  max_prefill_predict_length: int
  sampling_strategy: str
  sampling_temperature: float
  sampling_nucleus_p: float
  sampling_top_k: int
  sampling_seed: int
  quantize_kvcache: bool

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "DecodeConfig":
    _one_of(v, "decode_sampling_strategy", SAMPLING_STRATEGIES)
    # Checked against max_target_length by the decode engine only: training runs never read it.
    prefill = v["max_prefill_predict_length"]
    _require(prefill > 0, f"max_prefill_predict_length must be > 0, got {prefill}")
    _require(v["decode_sampling_temperature"] > 0,
             f"decode_sampling_temperature must be > 0, got {v['decode_sampling_temperature']}")
    _require(0 < v["decode_sampling_nucleus_p"] <= 1,
             f"decode_sampling_nucleus_p must be in (0, 1], got {v['decode_sampling_nucleus_p']}")
    _require(1 <= v["decode_sampling_top_k"] <= v["vocab_size"],
             f"decode_sampling_top_k must be between 1 and vocab_size, got {v['decode_sampling_top_k']}")
    try:
      ids = tuple(int(str(t)) for t in v["prompt_token_ids"])
    except ValueError:
      raise ConfigError(f"prompt_token_ids must be comma-separated integers like 5,17,42, "
                        f"got {list(v['prompt_token_ids'])}") from None
    _require(all(0 <= t < v["vocab_size"] for t in ids),
             f"prompt_token_ids must lie in [0, vocab_size={v['vocab_size']}), got {list(ids)}")
    _require(len(ids) <= prefill, f"prompt_token_ids has {len(ids)} tokens, more than max_prefill_predict_length="
             f"{prefill}; raise max_prefill_predict_length or shorten the prompt")
    return cls(prompt=v["prompt"], prompt_token_ids=ids, max_prefill_predict_length=prefill,
               sampling_strategy=v["decode_sampling_strategy"],
               sampling_temperature=v["decode_sampling_temperature"],
               sampling_nucleus_p=v["decode_sampling_nucleus_p"], sampling_top_k=v["decode_sampling_top_k"],
               sampling_seed=v["decode_sampling_seed"], quantize_kvcache=v["quantize_kvcache"])


@dataclasses.dataclass(frozen=True)
class Groups:
  model: ModelConfig
  mesh: MeshConfig
  optim: OptimConfig
  data: DataConfig
  run: RunConfig
  checkpoint: CheckpointConfig
  decode: DecodeConfig


def build_groups(values: Mapping[str, Any], target: DeviceTarget) -> Groups:
  mesh = MeshConfig.from_values(values, target)
  run = RunConfig.from_values(values, target.num_processes)
  num_experts, expert_degree = values["num_experts"], dict(mesh.shape)["expert"]
  # Experts are split evenly over the expert axis; a dense model may use that axis as extra FSDP.
  _require(num_experts == 1 or num_experts % expert_degree == 0,
           f"num_experts ({num_experts}) must be a multiple of the expert parallelism "
           f"(ici_expert_parallelism * dcn_expert_parallelism = {expert_degree})")
  data = DataConfig.from_values(values, target, mesh)
  model = _with_pipeline(ModelConfig.from_values(values), values, mesh, data.global_batch_size)
  return Groups(model=model, mesh=mesh, optim=OptimConfig.from_values(values), data=data, run=run,
                checkpoint=CheckpointConfig.from_values(values, run), decode=DecodeConfig.from_values(values))
