"""GRPO (objective=grpo): configuration and reward errors, rollouts by the decode engine from the train
state's parameters for every family on the 8-device mesh, and the step's updates (LoRA keeping
its base, iterations keeping the old policy). train.py end to end is in test_grpo_run.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from MaxText import models
from MaxText.rl import rewards, rollouts
from MaxText.training import lora, run_assembly
from MaxText.training.objectives import Grpo, objective_for
from MaxText.input_pipeline.batch_spec import GRPO_FIELDS, batch_spec

GRPO = dict(objective="grpo", dataset_type="hf", hf_data_files="prompts.jsonl", tokenizer_type="huggingface",
            tokenizer_path="tokenizer", eval_interval=-1, reward_functions="exact_match", num_generations=4,
            max_prefill_predict_length=8, max_completion_length=6, max_target_length=16)
MOE = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, load_balance_loss_weight=0.01)
MLA = dict(decoder_block="deepseek3", attention_type="mla", base_num_query_heads=4, base_num_kv_heads=4, head_dim=12,
           q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_experts=4,
           num_experts_per_tok=2, first_dense_layers=1)


def _config(tiny_overrides, **extra) -> Config:
  return Config.for_testing(**{**tiny_overrides, **GRPO, **extra})


# ---- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(num_generations=1), "num_generations=1: GRPO compares the completions of one prompt"),
    (dict(num_generations=3), "the global batch of 8 completions (per_device_batch_size x devices) does not divide into groups of num_generations=3"),
    (dict(reward_functions="[]"), "objective=grpo needs reward_functions"),
    (dict(reward_weights="1,2"), "reward_weights has 2 values for 1 reward_functions"),
    (dict(max_completion_length=10), "max_prefill_predict_length (8) + max_completion_length (10) must be <= "
     "max_target_length + 1 (17)"),
    (dict(grpo_loss_type="ppo"), "grpo_loss_type must be one of grpo, dapo, dr_grpo"),
    # was accepted: inf x the KL's exact 0 at the first step made every step's loss NaN
    (dict(grpo_beta="inf"), "grpo_beta must be a finite number >= 0 (0 = no KL term), got inf"),
    (dict(use_sft=True), "'use_sft' (deprecated) says use_sft=True but Config.for_testing also gives objective='grpo'"),
    (dict(eval_interval=10, hf_eval_files="eval.jsonl"), "set eval_interval=-1"),
])
def test_configuration_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError) as error:
    _config(tiny_overrides, **overrides)
  assert message in str(error.value)


def test_the_objective_reads_the_fields_batch_spec_declares(tiny_overrides):
  config = _config(tiny_overrides, per_device_batch_size=1)
  objective = objective_for(config, models.build_model_spec(config.model), lora.partition_for(config.model))
  assert isinstance(objective, Grpo) and objective.batch_fields == tuple(batch_spec(config.data)) == GRPO_FIELDS
  assert batch_spec(config.data)["advantages"].shape == (8,)
  # No reference without a KL term; a copy of the starting weights with one; LoRA's base under LoRA.
  assert objective.extra_state({"w": 1}, dict) == {}
  with_kl = _config(tiny_overrides, per_device_batch_size=1, grpo_beta=0.1)
  assert objective_for(with_kl, objective.model, lora.partition_for(with_kl.model)).extra_state({"w": 1}, dict) \
      == {"reference": {"w": 1}}


# ---- rewards ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer, reward", [
    ("so the answer is 42.", "42", 1.0), ("it is \\boxed{3/4} indeed", "3/4", 1.0), ("... #### 1,200", 1200, 1.0),
    ("<answer> Fox </answer>", "fox", 1.0), ("fox", "fox", 1.0), ("41 or 42", "41", 0.0), ("", "0", 0.0),
])
def test_exact_match(completion, answer, reward):
  assert rewards.ExactMatch("answer")(completions=[completion], answer=[answer]) == [reward]


def test_format_and_length_penalty():
  import re

  assert rewards.FormatMatch(re.compile(r"^<think>.*</think>", re.DOTALL))(
      completions=["<think>a\nb</think> 4", "4"]) == [1.0, 0.0]
  penalty = rewards.LengthPenalty(max_length=10, window=4, eos_id=2)
  # Up to 6 tokens free, then down by 1/4 per token; truncated (10 tokens, no eos) is -1.
  assert penalty(completion_ids=[[5] * 5 + [2], [5] * 7 + [2], [5] * 9 + [2], [5] * 10]) == [0.0, -0.5, -1.0, -1.0]


def _reward_set(tiny_overrides, functions: str, **extra) -> rewards.RewardSet:
  return rewards.RewardSet(_config(tiny_overrides, reward_functions=functions, **extra).rl, eos_id=2)


def test_user_reward_functions_are_imported_weighted_and_given_the_columns(tiny_overrides, tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(
      "def by_column(prompts, completions, completion_ids, bonus, **kwargs):\n"
      "  return [float(len(c)) + b for c, b in zip(completions, bonus)]\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  scores = _reward_set(tiny_overrides, "my_rewards:by_column,exact_match", reward_weights="0.5,2").score(
      ["p", "p"], ["ab", "7"], [[5, 2], [6]], {"bonus": [1.0, 0.0], "answer": ["x", "7"]}, [3, 3])
  assert scores.per_function["my_rewards:by_column"].tolist() == [3.0, 1.0]
  assert scores.total.tolist() == [1.5, 0.5 + 2.0]


@pytest.mark.parametrize("source, message", [
    ("def f(**kw):\n  raise KeyError('answer')\n", "reward function bad:f raised KeyError: 'answer' (on the "
     "completions of prompt records 7, 9)"),
    ("def f(completions, **kw):\n  return [1.0]\n", "reward function bad:f returned 1 value(s) for 2 completions"),
    ("def f(completions, **kw):\n  return [1.0, float('nan')]\n", "reward function bad:f returned nan for "
     "completion 1 (prompt record 9); rewards must be finite"),
    ("def f(completions, **kw):\n  return 'no'\n", "reward function bad:f returned str, not a list of floats"),
])
def test_a_reward_function_that_fails_is_named_with_the_prompt(tiny_overrides, tmp_path, monkeypatch, source, message):
  module = f"bad_{abs(hash(source))}"  # a module of its own per case (imports are cached)
  (tmp_path / f"{module}.py").write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(UserError) as error:
    _reward_set(tiny_overrides, f"{module}:f").score(["p", "q"], ["a", "b"], [[1], [2]], {}, [7, 9])
  assert message.replace("bad:f", f"{module}:f") in str(error.value)


@pytest.mark.parametrize("functions, message", [
    ("no_such_module_here:f", "reward function no_such_module_here:f: cannot import no_such_module_here "
     "(ModuleNotFoundError"), ("math:no_such", "reward function math:no_such: math has no callable 'no_such'"),
    ("exactmatch", "reward function 'exactmatch' is neither a built-in (exact_match, format, length_penalty)"),
    ("format", "reward format needs rl_format_regex"),
])
def test_reward_functions_that_cannot_load_are_config_errors(tiny_overrides, functions, message):
  with pytest.raises(ConfigError) as error:
    _reward_set(tiny_overrides, functions)
  assert message in str(error.value)


# ---- rollouts and the step on the 8-device mesh ------------------------------------------------------

def test_training_rows_weigh_only_the_completion():
  rows = rollouts.training_rows([[1, 5, 6], [1, 7]], [[9, 10, 2], [11]], length=6)
  assert rows["inputs"][0].tolist() == [1, 5, 6, 9, 10, 0] and rows["targets"][0].tolist() == [5, 6, 9, 10, 2, 0]
  assert rows["targets_segmentation"][0].tolist() == [0, 0, 1, 1, 1, 0]
  assert rows["targets_segmentation"][1].tolist() == [0, 1, 0, 0, 0, 0]
  assert rows["inputs_segmentation"][1].tolist() == [1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("family", [
    # MoE and MLA rollouts are the decode engine's (tested per family there): slow here.
    {}, pytest.param(MOE, marks=pytest.mark.slow), pytest.param(MLA, marks=pytest.mark.slow),
    pytest.param(dict(lora_rank=4, lora_target_modules="q_proj,v_proj", grpo_beta=0.1), marks=pytest.mark.slow),
    dict(grpo_num_iterations=3, grpo_beta=0.05, grpo_loss_type="grpo"),
], ids=["dense", "moe", "mla", "lora_kl", "iterations_kl"])
def test_rollouts_sample_from_the_train_state_and_the_step_learns_from_them(tiny_overrides, family):
  config = _config(tiny_overrides, per_device_batch_size=1, learning_rate=1e-2, warmup_steps_fraction=0.0, dtype="float32",
                   **family)
  run = run_assembly.build_run(config)
  state = run.init_state()
  engine = Engine(config, num_slots=8, mesh=run.mesh)
  prompts = [[1, 2, 3, (i % 4) + 4] for i in range(2) for _ in range(4)]
  row_params = [RowParams(1.0, 1.0, 0, seed) for seed in range(8)]
  completions = rollouts.generate(engine, state.params, prompts, row_params, max_new_tokens=6, eos_id=None)
  assert [len(c) for c in completions] == [6] * 8
  again = rollouts.generate(engine, state.params, prompts, row_params, max_new_tokens=6, eos_id=None)
  assert again == completions  # seeded per row
  # A made-up verifiable reward: completions of mostly low token ids.
  scores = np.asarray([np.mean(np.asarray(c) < 64) for c in completions])
  advantages, _ = rewards.advantages(scores, 4, "group")
  rows = rollouts.training_rows(prompts, completions, config.data.max_target_length)
  rows["advantages"] = advantages.astype(np.float32)
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = run.train_step(state, batch, jax.random.key(0))
  metrics = {k: np.asarray(v) for k, v in metrics.items()}
  assert math.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  assert float(metrics["num_tokens"]) == 48 * config.rl.grpo_num_iterations
  if config.rl.grpo_num_iterations > 1:  # later updates see a moved policy: ratios away from 1
    assert float(metrics["policy_ratio_mean"]) != pytest.approx(1.0, abs=1e-7)
  if config.rl.grpo_beta > 0:
    assert float(metrics["kl"]) >= 0
  after = jax.tree.map(np.asarray, state.params)
  trainable, frozen = lora.partition_for(config.model).split(after)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
  if config.model.lora.lora_rank:
    base_before = lora.partition_for(config.model).split(before)[1]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base_before)))
  assert any(changed)
