"""Pipeline schedules side by side on simulated CPU devices: bubble, compiled memory, step time.

    python3 benchmarks/pipeline_bench.py [--stages 4] [--micro 8] [--repeats 2] [--devices 8]
        [--layers 8] [--width 256] [--length 256] [--per_device_batch 4] [--steps 3]

Builds train.py's state and jitted train step for gpipe, circular, 1f1b and interleaved 1f1b
(`pipeline_schedule=1f1b num_pipeline_repeats=R`) on `--devices` simulated CPU devices (stage
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


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--micro", type=int, default=8, help="num_pipeline_microbatches")
  parser.add_argument("--repeats", type=int, default=2, help="passes for circular and interleaved 1f1b")
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (stages x data)")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--per_device_batch", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

  import jax

  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import build_run
  from MaxText.layers import pipeline, pipeline_timetable

  model = dict(base_emb_dim=args.width, base_num_query_heads=4, base_num_kv_heads=4, head_dim=args.width // 4,
               base_mlp_dim=4 * args.width, base_num_decoder_layers=args.layers, vocab_size=1024,
               max_target_length=args.length, per_device_batch_size=args.per_device_batch, remat_policy="full",
               dataset_type="synthetic", print_config=False)
  schedules = [("gpipe", 1), ("circular", args.repeats), ("1f1b", 1), ("1f1b", args.repeats)]
  print(f"{args.stages} stages x {args.devices // args.stages} data, {args.micro} microbatches, {args.layers} layers "
        f"of width {args.width}, {args.length} tokens, {args.per_device_batch} sequences per device; "
        f"jax {jax.__version__}, {jax.devices()[0].platform}")
  print("| schedule | repeats | bubble | stage inputs kept (1F1B) | temporaries per device | step time |")
  print("| --- | --- | --- | --- | --- | --- |")
  for schedule, repeats in schedules:
    config = Config.for_testing(**model, ici_pipeline_parallelism=args.stages, ici_fsdp_parallelism=1,
                                ici_data_parallelism=args.devices // args.stages, pipeline_schedule=schedule,
                                num_pipeline_repeats=repeats, num_pipeline_microbatches=args.micro,
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
    kept = (str(pipeline_timetable.build(args.stages, args.micro, repeats).num_slots) if schedule == "1f1b"
            else f"all ({pipeline.num_iterations(args.stages, args.micro, repeats)} iterations)")
    name = "interleaved 1f1b" if schedule == "1f1b" and repeats > 1 else schedule
    assert bool(jax.numpy.isfinite(metrics["loss"])), f"{name}: loss is not finite"
    print(f"| {name} | {repeats} | {pipeline.bubble_fraction(args.stages, args.micro, repeats):.3f} | {kept} | "
          f"{temp / 2**20:.1f} MiB | {seconds * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
  main()
