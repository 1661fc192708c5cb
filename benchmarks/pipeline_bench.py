"""Pipeline schedules side by side on simulated CPU devices: bubble, compiled memory, step time.

    python3 benchmarks/pipeline_bench.py [ici_pipeline_parallelism=4] [num_pipeline_microbatches=8]
        [repeats=2] [devices=8] [base_num_decoder_layers=8] [base_emb_dim=256] [max_target_length=256]
        [per_device_batch_size=4] [steps=3]

Builds train.py's state and jitted train step for gpipe, circular, 1f1b and interleaved 1f1b
(`pipeline_schedule=1f1b num_pipeline_repeats=R`) on `devices` simulated CPU devices (stage
x data), then prints one Markdown row per schedule: the bubble fraction the log reports, the
stage inputs 1F1B keeps, XLA's temporaries of the compiled step per device (what the schedule's
stored activations cost) and the mean step time after the compiling call. CPU step times show
the schedules' extra work (1F1B re-runs each stage forward), not accelerator speed.
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
RENAMED = {"layers": "base_num_decoder_layers", "width": "base_emb_dim", "length": "max_target_length",
           "per_device_batch": "per_device_batch_size", "micro": "num_pipeline_microbatches",
           "stages": "ici_pipeline_parallelism"}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ici_pipeline_parallelism", type=int, default=4)
  parser.add_argument("--num_pipeline_microbatches", type=int, default=8, help="num_pipeline_microbatches")
  parser.add_argument("--repeats", type=int, default=2, help="passes for circular and interleaved 1f1b")
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (stages x data)")
  parser.add_argument("--base_num_decoder_layers", type=int, default=8)
  parser.add_argument("--base_emb_dim", type=int, default=256)
  parser.add_argument("--max_target_length", type=int, default=256)
  parser.add_argument("--per_device_batch_size", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3)
  args = tool_args.parse_args(parser, argv, renamed=RENAMED)
  for key in ("ici_pipeline_parallelism", "num_pipeline_microbatches", "repeats", "devices",
              "base_num_decoder_layers", "base_emb_dim", "max_target_length", "per_device_batch_size", "steps"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

  import jax

  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import build_run
  from MaxText.layers import pipeline, pipeline_timetable

  emb, stages, micro = args.base_emb_dim, args.ici_pipeline_parallelism, args.num_pipeline_microbatches
  model = dict(base_emb_dim=emb, base_num_query_heads=4, base_num_kv_heads=4, head_dim=emb // 4, base_mlp_dim=4 * emb,
               base_num_decoder_layers=args.base_num_decoder_layers, vocab_size=1024,
               max_target_length=args.max_target_length, per_device_batch_size=args.per_device_batch_size,
               remat_policy="full", dataset_type="synthetic", print_config=False)
  schedules = [("gpipe", 1), ("circular", args.repeats), ("1f1b", 1), ("1f1b", args.repeats)]
  print(f"{stages} stages x {args.devices // stages} data, {micro} microbatches, {args.base_num_decoder_layers} layers "
        f"of width {args.base_emb_dim}, {args.max_target_length} tokens, {args.per_device_batch_size} sequences per device; "
        f"jax {jax.__version__}, {jax.devices()[0].platform}")
  print("| schedule | repeats | bubble | stage inputs kept (1F1B) | temporaries per device | step time |")
  print("| --- | --- | --- | --- | --- | --- |")
  for schedule, repeats in schedules:
    config = Config.for_testing(**model, ici_pipeline_parallelism=stages, ici_fsdp_parallelism=1,
                                ici_data_parallelism=args.devices // stages, pipeline_schedule=schedule,
                                num_pipeline_repeats=repeats, num_pipeline_microbatches=micro,
                                steps=args.steps + 1)
    run = build_run(config)
    state, data, rng = run.init_state(0), run.data_iterator(), jax.random.key(0)
    batch = next(data)
    compiled = run.train_step.lower(state, batch, rng).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, metrics = compiled(state, batch, rng)  # the first call is not timed
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = compiled(state, next(data), rng)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / args.steps
    kept = (str(pipeline_timetable.build(stages, micro, repeats).num_slots) if schedule == "1f1b"
            else f"all ({pipeline.num_iterations(stages, micro, repeats)} iterations)")
    name = "interleaved 1f1b" if schedule == "1f1b" and repeats > 1 else schedule
    assert bool(jax.numpy.isfinite(metrics["loss"])), f"{name}: loss is not finite"
    print(f"| {name} | {repeats} | {pipeline.bubble_fraction(stages, micro, repeats):.3f} | {kept} | "
          f"{temp / 2**20:.1f} MiB | {seconds * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
  bench_args.run(main, with_argv=True)
