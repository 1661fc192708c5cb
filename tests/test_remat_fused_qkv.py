"""fused_qkv's one query/key/value matmul (named qkv_proj, its parts query_proj, key_proj, value_proj after RoPE
and the norms) priced by the planner as the compiled backward re-runs and keeps it (plan_remat.shared_matmuls,
qkv_proj_read), with and without the QK-norm, whose gradient reads the raw query and key."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from MaxText.configuration import remat_policies
from MaxText.configuration.config import Config
from test_remat_qkv_names import _POSITIONS, _SEGMENTS, _TINY, _layer, _planned_spared, _x, residuals

_FUSED = dict(base_num_kv_heads=4, fused_qkv=True)
# Wider, so that the matmuls' FLOPs dwarf the elementwise work a placement also changes.
_WIDE = dict(_FUSED, base_emb_dim=256)
_QKV = ("query_proj", "key_proj", "value_proj")
_NORMS = [False, True]
_IDS = ["no_qk_norm", "qk_norm"]


def _compiled_flops(overrides: dict, **policy) -> float:
  """Compiled FLOPs of one attention layer's loss and gradient (2 x 8 tokens) under `policy` (CPU cost analysis)."""
  from MaxText.layers import remat
  from MaxText.platform import sharding
  cfg, layer = _layer(overrides, **policy)
  graph, state = nnx.split(layer)

  def loss(x):
    return nnx.merge(graph, state)(x, _POSITIONS, _SEGMENTS).sum()
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.emb_dim), jnp.float32)
  with sharding.unsharded():
    compiled = jax.jit(jax.value_and_grad(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)))).lower(
        x).compile()
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("qk_norm", _NORMS, ids=_IDS)
def test_the_fused_matmul_is_spared_as_compiled(qk_norm):
  """Keeping qkv_proj spares the one matmul; query_proj alone spares none; the three parts spare it only without
  the QK-norm (whose gradient reads the raw query and key, slices of the matmul's output). The planner priced
  qkv_proj at 0 and each part at its own third of the matmul."""
  overrides = dict(_WIDE, use_qk_norm=qk_norm)
  fused = 2 * 2 * 8 * 256 * 3 * 4 * 16  # 2 flops x 16 tokens x emb x (q, k, v) heads x head_dim
  full = _compiled_flops(overrides, remat_policy="full")
  for keep, spared in ((("qkv_proj",), fused), (("query_proj",), 0), (_QKV, 0 if qk_norm else fused),
                       (("qkv_proj", "query_proj", "key_proj"), fused)):
    kept = {name: "device" for name in keep}
    assert _planned_spared(overrides, kept) == spared, keep
    # Beside the matmul: the norms' and RoPE's elementwise re-run, and on this CPU compile the [8, 8] QK^T per
    # head merged with the forward's when query_proj and key_proj are kept (Remat.md): a few percent.
    measured = full - _compiled_flops(overrides, remat_policy="custom", **kept)
    assert abs(measured - spared) < 0.05 * fused, (keep, measured)


def _saved(overrides: dict, **policy) -> dict[bool, float]:
  """Elements per token one attention layer keeps for its backward pass, in HBM and on the host (True)."""
  saved = {False: 0.0, True: 0.0}
  for host, n, _ in residuals(overrides, **policy):
    saved[host] += n
  return saved


def _kept(overrides: dict, policy: remat_policies.RematPolicy) -> dict[bool, float]:
  """What the planner keeps per token and layer, in HBM and on the host (True)."""
  from MaxText.aot import plan_remat
  cfg = Config.for_testing(**{**_TINY, **overrides}).model
  return {host: plan_remat.kept_width(cfg, policy, on_host=host) for host in (False, True)}


@pytest.mark.parametrize("qk_norm", _NORMS, ids=_IDS)
def test_a_kept_qkv_proj_holds_memory_where_the_backward_reads_it(qk_norm):
  """qkv_proj ([B, L, 3, N, H]) is a saved residual only where a part is re-made from it or the QK-norm reads
  its raw query and key: kept with all three parts and no norm, jax keeps the parts only. The planner's kept
  widths are the saved residuals (print_saved_residuals) of one attention layer (it counted qkv_proj always)."""
  overrides = dict(_FUSED, use_qk_norm=qk_norm)
  for keep in (("qkv_proj",), _QKV, ("qkv_proj", *_QKV), ("qkv_proj", "query_proj", "key_proj")):
    for where in ("device", "offload"):
      placed = {name: where for name in keep}
      saved = _saved(overrides, remat_policy="custom", **placed)
      assert _kept(overrides, remat_policies.custom(placed)) == saved, (keep, where, saved)


@pytest.mark.parametrize("qk_norm", _NORMS, ids=_IDS)
@pytest.mark.parametrize("name", ["minimal", "save_qkv_proj", "qkv_proj_offloaded"])
def test_the_presets_keep_qkv_proj_as_compiled(name, qk_norm):
  """What fusing adds to a preset's kept memory is what it adds to the saved residuals: with the QK-norm, the
  presets naming qkv_proj keep it beside the parts (minimal keeps it in place of the raw query and key, which
  the planner counted as unnamed dots); qkv_proj_offloaded does not name it."""
  policy = remat_policies.by_name(name)
  residuals = {fused: _saved(dict(_FUSED, fused_qkv=fused, use_qk_norm=qk_norm), remat_policy=name)
               for fused in (False, True)}
  planned = {fused: _kept(dict(_FUSED, fused_qkv=fused, use_qk_norm=qk_norm), policy) for fused in (False, True)}
  added = 3 * 4 * 16 - (2 * 4 * 16 if name == "minimal" else 0) if qk_norm and name != "qkv_proj_offloaded" else 0
  # the presets keep out_proj and the MLP's tensors too, which this attention layer's residuals leave out
  for host in (False, True):
    assert planned[True][host] - planned[False][host] == residuals[True][host] - residuals[False][host], host
    assert residuals[True][host] - residuals[False][host] == (0 if host else added), host


