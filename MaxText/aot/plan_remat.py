"""The planner's per-tensor activation pricing (plan_model.estimate uses it): for a remat policy, a
preset or a custom placement, the elements per token and layer each named activation holds on the device or in
host memory, the projection outputs the backward pass needs, and the forward FLOPs the backward re-runs
(the policy's, and the kernels' own beyond the model's count); a MoE layer's expert rows as its dispatch
path lays them out per chip."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Collection, Mapping

from MaxText.configuration import remat_policies
from MaxText.configuration.model_config import ModelConfig
from MaxText.training import metrics

def preset_widths(cfg: ModelConfig) -> dict[remat_policies.Width, float]:
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
def layer_unproduced(decoder_block: str) -> dict[str, str]:
  """The activation names the shared layers produce that the family's own layer never does, with why
  (its `unproduced_names`): a placement of one places nothing."""
  from MaxText import families  # noqa: PLC0415  (flax; only the planner needs it here)
  return dict(getattr(families.family_for_decoder_block(decoder_block).layer, "unproduced_names", {}))


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


def fuses_qkv(cfg: ModelConfig) -> bool:
  """Whether the attention's query, key and value come from one matmul named qkv_proj (fused_qkv): a quantized
  matmul or a LoRA adapter on any of them keeps them apart (linears.fused_outputs), priced then as unfused, as
  is a family's own layer that never makes qkv_proj (Gemma 4's: layer_unproduced)."""
  return (cfg.fused_qkv and cfg.attn.attention_type != "mla" and not _runs_apart(cfg, ("q_proj", "k_proj", "v_proj"))
          and "qkv_proj" not in layer_unproduced(cfg.decoder_block))


def _runs_apart(cfg: ModelConfig, targets: tuple[str, ...]) -> bool:
  """Whether quantization or a LoRA adapter on one of `targets` keeps a fused matmul's parts apart."""
  lora = cfg.lora
  return bool(cfg.quantization) or (lora.lora_rank > 0 and bool(set(targets) & set(lora.lora_target_modules)))


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
  if cfg.layer_shapes.moe_beside_mlp:  # Gemma 4's dense MLP beside the experts
    dense = cfg.moe.dense_mlp_dim or cfg.mlp_dim
  rope = cfg.mla.qk_rope_head_dim
  gated = len(cfg.mlp_activations) > 1  # two input projections (layers/mlp.py names them mlpwi_0, mlpwi_1)
  # their one matmul's output is mlpwi, the parts unnamed (as upstream), unless they run apart (_runs_apart)
  fused_mlp = gated and cfg.fused_mlp and not _runs_apart(cfg, ("gate_proj", "up_proj"))
  mla = cfg.attn.attention_type == "mla"  # whose attention output is `attention_out`; the others' is `context`
  # MLA's key_proj and value_proj are per query head, its values v_head_dim wide (layers/mla.py).
  key, value = (n * h, n * cfg.mla.v_head_dim) if mla else (k * h, k * h)
  return {"decoder_layer_input": d, "query_proj": n * h, "key_proj": key, "value_proj": value,
          "qkv_proj": (n + 2 * k) * h if fuses_qkv(cfg) else 0,
          "context": 0 if mla else n * h, "attention_out": n * h if mla else 0, "out_proj": d,
          "query_wa_proj": cfg.mla.q_lora_rank,
          "kv_wa_proj": cfg.mla.kv_lora_rank + rope if mla else 0,
          "mla_q": cfg.mla.q_lora_rank, "mla_kv": cfg.mla.kv_lora_rank if mla else 0,
          "mlpwi": dense * len(cfg.mlp_activations) if fused_mlp or not gated else 0,
          "mlpwi_0": dense if gated and not fused_mlp else 0, "mlpwi_1": dense if gated and not fused_mlp else 0,
          "mlpwo": d if dense and mlp_output_read(cfg) else 0, "moe_mlpwi_0": routed, "moe_mlpwi_1": routed if gated else 0,
          "moe_mlpwo": d * rows * repeat_out}


