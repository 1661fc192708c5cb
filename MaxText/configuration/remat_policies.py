"""The remat policies (`remat_policy`): one record each, read by config validation
(model_config), the model's jax.checkpoint policy (layers/remat.py) and the planner's
activation-memory and recompute model (plan_model.py). Free of jax, so the configuration can
import it; layers/remat.py turns a record into jax's policy.

`remat_policy=custom` places each activation the layers name (`checkpoint_name`) by its own key:
`device` (kept in HBM for the backward pass), `offload` (kept in pinned host memory) or `remat`
(recomputed). The key names are upstream MaxText's, so a recipe's tuning block carries over as
written. The fixed policies are named placements of the same tensors (PRESET_PLACEMENTS).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

# What the backward pass finds saved rather than recomputing: nothing, the matmuls without batch
# dimensions (weights × activations), the tensors named by `checkpoint_name` in `device` and
# `offload`, or everything (no rematerialisation at all).
Keeps = Literal["nothing", "dots", "names", "everything"]
# The widths the planner counts per token and layer, as plan_remat.preset_widths names them.
Width = Literal["qkv", "out", "mlp_in", "mlp_out", "attn", "norms", "mlp_act"]
Placement = Literal["remat", "device", "offload"]
PLACEMENTS: tuple[Placement, ...] = ("remat", "device", "offload")

# Every activation name a `remat_policy=custom` key places, with what carries it here. A name no
# layer here produces (a fused projection, a feature this project does not have) is accepted so
# an upstream recipe runs as written, and places nothing.
TENSORS: dict[str, str] = {
    "decoder_layer_input": "a decoder layer's input, the residual stream entering it",
    # upstream's names for the attention kernel's inputs (layers/attention.named_qkv), not the raw projections
    "query_proj": "the query the attention kernel receives: after QK-norm, RoPE, L2-norm and the query scale",
    "key_proj": "the key the attention kernel receives (MLA: each head's no-position part and the shared rotated one)",
    "value_proj": "the value the attention kernel receives (MLA: the values from the key/value latent)",
    "qkv_proj": "fused_qkv's one query/key/value matmul, before the split",
    "context": "the attention kernel's output before the output projection (grouped-query attention)",
    "attention_out": "the attention kernel's output before the output projection (MLA)",
    "out_proj": "the attention output projection",
    "query_wa_proj": "MLA's query down-projection (q_lora_rank wide)",
    "kv_wa_proj": "MLA's key/value down-projection (kv_lora_rank plus the rotated key)",
    "mla_q": "MLA's normalised query latent",
    "mla_kv": "MLA's normalised key/value latent",
    "mlpwi": "an ungated MLP's input projection",
    "mlpwi_0": "a gated MLP's first input projection (the activation's input)",
    "mlpwi_1": "a gated MLP's second input projection (the linear one)",
    "mlpwo": "the MLP output projection",
    "moe_mlpwi_0": "the routed experts' first input projection (also named mlpwi_0)",
    "moe_mlpwi_1": "the routed experts' second input projection (also named mlpwi_1, not with sparse_matmul)",
    "moe_mlpwo": "the routed experts' output projection (also named mlpwo)",
    "kv_proj": "",  # a fused key/value projection: none here
    "indexer_cutoff_threshold": "",  # the sparse-attention indexer keeps its own selection (layers/sparse_attention.py)
    "engram": "",  # no engram memory here
}
PRODUCED: tuple[str, ...] = tuple(name for name, what in TENSORS.items() if what)
# Produced only under a config key (model_config warns when a placement names one that is off).
PRODUCED_WITH: dict[str, str] = {"qkv_proj": "fused_qkv"}
MLA_ONLY = ("query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out")
# As upstream's moe.py, a routed expert's projection carries the dense MLP's name inside its own, so
# a placement of mlpwi_0 or mlpwo (and the presets that keep them) reaches the experts too, and
# the moe_* key, when not remat, wins. Upstream's sparse_matmul path names wi_1 moe_mlpwi_1 only.
EXPERT_ALSO_NAMED: dict[str, str] = {"moe_mlpwi_0": "mlpwi_0", "moe_mlpwi_1": "mlpwi_1", "moe_mlpwo": "mlpwo"}
SPARSE_MATMUL_ONLY_MOE = ("moe_mlpwi_1",)
# A layer's input is what every recompute starts from: it can be kept in HBM or offloaded, not recomputed.
NOT_RECOMPUTABLE = ("decoder_layer_input",)

# The attention projections' checkpoint names that upstream's save_qkv_proj, save_dot_except_mlp and
# minimal keep (src/maxtext/layers/decoders.py; its kv_proj no layer here produces). Not MLA's
# down-projections, which those presets recompute there.
QKV_PROJ = ("query_proj", "key_proj", "value_proj", "qkv_proj")
ATTENTION_PROJ = QKV_PROJ + ("out_proj",)
MLA_DOWN_PROJ = ("query_wa_proj", "kv_wa_proj")
# Every projection's output: what jax's dots-without-batch-dimensions policy keeps of the named tensors.
PROJECTIONS = ATTENTION_PROJ + MLA_DOWN_PROJ + ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1",
                                                "moe_mlpwo")
# What minimal and minimal_offloaded keep: the dots without batch dimensions and, as upstream's
# minimal names them, the MLP projections, which reach the routed experts (EXPERT_ALSO_NAMED).
_MINIMAL_NAMES = ATTENTION_PROJ + MLA_DOWN_PROJ + ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")

# The preset widths (plan_remat.preset_widths) each produced tensor belongs to, for comparing a placement
# with the presets; the planner prices a custom placement per tensor (plan_remat.tensor_widths).
_TENSOR_WIDTHS: dict[str, Width] = {
    "query_proj": "qkv", "key_proj": "qkv", "value_proj": "qkv", "qkv_proj": "qkv", "out_proj": "out", "context": "attn",
    "attention_out": "attn", "mlpwi": "mlp_in", "mlpwi_0": "mlp_in", "mlpwi_1": "mlp_in", "mlpwo": "mlp_out",
    "moe_mlpwi_0": "mlp_in", "moe_mlpwi_1": "mlp_in", "moe_mlpwo": "mlp_out",
}


@dataclasses.dataclass(frozen=True)
class RematPolicy:
  name: str
  keeps: Keeps
  device: tuple[str, ...] = ()  # named tensors kept in HBM (keeps="dots": kept too, beside the dots)
  offload: tuple[str, ...] = ()  # named tensors kept in pinned host memory, back for the backward pass
  # What the planner counts as kept per token and layer besides the layer input (what the backward
  # re-runs it counts from the tensors kept: plan_remat.rerun_flops).
  saved: tuple[Width, ...] = ()
  searched_by_planner: bool = True

  @property
  def offloaded(self) -> bool:
    return bool(self.offload)

  @property
  def names(self) -> tuple[str, ...]:
    """Every named tensor the policy keeps, in HBM or on the host."""
    return self.device + self.offload

  @property
  def saved_on_device(self) -> tuple[Width, ...]:
    """Widths kept in HBM besides the layer input (which is there unless offloaded)."""
    return _widths_of(self.device) if self.offloaded else self.saved

  @property
  def saved_on_host(self) -> tuple[Width, ...]:
    """Widths kept in pinned host memory."""
    return _widths_of(self.offload) if self.offloaded else ()

  def placements(self) -> dict[str, Placement]:
    """Every tensor key's placement under this policy (the layer input stays in HBM)."""
    out: dict[str, Placement] = {name: "remat" for name in TENSORS}
    out["decoder_layer_input"] = "device"
    out.update({name: "device" for name in self.device})
    out.update({name: "offload" for name in self.offload})
    return out


