"""Pins the numerics of training: loss, gradient norm and parameter checksums after one and two
steps of a fixed tiny config on the simulated 8-device mesh (fsdp=4, tensor=2).

A refactor must leave these numbers alone. Regenerate them only for a change that is meant to
alter the numerics (a new initialiser, a different loss reduction, a data change), say so in the
commit message, and paste what `python3 tests/test_golden_step.py` prints.
"""

from __future__ import annotations

import jax
import numpy as np

GOLDEN = [
    {"loss": 5.3216962814331055, "grad_norm": 1.0569506883621216, "param_sum": 310.6253499176796,
     "param_abs_sum": 14882.05018212118},
    {"loss": 5.449744701385498, "grad_norm": 1.1062296628952026, "param_sum": 310.80840932497654,
     "param_abs_sum": 14880.532695132564},
]
# float32 sums may round differently across XLA versions; a real change moves these far more.
RTOL = 2e-5


def two_steps() -> list[dict[str, float]]:
  from MaxText.configuration.config import Config
  from tests.train_utils import Run

  config = Config.for_testing(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
                              base_mlp_dim=128, base_num_decoder_layers=2, vocab_size=128, max_target_length=32,
                              per_device_batch_size=1, print_config=False, ici_fsdp_parallelism=4,
                              ici_tensor_parallelism=2)
  run = Run(config)
  state = run.init()
  found = []
  for _ in range(2):
    state, metrics = run.step_fn(state, next(run.data), run.rng)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(state.params))]
    metrics = jax.device_get(metrics)
    found.append({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "param_sum": float(sum(leaf.sum() for leaf in leaves)),
                  "param_abs_sum": float(sum(np.abs(leaf).sum() for leaf in leaves))})
  return found


def test_one_and_two_steps_match_the_golden_numbers():
  found = two_steps()
  for step, (got, want) in enumerate(zip(found, GOLDEN), 1):
    for key, value in want.items():
      assert np.isclose(got[key], value, rtol=RTOL, atol=0), (
          f"step {step} {key}: {got[key]!r} != golden {value!r}. If this change is meant to alter the numerics, "
          f"regenerate GOLDEN with `python3 tests/test_golden_step.py` and say why in the commit; otherwise it "
          f"changed training behaviour")


if __name__ == "__main__":
  import os
  import sys

  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  print(two_steps())
