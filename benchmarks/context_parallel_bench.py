"""Context-parallel attention on the simulated CPU mesh: each strategy's forward + backward time
and per-device memory at a long sequence.

    python3 benchmarks/context_parallel_bench.py [max_target_length=16384] [ici_sequence_parallelism=4]
        [base_num_query_heads=8] [base_num_kv_heads=4] [head_dim=64] [block=512] [repeats=2]
        [strategies=all_gather,ring,all_to_all] [balance=both]

The length is split over `shards` simulated CPU devices (--xla_force_host_platform_device_count;
all share this machine's cores, so times show the schedule's total work, not parallel speed-up).
Memory is XLA's accounting of the compiled step per device (`memory_analysis()`: temporaries,
i.e. every intermediate alive at the peak, arguments and outputs excluded). One Markdown row per
strategy and balancing setting.
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


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"heads": "base_num_query_heads", "kv_heads": "base_num_kv_heads", "length": "max_target_length",
           "shards": "ici_sequence_parallelism"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max_target_length", type=int, default=16384)
  parser.add_argument("--ici_sequence_parallelism", type=int, default=4)
  parser.add_argument("--base_num_query_heads", type=int, default=8)
  parser.add_argument("--base_num_kv_heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--block", type=int, default=512, help="flash_block_q = flash_block_kv")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--strategies", default="all_gather,ring,all_to_all")
  parser.add_argument("--balance", default="both", choices=("both", "on", "off"))
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  # the config's own list: a name it does not know is refused here, not after the earlier strategies ran
  from MaxText.configuration.model_checks import CONTEXT_PARALLEL_STRATEGIES  # noqa: PLC0415
  args.strategies = bench_args.names("strategies", args.strategies, CONTEXT_PARALLEL_STRATEGIES)
  for key in ("max_target_length", "ici_sequence_parallelism", "base_num_query_heads", "base_num_kv_heads",
              "head_dim", "block", "repeats"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.ici_sequence_parallelism}")

  import jax
  import jax.numpy as jnp

  from MaxText.platform import sharding
  from MaxText.configuration.config import Config
  from MaxText.layers import attention, context_parallel

  balances = {"both": (False, True), "on": (True,), "off": (False,)}[args.balance]
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, args.max_target_length, args.base_num_query_heads, args.head_dim), jnp.float32)
  kv_shape = (1, args.max_target_length, args.base_num_kv_heads, args.head_dim)
  k, v = (jax.random.normal(key, kv_shape, jnp.float32) for key in keys[1:])
  segments = jnp.ones((1, args.max_target_length), jnp.int32)
  print(f"length {args.max_target_length} over {args.ici_sequence_parallelism} CPU devices, "
        f"heads {args.base_num_query_heads}/{args.base_num_kv_heads} (q/kv), head_dim "
        f"{args.head_dim}, float32, causal, flash block {args.block}")
  print("| strategy | load balance | fwd+bwd s | tokens/s | temp memory per device MiB |")
  print("| --- | --- | --- | --- | --- |")
  for strategy in args.strategies:
    for balanced in balances:
      config = Config.for_testing(
          base_emb_dim=args.base_num_query_heads * args.head_dim, base_num_query_heads=args.base_num_query_heads,
          base_num_kv_heads=args.base_num_kv_heads,
          head_dim=args.head_dim, max_target_length=args.max_target_length, per_device_batch_size=1, print_config=False,
          attention="flash", ici_sequence_parallelism=args.ici_sequence_parallelism, ici_fsdp_parallelism=-1,
          flash_block_q=args.block, flash_block_kv=args.block, context_parallel_strategy=strategy,
          context_parallel_load_balance=balanced)
      mesh, rules = sharding.create_mesh(config.mesh), config.mesh.logical_axis_rules
      kernel = attention.ATTENTION_KERNELS["flash"](config.model)

      def loss(q, k, v, kernel=kernel, mesh=mesh, rules=rules):
        with sharding.activation_sharding(mesh, rules):
          return kernel(q, k, v, segments, None, 0.0).sum()

      args_in = (q, k, v)
      if balanced:
        args_in = tuple(context_parallel.to_balanced_order(x, args.ici_sequence_parallelism) for x in args_in)
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args_in).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled(*args_in))
      start = time.perf_counter()
      for _ in range(args.repeats):
        jax.block_until_ready(compiled(*args_in))
      seconds = (time.perf_counter() - start) / args.repeats
      print(f"| {strategy} | {balanced} | {seconds:.2f} | {args.max_target_length / seconds:,.0f} | {temp / 2**20:,.1f} |",
            flush=True)


if __name__ == "__main__":
  bench_args.run(main)
