"""DeepSeek Sparse Attention against full MLA attention: one attention layer's training step
(forward + backward) on CPU, tokens/s.

    python3 benchmarks/sparse_attention_bench.py [lengths=4096,16384,65536] [index_topk=2048]
        [base_num_query_heads=4] [index_n_heads=2] [repeats=1] [forms=full,gathered,masked]

One MultiHeadLatentAttention layer (layers/mla.py) of a scaled-down V3.2 shape (model width 128,
4 heads, a 32-wide latent, 16 rotated features, an indexer of 2 heads of 32) over one sequence,
float32, jitted, gradients of its parameters and input; the first (compiling) call is not timed.
Forms: `full` is dense MLA under the chunked flash kernel (attention=flash, what CPU runs at these
lengths); `gathered` and `masked` are the two sparse forms (layers/sparse_attention.py), forced
whatever attention_kernels.SPARSE would pick. The masked form materialises [L, L] scores and is
skipped above 16384 tokens. Prints one Markdown table row per form and length.

    python3 benchmarks/sparse_attention_bench.py aot=v5p-8 [lengths=...]

instead predicts a TPU: a 4-layer DeepSeek-V3.2 model at its published attention shapes (width 7168, 128
heads, MLA with a 512-wide latent, an indexer of 64 heads of 128, top-k 2048; three dense MLPs of 18432 and a
small routed layer of 8 experts of 2048, top-2, the family's layout at a size that fits), one sequence per
chip over FSDP, with `full` dense MLA (index_topk=0) or `sparse` (index_topk=2048, the form the attention
kernel table picks for the length), compiled for the topology by `MaxText.train_compile` and priced by the
step-time model (getting_started/AOT.md): a prediction from the schedule, not a measurement.
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

MASKED_MAX = 16384


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"heads": "base_num_query_heads", "index_heads": "index_n_heads", "topk": "index_topk"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="4096,16384,65536")
  parser.add_argument("--index_topk", type=int, default=2048)
  parser.add_argument("--base_num_query_heads", type=int, default=4)
  parser.add_argument("--index_n_heads", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--forms", default="full,gathered,masked", help="the CPU forms; --aot compiles full and sparse")
  parser.add_argument("--aot", default="", help="a TPU topology (e.g. v5p-8): predict its train step instead")
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  args.lengths = bench_args.numbers("lengths", args.lengths, "4096,16384")
  args.forms = bench_args.names("forms", args.forms, ("full", "gathered", "masked"))
  for key in ("base_num_query_heads", "index_n_heads", "repeats"):
    bench_args.at_least(key, getattr(args, key), 1)
  if args.aot:
    _aot_table(args.aot, args.lengths, args.index_topk)
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from MaxText.configuration.config import Config
  from MaxText.layers import attention_kernels
  from MaxText.platform import sharding
  from MaxText.layers.mla import MultiHeadLatentAttention

  heads = args.base_num_query_heads
  shape = dict(decoder_block="deepseek32", attention_type="mla", base_emb_dim=128, base_num_query_heads=heads,
               base_num_kv_heads=heads, head_dim=48, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
               qk_rope_head_dim=16, v_head_dim=32, index_n_heads=args.index_n_heads, index_head_dim=32,
               dtype="float32", print_config=False, flash_block_q=512, flash_block_kv=512)
  print(f"one MLA layer, width 128, {heads} heads, latent 32, indexer {args.index_n_heads}x32, top-k {args.index_topk}, "
        f"float32, {jax.devices()[0].device_kind}")
  print("| form | tokens | fwd+bwd s | tokens/s |")
  print("| --- | --- | --- | --- |")
  for length in args.lengths:
    x = jax.random.normal(jax.random.key(0), (1, length, 128), jnp.float32)
    positions = jnp.arange(length)[None]
    segments = jnp.ones((1, length), jnp.int32)
    for form in args.forms:
      if form == "masked" and length > MASKED_MAX:
        continue
      topk = 0 if form == "full" else args.index_topk
      cfg = Config.for_testing(**shape, index_topk=topk, max_target_length=length, attention="flash").model
      # Force the form: gathered above 0 x top-k keys, masked never.
      attention_kernels.SPARSE_GATHER_ABOVE = 0 if form == "gathered" else 1 << 30
      with nnx.use_eager_sharding(False):
        graph, params = nnx.split(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)))

      def loss(params: nnx.State, x: jax.Array, graph: nnx.GraphDef = graph) -> jax.Array:
        out = nnx.merge(graph, params)(x, positions, segments)
        assert isinstance(out, jax.Array)
        return out.sum()

      step = jax.jit(sharding.unsharded()(jax.grad(loss, argnums=(0, 1))))
      jax.block_until_ready(step(params, x))
      start = time.perf_counter()
      for _ in range(args.repeats):
        jax.block_until_ready(step(params, x))
      seconds = (time.perf_counter() - start) / args.repeats
      print(f"| {form} | {length} | {seconds:.2f} | {length / seconds:,.0f} |", flush=True)


# V3.2's attention at 4 layers: 3 dense, 1 routed (the smallest routed layer the family's grouped router takes).
AOT_SHAPE = dict(model_name="deepseek3.2-671b", base_num_decoder_layers=4, first_dense_layers=3, num_experts=8,
                 num_experts_per_tok=2, moe_num_groups=1, moe_topk_groups=1, vocab_size=32768, per_device_batch_size=1)


def _aot_table(topology: str, lengths: list[int], topk: int) -> None:
  import aot_layer_table  # noqa: PLC0415  (benchmarks/, beside this script)

  print(f"{topology}, a 4-layer DeepSeek-V3.2 at its attention shapes, one sequence per chip, top-k {topk}; "
        "step-time model predictions from train_compile (not measurements)")
  aot_layer_table.print_table(topology, lengths, ["full", "sparse"], lambda form, length: dict(
      AOT_SHAPE, max_target_length=length, index_topk=0 if form == "full" else topk))


if __name__ == "__main__":
  bench_args.run(main)
