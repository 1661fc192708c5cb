"""The model keys' checks: each feature's keys validated together, against the mesh and the batch
where they depend on them (model_config.ModelConfig.from_values runs them before building the records).

Every check reads the flat key values and raises one ConfigError line naming the keys to change.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.configuration import batch_split
from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.remat_policies import NAMES as REMAT_POLICY_NAMES
from MaxText.errors import choices

if TYPE_CHECKING:
  from MaxText.configuration.config_groups import MeshConfig
  from MaxText.families import Family

QUANTIZATION_MODES = ("", "int8", "fp8", "mxfp8")  # layers/quantization.py runs each
ATTENTION_KINDS = ("dot_product", "flash", "cudnn_flash", "autoselected")
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring", "all_to_all")  # layers/context_parallel.py, ring_attention.py
MOE_DISPATCHES = ("all_to_all", "gather")
ALL_TO_ALL_KINDS = ("auto", "ragged", "padded")
GROUPED_MATMUL_KINDS = ("auto", "ragged_dot", "megablox")
ACTIVATIONS = ("silu", "gelu", "relu", "linear", "tanh", "clamped_swish", "clamped_plus_one")
DTYPES = ("float32", "bfloat16", "float16")
FLOAT32_MAX = 3.4028234663852886e38  # a larger number is inf on the device (1e39 passes math.isfinite)
NORMALIZATION_TYPES = ("rms", "rms_plus_one", "layer")
POSITION_EMBEDDINGS = ("rope", "learned", "sinusoidal")
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "proportional")
ATTENTION_LAYER_KINDS = ("global", "local", "chunked")
ROPE_LAYER_KINDS = ("rope", "nope")
ATTENTION_TYPES = ("gqa", "mla", "gated_deltanet")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("max", "top2_sum")
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")


def families() -> dict[str, Family]:
  """Every model family's record (families/), for the keys only some families read (a vision tower's,
  the per-layer shapes'). families/ sits above configuration/ in the import order (a family holds its
  layers), so the registry is looked up by name when such a key is set."""
  registry = importlib.import_module("MaxText.families")
  found: dict[str, Family] = registry.families()
  return found


def family_of(decoder_block: str) -> Family | None:
  """The family that writes `decoder_block`, None for a block no family writes."""
  return next((f for f in families().values() if decoder_block in f.decoder_blocks), None)


def positive(values: Mapping[str, Any], *keys: str) -> None:
  for name in keys:
    _require(values[name] > 0, f"{name} must be > 0, got {values[name]}")


def _list_of(v: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> list[Any]:
  """v[name] as a list, which must be non-empty and hold only `allowed` names; the error lists the first few unknown
  items, not the whole list (a pattern pasted per layer is thousands of items)."""
  items = list(v[name])
  unknown = list(dict.fromkeys(str(item) for item in items if item not in allowed))
  shown = ", ".join(repr(item[:40]) for item in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
  _require(bool(items) and not unknown, f"{name} must be a non-empty list of {', '.join(allowed)}; got "
           + (f"{len(items)} items, among them {shown}" if unknown else "an empty list"))
  return items


def one_of(v: Mapping[str, Any], name: str, allowed: tuple[str, ...], empty: str = "off") -> None:
  """`empty`: what "" means, where `allowed` holds it."""
  _require(v[name] in allowed, f"{name} must be one of {choices(allowed, empty)}; got {v[name]!r}")


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


def check_core(v: Mapping[str, Any]) -> None:
  """The core shape, dtypes, activations and the kernel's name."""
  positive(v, "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
           "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length")
  heads = parameter_scales(v["global_parameter_scale"])["heads"]
  num_q, num_kv = v["base_num_query_heads"] * heads, v["base_num_kv_heads"] * heads
  _require(num_q % num_kv == 0,
           f"num_query_heads ({num_q}) must be a multiple of num_kv_heads ({num_kv}) for grouped-query attention")
  if v["fused_qkv"]:
    _require(num_q == num_kv and v["attention_type"] != "mla", f"fused_qkv=True needs multi-head attention "
             f"(num_kv_heads == num_query_heads, not attention_type=mla); got {num_q} query and {num_kv} key/value "
             f"heads, attention_type={v['attention_type']}; set fused_qkv=False")
  one_of(v, "remat_policy", REMAT_POLICY_NAMES)
  one_of(v, "attention", ATTENTION_KINDS)
  for name in ("dtype", "weight_dtype"):
    one_of(v, name, DTYPES)
  _list_of(v, "mlp_activations", ACTIVATIONS)
  _require(v["swiglu_limit"] >= 0 and v["swiglu_alpha"] > 0,
           f"swiglu_limit must be >= 0 (0 = no clipping) and swiglu_alpha > 0; got {v['swiglu_limit']}, "
           f"{v['swiglu_alpha']}")
  _require(0.0 <= v["dropout_rate"] < 1.0, f"dropout_rate must be in [0, 1), got {v['dropout_rate']}")


