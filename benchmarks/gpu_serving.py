"""The GPU suite's decode, serving and multi-LoRA rows (benchmarks/gpu_suite.py runs them in one child).

- decode: the engine's generate step for each (slots, decode_steps_per_call, quantize_weights) of the
  spec, after one prompt; the time per step (a call's time over its steps), tokens/s, and the
  weight-read bound: the decode step's weight bytes at the GPU's published HBM bandwidth
  (MaxText/aot/step_time/gpu.py), with the step over that bound;
- serve: the OpenAI-compatible server (benchmarks/serve_bench.py's app and streaming clients) at each
  concurrency, output tokens/s and the median time to first token;
- lora: the server's scheduler (no HTTP, as benchmarks/lora_bench.py) with random PEFT adapters loaded
  beside the base model: every request on the base row, on one adapter, and on all of them in turn
  (each batch mixing them); output tokens/s.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def decode_row(overrides: dict[str, Any], slots: int, steps_per_call: int, quant: str, prompt_len: int,
               steps: int, layers: str = "") -> dict[str, Any]:
  """The engine's decode step time; `layers` "unrolled" sets scan_layers=False (a scanned stack may read
  each layer's weights out of the stacked arrays as a copy per step, as XLA's CPU backend does)."""
  import decode_bench  # noqa: E402  (its timed decode calls)
  import jax
  import numpy as np

  from MaxText.configuration.config import Config
  from MaxText.inference import quantized_weights
  from MaxText.inference.engine import Engine

  calls = max(1, steps // steps_per_call)
  config = Config.for_testing(**dict(
      overrides, max_prefill_predict_length=prompt_len, max_target_length=prompt_len + (calls + 1) * steps_per_call + 2,
      per_device_batch_size=1, decode_steps_per_call=steps_per_call, quantize_weights=quant,
      **({"scan_layers": False} if layers == "unrolled" else {})))
  engine = Engine(config, num_slots=slots)
  params = engine.load_params()
  prompt = [int(t) for t in np.random.default_rng(0).integers(3, config.model.vocab_size, prompt_len)]
  prefix = engine.prefill(params, [prompt])
  step_s = decode_bench.time_decode_calls(engine, params, prefix, slots, calls) / steps_per_call
  return dict(slots=slots, steps_per_call=steps_per_call, quant=quant or "bf16", step_s=step_s,
              layers="scanned" if config.model.scan_layers else "unrolled",
              tokens_per_s=slots / step_s, weight_bytes=quantized_weights.weight_bytes(params),
              params_m=sum(x.size for x in jax.tree.leaves(params)) / 1e6, device_kind=jax.devices()[0].device_kind)


def serve_rows(overrides: dict[str, Any], concurrencies: list[int], max_tokens: int, prompt_lengths: list[int],
               requests_per_client: int) -> list[dict[str, Any]]:
  import serve_bench  # noqa: E402  (its tokenizer, in-process server and streaming clients)

  from MaxText.configuration.config import Config

  prompt_vocab = 512  # the tokenizer's; the model's own vocabulary may be larger
  tokenizer = serve_bench._tokenizer(Path(tempfile.mkdtemp()) / "tok", prompt_vocab)
  config = Config.for_testing(**dict(
      overrides, max_target_length=max(prompt_lengths) + max_tokens, max_prefill_predict_length=max(prompt_lengths),
      tokenizer_type="huggingface", tokenizer_path=str(tokenizer), add_bos=False, print_config=False,
      serve_max_slots=max(concurrencies), serve_max_queue=4 * max(concurrencies) * requests_per_client,
      serve_max_tokens=max_tokens, serve_model_name="bench"))
  server, uv, thread, url = serve_bench.start_server(config)
  asyncio.run(serve_bench._round(url, 2, 2, 4, prompt_lengths, prompt_vocab))  # compiles, untimed
  rows = []
  for concurrency in concurrencies:
    n = concurrency * requests_per_client
    t = asyncio.run(serve_bench._round(url, concurrency, n, max_tokens, prompt_lengths, prompt_vocab))
    rows.append(dict(concurrency=concurrency, requests=n, tokens_per_s=t["tokens"] / t["wall"],
                     ttft_p50_ms=1e3 * statistics.median(t["ttft"]), tokens=t["tokens"]))
  uv.should_exit = True
  thread.join(30)
  server.scheduler.stop()
  return rows


def random_adapters(root: Path, overrides: dict[str, Any], rank: int, count: int) -> list[Path]:
  """`count` random PEFT adapters (rank `rank` on every attention and MLP projection) of the model
  `overrides` describe; only the adapters' leaves are drawn, so a 1B model costs megabytes."""
  import jax
  import numpy as np

  import lora_bench  # noqa: E402  (the projections it adapts)

  from MaxText import models
  from MaxText.configuration.config import Config
  from MaxText.convert import peft_adapters
  from MaxText.training import lora

  config = Config.for_testing(**overrides, lora_rank=rank, lora_alpha=2.0 * rank,
                              lora_target_modules=",".join(lora_bench.TARGETS))
  adapters, _ = lora.split(models.build_model_spec(config.model).abstract_params)
  out = []
  for i in range(count):
    rng = np.random.default_rng(i)
    drawn = jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(x.dtype), adapters)
    peft_adapters.save(str(root / f"a{i}"), drawn, config.model)
    out.append(root / f"a{i}")
  return out


