"""Model FLOPs per step, throughput and MFU, and the metric writers (stdout, JSONL, TensorBoard).

FLOPs formula (training = forward + backward = 3 × forward matmul FLOPs; a
multiply-add counts 2):

  per token, forward:
    attention projections  2·D·H·(N + 2K)  (q, k, v)  +  2·N·H·D  (output)
    MLP                    2·D·F·(number of mlp_activations)  +  2·F·D
                           (MoE: that per expert row the path computes, per token, plus the
                           router 2·D·E; see below)
    logits                 2·D·V
  per sequence and layer, forward, attention scores and the weighted sum of values:
    2·2·N·H per query-key pair the layer attends: L² without masking; with causal masking
    L²/2 for a global layer and W·L − W²/2 for a local (sliding-window) layer with window
    W < L (each query sees at most W keys; the first W queries see a causal triangle), and
    for a chunked layer with chunk C < L a causal triangle per chunk: (L // C)·C²/2 + (L mod C)²/2.
    The layer kinds cycle over attention_layer_pattern. DeepSeek Sparse Attention (index_topk T > 0,
    outside the dense warm-up) attends each query's T chosen keys: T·L − T²/2 like a window of T.
  its lightning indexer (I heads of J), per layer: per token 2·(q_lora_rank·I·J + D·J + D·I) for
    its projections, per causal pair (L²/2) 2·I·(J + 1) for the scores and their weighted sum;
    once forward per sequence the step runs (a frozen reference's too). Where the objective trains it
    (the language-model loss with indexer_loss_scaling_factor > 0) each trained sequence adds the scores'
    backward (2×) and the projections' weight gradient (1×: their inputs are detached); its KL target
    is not counted.

  Gated DeltaNet layers (attention_type=gated_deltanet, or all but every k-th layer of a hybrid stack with
  full_attention_interval k > 1, which keeps the MoE MLP on every layer) attend no pairs; per token:
    projections 2·D·(2·I·J + 2·Y·W + 2·Y) (q, k; v, output gate z; b, a) + 2·Y·W·D (output), the
    depthwise conv 2·w·(2·I·J + Y·W), and the state's update 8·Y·J·W: decay, prediction, write and read,
    one multiply-add per state element each (the recurrent form's count, as Megatron-LM's; the chunked
    form's intra-chunk matmuls are not counted). I key heads of J, Y value heads of W, conv width w.
  An attention output gate (attention_output_gate) adds a query-sized projection 2·D·N·H, a gated
  shared expert (shared_expert_gate) 2·D.

  tflops_per_step = 3 · (B·L · per_token · num_layers (+ logits) + B · attention) / 1e12

An image-text model (use_multimodal) with max_images_per_row M adds B·M views through the family's vision tower
(its flops_per_view: patch embedding, encoder layers with every token attending to every token, adapter,
projector), padding slots included since the tower runs on every slot. A frozen encoder (freeze_vision_encoder,
or any LoRA run) needs no backward, its input being pixels: forward only; a projector that trains behind it
its forward and weight gradient (2 of the 3).

A stack of differing layers (Gemma 4's per-layer shapes) is counted layer by layer, each at its own
head width, key/value heads and MLP width (layer_groups): a KV-sharing layer projects no keys or values,
a layer whose values are its keys (attention_k_eq_v) no values; plus per-layer inputs' projections
and a dense MLP beside the experts (moe_beside_mlp).

MoE expert rows per sequence: the padded path (sparse_matmul=False) runs every expert
over its C slots, E·C rows (dropless: C = L, E/k times the routed work; capacity_factor 1:
E·C = k·L); the grouped path (sparse_matmul=True) runs the k·L routed rows only, which is
what ragged_dot costs on GPU/TPU (jax's CPU lowering of ragged_dot is a masked dense product
over all experts; that extra is not counted).

Causal and window masking count the useful FLOPs, not what a dense kernel executes (the
convention of published MFU figures); the `causal=False` figure is what the dense
attention kernel executes for every layer, masked or not. Embedding lookups, norms,
softmax and the optimizer are not counted; for realistic widths they are <1%. The lookup stays
uncounted when use_iota_embed runs it as a one-hot matmul with the table (2·D·V per token forward,
as much for the table's gradient), as in upstream MaxText's count; the step-time models price that
matmul as work the step runs (aot/plan_remat.kernel_rerun_flops, and the compiled HLO's dots).
Rematerialisation is also not counted: MFU measures useful model FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np

from MaxText.paths import storage, storage_retry
from MaxText.configuration import model_checks
from MaxText.configuration.model_config import ModelConfig

if TYPE_CHECKING:
  from MaxText.configuration.config import Config


@dataclasses.dataclass(frozen=True)
class StepFlops:
  weight_tflops: float  # matmuls against parameters (the 6·N·tokens part)
  attention_tflops: float  # QK^T and AV, causal-halved
  total_tflops: float


def softmax_attention_layers(cfg: ModelConfig) -> dict[int, int]:
  """Layers with softmax attention, the MTP modules' included, by their position in attention_layer_pattern.
  A hybrid stack (full_attention_interval k > 1) has it on every k-th layer only, the others are Gated
  DeltaNet; attention_type=gated_deltanet has none. MTP modules are built like the main `layers` stack."""
  pattern = len(cfg.attn.attention_layer_pattern)
  interval = cfg.linear_attn.full_attention_interval
  counts: dict[int, int] = {}
  if cfg.attn.attention_type == "gated_deltanet":
    return counts
  # Per position, not per layer: the planner prices models of any depth many times over.
  step = interval if interval > 1 else 1
  full = cfg.num_decoder_layers // step
  period = pattern // math.gcd(pattern, step)  # full layers step·m + step − 1 revisit a position every `period`
  for m in range(min(period, full)):
    position = (step * m + step - 1) % pattern
    counts[position] = counts.get(position, 0) + full // period + (1 if m < full % period else 0)
  for depth in range(cfg.mtp.mtp_num_layers):
    position = (cfg.num_decoder_layers + depth) % pattern
    counts[position] = counts.get(position, 0) + 1
  return counts


def linear_attention_layers(cfg: ModelConfig) -> int:
  """Gated DeltaNet layers (MTP modules' included): the rest of a hybrid stack, or every layer."""
  if cfg.attn.attention_type == "gated_deltanet":
    return cfg.num_decoder_layers + cfg.mtp.mtp_num_layers
  return cfg.num_decoder_layers + cfg.mtp.mtp_num_layers - sum(softmax_attention_layers(cfg).values())


def gated_deltanet_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
  """(weight FLOPs, recurrence FLOPs) of one Gated DeltaNet layer per token, forward (module docstring)."""
  la = cfg.linear_attn
  d, y = cfg.emb_dim, la.linear_num_value_heads
  keys, values = la.linear_num_key_heads * la.linear_key_head_dim, y * la.linear_value_head_dim
  projections = 2 * d * (2 * keys + 2 * values + 2 * y) + 2 * values * d  # q, k, v, gate z, b, a; output
  conv = 2 * la.linear_conv_kernel_dim * (2 * keys + values)  # depthwise taps over q, k and v
  return float(projections + conv), float(8 * y * la.linear_key_head_dim * la.linear_value_head_dim)


def attended_pairs(cfg: ModelConfig, length: int, causal: bool = True) -> float:
  """Query-key pairs of one sequence summed over the softmax-attention layers, the MTP modules' layers
  included (see the module docstring)."""
  pattern = cfg.attn.attention_layer_pattern
  total = 0.0
  for position, count in softmax_attention_layers(cfg).items():
    kind = pattern[position]
    window = cfg.attn.sliding_window_size if kind == "local" else None
    chunk = cfg.attn.attention_chunk_size
    if not causal:
      pairs: float = length * length
    elif kind == "chunked" and chunk < length:
      pairs = (length // chunk) * chunk * chunk / 2 + (length % chunk) ** 2 / 2
    elif window is not None and window < length:
      pairs = window * length - window * window / 2
    elif 0 < cfg.mla.index_topk < length and not cfg.mla.indexer_warmup:
      pairs = cfg.mla.index_topk * length - cfg.mla.index_topk ** 2 / 2
    else:
      pairs = length * length / 2
    total += count * pairs
  return total


def indexer_flops_per_sequence(cfg: ModelConfig, length: int) -> tuple[float, float]:
  """(projection FLOPs, score FLOPs) of DeepSeek Sparse Attention's indexers in one forward pass
  over one sequence (the module docstring); zeros without an indexer."""
  heads, width = cfg.mla.index_n_heads, cfg.mla.index_head_dim
  if cfg.mla.index_topk <= 0 or heads <= 0:
    return 0.0, 0.0
  layers = cfg.num_decoder_layers + cfg.mtp.mtp_num_layers
  per_token = 2 * (cfg.mla.q_lora_rank * heads * width + cfg.emb_dim * width + cfg.emb_dim * heads)
  return float(layers * length * per_token), float(layers * length * length / 2 * 2 * heads * (width + 1))


def moe_expert_rows(cfg: ModelConfig, length: int) -> float:
  """Rows the expert matmuls process per sequence: routed (k·L) or padded slots (E·C)."""
  if cfg.moe.sparse_matmul:
    return float(cfg.moe.num_experts_per_tok * length)
  # The capacity formula lives with the kernel it sizes; imported lazily (flax) for MoE models only.
  from MaxText.layers.moe import expert_capacity  # noqa: PLC0415
  return float(cfg.moe.num_experts * expert_capacity(cfg.moe, length))


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """`count` decoder layers of one shape (`cfg`); `kv_source`: later layers read its keys and values."""
  count: int
  cfg: ModelConfig
  kv_source: bool = False


@functools.cache
def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
  """The stack's layers by shape: one group, but for a stack of differing layers (layer_shapes: Gemma 4) each
  layer's own head width and key/value heads (layers/layer_shapes.layer_config), attention_k_eq_v only where
  it runs (the global layers), no key/value heads where a layer reads another's (it projects queries only),
  and the sharing layers' MLP width (the experts' stays mlp_dim beside moe_beside_mlp's dense MLP)."""
  if not cfg.layer_shapes.active:
    return (LayerGroup(cfg.num_decoder_layers, cfg),)
  from MaxText.layers import layer_shapes  # noqa: PLC0415  (flax; only a stack of differing layers needs it)
  sources = layer_shapes.kv_sources(cfg)
  shapes = cfg.layer_shapes
  groups: list[LayerGroup] = []
  for i in range(cfg.num_decoder_layers):
    own = layer_shapes.layer_config(cfg, i)
    is_global = own.attn.attention_layer_pattern[0] == "global"
    own = dataclasses.replace(
        own, num_kv_heads=0 if i in sources else own.num_kv_heads,
        mlp_dim=cfg.mlp_dim if shapes.moe_beside_mlp else own.mlp_dim,
        layer_shapes=dataclasses.replace(shapes, attention_k_eq_v=shapes.attention_k_eq_v and is_global))
    source = i in sources.values()
    same = next((n for n, g in enumerate(groups) if g.cfg == own and g.kv_source == source), None)
    if same is None:
      groups.append(LayerGroup(1, own, source))
    else:
      groups[same] = dataclasses.replace(groups[same], count=groups[same].count + 1)
  return tuple(groups)


def attention_projection_flops(cfg: ModelConfig) -> float:
  """Weight-matmul FLOPs of one layer's attention projections per token."""
  d, n, k, h = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  if cfg.attn.attention_type != "mla":  # values made from the keys' matmul (attention_k_eq_v): none of their own
    gate = n if cfg.attn.attention_output_gate else 0  # sigmoid(x W_gate): one more query-sized projection
    return 2 * d * h * (n + gate + k + (0 if cfg.layer_shapes.attention_k_eq_v else k)) + 2 * n * h * d
  query = 2 * d * n * h if cfg.mla.q_lora_rank <= 0 else 2 * d * cfg.mla.q_lora_rank + 2 * cfg.mla.q_lora_rank * n * h
  latent = 2 * d * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
  expand = 2 * cfg.mla.kv_lora_rank * n * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim)
  return query + latent + expand + 2 * n * cfg.mla.v_head_dim * d


def forward_flops_per_sequence(cfg: ModelConfig, length: int, causal: bool = True) -> tuple[float, float]:
  """(weight-matmul FLOPs, attention FLOPs) of one forward pass over one sequence."""
  d, n, h, f, v = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  gated = len(cfg.mlp_activations)
  expert_mlp = 2 * d * f * gated + 2 * f * d
  if cfg.moe.num_experts > 1:
    mlp_per_sequence = expert_mlp * moe_expert_rows(cfg, length) + 2 * d * cfg.moe.num_experts * length
    mlp_per_sequence += expert_mlp * cfg.moe.shared_experts * length  # shared experts: every token, width x shared
    if cfg.moe.shared_experts and cfg.moe.shared_expert_gate:  # sigmoid(x W), W [D, 1]
      mlp_per_sequence += 2 * d * length
  else:
    mlp_per_sequence = expert_mlp * length
  dense_f = cfg.moe.dense_mlp_dim or f  # the dense_layers stack (first_dense_layers, moe_layer_interval): dense_mlp_dim
  dense_mlp = (2 * d * dense_f * gated + 2 * dense_f * d) * length
  # Multi-token prediction (training only): per module one more layer like the main stack's, the
  # [2D -> D] projection and another pass through the output head.
  mtp = cfg.mtp.mtp_num_layers
  # A hybrid stack's Gated DeltaNet layers are its dense_layers stack, with the MoE MLP of the others.
  hybrid = cfg.linear_attn.full_attention_interval > 1
  moe_layers = cfg.num_decoder_layers if hybrid else cfg.num_moe_stack_layers
  linear = linear_attention_layers(cfg)
  linear_weights, recurrence = gated_deltanet_flops_per_token(cfg) if linear else (0.0, 0.0)
  weights = (length * attention_projection_flops(cfg) * (cfg.num_decoder_layers + mtp - linear)
             + length * linear_weights * linear
             + mlp_per_sequence * (moe_layers + mtp) + dense_mlp * (0 if hybrid else cfg.num_dense_layers)
             + length * 2 * d * v * (1 + mtp) + length * 2 * (2 * d) * d * mtp)
  value_dim = cfg.mla.v_head_dim if cfg.attn.attention_type == "mla" else h  # QK^T over head_dim, AV over the value width
  scores = 2 * n * (h + value_dim) * attended_pairs(cfg, length, causal) + length * recurrence * linear
  if cfg.layer_shapes.active:  # each layer at its own shape (layer_groups), beside the stack's common parts
    weights, scores = _differing_layers_flops(cfg, length, causal, mlp_per_sequence)
  return float(weights), float(scores)


def _differing_layers_flops(cfg: ModelConfig, length: int, causal: bool, experts: float) -> tuple[float, float]:
  """forward_flops_per_sequence of a stack of differing layers (layer_groups; no MTP, no dense-layer stack):
  each layer's attention and MLP at its own shape, the routed `experts` (FLOPs per sequence and layer) beside
  moe_beside_mlp's dense MLP, the per-layer inputs' projections (2·D·M·P per token, and per layer its gate
  2·D·P and projection 2·P·D), the output head."""
  d, gated = cfg.emb_dim, len(cfg.mlp_activations)
  p = cfg.layer_shapes.per_layer_input_dim
  weights = float(length * (2 * d * cfg.vocab_size + 2 * d * cfg.num_decoder_layers * p))
  scores = 0.0
  for group in layer_groups(cfg):
    own = group.cfg
    dense_f = (cfg.moe.dense_mlp_dim or own.mlp_dim) if cfg.layer_shapes.moe_beside_mlp else own.mlp_dim
    layer = length * (attention_projection_flops(own) + 2 * d * dense_f * gated + 2 * dense_f * d + 4 * d * p)
    layer += experts if cfg.moe.num_experts > 1 else 0.0
    one = dataclasses.replace(own, num_decoder_layers=1, mtp=dataclasses.replace(own.mtp, mtp_num_layers=0))
    weights += group.count * layer
    scores += group.count * 2 * own.num_query_heads * 2 * own.head_dim * attended_pairs(one, length, causal)
  return weights, scores


def training_tflops_per_step(cfg: ModelConfig, global_batch: int, length: int, passes: int = 3,
                             forward_only: Sequence[ModelConfig] = (), images_per_row: int = 0,
                             trained_per_row: int = 1, trains_indexer: bool = True) -> StepFlops:
  """`passes` forward passes' worth per batch row: forward + backward is 3 (language modelling);
  an objective that runs more sequences per row says how many (objectives/base.Objective.passes_per_row),
  `trained_per_row` of them with a backward (3 each), the rest forward only (a frozen reference's).
  `trains_indexer`: the objective's loss adds the lightning indexer's KL (with indexer_loss_scaling_factor > 0).
  `forward_only`: other models run once forward per row (a distillation teacher: 2·N_teacher·tokens).
  `images_per_row`: the views a row's vision tower encodes (max_images_per_row: padding slots run too)."""
  weights, attention = forward_flops_per_sequence(cfg, length)
  index_weights, index_scores = indexer_flops_per_sequence(cfg, length)
  index_weight_passes, index_score_passes = indexer_passes(cfg, passes, trained_per_row, trains_indexer)
  weight_tflops = global_batch * (passes * weights + index_weight_passes * index_weights) / 1e12
  attention_tflops = global_batch * (passes * attention + index_score_passes * index_scores) / 1e12
  for other in forward_only:
    other_weights, other_attention = forward_flops_per_sequence(other, length)
    other_index_weights, other_index_scores = indexer_flops_per_sequence(other, length)  # a DSA model: its indexer too
    weight_tflops += global_batch * (other_weights + other_index_weights) / 1e12
    attention_tflops += global_batch * (other_attention + other_index_scores) / 1e12
  if images_per_row and cfg.vision.use_multimodal:
    tower_weights, tower_scores = vision_tower_flops(cfg, passes)
    weight_tflops += global_batch * images_per_row * tower_weights / 1e12
    attention_tflops += global_batch * images_per_row * tower_scores / 1e12
  return StepFlops(weight_tflops, attention_tflops, weight_tflops + attention_tflops)


class CountedObjective(Protocol):
  """What of an objective (objectives/base.Objective) the FLOPs count reads."""
  passes_per_row: int
  trained_per_row: int
  trains_indexer: bool
  forward_only_models: tuple[ModelConfig, ...]


@dataclasses.dataclass(frozen=True)
class ObjectiveCost:
  """What an objective's step runs per batch row and keeps beside the parameters, from the config and the
  partition alone (its ObjectiveRecord's `cost`, which the objective's own attributes come from too): the
  planner prices a step with it without building the objective. The defaults are language modelling's."""
  passes_per_row: int = 3  # CountedObjective's
  trained_per_row: int = 1
  trains_indexer: bool = True
  reference_copy: bool = False  # the state holds a frozen copy of the parameters (PreferenceState.reference)


def objective_tflops_per_step(config: Config, objective: CountedObjective) -> StepFlops:
  """training_tflops_per_step of a run's step: its batch, its objective's passes and models, its image views."""
  return training_tflops_per_step(config.model, config.data.global_batch_size, config.data.max_target_length,
                                  passes=objective.passes_per_row, forward_only=objective.forward_only_models,
                                  images_per_row=config.data.max_images_per_row,
                                  trained_per_row=objective.trained_per_row, trains_indexer=objective.trains_indexer)


def indexer_passes(cfg: ModelConfig, passes: int, trained_per_row: int, trains_indexer: bool) -> tuple[int, int]:
  """(projection passes, score passes) of the lightning indexer per row: a forward on every sequence the row
  runs (passes less the trained sequences' backwards); a trained indexer's backward adds its scores' two passes
  but its projections' weight gradient only, their inputs being detached (layers/indexer.py)."""
  forwards = passes - 2 * trained_per_row
  trained = trained_per_row if trains_indexer and cfg.mla.indexer_loss_scaling_factor > 0 else 0
  return forwards + trained, forwards + 2 * trained


def batch_words(global_batch: int, length: int, images_per_row: int = 0) -> str:
  """What the step's FLOPs are of, for the lines that print them."""
  views = f" + {images_per_row} image view(s) a sequence" if images_per_row else ""
  return f"{global_batch} sequences x {length} tokens{views}"


def vision_tower_flops(cfg: ModelConfig, passes: float = 3) -> tuple[float, float]:
  """(weight, score) FLOPs of one view through the family's vision tower at `passes` (module docstring): a frozen
  part needs no backward (its input is pixels): the encoder forward only; the projector forward and its weight
  gradient (2 of 3) when it trains behind a frozen encoder; everything `passes` when the encoder trains."""
  family = model_checks.family_of(cfg.decoder_block)
  assert family is not None and family.vision is not None, f"no vision tower for {cfg.decoder_block}"
  view = family.vision.flops_per_view(cfg)
  lora = cfg.lora.lora_rank > 0  # the whole tower frozen
  encoder_trains = not (lora or cfg.vision.freeze_vision_encoder)
  projector_trains = not (lora or cfg.vision.freeze_multimodal_projector)
  encoder_passes = passes if encoder_trains else passes / 3
  projector_passes = passes if encoder_trains else (2 * passes / 3 if projector_trains else passes / 3)
  return (encoder_passes * view.encoder_weights + projector_passes * view.projector,
          encoder_passes * view.encoder_scores)


@dataclasses.dataclass(frozen=True)
class Throughput:
  tokens_per_s: float
  tokens_per_s_per_device: float
  tflops_per_s_per_device: float
  mfu: float  # fraction of peak, nan if unknown


def throughput(step_seconds: float, tokens: float, flops: StepFlops, num_devices: int,
               peak_tflops_per_device: float) -> Throughput:
  if not step_seconds > 0 or num_devices <= 0:  # a clock that did not advance measures no rate (nan: "n/a")
    return Throughput(math.nan, math.nan, math.nan, math.nan)
  tflops_per_device = flops.total_tflops / num_devices / step_seconds
  mfu = tflops_per_device / peak_tflops_per_device if peak_tflops_per_device > 0 else math.nan
  return Throughput(tokens / step_seconds, tokens / step_seconds / num_devices, tflops_per_device, mfu)


def format_step_line(step: int, loss: float, seconds: float, t: Throughput) -> str:
  mfu = "n/a" if math.isnan(t.mfu) else f"{100 * t.mfu:.2f}%"
  return (f"step {step:>6d} | loss {loss:8.4f} | {seconds:7.3f} s | {t.tokens_per_s:11.1f} tokens/s | "
          f"{t.tflops_per_s_per_device:8.3f} TFLOP/s/device | MFU {mfu}")


def _lines_up_to(jsonl_path: str, step: int) -> list[str]:
  if not storage.exists(jsonl_path):
    return []
  data = storage.read_bytes(jsonl_path)
  # Bytes that are not UTF-8 (a disk's damage, never this writer's) fail to parse below, like a cut line.
  lines = [line + "\n" for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
  kept, damaged = [], []
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
      damaged.append(number)
    elif record["step"] <= step:
      kept.append(line)
  if damaged and damaged != [len(lines)]:  # more than the one line a kill can cut short (one writer, whole lines)
    copy = f"{jsonl_path}.damaged-{int(time.time())}"
    storage.write_bytes(copy, data)
    print(f"warning: {jsonl_path} has {len(damaged)} lines that are no step record (the first is line {damaged[0]}); "
          f"the resumed run keeps its step records only, and the file as it was is kept at {copy}", flush=True)
  return kept


class _ObjectRecordWriter:
  """tensorboardX record writer for object stores: keeps the event file's bytes and rewrites
  the whole object on flush (objects cannot be appended to). Used instead of tensorboardX's
  own GCS writer, which re-raises a failed upload from `__del__` and at exit; here a failed
  upload is one warning and the run's own error handling decides what happens."""

  def __init__(self, path: str):
    self.path, self._buffer, self._warned = path, bytearray(), False

  def write(self, data: bytes) -> None:
    self._buffer += data

  def flush(self) -> None:
    try:
      storage.write_bytes(self.path, bytes(self._buffer))
    except storage_retry.StorageUnavailable:
      pass  # the run stops with its own line
    except Exception as e:  # noqa: BLE001 - TensorBoard events are not worth stopping a run for
      if not self._warned:
        self._warned = True
        print(f"warning: cannot write TensorBoard events to {self.path}: {type(e).__name__}", flush=True)

  def close(self) -> None:
    self.flush()


class _ObjectRecordWriterFactory:
  def open(self, path: str) -> _ObjectRecordWriter:
    return _ObjectRecordWriter(path)

  def directory_check(self, path: str) -> None:
    pass  # object stores have no directories to create


def tensorboard_summary_writer() -> Any:
  """tensorboardX's SummaryWriter, with the `gs` writer registered, imported without torch:
  tensorboardX imports torch, when it is installed, only to accept torch tensors, which a run
  never hands it, and torch's import is the larger part of a training process's start-up.
  A process that already has torch keeps it."""
  hide_torch = "torch" not in sys.modules
  if hide_torch:
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
  try:
    from tensorboardX import SummaryWriter, record_writer
  finally:
    if hide_torch:
      del sys.modules["torch"]
  record_writer.register_writer_factory("gs", _ObjectRecordWriterFactory())
  return SummaryWriter


class ScalarSink(Protocol):
  """Where else the writer sends every scalar it writes (the experiment trackers, trackers.py)."""

  def log(self, step: int, scalars: Mapping[str, Any]) -> None: ...

  def close(self) -> None: ...


class MetricWriter:
  """Writes each logged step's scalars to metrics.jsonl, TensorBoard and the `sinks` (process 0 only).

  `run_dir` may be local or gs:// (TensorBoard events there through `_ObjectRecordWriter`)."""

  def __init__(self, run_dir: str, enable_jsonl: bool, enable_tensorboard: bool, resume_step: int = 0,
               sinks: Sequence[ScalarSink] = ()):
    """A fresh run (resume_step 0) starts metrics.jsonl anew; a run resumed from a checkpoint
    keeps the lines up to that step and drops later ones, which the killed run logged but
    the resumed run will log again."""
    self._sinks = list(sinks)
    storage.makedirs(run_dir)
    jsonl_path = storage.join(run_dir, "metrics.jsonl")
    self._jsonl: storage.LineLog | None = None
    if enable_jsonl:
      kept = _lines_up_to(jsonl_path, resume_step) if resume_step > 0 else []
      self._jsonl = storage.LineLog(jsonl_path, kept)
    self._tb = None
    if enable_tensorboard:
      self._tb = tensorboard_summary_writer()(storage.join(storage.resolve(run_dir), "tensorboard"))

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    if self._jsonl is not None:
      record = {"step": step, **{k: _jsonable(v) for k, v in scalars.items()}}
      self._jsonl.write_line(json.dumps(record))
    self.write_summary(step, scalars)

  def write_summary(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Run-level figures (the goodput summary) go to TensorBoard only: metrics.jsonl holds one
    record per logged step, so `[json.loads(l)["loss"] for l in f]` keeps working; the run's
    summaries have files of their own (goodput.json)."""
    for sink in self._sinks:
      sink.log(step, scalars)
    if self._tb is not None:
      for key, value in scalars.items():
        # Not inf either: the spike limit is inf until its window fills, and tensorboardX warned "NaN or Inf
        # found" at every logged step of a healthy run (metrics.jsonl keeps it as "inf").
        if isinstance(value, (int, float)) and math.isfinite(value):
          self._tb.add_scalar(key, value, step)

  def sync(self) -> None:
    """Every line so far is durable (on gs:// uploaded) when this returns."""
    if self._jsonl is not None:
      self._jsonl.sync()

  def close(self) -> None:
    try:
      if self._jsonl is not None:
        self._jsonl.close()
    finally:
      for sink in self._sinks:
        sink.close()
      self._sinks = []
      if self._tb is not None:
        self._tb.flush()
        self._tb.close()
        self._tb = None


def host_scalars(values: Mapping[str, Any]) -> dict[str, float]:
  """Host floats by name; a per-layer vector metric (e.g. moe_load_cv) becomes one scalar per
  layer, named `<name>/layer_<i>`, so JSONL and TensorBoard see each layer as its own series."""
  scalars: dict[str, float] = {}
  for name, value in values.items():
    array = np.asarray(value)
    if array.ndim == 0:
      scalars[name] = float(array)
    else:
      width = len(str(array.size - 1))
      scalars.update({f"{name}/layer_{i:0{width}d}": float(v) for i, v in enumerate(array.reshape(-1))})
  return scalars


def _jsonable(value: object) -> Any:
  if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
    return str(value)
  return value
