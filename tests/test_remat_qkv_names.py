"""Where query_proj, key_proj and value_proj sit: on the attention kernel's inputs, after QK-norm, RoPE, the
L2-norm, temperature tuning and the query scale, as upstream's attentions.py and attention_mla.py name them
(they named the projections' outputs here, before the norm and RoPE). A placement changes what the
backward keeps, never the values or the gradients."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.configuration import remat_policies
from MaxText.configuration.config import Config

_TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
             base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
             print_config=False, dtype="float32", attention="dot_product")
_MLA = dict(_TINY, decoder_block="deepseek3", base_num_kv_heads=4, head_dim=12, attention_type="mla", q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
# Each family's path to the kernel's inputs.
_FAMILIES = {
    "llama": {},
    "qk_norm": dict(use_qk_norm=True),  # Qwen3, Gemma 3: the norm before RoPE
    "qk_norm_all_heads": dict(use_qk_norm=True, qk_norm_over_all_heads=True),  # OLMo
    "l2_norm_after_rope": dict(use_qk_l2_norm=True, rope_layer_pattern=["rope", "rope", "rope", "nope"],
                               attn_temperature_floor_scale=8.0),  # Llama 4
    "partial_rope_gate": dict(use_qk_norm=True, partial_rotary_factor=0.25, attention_output_gate=True),  # Qwen3-Next
    "query_pre_attn_scalar": dict(use_qk_norm=True, query_pre_attn_scalar=144.0),  # Gemma 2/3
    "fused_qkv": dict(base_num_kv_heads=4, fused_qkv=True),
    "mla": _MLA,
    "mla_no_q_lora": dict(_MLA, q_lora_rank=0),
}
# Gemma 4's attention: its own query and key norms, and its value norm (use_v_norm), before the names.
_GEMMA4 = dict(decoder_block="gemma4", base_num_kv_heads=4, use_v_norm=True)
_QKV = ("query_proj", "key_proj", "value_proj")
_POSITIONS, _SEGMENTS = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)


def _layer(overrides: dict, **extra):
  from MaxText.families import gemma4_layers
  from MaxText.layers import attention, mla
  cfg = Config.for_testing(**{**_TINY, **overrides, **extra}).model
  with nnx.use_eager_sharding(False):
    if cfg.decoder_block == "gemma4":  # a local layer with its own keys and values
      return cfg, gemma4_layers.Gemma4Attention(cfg, rngs=nnx.Rngs(0), owns_kv=True, k_eq_v=False)
    cls = mla.MultiHeadLatentAttention if cfg.attn.attention_type == "mla" else attention.Attention
    return cfg, cls(cfg, rngs=nnx.Rngs(0))


def _x() -> jax.Array:
  return jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.float32)


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_the_names_are_the_kernels_inputs(family, monkeypatch):
  """Each of query_proj, key_proj, value_proj names exactly the array the attention kernel receives."""
  from MaxText.layers import attention, linears, mla
  from MaxText.platform import sharding
  _, layer = _layer(_FAMILIES[family])
  named: dict[str, list[jax.Array]] = {}

  def record(x, name):
    named.setdefault(name, []).append(x)
    return x
  for module in (attention, linears, mla):
    monkeypatch.setattr(module, "checkpoint_name", record)
  kernel_inputs = []
  kernel = layer.kernel

  def spy(q, k, v, *args, **kwargs):
    kernel_inputs.append((q, k, v))
    return kernel(q, k, v, *args, **kwargs)
  layer.kernel = spy
  with sharding.unsharded():
    layer(_x(), _POSITIONS, _SEGMENTS)
  (inputs,) = kernel_inputs
  for name, given in zip(_QKV, inputs):
    (kept,) = named[name]  # one tensor of each name (the output gate carries none)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(given), err_msg=name)


def test_gemma4_names_the_normed_rotated_query_and_key(monkeypatch):
  """Gemma 4's attention (its own norms, its value norm, keys as values) names its kernel's inputs too."""
  from MaxText.families import gemma4_layers
  from MaxText.platform import sharding
  for k_eq_v in (False, True):
    cfg = Config.for_testing(**{**_TINY, "base_num_kv_heads": 4}).model
    with nnx.use_eager_sharding(False):
      layer = gemma4_layers.Gemma4Attention(cfg, rngs=nnx.Rngs(0), owns_kv=True, k_eq_v=k_eq_v)
    named: dict[str, jax.Array] = {}
    monkeypatch.setattr(gemma4_layers, "checkpoint_name", lambda x, name: named.setdefault(name, x))
    kernel_inputs = []
    kernel = layer.kernel
    layer.kernel = lambda q, k, v, *a, **kw: (kernel_inputs.append((q, k, v)), kernel(q, k, v, *a, **kw))[1]
    with sharding.unsharded():
      layer(_x(), _POSITIONS, _SEGMENTS)
    for name, given in zip(_QKV, kernel_inputs[0]):
      np.testing.assert_array_equal(np.asarray(named[name]), np.asarray(given), err_msg=f"{name} k_eq_v={k_eq_v}")


def _loss_and_grads(overrides: dict, policy):
  """The layer's loss and its gradients (input and parameters) under jax.checkpoint with `policy`."""
  from MaxText.layers import remat
  from MaxText.platform import sharding
  cfg, layer = _layer(overrides, **(policy if isinstance(policy, dict) else dict(remat_policy=policy)))
  graph, state = nnx.split(layer)

  def loss(params, x):
    out = nnx.merge(graph, params)(x, _POSITIONS, _SEGMENTS)
    return jnp.sum(jnp.sin(out))
  with sharding.unsharded():
    return jax.jit(jax.value_and_grad(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)),
                                      argnums=(0, 1)))(state, _x())


