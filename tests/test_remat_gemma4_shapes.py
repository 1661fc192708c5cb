"""Gemma 4's per-layer shapes priced by the planner (plan_remat.layer_groups) as the compiled program keeps and
re-runs them: the global layers' own head width and key/value heads (global_head_dim, global_num_kv_heads), their
values made from the keys' matmul (attention_k_eq_v), the KV-sharing layers that project queries only and run
twice-wide MLPs (num_kv_shared_layers, kv_shared_double_mlp), and the source layers' keys and values, which stay
in memory for the sharing layers whatever the policy."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.configuration import remat_policies
from MaxText.configuration.config import Config
from MaxText.platform import sharding

# Four layers, local and global in turn: layers 0 and 1 own their keys and values, 2 and 3 read theirs.
_GEMMA4 = dict(decoder_block="gemma4", base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
               base_mlp_dim=128, base_num_decoder_layers=4, vocab_size=128, max_target_length=16,
               per_device_batch_size=1, print_config=False, dtype="float32", attention="dot_product",
               use_qk_norm=True, attention_layer_pattern=["local", "global"], sliding_window_size=4,
               mlp_activations=["gelu", "linear"], global_head_dim=32, global_num_kv_heads=1, attention_k_eq_v=True,
               use_v_norm=True, num_kv_shared_layers=2, kv_shared_double_mlp=True)
_BATCH, _LENGTH = 2, 16
_NAMES = ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")


def _model_and_loss(**overrides):
  cfg = Config.for_testing(**{**_GEMMA4, **overrides}).model
  spec = models.build_model_spec(cfg)
  tokens = jnp.ones((_BATCH, _LENGTH), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(_LENGTH), (_BATCH, _LENGTH))

  def loss(params):
    return spec.apply(params, tokens, positions, tokens).sum()
  return cfg, spec, loss


def _named_residuals(**overrides) -> dict[bool, float]:
  """Elements per token of the named activations the whole model's loss keeps for its backward pass in HBM, and of
  those it offloads (True; jax prints them as the host copies), from jax's print_saved_residuals."""
  _, spec, loss = _model_and_loss(**overrides)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed), sharding.unsharded():
    jax.ad_checkpoint.print_saved_residuals(loss, spec.init_params(jax.random.key(0)))
  kept = {False: 0.0, True: 0.0}
  for host, shape, what in re.findall(r"^\w+(<host>)?\[([\d,]*)\] (named '\w+'|output of device_put)",
                                     printed.getvalue(), re.M):
    dims = [int(d) for d in shape.split(",")]
    assert dims[:2] == [_BATCH, _LENGTH] and bool(host) == (what == "output of device_put"), (shape, what)
    kept[bool(host)] += int(np.prod(dims[2:]))
  return kept


_POLICIES = {
    "full": {},
    "every_name": dict.fromkeys(_NAMES, "device"),
    "keys_values_offloaded": dict(key_proj="offload", value_proj="offload", context="device"),
    "query_context_mlp": dict(query_proj="device", context="device", mlpwi_0="offload", mlpwi_1="offload"),
}


@pytest.mark.parametrize("placed", list(_POLICIES.values()), ids=list(_POLICIES))
def test_the_planner_keeps_what_a_gemma4_stack_saves(placed):
  """Per token over the stack, in HBM and on the host: the planner's kept widths are the named residuals of the
  compiled loss (it counted every layer at the local layers' shape, the sharing layers' keys, values and single
  MLP, and no source keys and values under full remat)."""
  from MaxText.aot import plan_remat
  policy = dict(remat_policy="custom", **placed) if placed else dict(remat_policy="full")
  cfg = Config.for_testing(**_GEMMA4, **policy).model
  planned = {host: cfg.num_decoder_layers * plan_remat.kept_width(cfg, cfg.remat, on_host=host)
             for host in (False, True)}
  assert planned == _named_residuals(**policy)


def _compiled_flops(**overrides) -> float:
  _, spec, loss = _model_and_loss(**overrides)
  with sharding.unsharded():
    compiled = jax.jit(jax.value_and_grad(loss)).lower(spec.abstract_params).compile()
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("keep", [pytest.param(("context", "out_proj", "mlpwi_0", "mlpwi_1"), marks=pytest.mark.slow),
                                  ("value_proj", "mlpwi_0")],
                         ids=["context_out_mlp", "value_mlp"])
def test_the_planner_prices_a_gemma4_stacks_rerun_as_compiled(keep):
  """What a placement spares against full remat (CPU cost analysis) is what the planner prices per layer: the
  global layers' wider heads, the sharing layers' twice-wide MLPs, no value matmul where the values are the keys
  (the planner priced every layer as a local one with its own keys and values)."""
  from MaxText.aot import plan_remat
  placed = dict.fromkeys(keep, "device")
  measured = _compiled_flops(remat_policy="full") - _compiled_flops(remat_policy="custom", **placed)
  cfg = Config.for_testing(**_GEMMA4).model
  planned = _BATCH * (plan_remat.rerun_flops(cfg, remat_policies.by_name("full"), _LENGTH)
                      - plan_remat.rerun_flops(cfg, remat_policies.custom(placed), _LENGTH))
  # Beside the matmuls: the norms' and the activation's elementwise work, which a kept tensor moves (a few FLOPs
  # per element either way).
  assert abs(measured - planned) < 0.05 * planned, (measured, planned)


def test_the_fill_sizes_each_tensor_over_a_gemma4_stacks_layers():
  """The placement fill orders and fits each tensor by the HBM it holds per token and layer averaged over the
  stack's layers, as the estimate prices it (it took the local layers' shape for every layer: the global
  layers' wider query and the sharing layers' twice-wide MLP were left out)."""
  from MaxText.aot import plan_model, plan_remat, plan_search
  config = Config.for_testing(**_GEMMA4)
  cfg = config.model
  fill = plan_search.PlacementFill(plan_model.ModelShape.of(cfg, config.optim), _LENGTH)
  full = plan_remat.kept_width(cfg, remat_policies.by_name("full"), on_host=False)
  assert fill.order
  for names, width, _ in fill.order:
    assert width == plan_remat.kept_width(cfg, remat_policies.custom(dict.fromkeys(names, "device")), False) - full