def stack_tensor_widths(cfg: ModelConfig) -> dict[str, float]:
  """tensor_widths averaged over the stack's layers, each at its own shape (metrics.layer_groups: Gemma 4's
  differ), on one chip."""
  groups = metrics.layer_groups(cfg)
  if len(groups) == 1:
    return tensor_widths(cfg)
  total = sum(group.count for group in groups)
  per_group = [(group.count, tensor_widths(group.cfg)) for group in groups]
  return {name: sum(count * widths[name] for count, widths in per_group) / total for name in per_group[0][1]}


def placed_tensors(cfg: ModelConfig, policy: remat_policies.RematPolicy) -> dict[str, str]:
  """Each tensor `policy` names, placed (device | offload), and the routed experts' tensors the
  MLP names reach (remat_policies.expert_placements)."""
  placed = {**{n: "device" for n in policy.device}, **{n: "offload" for n in policy.offload}}
  return {**placed, **remat_policies.expert_placements(placed, cfg.moe.sparse_matmul)}


def normed_projections(cfg: ModelConfig) -> dict[str, float]:
  """Per token and layer, the raw projections a norm's gradient reads, by the name on its normed output.
  query_proj and key_proj name the kernel's inputs (after the QK-norm, as upstream), so with use_qk_norm,
  use_qk_l2_norm (computed on every layer of a mixed rope pattern) or Gemma 4's norms, the norms' gradients
  need the raw query and key; value_proj is named after Gemma 4's value norm (use_v_norm), whose gradient
  needs the raw value, but where the values are the keys (attention_k_eq_v): the raw key is that."""
  n, k, h = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  out: dict[str, float] = {}
  if cfg.attn.attention_type == "mla":
    return out
  if cfg.attn.use_qk_norm or cfg.attn.use_qk_l2_norm or _layer_norms_query_and_key(cfg.decoder_block):
    out.update(query_proj=n * h, key_proj=k * h)
  if cfg.layer_shapes.use_v_norm and not cfg.layer_shapes.attention_k_eq_v:
    out["value_proj"] = k * h
  return out


def backward_dots(cfg: ModelConfig) -> dict[str, float]:
  """Per token and layer, projection outputs the backward pass needs that no name covers: the raw
  projections under a norm (normed_projections; with fused_qkv they are parts of qkv_proj, a name: its
  matmul is priced in shared_matmuls) and the output gate, unnamed as upstream's. A policy that keeps the
  dots keeps these (kept_width); any other re-runs their matmuls (rerun_flops), whether the names are kept
  or not."""
  n, h = cfg.num_query_heads, cfg.head_dim
  out = {} if fuses_qkv(cfg) else normed_projections(cfg)
  if cfg.attn.attention_output_gate:
    out["output_gate"] = n * h
  return out


def recompute_flops(cfg: ModelConfig) -> dict[str, float]:
  """Per token and layer, the forward FLOPs the backward pass re-runs when a named tensor is not kept:
  the matmul that makes it. The MLP output projections' results feed only the residual add, which no
  backward op needs, so dropping them costs nothing; a norm's output costs no matmul; the attention
  output (`context`, MLA's `attention_out`) is priced per sequence (rerun_flops), as it grows with
  the length. Additive over the tensors, as compiled FLOPs show (tests/test_remat_custom.py), but for a
  matmul whose output several names split (shared_matmuls), priced in rerun_flops."""
  widths = tensor_widths(cfg)
  d = cfg.emb_dim
  mla = cfg.attn.attention_type == "mla"
  value_dim = cfg.mla.v_head_dim if mla else cfg.head_dim
  # What each projection reads per token: the layer's (normalised) input, MLA's latents for its up-projections.
  reads = {name: d for name in widths}
  reads.update(decoder_layer_input=0, mla_q=0, mla_kv=0, mlpwo=0, moe_mlpwo=0, context=0, attention_out=0)
  if fuses_qkv(cfg):  # the one matmul makes all three (shared_matmuls)
    reads.update(query_proj=0, key_proj=0, value_proj=0)
  reads["qkv_proj"] = 0
  if mla:  # its key_proj and value_proj share one up-projection (shared_matmuls)
    reads.update(query_proj=cfg.mla.q_lora_rank or d, key_proj=0, value_proj=0)
  if cfg.layer_shapes.attention_k_eq_v:  # the values are the keys' matmul: none of their own
    reads["value_proj"] = 0
  flops = {name: 2 * reads[name] * width for name, width in widths.items()}
  flops["out_proj"] = 2 * cfg.num_query_heads * value_dim * d
  # A normed query, key or value kept spares no matmul: the norm's gradient re-runs it anyway (backward_dots).
  flops.update({name: 0.0 for name in backward_dots(cfg) if name in flops})
  return flops