def check_layer_layout(v: Mapping[str, Any], layers: int, pipelined: bool) -> None:
  """Which layers are dense, MoE or MTP, against the layer count and pipeline parallelism."""
  _require(0 <= v["first_dense_layers"] < layers, f"first_dense_layers must be in [0, num_decoder_layers ({layers})), "
           f"got {v['first_dense_layers']}")
  _require(v["dense_mlp_dim"] >= 0, f"dense_mlp_dim must be >= 0 (0 = mlp_dim), got {v['dense_mlp_dim']}")
  interval = v["moe_layer_interval"]
  _require(interval >= 1, f"moe_layer_interval must be >= 1 (1 = every layer MoE), got {interval}")
  _require(interval == 1 or (v["first_dense_layers"] == 0 and layers % interval == 0 and v["num_experts"] > 1),
           f"moe_layer_interval={interval} needs num_experts > 1, first_dense_layers=0 and a layer count "
           f"({layers}) that is a multiple of it")
  _require(not pipelined or interval == 1,
           "moe_layer_interval > 1 is not supported with pipeline parallelism (the stages split one homogeneous stack)")
  _require(not pipelined or v["first_dense_layers"] == 0,
           "first_dense_layers > 0 is not supported with pipeline parallelism (the stages split one homogeneous stack)")
  _require(not pipelined or v["full_attention_interval"] <= 1,
           f"full_attention_interval={v['full_attention_interval']} (Gated DeltaNet layers between full-attention "
           "layers) is not supported with pipeline parallelism (the stages split one homogeneous stack); set "
           "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
  _require(not pipelined or v["moe_bias_update_rate"] == 0,
           "moe_bias_update_rate > 0 is not supported with pipeline parallelism (the pipelines report no expert load)")
  _require(v["mtp_num_layers"] >= 0 and 0 <= v["mtp_loss_scaling_factor"] <= FLOAT32_MAX,
           f"mtp_num_layers must be >= 0 and mtp_loss_scaling_factor a finite float32 number >= 0, got "
           f"{v['mtp_num_layers']} and {v['mtp_loss_scaling_factor']}")
  _require(not pipelined or v["mtp_num_layers"] == 0,
           "mtp_num_layers > 0 is not supported with pipeline parallelism (the last stage would run the MTP modules)")


def check_context_parallel(v: Mapping[str, Any], degree: int, num_q: int, num_kv: int) -> None:
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


def check_vocab_tiling(v: Mapping[str, Any], context_degree: int, pipelined: bool) -> None:
  """num_vocab_tiling: a whole number of tiles of each device's positions, on the objectives that run it."""
  tiles = v["num_vocab_tiling"]
  _require(isinstance(tiles, int) and tiles >= 1, f"num_vocab_tiling must be a whole number >= 1 (1 = off), got {tiles!r}")
  if tiles == 1:
    return
  length = v["max_target_length"]
  _require(length % (context_degree * tiles) == 0,
           f"num_vocab_tiling={tiles} must divide the {length / context_degree:g} positions each device holds "
           f"(max_target_length={length} / sequence parallelism {context_degree}); use a divisor of it")
  # The other objectives read the logits whole (log-probs, a teacher's KL), and 1F1B runs the head
  # inside its own schedule.
  _require(v["objective"] in ("lm", "sft"), f"num_vocab_tiling={tiles} is built for objective=lm and sft only, not "
           f"objective={v['objective']}; set num_vocab_tiling=1")
  _require(not (pipelined and v["pipeline_schedule"] == "1f1b"), f"num_vocab_tiling={tiles} is not built for "
           "pipeline_schedule=1f1b (its loss head runs inside the schedule); use gpipe or circular, or num_vocab_tiling=1")


def check_quantization(v: Mapping[str, Any]) -> None:
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


def check_lora(v: Mapping[str, Any]) -> None:
  rank, targets = v["lora_rank"], list(v["lora_target_modules"])
  _require(isinstance(rank, int) and rank >= 0, f"lora_rank must be an integer >= 0 (0 = no adapters), got {rank!r}")
  if rank == 0:
    return
  # inf passed (a fresh adapter's output inf * 0 = NaN), and so did 1e39 (inf gradients from the first step).
  _require(0 < v["lora_alpha"] <= FLOAT32_MAX, f"lora_alpha must be a finite float32 number > 0 (the "
           f"adapters' scale is lora_alpha / lora_rank), got {v['lora_alpha']}")
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


def check_positions_and_attention(v: Mapping[str, Any]) -> None:
  """Normalization, position embedding, RoPE scaling and attention-pattern keys."""
  one_of(v, "normalization_type", NORMALIZATION_TYPES)
  one_of(v, "position_embedding", POSITION_EMBEDDINGS)
  one_of(v, "rope_type", ROPE_TYPES)
  if v["position_embedding"] == "rope":  # MLA rotates qk_rope_head_dim only (check_mla)
    _require(v["head_dim"] % 2 == 0 or v["attention_type"] == "mla",
             f"head_dim must be even for rotary embeddings, got {v['head_dim']}")
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
  pattern = _list_of(v, "attention_layer_pattern", ATTENTION_LAYER_KINDS)
  if "local" in pattern:
    positive(v, "sliding_window_size")
  if "chunked" in pattern:
    positive(v, "attention_chunk_size")
    _require(v["attention"] in ("dot_product", "autoselected"),
             f"chunked attention layers run on attention=dot_product (or autoselected, which picks it); "
             f"attention={v['attention']} has no chunked mask")
  _list_of(v, "rope_layer_pattern", ROPE_LAYER_KINDS)
  _require(v["attn_temperature_floor_scale"] >= 0, "attn_temperature_floor_scale must be >= 0 (0 = off), got "
           f"{v['attn_temperature_floor_scale']}")
  _require(not v["attention_sinks"] or v["attention"] != "cudnn_flash",
           "attention_sinks=True needs attention=dot_product, autoselected or flash (cuDNN's kernel has no sink "
           "logit in its softmax)")
  for key in ("attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar"):
    _require(v[key] >= 0, f"{key} must be >= 0 (0 = off), got {v[key]}")


def check_moe(v: Mapping[str, Any]) -> None:
  num_experts, top_k = v["num_experts"], v["num_experts_per_tok"]
  _require(num_experts >= 1, f"num_experts must be >= 1 (1 = dense MLP), got {num_experts}")
  _require(1 <= top_k <= num_experts,
           f"num_experts_per_tok must be between 1 and num_experts ({num_experts}), got {top_k}")
  # inf passed `>= 0`: an MoE model's gradients were NaN from the first step.
  _require(0 <= v["load_balance_loss_weight"] <= FLOAT32_MAX,
           f"load_balance_loss_weight must be a finite float32 number >= 0, got {v['load_balance_loss_weight']}")
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


def check_linear_attention(v: Mapping[str, Any]) -> None:
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
  # Learned or sinusoidal positions rotate nothing: an odd head_dim is fine there (GPT-2's 20 features / 4 heads).
  rotates = v["position_embedding"] == "rope" and v["attention_type"] != "mla"
  _require(0 < fraction <= 1 and (not rotates or (v["head_dim"] * fraction) % 2 == 0),
           f"partial_rotary_factor must be in (0, 1] and rotate an even number of head_dim={v['head_dim']} "
           f"features, got {fraction}")


def check_mla(v: Mapping[str, Any]) -> None:
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
  _require(0 <= scale <= FLOAT32_MAX, f"indexer_loss_scaling_factor must be a finite float32 number >= 0 (0 = the "
           f"indexer does not train), got {scale}")
  if v["index_topk"] == 0:
    _require(scale == 0 and not v["indexer_warmup"],
             "indexer_loss_scaling_factor and indexer_warmup train DeepSeek Sparse Attention's indexer: they need "
             "index_topk > 0 (a model with a lightning indexer)")
    return
  _require(not v["indexer_warmup"] or scale > 0,
           "indexer_warmup=True trains only the indexer, by its KL loss: set indexer_loss_scaling_factor > 0")
  # Only the language-model loss adds the KL; another objective would compute its target (a pass over the
  # attention scores) and drop it, the indexer never training.
  _require(scale == 0 or v["objective"] in ("lm", "sft"),
           f"indexer_loss_scaling_factor={scale:g} trains the lightning indexer by a KL term that only objective=lm "
           f"and sft add to their loss, not objective={v['objective']}: set indexer_loss_scaling_factor=0 (the "
           "indexer then runs as loaded)")
  _require(not v["indexer_warmup"] or v["lora_rank"] == 0,
           "indexer_warmup=True trains only the indexer: it cannot be combined with lora_rank > 0")
  _require(v["attention_type"] == "mla" and v["q_lora_rank"] > 0,
           f"index_topk={v['index_topk']} (DeepSeek Sparse Attention) needs attention_type=mla with q_lora_rank > 0 "
           "(the indexer's queries read the query latent); set index_topk=0 otherwise")
  positive(v, "index_n_heads", "index_head_dim")
  _require(v["index_head_dim"] >= v["qk_rope_head_dim"],
           f"index_head_dim ({v['index_head_dim']}) must be >= qk_rope_head_dim ({v['qk_rope_head_dim']}): "
           "the indexer rotates that many of its features")


def check_pipeline(v: Mapping[str, Any], mesh: "MeshConfig", global_batch: int, layers: int) -> tuple[int, int]:
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
  # The rows split as the data group's batch_axes (the same rule), each microbatch's less the stage.
  row_axes = [a for a in mesh.batch_axes(global_batch, accum, micro) if a != "stage"]
  row_shards = batch_split.row_devices(shape, row_axes)
  _require(rows % (micro * row_shards) == 0,
           f"the batch of {rows} sequences per gradient-accumulation step must split into num_pipeline_microbatches="
           f"{micro} microbatches, each split over {batch_split.over(shape, mesh.data_sharding, row_axes)}; "
           f"make the global batch {global_batch} (per_device_batch_size x devices) a multiple of "
           f"{micro * row_shards * accum}, or change num_pipeline_microbatches")
  return stages, micro
