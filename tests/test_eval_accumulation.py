"""The eval step under gradient_accumulation_steps: the batch goes through in the training step's
micro-batches (a batch sized to fit only that way ran out of memory at the first evaluation), and the
summed figures are those of the whole batch at once."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from MaxText.configuration.config import Config
from MaxText.platform import accelerators, sharding
from MaxText.training.run_assembly import build_run

MODEL = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=1, head_dim=16, base_mlp_dim=64,
             base_num_decoder_layers=1, vocab_size=4096, max_target_length=64, per_device_batch_size=8,
             dataset_type="synthetic")


def _run(accumulation: int):
  config = Config.for_testing(dataclasses.replace(accelerators.local_target(), num_devices=1),
                              gradient_accumulation_steps=accumulation, **MODEL)
  return build_run(config, devices=jax.devices()[:1], compiled_step=False)


def test_eval_sums_with_accumulation_equal_the_whole_batchs_and_need_less_memory():
  whole, split = _run(1), _run(4)
  state = whole.init_state()
  batch = next(whole.data_iterator())
  want = jax.device_get(whole.eval_step(state, batch))
  got = jax.device_get(split.eval_step(state, batch))
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-5, err_msg=name)
  assert float(got["weight_sum"]) == float(want["weight_sum"]) > 0

  def temp_bytes(run) -> int:
    inputs = run.abstract_inputs()
    return run.eval_step.lower(inputs.state, inputs.batch).compile().memory_analysis().temp_size_in_bytes

  # The whole batch's logits at once are most of the eval step's memory; a quarter of the rows at a time need less.
  assert temp_bytes(split) < 0.5 * temp_bytes(whole)


def test_task_scoring_runs_in_micro_batch_rows_with_the_same_scores():
  """lm-eval's forward passes (training/task_eval.Scorer) hold a training micro-batch's rows at once, not the
  global batch's, and score the same."""
  from MaxText.training import task_eval

  whole, split = task_eval.Scorer(_run(1)), task_eval.Scorer(_run(4))
  assert (whole.rows, split.rows) == (8, 2)
  params = jax.device_get(_run(1).init_state().params)
  whole.params = split.params = params
  rng = np.random.default_rng(0)
  pairs = [(rng.integers(1, 4096, size=int(n)).tolist(), rng.integers(1, 4096, size=3).tolist())
           for n in rng.integers(1, 40, size=5)]
  want, got = whole.loglikelihoods(pairs), split.loglikelihoods(pairs)
  np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=1e-5)
  assert [g for _, g in got] == [w for _, w in want]


GRPO = dict(objective="grpo", dataset_type="hf", tokenizer_type="huggingface", eval_interval=-1,
            reward_functions="exact_match", num_generations=4, max_prefill_predict_length=16, max_completion_length=48,
            max_target_length=64, grpo_beta=0.04)


def _grpo_run(tmp_path, accumulation: int, **overrides):
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
  from sft_fixtures import CHATML, without_markers, write_tokenizer

  tokenizer = tmp_path / "tokenizer"
  if not tokenizer.exists():
    write_tokenizer(tokenizer, without_markers(CHATML))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 1", "answer": "2"}\n' * 8)
  config = Config.for_testing(dataclasses.replace(accelerators.local_target(), num_devices=1),
                              gradient_accumulation_steps=accumulation, hf_data_files=str(tmp_path / "prompts.jsonl"),
                              tokenizer_path=str(tokenizer), **{**MODEL, "dataset_type": "hf", **GRPO, **overrides})
  return build_run(config, devices=jax.devices()[:1], compiled_step=False)


def test_grpo_reference_log_probs_run_in_micro_batches_with_the_same_values(tmp_path):
  """GRPO's fixed log-probabilities (the reference's here; the teacher's and the old policy's alike) are computed
  before the step's updates: over the whole batch at once they set a floor on the step's memory that
  gradient_accumulation_steps did not lower. Now one micro-batch at a time, the same values."""
  from MaxText.training.objectives import grpo_loss

  whole, split = _grpo_run(tmp_path, 1), _grpo_run(tmp_path, 4)
  state = whole.init_state()
  rng = np.random.default_rng(0)
  batch = {name: (rng.normal(size=s.shape).astype(s.dtype) if s.dtype == np.float32 else
                  rng.integers(1, 4, size=s.shape).astype(s.dtype)) for name, s in jax.eval_shape(
                      lambda: whole.abstract_inputs().batch).items()}
  context = whole.objective.context(state)
  want = jax.jit(sharding.unsharded()(whole.objective.prepare_batch))(state.params, context, batch)
  got = jax.jit(sharding.unsharded()(split.objective.prepare_batch))(state.params, context, batch)
  want, got = want[grpo_loss.REF_LOGPS], got[grpo_loss.REF_LOGPS]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()

  def temp_bytes(run) -> int:
    inputs = run.abstract_inputs()
    return run.train_step.lower(inputs.state, inputs.batch, inputs.rng).compile().memory_analysis().temp_size_in_bytes

  # Logits a large part of the step: with a reference, the step needs no more memory than without one.
  big = dict(vocab_size=32768, per_device_batch_size=16, max_prefill_predict_length=64, max_completion_length=192,
             max_target_length=256)
  with_reference, without = (_grpo_run(tmp_path, 8, grpo_beta=beta, **big) for beta in (0.04, 0.0))
  assert temp_bytes(with_reference) < 1.2 * temp_bytes(without)
  # The eval step prepares the whole batch once, then adds its micro-batches' sums: those of the whole batch.
  sums = [jax.device_get(run.eval_step(state, batch)) for run in (whole, split)]
  for name in ("loss_sum", "weight_sum", "kl_sum"):
    if name in sums[0]:
      np.testing.assert_allclose(sums[1][name], sums[0][name], rtol=1e-4, atol=1e-5, err_msg=name)
