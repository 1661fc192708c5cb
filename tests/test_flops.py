"""The FLOPs formula of MaxText/training/metrics.py: sliding-window layers and the two MoE paths, checked
against XLA's cost analysis, the real attention mask, and the matmuls in the model's jaxpr."""

import math

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import numpy as np
import pytest

from MaxText import models
from MaxText.training import metrics
from MaxText.platform import sharding
from MaxText.configuration.config import Config
from MaxText.layers import attention, masks

BATCH, LENGTH, WINDOW = 2, 128, 32
DENSE = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=2, head_dim=64, base_mlp_dim=1024,
             vocab_size=512, scan_layers=False, ici_data_parallelism=8, ici_fsdp_parallelism=1, print_config=False)
MOE = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
           base_num_decoder_layers=2, vocab_size=128, num_experts=4, num_experts_per_tok=2, scan_layers=False,
           ici_data_parallelism=8, ici_fsdp_parallelism=1, print_config=False, dtype="float32")


def _windowed(**overrides) -> Config:
  values = dict(DENSE, base_num_decoder_layers=3, attention_layer_pattern=["local", "global"],
                sliding_window_size=WINDOW, max_target_length=LENGTH)
  return Config.for_testing(**{**values, **overrides})


def _xla_forward_flops(config: Config, batch: int, length: int) -> float:
  spec = models.build_model_spec(config.model)
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  cost = jax.jit(sharding.unsharded()(spec.apply)).lower(spec.abstract_params, tokens, tokens, tokens).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_window_shorter_than_the_sequence_counts_only_attended_pairs():
  config = _windowed()
  # Layers cycle local, global, local: the causal count per layer is what the real mask
  # (masks.self_mask with each layer's window) lets through, less the half diagonal
  # (the formula's continuous convention: L²/2 for a global layer, W·L - W²/2 for a local one).
  segments = jnp.ones((1, LENGTH), jnp.int32)
  mask_pairs, diagonal = 0, 0.0
  for layer in range(3):
    window = attention.layer_window_size(config.model.attn, layer)
    mask_pairs += int(jnp.sum(masks.self_mask(segments, window)))
    diagonal += min(int(window), LENGTH) / 2
  ours = metrics.attended_pairs(config.model, LENGTH)
  assert ours + diagonal == mask_pairs
  assert ours == 2 * (WINDOW * LENGTH - WINDOW**2 / 2) + LENGTH**2 / 2
  weights, attention_flops = metrics.forward_flops_per_sequence(config.model, LENGTH)
  assert attention_flops == 2 * 2 * 4 * 64 * ours
  step = metrics.training_tflops_per_step(config.model, BATCH, LENGTH)
  assert math.isclose(step.attention_tflops, 3 * BATCH * attention_flops / 1e12)
  # A window at least as long as the sequence is global attention.
  long_window = _windowed(sliding_window_size=LENGTH)
  assert metrics.attended_pairs(long_window.model, LENGTH) == 3 * LENGTH**2 / 2


def test_chunked_layers_count_a_causal_triangle_per_chunk():
  # Chunks of 48 over 128 tokens: two full chunks and one of 32, on layers 0 and 2 (Llama 4's
  # chunked layers); the real mask less the half diagonal again.
  config = _windowed(attention_layer_pattern=["chunked", "global"], attention_chunk_size=48)
  segments = jnp.ones((1, LENGTH), jnp.int32)
  mask_pairs = sum(int(jnp.sum(masks.self_mask(segments, chunk=attention.layer_chunk_size(config.model.attn, layer))))
                   for layer in range(3))
  ours = metrics.attended_pairs(config.model, LENGTH)
  assert ours + 3 * LENGTH / 2 == mask_pairs
  assert ours == 2 * (2 * 48**2 / 2 + 32**2 / 2) + LENGTH**2 / 2



class _CountedPattern(tuple):
  """An attention_layer_pattern that counts its item reads."""
  reads = 0

  def __getitem__(self, index):
    _CountedPattern.reads += 1
    return super().__getitem__(index)


