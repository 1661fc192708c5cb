"""The planner's kept-activation count of a MoE decoder layer against the residuals jax saves for it
(print_saved_residuals of one remat'd layer), on every expert path: the experts' tensors have the rows the
path lays out (one per chosen expert with sparse_matmul, the capacity slots E·C per sequence without it, C = L
when dropless), not one per token."""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import pytest

from MaxText.aot import plan_remat
from MaxText.configuration import remat_policies
from MaxText.configuration.config import Config

_BATCH, _LENGTH, _EMB = 2, 32, 64
_MOE = dict(base_emb_dim=_EMB, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=96,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=_LENGTH, per_device_batch_size=1,
            num_experts=4, num_experts_per_tok=2, attention="dot_product", dtype="bfloat16", print_config=False)
_PATHS = {"sparse_matmul": dict(sparse_matmul=True, capacity_factor=-1.0),
          "capacity": dict(sparse_matmul=False, capacity_factor=1.25),  # 20 slots per expert of 32 tokens
          "dense_dropless": dict(sparse_matmul=False, capacity_factor=-1.0)}  # every expert over every token
_POLICIES = {"minimal": dict(remat_policy="minimal"),
             "save_dot_except_mlpwi": dict(remat_policy="save_dot_except_mlpwi"),
             "custom": dict(remat_policy="custom", query_proj="device", moe_mlpwi_1="device", mlpwo="offload")}
_BYTES = {"bf16": 2, "f32": 4, "i32": 4}


def _saved_bytes(overrides: dict) -> tuple[int, int]:
  """(device bytes, host bytes) of what one decoder layer keeps for its backward pass under the config's
  remat policy, its input included; the weights are constants here and left out."""
  return _layer_saved_bytes(Config.for_testing(**overrides).model)


def _layer_saved_bytes(cfg) -> tuple[int, int]:
  """_saved_bytes of one layer built with the model config `cfg`."""
  from flax import nnx

  from MaxText import families
  from MaxText.layers import decoders, remat
  from MaxText.platform import sharding
  with nnx.use_eager_sharding(False):
    layer = (families.family_for_decoder_block(cfg.decoder_block).layer or decoders.DecoderLayer)(cfg, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  positions, segments = jnp.broadcast_to(jnp.arange(_LENGTH), (_BATCH, _LENGTH)), jnp.ones((_BATCH, _LENGTH), jnp.int32)

  def loss(x):
    return nnx.merge(graph, state)(x, positions, segments, None).astype(jnp.float32).sum()
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed), sharding.unsharded():
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)),
                                            jnp.ones((_BATCH, _LENGTH, _EMB), jnp.bfloat16))
  device = host = 0
  for line in printed.getvalue().splitlines():
    if "from a constant" in line:
      continue
    dtype, space, dims = re.match(r"(\w+)(<\w+>)?\[([\d,]*)\]", line).groups()
    nbytes = math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
    if space == "<host>":
      host += nbytes
    else:
      device += nbytes
  return device, host


def _planned_bytes(overrides: dict) -> tuple[float, float]:
  """(device bytes, host bytes) the planner counts kept per layer for the same tokens (input included)."""
  cfg = Config.for_testing(**overrides).model
  tokens = _BATCH * _LENGTH * 2  # bf16
  device = plan_remat.stream_width(cfg, cfg.remat) + plan_remat.kept_width(cfg, cfg.remat, on_host=False)
  return tokens * device, tokens * plan_remat.kept_width(cfg, cfg.remat, on_host=True)


@pytest.mark.parametrize("policy", _POLICIES)
@pytest.mark.parametrize("path", _PATHS)
def test_planner_counts_the_expert_tensors_a_layer_keeps(path, policy):
  overrides = dict(_MOE, **_PATHS[path], **_POLICIES[policy])
  assert _planned_bytes(overrides) == _saved_bytes(overrides)


@pytest.mark.parametrize("overrides", [
    dict(_PATHS["sparse_matmul"], remat_policy="minimal_offloaded"),  # the router's logits go to the host too
    dict(_PATHS["capacity"], remat_policy="minimal", shared_experts=1),  # the shared MLP's tensors beside the experts'
], ids=["minimal_offloaded", "shared_experts"])
def test_planner_counts_the_router_and_shared_experts_a_preset_keeps(overrides):
  overrides = dict(_MOE, **overrides)
  assert _planned_bytes(overrides) == _saved_bytes(overrides)


@pytest.mark.parametrize("overrides", [
    dict(remat_policy="minimal"), dict(remat_policy="save_dot_except_mlpwi"), dict(remat_policy="custom", mlpwo="device"),
    dict(remat_policy="minimal", decoder_block="gemma2"),  # sandwich norms: the output's norm reads mlpwo
], ids=["minimal", "save_dot_except_mlpwi", "mlpwo", "sandwich"])
def test_a_dense_mlps_output_is_kept_only_where_the_backward_reads_it(overrides):
  """The pre-norm layer adds the MLP's output to the residual stream, whose gradient does not need it: jax
  keeps none of it whatever the policy names (the planner counted it, D per token)."""
  overrides = dict(_MOE, num_experts=1, num_experts_per_tok=1, **overrides)
  assert _planned_bytes(overrides) == _saved_bytes(overrides)