def shared_matmuls(cfg: ModelConfig) -> list[tuple[tuple[frozenset[str], ...], float]]:
  """Per token and layer, each matmul whose one output several names carry, with the sets of names any one
  of which, all kept, spares its re-run (the narrowest first). MLA's key/value up-projection makes each
  head's no-position key (in key_proj, beside the rotated part kv_wa_proj makes) and its value
  (value_proj) from the latent: both kept. fused_qkv's matmul: qkv_proj kept, or the query, key and value
  (named after RoPE and the norms) all kept where no norm's gradient reads the raw parts (normed_projections):
  one of them alone spares only elementwise work."""
  if fuses_qkv(cfg):
    qkv = frozenset({"query_proj", "key_proj", "value_proj"})
    spare = (frozenset({"qkv_proj"}),) + (() if normed_projections(cfg) else (qkv,))
    return [(spare, 2.0 * cfg.emb_dim * (cfg.num_query_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)]
  if cfg.attn.attention_type != "mla":
    return []
  m = cfg.mla
  return [((frozenset({"key_proj", "value_proj"}),), 2.0 * m.kv_lora_rank * cfg.num_query_heads
           * (m.qk_nope_head_dim + m.v_head_dim))]


def qkv_proj_read(cfg: ModelConfig, kept: Collection[str]) -> bool:
  """Whether the backward reads fused_qkv's qkv_proj when the names `kept` are kept, so that keeping it holds
  memory: a norm reads its raw parts, or a query, key or value not kept is re-made from it."""
  return fuses_qkv(cfg) and (bool(normed_projections(cfg)) or not {"query_proj", "key_proj", "value_proj"} <= set(kept))


def rerun_flops(cfg: ModelConfig, policy: remat_policies.RematPolicy, seq_len: int) -> float:
  """Forward FLOPs per sequence that `policy`'s backward pass re-runs over every layer: the matmuls
  of the tensors it does not keep (a shared matmul unless all its names are kept), the attention scores
  (re-run whatever is kept: the softmax's backward needs them; a CPU compile of an unscanned dot_product
  model runs them once with query_proj and key_proj kept, a TPU compile twice: Remat.md), and the
  probabilities-times-values product unless the attention output is kept."""
  if policy.keeps == "everything":
    return 0.0
  if not cfg.layer_shapes.active:
    return _rerun(cfg, policy, seq_len, cfg.num_decoder_layers, metrics.attended_pairs(cfg, seq_len, causal=True))
  # each layer shape with its own layers' pairs (a layer's pattern is its one kind)
  return sum(group.count * _rerun(group.cfg, policy, seq_len, 1, metrics.attended_pairs(
      dataclasses.replace(group.cfg, num_decoder_layers=1, mtp=dataclasses.replace(group.cfg.mtp, mtp_num_layers=0)),
      seq_len, causal=True)) for group in metrics.layer_groups(cfg))


def _rerun(cfg: ModelConfig, policy: remat_policies.RematPolicy, seq_len: int, layers: int, pairs: float) -> float:
  """rerun_flops of `layers` layers of `cfg`'s shape attending `pairs` query-key pairs in all."""
  kept = {name for name, placed in placed_tensors(cfg, policy).items() if placed != "remat"}
  projections = sum(f for name, f in recompute_flops(cfg).items() if name not in kept)
  if policy.keeps != "dots":  # which keep every matmul's output
    projections += sum(f for spare, f in shared_matmuls(cfg) if not any(names <= kept for names in spare))
    projections += sum(2 * cfg.emb_dim * width for width in backward_dots(cfg).values())
  value_dim = cfg.mla.v_head_dim if cfg.attn.attention_type == "mla" else cfg.head_dim
  attention = 2 * cfg.num_query_heads * cfg.head_dim * pairs
  if not kept & {"context", "attention_out"}:
    attention += 2 * cfg.num_query_heads * value_dim * pairs
  return seq_len * layers * projections + attention


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
  if cfg.layer_shapes.active and layers > 0:
    return sum(group.count * (layer_kept_width(group.cfg, policy, on_host, mesh)
                              + (0.0 if on_host or not group.kv_source else _held_keys_values(group.cfg, policy)))
               for group in metrics.layer_groups(cfg)) / layers
  kept = layer_kept_width(cfg, policy, on_host, mesh)
  if dense <= 0 or cfg.linear_attn.full_attention_interval > 1 or layers <= 0:
    return kept
  dense_kept = layer_kept_width(cfg.dense_prefix_config(), policy, on_host, mesh)
  return ((layers - dense) * kept + dense * dense_kept) / layers


def _held_keys_values(cfg: ModelConfig, policy: remat_policies.RematPolicy) -> float:
  """Elements per token a KV source layer's keys and values hold in HBM for the layers that read them, beyond
  what `policy` keeps there: they are those layers' inputs, saved whatever the policy (an offloaded copy
  leaves them in HBM too)."""
  widths = tensor_widths(cfg)
  return sum(widths[name] for name in ("key_proj", "value_proj")
             if not (policy.keeps == "everything" or name in policy.device))


def layer_kept_width(cfg: ModelConfig, policy: remat_policies.RematPolicy, on_host: bool,
                     mesh: Mapping[str, int] | None = None) -> float:
  """Elements per token one layer of `cfg` keeps (kept_width): a custom placement per tensor, a fixed
  policy by its preset widths (a MoE layer's MLP per tensor, as its path lays the experts' rows out on
  the candidate's `mesh`: tensor_widths)."""
  where = "offload" if on_host else "device"
  placed = placed_tensors(cfg, policy)
  widths = tensor_widths(cfg, mesh)
  # fused_qkv's qkv_proj is held only where the backward reads it (qkv_proj_read); presets count it beside "qkv"
  kept_names = [n for n, at in placed.items() if at != "remat"]
  fused = widths["qkv_proj"] if placed.get("qkv_proj") == where and qkv_proj_read(cfg, kept_names) else 0.0
  if policy.name == "custom":
    return fused + sum(widths[n] for n, at in placed.items() if at == where and n != "qkv_proj")
  preset = preset_widths(cfg)
  saved = policy.saved_on_host if on_host else policy.saved_on_device
  # The dots policies keep the projection outputs no name covers too, where they keep the dots.
  unnamed = sum(backward_dots(cfg).values()) if policy.keeps == "dots" and on_host == policy.offloaded else 0.0
  if cfg.moe.num_experts > 1:
    # Only the MLP tensors a preset's names reach (sparse_matmul's wi_1 carries only moe_mlpwi_1, which no
    # preset names: remat_policies.expert_placements), the shared experts' too; "none" keeps them all.
    for width, names in _MLP_TENSORS.items():
      preset[width] = sum(widths[n] for n in names if policy.keeps == "everything" or placed.get(n) == where)
  kept = sum(preset[w] for w in saved)
  if policy.keeps == "dots" and cfg.moe.num_experts > 1 and on_host == policy.offloaded:
    # The router's logits (and the shared experts' gate) are dots without batch dimensions.
    kept += cfg.moe.num_experts + (1 if cfg.moe.shared_expert_gate else 0)
  return kept + unnamed + fused


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