def _widths_of(names: tuple[str, ...]) -> tuple[Width, ...]:
  """The planner widths `names` fill, each once, in _TENSOR_WIDTHS' order."""
  found = {_TENSOR_WIDTHS[n] for n in names if n in _TENSOR_WIDTHS}
  return tuple(dict.fromkeys(w for w in _TENSOR_WIDTHS.values() if w in found))


# The projections upstream's qkv_proj_offloaded names (not MLA's down-projections, not the fused one),
# and those its save_dot_except_mlpwi and save_dot_with_context_except_mlp name.
_UPSTREAM_QKV = ("query_proj", "key_proj", "value_proj")
_UPSTREAM_QKV_FUSED = _UPSTREAM_QKV + ("qkv_proj",)
_MINIMAL: tuple[Width, ...] = ("qkv", "out", "mlp_in", "mlp_out")
_ATTENTION: tuple[Width, ...] = ("qkv", "out")

# In the order the planner searches them (it breaks ties between equal estimates by this order).
REMAT_POLICIES: tuple[RematPolicy, ...] = (
    RematPolicy("full", "nothing"),
    RematPolicy("save_qkv_proj", "names", QKV_PROJ, saved=("qkv",)),
    RematPolicy("save_dot_except_mlp", "names", ATTENTION_PROJ, saved=_ATTENTION),
    RematPolicy("minimal", "dots", _MINIMAL_NAMES, saved=_MINIMAL),
    RematPolicy("minimal_offloaded", "dots", offload=_MINIMAL_NAMES, saved=_MINIMAL),
    RematPolicy("save_dot_except_mlp_offloaded", "names", offload=ATTENTION_PROJ, saved=_ATTENTION),
    RematPolicy("none", "everything", saved=_MINIMAL + ("attn", "norms", "mlp_act"), searched_by_planner=False),
    # upstream MaxText's presets, with exactly its names: the planner searches the placements between
    # its steps instead (SEARCHED_PLACEMENTS)
    RematPolicy("qkv_proj_offloaded", "names", offload=_UPSTREAM_QKV, saved=("qkv",), searched_by_planner=False),
    RematPolicy("save_dot_except_mlpwi", "names", _UPSTREAM_QKV_FUSED + ("out_proj", "mlpwo"),
                saved=("qkv", "out", "mlp_out"), searched_by_planner=False),
    RematPolicy("save_dot_with_context_except_mlp", "names", _UPSTREAM_QKV_FUSED + ("context", "out_proj"),
                saved=("qkv", "out", "attn"), searched_by_planner=False),
    RematPolicy("custom", "names", searched_by_planner=False),  # its tensors from the placement keys (custom())
)
BY_NAME: dict[str, RematPolicy] = {policy.name: policy for policy in REMAT_POLICIES}
NAMES: tuple[str, ...] = tuple(BY_NAME)
# The fixed policies as placements: what `remat_policy=custom` with these keys keeps. "none" keeps
# every intermediate, which no placement of named tensors spells.
PRESET_PLACEMENTS: dict[str, dict[str, Placement]] = {
    p.name: p.placements() for p in REMAT_POLICIES if p.name not in ("none", "custom")}



