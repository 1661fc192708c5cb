"""Training step time, tokens/s, TFLOP/s/device and MFU of one model config on the local accelerator.

    python3 benchmarks/gpu_train.py [model_name=llama2-7b] [attention=cudnn_flash]
        [quantization=fp8] [steps=10] [per_device_batch_size=1] [max_target_length=2048]
        [remat_policy=full] [key=value ...]
    python3 benchmarks/gpu_train.py smoke=true     # a tiny model on CPU: checks the script runs

Builds the same state and jitted step as train.py (synthetic data), runs one compiling
step, then times `steps` steps. FLOPs follow MaxText/training/metrics.py (6 x matmul parameters x
tokens plus attention); MFU is against the device's published bf16 peak from
MaxText/platform/accelerators.py (on CPU: a measured float32 matmul rate), also for int8/fp8 runs,
so a quantized run's MFU shows its speed-up over the same bf16 budget.
`compare=quantization=,int8` runs several variants in one process and prints one line each. The
last line of each run is machine-readable: `RESULT name=... step_s=... tokens_per_s=...
tflops_per_s_per_device=... mfu=...`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.errors import UserError  # noqa: E402
from benchmarks import bench_args  # noqa: E402

# A model that compiles and steps in seconds on CPU (the smoke=true run and the CPU int8/bf16 figures).
SMOKE_MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                   base_num_decoder_layers=2, vocab_size=256, max_target_length=64, per_device_batch_size=1)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model_name", default="llama2-7b")
  parser.add_argument("--attention", default="autoselected")
  parser.add_argument("--quantization", default="", choices=["", "int8", "fp8"])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--per_device_batch_size", type=float, default=1.0)
  parser.add_argument("--max_target_length", type=int, default=2048)
  parser.add_argument("--remat_policy", default="full")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--compare", default="",
                      help="key=v1,v2: one run per value, e.g. quantization=,int8 or attention=dot_product,cudnn_flash")
  parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, CPU")
  args, rest = tool_args.parse_known_args(parser, argv)
  for item in rest:
    if "=" not in item or not item.partition("=")[0]:
      raise UserError(f"{item!r} is not key=value; give config keys as key=value")
  extra = dict(item.split("=", 1) for item in rest)
  key, sep, values = args.compare.partition("=")
  if args.compare and not (sep and key):
    # values stay split as typed: an empty one is a value (quantization=,int8 compares none with int8)
    raise UserError(f"compare={args.compare!r}: write key=v1,v2, e.g. compare=attention=dot_product,cudnn_flash")
  bench_args.at_least("steps", args.steps, 1)
  bench_args.at_least("per_device_batch_size", args.per_device_batch_size, 1e-9)
  bench_args.at_least("max_target_length", args.max_target_length, 1)
  return args, extra


def _overrides(args: argparse.Namespace, extra: dict[str, str]) -> dict[str, Any]:
  if args.smoke:
    base = dict(SMOKE_MODEL, dtype=args.dtype, steps=max(args.steps, 2) + 1)
  else:
    base = dict(model_name=args.model_name, per_device_batch_size=args.per_device_batch_size,
                max_target_length=args.max_target_length, dtype=args.dtype, steps=args.steps + 1)
  base.update(attention=args.attention, quantization=args.quantization, remat_policy=args.remat_policy,
              enable_checkpointing=False, print_config=False, dataset_type="synthetic")
  base.update(extra)
  return base


def time_steps(overrides: dict[str, Any], num_steps: int) -> dict[str, float]:
  """Compiles, runs one warm-up step, times `num_steps` steps; throughput per MaxText/training/metrics.py."""
  import jax

  from MaxText.training import metrics
  from MaxText.platform import accelerators
  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import build_run

  config = Config.for_testing(**overrides)
  run = build_run(config)
  state, step_fn, data, rng = run.init_state(0), run.train_step, run.data_iterator(), jax.random.key(0)
  compile_start = time.perf_counter()
  state, m = step_fn(state, next(data), rng)
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - compile_start
  batches = [next(data) for _ in range(num_steps)]  # data time stays out of the step time
  start = time.perf_counter()
  for batch in batches:
    state, m = step_fn(state, batch, rng)
  jax.block_until_ready(m)
  step_s = (time.perf_counter() - start) / num_steps
  length, batch_size = config.data.max_target_length, config.data.global_batch_size
  flops = metrics.training_tflops_per_step(config.model, batch_size, length)
  peak, source = accelerators.peak_tflops_per_device(config.target, config.run.cpu_peak_tflops)
  t = metrics.throughput(step_s, batch_size * length, flops, config.target.num_devices, peak)
  num_params = run.num_params
  return dict(step_s=step_s, compile_s=compile_s, tokens_per_s=t.tokens_per_s,
              tflops_per_s_per_device=t.tflops_per_s_per_device, mfu=t.mfu, loss=float(m["loss"]),
              params_m=num_params / 1e6, devices=config.target.num_devices, peak=peak, peak_source=source,
              device_kind=config.target.device_kind, batch=batch_size, length=length)


def _report(name: str, r: dict[str, Any]) -> None:
  print(f"[{name}] {r['params_m']:.1f}M params, batch {r['batch']} x {r['length']} on {r['devices']} x "
        f"{r['device_kind']} (peak {r['peak']:.3f} TFLOP/s/device: {r['peak_source']})")
  print(f"[{name}] step {r['step_s'] * 1e3:.1f} ms (compile+first {r['compile_s']:.1f} s) | "
        f"{r['tokens_per_s']:.1f} tokens/s | {r['tflops_per_s_per_device']:.3f} TFLOP/s/device | "
        f"MFU {100 * r['mfu']:.2f}% | loss {r['loss']:.3f}")
  print(f"RESULT name={name or 'default'} step_s={r['step_s']:.6g} tokens_per_s={r['tokens_per_s']:.6g} "
        f"tflops_per_s_per_device={r['tflops_per_s_per_device']:.6g} mfu={r['mfu']:.6g}")


def main(argv: list[str] | None = None) -> None:
  args, extra = _parse(argv)
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  overrides = _overrides(args, extra)
  variants = [("", overrides)]
  if args.compare:
    key, values = args.compare.split("=", 1)
    variants = [(f"{key}={value}", dict(overrides, **{key: value})) for value in values.split(",")]
  for name, variant in variants:
    _report(name, time_steps(variant, max(args.steps, 2) if args.smoke else args.steps))


if __name__ == "__main__":
  bench_args.run(main)