def test_a_deep_stack_costs_one_count_per_pattern_position_not_per_layer():
  """The planner prices a model of any depth thousands of times over (the fits-nowhere bound over every
  topology): per-layer counting made a 100000-layer model's plan run for minutes before its one-line answer."""
  import dataclasses
  cfg = _windowed().model
  _CountedPattern.reads = 0
  layers = 10**6 + 1  # local, global, ..., local: one more local than global layer
  pattern = _CountedPattern(("local", "global"))
  deep = dataclasses.replace(cfg, num_decoder_layers=layers, attn=dataclasses.replace(cfg.attn,
                                                                                     attention_layer_pattern=pattern))
  assert metrics.attended_pairs(deep, LENGTH) == (layers // 2 + 1) * (WINDOW * LENGTH - WINDOW**2 / 2) + (
      layers // 2) * LENGTH**2 / 2
  assert _CountedPattern.reads <= len(pattern)

DSA = dict(decoder_block="deepseek32", attention_type="mla", base_emb_dim=64, base_num_query_heads=4,
           base_num_kv_heads=4, head_dim=24, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=8, base_num_decoder_layers=2,
           vocab_size=128, max_target_length=LENGTH, print_config=False)


def test_sparse_attention_counts_each_querys_chosen_keys_and_its_indexer():
  """DeepSeek Sparse Attention: each query's top-k keys (the real top-k mask, less the half diagonal, as
  for a window of k), plus the indexer's projections and scores, forward only unless the indexer trains."""
  topk = 48
  config = Config.for_testing(**DSA, index_topk=topk).model
  scores = jax.random.normal(jax.random.key(0), (1, LENGTH, LENGTH))
  causal = masks.self_mask(jnp.ones((1, LENGTH), jnp.int32))
  chosen = int(jnp.sum(masks.top_k_mask(scores, causal, topk)))
  ours = metrics.attended_pairs(config, LENGTH)
  assert ours + 2 * topk / 2 == 2 * chosen
  assert ours == 2 * (topk * LENGTH - topk**2 / 2)
  # The dense warm-up attends every causal pair; so does a top-k covering the sequence.
  assert metrics.attended_pairs(Config.for_testing(**DSA, index_topk=topk, indexer_warmup=True,
                                                   indexer_loss_scaling_factor=1.0).model, LENGTH) == LENGTH**2
  assert metrics.attended_pairs(Config.for_testing(**DSA, index_topk=LENGTH).model, LENGTH) == LENGTH**2
  projections, index_scores = metrics.indexer_flops_per_sequence(config, LENGTH)
  assert projections == 2 * LENGTH * 2 * (32 * 2 * 8 + 64 * 8 + 64 * 2)
  assert index_scores == 2 * LENGTH**2 / 2 * 2 * 2 * (8 + 1)
  dense = metrics.training_tflops_per_step(Config.for_testing(**DSA).model, BATCH, LENGTH)
  frozen = metrics.training_tflops_per_step(config, BATCH, LENGTH)
  trained = metrics.training_tflops_per_step(Config.for_testing(**DSA, index_topk=topk,
                                                               indexer_loss_scaling_factor=1.0).model, BATCH, LENGTH)
  assert math.isclose(frozen.weight_tflops - dense.weight_tflops, BATCH * projections / 1e12)
  # Trained: the projections' forward and weight gradient (their inputs are detached), the scores' three passes.
  assert math.isclose(trained.weight_tflops - dense.weight_tflops, 2 * BATCH * projections / 1e12)
  _, sparse_attention = metrics.forward_flops_per_sequence(config, LENGTH)
  assert math.isclose(frozen.attention_tflops, BATCH * (3 * sparse_attention + index_scores) / 1e12)
  assert math.isclose(trained.attention_tflops, 3 * BATCH * (sparse_attention + index_scores) / 1e12)


def test_the_indexer_runs_forward_once_a_sequence_and_backward_only_where_the_loss_trains_it(tiny_overrides):
  """DPO's 8 passes a row are 2 trained sequences and 2 reference forwards, but the detached indexer was counted
  at passes / 3 (8/3 forwards, not 4), and GRPO's likewise; and only the language-model loss adds the indexer's
  KL, so DPO and GRPO run no indexer backward whatever indexer_loss_scaling_factor says."""
  from types import SimpleNamespace

  from MaxText.training.objectives import Grpo, LanguageModel, Preference
  from tests.test_grpo import GRPO

  keeps_reference = SimpleNamespace(frozen_gives_base_model=False)
  rl = Config.for_testing(**{**tiny_overrides, **GRPO, "grpo_beta": 0.1, "grpo_num_iterations": 2}).rl
  # No model: the FLOPs count reads the objectives' passes alone.
  objectives = {"lm": LanguageModel(None, 0.0),  # type: ignore[arg-type]
                "dpo": Preference(None, keeps_reference, 0.1, 0.0),  # type: ignore[arg-type]
                "grpo": Grpo(None, keeps_reference, rl)}  # type: ignore[arg-type]
  assert (objectives["grpo"].passes_per_row, objectives["grpo"].trained_per_row) == (2 * 3 + 2, 2)  # π_old, π_ref

  def indexer_passes(objective, **overrides) -> tuple[float, float]:
    config = Config.for_testing(**DSA, index_topk=48, **overrides)
    step = metrics.objective_tflops_per_step(config, objective)
    weights, attention = metrics.forward_flops_per_sequence(config.model, LENGTH)
    projections, scores = metrics.indexer_flops_per_sequence(config.model, LENGTH)
    rows, passes = config.data.global_batch_size, objective.passes_per_row
    return (round((step.weight_tflops * 1e12 / rows - passes * weights) / projections, 6),
            round((step.attention_tflops * 1e12 / rows - passes * attention) / scores, 6))

  trained = dict(indexer_loss_scaling_factor=1.0)
  assert indexer_passes(objectives["lm"]) == (1, 1)
  assert indexer_passes(objectives["lm"], **trained) == (2, 3)
  for name in ("dpo", "grpo"):  # four sequences a row through the policy and its reference, forward only
    assert indexer_passes(objectives[name]) == indexer_passes(objectives[name], **trained) == (4, 4), name


def test_window_flops_unmasked_match_xla_cost_analysis():
  # The dense attention kernel computes every score and masks afterwards, so XLA counts all
  # L² pairs on every layer: the unmasked figure must match it in the band of the dense test,
  # and the masked (useful) figure is below it by exactly the skipped pairs.
  config = _windowed()
  xla_flops = _xla_forward_flops(config, BATCH, LENGTH)
  weights, unmasked = metrics.forward_flops_per_sequence(config.model, LENGTH, causal=False)
  ours = BATCH * (weights + unmasked)
  assert ours <= xla_flops <= 1.06 * ours, (ours, xla_flops)
  _, masked = metrics.forward_flops_per_sequence(config.model, LENGTH)
  assert masked < unmasked / 3  # two of three layers see 32 of 128 keys


def _jaxpr_matmul_flops(jaxpr: jax_core.Jaxpr) -> float:
  """2·M·K·N of every dot_general and ragged_dot_general (at its grouped cost), sub-jaxprs included."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    elif name == "ragged_dot_general":
      (rows, contract), (_, _, out) = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
      total += 2 * rows * contract * out
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax_core.ClosedJaxpr):
          total += _jaxpr_matmul_flops(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          total += _jaxpr_matmul_flops(sub)
  return total


@pytest.mark.parametrize("sparse_matmul", [False, True])
def test_moe_formula_counts_the_expert_rows_each_path_computes(sparse_matmul):
  """Dropless: the padded path multiplies E·L rows per sequence, the grouped path the k·L routed
  rows; the formula must equal every matmul the model's jaxpr contains (attention unmasked)."""
  config = Config.for_testing(**MOE, max_target_length=32, sparse_matmul=sparse_matmul, capacity_factor=-1.0)
  spec = models.build_model_spec(config.model)
  tokens = jax.ShapeDtypeStruct((BATCH, 32), jnp.int32)
  jaxpr = jax.make_jaxpr(sharding.unsharded()(spec.apply))(spec.abstract_params, tokens, tokens, tokens).jaxpr
  weights, attention_flops = metrics.forward_flops_per_sequence(config.model, 32, causal=False)
  assert _jaxpr_matmul_flops(jaxpr) == BATCH * (weights + attention_flops)
  assert metrics.moe_expert_rows(config.model, 32) == (2 * 32 if sparse_matmul else 4 * 32)


@pytest.mark.parametrize("shared_experts", [0, 2])
def test_padded_dropless_moe_flops_match_xla_cost_analysis(shared_experts):
  # The padded path is plain batched matmuls, so XLA's count is its real cost: E/k times the routed
  # work (plus, with shared experts, one dense MLP of shared x mlp_dim for every token).
  config = Config.for_testing(**MOE, max_target_length=32, capacity_factor=-1.0, shared_experts=shared_experts)
  xla_flops = _xla_forward_flops(config, BATCH, 32)
  weights, attention_flops = metrics.forward_flops_per_sequence(config.model, 32, causal=False)
  ours = BATCH * (weights + attention_flops)
  assert ours <= xla_flops <= 1.06 * ours, (ours, xla_flops)
  grouped = Config.for_testing(**MOE, max_target_length=32, capacity_factor=-1.0, sparse_matmul=True)
  assert metrics.forward_flops_per_sequence(grouped.model, 32)[0] < weights


# Gemma 4's per-layer shapes: four layers, local and global in turn, global heads twice as wide with one key/value
# head whose values are its keys, the last two layers reading the first two's keys and values with twice-wide MLPs.
GEMMA4 = dict(decoder_block="gemma4", base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
              base_mlp_dim=128, base_num_decoder_layers=4, vocab_size=128, scan_layers=False, print_config=False,
              dtype="float32", ici_data_parallelism=8, ici_fsdp_parallelism=1, use_qk_norm=True,
              attention_layer_pattern=["local", "global"], sliding_window_size=8, mlp_activations=["gelu", "linear"],
              global_head_dim=32, global_num_kv_heads=1, attention_k_eq_v=True, use_v_norm=True,
              num_kv_shared_layers=2, kv_shared_double_mlp=True)


@pytest.mark.parametrize("overrides", [{}, dict(per_layer_input_dim=8),
                                       dict(moe_beside_mlp=True, num_experts=4, num_experts_per_tok=2,
                                            dense_mlp_dim=96, capacity_factor=-1.0)],
                         ids=["shapes", "per_layer_inputs", "experts_beside"])
def test_gemma4_formula_counts_each_layers_own_shape(overrides):
  """The formula equals every matmul of a Gemma 4 model's jaxpr (attention unmasked): each layer at its own head
  shape and MLP width, no key/value projections on the KV-sharing layers, no value projection where the values are
  the keys, the per-layer inputs' projections, the dense MLP beside the experts (it counted every layer at the local
  layers' shape with its own keys and values, and no dense MLP beside experts)."""
  config = Config.for_testing(**GEMMA4, **overrides, max_target_length=32)
  spec = models.build_model_spec(config.model)
  tokens = jax.ShapeDtypeStruct((BATCH, 32), jnp.int32)
  jaxpr = jax.make_jaxpr(sharding.unsharded()(spec.apply))(spec.abstract_params, tokens, tokens, tokens).jaxpr
  weights, attention_flops = metrics.forward_flops_per_sequence(config.model, 32, causal=False)
  assert _jaxpr_matmul_flops(jaxpr) == BATCH * (weights + attention_flops)
