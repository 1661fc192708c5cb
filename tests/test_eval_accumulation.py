"""The eval step under gradient_accumulation_steps: the batch goes through in the training step's
micro-batches (a batch sized to fit only that way ran out of memory at the first evaluation), and the
summed figures are those of the whole batch at once."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from MaxText.configuration.config import Config
from MaxText.platform import accelerators
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
