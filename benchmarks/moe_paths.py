"""Training step time of a small Mixtral on CPU: padded dropless vs grouped (ragged_dot) vs capacity 1.25.

    python3 benchmarks/moe_paths.py [--steps 5] [--batch 4] [--length 256] [--experts 8]

Same state, step and data as train.py (through tests/train_utils.Run's pieces), one process,
all local devices; the first (compiling) step is skipped. Prints, per path, seconds per step,
the formula's training TFLOPs per step (metrics.py) and XLA's count for the forward pass
(cost analysis). On CPU, jax lowers ragged_dot to a masked dense product over every
expert, so the grouped path does not run fewer FLOPs here; on GPU and TPU it is a grouped
GEMM over the routed rows only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PATHS = {"padded dropless": dict(capacity_factor=-1.0), "grouped (sparse_matmul)": dict(sparse_matmul=True),
         "padded capacity 1.25": dict(capacity_factor=1.25)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--experts", type=int, default=8)
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp

  from MaxText import metrics, models, sharding
  from MaxText.config import Config
  from MaxText.run_assembly import build_run

  model = dict(decoder_block="mixtral", base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=2, head_dim=64,
               base_mlp_dim=512, base_num_decoder_layers=4, vocab_size=1024, mlp_activations=["silu", "linear"],
               num_experts=args.experts, num_experts_per_tok=2, dtype="float32", remat_policy="none",
               scan_layers=False)  # unrolled: XLA's cost analysis counts a scan body once
  for label, path in PATHS.items():
    config = Config.for_testing(**model, **path, per_device_batch_size=args.batch / jax.device_count(),
                                max_target_length=args.length, steps=args.steps + 1, print_config=False)
    run = build_run(config)
    state, step_fn, data, rng = run.init_state(0), run.train_step, run.data_iterator(), jax.random.key(0)
    state, out = step_fn(state, next(data), rng)  # compile
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, out = step_fn(state, next(data), rng)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / args.steps
    flops = metrics.training_tflops_per_step(config.model, config.data.global_batch_size, args.length)
    spec = models.build_model_spec(config.model)
    tokens = jax.ShapeDtypeStruct((config.data.global_batch_size, args.length), jnp.int32)
    cost = jax.jit(sharding.unsharded()(spec.apply)).lower(spec.abstract_params, tokens, tokens, tokens).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"] / 1e12
    print(f"{label:24s}: {seconds:.3f} s/step; formula {flops.total_tflops:.3f} TFLOP/step "
          f"(expert rows/sequence {metrics.moe_expert_rows(config.model, args.length):.0f}); "
          f"XLA forward {xla:.3f} TFLOP (x3 = {3 * xla:.3f})", flush=True)


if __name__ == "__main__":
  main()
