"""MoE dispatch and grouped-matmul paths: CPU step time, or an AOT compile for a TPU topology.

    python3 benchmarks/moe_paths.py [steps=3] [max_target_length=128] [num_experts=8]
        [ici_expert_parallelism=4]
    python3 benchmarks/moe_paths.py tpu=v5p-64 ici_expert_parallelism=8
        [models=mixtral-8x7b,qwen3-30b-a3b-shape] [moe_ragged_buffer_factor=2] [dispatch=all_to_all,gather]

CPU (default): a small Mixtral-style model on the 8 simulated devices (expert parallelism
ici_expert_parallelism, FSDP over the rest), the same state, step and data as train.py (run_assembly);
for each dispatch (all_to_all, gather) and each expert path (padded dropless, capacity 1.25,
grouped dropless with ragged_dot) it prints seconds per step (first, compiling, step skipped).
On CPU the grouped exchange is the padded all_to_all (XLA:CPU has no ragged all-to-all) and
ragged_dot is a masked dense product, so CPU times say little about TPU/GPU speed.

tpu=NAME: compiles the train step ahead of time for that topology (no TPU needed), dropless
grouped experts (sparse_matmul, moe_grouped_matmul=auto = megablox), for each model and
dispatch, and prints XLA's per-chip memory, the bytes each kind of collective produces per
step and device (from the compiled HLO; a ragged all-to-all counts its whole receive buffer, an
upper bound), and the compiler's step-time estimate with its implied MFU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from MaxText.configuration.model_checks import MOE_DISPATCHES  # noqa: E402
from benchmarks import bench_args  # noqa: E402

CPU_PATHS = {"padded dropless": dict(capacity_factor=-1.0), "capacity 1.25": dict(capacity_factor=1.25),
             "grouped dropless": dict(capacity_factor=-1.0, sparse_matmul=True)}
# A many-expert shape: Qwen3-30B-A3B's published dimensions (128 experts, top-8, no shared expert).
QWEN3_30B_A3B = dict(decoder_block="mixtral", base_emb_dim=2048, base_num_query_heads=32, base_num_kv_heads=4,
                     head_dim=128, base_mlp_dim=768, base_num_decoder_layers=48, vocab_size=151936, num_experts=128,
                     num_experts_per_tok=8, rope_max_timescale=1_000_000, normalization_layer_epsilon=1e-6)
TPU_MODELS = {"mixtral-8x7b": dict(model_name="mixtral-8x7b"), "qwen3-30b-a3b-shape": QWEN3_30B_A3B}


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"length": "max_target_length", "experts": "num_experts", "buffer_factor": "moe_ragged_buffer_factor",
           "batch": "per_device_batch_size", "expert": "ici_expert_parallelism"}


def cpu(args: argparse.Namespace) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  import jax

  from benchmarks.gpu_train import time_steps  # the same timing as the GPU/CPU training benchmark

  model = dict(decoder_block="mixtral", base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=2, head_dim=64,
               base_mlp_dim=512, base_num_decoder_layers=4, vocab_size=1024, num_experts=args.num_experts,
               num_experts_per_tok=2, dtype="float32", remat_policy="none")
  expert = args.ici_expert_parallelism
  print(f"CPU, {jax.device_count()} devices: expert={expert}, fsdp={jax.device_count() // expert}; "
        f"{args.num_experts} experts top-2, 4 layers, width 256, {args.max_target_length} tokens x 8 sequences")
  for path_name, path in CPU_PATHS.items():
    for dispatch in ("all_to_all", "gather"):
      overrides = dict(model, **path, moe_dispatch=dispatch, per_device_batch_size=1,
                       max_target_length=args.max_target_length, ici_expert_parallelism=expert,
                       ici_fsdp_parallelism=-1, steps=args.steps + 1,
                       print_config=False)
      print(f"{path_name:17s} {dispatch:10s}: {time_steps(overrides, args.steps)['step_s']:.3f} s/step", flush=True)


def tpu(args: argparse.Namespace) -> None:
  from MaxText import train_compile
  from MaxText.aot import hlo_cycles
  from MaxText.training import metrics
  from MaxText.configuration.config import BASE_CONFIG_PATH
  from MaxText.aot.memory_report import MemoryReport, format_bytes
  from MaxText.training.run_assembly import build_run

  for model_name in args.models:
    for dispatch in args.dispatch:
      overrides = dict(TPU_MODELS[model_name], compile_topology=args.tpu, ici_expert_parallelism=args.ici_expert_parallelism,
                       ici_fsdp_parallelism=-1, per_device_batch_size=args.per_device_batch_size,
                       max_target_length=args.max_target_length,
                       sparse_matmul=True, capacity_factor=-1, moe_dispatch=dispatch, remat_policy="full",
                       moe_ragged_buffer_factor=args.moe_ragged_buffer_factor, print_config=False)
      argv = ["train_compile", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in overrides.items()]
      config, devices, topology = train_compile.load_target_config(argv)
      assert topology is not None
      run = build_run(config, devices=devices, compiled_step=False)
      start = time.perf_counter()
      compiled = run.train_step.lower(*run.abstract_inputs().as_args()).compile()
      seconds = time.perf_counter() - start
      text = compiled.as_text()
      memory = MemoryReport.from_compiled(compiled, None)
      moved = hlo_cycles.collective_bytes(text)
      cycles = hlo_cycles.estimated_cycles(text) or 0
      gen = topology.generation
      step_s = cycles / (gen.clock_ghz * 1e9)
      flops = metrics.training_tflops_per_step(config.model, config.data.global_batch_size, args.max_target_length)
      mfu = flops.total_tflops / config.target.num_devices / step_s / gen.peak_tflops if step_s else 0.0
      collectives = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in sorted(moved.items()))
      print(f"{model_name} on {args.tpu} ({run.mesh_description()}), {dispatch}: compiled in {seconds:.0f} s; "
            f"memory {format_bytes(memory.total)} per chip ({memory.source}); collectives per step and device: "
            f"{collectives} (total {format_bytes(sum(moved.values()))}); compiler estimate {step_s * 1e3:,.0f} ms "
            f"-> MFU {mfu:.1%}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--max_target_length", type=int, default=None, help="tokens per sequence (CPU 128, TPU 4096)")
  parser.add_argument("--num_experts", type=int, default=8, help="CPU model: number of experts")
  parser.add_argument("--ici_expert_parallelism", type=int, default=None, help="expert-parallel degree (CPU 4, TPU 8)")
  parser.add_argument("--dispatch", default="all_to_all,gather", help="AOT mode: the dispatches to compile")
  parser.add_argument("--tpu", default="", help="a TPU topology name (e.g. v5p-64): AOT mode")
  parser.add_argument("--models", default=",".join(TPU_MODELS), help=f"AOT mode: any of {', '.join(TPU_MODELS)}")
  parser.add_argument("--per_device_batch_size", type=int, default=2, help="AOT mode: sequences per chip")
  parser.add_argument("--moe_ragged_buffer_factor", type=float, default=-1.0,
                      help="AOT mode: moe_ragged_buffer_factor of the all_to_all runs (<= 0: worst case)")
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  args.dispatch = bench_args.names("dispatch", args.dispatch, MOE_DISPATCHES)
  args.models = bench_args.names("models", args.models, TPU_MODELS)
  for key in ("steps", "num_experts", "per_device_batch_size"):
    bench_args.at_least(key, getattr(args, key), 1)
  for key in ("max_target_length", "ici_expert_parallelism"):  # None: the mode's default
    if getattr(args, key) is not None:
      bench_args.at_least(key, getattr(args, key), 1)
  if args.tpu:
    args.max_target_length = args.max_target_length or 4096
    args.ici_expert_parallelism = args.ici_expert_parallelism or 8
    tpu(args)
  else:
    args.max_target_length = args.max_target_length or 128
    args.ici_expert_parallelism = args.ici_expert_parallelism or 4
    cpu(args)


if __name__ == "__main__":
  bench_args.run(main)