@pytest.mark.parametrize("family", ["qk_norm", "l2_norm_after_rope", "partial_rope_gate", "fused_qkv", "mla"])
def test_kept_or_offloaded_qkv_give_full_remats_loss_and_gradients(family):
  reference = _loss_and_grads(_FAMILIES[family], "full")
  for placement in ("device", "offload"):
    placed = dict(remat_policy="custom", **{name: placement for name in _QKV})
    got = _loss_and_grads(_FAMILIES[family], placed)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, reference)


def residuals(overrides: dict, **policy) -> list[tuple[bool, int, str]]:
  """(on the host, elements per token, what) of each activation one attention layer keeps for its backward
  pass: jax's print_saved_residuals (which marks an offloaded one <host>), less the weights and positions
  (constants here) and the layer input."""
  from MaxText.layers import remat
  from MaxText.platform import sharding
  cfg, layer = _layer(overrides, **policy)
  graph, state = nnx.split(layer)

  def loss(x):
    return nnx.merge(graph, state)(x, _POSITIONS, _SEGMENTS).sum()
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed), sharding.unsharded():
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)), _x())
  out = []
  for host, shape, what in re.findall(r"^\w+(<host>)?\[([\d,]*)\] (.*)$", printed.getvalue(), re.M):
    dims = [int(d) for d in shape.split(",") if d]
    if what.startswith(("from a constant", "from the argument")):
      continue
    assert dims[:2] == [2, 8], (shape, what)
    out.append((bool(host), int(np.prod(dims[2:])), what))
  return out


def _saved(overrides: dict, **policy) -> list[tuple[int, str]]:
  """(elements per token, what) of each activation one attention layer keeps (residuals)."""
  return [(n, "named " + re.search(r"named '(\w+)'", what)[1] if "named" in what else what.split(" from ")[0])
          for _, n, what in residuals(overrides, **policy)]


def test_a_kept_normed_query_and_key_keep_their_projections_too_under_minimal():
  """Under the dots policies the QK-norm's input (the raw projections, which its gradient needs) is kept
  beside the named kernel inputs, and the planner counts both (plan_remat.backward_dots)."""
  from MaxText.aot import plan_remat
  plain = _saved({"base_num_kv_heads": 4}, remat_policy="minimal")
  normed = _saved({"base_num_kv_heads": 4, "use_qk_norm": True}, remat_policy="minimal")
  assert sorted(what for _, what in plain) == ["named key_proj", "named query_proj", "named value_proj"]
  assert sorted(what for _, what in normed) == ["named key_proj", "named query_proj", "named value_proj",
                                                "output of dot_general", "output of dot_general"]
  minimal = remat_policies.by_name("minimal")
  planned = {name: plan_remat.kept_width(Config.for_testing(**{**_TINY, "base_num_kv_heads": 4}, use_qk_norm=qk).model,
                                         minimal, on_host=False) for name, qk in (("plain", False), ("normed", True))}
  assert planned["normed"] - planned["plain"] == sum(n for n, _ in normed) - sum(n for n, _ in plain) == 2 * 4 * 16


def test_mla_names_are_priced_at_their_kept_widths():
  """The planner's query_proj, key_proj and value_proj widths for MLA are those the layer keeps: each head's
  whole query and key (nope + rope) and its v_head_dim-wide value (the planner counted k·head_dim)."""
  from MaxText.aot import plan_remat
  saved = _saved(_MLA, remat_policy="custom", **{name: "device" for name in _QKV})
  widths = plan_remat.tensor_widths(Config.for_testing(**_MLA).model)
  assert sorted(saved, key=lambda t: t[1]) == [(widths["key_proj"], "named key_proj"),
                                               (widths["query_proj"], "named query_proj"),
                                               (widths["value_proj"], "named value_proj")]
  assert (widths["query_proj"], widths["key_proj"], widths["value_proj"]) == (4 * 12, 4 * 12, 4 * 6)