# The placements the planner searches beside the fixed policies, between their steps as upstream
# recipes tune them: the attention projections in HBM with the MLP's offloaded; only the query,
# key and value offloaded (upstream's qkv_proj_offloaded); every projection in HBM with the layer
# input offloaded.
SEARCHED_PLACEMENTS: dict[str, dict[str, Placement]] = {
    "attn_hbm_mlp_host": {**{n: "device" for n in ATTENTION_PROJ},
                          **{n: "offload" for n in ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0",
                                                    "moe_mlpwi_1", "moe_mlpwo")}},
    "qkv_host": {n: "offload" for n in QKV_PROJ},
    "minimal_input_host": {**{n: "device" for n in PROJECTIONS}, "decoder_layer_input": "offload"},
}


def expert_placements(placements: Mapping[str, str], sparse_matmul: bool) -> dict[str, str]:
  """Each moe_* tensor's placement in effect: its own key unless remat, else its dense MLP name's
  (EXPERT_ALSO_NAMED; sparse_matmul's wi_1 carries no dense name)."""
  out = {}
  for moe, dense in EXPERT_ALSO_NAMED.items():
    own = placements.get(moe, "remat")
    shared = "remat" if sparse_matmul and moe in SPARSE_MATMUL_ONLY_MOE else placements.get(dense, "remat")
    out[moe] = own if own != "remat" else shared
  return out


