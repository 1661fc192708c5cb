"""CPU training throughput of a fixed ~42M-parameter Llama-style model.

    python3 benchmarks/cpu_train.py [steps=10] [batch=4] [max_target_length=256]

Builds the same state, step and loop as train.py (via Config / build_run) on the
local CPU devices, skips the first (compiling) step, and prints tokens/s,
TFLOP/s and MFU against the measured CPU matmul peak. The last line is
machine-readable: `RESULT tokens_per_s=... tflops_per_s=... mfu=... peak_tflops=...`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

# ~42M parameters: 8 layers of width 512 (8 heads of 64, MLP 2048, SwiGLU) and a 8192 vocabulary.
MODEL = dict(base_emb_dim=512, base_num_query_heads=8, base_num_kv_heads=8, head_dim=64, base_mlp_dim=2048,
             base_num_decoder_layers=8, vocab_size=8192, dtype="float32", remat_policy="none", scan_layers=True)


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"length": "max_target_length"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--batch", type=int, default=4, help="sequences per step")
  parser.add_argument("--max_target_length", type=int, default=256)
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  for key in ("steps", "batch", "max_target_length"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax

  from MaxText.training import metrics
  from MaxText.platform import accelerators
  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import build_run

  config = Config.for_testing(**MODEL, per_device_batch_size=args.batch / jax.device_count(),
                              max_target_length=args.max_target_length, steps=args.steps + 1, print_config=False)
  run = build_run(config)
  state, step_fn, data, rng = run.init_state(0), run.train_step, run.data_iterator(), jax.random.key(0)
  num_params = run.num_params

  state, m = step_fn(state, next(data), rng)  # compile
  jax.block_until_ready(m)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, m = step_fn(state, next(data), rng)
  jax.block_until_ready(m)
  seconds = (time.perf_counter() - start) / args.steps

  flops = metrics.training_tflops_per_step(config.model, config.data.global_batch_size, args.max_target_length)
  peak, source = accelerators.peak_tflops_per_device(config.target, -1.0)
  tokens = config.data.global_batch_size * args.max_target_length
  t = metrics.throughput(seconds, tokens, flops, config.target.num_devices, peak)
  print(f"model: {num_params / 1e6:.1f}M parameters; batch {config.data.global_batch_size} x {args.max_target_length} tokens; "
        f"{jax.device_count()} CPU device(s)")
  print(f"peak: {peak * config.target.num_devices:.3f} TFLOP/s per host ({source})")
  print(f"step: {seconds:.3f} s, {t.tokens_per_s:.1f} tokens/s, {t.tflops_per_s_per_device * config.target.num_devices:.3f} "
        f"TFLOP/s, MFU {100 * t.mfu:.1f}%")
  print(f"RESULT tokens_per_s={t.tokens_per_s:.1f} tflops_per_s={t.tflops_per_s_per_device * config.target.num_devices:.4f} "
        f"mfu={t.mfu:.4f} peak_tflops={peak * config.target.num_devices:.4f} params_m={num_params / 1e6:.1f}")


if __name__ == "__main__":
  bench_args.run(main)