def _compiled_flops(overrides: dict, **policy) -> float:
  from MaxText.layers import remat
  from MaxText.platform import sharding
  cfg, layer = _layer(overrides, **policy)
  graph, state = nnx.split(layer)

  def loss(x):
    return nnx.merge(graph, state)(x, _POSITIONS, _SEGMENTS).sum()
  with sharding.unsharded():
    # value_and_grad: with the loss an output, the forward runs as well as the backward's re-run
    step = jax.value_and_grad(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)))
    compiled = jax.jit(step).lower(_x()).compile()
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_a_kept_normed_query_and_key_spare_no_matmul_as_the_planner_prices():
  """With QK-norm the norm's gradient needs the raw query and key, so keeping query_proj and key_proj (after
  the norm) spares only the value projection's re-run, in the compiled backward and in the planner."""
  from MaxText.aot import plan_remat
  overrides = {"base_num_kv_heads": 4, "use_qk_norm": True}
  kept = {name: "device" for name in _QKV}
  measured = _compiled_flops(overrides, remat_policy="full") - _compiled_flops(overrides, remat_policy="custom", **kept)
  cfg = Config.for_testing(**{**_TINY, **overrides}).model
  planned = (plan_remat.rerun_flops(cfg, remat_policies.by_name("full"), 8)
             - plan_remat.rerun_flops(cfg, remat_policies.custom(kept), 8)) / cfg.num_decoder_layers * 2
  value_projection = 2 * 2 * 8 * 64 * 4 * 16  # 2 flops x 16 tokens x d x k·h
  assert planned == value_projection
  # Beside the value's matmul the kept tensors spare the norm's and RoPE's elementwise re-run (a few
  # FLOPs per element); keeping all three matmuls' worth would be 3x the value's.
  assert value_projection <= measured < 1.25 * value_projection


def _planned_spared(overrides: dict, kept: dict[str, str]) -> float:
  """The re-run FLOPs the planner says `kept` spares against full remat, for this layer's 2 x 8 tokens."""
  from MaxText.aot import plan_remat
  cfg = Config.for_testing(**{**_TINY, **overrides}).model
  return (plan_remat.rerun_flops(cfg, remat_policies.by_name("full"), 8)
          - plan_remat.rerun_flops(cfg, remat_policies.custom(kept), 8)) / cfg.num_decoder_layers * 2


@pytest.mark.parametrize("v_norm", [True, False], ids=["value_norm", "no_value_norm"])
def test_gemma4s_normed_value_spares_no_matmul_as_the_planner_prices(v_norm):
  """Gemma 4 names its value after its value norm, whose gradient needs the raw value: keeping value_proj (with
  query_proj and key_proj, after their norms) spares no matmul, in the compiled backward and in the planner
  (which priced the value projection spared); without the value norm it spares the value projection."""
  overrides = dict(_GEMMA4, use_v_norm=v_norm)
  kept = {name: "device" for name in _QKV}
  measured = _compiled_flops(overrides, remat_policy="full") - _compiled_flops(overrides, remat_policy="custom", **kept)
  value_projection = 2 * 2 * 8 * 64 * 4 * 16  # 2 flops x 16 tokens x d x k·h
  assert _planned_spared(overrides, kept) == (0 if v_norm else value_projection)
  # Beside any matmul: the norms' and RoPE's elementwise re-run, and one [8, 8] QK^T per head that this CPU
  # compile of one layer runs once for the forward and the backward (Remat.md; a TPU compile runs it twice).
  spared = 0 if v_norm else value_projection
  assert spared <= measured < spared + 0.25 * value_projection


def test_gemma4s_value_norm_keeps_the_raw_value_under_minimal():
  """Under the dots policies the value norm's input (the value projection's raw output) is kept beside the
  named kernel inputs, as the query and key norms' are, and the planner counts it (plan_remat.backward_dots)."""
  from MaxText.aot import plan_remat
  plain = _saved(dict(_GEMMA4, use_v_norm=False), remat_policy="minimal")
  normed = _saved(_GEMMA4, remat_policy="minimal")
  assert sorted(what for _, what in normed) == sorted(what for _, what in plain) + ["output of dot_general"]
  assert [what for _, what in plain].count("output of dot_general") == 2  # the raw query and key
  minimal = remat_policies.by_name("minimal")
  planned = [plan_remat.kept_width(Config.for_testing(**{**_TINY, **_GEMMA4, "use_v_norm": v}).model, minimal,
                                   on_host=False) for v in (False, True)]
  assert planned[1] - planned[0] == sum(n for n, _ in normed) - sum(n for n, _ in plain) == 4 * 16


def test_mlas_key_and_value_share_one_up_projection_as_the_planner_prices():
  """MLA makes each head's no-position key and its value with one up-projection from the latent: keeping key_proj
  or value_proj alone spares no matmul, both spare that one (its no-position and value columns), in the compiled
  backward and in the planner (which priced each alone as a matmul of its own, the key's rotated part included)."""
  full = _compiled_flops(_MLA, remat_policy="full")
  up_projection = 2 * 2 * 8 * 16 * 4 * (8 + 6)  # 2 flops x 16 tokens x kv_lora_rank x heads x (nope + v_head_dim)
  for keep, spared in ((("key_proj",), 0), (("value_proj",), 0), (("key_proj", "value_proj"), up_projection)):
    kept = {name: "device" for name in keep}
    measured = full - _compiled_flops(_MLA, remat_policy="custom", **kept)
    assert _planned_spared(_MLA, kept) == spared, keep
    # within a few hundred FLOPs of slicing and concatenation either way
    assert abs(measured - spared) < 0.05 * up_projection, (keep, measured)