@pytest.mark.parametrize("overrides", [dict(first_dense_layers=1), dict(moe_layer_interval=2)],
                         ids=["dense_prefix", "interleaved"])
def test_a_moe_models_dense_layers_keep_their_own_mlps(overrides):
  """DeepSeek's leading dense layers and Llama 4's interleaved ones keep a dense MLP's tensors (dense_mlp_dim
  wide), not the experts': the planner's per-layer count is the two stacks' average."""
  cfg = Config.for_testing(**dict(_MOE, **_PATHS["sparse_matmul"], remat_policy="minimal", dense_mlp_dim=80,
                                  **overrides)).model
  assert cfg.num_dense_layers == 1 and cfg.num_decoder_layers == 2
  saved = _layer_saved_bytes(cfg)[0] + _layer_saved_bytes(cfg.dense_prefix_config())[0]
  per_layer = plan_remat.stream_width(cfg, cfg.remat) + plan_remat.kept_width(cfg, cfg.remat, on_host=False)
  assert 2 * _BATCH * _LENGTH * 2 * per_layer == saved


def test_expert_rows_per_token_on_each_path():
  """Rows per token of the experts' tensors: k chosen experts; E·C/L capacity slots; under expert parallelism
  the all-to-all receive buffer (every peer's tokens, each once per local expert) or the gathered group's."""
  def rows(experts=1, **overrides):
    return plan_remat.expert_rows(Config.for_testing(**dict(_MOE, **overrides)).model, experts)
  assert rows(**_PATHS["sparse_matmul"]) == 2
  assert rows(**_PATHS["capacity"]) == 4 * 20 / 32
  assert rows(**_PATHS["dense_dropless"]) == 4
  assert rows(2, **_PATHS["sparse_matmul"]) == 2 * min(2, 4 // 2)
  assert rows(2, **_PATHS["sparse_matmul"], moe_dispatch="gather") == 2 * 2
  assert rows(2, **_PATHS["capacity"]) == 4 * 20 / 32  # the slots move between devices, their number does not
  assert plan_remat.expert_rows(Config.for_testing(**dict(_MOE, num_experts=1, num_experts_per_tok=1)).model) == 0
  assert remat_policies.SPARSE_MATMUL_ONLY_MOE == ("moe_mlpwi_1",)


@pytest.mark.parametrize("path", ["sparse_matmul", "capacity"])
@pytest.mark.parametrize("mesh", [
    dict(ici_fsdp_parallelism=8),
    dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2),
    dict(ici_fsdp_parallelism=4, ici_sequence_parallelism=2),
    dict(ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2),
    dict(ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_sequence_parallelism=2),
], ids=["fsdp", "tensor", "sequence", "expert_tensor", "expert_sequence"])
def test_planner_counts_the_expert_rows_each_chip_keeps(path, mesh):
  """Per chip on 8 devices: the expert bodies run per batch shard, so their kept rows repeat over tensor and
  sequence (the all-to-all bodies split the input projections' width over tensor, the capacity path's
  sharding the output projection's); the planner counted one chip's share of the tokens."""
  from flax import nnx

  from MaxText.layers import moe, remat
  from MaxText.platform import sharding
  config = Config.for_testing(**dict(_MOE, **_PATHS[path], remat_policy="minimal", **mesh))
  cfg, mesh_ = config.model, sharding.create_mesh(config.mesh)
  with nnx.use_eager_sharding(False):
    layer = moe.MoeBlock(cfg, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)

  def loss(x):
    return nnx.merge(graph, state)(x).astype(jnp.float32).sum()
  batch = 8
  with sharding.activation_sharding(mesh_, config.mesh.logical_axis_rules):
    x = jax.device_put(jnp.ones((batch, _LENGTH, _EMB), jnp.bfloat16),
                       jax.sharding.NamedSharding(mesh_, jax.sharding.PartitionSpec(("fsdp", "expert"))))
    _, backward = jax.jit(lambda x: jax.vjp(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)), x))(x)
  # The experts' residuals: bf16 and not token-shaped [B, L, ·] (the input and the router's logits are).
  kept = sum(math.prod(r.sharding.shard_shape(r.shape)) * 2 for r in jax.tree.leaves(backward)
             if getattr(r, "dtype", None) == jnp.bfloat16 and r.shape[:2] != (batch, _LENGTH))
  widths = plan_remat.tensor_widths(cfg, dict(config.mesh.shape))
  names = ("moe_mlpwi_0", "moe_mlpwo") if cfg.moe.sparse_matmul else ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
  tokens_per_chip = batch * _LENGTH / 8
  assert kept == tokens_per_chip * 2 * sum(widths[n] for n in names)
