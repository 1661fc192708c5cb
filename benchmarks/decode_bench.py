"""CPU decode latency and throughput of a ~110M-parameter Llama-style model through the engine.

    python3 benchmarks/decode_bench.py [max_prefill_predict_length=128] [steps=32] [slots=1,8]
        [layouts=unrolled,scanned] [repeats=3] [quantize_kvcache=true] [caches=dense,paged]
        [kv_page_size=16] [pool_multiples=1,4,16] [speculative_tokens=4 draft=small]
        [quantize_weights=none,int8,fp8] [quality=true] [response_format=json_schema]

Prefill: one pass over a full prompt of max_prefill_predict_length tokens (batch 1); latency is the median of
repeats runs after a compiling one. Generate: steps jitted steps advancing every slot by one
token, timed after a compiling step; per-token latency is the wall time of one step (all slots
at once), tokens/s counts every slot. Both layer layouts are measured: on CPU the scanned stack
generates about 3x slower (XLA's CPU backend copies each layer's weights out of the stacked
arrays every step; see getting_started/Decode.md), so decode there with scan_layers=False. Random weights
(the speed does not depend on them).
caches also times the paged KV cache (kv_cache_layout=paged, pages of kv_page_size tokens, as many
as the dense cache holds, times each of pool_multiples: a paged step's cost should follow the
tokens its slots hold, not the pool) and prints the cache bytes of a mixed-length workload (8 slots,
max_target_length 1024, prompts of 10..900 tokens with 64 new each) dense vs paged, the pool sized
to the pages the workload holds. The last lines are machine-readable: `RESULT prefill ...`,
`RESULT generate slots=...` and `RESULT memory ...`.
speculative_tokens=k > 0 also times speculative decoding (inference/speculative.py): steps
rounds of k draft steps and one target pass, tokens/s counting every token the slots emitted,
and the acceptance rate (`RESULT speculative ...`). Random weights say nothing about a real
draft's acceptance (with tied embeddings both random models mostly repeat their input token, so
even a small random draft is accepted nearly always): the figure is the cost of a round at the
acceptance measured. draft=small: a 2-layer, width-256 model of the same vocabulary;
draft=self: the target as its own draft (everything accepted, the draft as expensive as the target).
quantize_weights: each listed mode (none = float kernels, int8, fp8) timed in turn, the generate line
also giving the parameters' bytes as the engine holds them (`weight_mib`: the decoder kernels 8-bit
with their scales, the embedding and norms float).
quality=true prints only the quality table of quantize_weights instead (`RESULT quality ...`): a small
random-init model (emb 256, 4 layers, vocab 512) computing in bfloat16 from float32 weights, each
mode against the unquantized engine: the mean KL(float || quantized) of the next-token distributions
and the share of positions whose most probable token agrees, over 32 random sequences of 64 tokens
(the same context for both), and the share of greedy tokens equal to the float engine's over 16
prompts x 32 new tokens (free-running: a sequence counts as equal up to its first difference); and
the same figures for float32 compute against bfloat16, the scale of bfloat16's own rounding.
response_format=json_schema also times constrained decoding (inference/grammar.py) as the server's
scheduler runs it: each step the host writes every slot's token bitmask from its JSON schema
(llguidance, over a byte-level BPE tokenizer trained here to the model's 32000 tokens), the step
masks the logits on the device, the tokens come back and advance each slot's grammar (a finished
reply starts the next). The same loop without the schema (a step, its tokens read back) is the
baseline: `RESULT constrained ... plain_ms=... schema_ms=... host_mask_ms=...` per token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

# ~110M parameters: 12 layers of width 768 (12 heads of 64, SwiGLU MLP 2048), a 32000 vocabulary
# tied to the output projection (24.6M of the total).
MODEL = dict(base_emb_dim=768, base_num_query_heads=12, base_num_kv_heads=12, head_dim=64, base_mlp_dim=2048,
             base_num_decoder_layers=12, vocab_size=32000, logits_via_embedding=True, dtype="float32",
             ici_fsdp_parallelism=1, ici_data_parallelism=-1)


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"prefill": "max_prefill_predict_length", "int8": "quantize_kvcache", "page_size": "kv_page_size"}


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The arguments, every list read and checked: nothing is measured with a bad one."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max_prefill_predict_length", type=int, default=128, help="prompt tokens")
  parser.add_argument("--steps", type=int, default=32, help="generate steps timed")
  parser.add_argument("--slots", default="1,8", help="comma-separated decode batch sizes")
  parser.add_argument("--layouts", default="unrolled,scanned", help="scan_layers=False (unrolled) and/or True")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quantize_kvcache", action="store_true", help="quantize_kvcache=True")
  parser.add_argument("--caches", default="dense", help="kv_cache_layout values to time: dense and/or paged")
  parser.add_argument("--kv_page_size", type=int, default=16, help="kv_page_size of the paged cache")
  parser.add_argument("--pool_multiples", default="1",
                      help="comma-separated paged pool sizes, as multiples of the dense cache's capacity")
  parser.add_argument("--speculative_tokens", type=int, default=0, help="draft tokens per round (0: not timed)")
  parser.add_argument("--draft", default="small", choices=("small", "self"),
                      help="the draft model: a small random one, or the target itself")
  parser.add_argument("--quantize_weights", default="none",
                      help="comma-separated quantize_weights modes to time: none (float kernels), int8, fp8")
  parser.add_argument("--quality", action="store_true", help="only the quantize_weights quality table")
  parser.add_argument("--response_format", default="none", choices=("none", "json_schema"),
                      help="json_schema: also time decoding under a JSON schema (constrained decoding)")
  args = tool_args.parse_args(parser, argv, renamed=RENAMED)
  from MaxText.configuration.decode_config import KV_CACHE_LAYOUTS, WEIGHT_QUANTIZATION_MODES  # noqa: PLC0415
  args.slots = bench_args.numbers("slots", args.slots, "1,8")
  args.layouts = bench_args.names("layouts", args.layouts, ("unrolled", "scanned"))
  args.caches = bench_args.names("caches", args.caches, KV_CACHE_LAYOUTS)
  args.pool_multiples = bench_args.numbers("pool_multiples", args.pool_multiples, "1,2")
  weight_modes = ["none"] + [m for m in WEIGHT_QUANTIZATION_MODES if m]
  args.quantize_weights = bench_args.names("quantize_weights", args.quantize_weights, weight_modes)
  for key in ("max_prefill_predict_length", "steps", "repeats", "kv_page_size"):
    bench_args.at_least(key, getattr(args, key), 1)
  bench_args.at_least("speculative_tokens", args.speculative_tokens, 0)
  return args


def main() -> None:
  args = parse(None)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import numpy as np

  from MaxText.configuration.config import Config

  if args.quality:
    quality()
    return
  prompt = list(np.random.default_rng(0).integers(1, MODEL["vocab_size"], args.max_prefill_predict_length))
  if "paged" in args.caches:
    memory(args)
  for layout in args.layouts:
    for cache in args.caches:
      max_length = args.max_prefill_predict_length + (args.steps + 1) * (args.speculative_tokens + 1) + 2
      for num_slots in args.slots:
        for multiple in (args.pool_multiples if cache == "paged" else [0]):
          for weights in args.quantize_weights:
            pages = multiple * num_slots * -(-max_length // args.kv_page_size)
            overrides = dict(MODEL, scan_layers=layout == "scanned",
                             max_prefill_predict_length=args.max_prefill_predict_length,
                             max_target_length=max_length, per_device_batch_size=1,
                             quantize_kvcache=args.quantize_kvcache, print_config=False, kv_cache_layout=cache,
                             kv_page_size=args.kv_page_size, kv_num_pages=pages,
                             quantize_weights="" if weights == "none" else weights)
            label = f"{layout} cache={cache}" + (f" pool={multiple}x pages={pages}" if cache == "paged" else "")
            label += f" weights={weights}" if args.quantize_weights != ["none"] else ""
            run(overrides, label, num_slots, prompt, args)


QUALITY_MODEL: dict[str, Any] = dict(
    base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64, base_mlp_dim=512, base_num_decoder_layers=4,
    vocab_size=512, dtype="bfloat16", weight_dtype="float32", max_target_length=64, max_prefill_predict_length=16,
    per_device_batch_size=1, print_config=False)


def quality() -> None:
  """quantize_weights against the float engine: logit KL, top-1 agreement, greedy tokens equal."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from MaxText import models
  from MaxText.configuration.config import Config
  from MaxText.inference import quantized_weights
  from MaxText.inference.engine import Engine, Request, serve
  from MaxText.platform import sharding

  vocab = QUALITY_MODEL["vocab_size"]
  tokens = jax.random.randint(jax.random.key(0), (32, 64), 0, vocab)
  positions = jnp.broadcast_to(jnp.arange(64), tokens.shape)
  prompts = [list(map(int, p)) for p in np.random.default_rng(1).integers(0, vocab, (16, 12))]

  def outputs(config: Any, engine: Any, params: Any) -> tuple[Any, list[list[int]]]:
    apply = jax.jit(sharding.unsharded()(models.build_model_spec(config.model).apply))
    logits = apply(params, tokens, positions, jnp.ones_like(tokens))
    served = serve(engine, params, [Request(list(p), 32) for p in prompts])
    return jax.nn.log_softmax(logits.astype(jnp.float32), -1), [r.output for r in served]

  config = Config.for_testing(**QUALITY_MODEL)
  reference = Engine(config, num_slots=16)
  float_params = reference.load_params(seed=0)
  log_p, greedy = outputs(config, reference, float_params)
  print(f"RESULT quality weights=none dtype=bfloat16 weight_mib={quantized_weights.weight_bytes(float_params) / 2**20:.2f}")
  # The last row puts the others in scale: bfloat16's own rounding, float32 compute against bfloat16.
  for mode, dtype in (("int8", "bfloat16"), ("fp8", "bfloat16"), ("", "float32")):
    config = Config.for_testing(**dict(QUALITY_MODEL, dtype=dtype), quantize_weights=mode)
    engine = Engine(config, num_slots=16)
    params = engine.load_params(seed=0)  # the reference's weights, converted as the engine takes them
    log_q, tokens_q = outputs(config, engine, params)
    kl = float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)))
    top1 = float(jnp.mean(jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1)))
    equal = [next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), len(f)) for f, q in zip(greedy, tokens_q)]
    print(f"RESULT quality weights={mode or 'none'} dtype={dtype} "
          f"weight_mib={quantized_weights.weight_bytes(params) / 2**20:.2f} kl={kl:.2e} top1_agreement={top1:.4f} "
          f"greedy_equal={sum(equal) / (32 * len(prompts)):.4f}")