def lora_rows(overrides: dict[str, Any], slots: int, requests: int, count: int, rank: int, prompt_len: int,
              max_tokens: int) -> list[dict[str, Any]]:
  import lora_bench  # noqa: E402  (its timed scheduler run)

  from MaxText.configuration.config import Config
  from MaxText.inference import lora_adapters

  keys = dict(overrides, max_target_length=prompt_len + max_tokens + 1, max_prefill_predict_length=prompt_len,
              print_config=False)
  paths = random_adapters(Path(tempfile.mkdtemp()), keys, rank, count)
  config = Config.for_testing(**keys, serve_max_slots=slots,
                              serve_lora_adapters=",".join(f"a{i}={p}" for i, p in enumerate(paths)))
  engine, registry = lora_adapters.load_engine(config, slots, "", "base")
  rows = []
  for label, adapter_rows in (("base model only", [0] * requests), ("1 adapter", [1] * requests),
                              (f"{count} adapters mixed", [1 + i % count for i in range(requests)])):
    lora_bench._run(engine, registry.params, adapter_rows, prompt_len, max_tokens)  # compiles, untimed
    rate = lora_bench._run(engine, registry.params, adapter_rows, prompt_len, max_tokens)
    rows.append(dict(label=label, adapters=len(set(adapter_rows) - {0}), slots=slots, requests=requests,
                     tokens_per_s=rate))
  return rows


def child(spec: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
  decode = [decode_row(spec["overrides"], slots, k, quant, spec["prompt_len"], spec["decode_steps"], *layers)
            for slots, k, quant, *layers in spec["decode"]]
  serve = serve_rows(dict(spec["overrides"], decode_steps_per_call=spec["serve_steps_per_call"]),
                     spec["concurrency"], spec["max_tokens"], spec["prompt_lengths"], spec["requests_per_client"])
  lora = lora_rows(spec["overrides"], **spec["lora"]) if spec.get("lora") else []
  emit(dict(decode=decode, serve=serve, lora=lora))


def spec_for(dry: bool, model_name: str) -> tuple[dict[str, Any], str]:
  """The child's spec and the model's label: tiny on a dry run, else `model_name` in bfloat16."""
  if dry:
    tiny = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                base_num_decoder_layers=2, vocab_size=1024, dtype="float32", scan_layers=False)
    # One decode engine covers both new paths (several steps per call, int8 weights); each costs a compile.
    return dict(overrides=tiny, decode=[(8, 4, "int8", "unrolled")], prompt_len=16, decode_steps=8, concurrency=[1, 8, 32],
                max_tokens=4, prompt_lengths=[8, 16], requests_per_client=1, serve_steps_per_call=4,
                lora=dict(slots=4, requests=4, count=2, rank=4, prompt_len=8, max_tokens=4)), "tiny"
  # (slots, steps per call, quantize_weights[, "unrolled"]): the unrolled row tells whether a scanned stack's step
  # copies each layer's weights on this backend.
  decode = [(1, 8, ""), (8, 8, ""), (32, 8, ""), (8, 1, ""), (8, 8, "int8"), (8, 8, "fp8"), (8, 8, "", "unrolled")]
  return dict(overrides=dict(model_name=model_name, dtype="bfloat16", weight_dtype="bfloat16"), decode=decode,
              prompt_len=128, decode_steps=64, concurrency=[1, 8, 32, 64], max_tokens=64, prompt_lengths=[64, 128],
              requests_per_client=2, serve_steps_per_call=8,
              lora=dict(slots=32, requests=64, count=4, rank=16, prompt_len=64, max_tokens=64)), "1b"


def table_rows(spec: dict[str, Any], label: str, r: dict[str, Any] | None, status: str, hbm: float | None,
               dry: bool) -> list[dict[str, str]]:
  """The table's decode, serve and lora rows (each a failure note where the child gave nothing)."""
  names = [("decode", f"slots {s}, {k} steps per call, {q or 'bf16'} weights{', unrolled layers' if rest else ''}")
           for s, k, q, *rest in spec["decode"]] + \
      [("serve", f"clients {c}") for c in spec["concurrency"]] + ([("lora", "adapters")] if spec.get("lora") else [])
  if not r:
    return [dict(section=s, impl="ours", model=label, note=f"{status}; {n}") for s, n in names]
  rows = []
  for d in r["decode"]:
    bound_s = d["weight_bytes"] / hbm if hbm else None
    over = f"; {d['step_s'] / bound_s:.2f}x the weight-read bound ({bound_s * 1e3:.3g} ms)" if bound_s else ""
    rows.append({"section": "decode", "impl": "ours", "model": label, "params": f"{d['params_m']:.3g}M",
                 "quant": d["quant"] if not dry or d["quant"] != "bf16" else "f32", "batch": str(d["slots"]),
                 "seq": str(spec["prompt_len"]), "step ms": f"{d['step_s'] * 1e3:.3f}",
                 "tokens/s": f"{d['tokens_per_s']:.0f}",
                 "note": f"engine, {d['steps_per_call']} steps per call, {d['layers']} layers, {spec['decode_steps']} "
                         f"steps after a {spec['prompt_len']}-token prompt{over}"})
  quant = "f32" if dry else "bf16"
  for s in r["serve"]:
    rows.append({"section": "serve", "impl": "ours", "model": label, "quant": quant, "batch": str(s["concurrency"]),
                 "seq": "/".join(map(str, spec["prompt_lengths"])), "tokens/s": f"{s['tokens_per_s']:.0f}",
                 "note": f"{s['concurrency']} clients, {s['requests']} requests x {spec['max_tokens']} tokens, "
                         f"{spec['serve_steps_per_call']} steps per call, TTFT p50 {s['ttft_p50_ms']:.0f} ms"})
  for row in r.get("lora", []):
    rows.append({"section": "lora", "impl": "ours", "model": label, "quant": quant, "batch": str(row["slots"]),
                 "tokens/s": f"{row['tokens_per_s']:.0f}",
                 "note": f"{row['label']}: {row['requests']} requests at once, scheduler without HTTP"})
  return rows