def not_produced(values: Mapping[str, Any]) -> dict[str, str]:
  """The PRODUCED names no layer of the model `values` (config keys) configures produces, each with the keys
  that say why: a placement of one places nothing (model_config warns)."""
  out = {n: f"{k}=False" for n, k in PRODUCED_WITH.items() if not values[k]}  # qkv_proj unfused
  # A quantized matmul or a LoRA adapter keeps fused_qkv's and fused_mlp's projections apart, each with its own
  # name (linears.fused_outputs: DenseGeneral.fusable_with).
  adapted = set(values["lora_target_modules"]) if values["lora_rank"] > 0 else set()
  apart = {fused: (f"quantization={values['quantization']}" if values["quantization"] else
                   f"LoRA on {', '.join(sorted(adapted & set(targets)))}" if adapted & set(targets) else "")
           for fused, targets in (("fused_qkv", ("q_proj", "k_proj", "v_proj")), ("fused_mlp", ("gate_proj", "up_proj")))}
  if values["fused_qkv"] and apart["fused_qkv"]:
    out["qkv_proj"] = f"{apart['fused_qkv']}: fused_qkv's projections run apart, named query_proj, key_proj, value_proj"
  activations = list(values["mlp_activations"])
  if values["num_experts"] <= 1:  # no expert carries the dense MLP's names
    out.update({n: f"num_experts={values['num_experts']}: no routed experts" for n in EXPERT_ALSO_NAMED})
    if len(activations) == 1:
      out.update({n: f"mlp_activations={activations}: the ungated MLP names its input projection mlpwi"
                  for n in ("mlpwi_0", "mlpwi_1")})
    elif values["fused_mlp"] and not apart["fused_mlp"]:  # one matmul, named mlpwi as upstream
      out.update({n: "fused_mlp=True names its one matmul mlpwi" for n in ("mlpwi_0", "mlpwi_1")})
    elif values["fused_mlp"]:
      out["mlpwi"] = f"{apart['fused_mlp']}: fused_mlp's projections run apart, named mlpwi_0 and mlpwi_1"
    else:
      out["mlpwi"] = f"mlp_activations={activations}: the gated MLP's input projections are mlpwi_0 and mlpwi_1"
  if values["attention_type"] == "mla":
    out["context"] = "attention_type=mla names the attention kernel's output attention_out"
    if values["q_lora_rank"] <= 0:
      out.update({n: "q_lora_rank=0: MLA's query has no down-projection" for n in ("query_wa_proj", "mla_q")})
  else:
    out.update({n: f"attention_type={values['attention_type']}: only MLA names it" for n in MLA_ONLY})
  return out


def by_name(name: str) -> RematPolicy:
  return BY_NAME[name]


# The names some models do not produce (not_produced): the planner leaves them out of a searched placement.
CONDITIONAL = frozenset(("qkv_proj", "context", "mlpwi", "mlpwi_0", "mlpwi_1", *MLA_ONLY, *EXPERT_ALSO_NAMED))


def placement_label(placements: Mapping[str, object]) -> str:
  """A searched placement's name (less the names the model does not produce), or the non-default keys, for a
  table label."""
  moved = {n: p for n, p in placements.items() if n in TENSORS and p != BY_NAME["full"].placements()[n]}
  for name, searched in SEARCHED_PLACEMENTS.items():
    if moved and moved == {n: p for n, p in searched.items() if n in moved or n not in CONDITIONAL}:
      return name
  return ",".join(f"{n}={p}" for n, p in moved.items()) or "full"


def custom(placements: Mapping[str, str]) -> RematPolicy:
  """The policy `remat_policy=custom` runs for `placements` (tensor key -> remat | device | offload;
  keys left out are recomputed)."""
  # The layer input is jax.checkpoint's own argument: kept without a name unless it is offloaded.
  device = tuple(n for n in PRODUCED if placements.get(n) == "device" and n not in NOT_RECOMPUTABLE)
  offload = tuple(n for n in PRODUCED if placements.get(n) == "offload")
  return RematPolicy("custom", "names", device, offload, saved=_widths_of(device + offload), searched_by_planner=False)


def check_placements(placements: Mapping[str, object]) -> list[str]:
  """One message per wrong placement value (empty when all are right)."""
  problems = []
  for name, value in placements.items():
    if value not in PLACEMENTS:
      problems.append(f"{name}={value!r} is not a placement; use one of {' | '.join(PLACEMENTS)}")
    elif name in NOT_RECOMPUTABLE and value == "remat":
      problems.append(f"{name}=remat: a layer's input is where its recompute starts; keep it on device or offload it")
  return problems