def memory(args: argparse.Namespace) -> None:
  """Cache bytes of a mixed-length workload: dense slots x max_target_length against the pages
  its requests hold at their longest (shapes only, nothing runs)."""
  from MaxText.configuration.config import Config
  from MaxText.inference.engine import Engine

  prompts, new_tokens, max_length = [20, 900, 64, 300, 130, 45, 600, 10], 64, 1024
  pages = sum(-(-(n + new_tokens - 1) // args.kv_page_size) for n in prompts)
  overrides = dict(MODEL, max_target_length=max_length, max_prefill_predict_length=max_length - new_tokens,
                   per_device_batch_size=1, quantize_kvcache=args.quantize_kvcache, print_config=False)
  dense = Engine(Config.for_testing(**overrides), num_slots=len(prompts)).cache_stats()["cache_bytes"]
  paged = Engine(Config.for_testing(**overrides, kv_cache_layout="paged", kv_page_size=args.kv_page_size,
                                    kv_num_pages=pages), num_slots=len(prompts)).cache_stats()["cache_bytes"]
  print(f"RESULT memory slots={len(prompts)} max_target_length={max_length} tokens_cached="
        f"{sum(prompts) + len(prompts) * (new_tokens - 1)} dense_mib={dense / 2**20:.1f} "
        f"paged_mib={paged / 2**20:.1f} pages={pages}x{args.kv_page_size} ratio={paged / dense:.3f}")


def time_decode_calls(engine: Any, params: Any, prefix: Any, num_slots: int, calls: int) -> float:
  """Seconds per `decode_step` call with every slot holding `prefix`, after one compiling call; the
  host reads the tokens only at the end."""
  state = engine.init_decode_state()
  for slot in range(num_slots):
    state = engine.insert(prefix, state, slot)
  state, emitted = engine.decode_step(params, state)  # compile
  emitted.tokens.block_until_ready()
  start = time.perf_counter()
  for _ in range(calls):
    state, emitted = engine.decode_step(params, state)
  emitted.tokens.block_until_ready()
  return (time.perf_counter() - start) / calls


def run(overrides: dict[str, Any], layout: str, num_slots: int, prompt: list[int], args: argparse.Namespace) -> None:
  import jax

  from MaxText.configuration.config import Config
  from MaxText.inference import quantized_weights
  from MaxText.inference.engine import Engine

  config = Config.for_testing(**overrides)
  engine = Engine(config, num_slots=num_slots)
  params = engine.load_params()
  num_params = quantized_weights.parameter_count(params)
  weight_mib = quantized_weights.weight_bytes(params) / 2**20
  times = []
  for i in range(args.repeats + 1):
    start = time.perf_counter()
    prefix = engine.prefill(params, [prompt])
    prefix.first_tokens_B.block_until_ready()
    times.append(time.perf_counter() - start)
  prefill_s = statistics.median(times[1:])
  print(f"model: {num_params / 1e6:.1f}M parameters, {jax.device_count()} CPU device(s), "
        f"kv cache {'int8' if args.quantize_kvcache else config.model.dtype}; compile+first prefill {times[0]:.2f} s")
  print(f"RESULT prefill layout={layout} tokens={args.max_prefill_predict_length} latency_ms={prefill_s * 1e3:.1f} "
        f"tokens_per_s={args.max_prefill_predict_length / prefill_s:.1f}")

  step_s = time_decode_calls(engine, params, prefix, num_slots, args.steps)
  assert engine.metrics()["step_compilations"] == 1
  print(f"RESULT generate layout={layout} slots={num_slots} per_token_ms={step_s * 1e3:.2f} "
        f"tokens_per_s={num_slots / step_s:.1f} weight_mib={weight_mib:.1f} "
        f"(context {args.max_prefill_predict_length}..{args.max_prefill_predict_length + args.steps})")
  if args.speculative_tokens > 0:
    speculate(overrides, engine, params, layout, num_slots, prompt, args)
  if args.response_format == "json_schema":
    constrained(engine, params, prefix, layout, num_slots, args)


# A schema like a tool's arguments: nested objects, an enum, an array, numbers and short strings.
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "array", "items": {"type": "object", "properties": {
        "day": {"type": "integer", "minimum": 1, "maximum": 31}, "high": {"type": "number"}},
        "required": ["day", "high"], "additionalProperties": False}, "maxItems": 4}},
    "required": ["city", "unit", "days"], "additionalProperties": False}


