"""Attention forward + backward on CPU: chunked flash vs dot_product, tokens/s and memory.

    python3 benchmarks/attention_bench.py [lengths=1024,2048,4096,8192] [base_num_query_heads=8]
        [base_num_kv_heads=8] [head_dim=64] [batch=1] [block=512] [repeats=3] [sliding_window_size=0]

One sequence of causal self-attention per step (gradients of q, k and v of a scalar loss), jitted,
on one CPU device; the first (compiling) call is not timed. Memory is XLA's own accounting of the
compiled step (`memory_analysis().temp_size_in_bytes`: every intermediate buffer alive at the
peak, arguments and outputs excluded). Prints one Markdown table row per kernel and length.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"heads": "base_num_query_heads", "kv_heads": "base_num_kv_heads", "window": "sliding_window_size"}


KERNELS = ("dot_product", "flash")


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The arguments, every list read and checked: nothing is measured with a bad one."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--base_num_query_heads", type=int, default=8)
  parser.add_argument("--base_num_kv_heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--block", type=int, default=512, help="flash_block_q = flash_block_kv")
  parser.add_argument("--sliding_window_size", type=int, default=0, help="sliding window (0 = full causal)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--kernels", default="dot_product,flash")
  args = tool_args.parse_args(parser, argv, renamed=RENAMED)
  args.lengths = bench_args.numbers("lengths", args.lengths, "1024,2048")
  args.kernels = bench_args.names("kernels", args.kernels, KERNELS)
  for key in ("batch", "base_num_query_heads", "base_num_kv_heads", "head_dim", "block", "repeats"):
    bench_args.at_least(key, getattr(args, key), 1)
  bench_args.at_least("sliding_window_size", args.sliding_window_size, 0)
  return args


def main() -> None:
  args = parse(None)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp

  from MaxText.layers import flash_blocks
  from MaxText.layers.attention import dot_product_attention

  kernels = {"dot_product": dot_product_attention,
             "flash": functools.partial(flash_blocks.flash_attention, block_q=args.block, block_kv=args.block)}
  window = args.sliding_window_size or None
  print(f"batch {args.batch}, heads {args.base_num_query_heads}/{args.base_num_kv_heads} (q/kv), "
        f"head_dim {args.head_dim}, float32, "
        f"window {window}, flash block {args.block}, {jax.devices()[0].device_kind}")
  print("| kernel | length | fwd+bwd s | tokens/s | temp memory MiB |")
  print("| --- | --- | --- | --- | --- |")
  for length in args.lengths:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (args.batch, length, args.base_num_query_heads, args.head_dim), jnp.float32)
    kv_shape = (args.batch, length, args.base_num_kv_heads, args.head_dim)
    k, v = (jax.random.normal(key, kv_shape, jnp.float32) for key in keys[1:])
    segments = jnp.ones((args.batch, length), jnp.int32)
    for name in args.kernels:
      kernel = kernels[name]
      step = jax.jit(jax.grad(lambda q, k, v, kernel=kernel: kernel(q, k, v, segments, window, 0.0).sum(),
                              argnums=(0, 1, 2)))
      compiled = step.lower(q, k, v).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled(q, k, v))
      start = time.perf_counter()
      for _ in range(args.repeats):
        jax.block_until_ready(compiled(q, k, v))
      seconds = (time.perf_counter() - start) / args.repeats
      print(f"| {name} | {length} | {seconds:.3f} | {args.batch * length / seconds:,.0f} | {temp / 2**20:,.1f} |",
            flush=True)


if __name__ == "__main__":
  bench_args.run(main)
