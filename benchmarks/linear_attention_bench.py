"""Gated DeltaNet (Qwen3-Next's linear attention) against full attention, one layer on CPU: a training
step's tokens/s, and a decode step's milliseconds with the recurrent state against a KV cache.

    python3 benchmarks/linear_attention_bench.py [lengths=4096,16384,65536] [layers=linear,full]
        [repeats=1] [decode_steps=20] [train=false] [decode=false]

A scaled-down Qwen3-Next shape, float32, one sequence, jitted; the first (compiling) call is not timed.
- `linear`: one GatedDeltaNet layer (layers/gated_deltanet.py): width 128, 2 key heads and 4 value
  heads of 32, a width-4 conv, chunks of 64 tokens (the training and prefill form).
- `full`: one gated full-attention layer of the same family (4 query heads, 2 KV heads of 32) under
  the chunked flash kernel (attention=flash, what CPU runs at these lengths).
Training: forward + backward (gradients of the parameters and the input) over `length` tokens.
Decode: one new token per call at position `length`, the linear layer stepping its recurrent state,
the full layer attending over a KV cache of `length + 1` rows; the median of `decode_steps` calls.
Prints one Markdown table row per layer and length.

    python3 benchmarks/linear_attention_bench.py aot=v5p-8 [lengths=...] [layers=...]

instead predicts a TPU: a 4-layer model at Qwen3-Next's shapes (width 2048; DeltaNet 16 key and 32 value heads
of 128 in chunks of 64, or gated full attention with 16 query and 2 KV heads of 256 under splash; a dense SwiGLU
MLP of 5120), every layer one kind, one sequence per chip over FSDP, is compiled for the topology by
`MaxText.train_compile`, and the step-time model (getting_started/AOT.md) prices the compiled train step: a
prediction from the schedule, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

SHAPE = dict(decoder_block="qwen3_next", base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=2, head_dim=32,
             attention_output_gate=True, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=32, linear_conv_kernel_dim=4, linear_attention_chunk_size=64, dtype="float32",
             print_config=False, flash_block_q=512, flash_block_kv=512, attention="flash")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="4096,16384,65536")
  parser.add_argument("--layers", default="linear,full")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--decode_steps", type=int, default=20)
  parser.add_argument("--train", action="store_false", help="false: leave out the train step")
  parser.add_argument("--decode", action="store_false", help="false: leave out the decode step")
  parser.add_argument("--aot", default="", help="a TPU topology (e.g. v5p-8): predict its train step instead")
  args = tool_args.parse_args(parser, None, renamed={"no_train": "train", "no_decode": "decode"})
  args.lengths = bench_args.numbers("lengths", args.lengths, "4096,16384")
  args.layers = bench_args.names("layers", args.layers, ("linear", "full"))
  bench_args.at_least("repeats", args.repeats, 1)
  bench_args.at_least("decode_steps", args.decode_steps, 1)
  if args.aot:
    _aot_table(args.aot, args.lengths, args.layers)
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax

  print(f"one layer, width 128, float32, {jax.devices()[0].device_kind}; linear: 2 key / 4 value heads of 32, "
        "chunks of 64; full: 4 query / 2 KV heads of 32, flash")
  print("| layer | tokens | train fwd+bwd s | train tokens/s | decode ms/token at this context |")
  print("| --- | --- | --- | --- | --- |")
  for length in args.lengths:
    for layer in args.layers:
      train = _train_seconds(layer, length, args.repeats) if args.train else None
      decode = _decode_seconds(layer, length, args.decode_steps) if args.decode else None
      cells = [f"{train:.2f}" if train else "", f"{length / train:,.0f}" if train else "",
               f"{1e3 * decode:.3f}" if decode else ""]
      print(f"| {layer} | {length} | " + " | ".join(cells) + " |", flush=True)


AOT_SHAPE = dict(decoder_block="qwen3_next", base_emb_dim=2048, base_num_query_heads=16, base_num_kv_heads=2,
                 head_dim=256, base_mlp_dim=5120, base_num_decoder_layers=4, num_experts=1, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, linear_attention_chunk_size=64, per_device_batch_size=1)


def _aot_table(topology: str, lengths: list[int], layers: list[str]) -> None:
  import aot_layer_table  # noqa: PLC0415  (benchmarks/, beside this script)

  print(f"{topology}, 4 layers of one kind at Qwen3-Next's shapes, one sequence per chip; step-time model "
        "predictions from train_compile (not measurements)")
  aot_layer_table.print_table(topology, lengths, layers, lambda layer, length: dict(
      AOT_SHAPE, max_target_length=length, attention_type="gated_deltanet" if layer == "linear" else "gqa"),
      form_column="layer")


def _layer(kind: str, length: int):  # -> (the module, its config)
  from flax import nnx

  from MaxText.configuration.config import Config
  from MaxText.layers.attention import Attention
  from MaxText.layers.gated_deltanet import GatedDeltaNet

  attention_type = "gated_deltanet" if kind == "linear" else "gqa"
  config = Config.for_testing(**SHAPE, attention_type=attention_type, max_target_length=length + 8,
                              max_prefill_predict_length=8).model
  with nnx.use_eager_sharding(False):
    module = GatedDeltaNet(config, rngs=nnx.Rngs(0)) if kind == "linear" else Attention(config, rngs=nnx.Rngs(0))
  return module, config


def _train_seconds(kind: str, length: int, repeats: int) -> float:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from MaxText.platform import sharding

  module, _ = _layer(kind, length)
  graph, params = nnx.split(module)
  x = jax.random.normal(jax.random.key(0), (1, length, 128), jnp.float32)
  positions, segments = jnp.arange(length)[None], jnp.ones((1, length), jnp.int32)

  def loss(params: nnx.State, x: jax.Array) -> jax.Array:
    out = nnx.merge(graph, params)(x, positions, segments)
    assert isinstance(out, jax.Array)
    return out.sum()

  step = jax.jit(sharding.unsharded()(jax.grad(loss, argnums=(0, 1))))
  jax.block_until_ready(step(params, x))
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(step(params, x))
  return (time.perf_counter() - start) / repeats


def _decode_seconds(kind: str, length: int, steps: int) -> float:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from MaxText.layers import gated_deltanet, kv_cache
  from MaxText.platform import sharding

  module, config = _layer(kind, length)
  graph, params = nnx.split(module)
  # The state a prompt of `length` tokens leaves: its values do not change the step's cost.
  cache = (gated_deltanet.empty_state(config, 1) if kind == "linear"
           else kv_cache.layer_cache(config, 1, length + 8))
  x = jax.random.normal(jax.random.key(1), (1, 1, 128), jnp.float32)
  positions, segments = jnp.full((1, 1), length, jnp.int32), jnp.ones((1, 1), jnp.int32)

  def one_token(params: nnx.State, cache, x: jax.Array):  # noqa: ANN001, ANN202
    return nnx.merge(graph, params)(x, positions, segments, cache=cache)

  step = jax.jit(sharding.unsharded()(one_token))
  jax.block_until_ready(step(params, cache, x))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step(params, cache, x))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


if __name__ == "__main__":
  bench_args.run(main)