def bench_tokenizer(vocab_size: int) -> Any:
  """A `tokenizers` tokenizer of `vocab_size` tokens: byte-level BPE trained on random words."""
  import numpy as np
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  rng = np.random.default_rng(0)
  letters = list("abcdefghijklmnopqrstuvwxyz")
  words = ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(40000)]
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator([" ".join(words[i:i + 50]) for i in range(0, len(words), 50)] * 2,
                                trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tokenizer


def constrained(engine: Any, params: Any, prefix: Any, layout: str, num_slots: int, args: argparse.Namespace) -> None:
  import jax
  import numpy as np

  from MaxText.inference import grammar, sampling

  vocab = MODEL["vocab_size"]
  schema = grammar.Compiler(bench_tokenizer(vocab), vocab, eos_ids=[0]).json_schema(SCHEMA)

  def loop(masked: bool) -> tuple[float, float]:
    """(seconds per step, of which the host's masks and grammar advances)."""
    state = engine.init_decode_state()
    for slot in range(num_slots):
      state = engine.insert(prefix, state, slot)
    slots = [schema.constraint() for _ in range(num_slots)]
    mask = np.full((num_slots, sampling.mask_words(vocab)), sampling.ALL_TOKENS, np.int32)
    start = host = 0.0
    for step in range(args.steps + 1):
      if step == 1:  # step 0 compiled
        start, host = time.perf_counter(), 0.0
      began = time.perf_counter()
      for i, constraint in enumerate(slots if masked else []):
        constraint.fill(mask[i])
      host += time.perf_counter() - began
      state, out = engine.decode_step(params, state, mask=mask if masked else None)
      tokens = np.asarray(jax.device_get(out.tokens))
      began = time.perf_counter()
      for i, constraint in enumerate(slots if masked else []):
        if constraint.advance(int(tokens[i])):
          slots[i] = schema.constraint()
      host += time.perf_counter() - began
    return (time.perf_counter() - start) / args.steps, host / args.steps

  plain_s, _ = loop(masked=False)
  schema_s, host_s = loop(masked=True)
  print(f"RESULT constrained layout={layout} slots={num_slots} plain_ms={plain_s * 1e3:.2f} "
        f"schema_ms={schema_s * 1e3:.2f} host_mask_ms={host_s * 1e3:.2f} overhead={schema_s / plain_s - 1:+.1%}")


def speculate(overrides: dict[str, Any], target: Any, target_params: Any, layout: str, num_slots: int,
              prompt: list[int], args: argparse.Namespace) -> None:
  import numpy as np

  from MaxText.configuration.config import Config
  from MaxText.inference.engine import Engine
  from MaxText.inference.speculative import SpeculativeDecoder
  from MaxText.inference.speculative_engine import SpeculativeEngine

  if args.draft == "self":
    draft, draft_params = target, target_params
  else:
    small = dict(overrides, base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, base_mlp_dim=512,
                 base_num_decoder_layers=2)
    draft = Engine(Config.for_testing(**small), num_slots=num_slots)
    draft_params = draft.load_params(seed=1)
  engine = SpeculativeEngine(SpeculativeDecoder(target, draft, args.speculative_tokens))
  params = (target_params, draft_params)
  prefix = engine.prefill(params, [prompt])
  state = engine.init_decode_state()
  for slot in range(num_slots):
    state = engine.insert(prefix, state, slot)
  state, _ = engine.decode_step(params, state)  # compile
  before = engine.metrics()  # the timed rounds' acceptance only
  emitted = 0
  start = time.perf_counter()
  for _ in range(args.steps):
    state, out = engine.decode_step(params, state)  # counts come back to the host
    emitted += int(np.sum(out.counts))
  round_s = (time.perf_counter() - start) / args.steps
  after = engine.metrics()
  proposed = after["proposed"] - before["proposed"]
  metrics = {"acceptance_rate": (after["accepted"] - before["accepted"]) / proposed if proposed else 0.0}
  print(f"RESULT speculative layout={layout} slots={num_slots} k={args.speculative_tokens} draft={args.draft} "
        f"round_ms={round_s * 1e3:.2f} tokens_per_s={emitted / args.steps / round_s:.1f} "
        f"acceptance_rate={metrics['acceptance_rate']:.3f}")


if __name__ == "__main__":
  bench_args.run(main)
