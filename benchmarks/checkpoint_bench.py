"""Checkpoint save/restore throughput and the step-time cost of async saving, ~200M parameters on CPU.

    python3 benchmarks/checkpoint_bench.py [dir=/tmp/ckpt_bench] [steps=4] [gcs=true]
        [base_num_decoder_layers=8]

The full train state (parameters + AdamW's two moments, float32) is ~2.4 GB. For each target
(local disk; with gcs=true also a GCS endpoint: STORAGE_EMULATOR_HOST if set, else a
fake-gcs-server started on 127.0.0.1 from the test extra) it prints:
  * synchronous save and restore throughput (GB/s of state bytes),
  * how long an async save blocks the caller (the device->host copy) and how much it slows
    the training steps that run while it writes in the background,
and the same for the local checkpoint tier (per-process shards on local disk).
The last lines are machine-readable: `RESULT target=... save_gbps=... restore_gbps=...
async_block_s=... step_s=... step_s_during_async_save=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

# 8 layers of width 1024 (8 heads of 128, MLP 4096, SwiGLU) and a 32000 vocabulary: ~200M parameters.
MODEL = dict(base_emb_dim=1024, base_num_query_heads=8, base_num_kv_heads=8, head_dim=128, base_mlp_dim=4096,
             base_num_decoder_layers=8, vocab_size=32000, dtype="float32", remat_policy="none",
             max_target_length=128, print_config=False)


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"layers": "base_num_decoder_layers"}


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default="/tmp/checkpoint_bench")
  parser.add_argument("--steps", type=int, default=4, help="train steps timed with and without a save in flight")
  parser.add_argument("--gcs", action="store_true", help="also measure a GCS endpoint (see above)")
  parser.add_argument("--base_num_decoder_layers", type=int, default=8, help="decoder layers (8: ~200M parameters)")
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  for key in ("steps", "base_num_decoder_layers"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax

  from MaxText.configuration.config import Config
  from MaxText.training.run_assembly import build_run

  shutil.rmtree(args.dir, ignore_errors=True)
  per_device = 1.0 / jax.device_count() if jax.device_count() > 1 else 1.0
  base = dict(MODEL, base_num_decoder_layers=args.base_num_decoder_layers, per_device_batch_size=per_device,
              base_output_directory=args.dir, run_name="bench", steps=1000)
  sync_cfg = Config.for_testing(**base, async_checkpointing=False)
  run = build_run(sync_cfg)
  setup = run.setup
  state, step_fn, data, rng = run.init_state(0), run.train_step, run.data_iterator(), jax.random.key(0)
  num_params = run.num_params
  state_gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  print(f"state: {num_params / 1e6:.1f}M parameters, {state_gb:.2f} GB with optimizer moments")

  def train(n: int) -> float:
    nonlocal state
    start = time.perf_counter()
    for _ in range(n):
      state, metrics = step_fn(state, next(data), rng)
      jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / n

  train(1)  # compile
  step_s = train(args.steps)

  targets = [("local", args.dir)]
  server = None
  if args.gcs:
    server, bucket = _gcs_bucket()
    targets.append(("gcs", f"{bucket}/bench"))
  try:
    for label, directory in targets:
      _measure_tier(label, directory, base, setup, state, train, step_s, state_gb, args.steps)
    _measure_local_tier(args.dir, setup, state, train, step_s, state_gb, args.steps)
  finally:
    if server is not None:
      server.stop()
  shutil.rmtree(args.dir, ignore_errors=True)


def _gcs_bucket():
  """(server to stop or None, 'gs://bucket') on STORAGE_EMULATOR_HOST or a local fake-gcs-server."""
  import tempfile

  from MaxText.paths import cloud_env
  from tests.gcs_emulator import GcsServer

  server = None
  if not os.environ.get("STORAGE_EMULATOR_HOST"):
    server = GcsServer(Path(tempfile.mkdtemp(prefix="bench-gcs-")) / "data")
    server.start()
    os.environ.update(server.env())
  cloud_env.configure_cloud_env()
  host = os.environ["STORAGE_EMULATOR_HOST"]
  name = server.create_bucket() if server else _create_bucket(host)
  return server, f"gs://{name}"


def _create_bucket(host: str) -> str:
  import json
  import urllib.request
  import uuid

  name = f"bench-{uuid.uuid4().hex[:8]}"
  request = urllib.request.Request(f"{host}/storage/v1/b?project=bench", data=json.dumps({"name": name}).encode(),
                                   headers={"Content-Type": "application/json"}, method="POST")
  urllib.request.urlopen(request, timeout=30).read()
  return name


def _measure_tier(label, directory, base, setup, state, train, step_s, state_gb, steps) -> None:
  import jax

  from MaxText.run_dir import checkpointing
  from MaxText.configuration.config import Config

  sync_cfg = Config.for_testing(**{**base, "base_output_directory": directory}, async_checkpointing=False)
  async_cfg = Config.for_testing(**{**base, "base_output_directory": directory}, async_checkpointing=True)
  checkpoints = checkpointing.RunCheckpoints.for_run(sync_cfg.checkpoint)
  save_s = _timed(lambda: checkpoints.save(1, state, {"step": 1}, {}))
  checkpoints.close()
  restore_s = _timed(lambda: jax.block_until_ready(checkpointing.RunCheckpoints.for_run(sync_cfg.checkpoint).restore_latest(
      setup.abstract_state, setup.state_shardings).state))

  checkpoints = checkpointing.RunCheckpoints.for_run(async_cfg.checkpoint)
  block_s = _timed(lambda: checkpoints.save(2, state, {"step": 2}, {}))
  during_s = train(steps)
  wait_s = _timed(checkpoints.wait)
  checkpoints.close()
  _report(label, state_gb, save_s, restore_s, block_s, wait_s, step_s, during_s, steps)


def _measure_local_tier(root, setup, state, train, step_s, state_gb, steps) -> None:
  import jax

  from MaxText.run_dir.local_checkpoints import LocalTier

  tier = LocalTier(os.path.join(root, "local_tier"), period=1, max_to_keep=2)
  save_s = _timed(lambda: (tier.save(1, state, {"step": 1}, {}), tier.wait()))
  restore_s = _timed(lambda: jax.block_until_ready(
      tier.restore(tier.agreed_step(setup.state_shardings, setup.abstract_state), setup.abstract_state,
                   setup.state_shardings)[0]))
  block_s = _timed(lambda: tier.save(2, state, {"step": 2}, {}))
  during_s = train(steps)
  wait_s = _timed(tier.wait)
  _report("local-tier", state_gb, save_s, restore_s, block_s, wait_s, step_s, during_s, steps)


def _report(label, state_gb, save_s, restore_s, block_s, wait_s, step_s, during_s, steps) -> None:
  print(f"[{label}] sync save: {save_s:.2f} s = {state_gb / save_s:.2f} GB/s; restore: {restore_s:.2f} s = "
        f"{state_gb / restore_s:.2f} GB/s")
  print(f"[{label}] async save: blocks the loop {block_s:.2f} s, then {wait_s:.2f} s more after {steps} steps; "
        f"step time {step_s:.3f} s without a save, {during_s:.3f} s with one in flight "
        f"({100 * (during_s / step_s - 1):+.1f}%)")
  print(f"RESULT target={label} save_gbps={state_gb / save_s:.3f} restore_gbps={state_gb / restore_s:.3f} "
        f"async_block_s={block_s:.3f} step_s={step_s:.3f} step_s_during_async_save={during_s:.3f}", flush=True)


if __name__ == "__main__":
  bench_args.run(main)