@pytest.mark.parametrize("apart", [dict(quantization="int8"), dict(lora_rank=4, lora_target_modules=["k_proj"]),
                                   dict(decoder_block="gemma4")], ids=["int8", "lora", "gemma4"])
def test_a_quantized_or_adapted_fused_qkv_is_priced_unfused(apart):
  """A quantized matmul or an adapter on a part runs the projections apart (linears.fused_outputs), and Gemma 4's
  own attention never fuses them: qkv_proj holds and spares nothing, each part spares its own matmul, as
  unfused (the planner priced it fused)."""
  from MaxText.aot import plan_remat
  fused = Config.for_testing(**{**_TINY, **_FUSED, **apart}).model
  unfused = Config.for_testing(**{**_TINY, **_FUSED, **apart, "fused_qkv": False}).model
  assert plan_remat.tensor_widths(fused)["qkv_proj"] == 0
  for keep in (("qkv_proj",), ("query_proj",), _QKV):
    policy = remat_policies.custom(dict.fromkeys(keep, "device"))
    assert plan_remat.rerun_flops(fused, policy, 8) == plan_remat.rerun_flops(unfused, policy, 8), keep
    assert plan_remat.kept_width(fused, policy, False) == plan_remat.kept_width(unfused, policy, False), keep


def test_the_fill_keeps_qkv_proj():
  """The fill orders fused_qkv's matmul as qkv_proj, which spares it, and keeps it with room for it; not the
  parts, each of which alone spares nothing (the fill ordered each part and never qkv_proj)."""
  from test_remat_custom import _FILL_SETTINGS, _PLAN_MODEL, _fill_setup, _limit, _room_for
  model = dict(_PLAN_MODEL, base_num_kv_heads=8, fused_qkv=True)
  _, fill, base, estimate, topology = _fill_setup(model, _FILL_SETTINGS)
  units = [names for names, _, _ in fill.order]
  assert ("qkv_proj",) in units and not {("query_proj",), ("key_proj",), ("value_proj",), _QKV} & set(units)
  before = units[:units.index(("qkv_proj",)) + 1]
  (placed, *_) = fill.variants(base, estimate, topology,
                               _limit(estimate, _room_for([n for u in before for n in u], model, _FILL_SETTINGS)), {})
  assert placed["qkv_proj"] == "device" and not set(_QKV) & set(placed)


@pytest.mark.parametrize("apart", [dict(quantization="int8"), dict(lora_rank=4, lora_target_modules=["up_proj"])],
                         ids=["int8", "lora"])
def test_a_quantized_or_adapted_fused_mlp_is_priced_unfused(apart):
  """Likewise fused_mlp's two input projections run apart, named mlpwi_0 and mlpwi_1 (test_remat_custom's
  test_a_quantized_or_adapted_fused_mlp_keeps_its_parts_names): the planner priced mlpwi, the parts at nothing."""
  from MaxText.aot import plan_remat
  fused = Config.for_testing(**{**_TINY, "fused_mlp": True, **apart}).model
  unfused = Config.for_testing(**{**_TINY, **apart}).model
  assert plan_remat.tensor_widths(fused) == plan_remat.tensor_widths(unfused)
  for keep in (("mlpwi",), ("mlpwi_0",), ("mlpwi_0", "mlpwi_1")):
    policy = remat_policies.custom(dict.fromkeys(keep, "device"))
    assert plan_remat.rerun_flops(fused, policy, 8) == plan_remat.rerun_flops(unfused, policy, 8), keep
    assert plan_remat.kept_width(fused, policy, False) == plan_remat.kept_width(unfused, policy, False), keep


def test_a_qkv_proj_placement_on_gemma4_is_one_warning_naming_the_model(capsys):
  """Gemma 4's attention never fuses its query, key and value, so with fused_qkv=True a qkv_proj placement places
  nothing: building the model says so in one line naming the key and the model (was silent: config validation
  reads only the keys, which say fused), once per process; a model whose layer fuses them is not warned about."""
  from MaxText.configuration import model_config
  from MaxText.models.transformer import Transformer
  model_config._WARNED_UNPRODUCED.discard("qkv_proj")
  for block in ("llama2", "gemma4", "gemma4"):
    cfg = Config.for_testing(**{**_TINY, **_FUSED, "decoder_block": block, "remat_policy": "custom",
                                "qkv_proj": "offload"}).model
    with nnx.use_eager_sharding(False):
      Transformer(cfg, rngs=nnx.Rngs(0))
  assert [line for line in capsys.readouterr().err.splitlines() if "qkv_proj" in line] == [
      "warning: qkv_proj=offload places nothing: no layer of gemma4 produces 'qkv_proj' (its attention projects the "
      "query, key and value apart whatever fused_qkv says)"]
