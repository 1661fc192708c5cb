"""Matmul throughput of the training matmul modes: bf16, fp8 and mxfp8, forward and forward + backward.

    python3 benchmarks/mxfp8_bench.py [sizes=1024,2048,4096] [repeats=5] [modes=bf16,fp8,mxfp8]

One [M, K] x [K, N] product (M = N = K = size) through `quantization.quantized_dot_general`,
the function the model's projections call, with bfloat16 operands; "fwd+bwd" is the gradient
of both operands for a random cotangent (three matmuls; a constant one would let XLA fold the
gradient's quantization at compile time). Jitted on the first device JAX gives (CPU,
GPU or TPU, whatever the machine has); the first (compiling) call is not timed; the time is
the median of `repeats` calls. TFLOP/s counts 2·M·N·K per matmul whatever the operand type,
so a mode that runs faster shows as a higher figure. Prints one Markdown table row per mode
and size, after a line naming the device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.errors import UserError  # noqa: E402
from benchmarks import bench_args  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText.layers import quantization  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))


def _seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


MODES = {"bf16": "", "fp8": "fp8", "mxfp8": "mxfp8"}  # the name a table row shows -> quantized_dot_general's mode


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The arguments, every list read and checked: nothing is measured with a bad one."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="1024,2048,4096")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--modes", default="bf16,fp8,mxfp8", help="quantization modes: bf16, fp8, mxfp8")
  args = tool_args.parse_args(parser, argv)
  args.sizes = bench_args.numbers("sizes", args.sizes, "1024,2048")
  if args.modes.strip().startswith(","):  # the old spelling of bf16 was an empty first item
    raise UserError(f"modes={args.modes!r} starts with an empty item; write bf16 for the bf16 mode, e.g. "
                    "modes=bf16,fp8,mxfp8")
  args.modes = [MODES[m] for m in bench_args.names("modes", args.modes, MODES)]
  bench_args.at_least("repeats", args.repeats, 1)
  return args


def main() -> None:
  args = parse(None)
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), bfloat16 operands, median of {args.repeats} calls")
  print("| mode | size | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
  print("| --- | --- | --- | --- | --- | --- |")
  for size in args.sizes:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (size, size), jnp.bfloat16)
    w = (jax.random.normal(kw, (size, size), jnp.float32) / size ** 0.5).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    flops = 2.0 * size ** 3
    for mode in args.modes:
      def forward(x: jax.Array, w: jax.Array, mode: str = mode) -> jax.Array:
        return quantization.quantized_dot_general(mode, x, w, DIMS)

      both = jax.jit(jax.grad(lambda x, w, c, f=forward: (f(x, w).astype(jnp.float32) * c).sum(), argnums=(0, 1)))
      fwd_s = _seconds(jax.jit(forward), x, w, repeats=args.repeats)
      both_s = _seconds(both, x, w, cotangent, repeats=args.repeats)
      print(f"| {mode or 'bf16'} | {size} | {1e3 * fwd_s:.2f} | {flops / fwd_s / 1e12:.3f} | {1e3 * both_s:.2f} | "
            f"{3 * flops / both_s / 1e12:.3f} |", flush=True)


if __name__ == "__main__":
  bench_args.run(main)
